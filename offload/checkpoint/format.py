"""The checkpoint format's names; the whole small files of a checkpoint (torch.save files, JSON), written
fsynced and read back checked; and :class:`Storage`, every call by which checkpoints touch files."""

from __future__ import annotations

import errno
import io
import json
import os
from typing import Any, Callable

import torch
import xxhash

from ..aio import Engine, create_private
from ..commit import fsync_fd, make_dirs, rename
from ..config import AioConfig
from ..errors import CheckpointError, ChecksumError
from ..regular import CHUNK, FileTooLargeError, NotRegularFileError, open_regular, read_regular

# A checkpoint is a directory of these files; what each holds is docs/checkpoint.md's "Format".
FORMAT = "nvme-offload-checkpoint"
FORMAT_VERSION = 1
# Version 2: some units of state.bin are checksummed in pieces (the store's checksums, taken by a clone save)
# and state.bin may have no checksum of its own. Written only then, so a library that reads version 1 alone
# refuses such a checkpoint by its version instead of by a field it does not know.
PIECES_VERSION = 2
MANIFEST = "manifest.json"
DATA = "state.bin"
MEMORY = "memory.pt"
EXTRA = "extra.pt"
PARAMS_DATA = "params.bin"
MODEL_MEMORY = "model.pt"
FILE_NAMES = (DATA, MEMORY, EXTRA, PARAMS_DATA, MODEL_MEMORY)
# A checkpoint of a torch.distributed job: one shard directory per rank (each an ordinary checkpoint of
# the rank's own state) and a job manifest (MANIFEST, of format JOB_FORMAT) naming them all.
JOB_FORMAT = "nvme-offload-job-checkpoint"
JOB_VERSION = 1


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``, as manifests write dtypes."""
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype named ``name`` (as :func:`dtype_name` writes it); CheckpointError if none is."""
    value = getattr(torch, str(name), None)
    if not isinstance(value, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in the manifest")
    return value


def jsonable(value: Any, *, strict: bool = False) -> Any:
    """``value`` as JSON holds it: a manifest entry by its ``to_json``, lists, tuples and dicts element by
    element, tensors as numbers (hyperparameters: exact values live in memory.pt), anything else not JSON's
    by its repr, or with ``strict`` (a manifest entry's fields, which a load checks) a TypeError."""
    if hasattr(value, "to_json"):
        return value.to_json()
    if torch.is_tensor(value):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, (list, tuple)):
        return [jsonable(v, strict=strict) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v, strict=strict) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if strict:
        raise TypeError(f"a manifest field holds {type(value).__name__} {value!r}, which JSON cannot hold")
    return repr(value)


def io_error(err: OSError, path: str, doing: str) -> OSError:
    """``err`` as ``OSError(errno, message, path)`` naming ``path`` (raise it ``from err``).

    Python's file objects raise errors of ``write``, ``flush`` and ``fsync`` without the file's
    name; torch.save turns them into a RuntimeError without the errno. This puts both back.
    """
    if err.errno is None or err.filename == path:
        return err
    return OSError(err.errno, f"{doing} {path}: {err.strerror or os.strerror(err.errno)}", path)


# The calls by which checkpoints touch files, in one object: the engine that moves the data files, and
# the file-system operations of the commit rule. Saves and loads take one (``storage=``); the default
# does what it says, and the fault tests hand in one that fails where they want.
# The small files (memory.pt, extra.pt, model.pt) are read whole, up to their manifest's size; a file larger
# than that is refused before it is read (a bigger one may be read up to this many bytes).
_SMALL_LIMIT = 1 << 20
# What copy_file_range says where it cannot copy between these two files: the copy falls back to reads
# and writes.
_NO_COPY_RANGE = frozenset({errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP,
                            errno.EBADF, errno.EPERM})


class Storage:
    """The file-system and engine calls of a save, a load or a mirror. Subclass it to inject faults."""

    def engine(self, aio: AioConfig) -> Engine:
        """The engine that moves a data file's bytes, built with ``aio``."""
        return Engine(aio)

    def rename(self, src: str, dst: str) -> None:
        """Rename the staged file ``src`` over ``dst``, a regular file or nothing (:func:`offload.commit.rename`)."""
        rename(src, dst)

    def unlink(self, path: str) -> None:
        """Remove the file ``path`` (``os.unlink``)."""
        os.unlink(path)

    def fsync(self, fd: int, path: str) -> None:
        """Make the file ``fd`` durable; an error names ``path``."""
        fsync_fd(fd, path)

    def make_dirs(self, path: str) -> bool:
        """Create directory ``path`` and its missing parents durably (:func:`offload.commit.make_dirs`, each
        directory fsynced through :meth:`fsync_dir`); returns whether ``path`` was made."""
        return make_dirs(path, self.fsync_dir)

    def fsync_dir(self, path: str) -> None:
        """Make the entries of directory ``path`` durable (an fsync of the directory)."""
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            self.fsync(fd, path)
        finally:
            os.close(fd)

    def copy_file(self, src: str, dst: str, bar) -> None:
        """Copy ``src`` to the new file ``dst`` and fsync it (``copy_file_range``, else reads and writes),
        counting the bytes on the progress bar ``bar``."""
        try:
            fin = os.fdopen(open_regular(src, follow=False), "rb")
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {os.path.dirname(src)} is missing {os.path.basename(src)}, which "
                                  "its manifest lists") from None
        except NotRegularFileError as err:
            raise not_regular(err, src) from None
        with fin:
            try:
                # A copy never lets more people read it than its original does.
                with create_private(dst, within=os.fstat(fin.fileno()).st_mode) as fout:
                    size = os.fstat(fin.fileno()).st_size
                    pos, ranged = 0, True
                    while pos < size:
                        want = min(CHUNK, size - pos)
                        if ranged:
                            try:
                                n = os.copy_file_range(fin.fileno(), fout.fileno(), want, pos, pos)
                            except OSError as err:
                                if err.errno not in _NO_COPY_RANGE:
                                    raise
                                ranged = False
                                continue
                        else:
                            data = os.pread(fin.fileno(), min(want, 8 << 20), pos)
                            n = len(data)
                            view = memoryview(data)
                            while view:
                                view = view[os.pwrite(fout.fileno(), view, pos + n - len(view)):]
                        if n == 0:
                            raise ChecksumError(f"{src}: ends at byte {pos}, {size} expected (it shrank while "
                                                "copied)")
                        pos += n
                        bar.update(n)
                    fout.flush()
                    self.fsync(fout.fileno(), dst)
            except OSError as err:
                raise io_error(err, dst, "cannot copy to") from err


DEFAULT_STORAGE = Storage()


# -- writing ------------------------------------------------------------------------------------------


class Serialized(bytes):
    """A torch.save of an object taken earlier (:func:`torch_bytes`), to be written as it is."""


def torch_bytes(obj: Any) -> Serialized:
    """What :func:`write_file` would write for ``obj``, in memory (a copy taken now, written later)."""
    out = io.BytesIO()
    torch.save(obj, out)
    return Serialized(out.getvalue())


class JSON:
    """A value :func:`write_file` writes as JSON."""

    def __init__(self, value: Any):
        self.value = value


class _HashingWriter:
    """A file object that hashes what passes through it (for torch.save).

    torch.save reports a failed ``write`` as ``RuntimeError: [enforce fail at inline_container.cc]``
    without errno or path, so the first OSError is kept here for :func:`write_file` to raise.
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


def write_file(obj: Any, path: str, fsync: Callable[[int, str], None], *, within: int = 0o777) -> dict:
    """Write ``obj`` into the new file ``path`` (mode ``within`` at most) and fsync it with ``fsync(fd,
    path)``: :class:`Serialized` bytes as they are, a :class:`JSON` value as JSON, else ``torch.save(obj)``
    (plain bytes too: a user's ``extra=b"..."`` is an object like any other). Returns the file's size and
    xxh3_64; an OSError names ``path``."""
    try:
        with create_private(path, within=within) as f:
            w = write_into(obj, f, path)
            fsync(f.fileno(), path)
    except OSError as err:  # the file's close (a flush) fails too, after write_into named the path
        raise io_error(err, path, "cannot write") from err
    return {"bytes": w.nbytes, "xxh3_64": w.hash.hexdigest()}


def write_into(obj: Any, f, path: str) -> _HashingWriter:
    """Write ``obj`` (as :func:`write_file` does) into the open file ``f`` of ``path``, flushed; returns what
    hashed it (its ``nbytes`` and ``hash``). An OSError names ``path``."""
    w = _HashingWriter(f)
    try:
        if isinstance(obj, Serialized):
            w.write(obj)
        elif isinstance(obj, JSON):
            w.write((json.dumps(obj.value, indent=1, sort_keys=True) + "\n").encode())
        else:
            torch.save(obj, w)
        w.flush()
    except OSError as err:
        raise io_error(err, path, "cannot write") from err
    except RuntimeError:
        if w.error is None:
            raise
        raise io_error(w.error, path, "cannot write") from w.error
    return w


# -- reading ------------------------------------------------------------------------------------------


def not_regular(err: OSError, path: str) -> CheckpointError:
    """The error for a checkpoint file ``path`` that is not a regular file (``err``, from :mod:`offload.regular`)."""
    return CheckpointError(f"{path} is {err.strerror}: a checkpoint's files are regular files its save wrote, so "
                           "this one was replaced or tampered with; nothing was read from it. Load another checkpoint")


def read_checked(path: str, entry) -> bytes:
    """The bytes of the checkpoint file ``path``, checked against its ``manifest.FileEntry`` (size and
    xxh3_64: ChecksumError where either differs). A FIFO or a device is a CheckpointError, never read;
    no more than the manifest's size (and one byte) is read."""
    try:
        data = read_regular(path, limit=max(entry.bytes, _SMALL_LIMIT), size=entry.bytes)
    except (NotRegularFileError, FileTooLargeError) as err:
        if isinstance(err, FileTooLargeError):
            raise ChecksumError(f"{path}: {err.strerror}, the manifest says {entry.bytes} bytes (replaced or "
                                "corrupt); load an older checkpoint") from None
        raise not_regular(err, path) from None
    except OSError as err:
        raise io_error(err, path, "cannot read") from err
    found = xxhash.xxh3_64(data).hexdigest()
    if len(data) != entry.bytes or found != entry.xxh3_64:
        raise ChecksumError(f"{path}: {len(data)} bytes with xxh3_64 {found}, the manifest says {entry.bytes} bytes "
                            f"with {entry.xxh3_64} (truncated, replaced or corrupt); load an older checkpoint")
    return data


def read_torch(path: str, entry) -> Any:
    """``torch.load`` (weights only, to the CPU) of the checkpoint file ``path``, checked as :func:`read_checked`."""
    return torch.load(io.BytesIO(read_checked(path, entry)), map_location="cpu", weights_only=True)
