"""Requests and their results: the segments a request moves, the future that stands for it, and the
``OSError`` a failed or short one becomes (errno, the file's path, the offset)."""

from __future__ import annotations

import errno as _errno
import os
import threading
import warnings
from typing import Any, Callable, NamedTuple, Optional, Sequence

import xxhash

from .._native import HAVE_XXHASH, ffi, lib
from .files import AioFile

READ = lib.OFL_OP_READ
WRITE = lib.OFL_OP_WRITE
_OP_NAMES = {READ: "read", WRITE: "write"}


class Segment(NamedTuple):
    """One contiguous transfer of a request: ``nbytes`` between ``buffer[buffer_offset:]`` and
    ``file`` at ``file_offset``."""

    file: AioFile
    file_offset: int
    buffer: Any  # HostBuffer, or any object exposing a contiguous buffer
    buffer_offset: int
    nbytes: int


class PieceDigest:
    """The engine's checksum of bytes cut into pieces, computed as they pass: the xxh3_64 of the sequence of
    the pieces' xxh3_64 (each piece ``block_size`` bytes of a segment, a segment's last one shorter) as
    64-bit little-endian words. A request submitted with ``digest=True`` gets this over its segments in
    order; a checkpoint records it for bytes it took from such a request without reading them.

    Feed each segment's bytes in order with :meth:`update` (in parts of any size), and call
    :meth:`end_segment` where a segment ends (its last piece may be short).
    """

    def __init__(self, block_size: int):
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
            raise ValueError(f"block_size must be a positive number of bytes, got {block_size!r}")
        self.block_size = block_size
        self._folded = xxhash.xxh3_64()
        self._piece = xxhash.xxh3_64()
        self._filled = 0  # bytes of the current piece seen so far

    def update(self, data) -> None:
        """The next bytes of the current segment (anything with the buffer protocol, or a HostBuffer's
        numpy view)."""
        view = memoryview(data).cast("B")
        pos, end = 0, len(view)
        while pos < end:
            take = min(self.block_size - self._filled, end - pos)
            if self._filled == 0 and take == self.block_size:  # a whole piece at once
                self._fold(xxhash.xxh3_64_intdigest(view[pos:pos + take]))
            else:
                self._piece.update(view[pos:pos + take])
                self._filled += take
                if self._filled == self.block_size:
                    self._fold(self._piece.intdigest())
                    self._piece.reset()
                    self._filled = 0
            pos += take

    def end_segment(self) -> None:
        """The current segment ends: its last, shorter piece (if any) is folded in."""
        if self._filled:
            self._fold(self._piece.intdigest())
            self._piece.reset()
            self._filled = 0

    def intdigest(self) -> int:
        """The checksum of every segment so far (the current one ended where it is)."""
        folded = self._folded.copy()
        if self._filled:
            folded.update(self._piece.intdigest().to_bytes(8, "little"))
        return folded.intdigest()

    def hexdigest(self) -> str:
        """:meth:`intdigest` as 16 hexadecimal digits, as ``xxhash``'s ``hexdigest`` writes an xxh3_64."""
        return f"{self.intdigest():016x}"

    def _fold(self, piece: int) -> None:
        self._folded.update(piece.to_bytes(8, "little"))


def segments_digest(segments: Sequence[Segment], block_size: int) -> int:
    """What the engine computes for a request submitted with ``digest=True`` (a :class:`PieceDigest` of its
    segments' bytes, in order). Computed here, in Python, where the engine was built without libxxhash."""
    digest = PieceDigest(block_size)
    for s in segments:
        b = s.buffer
        data = (b.tensor[s.buffer_offset:s.buffer_offset + s.nbytes].numpy() if hasattr(b, "tensor")  # HostBuffer
                else memoryview(b).cast("B")[s.buffer_offset:s.buffer_offset + s.nbytes])
        digest.update(data)
        digest.end_segment()
    return digest.intdigest()


def _io_error(err: int, op: int, path: Optional[str], offset: int) -> OSError:
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
    request was submitted ``exact``: then it raises ``OSError(ENODATA)``. A request submitted with
    ``digest`` has ``digest()``: the xxh3_64 of the bytes it moved.
    """

    # ``engine`` is the offload.aio.Engine that submitted the request (not imported here: the
    # engine module sits above this one).
    def __init__(self, engine, op: int, request, segments: Sequence[Segment], keepalive, exact: bool = False,
                 digest: bool = False):
        self._engine = engine
        self._op = op
        self._request = request
        self._segments = segments
        self._keepalive = keepalive  # buffers must outlive the I/O that targets them
        self._exact = exact
        self._want_digest = digest
        self._digest: Optional[int] = None
        if digest and not HAVE_XXHASH and op == WRITE:
            # No digests on the engine's threads: take the bytes' digest now, before they can change.
            self._digest = segments_digest(segments, engine.config.block_size)
        self._result = 0  # the bytes moved, once finished
        self._error: OSError | None = None
        # Whoever finishes the request frees it in C: a second waiter (another thread, or the
        # engine closing) must wait for the first rather than free it twice.
        self._lock = threading.Lock()

    def done(self) -> bool:
        """True if the request has completed (successfully or not). Does not wait for it (at most for another
        thread that took it over at this very moment to finish it)."""
        if self._request is None:
            return True
        self._engine._check_same_process()
        if self._lock.locked():
            return False  # another thread is finishing it right now
        # NOTE: a with block, not acquire() then try: a KeyboardInterrupt between those two lines would leave
        # the lock held and every later wait() of this request hanging.
        with self._lock:
            if self._request is None:
                return True
            return bool(lib.ofl_request_done(self._engine._handle, self._request))

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

    def digest(self) -> Optional[int]:
        """The xxh3_64 of the bytes the request moved, in segment order (waits for it); None for a read
        that met end of file before its last byte.

        Raises:
            OSError: the request failed (there is no digest of bytes that did not move).
            ValueError: the request was not submitted with ``digest=True``.
        """
        self.wait()
        if not self._want_digest:
            raise ValueError("this request was submitted without digest=True")
        return self._digest

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
        if rc == 0 and self._want_digest and self._digest is None:
            d = ffi.new("uint64_t *")
            if lib.ofl_request_digest(handle, self._request, d) == 0:
                self._digest = int(d[0])
            elif int(result[0]) == self._asked():
                # Built without libxxhash, or no memory was left for it there: take it here. A read cut
                # short by end of file has none (no digest of bytes that did not come).
                self._digest = segments_digest(self._segments, self._engine.config.block_size)
        lib.ofl_request_free(handle, self._request)
        self._request = None
        self._engine._futures.discard(self)
        if rc < 0:
            path = self._segments[seg[0]].file.path if 0 <= seg[0] < len(self._segments) else None
            self._error = _io_error(-rc, self._op, path, int(offset[0]))
        self._result = int(result[0])
        if rc == 0 and self._exact and self._result < self._asked():
            self._error = _short_read_error(self._segments, self._result)
        self._keepalive = None
        for s in self._segments:
            s.file._release()

    def _asked(self) -> int:
        """The bytes this request was asked to move (its segments'), for the rare checks that need them."""
        return sum(s.nbytes for s in self._segments)

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
        """The result it was made with: there is no I/O to wait for."""
        return self._result

    def done(self) -> bool:
        """True: nothing is in flight."""
        return True

    def digest(self) -> None:
        """None: no bytes moved, so there is no checksum of them."""
        return None


class CheckedRead:
    """A read whose ``wait()`` also compares the digest of the bytes read with the one expected of them.

    Args:
        read: the read's future, submitted with ``digest=True``.
        expected: returns the digest the bytes must have (that of their last write), or None if unknown.
        mismatch: ``mismatch(found, expected)`` returns the error to raise (and may record it first).
    """

    def __init__(self, read, expected: Callable[[], Any], mismatch: Callable[[Any, Any], BaseException]):
        self._read, self._expected, self._mismatch = read, expected, mismatch
        self._checked: Optional[tuple] = None  # (bytes read, the mismatch or None) once compared

    def done(self) -> bool:
        """Whether the read has finished (its bytes are compared at :meth:`wait`)."""
        return self._read.done()

    def wait(self) -> int:
        """Wait for the read and compare its bytes once; later waits give the same result (or error)."""
        if self._checked is None:
            n = self._read.wait()
            want, error = self._expected(), None
            if want is not None:
                found = self._read.digest()
                if found != want:
                    error = self._mismatch(found, want)
            self._checked = (n, error)
        n, error = self._checked
        if error is not None:
            raise error
        return n

    def digest(self):
        """The read's digest of the bytes it read."""
        return self._read.digest()


def hex_digest(digest) -> str:
    """An xxh3_64 (or a tuple of them, one per swap file) as hex, for messages."""
    return "/".join(f"{d:016x}" for d in (digest if isinstance(digest, (tuple, list)) else (digest,)))


def wait_quietly(futures) -> None:
    """Wait for every future, ignoring their errors (I/O errors, and checks made as they are waited for).

    For error paths: a buffer may be the target of requests still in flight, so they must all land
    before the buffer is reused or the first error is raised; their own errors add nothing.
    """
    for fut in futures:
        try:
            fut.wait()
        except Exception:  # the first error is already on its way up
            pass


class FutureGroup:
    """Several futures seen as one: ``wait()`` waits for all, then raises the first error."""

    def __init__(self, futures: Sequence):
        self._futures = list(futures)

    def done(self) -> bool:
        """Whether every member has finished."""
        return all(f.done() for f in self._futures)

    def wait(self) -> int:
        """Wait for every member, then raise the first error; returns the bytes they moved together."""
        total, first = 0, None
        for f in self._futures:
            try:
                total += f.wait()
            except Exception as err:  # every member lands before the first error leaves
                first = first or err
        if first is not None:
            raise first
        return total

    def digest(self) -> tuple:
        """The members' digests, in order (one per swap file a striped request touched)."""
        self.wait()
        return tuple(f.digest() for f in self._futures)
