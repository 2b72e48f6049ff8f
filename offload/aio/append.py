"""A new file written front to back through a few page-aligned host buffers, by the engine."""

from __future__ import annotations

import os
from collections import deque
from typing import Optional

import numpy as np

from ..buffers import BufferPool
from ..sizes import ALIGNMENT, round_up
from .engine import Engine
from .files import reserve, unlink_if_same
from .futures import wait_quietly

__all__ = ["AppendFile"]


# NOTE: a file whose pieces have arbitrary lengths (a safetensors shard: a header, then tensors back to back)
# cannot be written piece by piece with O_DIRECT, which wants every offset and length aligned. Written
# through Python's buffered file instead, every byte is copied into the page cache first, which runs at about
# 0.5 GB/s on a small machine and was most of the time of a Hugging Face save. Here the bytes are copied into
# aligned buffers (a memcpy), and each full buffer is written by the engine at its aligned offset while the
# next fills; the last, partial one is written padded to the alignment and the file then cut to its length.
# So the file is written with direct I/O, several buffers in flight, whatever the pieces' lengths. (The
# writer pushes bytes as they come, so this is a ring of its own rather than the pull-driven Pipeline.)
class AppendFile:
    """A new file ``path``, created exclusively (mode: see :mod:`offload.modes`), written by appending.

    Args:
        path: the file to create (an existing name, a link included, raises ``FileExistsError``).
        engine: the engine that writes it, with direct I/O as its config's ``o_direct`` says (``"auto"``: where
            the file system allows it).
        buffer_size: bytes per buffer (rounded up to the file's direct-I/O alignment and whole pages).
        count: buffers; all but the one filling are in flight at most.
        buffers: a pool to write through instead of one of ``count`` x ``buffer_size`` made for this file (the
            caller's, for several files in turn: it stays open, and must be idle when given).
        size: the length the file will have, where the caller knows it: reserved at once (a full disk is an
            ``OSError`` here, before anything is written, and the file is removed), and the writes then land
            in place instead of growing the file one by one (about 1.2x faster on ext4). Writing more or less
            is allowed; ``close()`` cuts the file to what was written.

    ``write(data)`` appends any bytes-like object (bytes, memoryview, a contiguous NumPy array); ``tell()``
    is the length so far; ``close()`` writes what is left, cuts the file to its length and fsyncs it.
    Any error (an ``OSError`` naming the file), like ``abort()`` or leaving a ``with`` block by an exception,
    waits for the writes in flight and removes the file: nothing half written stays, and a later ``write()``
    or ``close()`` raises ``ValueError``.
    """

    def __init__(self, path: str | os.PathLike, engine: Engine, *, buffer_size: int = 8 << 20, count: int = 3,
                 buffers: Optional[BufferPool] = None, size: int = 0):
        if (len(buffers) if buffers is not None else count) < 2:
            raise ValueError("an AppendFile needs at least 2 buffers (one filling, one in flight)")
        self.path = os.fspath(path)
        self._engine = engine
        self._file = engine.open(self.path, "x+")
        self._owns_pool = buffers is None
        try:
            align = max(ALIGNMENT, self._file.alignment)
            if buffers is not None and buffers.buffer_size % align:
                raise ValueError(f"buffers of {buffers.buffer_size} bytes are not a multiple of {path}'s direct-I/O "
                                 f"alignment ({align} bytes)")
            if size > 0:
                reserve(self._file.fd, 0, round_up(size, align), self.path)  # where the file system can
            self._pool = buffers if buffers is not None else BufferPool(count, round_up(max(buffer_size, 1), align))
        except BaseException:
            unlink_if_same(self.path, self._file.fd)
            self._file.close()
            raise
        self._free = deque(self._pool)
        self._flying: deque = deque()  # (buffer, future), oldest first
        self._buf = self._free.popleft()
        self._base = 0  # where the filling buffer's bytes go in the file (a multiple of the buffer size)
        self._fill = 0  # bytes in the buffer filling
        self._done = False
        self._failed = False

    def tell(self) -> int:
        """Bytes appended so far."""
        return self._base + self._fill

    def write(self, data) -> int:
        """Append ``data`` (bytes-like); returns its length."""
        self._check_open()
        src = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
        n, done = src.size, 0
        try:
            while done < n:
                take = min(n - done, self._buf.nbytes - self._fill)
                self._buf.numpy()[self._fill:self._fill + take] = src[done:done + take]
                self._fill += take
                done += take
                if self._fill == self._buf.nbytes:
                    self._flush(self._fill)
        except BaseException:
            self._fail()
            raise
        return n

    def close(self) -> None:
        """Write what is left, wait for every write, cut the file to its length and fsync it."""
        if self._done and not self._failed:
            return
        self._check_open()
        try:
            length = self.tell()
            if self._fill:
                align = self._file.alignment
                padded = -(-self._fill // align) * align
                self._buf.numpy()[self._fill:padded] = 0
                self._flush(padded)
            while self._flying:
                self._flying.popleft()[1].wait()
            os.ftruncate(self._file.fd, length)
            try:
                os.fsync(self._file.fd)
            except OSError as err:
                raise OSError(err.errno, f"cannot fsync: {err.strerror}", self.path) from err
        except BaseException:
            self._fail()
            raise
        self._release()

    def abort(self) -> None:
        """Stop: wait for the writes in flight (their errors are not raised) and remove the file."""
        if self._done:
            return
        wait_quietly([f for _, f in self._flying])
        self._flying.clear()
        unlink_if_same(self.path, self._file.fd)  # ours alone, never a name someone put there since
        self._release()

    def __enter__(self) -> AppendFile:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def _flush(self, nbytes: int) -> None:
        """Start writing the filling buffer's first ``nbytes`` at its place; take the next buffer (once the
        oldest write landed, when every buffer is in flight)."""
        self._flying.append((self._buf, self._engine.write_async(self._file, self._buf, self._base, nbytes)))
        self._base += self._fill
        self._fill = 0
        if not self._free:
            buf, fut = self._flying.popleft()
            fut.wait()
            self._free.append(buf)
        self._buf = self._free.popleft()

    def _fail(self) -> None:
        self._failed = True
        self.abort()

    def _release(self) -> None:
        self._done = True
        self._file.close()
        if self._owns_pool:
            self._pool.close()

    def _check_open(self) -> None:
        if self._failed:
            raise ValueError(f"{self.path}: an earlier error stopped this AppendFile and removed the file")
        if self._done:
            raise ValueError(f"{self.path}: write to a closed AppendFile")
