"""Safetensors checkpoints as Hugging Face lays them out: one ``model.safetensors``, or shards listed by
``model.safetensors.index.json``; each file's header read (no tensor data) and checked, and tensors' bytes read
from the files by the engine."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
import struct
from collections import deque
from dataclasses import dataclass
from typing import Optional

import torch

from ..aio import AioFile, Engine, wait_quietly, wrap_fd
from ..buffers import BufferPool
from ..config import AioConfig
from ..errors import CheckpointError
from ..units import ALIGNMENT, round_up

__all__ = ["DTYPES", "INDEX", "SINGLE", "Entry", "SafetensorsCheckpoint", "TensorReader", "dtype_name"]

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
    """One tensor of a checkpoint: its file, shape and dtype, and where its bytes are in the file (``offset``,
    from the file's start, and ``nbytes``)."""

    name: str
    file: str
    shape: tuple
    dtype: torch.dtype
    offset: int = 0
    nbytes: int = 0


# NOTE: the ``safetensors`` package maps a whole file and copies slices out of the mapping. Pages of a mapping
# count in the process's RSS for as long as it stays mapped, so a shard kept open while all its tensors are
# read would show the whole shard in memory. Each read maps the file anew and drops the mapping when done:
# what is resident from a checkpoint is the slice being read.
class SafetensorsCheckpoint:
    """A safetensors checkpoint's files: every tensor's name, shape and dtype from their headers, and
    :meth:`read` for slices of them. Usable as a context manager.

    Args:
        path: a ``.safetensors`` file, or a directory holding ``model.safetensors.index.json`` (shards) or
            ``model.safetensors``.

    Raises:
        CheckpointError: no checkpoint there, a shard the index names is missing, an index or header is
            corrupt, or two files hold the same name; each message names the file and what to do.
    """

    def __init__(self, path: str | os.PathLike):
        from safetensors import safe_open

        path = os.fspath(path)
        self.path = path
        self.files = self._files(path)
        self.entries: dict[str, Entry] = {}
        self._identity: dict[str, tuple] = {}
        try:
            for file in self.files:
                identity, layout = _layout(file)
                self._identity[file] = identity
                try:
                    handle = safe_open(file, framework="pt")
                    names = list(handle.keys())
                    found = {}
                    for name in names:
                        s = handle.get_slice(name)
                        dtype = DTYPES.get(s.get_dtype())
                        if dtype is None:
                            raise CheckpointError(f"{file}: tensor {name!r} has dtype {s.get_dtype()}, which this "
                                                  "loader does not know; convert the checkpoint to F32/F16/BF16")
                        found[name] = _entry(file, name, tuple(s.get_shape()), dtype, layout)
                except CheckpointError:
                    raise
                except Exception as err:  # safetensors raises its own SafetensorError, or OSError
                    if isinstance(err, FileNotFoundError):
                        raise CheckpointError(f"{file}: missing ({err}); copy the whole checkpoint again") from err
                    raise _unreadable(file, err) from err
                del handle  # unmapped
                for name, e in found.items():
                    if name in self.entries:
                        raise CheckpointError(f"{file} and {self.entries[name].file} both hold {name!r}; the "
                                              "checkpoint's shards overlap: save it again")
                    self.entries[name] = e
            self._check_index()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> SafetensorsCheckpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Nothing stays open between reads; here for the context manager."""

    def read(self, name: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows ``[start, stop)`` of tensor ``name`` (all of a 0-d tensor), as a new CPU tensor."""
        from safetensors import safe_open

        e = self.entries[name]
        try:
            handle = safe_open(e.file, framework="pt")
            try:
                if not e.shape:
                    return handle.get_tensor(name)
                return handle.get_slice(name)[start:stop if stop is not None else e.shape[0]]
            finally:
                del handle  # unmapped: its pages leave the RSS
        except Exception as err:
            raise CheckpointError(f"{e.file}: cannot read {name!r} ({err}); the file is corrupt or was changed "
                                  "while loading: download or save it again") from err

    # -- internals ----------------------------------------------------------------------------

    def _files(self, path: str) -> list[str]:
        if os.path.isfile(path):
            return [path]
        if not os.path.isdir(path):
            raise CheckpointError(f"{path}: no such file or directory; give a .safetensors file or a directory "
                                  f"holding {SINGLE} or {INDEX}")
        index = os.path.join(path, INDEX)
        if os.path.isfile(index):
            self._index_path = index
            try:
                with open(index) as f:
                    self._index = json.load(f)
                weight_map = self._index["weight_map"]
                if not isinstance(weight_map, dict):
                    raise TypeError("weight_map is not an object")
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
            missing = [s for s in shards if not os.path.isfile(os.path.join(path, s))]
            if missing:
                raise CheckpointError(
                    f"{index} lists {len(shards)} shards, {len(missing)} missing from {path}: "
                    f"{', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}; copy or download them too")
            return [os.path.join(path, s) for s in shards]
        single = os.path.join(path, SINGLE)
        if os.path.isfile(single):
            return [single]
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


def _unreadable(file: str, why) -> CheckpointError:
    return CheckpointError(f"{file}: not a readable safetensors file ({why}); its header or size is corrupt. "
                           "Download or save the checkpoint again")


def _open_regular(file: str) -> tuple[int, os.stat_result]:
    """``(fd, its stat)`` of ``file`` open for reading: a regular file (a FIFO is not waited on, a device not
    read). Links are followed: the Hugging Face hub's cache links each snapshot's files to its blobs."""
    try:
        fd = os.open(file, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError as err:
        raise CheckpointError(f"{file}: missing ({err}); copy the whole checkpoint again") from err
    except OSError as err:
        raise CheckpointError(f"{file}: cannot open it ({err}); check its permissions") from err
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{file} is not a regular file; a checkpoint's weights are read from files only")
        return fd, st
    except BaseException:
        os.close(fd)
        raise


def _layout(file: str) -> tuple[tuple, dict[str, tuple[int, int]]]:
    """The file's identity (device, inode, size, mtime) and ``{name: (offset from the file's start, bytes)}`` from
    its header, every tensor's bytes checked to lie inside the file.

    The ``safetensors`` package checks the header in full but does not say where the bytes are; this reads the
    same header (8 bytes of length, then JSON) for that, and checks what it reads against the file's size itself.
    """
    fd, st = _open_regular(file)
    try:
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            raise _unreadable(file, f"{st.st_size} bytes, shorter than a header")
        (length,) = struct.unpack("<Q", head)
        if length > st.st_size - 8:
            raise _unreadable(file, f"a header of {length} bytes in a file of {st.st_size}")
        text = os.pread(fd, length, 8)
    finally:
        os.close(fd)
    if len(text) != length:
        raise _unreadable(file, f"its header of {length} bytes ends early: the file changed while it was read")
    try:
        header = json.loads(text)
        if not isinstance(header, dict):
            raise ValueError("not a JSON object")
    except ValueError as err:
        raise _unreadable(file, f"its header is not JSON: {err}") from err
    start, out = 8 + length, {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] <= st.st_size - start):
            raise _unreadable(file, f"tensor {name!r} has data_offsets {offsets!r} outside its "
                                    f"{st.st_size - start} bytes of data")
        out[name] = (start + offsets[0], offsets[1] - offsets[0])
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns), out


def _entry(file: str, name: str, shape: tuple, dtype: torch.dtype, layout: dict) -> Entry:
    """``name``'s :class:`Entry`, its place from ``layout`` checked against its shape and dtype."""
    place = layout.get(name)
    nbytes = dtype.itemsize
    for d in shape:
        nbytes *= d
    if place is None or place[1] != nbytes:
        raise _unreadable(file, f"tensor {name!r} of shape {list(shape)} takes {nbytes} bytes, its header gives "
                                f"{place[1] if place else 'no'} bytes")
    return Entry(name, file, shape, dtype, place[0], nbytes)


@dataclass
class _Span:
    """One read: the file's aligned bytes ``[lo, round_up(end))`` into one buffer, holding ``pieces``,
    ``(entry, first byte, byte after the last)`` of the entries' data, contiguous in the file."""

    file: str
    lo: int
    end: int
    pieces: list


def _spans(order: list[Entry], capacity: int, alignment: int) -> list[_Span]:
    """The reads that bring ``order``'s bytes, in that order: entries contiguous in one file share a read, an
    entry larger than a buffer is cut at element boundaries, and no read is longer than ``capacity`` once its
    ends are aligned."""
    spans: list[_Span] = []
    cur = None
    for e in order:
        pos, end, size = e.offset, e.offset + e.nbytes, e.dtype.itemsize
        while pos < end:
            if cur is None or cur.file != e.file or cur.end != pos or cur.lo + capacity - pos < size:
                cur = _Span(e.file, pos // alignment * alignment, pos, [])
                spans.append(cur)
            take = min(end - pos, (cur.lo + capacity - pos) // size * size)
            cur.pieces.append((e, pos - e.offset, pos - e.offset + take))
            cur.end = pos = pos + take
    return spans


# NOTE: ``safetensors`` reads a tensor by copying it out of a memory map of its file: each few pages are a page
# fault and a small synchronous read, one at a time, which ran at well under the disk's speed and was most of a
# load's time. Here the engine reads the bytes instead: O_DIRECT (where the file system has it) into a few
# page-aligned buffers, large aligned spans with several requests in flight, the next spans read while the
# current one is copied into its tensor (converted to its dtype) and that tensor is written on. Spans follow the
# order the loader will ask for the tensors in; a tensor asked for out of that order is read from the memory map
# (``SafetensorsCheckpoint.read``), which is right in any order, only slower. Every byte read was checked against
# the file's size from its header, and a file that is not the one whose header was read is refused.
class TensorReader:
    """Tensors of a :class:`SafetensorsCheckpoint` read by the engine, ahead of their use, in a given order.

    Nothing is opened until the first :meth:`copy_into`, which brings the engine settings (those of the
    swap space the tensors go to). Usable as a context manager.

    Args:
        ckpt: the checkpoint, its headers checked.
        order: the entries in the order :meth:`copy_into` will be asked for them.
        buffer_size: bytes per read at most (rounded up to the files' direct-I/O alignment).
        count: buffers, so reads in flight at most.
    """

    def __init__(self, ckpt: SafetensorsCheckpoint, order: list[Entry], *, buffer_size: int = 4 << 20,
                 count: int = 4):
        self._ckpt = ckpt
        self._order = list({(e.file, e.offset): e for e in order if e.nbytes}.values())
        self._buffer_size, self._count = buffer_size, count
        self._engine = self._pool = None
        self._files: dict = {}
        self._spans: list[_Span] = []
        self._first: dict[tuple, int] = {}  # (file, offset) -> the span holding the entry's first byte
        self._queue: deque = deque()  # (span index, buffer, future), consecutive spans from the oldest
        self._next = 0  # the next span to read
        self._free: deque = deque()

    def copy_into(self, entry: Entry, dest: torch.Tensor, aio: Optional[AioConfig] = None) -> bool:
        """Copy ``entry``'s values into ``dest`` (contiguous, its shape; converted to its dtype).

        Returns:
            False, having copied nothing, where ``entry`` is not next in the order (read it from the memory map).

        Raises:
            CheckpointError: a file is not the one whose header was read, or is shorter.
            OSError: a read failed (naming the file).
        """
        key = (entry.file, entry.offset)
        if not entry.nbytes:
            return True
        if self._engine is None:
            self._start(aio)
        first = self._first.get(key)
        if first is None or not dest.is_contiguous() or first < (self._queue[0][0] if self._queue else self._next):
            return False
        self._skip_to(first)
        i = first
        while True:
            span, buf = self._take(i)
            try:
                for e, a, b in span.pieces:
                    if (e.file, e.offset) == key:
                        _copy_piece(buf.tensor[e.offset + a - span.lo:e.offset + b - span.lo], e, a, b, dest)
            except BaseException:
                self._drop_head()
                raise
            last = span.pieces[-1]
            if (last[0].file, last[0].offset) != key or last[2] == entry.nbytes:
                if (last[0].file, last[0].offset) == key:
                    self._drop_head()
                return True
            self._drop_head()
            i += 1

    def close(self) -> None:
        """Wait for the reads in flight and let go of the buffers, the files and the engine."""
        wait_quietly([f for _, _, f in self._queue])
        self._queue.clear()
        for f in self._files.values():
            f.close()
        self._files = {}
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        if self._engine is not None:
            self._engine.close()

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------------

    def _start(self, aio: Optional[AioConfig]) -> None:
        """Open the engine, the files (each checked to be the one whose header was read) and the buffers."""
        self._engine = Engine(aio)
        for file in dict.fromkeys(e.file for e in self._order):
            f = self._open(file)
            if f is not None:
                self._files[file] = f
        alignment = max([ALIGNMENT] + [f.alignment for f in self._files.values()])
        self._pool = BufferPool(self._count, round_up(self._buffer_size, alignment))
        self._engine.register_buffers(list(self._pool))
        self._free = deque(self._pool)
        self._spans = _spans([e for e in self._order if e.file in self._files], self._pool.buffer_size, alignment)
        for i, span in reversed(list(enumerate(self._spans))):
            for e, a, _ in span.pieces:
                if a == 0:
                    self._first[(e.file, e.offset)] = i
        self._fill()

    def _open(self, file: str) -> Optional[AioFile]:
        """``file`` open with O_DIRECT for the engine, checked to be the one whose header was read; None where
        O_DIRECT is refused or turned off (``o_direct: false``): its tensors come from the memory map, whose
        read-ahead reads a buffered file faster than the engine's requests do."""
        fd, st = _open_regular(file)
        try:
            if (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) != self._ckpt._identity.get(file):
                raise CheckpointError(f"{file} changed since its header was read (another file, size or time); "
                                      "load again once nothing writes the checkpoint")
            if self._engine.config.o_direct is False:
                os.close(fd)
                return None
            # O_NONBLOCK only kept a FIFO from blocking the open; reads of the file must wait for the disk.
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
            return wrap_fd(fd, file, o_direct=True)
        except OSError as err:
            os.close(fd)
            if err.errno == errno.EINVAL:
                return None
            raise
        except BaseException:
            os.close(fd)
            raise

    def _fill(self) -> None:
        """Start reading the next spans into the free buffers."""
        while self._free and self._next < len(self._spans):
            span, buf = self._spans[self._next], self._free.popleft()
            f = self._files[span.file]
            hi = min(round_up(span.end, f.alignment), span.lo + buf.nbytes)
            self._queue.append((self._next, buf, self._engine.read_async(f, buf, span.lo, hi - span.lo)))
            self._next += 1

    def _skip_to(self, i: int) -> None:
        """Make span ``i`` the oldest read: drop those before it, or start over at it."""
        while self._queue and self._queue[0][0] < i:
            self._drop_head()
        if not self._queue:
            self._next = max(self._next, i)
            self._fill()

    def _take(self, i: int) -> tuple[_Span, object]:
        """Span ``i`` (the oldest read) and its buffer, once the read has landed whole."""
        _, buf, fut = self._queue[0]
        span = self._spans[i]
        try:
            got = fut.wait()
        except BaseException:
            self._drop_head()
            raise
        if got < span.end - span.lo:
            self._drop_head()
            raise CheckpointError(f"{span.file} ends at byte {span.lo + got}, before byte {span.end} that its header "
                                  "promised: it was cut while loading; download or save it again")
        return span, buf

    def _drop_head(self) -> None:
        """Give the oldest read's buffer back (once it landed) and start the next read."""
        _, buf, fut = self._queue.popleft()
        wait_quietly([fut])
        self._free.append(buf)
        self._fill()


def _copy_piece(src: torch.Tensor, e: Entry, a: int, b: int, dest: torch.Tensor) -> None:
    """Copy bytes ``[a, b)`` of ``e``'s data, ``src`` (uint8), to their place in ``dest``, converting the dtype."""
    flat = dest.reshape(-1)
    if dest.dtype == e.dtype:
        flat.view(torch.uint8)[a:b].copy_(src)
        return
    size = e.dtype.itemsize
    if src.storage_offset() % size:
        src = src.clone()  # an element not at a multiple of its size in the buffer: view() wants one
    flat[a // size:b // size].copy_(src.view(e.dtype))
