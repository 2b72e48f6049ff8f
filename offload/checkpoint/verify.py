"""Reading a checkpoint without an optimizer or model: its manifest, a full verification, a summary."""

from __future__ import annotations

import errno as _errno
import json
import os
from typing import Sequence

import xxhash

from ..aio import Engine
from ..errors import CheckpointError, ChecksumError
from .commit import reading
from .format import (
    EXTRA,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    MEMORY,
    MODEL_MEMORY,
    PARAMS_DATA,
    _check_data_digest,
    _check_data_size,
    _check_digest,
    _check_file_hash,
    _io_error,
    _manifest_digest,
    _read_torch,
)
from .model import _verify_model
from .stream import _aio_of, _stream, _tool_pool


def read_manifest(directory: str | os.PathLike) -> dict:
    """The manifest of a checkpoint, checked for completeness and its own checksum.

    Read under :func:`offload.checkpoint.commit.reading`: it waits for a save into the same parent
    directory in progress, and puts back a checkpoint that a save which died between its two
    renames left aside. To read the rest of the checkpoint consistently with this manifest, hold
    ``reading(directory)`` around the whole read.

    Raises:
        FileNotFoundError: no such directory.
        CheckpointError: not a (complete) checkpoint, or a format this version cannot read.
    """
    directory = os.path.abspath(os.fspath(directory))
    with reading(directory):
        if not os.path.isdir(directory):
            raise FileNotFoundError(_errno.ENOENT, "no checkpoint directory", directory)
        path = os.path.join(directory, MANIFEST)
        try:
            with open(path, "rb") as f:
                text = f.read()
        except FileNotFoundError:
            raise CheckpointError(f"{directory} is not a complete checkpoint (no {MANIFEST}); a save that did "
                                  "not finish leaves only temporary directories, so this was never one") from None
        except OSError as err:
            raise _io_error(err, path, "cannot read") from err
    try:
        manifest = json.loads(text)
    except ValueError as err:
        raise ChecksumError(f"{path} is not valid JSON ({err}); the checkpoint is corrupt") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not an nvme-offload checkpoint manifest")
    if manifest.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{path} has format version {manifest.get('version')}; this library reads "
                              f"version {FORMAT_VERSION}")
    found = _manifest_digest(manifest)
    if found != manifest.get("manifest_xxh3_64"):
        raise ChecksumError(f"{path}: xxh3_64 of its content is {found}, it records "
                            f"{manifest.get('manifest_xxh3_64')}; the manifest is corrupt")
    return manifest


def _verify_data(directory: str, manifest: dict, engine: Engine, buffers: Sequence) -> None:
    """Read state.bin once and check every unit's checksum and the file's.

    Units larger than the buffers are read in parts (e.g. loading into an optimizer with smaller
    buffers than the one that saved).
    """
    path = _check_data_size(directory, manifest)
    whole = xxhash.xxh3_64()
    units = manifest["units"]
    size = buffers[0].nbytes
    parts = [(u, off, min(size, unit["length"] - off))
              for u, unit in enumerate(units) for off in range(0, unit["length"], size)]
    hashes = [xxhash.xxh3_64() for _ in units]
    with engine.open(path, "r") as f:
        def read(part, buf):
            u, off, n = part
            return engine.read_async(f, buf, units[u]["offset"] + off, n)

        def process(part, buf):
            u, off, n = part
            data = buf.tensor[:n].numpy()
            hashes[u].update(data)
            whole.update(data)
            if off + n == units[u]["length"]:
                _check_digest(manifest, path, u, hashes[u].hexdigest())
            return False

        _stream(parts, list(buffers), read=read, process=process)
    _check_data_digest(manifest, path, whole.hexdigest())


def verify_checkpoint(directory: str | os.PathLike) -> dict:
    """Check a checkpoint's manifest, every file's size and checksum, every unit's checksum and, with
    a model, every parameter's checksum in params.bin.

    Returns:
        The manifest.

    Raises:
        FileNotFoundError: no such directory.
        CheckpointError: incomplete or unreadable; ``ChecksumError`` names the first bad file and
            byte range (and the parameters whose state it holds, or the model parameter).
        OSError: the data could not be read.
    """
    directory = os.path.abspath(os.fspath(directory))
    with reading(directory):  # no save replaces it while its files are read one by one
        manifest = read_manifest(directory)
        _verify_files(directory, manifest)
    return manifest


def _verify_files(directory: str, manifest: dict) -> None:
    """Check every file ``manifest`` lists in ``directory`` (sizes, checksums, every unit and parameter);
    the data files are read with the native engine (O_DIRECT: from the drive, not the page cache)."""
    if EXTRA in manifest["files"]:
        _check_file_hash(directory, EXTRA, manifest["files"][EXTRA])
    if MEMORY in manifest["files"]:
        _read_torch(directory, MEMORY, manifest["files"][MEMORY])
        with _tool_pool(manifest) as pool:
            engine = Engine(_aio_of(manifest))
            try:
                _verify_data(directory, manifest, engine, list(pool))
            finally:
                engine.close()
    if "model" in manifest:
        _verify_model(directory, manifest, _aio_of(manifest))


def inspect_checkpoint(directory: str | os.PathLike) -> str:
    """A human-readable summary of a checkpoint's manifest (no data is read)."""
    m = read_manifest(directory)  # under reading(): the manifest is all it reads
    offloaded = [e for e in m["params"] if e.get("where") == "swap" and e.get("initialized")]
    in_memory = [e for e in m["params"] if e.get("where") == "memory"]
    lines = [
        f"checkpoint: {os.path.abspath(os.fspath(directory))}",
        f"format: {m['format']} v{m['version']} (library {m.get('library_version')}, torch {m.get('torch_version')})",
    ]
    if m.get("optimizer") is None:
        lines.append(f"created: {m.get('created')}   optimizer: none (model weights only)")
    else:
        lines += [
            f"created: {m.get('created')}   optimizer: {m.get('optimizer')}   step: {m.get('step')}"
            + (f" (steps {m['steps']})" if len(m.get("steps", [])) > 1 else ""),
            f"parameters: {len(m['params'])} ({len(offloaded)} with state on disk, {len(in_memory)} in memory, "
            f"{len(m['params']) - len(offloaded) - len(in_memory)} without state)",
            f"units: {len(m['units'])} of up to {m.get('buffer_size')} bytes",
        ]
    if "model" in m:
        tensors = m["model"]["tensors"]
        on_disk = [e for e in tensors if e.get("where") == PARAMS_DATA]
        tied = [e for e in tensors if "same_as" in e]
        lines.append(f"model: {len(tensors)} tensors ({len(on_disk)} offloaded parameters in {PARAMS_DATA}, "
                     f"{sum(e['length'] for e in on_disk)} bytes; {len(tensors) - len(on_disk) - len(tied)} in "
                     f"{MODEL_MEMORY}; {len(tied)} tied names)")
    for gi, g in enumerate(m["param_groups"]):
        hyper = ", ".join(f"{k}={g[k]}" for k in ("lr", "betas", "eps", "weight_decay", "amsgrad",
                                                   "decoupled_weight_decay") if k in g)
        lines.append(f"group {gi}: {len(g['params'])} params; {hyper}")
    for name, f in sorted(m["files"].items()):
        lines.append(f"file {name}: {f['bytes']} bytes, xxh3_64 {f['xxh3_64']}")
    return "\n".join(lines)
