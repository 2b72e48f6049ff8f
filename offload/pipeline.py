"""The one bounded read-ahead / process / write-behind loop: every mover of bytes in the library runs on it."""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Iterable, Optional, Protocol, Sequence

from .aio import wait_quietly
from .errors import PoolTooSmallError
from .interrupts import safe_point

__all__ = ["BufferRing", "BufferSource", "Pipeline", "Stream"]


class BufferSource(Protocol):
    """Where a pipeline gets the buffers it moves bytes through, and gives them back.

    ``take(wait=False)`` returns a buffer only if one is idle now (else ``None``); ``take(wait=True)``
    always returns one, waiting for the I/O that last used it. (A :class:`BufferRing` with ``prefer``
    waits in either case for the buffer that holds the item's bytes: reading them again would wait for
    that I/O too.) ``item`` is the item the buffer is for
    (a source may keep some items' buffers of their own). ``give(buffer, pending)`` returns a buffer;
    ``pending`` is a future still using it as a source (a write), or ``None``. A source may also have
    ``lends(item)``: False for an item that has a buffer of its own (no I/O, no buffer of the shared
    ones), which then does not count towards the pipeline's lookahead.
    """

    def take(self, wait: bool, item: Any = None) -> Any:
        """A buffer for ``item``; with ``wait`` False only one that is idle now, else None."""

    def give(self, buffer: Any, pending: Any = None) -> None:
        """Give ``buffer`` back; ``pending``: a future still using it (a write), or None."""


class BufferRing:
    """The plain :class:`BufferSource`: buffers reused in the order they were given back.

    The buffer a read needs is then the one whose write was issued longest ago, the likeliest to have
    landed; when that one is still being written, another buffer that is idle is taken instead, and only
    when none is idle does a take that must have one wait (for the oldest).

    Args:
        buffers: the buffers.
        prefer: ``prefer(item, buffer)`` True when ``buffer`` already holds what ``item`` needs (its bytes
            as last written from it): a take for ``item`` then returns that buffer, once the I/O still
            using it has finished, whatever its place in the ring.
    """

    def __init__(self, buffers: Iterable, prefer: Optional[Callable[[Any, Any], bool]] = None):
        self._free: deque = deque((b, None) for b in buffers)
        self._prefer = prefer
        if not self._free:
            raise PoolTooSmallError("a pipeline needs at least one buffer")

    def __len__(self) -> int:
        return len(self._free)

    def buffers(self) -> list:
        """The buffers in the ring now (every one, once a run has given them all back)."""
        return [b for b, _ in self._free]

    def take(self, wait: bool, item: Any = None) -> Any:
        """A buffer for ``item``: the one holding its bytes where ``prefer`` finds one, else the oldest idle one;
        where none is idle, the oldest once its write has landed (with ``wait``), or None."""
        if self._prefer is not None and item is not None:
            for i, (buffer, pending) in enumerate(self._free):
                if self._prefer(item, buffer):
                    del self._free[i]
                    # Its bytes are wanted as they are: wait for the write reading them, even for a take
                    # that need not wait (a read of the item would have to wait for that write too).
                    wait_quietly([pending] if pending is not None else [])
                    return buffer
        for i, (buffer, pending) in enumerate(self._free):
            if pending is None or pending.done():
                del self._free[i]
                wait_quietly([pending] if pending is not None else [])  # collect its result
                return buffer
        if not wait or not self._free:
            return None
        buffer, pending = self._free.popleft()
        # A failed write is not raised here: whoever issued it holds its future and reports it.
        wait_quietly([pending])
        return buffer

    def give(self, buffer: Any, pending: Any = None) -> None:
        """Put ``buffer`` at the end of the ring; ``pending``: a write still reading it, or None."""
        self._free.append((buffer, pending))


# NOTE: the I/O runs on the native engine's threads and torch's kernels release the GIL, so while
# ``process`` works on item i, the reads of the next items and the writes of the previous ones proceed
# on the disk. Reads are issued in item order up to ``lookahead`` items beyond the one being
# processed, as long as a buffer is idle; only the read of the item needed next may wait for a buffer
# (or a take that gets the buffer already holding its item's bytes, which waits for that buffer's write).
# With ``write_behind`` a write lands while later items are processed; without it each write is waited
# for at once. Whatever happens, every request run() issued has finished before it returns or raises:
# a buffer must never be reused (or freed) while the engine may still be filling or reading it.
class Pipeline:
    """Moves items through host buffers: ``read(item) || process(item) || write(item)`` overlapped.

    Args:
        buffers: the buffers to move bytes through: a list (or tuple) of host buffers, or a
            :class:`BufferSource` that lends them (the parameter store shares its pool with prefetches),
            or ``None`` when every run brings its own source.
        lookahead: how many items beyond the one being processed may have reads in flight; ``None``
            for as many as there are buffers to spare (len(buffers) - 1; a source must give a number).
        write_behind: let writes land while later items are processed.

    Attributes:
        bytes_read, bytes_written: bytes moved by every run so far (the futures' results).
    """

    def __init__(self, buffers: list | tuple | BufferSource | None, *, lookahead: Optional[int] = None,
                 write_behind: bool = True):
        self._buffers: Optional[list] = None
        self._source: Optional[BufferSource] = None
        default = None
        if isinstance(buffers, (list, tuple)):
            if not buffers:
                raise PoolTooSmallError("a pipeline needs at least one buffer")
            self._buffers = list(buffers)
            default = len(buffers) - 1
        else:
            self._source = buffers
        if lookahead is None:
            if default is None:
                raise ValueError("a pipeline over a buffer source needs an explicit lookahead")
            lookahead = default
        if lookahead < 0:
            raise ValueError(f"lookahead must not be negative, got {lookahead}")
        self.lookahead = lookahead
        self.write_behind = write_behind
        self.bytes_read = 0
        self.bytes_written = 0

    def stream(self, items: Sequence, *, read: Optional[Callable[[Any, Any], Any]] = None,
               write: Optional[Callable[[Any, Any], Any]] = None, drain: bool = True,
               source: Optional[BufferSource] = None) -> Stream:
        """A pass over ``items`` as a loop, in a ``with`` block.

        ::

            with pipeline.stream(items, read=read, write=write) as stream:
                for item, buf in stream:
                    ...  # change buf; stream.skip_write() to leave it unwritten

        Each item's ``read(item, buf)`` is issued ahead (up to ``lookahead`` items beyond the one in the body) and
        waited for before the item is handed out; once the body is done with it, ``write(item, buf)`` is issued
        (unless skipped). ``read`` and ``write`` start I/O and return a future (``wait()`` gives the bytes
        moved), or ``None`` when the item needs no read (state not created yet: the buffer then holds stale
        bytes that the body must overwrite) or no write. ``drain=False`` returns with the last writes still
        landing (a :class:`BufferSource` holds them as pending, so their buffers are not reused before; the
        caller keeps the futures ``write`` returned and waits for them before reading those bytes back); they
        are then not counted in ``bytes_written``. ``source`` lends the buffers instead of the pipeline's own.

        Whatever happens, every request the pass issued has finished when the ``with`` block ends, and every
        buffer is back with its source: a buffer must never be reused (or freed) while the engine may still be
        filling or reading it. An error in the body, in ``read``, ``write`` or a future (an ``OSError`` naming
        the file and offset for I/O) leaves the block after that.
        """
        return Stream(self, items, self._source_for(source, drain), read, write, drain)

    def run(
        self,
        items: Sequence,
        *,
        process: Callable[[Any, Any], bool],
        read: Optional[Callable[[Any, Any], Any]] = None,
        write: Optional[Callable[[Any, Any], Any]] = None,
        drain: bool = True,
        source: Optional[BufferSource] = None,
    ) -> None:
        """:meth:`stream` with ``process(item, buf)`` as the body: ``write(item, buf)`` follows if it returned
        True."""
        with self.stream(items, read=read, write=write, drain=drain, source=source) as stream:
            for item, buf in stream:
                if not process(item, buf):
                    stream.skip_write()

    def _source_for(self, source: Optional[BufferSource], drain: bool) -> BufferSource:
        """The source of a run's buffers: ``source``, else the pipeline's own."""
        if source is not None:
            return source
        if not drain and self._buffers is not None:
            raise ValueError("drain=False needs a BufferSource that outlives the run (it keeps the writes "
                             "pending)")
        source = BufferRing(self._buffers) if self._buffers is not None else self._source
        if source is None:
            raise ValueError("this pipeline has no buffers of its own: pass a source to run()")
        return source


class Stream:
    """One pass of a :class:`Pipeline` over its items, as a loop (see :meth:`Pipeline.stream`)."""

    def __init__(self, pipeline: Pipeline, items: Sequence, source: BufferSource,
                 read: Optional[Callable[[Any, Any], Any]], write: Optional[Callable[[Any, Any], Any]], drain: bool):
        self.pipeline = pipeline
        self.items = items
        self.source = source
        self.write = write
        self.drain = drain
        self.ahead = _ReadAhead(items, source, read, pipeline.lookahead)
        self.writes: list = []  # the writes left landing (write-behind)
        self.next = 0  # the index of the next item to hand out
        self.current: Optional[tuple] = None  # (item, buffer) in the body now
        self.reading: Any = None  # the read of the current item, until it has been waited for
        self.writing = True  # whether the current item is written once the body is done with it
        self.entered = False

    def __enter__(self) -> Stream:
        self.entered = True
        return self

    def __iter__(self) -> Stream:
        if not self.entered:
            raise RuntimeError("iterate a pipeline's stream inside its with block (it waits for the I/O at the end)")
        return self

    def __next__(self) -> tuple:
        """The body is done with the current item: write it (or not); then hand out the next, once read."""
        self._finish()
        if self.next >= len(self.items):
            raise StopIteration
        safe_point()  # a Ctrl-C held off stops the pass here, where every buffer is accounted for
        self.ahead.issue(self.next)
        self.current, self.writing, self.reading = self.ahead.reads[0][:2], True, self.ahead.reads[0][2]
        self.ahead.pop()
        self.next += 1
        if self.reading is not None:
            self.pipeline.bytes_read += self.reading.wait()
            self.reading = None
        return self.current

    def skip_write(self) -> None:
        """Leave the current item unwritten."""
        self.writing = False

    def _finish(self) -> None:
        """Issue the current item's write, if any: waited for at once or, with write-behind, left landing.
        Its buffer goes back to the source (pending on that write)."""
        if self.current is None:
            return
        item, buf = self.current
        self.current = None
        try:
            wfut = self.write(item, buf) if self.writing and self.write is not None else None
        except BaseException:
            self.source.give(buf)
            raise
        if wfut is not None and not self.pipeline.write_behind:
            try:
                self.pipeline.bytes_written += wfut.wait()
            finally:
                self.source.give(buf)
            return
        if wfut is not None:
            self.writes.append(wfut)
        self.source.give(buf, wfut)

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            try:
                self._finish()  # the loop was left early: the item in it is done with
                self._unread()  # and the items read ahead for it are not wanted
                for w in self.writes if self.drain else ():
                    self.pipeline.bytes_written += w.wait()
                return
            except BaseException:
                self._abort()
                raise
        self._abort()

    def _unread(self) -> None:
        """The reads issued ahead finished and their buffers back with the source."""
        wait_quietly(fut for _, _, fut in self.ahead.reads if fut is not None)
        for _, buf, _ in self.ahead.reads:
            self.source.give(buf)
        self.ahead.reads.clear()
        self.ahead.lent.clear()

    def _abort(self) -> None:
        """After an error: every request in flight finished, every buffer back with the source (once)."""
        current, self.current = self.current, None
        if current is not None and any(buf is current[1] for _, buf, _ in self.ahead.reads):
            current = None  # stopped as it was handed out: still among the reads ahead, given back with them
        self._unread()
        wait_quietly([self.reading] if self.reading is not None else [])
        wait_quietly(self.writes)
        if current is not None:
            self.source.give(current[1])


class _ReadAhead:
    """The reads a run has issued, from the item it processes next on: ``reads`` holds ``(item, buffer, read
    future or None)`` in item order."""

    def __init__(self, items: Sequence, source: BufferSource, read: Optional[Callable[[Any, Any], Any]],
                 lookahead: int):
        self.items, self.source, self.read, self.lookahead = items, source, read, lookahead
        self.lends = getattr(source, "lends", lambda item: True)
        self.reads: deque = deque()
        self.lent: deque = deque()  # whether each entry of reads holds a shared buffer
        self.next = 0  # the first item not read yet

    def issue(self, i: int) -> None:
        """Issue the reads of the items from the next one not read, as far as the lookahead beyond item ``i``
        allows and buffers are idle; the read of item ``i`` itself waits for a buffer if it must."""
        items = self.items
        while self.next < len(items):
            costly = self.lends(items[self.next])
            if self.next > i and costly and self._full():
                break
            buf = self.source.take(wait=not self.reads, item=items[self.next])
            if buf is None:
                break
            try:
                fut = self.read(items[self.next], buf) if self.read is not None else None
            except BaseException:
                self.source.give(buf)
                raise
            self.reads.append((items[self.next], buf, fut))
            self.lent.append(costly)
            self.next += 1

    def _full(self) -> bool:
        """Whether the items ahead of the current one (reads[0]) that hold a shared buffer are as many as may
        be: lookahead of them, one more while the current one has a buffer of its own."""
        current = self.lent[0]
        return sum(self.lent) - current >= self.lookahead + (not current and self.lookahead > 0)

    def pop(self) -> tuple:
        """The current item's ``(item, buffer, read future or None)``, taken out."""
        self.lent.popleft()
        return self.reads.popleft()
