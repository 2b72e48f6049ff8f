"""The pipeline: read(i+1) || process(i) || write(i-1) over a few buffers, bounded, and errors drained."""

from __future__ import annotations

import contextlib
import threading

import pytest

from offload.errors import PoolTooSmallError
from offload.pipeline import BufferRing, Pipeline


class FakeFuture:
    """A request that the disk finishes some events after it was issued (``done()`` turns true then);
    ``wait()`` records when somebody waited for it."""

    def __init__(self, log: list, name: str, nbytes: int = 1, error: Exception | None = None):
        self.log, self.name, self.nbytes, self.error = log, name, nbytes, error
        self.finished = False
        self.issued_at = len(log)

    def done(self) -> bool:
        return self.finished or len(self.log) - self.issued_at > 4

    def wait(self) -> int:
        if not self.finished:
            self.finished = True
            self.log.append(("land", self.name))
        if self.error is not None:
            raise self.error
        return self.nbytes


class FakeSpace:
    """Reads and writes that record when they are issued and when they land."""

    def __init__(self, fail_read: int | None = None, fail_write: int | None = None):
        self.log: list = []
        self.futures: list[FakeFuture] = []
        self.fail_read, self.fail_write = fail_read, fail_write
        self.in_use: dict = {}  # buffer -> the item whose I/O may still be using it

    def read(self, item, buf):
        assert self.in_use.get(buf) is None, f"buffer {buf} reused while I/O of {self.in_use[buf]} is in flight"
        self.log.append(("read", item))
        err = OSError(5, "injected read error") if item == self.fail_read else None
        fut = FakeFuture(self.log, f"read {item}", 10, err)
        self.futures.append(fut)
        return fut

    def write(self, item, buf):
        self.log.append(("write", item))
        err = OSError(5, "injected write error") if item == self.fail_write else None
        fut = FakeFuture(self.log, f"write {item}", 10, err)
        self.futures.append(fut)
        return fut


def run(n, buffers=4, lookahead=None, write_behind=True, space=None, process=None):
    space = space or FakeSpace()
    pipe = Pipeline([f"b{i}" for i in range(buffers)], lookahead=lookahead, write_behind=write_behind)

    def default(item, buf):
        space.log.append(("process", item))
        return True

    pipe.run(list(range(n)), read=space.read, process=process or default, write=space.write)
    return pipe, space


def position(log, event):
    return log.index(event)


def test_reads_run_ahead_and_writes_land_behind_the_item_being_processed():
    """While item i is processed, item i+1's read has been issued and item i-1's write has not been waited."""
    _, space = run(6, buffers=4, lookahead=2)
    log = space.log
    for i in range(1, 5):
        assert position(log, ("read", i + 1)) < position(log, ("process", i)), "read(i+1) not issued before process(i)"
        assert position(log, ("write", i - 1)) < position(log, ("process", i))
        assert ("land", f"write {i - 1}") not in log[:position(log, ("process", i))], \
            "write(i-1) was waited for before process(i)"


def test_without_write_behind_each_write_lands_before_the_next_item():
    """write_behind=False: an item's write has landed before the next item is processed."""
    _, space = run(5, buffers=3, lookahead=1, write_behind=False)
    for i in range(4):
        assert position(space.log, ("land", f"write {i}")) < position(space.log, ("process", i + 1))


def test_lookahead_zero_reads_only_the_item_needed_now():
    """lookahead=0: no read is issued for an item before the previous item is processed."""
    _, space = run(5, buffers=3, lookahead=0)
    for i in range(4):
        assert position(space.log, ("process", i)) < position(space.log, ("read", i + 1))


def test_reads_in_flight_never_exceed_the_buffers_and_no_buffer_is_reused_under_io():
    """With B buffers, at most B items are between their read and the landing of their write, and a
    buffer is handed to a new read only once every I/O that used it has finished."""
    space = FakeSpace()
    owner: dict = {}

    def read(item, buf):
        prev = owner.get(buf)
        if prev is not None:
            assert all(f.finished for f in prev), f"{buf} reused while its I/O is in flight"
        fut = space.read(item, buf)
        owner[buf] = [fut]
        return fut

    def write(item, buf):
        fut = space.write(item, buf)
        owner[buf].append(fut)
        return fut

    pipe = Pipeline(["a", "b", "c"], lookahead=2)
    pipe.run(list(range(9)), read=read, process=lambda item, buf: True, write=write)
    assert pipe.bytes_read == 90 and pipe.bytes_written == 90


def test_items_needing_no_read_or_no_write_move_no_bytes():
    """read returning None and process returning False move nothing; the counters say so."""
    pipe = Pipeline(["a", "b"])
    space = FakeSpace()
    pipe.run([0, 1, 2, 3], read=lambda item, buf: space.read(item, buf) if item % 2 else None,
             process=lambda item, buf: item < 2, write=space.write)
    assert [e for e in space.log if e[0] in ("read", "write")] == [("read", 1), ("write", 0), ("write", 1),
                                                                     ("read", 3)]
    assert (pipe.bytes_read, pipe.bytes_written) == (20, 20)


@pytest.mark.parametrize("where", ["read", "write", "process"])
def test_an_error_leaves_only_after_every_request_in_flight_has_landed(where):
    """A failed read, a failed write or an exception in process propagates, and by then every request
    the run issued has finished (buffers are never left as targets of I/O)."""
    space = FakeSpace(fail_read=3 if where == "read" else None, fail_write=2 if where == "write" else None)

    def process(item, buf):
        space.log.append(("process", item))
        if where == "process" and item == 3:
            raise RuntimeError("injected")
        return True

    with pytest.raises((OSError, RuntimeError)):
        run(8, buffers=4, lookahead=2, space=space, process=process)
    assert space.futures and all(f.finished for f in space.futures)


def test_a_buffer_source_lends_buffers_and_gets_every_one_back():
    """With a BufferSource, every buffer taken is given back, also after an error."""
    ring = BufferRing(["a", "b", "c"])
    pipe = Pipeline(ring, lookahead=1)
    space = FakeSpace(fail_read=4)
    with pytest.raises(OSError):
        pipe.run(list(range(6)), read=space.read, process=lambda item, buf: True, write=space.write)
    taken = [ring.take(wait=True) for _ in range(3)]
    assert sorted(taken) == ["a", "b", "c"]


def test_a_pipeline_needs_a_buffer_and_a_source_needs_a_lookahead():
    """No buffers, a negative lookahead, or a source without a lookahead are refused clearly."""
    with pytest.raises(PoolTooSmallError):
        Pipeline([])
    with pytest.raises(ValueError, match="lookahead"):
        Pipeline(["a"], lookahead=-1)
    with pytest.raises(ValueError, match="lookahead"):
        Pipeline(BufferRing(["a"]))


def test_real_overlap_with_threads_completes_every_item_once():
    """Futures completed by another thread (as the engine's are): every item is read, processed and
    written exactly once, in order."""
    done_order = []
    lock = threading.Lock()

    class ThreadFuture:
        def __init__(self, what):
            self.event = threading.Event()
            self.what = what
            threading.Timer(0.001, self.event.set).start()

        def done(self):
            return self.event.is_set()

        def wait(self):
            self.event.wait()
            return 1

    def process(item, buf):
        with lock:
            done_order.append(item)
        return True

    pipe = Pipeline(["a", "b", "c", "d"], lookahead=2)
    pipe.run(list(range(20)), read=lambda i, b: ThreadFuture(("r", i)), process=process,
             write=lambda i, b: ThreadFuture(("w", i)))
    assert done_order == list(range(20))
    assert (pipe.bytes_read, pipe.bytes_written) == (20, 20)


class OwnBuffers:
    """A BufferSource over a ring where the items in ``own`` have buffers of their own (a host tier)."""

    def __init__(self, ring: BufferRing, own: set):
        self.ring, self.own = ring, own

    def lends(self, item) -> bool:
        return item not in self.own

    def take(self, wait: bool, item=None):
        return f"home {item}" if item in self.own else self.ring.take(wait, item)

    def give(self, buf, pending=None) -> None:
        if not str(buf).startswith("home"):
            self.ring.give(buf, pending)


def test_while_the_current_item_has_its_own_buffer_one_more_read_goes_ahead():
    """Items with buffers of their own (resident units) do not count towards the lookahead, and while one
    is processed the buffer the current item would hold reads ahead too: with 4 buffers and lookahead 3,
    all four shared-buffer items are being read before the first resident item is processed."""
    space = FakeSpace()
    ring = BufferRing(["a", "b", "c", "d"])
    pipe = Pipeline(ring, lookahead=3)
    source = OwnBuffers(ring, own={0, 1, 2, 3})

    def process(item, buf):
        space.log.append(("process", item))
        return False

    pipe.run(list(range(8)), read=space.read, process=process, source=source)
    first = space.log.index(("process", 0))
    assert [e for e in space.log[:first] if e[0] == "read"] == [("read", i) for i in range(8)]


@pytest.mark.parametrize("leave", ["error", "break"])
def test_a_stream_left_by_an_error_or_a_break_gives_every_buffer_back_with_its_io_finished(leave):
    """The loop form of a pass: items come out read, in order; skip_write leaves one unwritten; an error in the
    body (or a break) ends the pass with every request finished and every buffer back in the ring, and only
    the items the body was done with are written (the one it raised in is not)."""
    ring = BufferRing(["a", "b", "c"])
    space = FakeSpace()
    seen = []
    with pytest.raises(RuntimeError) if leave == "error" else contextlib.nullcontext():
        with Pipeline(ring, lookahead=1).stream(list(range(6)), read=space.read, write=space.write) as stream:
            for item, _buf in stream:
                assert ("land", f"read {item}") in space.log  # handed out once read
                seen.append(item)
                if item == 1:
                    stream.skip_write()
                if item == 3:
                    if leave == "error":
                        raise RuntimeError("injected")
                    break
    assert seen == [0, 1, 2, 3] and all(f.finished for f in space.futures)
    assert [e for e in space.log if e[0] == "write"] == [("write", 0), ("write", 2)] + \
        ([("write", 3)] if leave == "break" else [])
    assert sorted(ring.take(wait=True) for _ in range(3)) == ["a", "b", "c"]


def test_a_stream_is_iterated_inside_its_with_block():
    """Outside its with block nothing would wait for the stream's I/O at the end: refused."""
    stream = Pipeline(["a"]).stream([0])
    with pytest.raises(RuntimeError, match="with block"):
        iter(stream)
