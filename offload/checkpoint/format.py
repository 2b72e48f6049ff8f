"""The checkpoint format: file names, the manifest's building blocks, checksums and file checks."""

from __future__ import annotations

import datetime
import io
import json
import os
import re
from typing import Any, Callable, Iterable

import torch
import xxhash

from .._version import __version__
from ..errors import CheckpointError, ChecksumError

# NOTE: a checkpoint is a directory of these files (state.bin and memory.pt when it holds an
# optimizer, params.bin and model.pt when it holds a model's weights, or all of them):
#
#   state.bin     the offloaded state, unit by unit, each unit padded to 4096 bytes. A unit is copied
#                 byte for byte from the swap space through the optimizer's own pool buffers with the
#                 native engine (O_DIRECT), so host memory stays the pool whatever the model size.
#   memory.pt     torch.save of what lives in memory: the param_groups (torch's layout, params as
#                 indices), the state of small parameters, and the step of every offloaded parameter.
#   extra.pt      optional: anything the caller passes as ``extra`` (the model's state_dict, the
#                 data loader's position, ...), saved in the same atomic directory.
#   params.bin    with a model: each offloaded parameter's bytes, streamed from the parameter
#                 store's swap space through its pool, at a 4096-aligned offset (see ``model``).
#   model.pt      with a model: torch.save of its other parameters and its persistent buffers.
#   manifest.json format version, param groups, per parameter its index, shape, dtype, state keys
#                 and where each chunk of its state lies in state.bin, the optimizer's config, the
#                 model's tensors (name, shape, dtype, and offset, length and xxh3_64 in params.bin),
#                 and the size and xxh3_64 of every file and of every unit. Written last.
#
# What is here is pure or reads and writes whole small files (manifest digest, memory.pt, extra.pt):
# committing the directory is ``commit``'s job, moving state.bin's bytes is ``stream``'s.
FORMAT = "nvme-offload-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
DATA = "state.bin"
MEMORY = "memory.pt"
EXTRA = "extra.pt"
PARAMS_DATA = "params.bin"  # with a model: offloaded parameters' bytes (see ``model``)
MODEL_MEMORY = "model.pt"  # with a model: its other parameters and its buffers
# A checkpoint of a torch.distributed job: one shard directory per rank (each an ordinary checkpoint of
# the rank's own state) and a job manifest (MANIFEST, of format JOB_FORMAT) naming them all.
JOB_FORMAT = "nvme-offload-job-checkpoint"
JOB_VERSION = 1
_SHARD = re.compile(r"^rank-(\d{5,})$")


def _shard_name(rank: int) -> str:
    """The directory of ``rank``'s shard inside a job's checkpoint."""
    return f"rank-{rank:05d}"


# -- small helpers ----------------------------------------------------------------------------



def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    value = getattr(torch, str(name), None)
    if not isinstance(value, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in the manifest")
    return value



def _jsonable(value: Any) -> Any:
    """Hyperparameters as JSON (tensors become numbers); exact values live in memory.pt."""
    if torch.is_tensor(value):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)



def _numel(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _cpu_state(state: dict) -> dict:
    """A parameter's in-memory state copied to the CPU, as memory.pt holds it."""
    return {k: (v.detach().to("cpu", copy=True) if torch.is_tensor(v) else v) for k, v in state.items()}


# -- checksums --------------------------------------------------------------------------------


def _manifest_digest(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != "manifest_xxh3_64"}
    return xxhash.xxh3_64(json.dumps(body, sort_keys=True).encode()).hexdigest()



def _unit_params(manifest: dict) -> list[list[int]]:
    """For each unit, the indices of the parameters with a chunk in it."""
    out: list[list[int]] = [[] for _ in manifest["units"]]
    for p in manifest["params"]:
        for c in p.get("chunks", ()):
            if p["index"] not in out[c[0]]:
                out[c[0]].append(p["index"])
    return out


def _check_unit(manifest: dict, path: str, u: int, buf) -> None:
    found = xxhash.xxh3_64(buf.tensor[: manifest["units"][u]["length"]].numpy()).hexdigest()
    _check_digest(manifest, path, u, found)


def _check_digest(manifest: dict, path: str, u: int, found: str) -> None:
    unit = manifest["units"][u]
    if found != unit["xxh3_64"]:
        holders = ", ".join(str(i) for i in _unit_params(manifest)[u]) or "none"
        raise ChecksumError(
            f"{path}: bytes [{unit['offset']}, {unit['offset'] + unit['length']}) (unit {u}, state of "
            f"parameter(s) {holders}) have xxh3_64 {found}, the manifest says {unit['xxh3_64']}; the "
            "checkpoint is corrupt, load an older one")


def file_path(directory: str, name: str, entry: dict) -> str:
    """Where the file ``name`` of the format is in checkpoint ``directory``, from its manifest entry:
    under the generation's name the save recorded (``file``), or under ``name`` itself (the first
    format's layout)."""
    on_disk = entry.get("file", name) if isinstance(entry, dict) else name
    if not isinstance(on_disk, str) or os.path.basename(on_disk) != on_disk or on_disk in ("", ".", ".."):
        raise CheckpointError(f"checkpoint {directory}: its manifest gives {name} the file name {on_disk!r}, "
                              "which is not a file of the checkpoint directory")
    return os.path.join(directory, on_disk)


def _check_data_digest(manifest: dict, path: str, found: str, name: str = DATA) -> None:
    """``found``, the xxh3_64 of the whole data file ``name``, against the manifest's."""
    if found != manifest["files"][name]["xxh3_64"]:
        raise ChecksumError(f"{path}: xxh3_64 is {found}, the manifest says "
                            f"{manifest['files'][name]['xxh3_64']}")


def _check_data_size(directory: str, manifest: dict, name: str = DATA) -> str:
    """The path of data file ``name``, after checking it exists with the size the manifest gives."""
    path = file_path(directory, name, manifest["files"][name])
    expected = manifest["files"][name]["bytes"]
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {directory} is missing {name}, which its manifest lists") from None
    if size != expected:
        raise ChecksumError(f"{path}: {size} bytes, the manifest says {expected} (truncated or extended); the "
                            "checkpoint is corrupt, load an older one")
    return path


def _check_file_hash(directory: str, name: str, entry: dict) -> None:
    path = file_path(directory, name, entry)
    h, n = xxhash.xxh3_64(), 0
    try:
        with open(path, "rb") as f:
            while block := f.read(8 << 20):
                h.update(block)
                n += len(block)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {directory} is missing {name}, which its manifest lists") from None
    except OSError as err:
        raise _io_error(err, path, "cannot read") from err
    if n != entry["bytes"] or h.hexdigest() != entry["xxh3_64"]:
        raise ChecksumError(f"{path}: {n} bytes with xxh3_64 {h.hexdigest()}, the manifest says "
                            f"{entry['bytes']} bytes with {entry['xxh3_64']}; the file is corrupt")


def _io_error(err: OSError, path: str, doing: str) -> OSError:
    """``err`` as ``OSError(errno, message, path)`` naming ``path`` (raise it ``from err``).

    Python's file objects raise errors of ``write``, ``flush`` and ``fsync`` without the file's
    name; torch.save turns them into a RuntimeError without the errno. This puts both back.
    """
    if err.errno is None or err.filename == path:
        return err
    return OSError(err.errno, f"{doing} {path}: {err.strerror or os.strerror(err.errno)}", path)


# -- memory.pt and extra.pt -------------------------------------------------------------------


class _HashingWriter:
    """A file object that hashes what passes through it (for torch.save).

    torch.save reports a failed ``write`` as ``RuntimeError: [enforce fail at inline_container.cc]``
    without errno or path, so the first OSError is kept here for :func:`_write_torch` to raise.
    """

    def __init__(self, f):
        self.f = f
        self.hash = xxhash.xxh3_64()
        self.nbytes = 0
        self.error: OSError | None = None

    def write(self, b) -> int:
        try:
            n = self.f.write(b)
        except OSError as err:
            self.error = self.error or err
            raise
        self.hash.update(b)
        self.nbytes += len(b)
        return n

    def flush(self) -> None:
        try:
            self.f.flush()
        except OSError as err:
            self.error = self.error or err
            raise


def create_private(path: str, *, text: bool = False):
    """A new file ``path`` open for writing, readable by its owner only (0600: state and weights are the
    user's data), created exclusively and without following a link: a name someone planted there (a link,
    a file) raises FileExistsError and is never written through or truncated."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    return os.fdopen(fd, "w" if text else "wb")


def _fsync(fd: int, path: str) -> None:
    os.fsync(fd)


def _write_torch(obj: Any, path: str, fsync: Callable[[int, str], None] = _fsync) -> dict:
    """``torch.save(obj)`` into a new file ``path``, fsynced with ``fsync(fd, path)`` (a save's
    ``Storage.fsync``); returns its size and xxh3_64.

    Raises:
        OSError: writing failed (ENOSPC, EIO, ...): ``OSError(errno, message, path)``, with the
            original error chained.
    """
    w = None
    try:
        with create_private(path) as f:
            w = _HashingWriter(f)
            torch.save(obj, w)
            w.flush()
            fsync(f.fileno(), path)
    except OSError as err:
        raise _io_error(err, path, "cannot write") from err
    except RuntimeError:
        if w is None or w.error is None:
            raise
        raise _io_error(w.error, path, "cannot write") from w.error
    return {"bytes": w.nbytes, "xxh3_64": w.hash.hexdigest()}


class _Serialized(bytes):
    """A torch.save of an object taken earlier (:func:`_torch_bytes`), to be written as it is."""


def _torch_bytes(obj: Any) -> _Serialized:
    """What :func:`_write_torch` would write for ``obj``, in memory (a copy taken now, written later)."""
    out = io.BytesIO()
    torch.save(obj, out)
    return _Serialized(out.getvalue())


def _write_bytes(data: bytes, path: str, fsync: Callable[[int, str], None] = _fsync) -> dict:
    """``data`` into a new file ``path``, fsynced; returns its size and xxh3_64 (as :func:`_write_torch`)."""
    try:
        with open(path, "xb") as f:
            f.write(data)
            f.flush()
            fsync(f.fileno(), path)
    except OSError as err:
        raise _io_error(err, path, "cannot write") from err
    return {"bytes": len(data), "xxh3_64": xxhash.xxh3_64(data).hexdigest()}


def _read_torch(directory: str, name: str, entry: dict) -> Any:
    path = file_path(directory, name, entry)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {directory} is missing {name}, which its manifest lists") from None
    except OSError as err:
        raise _io_error(err, path, "cannot read") from err
    if len(data) != entry["bytes"]:
        raise ChecksumError(f"{path}: {len(data)} bytes, the manifest says {entry['bytes']} (truncated or "
                            "replaced); the checkpoint is corrupt, load an older one")
    found = xxhash.xxh3_64(data).hexdigest()
    if found != entry["xxh3_64"]:
        raise ChecksumError(f"{path}: xxh3_64 is {found}, the manifest says {entry['xxh3_64']}; the file is "
                            "corrupt, load an older checkpoint")
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


# -- building the manifest --------------------------------------------------------------------


def _torch_groups(param_groups: list[dict], index: dict) -> list[dict]:
    """param_groups as torch's state_dict writes them: params as indices, the rest copied."""
    out = []
    for g in param_groups:
        d = {k: v for k, v in g.items() if k != "params"}
        d["params"] = [index[p] for p in g["params"]]
        out.append(d)
    return out


def _chunk_table(units: Iterable, index_of: Callable[[Any], int]) -> dict[int, list]:
    """Per parameter index, where its chunks lie: ``[unit, start, numel, offset, stride]`` each, and when
    its state keys differ in dtype (``state_dtype: "bf16"`` beside an fp32 master) a sixth element, each
    key's slice offset from ``offset`` (``stride`` is then 0)."""
    chunks_of: dict[int, list] = {}
    for ui, u in enumerate(units):
        for c in u.chunks:
            row = [ui, c.start, c.numel, c.offset, c.stride]
            if not c.stride:
                row.append(list(c.slices))
            chunks_of.setdefault(index_of(c.slot.param), []).append(row)
    return chunks_of


def _key_dtypes(entry: dict) -> list:
    """The dtype of each state key of a manifest parameter entry, in ``keys`` order."""
    names = entry.get("key_dtypes") or [entry["state_dtype"]] * len(entry["keys"])
    return [_dtype(n) for n in names]


def _slice_offset(chunk: list, k: int) -> int:
    """Byte offset of key ``k``'s slice of a manifest chunk row, within its unit."""
    return chunk[3] + (chunk[5][k] if len(chunk) > 5 else k * chunk[4])


def _groups_json(groups: list[dict]) -> list[dict]:
    return [{k: _jsonable(v) for k, v in g.items()} for g in groups]


def _write_memory_and_manifest(staged, *, kind: str, groups: list[dict], entries: list, memory_state: dict,
                               steps: dict, extra: Any, config: dict, unit_bytes: int, threshold: int,
                               data: dict) -> dict:
    """Write memory.pt (and extra.pt) into ``staged`` beside state.bin; returns the manifest to commit.

    Args:
        staged: the checkpoint being written (``commit._Staged``).
        kind: the optimizer's class name, or ``"imported"``.
        groups: torch-layout param groups (params as indices).
        entries: the manifest's per-parameter entries.
        memory_state: small parameters' state, by index.
        steps: offloaded parameters' steps, by index.
        extra: the caller's ``extra`` (None: no extra.pt). ``extra`` may also come as
            :class:`_Serialized`, and ``memory_state`` as the whole of memory.pt serialized (both
            taken at the call by an asynchronous save).
        config: the optimizer's config as a dict.
        unit_bytes: the unit (buffer) size.
        threshold: the small-parameter threshold.
        data: what ``stream._write_data`` returned.
    """
    files = {DATA: data["file"]}
    memory = memory_state if isinstance(memory_state, _Serialized) else \
        {"param_groups": groups, "state": memory_state, "steps": steps}
    files[MEMORY] = _write_any(memory, staged.path(MEMORY), staged.storage.fsync)
    if extra is not None:
        files[EXTRA] = _write_any(extra, staged.path(EXTRA), staged.storage.fsync)
    manifest = _base_manifest(kind, _groups_json(groups), entries, config, unit_bytes)
    manifest["threshold"] = threshold
    manifest["units"] = data["units"]
    manifest["files"] = files
    return manifest


def _write_any(obj: Any, path: str, fsync: Callable[[int, str], None]) -> dict:
    if isinstance(obj, _Serialized):
        return _write_bytes(obj, path, fsync)
    return _write_torch(obj, path, fsync)


def _base_manifest(kind: str, groups_json: list, params: list, config: dict, unit_bytes: int) -> dict:
    steps = sorted({p["step"] for p in params if p.get("step") is not None})
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "library_version": __version__,
        "torch_version": torch.__version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "optimizer": kind,
        "step": max(steps) if steps else 0,
        "steps": steps,
        "param_groups": groups_json,
        "params": params,
        "config": config,
        "buffer_size": unit_bytes,
    }

