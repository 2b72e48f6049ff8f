"""Streaming checkpoints of offloaded optimizer state: save, load, verify, export, import, retention.

# NOTE: a checkpoint is a directory of four files:
#
#   state.bin     the offloaded state, unit by unit, each unit padded to 4096 bytes. A unit is copied
#                 byte for byte from the swap space through the optimizer's own pool buffers with the
#                 native engine (O_DIRECT), so host memory stays the pool whatever the model size.
#   memory.pt     torch.save of what lives in memory: the param_groups (torch's layout, params as
#                 indices), the state of small parameters, and the step of every offloaded parameter.
#   extra.pt      optional: anything the caller passes as ``extra`` (the model's state_dict, the
#                 data loader's position, ...), saved in the same atomic directory.
#   manifest.json format version, param groups, per parameter its index, shape, dtype, state keys
#                 and where each chunk of its state lies in state.bin, the optimizer's config, and
#                 the size and xxh3_64 of every file and of every unit. Written last.
#
# Atomicity: everything is written into a sibling ``<dir>.tmp-<pid>-<random>``, fsynced (files, then
# the directory), and only then given the target's name. If the target exists, the two directories
# are swapped with renameat2(RENAME_EXCHANGE) in one step and the old one (now under the temporary
# name) is deleted. Where the file system cannot exchange, the old one is first renamed to
# ``<dir>.old-<random>``; a crash between that rename and the next leaves no ``<dir>``, and the next
# save or load puts the old one back (see ``_recover``). So the name ``<dir>`` only ever points at a
# complete checkpoint, and a directory under a temporary name is never loaded by accident.
#
# Loading checks the manifest, the sizes and every unit's checksum as the bytes pass, and the
# shapes, dtypes and param groups against the optimizer before touching it. When the optimizer
# packs state like the checkpoint (same buffer_size and parameters), units stream back to the swap
# space as they are; otherwise each parameter's element ranges are re-chunked into the new units.
"""

from __future__ import annotations

import ctypes
import datetime
import errno as _errno
import fcntl
import io
import json
import os
import re
import secrets
import shutil
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
import xxhash

from ._version import __version__
from .aio import Engine
from .buffers import BufferPool
from .config import AioConfig, Config, config_to_dict, load_config
from .errors import OffloadError, StateError
from .layout import Layout, state_keys_for

__all__ = [
    "CheckpointError",
    "ChecksumError",
    "FORMAT_VERSION",
    "Retention",
    "export_checkpoint",
    "export_state_dict",
    "import_state_dict",
    "inspect_checkpoint",
    "load_checkpoint",
    "read_manifest",
    "save_checkpoint",
    "save_with_retention",
    "verify_checkpoint",
]

FORMAT = "nvme-offload-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
DATA = "state.bin"
MEMORY = "memory.pt"
EXTRA = "extra.pt"
ALIGN = 4096
# Pool for tools that read a checkpoint without an optimizer (verify, export): per buffer.
_TOOL_BUFFER_MAX = 64 << 20


class CheckpointError(OffloadError, ValueError):
    """A checkpoint is incomplete, corrupt, or does not fit the optimizer; the message says where."""


class ChecksumError(CheckpointError):
    """A checkpoint file's bytes differ from what was saved (bit rot, truncation, tampering)."""


# -- small helpers ----------------------------------------------------------------------------


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    value = getattr(torch, str(name), None)
    if not isinstance(value, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in the manifest")
    return value


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


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


def _manifest_digest(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != "manifest_xxh3_64"}
    return xxhash.xxh3_64(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    _fsync_path(path)


_libc = None
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: str, b: str) -> bool:
    """Swap two paths atomically (renameat2 RENAME_EXCHANGE); False where unsupported."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.renameat2  # noqa: B018 - probe: older C libraries lack it
        except (OSError, AttributeError):
            _libc = False
    if _libc is False:
        return False
    rc = _libc.renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (_errno.EINVAL, _errno.ENOSYS, _errno.ENOTSUP, _errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"cannot exchange {a} and {b}: {os.strerror(err)}", b)


def _rename(src: str, dst: str) -> None:
    os.rename(src, dst)


def _remove_tree(path: str) -> None:
    """Delete a directory; renamed first, so a half-deleted one never carries a checkpoint's name."""
    if not os.path.exists(path):
        return
    doomed = path if ".tmp-" in os.path.basename(path) else f"{path}.tmp-del-{secrets.token_hex(4)}"
    if doomed != path:
        os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _recover(directory: str) -> None:
    """Put back a checkpoint left aside by a save that died between its two renames."""
    if os.path.exists(directory):
        return
    parent, name = os.path.split(directory)
    try:
        aside = sorted(n for n in os.listdir(parent) if n.startswith(name + ".old-"))
    except FileNotFoundError:
        return
    for n in aside:
        if os.path.isfile(os.path.join(parent, n, MANIFEST)):
            os.rename(os.path.join(parent, n), directory)
            _fsync_dir(parent)
            return


def _clean_stale(directory: str) -> None:
    """Remove temporary siblings of ``directory`` left by saves whose process is gone."""
    parent, name = os.path.split(directory)
    pattern = re.compile(re.escape(name) + r"\.(tmp-(?P<pid>\d+)-[0-9a-f]+|tmp-del-[0-9a-f]+|old-[0-9a-f]+)$")
    for n in os.listdir(parent):
        m = pattern.match(n)
        if m is None:
            continue
        if m["pid"] is not None and _pid_alive(int(m["pid"])):
            continue  # a save in progress in another live process
        shutil.rmtree(os.path.join(parent, n), ignore_errors=True)


class _HashingWriter:
    """A file object that hashes what passes through it (for torch.save)."""

    def __init__(self, f):
        self.f = f
        self.hash = xxhash.xxh3_64()
        self.nbytes = 0

    def write(self, b) -> int:
        self.hash.update(b)
        self.nbytes += len(b)
        return self.f.write(b)

    def flush(self) -> None:
        self.f.flush()


def _write_torch(obj: Any, path: str) -> dict:
    with open(path, "xb") as f:
        w = _HashingWriter(f)
        torch.save(obj, w)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": w.nbytes, "xxh3_64": w.hash.hexdigest()}


def _read_torch(directory: str, name: str, entry: dict) -> Any:
    path = os.path.join(directory, name)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {directory} is missing {name}, which its manifest lists") from None
    if len(data) != entry["bytes"]:
        raise ChecksumError(f"{path}: {len(data)} bytes, the manifest says {entry['bytes']} (truncated or "
                            "replaced); the checkpoint is corrupt, load an older one")
    found = xxhash.xxh3_64(data).hexdigest()
    if found != entry["xxh3_64"]:
        raise ChecksumError(f"{path}: xxh3_64 is {found}, the manifest says {entry['xxh3_64']}; the file is "
                            "corrupt, load an older checkpoint")
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


# -- the streaming loop -----------------------------------------------------------------------


class _Done:
    def wait(self) -> int:
        return 0

    def done(self) -> bool:
        return True


_DONE = _Done()


def _quiet_wait(fut) -> None:
    try:
        fut.wait()
    except OSError:
        pass


def _stream(items: Sequence, buffers: Sequence, *, read: Optional[Callable] = None,
            process: Callable[[Any, Any], bool], write: Optional[Callable] = None) -> None:
    """For each item in order: ``read(item, buf)``, ``process(item, buf)``, ``write(item, buf)`` if
    process returned True; reads run ahead and writes land behind, as far as the buffers allow.

    ``read`` and ``write`` return futures; every request in flight lands before an error leaves.
    """
    free = deque(buffers)
    reads: deque = deque()
    writes: deque = deque()
    n, next_i = len(items), 0
    try:
        for _ in range(n):
            while next_i < n:
                if free:
                    buf = free.popleft()
                elif writes and (not reads or writes[0][1].done()):
                    buf, fut = writes.popleft()
                    fut.wait()
                else:
                    break
                item = items[next_i]
                reads.append((item, buf, read(item, buf) if read is not None else _DONE))
                next_i += 1
            item, buf, fut = reads.popleft()
            fut.wait()
            if process(item, buf) and write is not None:
                writes.append((buf, write(item, buf)))
            else:
                free.append(buf)
        while writes:
            writes.popleft()[1].wait()
    except BaseException:
        for _, _, fut in reads:
            _quiet_wait(fut)
        for _, fut in writes:
            _quiet_wait(fut)
        raise


class _RangeReader:
    """Copies byte ranges of a checkpoint's data file into tensors through one staging buffer."""

    def __init__(self, engine: Engine, file, buffer, file_bytes: int):
        self.engine, self.file, self.buffer, self.file_bytes = engine, file, buffer, file_bytes
        self.start, self.end = 0, 0  # the window of the file the buffer holds

    def copy(self, dest: torch.Tensor, offset: int) -> None:
        """Fill the 1-D tensor ``dest`` from the file's bytes at ``offset``."""
        itemsize = dest.element_size()
        done, total = 0, dest.numel() * itemsize
        while done < total:
            pos = offset + done
            if not (self.start <= pos < self.end):
                self.start = pos // ALIGN * ALIGN
                length = min(self.buffer.nbytes, self.file_bytes - self.start)
                got = self.engine.read(self.file, self.buffer, self.start, length)
                self.end = self.start + got
                if got < itemsize:
                    raise ChecksumError(f"{self.file.path}: ends at byte {self.end}, data expected at {pos}")
            take = min(total - done, self.end - pos)
            n = take // itemsize
            dest[done // itemsize: done // itemsize + n].copy_(self.buffer.view(dest.dtype, pos - self.start, n))
            done += n * itemsize


# -- manifest ---------------------------------------------------------------------------------


def read_manifest(directory: str | os.PathLike) -> dict:
    """The manifest of a checkpoint, checked for completeness and its own checksum.

    Raises:
        FileNotFoundError: no such directory.
        CheckpointError: not a (complete) checkpoint, or a format this version cannot read.
    """
    directory = os.path.abspath(os.fspath(directory))
    _recover(directory)
    if not os.path.isdir(directory):
        raise FileNotFoundError(_errno.ENOENT, "no checkpoint directory", directory)
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path, "rb") as f:
            text = f.read()
    except FileNotFoundError:
        raise CheckpointError(f"{directory} is not a complete checkpoint (no {MANIFEST}); a save that did "
                              "not finish leaves only temporary directories, so this was never one") from None
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


def _check_data_size(directory: str, manifest: dict) -> str:
    path = os.path.join(directory, DATA)
    expected = manifest["files"][DATA]["bytes"]
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {directory} is missing {DATA}, which its manifest lists") from None
    if size != expected:
        raise ChecksumError(f"{path}: {size} bytes, the manifest says {expected} (truncated or extended); the "
                            "checkpoint is corrupt, load an older one")
    return path


def _tool_pool(manifest: dict) -> BufferPool:
    longest = max([u["length"] for u in manifest["units"]] + [ALIGN])
    return BufferPool(3, min(longest, _TOOL_BUFFER_MAX))


def _aio_of(manifest: dict) -> AioConfig:
    try:
        return load_config({"aio": manifest["config"]["aio"]}).aio
    except Exception:  # noqa: BLE001 - a config this version cannot read: the defaults do
        return AioConfig()


def _verify_data(directory: str, manifest: dict, engine: Engine, buffers: Sequence) -> None:
    """Read state.bin once and check every unit's checksum and the file's.

    Units larger than the buffers are read in pieces (e.g. loading into an optimizer with smaller
    buffers than the one that saved).
    """
    path = _check_data_size(directory, manifest)
    whole = xxhash.xxh3_64()
    units = manifest["units"]
    size = buffers[0].nbytes
    pieces = [(u, off, min(size, unit["length"] - off))
              for u, unit in enumerate(units) for off in range(0, unit["length"], size)]
    hashes = [xxhash.xxh3_64() for _ in units]
    with engine.open(path, "r") as f:
        def read(piece, buf):
            u, off, n = piece
            return engine.read_async(f, buf, units[u]["offset"] + off, n)

        def process(piece, buf):
            u, off, n = piece
            data = buf.tensor[:n].numpy()
            hashes[u].update(data)
            whole.update(data)
            if off + n == units[u]["length"]:
                _check_digest(manifest, path, u, hashes[u].hexdigest())
            return False

        _stream(pieces, list(buffers), read=read, process=process)
    if whole.hexdigest() != manifest["files"][DATA]["xxh3_64"]:
        raise ChecksumError(f"{path}: xxh3_64 is {whole.hexdigest()}, the manifest says "
                            f"{manifest['files'][DATA]['xxh3_64']}")


def verify_checkpoint(directory: str | os.PathLike) -> dict:
    """Check a checkpoint's manifest, every file's size and checksum, and every unit's checksum.

    Returns:
        The manifest.

    Raises:
        FileNotFoundError: no such directory.
        CheckpointError: incomplete or unreadable; ``ChecksumError`` names the first bad file and
            byte range (and the parameters whose state it holds).
        OSError: the data could not be read.
    """
    directory = os.path.abspath(os.fspath(directory))
    manifest = read_manifest(directory)
    _read_torch(directory, MEMORY, manifest["files"][MEMORY])
    if EXTRA in manifest["files"]:
        _check_file_hash(directory, EXTRA, manifest["files"][EXTRA])
    with _tool_pool(manifest) as pool:
        engine = Engine(_aio_of(manifest))
        try:
            _verify_data(directory, manifest, engine, list(pool))
        finally:
            engine.close()
    return manifest


def _check_file_hash(directory: str, name: str, entry: dict) -> None:
    path = os.path.join(directory, name)
    h, n = xxhash.xxh3_64(), 0
    try:
        with open(path, "rb") as f:
            while block := f.read(8 << 20):
                h.update(block)
                n += len(block)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {directory} is missing {name}, which its manifest lists") from None
    if n != entry["bytes"] or h.hexdigest() != entry["xxh3_64"]:
        raise ChecksumError(f"{path}: {n} bytes with xxh3_64 {h.hexdigest()}, the manifest says "
                            f"{entry['bytes']} bytes with {entry['xxh3_64']}; the file is corrupt")


# -- writing a checkpoint directory -----------------------------------------------------------


def _make_engine(aio: AioConfig) -> Engine:
    """The engine that writes or reads a checkpoint's data file (tests replace it to inject faults)."""
    return Engine(aio)


class _Staged:
    """A checkpoint being written under a temporary sibling name, then committed atomically."""

    def __init__(self, directory: str):
        self.directory = os.path.abspath(os.fspath(directory))
        parent = os.path.dirname(self.directory)
        os.makedirs(parent, exist_ok=True)
        self.parent = parent
        self._lock_fd = os.open(parent, os.O_RDONLY | os.O_CLOEXEC)
        # Saves of one directory from several processes queue here rather than race on the renames.
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        try:
            _recover(self.directory)
            _clean_stale(self.directory)
            self.tmp = f"{self.directory}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
            os.mkdir(self.tmp, 0o755)
        except BaseException:
            os.close(self._lock_fd)
            raise

    def path(self, name: str) -> str:
        return os.path.join(self.tmp, name)

    def commit(self, manifest: dict) -> None:
        manifest["manifest_xxh3_64"] = _manifest_digest(manifest)
        with open(self.path(MANIFEST), "x") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(self.tmp)
        if not os.path.exists(self.directory):
            _rename(self.tmp, self.directory)
            _fsync_dir(self.parent)
            return
        if _exchange(self.tmp, self.directory):
            # The old checkpoint now carries the temporary name: from here on only the new is loadable.
            _fsync_dir(self.parent)
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        aside = f"{self.directory}.old-{secrets.token_hex(4)}"
        _rename(self.directory, aside)
        _rename(self.tmp, self.directory)  # a crash just before this: _recover() restores `aside`
        _fsync_dir(self.parent)
        shutil.rmtree(aside, ignore_errors=True)

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    def close(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


def _write_data(staged: _Staged, aio: AioConfig, buffers: Sequence, units: Sequence, *,
                read: Optional[Callable], fill: Optional[Callable], nbytes_of: Callable[[Any], int]) -> dict:
    """Write ``units`` to state.bin in order through ``buffers``; returns the file entry and units."""
    lengths = [_round_up(nbytes_of(u), ALIGN) for u in units]
    offsets, pos = [], 0
    for n in lengths:
        offsets.append(pos)
        pos += n
    total = pos
    path = staged.path(DATA)
    engine = _make_engine(aio)
    try:
        if all(b.index == i for i, b in enumerate(buffers)):
            try:
                engine.register_buffers(list(buffers))
            except (ValueError, RuntimeError, OSError):
                pass  # fixed buffers only save a little CPU
        with engine.open(path, "x+") as f:
            if f.alignment > ALIGN:
                raise CheckpointError(f"{path}: the file system wants {f.alignment}-byte direct I/O; "
                                      f"checkpoints use {ALIGN}. Set aio.o_direct to false for this path")
            if total:
                try:
                    os.posix_fallocate(f.fd, 0, total)
                except OSError as err:
                    st = os.statvfs(staged.parent)
                    raise OSError(err.errno, f"cannot reserve {total} bytes for the checkpoint data "
                                  f"({err.strerror}; {st.f_bavail * st.f_frsize} bytes free)", path) from err
            whole = xxhash.xxh3_64()
            digests: list[str] = [""] * len(units)
            index = {id(u): i for i, u in enumerate(units)}

            def process(u, buf) -> bool:
                i = index[id(u)]
                if fill is not None:
                    fill(u, buf)
                n = nbytes_of(u)
                buf.tensor[n: lengths[i]].zero_()  # padding: same state, same bytes
                data = buf.tensor[: lengths[i]].numpy()
                digests[i] = xxhash.xxh3_64(data).hexdigest()
                whole.update(data)
                return True

            def write(u, buf):
                i = index[id(u)]
                return engine.write_async(f, buf, offsets[i], lengths[i])

            _stream(list(units), list(buffers), read=read, process=process, write=write)
            os.fsync(f.fd)
    finally:
        engine.close()
    entry = {"bytes": total, "xxh3_64": whole.hexdigest()}
    table = [{"offset": o, "nbytes": nbytes_of(u), "length": n, "xxh3_64": d}
             for u, o, n, d in zip(units, offsets, lengths, digests)]
    return {"file": entry, "units": table}


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


def _groups_json(groups: list[dict]) -> list[dict]:
    return [{k: _jsonable(v) for k, v in g.items()} for g in groups]


# -- save -------------------------------------------------------------------------------------


def save_checkpoint(optimizer, directory: str | os.PathLike, *, extra: Any = None) -> str:
    """Save an offloaded optimizer's whole state to ``directory``, atomically, without materialising it.

    Offloaded state streams from the swap space through the optimizer's pool to ``state.bin`` with
    the native engine; small parameters' state and the steps go to ``memory.pt``; ``extra`` (e.g.
    ``{"model": model.state_dict(), "step": step}``) to ``extra.pt`` in the same directory, so model
    and optimizer are always saved together. An existing checkpoint at ``directory`` is replaced
    only once the new one is complete on disk.

    Args:
        optimizer: an :class:`offload.OffloadedAdam` or ``OffloadedAdamW``.
        directory: the checkpoint directory; its parent is created if missing.
        extra: anything ``torch.save`` can write and ``torch.load(weights_only=True)`` can read back.

    Returns:
        The checkpoint directory (absolute).

    Raises:
        StateError: the optimizer's last step failed part-way, so its state must not be saved.
        OSError: writing failed (the message names file, offset and errno); the previous checkpoint
            at ``directory``, if any, is left as it was and nothing half written remains.
    """
    optimizer._check_usable()
    if optimizer._error is not None:
        raise StateError(f"not saving: the optimizer's last step failed part-way ({optimizer._error}), so "
                         "its offloaded state may be half written. Load the last good checkpoint instead.")
    staged = _Staged(directory)
    try:
        manifest = _save_into(optimizer, staged, extra)
        staged.commit(manifest)
    except BaseException:
        staged.abort()
        raise
    finally:
        staged.close()
    return staged.directory


def _save_into(opt, staged: _Staged, extra: Any) -> dict:
    params = [p for g in opt.param_groups for p in g["params"]]
    index = {p: i for i, p in enumerate(params)}
    slots = opt._layout.slots
    units = [u for u in opt._layout.units if any(c.slot.initialized for c in u.chunks)]

    space = opt._space
    data = _write_data(
        staged, opt.config.aio, list(opt._pool), units,
        read=lambda u, buf: space.read(u.extent, buf, nbytes=u.nbytes),
        fill=None, nbytes_of=lambda u: u.nbytes)

    entries = []
    chunks_of: dict[int, list] = {}
    for ui, u in enumerate(units):
        for c in u.chunks:
            chunks_of.setdefault(index[c.slot.param], []).append([ui, c.start, c.numel, c.offset, c.stride])
    memory_state, steps = {}, {}
    for i, p in enumerate(params):
        slot = slots.get(p)
        st = opt.state.get(p, {})
        entry = {"index": i, "shape": list(p.shape), "dtype": _dtype_name(p.dtype), "numel": p.numel()}
        if slot is not None and (slot.initialized or i in chunks_of):
            entry.update(where="swap", initialized=slot.initialized, keys=list(slot.keys),
                         state_dtype=_dtype_name(slot.dtype), chunks=chunks_of.get(i, []))
            if slot.initialized:
                steps[i] = st["step"].detach().to("cpu", copy=True)
        elif slot is None and len(st) > 0:
            memory_state[i] = {k: (v.detach().to("cpu", copy=True) if torch.is_tensor(v) else v)
                               for k, v in st.items()}
            entry.update(where="memory", initialized=True, keys=sorted(k for k in st if k != "step"),
                         state_dtype=_dtype_name(p.dtype))
        else:
            entry.update(where="none", initialized=False)
        if entry["initialized"]:
            entry["step"] = float(steps[i] if i in steps else memory_state[i].get("step", 0.0))
        entries.append(entry)

    groups = _torch_groups(opt.param_groups, index)
    files = {DATA: data["file"]}
    files[MEMORY] = _write_torch({"param_groups": groups, "state": memory_state, "steps": steps},
                                 staged.path(MEMORY))
    if extra is not None:
        files[EXTRA] = _write_torch(extra, staged.path(EXTRA))
    manifest = _base_manifest(type(opt).__name__, _groups_json(groups), entries,
                              config_to_dict(opt.config, only=None), opt._layout.unit_bytes)
    manifest["threshold"] = opt._threshold
    manifest["units"] = data["units"]
    manifest["files"] = files
    return manifest


def _torch_groups(param_groups: list[dict], index: dict) -> list[dict]:
    """param_groups as torch's state_dict writes them: params as indices, the rest copied."""
    out = []
    for g in param_groups:
        d = {k: v for k, v in g.items() if k != "params"}
        d["params"] = [index[p] for p in g["params"]]
        out.append(d)
    return out


# -- load -------------------------------------------------------------------------------------


def load_checkpoint(optimizer, directory: str | os.PathLike) -> Any:
    """Restore an offloaded optimizer from ``directory``; returns the ``extra`` saved with it (or None).

    Everything that can be checked without touching the optimizer is checked first: the manifest,
    file sizes, ``memory.pt``'s checksum, param groups, and every parameter's shape and dtype. The
    data then streams back to the swap space with each unit's checksum verified before it is
    written. Works across buffer sizes and small-parameter thresholds (state is re-chunked by
    parameter element ranges). Clears a failed step.

    Raises:
        CheckpointError: the checkpoint does not fit this optimizer (the message names the first
            mismatch: parameter index, expected and found) or is incomplete; nothing was changed.
        ChecksumError: a file is corrupt. If the data file's corruption is found while streaming,
            the optimizer refuses to step until a good checkpoint is loaded.
        OSError: reading or writing failed (same consequence).
    """
    optimizer._check_usable()
    directory = os.path.abspath(os.fspath(directory))
    manifest = read_manifest(directory)
    _check_data_size(directory, manifest)
    memory = _read_torch(directory, MEMORY, manifest["files"][MEMORY])
    extra = None
    if EXTRA in manifest["files"]:
        extra = _read_torch(directory, EXTRA, manifest["files"][EXTRA])
    params = _match(optimizer, manifest, memory, directory)

    try:
        _load_into(optimizer, directory, manifest, memory, params)
    except BaseException as err:
        for slot in optimizer._layout.slots.values():
            slot.initialized = False
        optimizer._error = err
        raise
    return extra


def _match(opt, manifest: dict, memory: dict, directory: str) -> list:
    """Check the checkpoint against the optimizer; return its parameters in index order."""
    groups = opt.param_groups
    saved = memory["param_groups"]
    where = f"checkpoint {directory}"
    if len(saved) != len(groups):
        raise CheckpointError(f"{where} has {len(saved)} parameter groups, this optimizer has {len(groups)}")
    for gi, (g, s) in enumerate(zip(groups, saved)):
        if len(g["params"]) != len(s["params"]):
            raise CheckpointError(f"{where}: parameter group {gi} has {len(s['params'])} parameters, this "
                                  f"optimizer's has {len(g['params'])}")
        if bool(g["amsgrad"]) != bool(s.get("amsgrad", False)):
            raise CheckpointError(f"{where}: parameter group {gi} has amsgrad={s.get('amsgrad')}, this "
                                  f"optimizer's has amsgrad={g['amsgrad']}; build the optimizer with the same")
    params = [None] * len(manifest["params"])
    for s, g in zip(saved, groups):
        for i, p in zip(s["params"], g["params"]):
            if not 0 <= i < len(params):
                raise CheckpointError(f"{where}: parameter index {i} is out of range")
            params[i] = p
    for entry in manifest["params"]:
        i, p = entry["index"], params[entry["index"]]
        if entry.get("shape") is not None and tuple(entry["shape"]) != tuple(p.shape):
            raise CheckpointError(f"{where}: parameter {i} has shape {tuple(entry['shape'])} in the checkpoint, "
                                  f"{tuple(p.shape)} in this optimizer")
        if entry.get("dtype") is not None and _dtype(entry["dtype"]) != p.dtype:
            raise CheckpointError(f"{where}: parameter {i} has dtype {entry['dtype']} in the checkpoint, "
                                  f"{_dtype_name(p.dtype)} in this optimizer")
        if entry.get("initialized"):
            amsgrad = bool(opt.param_groups[_group_of(saved, i)]["amsgrad"])
            want = set(state_keys_for(p, amsgrad)) - {"master"}
            have = set(entry.get("keys", ()))
            if entry["where"] == "memory":
                have = set(memory["state"][i]) - {"step"}
            if not want <= have:
                raise CheckpointError(f"{where}: parameter {i} lacks state {sorted(want - have)} in the "
                                      "checkpoint")
    return params


def _group_of(saved: list, i: int) -> int:
    for gi, s in enumerate(saved):
        if i in s["params"]:
            return gi
    raise CheckpointError(f"parameter {i} is in no group")


def _load_into(opt, directory: str, manifest: dict, memory: dict, params: list) -> None:
    entries = manifest["params"]
    # Parameters frozen when the optimizer was built have no place yet.
    late = {params[e["index"]] for e in entries if e.get("initialized") and not opt._is_small(params[e["index"]])
            and params[e["index"]] not in opt._layout.slots}
    if late:
        opt._lay_out(opt._offload_candidates(opt.param_groups, restrict=late))
    slots = opt._layout.slots
    path = os.path.join(directory, DATA)
    units = manifest["units"]
    aio = opt.config.aio
    engine = _make_engine(aio)
    new_state: dict = {}
    try:
        with engine.open(path, "r") as f:
            plan = _same_packing(opt, manifest, params)
            buffers = list(opt._pool)
            if plan is not None:
                whole = xxhash.xxh3_64()

                def read(item, buf):
                    u = units[item[0]]
                    return engine.read_async(f, buf, u["offset"], u["length"])

                def process(item, buf):
                    _check_unit(manifest, path, item[0], buf)
                    whole.update(buf.tensor[: units[item[0]]["length"]].numpy())
                    return True

                def write(item, buf):
                    return opt._space.write(item[1].extent, buf, nbytes=item[1].nbytes)

                _stream(plan, buffers, read=read, process=process, write=write)
                if whole.hexdigest() != manifest["files"][DATA]["xxh3_64"]:
                    raise ChecksumError(f"{path}: xxh3_64 is {whole.hexdigest()}, the manifest says "
                                        f"{manifest['files'][DATA]['xxh3_64']}")
                small_from_swap = []
            else:
                _verify_data(directory, manifest, engine, buffers)
                small_from_swap = _rechunk(opt, manifest, memory, params, engine, f, buffers)
            for i, tensors in small_from_swap:
                new_state[i] = tensors
    finally:
        engine.close()

    # The data is in place: now the in-memory side, which cannot fail half way.
    groups = opt.param_groups
    for g, s in zip(groups, memory["param_groups"]):
        for k, v in s.items():
            if k != "params":
                g[k] = v
    opt.state.clear()
    for slot in slots.values():
        slot.initialized = False
    for e in entries:
        if not e.get("initialized"):
            continue
        i = e["index"]
        p = params[i]
        step = memory["steps"][i] if e["where"] == "swap" else memory["state"][i].get("step", torch.tensor(0.0))
        step = step if torch.is_tensor(step) else torch.tensor(float(step), dtype=torch.float32)
        if opt._is_small(p):
            source = memory["state"][i] if e["where"] == "memory" else new_state[i]
            st = {"step": step.detach().to("cpu", torch.float32).clone()}
            for k, v in source.items():
                if k in ("step", "master"):
                    continue
                st[k] = v.detach().to(device=p.device, dtype=p.dtype).clone() if torch.is_tensor(v) else v
            opt.state[p] = st
        else:
            opt.state[p] = {"step": step.detach().to("cpu", torch.float32).clone()}
            slots[p].initialized = True
    opt._error = None


def _same_packing(opt, manifest: dict, params: list) -> Optional[list]:
    """[(checkpoint unit, optimizer unit)] when every saved unit is packed exactly like one of the
    optimizer's, so bytes can move as they are; None when state must be re-chunked."""
    if manifest.get("buffer_size") != opt._layout.unit_bytes:
        return None
    index = {p: i for i, p in enumerate(params)}
    signature: list[list] = [[] for _ in manifest["units"]]
    for e in manifest["params"]:
        p = params[e["index"]]
        if e.get("initialized"):
            slot = opt._layout.slots.get(p)
            if (e["where"] == "memory") != (slot is None):
                return None  # small here and offloaded there, or the other way round
            if slot is not None and list(slot.keys) != list(e["keys"]):
                return None  # e.g. an imported state without the fp32 master copy
        for u, start, numel, offset, stride in e.get("chunks", ()):
            signature[u].append((e["index"], start, numel, offset, stride))
    by_sig = {}
    for unit in opt._layout.units:
        sig = tuple(sorted((index[c.slot.param], c.start, c.numel, c.offset, c.stride) for c in unit.chunks))
        by_sig[sig] = unit
    plan = []
    for u, sig in enumerate(signature):
        target = by_sig.get(tuple(sorted(sig)))
        if target is None or target.nbytes != manifest["units"][u]["nbytes"]:
            return None
        plan.append((u, target))
    return plan


def _rechunk(opt, manifest: dict, memory: dict, params: list, engine: Engine, f, buffers: list) -> list:
    """Fill the optimizer's units from the checkpoint by parameter element ranges.

    Returns ``[(index, {key: tensor})]`` for parameters small here whose state the checkpoint holds
    on disk.
    """
    reader = _RangeReader(engine, f, buffers[0], manifest["files"][DATA]["bytes"])
    units = manifest["units"]
    entries = {e["index"]: e for e in manifest["params"]}
    index = {p: i for i, p in enumerate(params)}

    def copy_from_disk(dest: torch.Tensor, e: dict, key: str, lo: int, hi: int) -> None:
        k = e["keys"].index(key)
        itemsize = dest.element_size()
        for u, start, numel, offset, stride in e["chunks"]:
            a, b = max(lo, start), min(hi, start + numel)
            if a >= b:
                continue
            pos = units[u]["offset"] + offset + k * stride + (a - start) * itemsize
            reader.copy(dest[a - lo: b - lo], pos)

    def wanted(p) -> Optional[dict]:
        e = entries.get(index[p])
        return e if e is not None and e.get("initialized") else None

    todo = [u for u in opt._layout.units if any(wanted(c.slot.param) for c in u.chunks)]

    def fill(unit, buf) -> bool:
        for c in unit.chunks:
            e = wanted(c.slot.param)
            if e is None:
                continue
            i = e["index"]
            lo, hi = c.start, c.start + c.numel
            for key in c.slot.keys:
                view = c.slice(buf, key)
                if e["where"] == "swap" and key in e["keys"]:
                    copy_from_disk(view, e, key, lo, hi)
                elif e["where"] == "memory" and key in memory["state"][i]:
                    view.copy_(memory["state"][i][key].detach().reshape(-1)[lo:hi])
                elif key == "master":
                    view.copy_(c.slot.param.detach().reshape(-1)[lo:hi])
                else:
                    raise CheckpointError(f"parameter {i}: state {key!r} is not in the checkpoint")
        return True

    space = opt._space
    _stream(todo, buffers[1:], process=fill,
            write=lambda unit, buf: space.write(unit.extent, buf, nbytes=unit.nbytes))

    out = []
    for p in params:
        e = wanted(p)
        if e is None or e["where"] != "swap" or not opt._is_small(p):
            continue
        dtype = _dtype(e["state_dtype"])
        tensors = {}
        for key in e["keys"]:
            t = torch.empty(p.numel(), dtype=dtype)
            copy_from_disk(t, e, key, 0, p.numel())
            tensors[key] = t.view(p.shape)
        out.append((e["index"], tensors))
    return out


# -- export and import ------------------------------------------------------------------------


def export_state_dict(directory: str | os.PathLike, *, include_master: bool = True) -> dict:
    """A checkpoint as torch's optimizer ``state_dict`` (``{"state": ..., "param_groups": ...}``).

    What ``torch.optim.Adam``/``AdamW.load_state_dict`` (and ``OffloadedAdam.load_state_dict``)
    accept. State of fp16/bf16 parameters is fp32, with their fp32 master copy as ``"master"``
    (torch's optimizers ignore it; ``include_master=False`` leaves it out). Needs host memory for
    the whole state; every checksum is verified on the way.

    Raises:
        CheckpointError: incomplete or corrupt checkpoint.
    """
    directory = os.path.abspath(os.fspath(directory))
    manifest = read_manifest(directory)
    path = _check_data_size(directory, manifest)
    memory = _read_torch(directory, MEMORY, manifest["files"][MEMORY])
    state: dict = {}
    for e in manifest["params"]:
        if not e.get("initialized"):
            continue
        i = e["index"]
        if e["where"] == "memory":
            state[i] = {k: v for k, v in memory["state"][i].items()}
            continue
        dtype = _dtype(e["state_dtype"])
        entry = {"step": memory["steps"][i].detach().to("cpu", torch.float32).clone()}
        for k in e["keys"]:
            if k == "master" and not include_master:
                continue
            entry[k] = torch.empty(e["shape"], dtype=dtype)
        state[i] = entry
    placements: list[list] = [[] for _ in manifest["units"]]
    for e in manifest["params"]:
        if e.get("initialized") and e["where"] == "swap":
            for u, start, numel, offset, stride in e["chunks"]:
                placements[u].append((e, start, numel, offset, stride))
    units = manifest["units"]
    whole = xxhash.xxh3_64()
    with _tool_pool(manifest) as pool:
        engine = _make_engine(_aio_of(manifest))
        try:
            with engine.open(path, "r") as f:
                def read(u, buf):
                    return engine.read_async(f, buf, units[u]["offset"], units[u]["length"])

                def process(u, buf):
                    _check_unit(manifest, path, u, buf)
                    whole.update(buf.tensor[: units[u]["length"]].numpy())
                    for e, start, numel, offset, stride in placements[u]:
                        dtype = _dtype(e["state_dtype"])
                        for k, key in enumerate(e["keys"]):
                            if key in state[e["index"]]:
                                dest = state[e["index"]][key].view(-1)[start:start + numel]
                                dest.copy_(buf.view(dtype, offset + k * stride, numel))
                    return False

                _stream(range(len(units)), list(pool), read=read, process=process)
        finally:
            engine.close()
    if whole.hexdigest() != manifest["files"][DATA]["xxh3_64"]:
        raise ChecksumError(f"{path}: xxh3_64 is {whole.hexdigest()}, the manifest says "
                            f"{manifest['files'][DATA]['xxh3_64']}")
    return {"state": state, "param_groups": [dict(g) for g in memory["param_groups"]]}


def export_checkpoint(directory: str | os.PathLike, out: str | os.PathLike, *, include_master: bool = True) -> None:
    """Write :func:`export_state_dict` of ``directory`` to ``out`` with ``torch.save`` (atomically)."""
    sd = export_state_dict(directory, include_master=include_master)
    out = os.path.abspath(os.fspath(out))
    tmp = f"{out}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        with open(tmp, "xb") as f:
            torch.save(sd, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(os.path.dirname(out))


def import_state_dict(state_dict: dict | str | os.PathLike, directory: str | os.PathLike, *,
                      like: str | os.PathLike | None = None, config=None, extra: Any = None) -> str:
    """Write a torch-layout optimizer ``state_dict`` as a checkpoint that ``load_checkpoint`` reads.

    The state dict may come from ``torch.optim.Adam``/``AdamW``, from ``OffloadedAdam.state_dict()``
    or from :func:`export_state_dict` (or be a path to a file ``torch.save`` wrote). Parameter
    shapes come from ``like`` (a checkpoint of the same model, whose dtypes and settings are used)
    or else from the state tensors (parameters without state then go unchecked at load). Which
    parameters are offloaded and the unit size come from ``like``'s config or from ``config``;
    loading re-chunks anyway, so these only matter for speed.

    Args:
        state_dict: the state dict, or a path to one.
        directory: the checkpoint to write (atomically, as :func:`save_checkpoint`).
        like: an existing checkpoint directory of the same model.
        config: a config (path, dict or :class:`offload.config.Config`) when ``like`` is not given.
        extra: stored as the checkpoint's ``extra``.

    Returns:
        The checkpoint directory (absolute).

    Raises:
        CheckpointError: the state dict does not match ``like``, or is not an optimizer state dict.
    """
    if isinstance(state_dict, (str, os.PathLike)):
        state_dict = torch.load(os.fspath(state_dict), map_location="cpu", weights_only=True)
    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        raise CheckpointError("expected an optimizer state dict with 'state' and 'param_groups'")
    groups = state_dict["param_groups"]
    n = sum(len(g["params"]) for g in groups)
    old_ids = [i for g in groups for i in g["params"]]
    renumber = {old: new for new, old in enumerate(old_ids)}
    state = {renumber[k]: v for k, v in state_dict["state"].items() if k in renumber}
    unknown = [k for k in state_dict["state"] if k not in renumber]
    if unknown:
        raise CheckpointError(f"the state dict has state for parameter(s) {unknown} that no group lists")

    shapes: list = [None] * n
    dtypes: list = [None] * n
    if like is not None:
        ref = read_manifest(like)
        cfg = load_config(ref["config"])
        threshold = ref.get("threshold", cfg.offload_optimizer.small_param_threshold)
        if len(ref["params"]) != n:
            raise CheckpointError(f"the state dict has {n} parameters, checkpoint {like} has {len(ref['params'])}")
        for e in ref["params"]:
            shapes[e["index"]] = tuple(e["shape"])
            dtypes[e["index"]] = _dtype(e["dtype"])
    else:
        cfg = load_config(config) if not isinstance(config, Config) else config
        threshold = cfg.offload_optimizer.small_param_threshold
    unit_bytes = cfg.offload_optimizer.buffer_size
    amsgrad_of = {}
    for g in groups:
        for old in g["params"]:
            amsgrad_of[renumber[old]] = bool(g.get("amsgrad", False))
    for i, entry in state.items():
        ref_t = entry.get("exp_avg")
        if not torch.is_tensor(ref_t):
            raise CheckpointError(f"parameter {i}: state without an 'exp_avg' tensor is not Adam's")
        if shapes[i] is None:
            shapes[i] = tuple(ref_t.shape)
        elif tuple(ref_t.shape) != shapes[i]:
            raise CheckpointError(f"parameter {i}: exp_avg has shape {tuple(ref_t.shape)}, checkpoint {like} "
                                  f"has {shapes[i]}")
        if dtypes[i] is None:
            dtypes[i] = ref_t.dtype

    # Lay out the parameters with state, as an optimizer with this config would.
    metas = {}
    layout = Layout(unit_bytes)
    offloaded = []
    for i in range(n):
        if i in state and _numel(shapes[i]) >= threshold:
            metas[i] = torch.empty(shapes[i], dtype=dtypes[i], device="meta")
            offloaded.append((metas[i], {"index": i}, amsgrad_of[i]))
    layout.add(offloaded)
    meta_index = {id(t): i for i, t in metas.items()}

    def fill(unit, buf) -> None:
        for c in unit.chunks:
            i = meta_index[id(c.slot.param)]
            for key in c.slot.keys:
                view = c.slice(buf, key)
                src = state[i].get(key)
                if src is None:
                    if key == "master":
                        view.zero_()  # never read: "master" is absent from the manifest's keys below
                        continue
                    raise CheckpointError(f"parameter {i}: state {key!r} is missing from the state dict")
                view.copy_(src.detach().reshape(-1)[c.start:c.start + c.numel])

    staged = _Staged(directory)
    try:
        units = layout.units
        with BufferPool(3, max(unit_bytes, ALIGN)) as pool:
            data = _write_data(staged, cfg.aio, list(pool), units, read=None, fill=fill,
                               nbytes_of=lambda u: u.nbytes)
        chunks_of: dict[int, list] = {}
        for ui, u in enumerate(units):
            for c in u.chunks:
                chunks_of.setdefault(meta_index[id(c.slot.param)], []).append(
                    [ui, c.start, c.numel, c.offset, c.stride])
        entries, memory_state, steps = [], {}, {}
        for i in range(n):
            e = {"index": i, "shape": list(shapes[i]) if shapes[i] is not None else None,
                 "dtype": _dtype_name(dtypes[i]) if dtypes[i] is not None else None,
                 "numel": _numel(shapes[i]) if shapes[i] is not None else None}
            if i not in state:
                e.update(where="none", initialized=False)
            elif i in metas:
                slot = layout.slots[metas[i]]
                keys = [k for k in slot.keys if k in state[i]]
                e.update(where="swap", initialized=True, keys=keys, state_dtype=_dtype_name(slot.dtype),
                         chunks=chunks_of.get(i, []))
                steps[i] = _step_tensor(state[i].get("step", 0.0))
            else:
                memory_state[i] = {k: (v.detach().to("cpu", copy=True) if torch.is_tensor(v) else v)
                                   for k, v in state[i].items()}
                e.update(where="memory", initialized=True, keys=sorted(k for k in state[i] if k != "step"),
                         state_dtype=_dtype_name(dtypes[i]))
            if e["initialized"]:
                e["step"] = float(state[i].get("step", 0.0))
            entries.append(e)
        torch_groups = []
        for g in groups:
            d = {k: v for k, v in g.items() if k != "params"}
            d["params"] = [renumber[o] for o in g["params"]]
            torch_groups.append(d)
        files = {DATA: data["file"]}
        files[MEMORY] = _write_torch({"param_groups": torch_groups, "state": memory_state, "steps": steps},
                                     staged.path(MEMORY))
        if extra is not None:
            files[EXTRA] = _write_torch(extra, staged.path(EXTRA))
        manifest = _base_manifest("imported", _groups_json(torch_groups), entries,
                                  config_to_dict(cfg, only=None), unit_bytes)
        manifest["threshold"] = threshold
        manifest["units"] = data["units"]
        manifest["files"] = files
        staged.commit(manifest)
    except BaseException:
        staged.abort()
        raise
    finally:
        staged.close()
    return staged.directory


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _step_tensor(step) -> torch.Tensor:
    if torch.is_tensor(step):
        return step.detach().to("cpu", torch.float32).clone()
    return torch.tensor(float(step), dtype=torch.float32)


# -- inspection -------------------------------------------------------------------------------


def inspect_checkpoint(directory: str | os.PathLike) -> str:
    """A human-readable summary of a checkpoint's manifest (no data is read)."""
    m = read_manifest(directory)
    offloaded = [e for e in m["params"] if e.get("where") == "swap" and e.get("initialized")]
    in_memory = [e for e in m["params"] if e.get("where") == "memory"]
    lines = [
        f"checkpoint: {os.path.abspath(os.fspath(directory))}",
        f"format: {m['format']} v{m['version']} (library {m.get('library_version')}, torch {m.get('torch_version')})",
        f"created: {m.get('created')}   optimizer: {m.get('optimizer')}   step: {m.get('step')}"
        + (f" (steps {m['steps']})" if len(m.get("steps", [])) > 1 else ""),
        f"parameters: {len(m['params'])} ({len(offloaded)} with state on disk, {len(in_memory)} in memory, "
        f"{len(m['params']) - len(offloaded) - len(in_memory)} without state)",
        f"units: {len(m['units'])} of up to {m.get('buffer_size')} bytes",
    ]
    for gi, g in enumerate(m["param_groups"]):
        hyper = ", ".join(f"{k}={g[k]}" for k in ("lr", "betas", "eps", "weight_decay", "amsgrad",
                                                   "decoupled_weight_decay") if k in g)
        lines.append(f"group {gi}: {len(g['params'])} params; {hyper}")
    for name, f in sorted(m["files"].items()):
        lines.append(f"file {name}: {f['bytes']} bytes, xxh3_64 {f['xxh3_64']}")
    return "\n".join(lines)


# -- retention --------------------------------------------------------------------------------


@dataclass
class _Entry:
    step: int
    path: str


class Retention:
    """Periodic checkpoints under ``root``: keep the last ``keep_last`` plus milestones.

    Checkpoints are named ``step-<step>`` (zero-padded). A milestone is kept for good: a step for
    which ``milestones`` says so (a set of steps, or a function of the step), or one saved with
    ``milestone=True`` (marked by a ``step-<step>.keep`` file next to it; delete that file to let
    it go). Older checkpoints are deleted only after the newest one has been read back and
    verified.

    Example::

        keep = Retention("/ckpt", keep_last=2, milestones=lambda step: step % 10_000 == 0)
        if keep.latest() is not None:
            extra = load_checkpoint(opt, keep.latest())
        ...
        keep.save(opt, step, extra={"model": model.state_dict(), "step": step})
    """

    _NAME = re.compile(r"^step-(\d+)$")

    def __init__(self, root: str | os.PathLike, keep_last: int = 2,
                 milestones: Iterable[int] | Callable[[int], bool] = (), *, verify: bool = True):
        if not isinstance(keep_last, int) or keep_last < 1:
            raise ValueError(f"keep_last must be at least 1, got {keep_last!r}")
        self.root = os.path.abspath(os.fspath(root))
        self.keep_last = keep_last
        self._is_milestone = milestones if callable(milestones) else set(milestones).__contains__
        self.verify = verify

    def path_for(self, step: int) -> str:
        return os.path.join(self.root, f"step-{int(step):010d}")

    def checkpoints(self) -> list[str]:
        """Complete checkpoints (those with a manifest), oldest first."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        found = []
        for n in names:
            m = self._NAME.match(n)
            if m and os.path.isfile(os.path.join(self.root, n, MANIFEST)):
                found.append(_Entry(int(m[1]), os.path.join(self.root, n)))
        return [e.path for e in sorted(found, key=lambda e: e.step)]

    def latest(self) -> Optional[str]:
        """The newest complete checkpoint, or None."""
        found = self.checkpoints()
        return found[-1] if found else None

    def is_milestone(self, path: str) -> bool:
        m = self._NAME.match(os.path.basename(path))
        return os.path.exists(path + ".keep") or (m is not None and bool(self._is_milestone(int(m[1]))))

    def save(self, optimizer, step: int, *, extra: Any = None, milestone: bool = False) -> str:
        """Save ``step``, verify it, then delete what is no longer kept; returns its directory."""
        os.makedirs(self.root, exist_ok=True)
        path = save_checkpoint(optimizer, self.path_for(step), extra=extra)
        if milestone:
            with open(path + ".keep", "w"):
                pass
        if self.verify:
            verify_checkpoint(path)
        self.prune()
        return path

    def prune(self) -> list[str]:
        """Delete checkpoints beyond the last ``keep_last`` that are not milestones; returns them."""
        for n in os.listdir(self.root) if os.path.isdir(self.root) else ():
            if ".tmp-del-" in n:  # a deletion that a crash interrupted
                shutil.rmtree(os.path.join(self.root, n), ignore_errors=True)
        found = self.checkpoints()
        removed = []
        for path in found[: max(0, len(found) - self.keep_last)]:
            if not self.is_milestone(path):
                _remove_tree(path)
                removed.append(path)
        return removed


def save_with_retention(optimizer, root: str | os.PathLike, step: int, *, keep_last: int = 2,
                        milestones: Iterable[int] | Callable[[int], bool] = (), extra: Any = None,
                        milestone: bool = False) -> str:
    """``Retention(root, keep_last, milestones).save(optimizer, step, ...)`` in one call."""
    return Retention(root, keep_last, milestones).save(optimizer, step, extra=extra, milestone=milestone)
