"""Requests and their results: the segments a request moves, the future that stands for it, and the
``OSError`` a failed or short one becomes (errno, the file's path, the offset)."""

from __future__ import annotations

import errno as _errno
import os
import threading
import warnings
from typing import NamedTuple, Sequence

from .._native import ffi, lib
from .files import AioFile

READ = lib.OFL_OP_READ
WRITE = lib.OFL_OP_WRITE
_OP_NAMES = {READ: "read", WRITE: "write"}


class Segment(NamedTuple):
    """One contiguous transfer of a request: ``nbytes`` between ``buffer[buffer_offset:]`` and
    ``file`` at ``file_offset``."""

    file: AioFile
    file_offset: int
    buffer: object  # HostBuffer, or any object exposing a contiguous buffer
    buffer_offset: int
    nbytes: int


def _io_error(err: int, op: int, path: str, offset: int) -> OSError:
    return OSError(err, f"{os.strerror(err)} ({_OP_NAMES[op]} at offset {offset})", path)


def _short_read_error(segments: Sequence[Segment], got: int) -> OSError:
    """The error of an exact read that met end of file after ``got`` bytes of the request."""
    start = 0
    for s in segments:
        if got < start + s.nbytes:
            return OSError(
                _errno.ENODATA,
                f"short read at file offset {s.file_offset}: expected {s.nbytes} bytes, got {got - start} "
                f"(the file ends at offset {s.file_offset + got - start}, inside data it should hold: it "
                "was truncated after it was written)",
                s.file.path,
            )
        start += s.nbytes
    raise AssertionError(f"no short segment at {got} of {start} bytes")  # pragma: no cover - internal


class Future:
    """One request in flight. ``wait()`` returns the bytes moved or raises ``OSError``.

    A read that meets the end of the file returns the length of the prefix it read, unless the
    request was submitted ``exact``: then it raises ``OSError(ENODATA)``.
    """

    # ``engine`` is the offload.aio.Engine that submitted the request (not imported here: the
    # engine module sits above this one).
    def __init__(self, engine, op: int, request, segments: Sequence[Segment], keepalive, exact: bool = False):
        self._engine = engine
        self._op = op
        self._request = request
        self._segments = segments
        self._keepalive = keepalive  # buffers must outlive the I/O that targets them
        self._exact = exact
        self._result: int | None = None
        self._error: OSError | None = None
        # Whoever finishes the request frees it in C: a second waiter (another thread, or the
        # engine closing) must wait for the first rather than free it twice.
        self._lock = threading.Lock()

    def done(self) -> bool:
        """True if the request has completed (successfully or not). Never blocks."""
        if self._request is None:
            return True
        self._engine._check_same_process()
        if not self._lock.acquire(blocking=False):
            return False  # another thread is finishing it right now
        try:
            if self._request is None:
                return True
            return bool(lib.ofl_request_done(self._engine._handle, self._request))
        finally:
            self._lock.release()

    def wait(self) -> int:
        """Block until the request completes; return the bytes moved.

        Raises:
            OSError: the first piece that failed, with errno, the file's path and the offset.
            RuntimeError: called in a process forked after the engine was created.
        """
        if self._request is not None:
            self._engine._check_same_process()
            self._finish()
        if self._error is not None:
            raise self._error
        return self._result

    def _finish(self) -> None:
        with self._lock:
            if self._request is not None:
                self._finish_locked()

    def _finish_locked(self) -> None:
        result = ffi.new("int64_t *")
        seg = ffi.new("int *")
        offset = ffi.new("int64_t *")
        handle = self._engine._handle
        rc = lib.ofl_request_wait(handle, self._request, result, seg, offset)
        lib.ofl_request_free(handle, self._request)
        self._request = None
        self._engine._futures.discard(self)
        if rc < 0:
            path = self._segments[seg[0]].file.path if 0 <= seg[0] < len(self._segments) else None
            self._error = _io_error(-rc, self._op, path, int(offset[0]))
        self._result = int(result[0])
        if rc == 0 and self._exact and self._result < sum(s.nbytes for s in self._segments):
            self._error = _short_read_error(self._segments, self._result)
        self._keepalive = None
        for s in self._segments:
            s.file._release()

    def __del__(self):
        if (getattr(self, "_request", None) is not None and not self._engine.closed
                and self._engine._forked_from is None):
            self._finish()
            if self._error is not None:
                warnings.warn(f"an I/O error nobody waited for: {self._error}", RuntimeWarning, stacklevel=2)


class CompletedFuture:
    """A future for work that needed no I/O (e.g. a read of state that does not exist yet)."""

    def __init__(self, result: int = 0):
        self._result = result

    def wait(self) -> int:
        return self._result

    def done(self) -> bool:
        return True


def wait_quietly(futures) -> None:
    """Wait for every future, ignoring I/O errors.

    For error paths: a buffer may be the target of requests still in flight, so they must all land
    before the buffer is reused or the first error is raised; their own errors add nothing.
    """
    for fut in futures:
        try:
            fut.wait()
        except OSError:
            pass


class FutureGroup:
    """Several futures seen as one: ``wait()`` waits for all, then raises the first error."""

    def __init__(self, futures: Sequence):
        self._futures = list(futures)

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def wait(self) -> int:
        total, first = 0, None
        for f in self._futures:
            try:
                total += f.wait()
            except OSError as err:
                first = first or err
        if first is not None:
            raise first
        return total
