"""A CPU emulator of CUDA's asynchronous copies, so that their ordering rules are tested without a GPU."""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import weakref
from typing import Callable, Iterable, Iterator, Optional

import torch

from . import Ticket

__all__ = ["EmulatedCopies", "EmulatedStream"]

_TIMEOUT = 60.0  # an emulated event that never completes is a bug in the emulator's user: say so, don't hang


class _Event:
    """Completes when its stream reaches it."""

    __slots__ = ("_flag", "device", "stream")

    def __init__(self, stream: EmulatedStream):
        self._flag = threading.Event()
        self.stream = stream
        self.device = stream.device

    def query(self) -> bool:
        return self._flag.is_set()

    def synchronize(self) -> None:
        if not self._flag.wait(_TIMEOUT):
            raise RuntimeError(f"an emulated event on {self.stream.name} did not complete in {_TIMEOUT} s")


class EmulatedStream:
    """Work run in order on a thread of its own, each item no earlier than ``delay`` after it was queued and
    after the events it depends on (as a CUDA stream runs what is queued on it, late)."""

    def __init__(self, owner: EmulatedCopies, name: str, device: int):
        self.owner = owner
        self.name = name
        self.device = device
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._work, name=f"emulated-{name}", daemon=True)
        self._thread.start()

    def enqueue(self, fn: Optional[Callable[[], None]] = None, *, delay: float = 0.0,
                deps: Iterable[_Event] = (), start: Optional[Callable[[], None]] = None) -> _Event:
        """Queue ``fn``; ``start`` runs once ``deps`` completed, ``fn`` no earlier than ``delay`` from now."""
        event = _Event(self)
        self._queue.put((time.monotonic() + delay, tuple(deps), start, fn, event))
        return event

    def close(self) -> None:
        """Stop the thread once the work queued so far has run."""
        self._queue.put(None)
        self._thread.join()

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            due, deps, start, fn, event = item
            for dep in deps:
                dep._flag.wait(_TIMEOUT)
            if start is not None:
                start()
            pause = due - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            if fn is not None:
                try:
                    fn()
                except BaseException as err:  # reported by check()
                    self.owner.violations.append(f"{self.name}: {err!r}")
            event._flag.set()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def _poison(t: torch.Tensor) -> None:
    """Fill ``t`` with what no computation gives: NaN, or all bits set."""
    t = t.detach()
    if t.is_floating_point():
        t.fill_(float("nan"))
    else:
        t.fill_(-1 if t.dtype.is_signed else 255)


# NOTE: CPU tensors take the path device tensors take (``crosses`` says yes for the CPU), and each copy is
# performed as CUDA would: a copy to the device reads its host source late, on that device's copy stream
# (the destination is filled at once, since work on the device is ordered after the copy; the source is
# compared late with what it held at issue, and a change is a violation: a buffer reused before its copy
# completed); a copy to the host starts after the work of the current stream and after the copies to the
# device that the device's work waited for, and fills its destination late (poisoned from its start, with
# NaN or all bits set, so a read before completion sees that). Tensors have an emulated device index
# (``place``; 0 by default), and each index its own streams, so an event recorded on the wrong device's
# stream completes early. A side stream (``stream()``, ``later()``) holds work that produces tensors late,
# such as a backward on a side stream.
class EmulatedCopies:
    """The backend of :mod:`offload.copies` that :func:`offload.copies.emulated` installs.

    Args:
        delay: seconds each copy waits before it runs.

    Attributes:
        violations: ordering rules broken so far (:meth:`check` raises them).
        log: ``(kind, device index)`` of every copy and mark, in issue order.
        overlapped: copies to a device issued while a copy back from it was still in flight.
    """

    def __init__(self, delay: float = 0.002):
        self.delay = delay
        self.violations: list[str] = []
        self.log: list[tuple[str, int]] = []
        self._placed: dict[int, int] = {}
        self._streams: dict = {}
        self._waited: dict[int, list] = {}  # device -> events its compute stream waits for (copies to it)
        self._copies: list = []  # events of copies maybe in flight
        self._back: dict[int, list] = {}  # device -> events of its copies to the host maybe in flight
        self.overlapped = 0
        self._local = threading.local()
        self._lock = threading.Lock()
        self._closed = False

    # -- what tests call ---------------------------------------------------------------------------

    def place(self, tensors: Iterable[torch.Tensor], device: int) -> None:
        """Emulate ``tensors`` (by their storage) as living on device ``device``."""
        for t in tensors:
            self._placed[t.untyped_storage()._cdata] = device

    def new_stream(self, device: int = 0) -> EmulatedStream:
        """A side stream of ``device``."""
        with self._lock:
            n = sum(1 for k in self._streams if k[0] == device)
            stream = self._streams[(device, f"side{n}")] = EmulatedStream(self, f"side{n}:{device}", device)
        return stream

    @contextlib.contextmanager
    def stream(self, stream: EmulatedStream) -> Iterator[EmulatedStream]:
        """Make ``stream`` this thread's current stream for its device (as ``torch.cuda.stream``)."""
        current = self._current()
        before = current.get(stream.device)
        current[stream.device] = stream
        try:
            yield stream
        finally:
            if before is None:
                current.pop(stream.device, None)
            else:
                current[stream.device] = before

    def later(self, fn: Callable[[], None], *, device: int = 0, delay: Optional[float] = None) -> None:
        """Queue ``fn`` on this thread's current stream of ``device``: it runs late, as a kernel would."""
        self._current_stream(device).enqueue(fn, delay=self.delay if delay is None else delay)

    def pending(self) -> int:
        """Copies issued and not completed yet."""
        with self._lock:
            self._copies = [e for e in self._copies if not e.query()]
            return len(self._copies)

    def check(self) -> None:
        """Wait for every stream, then raise ``AssertionError`` naming every ordering rule broken."""
        for stream in list(self._streams.values()):
            stream.enqueue().synchronize()
        if self.violations:
            raise AssertionError("asynchronous copies out of order:\n  " + "\n  ".join(self.violations))

    def close(self) -> None:
        """Stop every stream, once the work queued on them has run (a second call does nothing)."""
        if self._closed:
            return
        self._closed = True
        for stream in list(self._streams.values()):
            stream.close()

    # -- the backend interface (offload.copies) ------------------------------------------------------

    @staticmethod
    def crosses(device: torch.device) -> bool:
        """Whether ``device`` takes the path of copies: the CPU, which stands in for devices here."""
        return device.type == "cpu"

    def device_of(self, t: torch.Tensor) -> int:
        """The emulated device of ``t``'s memory (0 unless a copy to another device made it)."""
        return self._placed.get(t.untyped_storage()._cdata, 0)

    def h2d(self, dst: Optional[torch.Tensor], src: torch.Tensor, device: int):
        """Copy ``src`` into ``dst`` (a new tensor where ``dst`` is None) on ``device`` at once, and check, ``delay``
        later on the copy stream, that ``src`` did not change before the copy completed."""
        before = src.detach().clone()
        if dst is None:
            out = torch.empty_like(src, memory_format=torch.contiguous_format)
            if device:
                key = out.untyped_storage()._cdata
                self._placed[key] = device
                weakref.finalize(out, self._placed.pop, key, None)  # the address may serve another tensor later
        else:
            out = dst
        out.copy_(src)  # what the device's work will see: it is ordered after the copy

        def late() -> None:
            if not torch.equal(_bytes(src), _bytes(before)):
                raise AssertionError(f"the host source of a copy to device {device} changed before the copy "
                                     "completed (a buffer reused too early)")

        event = self._stream(device, "h2d").enqueue(late, delay=self.delay, deps=self._deps(device))
        with self._lock:
            waited = self._waited.setdefault(device, [])
            waited[:] = [e for e in waited if not e.query()] + [event]
            self._copies.append(event)
            back = self._back.get(device, [])
            back[:] = [e for e in back if not e.query()]
            self.overlapped += bool(back)
        self.log.append(("h2d", device))
        return out, Ticket([event])

    def d2h(self, dst: torch.Tensor, src: torch.Tensor, device: int) -> Ticket:
        """Copy ``src`` into ``dst`` ``delay`` late on the copy stream, after the current stream's work; ``dst``
        holds garbage from the copy's start until it completes, so a read too early is caught."""
        before = src.detach().clone()
        need = src.storage_offset() * src.element_size() + src.numel() * src.element_size()
        storage = src.untyped_storage()
        def late() -> None:
            if storage.nbytes() >= need and not torch.equal(_bytes(src), _bytes(before)):
                raise AssertionError(f"the device source of a copy from device {device} changed before the copy "
                                     "completed")
            dst.copy_(before)

        deps = self._deps(device)  # (may make the default stream, under the lock)
        with self._lock:
            deps += self._waited.get(device, ())
        # Once the copy starts, nothing may read the destination before it completed.
        event = self._stream(device, "d2h").enqueue(late, delay=self.delay, deps=deps, start=lambda: _poison(dst))
        with self._lock:
            self._copies.append(event)
            self._back.setdefault(device, []).append(event)
        self.log.append(("d2h", device))
        return Ticket([event])

    def own_stream(self, device: int):
        """Make the worker stream of ``device`` this thread's current stream for the block (as the CUDA backend)."""
        return self.stream(self._stream(device, "worker"))

    @staticmethod
    def read_here(t: torch.Tensor) -> None:
        """Emulated device work runs on the host at once: it has read ``t`` by now."""

    def mark(self, device: int) -> Ticket:
        """A ticket done once the work queued so far on ``device``'s current stream has run."""
        self.log.append(("mark", device))
        return Ticket([self._current_stream(device).enqueue()])

    @staticmethod
    def after(ticket: Ticket) -> None:
        """Wait for ``ticket`` here: emulated device work runs on the host at once, so it may start only when the
        ticket is done."""
        ticket.wait()

    # -- internals -----------------------------------------------------------------------------------

    def _current(self) -> dict:
        current = getattr(self._local, "streams", None)
        if current is None:
            current = self._local.streams = {}
        return current

    def _current_stream(self, device: int) -> EmulatedStream:
        stream = self._current().get(device)
        return stream if stream is not None else self._stream(device, "default")

    def _deps(self, device: int) -> list:
        """What a copy stream waits for first: the work queued so far on this thread's current stream (the
        device's default stream, which every thread shares, unless the thread chose another)."""
        return [self._current_stream(device).enqueue()]

    def _stream(self, device: int, kind: str) -> EmulatedStream:
        key = (device, kind)
        stream = self._streams.get(key)
        if stream is None:
            with self._lock:
                stream = self._streams.get(key)
                if stream is None:
                    if self._closed:
                        raise RuntimeError("the copy emulator is closed")
                    stream = self._streams[key] = EmulatedStream(self, f"{kind}:{device}", device)
        return stream
