"""Safetensors checkpoints as Hugging Face lays them out: one ``model.safetensors``, or shards listed by
``model.safetensors.index.json``; each file's header read (no tensor data) and checked."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import warnings
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional

import torch
import xxhash

from ..commit import fsync_path, is_staged, rename
from ..config.files import CONFIG_LIMIT
from ..errors import CheckpointError
from ..locks import lock_directory
from ..regular import SMALL_FILE_LIMIT, FileTooLargeError, NotRegularFileError, open_regular, read_regular

__all__ = ["DTYPES", "INDEX", "SINGLE", "Entry", "SafetensorsCheckpoint", "dtype_name"]

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"

# The safetensors format's names for torch dtypes (its specification, README "Format").
DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.update(F8_E4M3=torch.float8_e4m3fn, F8_E5M2=torch.float8_e5m2)
_NAMES = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of ``dtype``."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise CheckpointError(f"safetensors has no dtype for {dtype}") from None


@dataclass(frozen=True)
class Entry:
    """One tensor of a checkpoint: its file, shape and dtype, and where its bytes lie in the file (``nbytes``
    from byte ``offset``)."""

    name: str
    file: str
    shape: tuple
    dtype: torch.dtype
    offset: Optional[int] = None  # None: unknown (dropped from the page cache only with its whole file)
    nbytes: int = 0


# The record a save of this library leaves in the entry point of a checkpoint (model.safetensors' header
# metadata, as a JSON string, or the index's metadata): its generation, its files, and the xxh3_64 of its config
# files. offload.pretrained.save writes it and reads it to know what it may replace; a load checks the config
# files against it.
RECORD = "nvme_offload"
RECORD_FORMAT = "nvme-offload-hf-save"


def is_record(value) -> bool:
    """Whether ``value`` is a save's record, well formed (its names bare file names)."""
    return (isinstance(value, dict) and value.get("format") == RECORD_FORMAT and isinstance(value.get("files"), list)
            and all(isinstance(n, str) and os.path.basename(n) == n and n not in ("", ".", "..")
                    for n in value["files"]) and isinstance(value.get("config", {}), dict)
            and isinstance(value.get("generation"), str))


def read_record(directory: str) -> Optional[dict]:
    """The record of the save of ours that loaders find in ``directory`` (in model.safetensors' header, which
    they read first, else in the index), or None: no entry point, or one no save of ours wrote."""
    single, index = os.path.join(directory, SINGLE), os.path.join(directory, INDEX)
    try:
        if os.path.lexists(single):
            fd = open_regular(single)
            try:
                head = os.pread(fd, 8, 0)
                n = int.from_bytes(head, "little") if len(head) == 8 else 0
                if n > SMALL_FILE_LIMIT:
                    return None
                header = json.loads(os.pread(fd, n, 8))
            finally:
                os.close(fd)
            raw = header.get("__metadata__", {}).get(RECORD) if isinstance(header, dict) else None
            value = json.loads(raw) if isinstance(raw, str) else None
        elif os.path.lexists(index):
            doc = json.loads(read_regular(index, limit=SMALL_FILE_LIMIT))
            value = doc.get("metadata", {}).get(RECORD) if isinstance(doc, dict) else None
        else:
            return None
    except (OSError, ValueError, AttributeError):
        return None
    return value if is_record(value) else None


STAGING = ".nvme-offload-save."  # the prefix of a save's staging directory inside its target (save.py)


def _check_config(directory: str) -> None:
    """Refuse a directory whose config files are not those its weights were saved with, where a save of ours
    recorded them and left its staging directory: a save into it cut short between the two (it moves config
    files in before its weights). Without one, the file was edited since the save: said, and used as it is."""
    record = read_record(directory)
    for name, digest in (record or {}).get("config", {}).items():
        path = os.path.join(directory, name)
        try:
            found = xxhash.xxh3_64(read_regular(path, limit=SMALL_FILE_LIMIT)).hexdigest()
        except (OSError, ValueError):
            found = None
        if found == digest:
            continue
        if found is not None and not any(n.startswith(STAGING) for n in os.listdir(directory)):
            warnings.warn(f"{path} is not the {name} the weights were saved with (edited since?); it is used as it "
                          "is", RuntimeWarning, stacklevel=4)
            continue
        raise CheckpointError(
            f"{path} is not the {name} the weights in {directory} were saved with (a save into the directory "
            "was cut short before its weights were in place): it holds parts of two saves. Save the model "
            "there again")


MARKER = "save.json"  # a staging directory's marker: what its save moves in, its entry point, what it replaces


def _entry_record(path: str) -> Optional[dict]:
    """The record in the entry point file ``path`` itself (an index, or a single file), or None."""
    d, name = os.path.split(path)
    if name == INDEX:
        try:
            doc = json.loads(read_regular(path, limit=SMALL_FILE_LIMIT))
            value = doc.get("metadata", {}).get(RECORD)
        except (OSError, ValueError, AttributeError):
            return None
        return value if is_record(value) else None
    return read_record(d) if name == SINGLE else None


def _regular(path: str) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _unlink(path: str) -> None:
    """Delete ``path`` if it is a regular file (never a directory, a link's target or anything else)."""
    if _regular(path):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _remove_staging(stage: str) -> None:
    """Delete a staging directory of ours: its regular files, its marker last (while anything else is in it, the
    marker proves it ours to the next save), then it (left if anything else is in it)."""
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for name in sorted(os.listdir(stage), key=lambda n: n == MARKER):
            _unlink(os.path.join(stage, name))
    with contextlib.suppress(OSError):
        os.rmdir(stage)


def _marker(stage: str) -> Optional[dict]:
    """The marker of staging directory ``stage`` if it is ours (a directory of this user, holding the marker
    of its own generation), else None."""
    try:
        st = os.lstat(stage)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            return None
        doc = json.loads(read_regular(os.path.join(stage, MARKER), limit=SMALL_FILE_LIMIT))
    except (OSError, ValueError):
        return None
    generation = os.path.basename(stage)[len(STAGING):]
    names = [*doc.get("moved", []), *doc.get("obsolete", []), doc.get("entry") or SINGLE] if isinstance(doc, dict) \
        else []
    if (not isinstance(doc, dict) or doc.get("generation") != generation
            or not all(isinstance(n, str) and os.path.basename(n) == n and n not in ("", ".", "..") for n in names)
            or not isinstance(doc.get("backups", {}), dict)):
        return None
    return doc


def _barely_begun(stage: str) -> bool:
    """Whether ``stage`` is a staging directory of this user holding nothing but (part of) its first marker: a
    save that died as it began, which moved nothing in."""
    try:
        st = os.lstat(stage)
        names = os.listdir(stage)
    except OSError:
        return False
    return (stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()
            and all(n in (MARKER, MARKER + ".new") or is_staged(n, MARKER) for n in names)
            and all(_regular(os.path.join(stage, n)) for n in names))


def _finish(directory: str, stage: str, obsolete: Iterable[str], files: Iterable[str]) -> None:
    """A committed save's last step: delete the previous save's files it made obsolete (never one of its own,
    ``files``), then its staging directory."""
    keep = set(files)
    for n in obsolete:
        if n not in keep:
            _unlink(os.path.join(directory, n))
    fsync_path(directory)
    _remove_staging(stage)
    fsync_path(directory)


def _roll_back(directory: str, stage: str, doc: dict) -> None:
    """Undo a save that never committed (its marker ``doc``): the config files it replaced put back, the files
    it moved in deleted, then its staging directory; the previous save stays as it was."""
    for n, backup in doc.get("backups", {}).items():
        if _regular(os.path.join(stage, backup)):
            rename(os.path.join(stage, backup), os.path.join(directory, n))
    if doc.get("entry") == INDEX and os.path.lexists(os.path.join(directory, SINGLE)):
        # An index moved in behind a model.safetensors that still wins (a model.safetensors of this save would
        # have committed it, so it is never deleted here).
        found = _entry_record(os.path.join(directory, INDEX)) if _regular(os.path.join(directory, INDEX)) else None
        if found is not None and found["generation"] == doc["generation"]:
            _unlink(os.path.join(directory, INDEX))
    for n in doc.get("moved", []):
        _unlink(os.path.join(directory, n))
    fsync_path(directory)
    _remove_staging(stage)
    fsync_path(directory)


def _settle(directory: str, stage: str) -> None:
    """Finish or undo the save that staging directory ``stage`` belongs to, as the disk says: committed when the
    record loaders find in ``directory`` is of the stage's generation (its rename, or the deletion of the
    model.safetensors in front of its index, happened), else never. The one rule for a save cut short, whether
    the next save sweeps it or the save itself unwinds from an exception. A stage not provably ours is left."""
    doc = _marker(stage)
    if doc is None:
        if _barely_begun(stage):
            _remove_staging(stage)  # died before it wrote its marker: nothing of it moved in
        return
    record = read_record(directory)
    if record is not None and record["generation"] == doc["generation"]:
        _finish(directory, stage, doc.get("obsolete", []), record["files"])
    else:
        _roll_back(directory, stage, doc)


def _sweep(directory: str) -> None:
    """Finish or undo what saves cut short left in ``directory`` (see the note above); under its lock."""
    for name in os.listdir(directory):
        if name.startswith(STAGING):
            _settle(directory, os.path.join(directory, name))


def settle_cut_short(directory: str) -> None:
    """Finish or undo, before a load, a save into ``directory`` that was cut short (a crash, a power loss), as the
    next save would (:func:`_sweep`): the load then reads the previous save or the new one whole, never config
    files of one beside the weights of the other. Nothing where no staging directory is there; a directory this
    user may not lock or change, or whose lock a save holds now, is read as it is (its loader refuses a mix)."""
    try:
        if not any(n.startswith(STAGING) for n in os.listdir(directory)):
            return
        # Without waiting: a save in progress there (another process's, or one in this process whose tensors this
        # load feeds) holds the lock and settles its own staging; the load reads what is there meanwhile.
        held = lock_directory(directory, exclusive=True, timeout=0)
    except (OSError, CheckpointError):
        return
    try:
        with contextlib.suppress(OSError):
            _sweep(directory)
    finally:
        if held is not None:
            held.release()


def not_regular(err: OSError, what: str) -> CheckpointError:
    """The error for a checkpoint's file that is not a regular file (``err``, from :mod:`offload.regular`)."""
    return CheckpointError(f"{err.filename} is {err.strerror}: {what} is a regular file, so this checkpoint was "
                           "tampered with or is not one; nothing was read from it")


# NOTE: the safetensors package opens a file by its name. Each shard is opened here first, checked to be a
# regular file on the descriptor itself, and handed over as /proc/self/fd/N: what safetensors opens is the
# file that was checked, never a FIFO (which would block the open for ever) or a device swapped in by name.
@contextlib.contextmanager
def regular_shard(file: str) -> Iterator[str]:
    """A name under which ``file``, checked to be a regular file, is opened (valid inside the block).

    Raises:
        CheckpointError: ``file`` is not a regular file.
        OSError: it cannot be opened (``FileNotFoundError``, ...).
    """
    try:
        fd = open_regular(file)
    except NotRegularFileError as err:
        raise not_regular(err, "a safetensors shard") from None
    try:
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


def _data_ranges(file: str) -> dict[str, tuple[int, int]]:
    """``{name: (offset, nbytes)}`` of each tensor's bytes in the safetensors ``file``, from its header (read
    after ``safe_open`` has checked it: an 8-byte little-endian length, then that much JSON; offsets count
    from the header's end). Only used to drop pages from the page cache: a range that does not fit the
    file is left out."""
    with os.fdopen(open_regular(file), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n)) if 8 + n <= size else {}
    out = {}
    for name, v in header.items():
        a, b = v.get("data_offsets", (0, -1)) if isinstance(v, dict) and name != "__metadata__" else (0, -1)
        if isinstance(a, int) and isinstance(b, int) and 0 <= a <= b and 8 + n + b <= size:
            out[name] = (8 + n + a, b - a)
    return out


def _drop_range(file: str, start: int, length: int) -> None:
    """``length`` bytes of ``file`` from ``start`` (0: to its end) out of the page cache; advice, nothing raised
    (pages mapped, or still being read ahead, stay)."""
    try:
        fd = os.open(file, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, start, length, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass
    finally:
        os.close(fd)


def _several_here() -> bool:
    """Whether other ranks of this process's job may run on this machine (sharing its page cache): torchrun's
    ``LOCAL_WORLD_SIZE``, else the job's world size (torch.distributed's, else ``WORLD_SIZE``); a value that
    cannot be read counts as several."""
    value = os.environ.get("LOCAL_WORLD_SIZE")
    if value is None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_world_size() > 1
        value = os.environ.get("WORLD_SIZE", "1")
    try:
        return int(value) > 1
    except ValueError:
        return True


# Bytes before a read that the kernel may read with it (its read-around on a fault is up to the read-ahead
# size, 8 MiB on the disks measured, centred on the fault): dropped again after each read.
_READ_AROUND = 16 << 20


# NOTE: the ``safetensors`` package maps a whole file and copies slices out of the mapping. Pages of a mapping
# count in the process's RSS for as long as it stays mapped, so a shard kept open while all its tensors are
# read would show the whole shard in memory. Each read maps the file anew and drops the mapping when done:
# what is resident from a checkpoint is the slice being read. Its pages in the page cache are dropped too
# once copied (``drop_behind``): a load of a checkpoint larger than memory does not push the rest of the
# cache out, and the pages freed serve the next reads (on a virtual machine whose host backs guest memory
# lazily, pages the guest never used cost a fault on the host each: loads ran 1.5x faster here). Not where
# other ranks of a job may run on the machine, which may read the same shards at once from one cache.
class SafetensorsCheckpoint:
    """A safetensors checkpoint's files: every tensor's name, shape and dtype from their headers, and
    :meth:`read` for slices of them. Usable as a context manager.

    Args:
        path: a ``.safetensors`` file, or a directory holding ``model.safetensors.index.json`` (shards) or
            ``model.safetensors``.
        drop_behind: drop what :meth:`read_into` has read from the page cache (see the note above); None:
            unless other ranks of a job may run on this machine (``LOCAL_WORLD_SIZE``, else the world size,
            above 1).

    Raises:
        CheckpointError: no checkpoint there, a shard the index names is missing, an index or header is
            corrupt, or two files hold the same name; each message names the file and what to do.
    """

    def __init__(self, path: str | os.PathLike, *, drop_behind: Optional[bool] = None):
        from safetensors import safe_open

        path = os.fspath(path)
        self.path = path
        self.drop_behind = not _several_here() if drop_behind is None else bool(drop_behind)
        self._unread: dict[str, set] = {}  # file -> names of its tensors not read to their end yet
        self._touched: set[str] = set()  # files read_into has read from
        if os.path.isdir(path):
            settle_cut_short(path)
        self.files = self._files(path)
        if os.path.isdir(path):
            _check_config(path)
        self.entries: dict[str, Entry] = {}
        try:
            for file in self.files:
                try:
                    with regular_shard(file) as opened:
                        handle = safe_open(opened, framework="pt")
                    names = list(handle.keys())
                    found = {}
                    for name in names:
                        s = handle.get_slice(name)
                        dtype = DTYPES.get(s.get_dtype())
                        if dtype is None:
                            raise CheckpointError(f"{file}: tensor {name!r} has dtype {s.get_dtype()}, which this "
                                                  "loader does not know; convert the checkpoint to F32/F16/BF16")
                        found[name] = (tuple(s.get_shape()), dtype)
                    ranges = _data_ranges(file)
                    found = {name: Entry(name, file, shape, dtype, *ranges.get(name, (None, 0)))
                             for name, (shape, dtype) in found.items()}
                except CheckpointError:
                    raise
                except Exception as err:  # safetensors raises its own SafetensorError, or OSError
                    if isinstance(err, FileNotFoundError):
                        raise CheckpointError(f"{file}: missing ({err}); copy the whole checkpoint again") from err
                    raise CheckpointError(
                        f"{file}: not a readable safetensors file ({err}); its header or size is corrupt. Download "
                        "or save the checkpoint again") from err
                del handle  # unmapped
                for name, e in found.items():
                    if name in self.entries:
                        raise CheckpointError(f"{file} and {self.entries[name].file} both hold {name!r}; the "
                                              "checkpoint's shards overlap: save it again")
                    self.entries[name] = e
            self._check_index()
            for e in self.entries.values():
                self._unread.setdefault(e.file, set()).add(e.name)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> SafetensorsCheckpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Nothing stays open between reads; with ``drop_behind``, what is left in the page cache of the files
        read (read ahead after the last drop) is dropped once more."""
        if self.drop_behind:
            for file in self._touched:
                _drop_range(file, 0, 0)
            self._touched.clear()

    def read(self, name: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows ``[start, stop)`` of tensor ``name`` (all of a 0-d tensor), as a CPU tensor (which may share
        the file's pages until it is freed; :meth:`read_into` copies and lets them go)."""
        from safetensors import safe_open

        e = self.entries[name]
        try:
            with regular_shard(e.file) as opened:
                handle = safe_open(opened, framework="pt")
            try:
                if not e.shape:
                    return handle.get_tensor(name)
                return handle.get_slice(name)[start:stop if stop is not None else e.shape[0]]
            finally:
                del handle  # unmapped: its pages leave the RSS
        except CheckpointError:
            raise
        except Exception as err:
            raise CheckpointError(f"{e.file}: cannot read {name!r} ({err}); the file is corrupt or was changed "
                                  "while loading: download or save it again") from err

    def read_into(self, name: str, dest: torch.Tensor, start: int = 0, stop: int | None = None) -> None:
        """Copy rows ``[start, stop)`` of tensor ``name`` (all of a 0-d tensor) into ``dest`` (their shape,
        any floating-point dtype where ``name`` is one); with ``drop_behind`` their pages then leave the page
        cache (see the note above)."""
        e = self.entries[name]
        dest.copy_(self.read(name, start, stop))
        if self.drop_behind:
            self._touched.add(e.file)
            rows = (start, stop if stop is not None else e.shape[0]) if e.shape else None
            self._drop(e, rows)

    def _drop(self, e: Entry, rows: Optional[tuple[int, int]]) -> None:
        """Drop rows ``[a, b)`` of ``e`` (all of it for None), just read, from the page cache, with the rows of
        ``e`` up to :data:`_READ_AROUND` bytes before them (a fault on a new mapping reads pages behind it too,
        those of rows dropped already); never another tensor's bytes, which may not be read yet: what was read
        around into them goes with the whole file, once every tensor of it was read to its end (or at
        :meth:`close`). Advice: nothing is raised."""
        unread = self._unread.get(e.file, set())
        row = e.nbytes // e.shape[0] if e.shape and e.shape[0] else 0
        a, b = (0, e.nbytes) if rows is None else (rows[0] * row, rows[1] * row)
        if b >= e.nbytes:
            unread.discard(e.name)
        if not unread:
            _drop_range(e.file, 0, 0)  # the whole file
        elif e.offset is not None and b > a:  # (no bytes: a length of 0 would mean to the end of the file)
            start = e.offset + max(0, a - _READ_AROUND)
            _drop_range(e.file, start, e.offset + b - start)

    # -- internals ----------------------------------------------------------------------------

    def _files(self, path: str) -> list[str]:
        if os.path.lexists(path) and not os.path.isdir(path):
            return [path]  # a file: checked to be a regular one as it is opened
        if not os.path.isdir(path):
            raise CheckpointError(f"{path}: no such file or directory; give a .safetensors file or a directory "
                                  f"holding {SINGLE} or {INDEX}")
        single = os.path.join(path, SINGLE)
        if os.path.lexists(single):
            return [single]  # read first, as transformers does: a save's commit relies on it
        index = os.path.join(path, INDEX)
        if os.path.lexists(index):
            self._index_path = index
            try:
                self._index = json.loads(read_regular(index, limit=CONFIG_LIMIT))
                weight_map = self._index["weight_map"]
                if not isinstance(weight_map, dict):
                    raise TypeError("weight_map is not an object")
            except (NotRegularFileError, FileTooLargeError) as err:
                raise not_regular(err, "a safetensors index") from None
            except OSError as err:
                raise CheckpointError(f"{index}: cannot be read ({err.strerror}); copy or download the checkpoint "
                                      "again") from None
            except (ValueError, KeyError, TypeError) as err:
                raise CheckpointError(f"{index}: not a safetensors index ({err}); save the checkpoint again") from err
            if not all(isinstance(s, str) for s in weight_map.values()):
                raise CheckpointError(f"{index}: its weight_map names shards by something other than a file name; "
                                      "save the checkpoint again")
            shards = sorted(set(weight_map.values()))
            outside = [s for s in shards if os.path.basename(s) != s or s in ("", ".", "..")]
            if outside:
                raise CheckpointError(f"{index} names shards that are not files beside it ({outside[:4]}); a "
                                      "checkpoint's shards are read from its own directory only")
            missing = [s for s in shards if not os.path.lexists(os.path.join(path, s))]
            if missing:
                raise CheckpointError(
                    f"{index} lists {len(shards)} shards, {len(missing)} missing from {path}: "
                    f"{', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}; copy or download them too")
            return [os.path.join(path, s) for s in shards]
        raise CheckpointError(f"{path} holds neither {SINGLE} nor {INDEX}: not a safetensors checkpoint")

    def _check_index(self) -> None:
        index = getattr(self, "_index", None)
        if index is None:
            return
        for name, shard in index["weight_map"].items():
            e = self.entries.get(name)
            if e is None or os.path.basename(e.file) != shard:
                raise CheckpointError(f"{self._index_path} says {name!r} is in {shard}, which does not hold it; "
                                      "the index and the shards are from different saves: save the checkpoint again")
