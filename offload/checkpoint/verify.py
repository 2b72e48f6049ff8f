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
    JOB_FORMAT,
    JOB_VERSION,
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
from .manifest import check_manifest
from .model import _verify_model
from .ownership import parse_manifest, shard_manifest_name
from .stream import _aio_of, _stream, _tool_pool


def read_manifest(directory: str | os.PathLike) -> dict:
    """The manifest of a checkpoint, checked for completeness and its own checksum.

    A job's checkpoint (saved by every rank of a torch.distributed job) has one per rank's shard,
    in ``directory/rank-<n>``; read them there (:func:`read_job_manifest` reads the job's).

    Read under :func:`offload.checkpoint.commit.reading`: it waits for a save into the same parent
    directory in progress, and puts back a checkpoint that a save which died between its two
    renames left aside. To read the rest of the checkpoint consistently with this manifest, hold
    ``reading(directory)`` around the whole read.

    Raises:
        FileNotFoundError: no such directory.
        CheckpointError: not a (complete) checkpoint, or a format this version cannot read, or the
            checkpoint of a job (the message says how to load it).
    """
    manifest = _read_manifest(directory)
    if manifest.get("format") == JOB_FORMAT:
        raise CheckpointError(_world_mismatch(os.path.abspath(os.fspath(directory)), manifest, 1))
    return manifest


def read_job_manifest(directory: str | os.PathLike) -> dict:
    """The job manifest of a checkpoint saved by every rank of a torch.distributed job, checked for
    completeness and its own checksum: world size, and per rank its shard's name, manifest checksum
    and files (see ``docs/checkpoint.md``, "Saves of a job").

    Raises:
        FileNotFoundError: no such directory.
        CheckpointError: not a (complete) checkpoint of a job.
    """
    manifest = _read_manifest(directory)
    if manifest.get("format") != JOB_FORMAT:
        raise CheckpointError(f"{os.path.abspath(os.fspath(directory))} is the checkpoint of one process, not "
                              "of a job (read it with read_manifest)")
    return manifest


def _read_manifest(directory: str | os.PathLike) -> dict:
    """:func:`read_manifest` of a process's checkpoint or :func:`read_job_manifest` of a job's."""
    directory = os.path.abspath(os.fspath(directory))
    with reading(directory):
        if not os.path.isdir(directory):
            raise FileNotFoundError(_errno.ENOENT, "no checkpoint directory", directory)
        path = os.path.join(directory, _manifest_name(directory))
        try:
            with open(path, "rb") as f:
                text = f.read()
        except FileNotFoundError:
            raise CheckpointError(f"{directory} is not a complete checkpoint (no {MANIFEST}); a save commits by "
                                  f"writing its {MANIFEST} last, so no save of ours finished here") from None
        except OSError as err:
            raise _io_error(err, path, "cannot read") from err
    try:
        manifest = json.loads(text)
    except ValueError as err:
        raise ChecksumError(f"{path} is not valid JSON ({err}); the checkpoint is corrupt") from None
    if not isinstance(manifest, dict) or manifest.get("format") not in (FORMAT, JOB_FORMAT):
        raise CheckpointError(f"{path} is not an nvme-offload checkpoint manifest")
    version = JOB_VERSION if manifest["format"] == JOB_FORMAT else FORMAT_VERSION
    if manifest.get("version") != version:
        raise CheckpointError(f"{path} has format version {manifest.get('version')}; this library reads "
                              f"version {version}")
    found = _manifest_digest(manifest)
    if found != manifest.get("manifest_xxh3_64"):
        raise ChecksumError(f"{path}: xxh3_64 of its content is {found}, it records "
                            f"{manifest.get('manifest_xxh3_64')}; the manifest is corrupt")
    check_manifest(manifest, path)
    return manifest


def _manifest_name(directory: str) -> str:
    """The name of ``directory``'s manifest: a job's shard has the one its job manifest names (a save
    writes it under the job's generation), anything else ``manifest.json``."""
    parent, name = os.path.split(directory)
    job = parse_manifest(parent)
    if isinstance(job, dict) and job.get("format") == JOB_FORMAT and isinstance(job.get("shards"), list):
        for entry in job["shards"]:
            if isinstance(entry, dict) and entry.get("name") == name:
                found = shard_manifest_name(entry)
                if isinstance(found, str) and os.path.basename(found) == found and found:
                    return found
    return MANIFEST


def _world_mismatch(directory: str, job: dict, world: int) -> str:
    """Why a job's checkpoint does not load into a job of ``world`` ranks, and how to convert it."""
    saved = job["world_size"]
    here = "this process runs alone" if world == 1 else f"this job has {world} ranks"
    shard = os.path.join(directory, job["shards"][0]["name"])
    return (f"checkpoint {directory} was saved by a job of {saved} ranks (one shard per rank) and {here}; a job's "
            f"checkpoint loads only into a job of the same size. Load it on every rank of a job of {saved} "
            "ranks (each rank finds its own shard). To go on with another number of ranks: where every rank "
            f"holds the whole state (DDP), load one rank's shard on every rank, load_checkpoint(opt, {shard!r}); "
            f"where the state is sharded (FSDP2), convert through torch.distributed.checkpoint: on {saved} ranks "
            "load this checkpoint and dcp.save({'optim': get_optimizer_state_dict(model, opt)}, ...), then on "
            "the new ranks dcp.load it and set_optimizer_state_dict(model, opt, ...), which reshards")


def _job_shard(directory: str, world: int, rank: int) -> tuple[str, str | None]:
    """Where rank ``rank`` of a job of ``world`` ranks loads from in checkpoint ``directory``: its shard
    and the job's id for a job's checkpoint, the directory itself (and None) for a process's, which every
    rank loads whole (replicated state, as under DDP).

    Raises:
        CheckpointError: saved by a job of another size (the message says how to convert), or this
            rank's shard is not here, or it is not the one the job manifest lists.
    """
    manifest = _read_manifest(directory)
    if manifest["format"] != JOB_FORMAT:
        return directory, None
    if manifest["world_size"] != world:
        raise CheckpointError(_world_mismatch(directory, manifest, world))
    entry = manifest["shards"][rank]
    path = os.path.join(directory, entry["name"])
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {directory} has no shard of rank {rank} here ({entry['name']} is "
                              "missing); with node-local checkpoint directories each node holds the shards of "
                              "the ranks that ran there: start each rank on the node that saved its shard")
    shard = read_manifest(path)
    if shard["manifest_xxh3_64"] != entry["manifest_xxh3_64"]:
        raise ChecksumError(f"{path}: its manifest has xxh3_64 {shard['manifest_xxh3_64']}, the job manifest of "
                            f"{directory} lists {entry['manifest_xxh3_64']} (a shard of another save)")
    return path, manifest["job"]


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


def verify_checkpoint(directory: str | os.PathLike, *, local: bool = False) -> dict:
    """Check a checkpoint's manifest, every file's size and checksum, every unit's checksum and, with
    a model, every parameter's checksum in params.bin.

    A job's checkpoint: its job manifest, and each rank's shard as above (each shard's manifest must
    be the one the job manifest lists).

    Args:
        directory: the checkpoint directory.
        local: for a job's checkpoint, check the shards that are here and let the others be elsewhere
            (node-local directories: each node holds its own ranks' shards). Without it, a missing
            shard fails the check.

    Returns:
        The manifest (a job's: the job manifest).

    Raises:
        FileNotFoundError: no such directory.
        CheckpointError: incomplete or unreadable (for a job, the message names every missing
            shard); ``ChecksumError`` names the first bad file and byte range (and the parameters
            whose state it holds, or the model parameter).
        OSError: the data could not be read.
    """
    directory = os.path.abspath(os.fspath(directory))
    with reading(directory):  # no save replaces it while its files are read one by one
        manifest = _read_manifest(directory)
        if manifest["format"] == JOB_FORMAT:
            _verify_job(directory, manifest, local=local)
        else:
            _verify_files(directory, manifest)
    return manifest


def _missing_shards(directory: str, job: dict) -> list[str]:
    return [s["name"] for s in job["shards"] if not os.path.isdir(os.path.join(directory, s["name"]))]


def _verify_job(directory: str, job: dict, *, local: bool = False, ranks=None) -> None:
    """Verify the shards of a job's checkpoint that are here (``ranks``: those ranks' only, which must
    be here); without ``local``, a shard that is not here fails it, named."""
    missing = _missing_shards(directory, job)
    wanted = [s for s in job["shards"] if ranks is None or s["rank"] in ranks]
    lost = [s["name"] for s in wanted if s["name"] in missing]
    if lost and (ranks is not None or not local):
        raise CheckpointError(f"checkpoint {directory} of a job of {job['world_size']} ranks is missing the "
                              f"shard(s) {', '.join(lost)} here (with node-local directories they are on other "
                              "nodes: verify there, or pass local=True / --local to check only what is here)")
    for entry in wanted:
        if entry["name"] in missing:
            continue
        path = os.path.join(directory, entry["name"])
        shard = read_manifest(path)
        if shard["manifest_xxh3_64"] != entry["manifest_xxh3_64"]:
            raise ChecksumError(f"{path}: its manifest has xxh3_64 {shard['manifest_xxh3_64']}, the job manifest "
                                f"lists {entry['manifest_xxh3_64']} (a shard of another save)")
        _verify_files(path, shard)


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
    """A human-readable summary of a checkpoint's manifest (no data is read); for a job's checkpoint,
    the job and each shard that is here."""
    m = _read_manifest(directory)  # under reading(): the manifest is all it reads
    if m["format"] == JOB_FORMAT:
        return _inspect_job(os.path.abspath(os.fspath(directory)), m)
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


def _inspect_job(directory: str, job: dict) -> str:
    missing = set(_missing_shards(directory, job))
    lines = [
        f"checkpoint: {directory}",
        f"format: {job['format']} v{job['version']}: a job of {job['world_size']} ranks, job id {job['job']}",
        f"created: {job.get('created')}   step: {job.get('step')}",
        f"shards here: {job['world_size'] - len(missing)} of {job['world_size']}"
        + (f" (missing here: {', '.join(sorted(missing))})" if missing else ""),
    ]
    for s in job["shards"]:
        size = sum(f["bytes"] for f in s["files"].values())
        where = "MISSING here" if s["name"] in missing else "here"
        lines.append(f"shard {s['name']} (rank {s['rank']}): {where}, step {s['step']}, {size} bytes in "
                     f"{len(s['files'])} files, manifest xxh3_64 {s['manifest_xxh3_64']}")
    for s in job["shards"]:
        if s["name"] not in missing:
            lines += ["", inspect_checkpoint(os.path.join(directory, s["name"]))]
            break
    return "\n".join(lines)
