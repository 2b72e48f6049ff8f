"""Every copy between host memory and a device, and when it has completed.

The rest of the package never calls ``non_blocking=True``, makes events or picks streams: it asks this
module. Devices come from the tensors, never from the current device.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterable, Iterator, Optional

import torch

__all__ = ["DONE", "Ticket", "after", "crosses", "emulated", "into_device", "on_each_device", "on_host", "own_streams",
           "produced", "read_here", "to_device", "to_host", "waited"]


class Ticket:
    """The completion of copies (or of the work that produced some tensors): ``done()``, ``wait()``.

    A buffer a copy reads is handed back for reuse, and a host buffer a copy fills is read, only after
    the ticket says the copy completed.
    """

    __slots__ = ("_parts",)

    def __init__(self, parts: Iterable = ()):
        # Each part has query() and synchronize() (a CUDA event, or an emulated one); a part may also carry
        # ``device`` (the device whose stream recorded it), for after().
        self._parts = tuple(parts)

    def done(self) -> bool:
        """Whether every copy has completed (never waits)."""
        return all(p.query() for p in self._parts)

    def wait(self) -> None:
        """Wait until every copy has completed."""
        for p in self._parts:
            p.synchronize()

    def __or__(self, other: Ticket) -> Ticket:
        """Both tickets: done when both are."""
        if not other._parts:
            return self
        if not self._parts:
            return other
        return Ticket(self._parts + other._parts)

    @staticmethod
    def all(tickets: Iterable[Ticket]) -> Ticket:
        """One ticket for all of ``tickets``: done when each of them is."""
        return Ticket(p for t in tickets for p in t._parts)

    @property
    def parts(self) -> tuple:
        """The events it stands for (CUDA events, or the emulator's)."""
        return self._parts


DONE = Ticket()  # nothing in flight


def waited(tickets: Iterable[Optional[Ticket]]) -> None:
    """Wait for every ticket (None: nothing), even after one raised: a buffer is reused after this."""
    first = None
    for t in tickets:
        if t is None:
            continue
        try:
            t.wait()
        except BaseException as err:  # the first is raised once every copy is waited for
            first = first or err
    if first is not None:
        raise first


# -- the backend: CUDA by default, or a CPU emulator installed for a block -------------------------

_lock = threading.Lock()
_installed: list = []  # the emulator installed by emulated(), if any (process-wide: worker threads see it)
_cuda = None


def _backend():
    if _installed:
        return _installed[-1]
    global _cuda
    if _cuda is None:
        with _lock:
            if _cuda is None:
                from .cuda import CudaCopies
                _cuda = CudaCopies()
    return _cuda


@contextlib.contextmanager
def emulated(delay: float = 0.002) -> Iterator:
    """Install a CPU emulator of asynchronous copies for the block (tests): CPU tensors then take the path
    device tensors take, each copy performed ``delay`` seconds late on a thread, and the ordering rules
    checked (see :class:`offload.copies.emulator.EmulatedCopies`). Yields the emulator."""
    from .emulator import EmulatedCopies

    emu = EmulatedCopies(delay)
    with _lock:
        _installed.append(emu)
    try:
        yield emu
    finally:
        with _lock:
            _installed.remove(emu)
        emu.close()


def crosses(device: torch.device) -> bool:
    """Whether tensors on ``device`` are reached from host memory by (asynchronous) copies: a GPU's, or the
    CPU's under the emulator. Otherwise state is used in place in host memory."""
    return _backend().crosses(device)


def to_device(src: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, Ticket]:
    """A new tensor on ``like``'s device holding ``src`` (host memory), for work issued after this on that
    device's current stream (which waits for the copy). The ticket says when ``src`` may be reused."""
    b = _backend()
    return b.h2d(None, src, b.device_of(like))


def into_device(dst: torch.Tensor, src: torch.Tensor) -> Ticket:
    """Copy ``src`` (host memory) into ``dst`` (on a device), ordered before later work on ``dst``'s device's
    current stream. The ticket says when ``src`` may be reused."""
    b = _backend()
    return b.h2d(dst, src, b.device_of(dst))[1]


def to_host(dst: torch.Tensor, src: torch.Tensor) -> Ticket:
    """Copy ``src`` (on a device) into ``dst`` (host memory), after the work already issued on ``src``'s
    device's current stream. ``dst`` holds the bytes only once the ticket is done."""
    b = _backend()
    return b.d2h(dst, src, b.device_of(src))


def on_host(src: torch.Tensor) -> torch.Tensor:
    """A new host tensor holding ``src`` (on a device), once the copy completed: for host code that needs the
    values now (it waits)."""
    dst = torch.empty(src.shape, dtype=src.dtype)
    to_host(dst, src).wait()
    return dst


def produced(tensors: Iterable[Optional[torch.Tensor]]) -> Ticket:
    """Where the current streams of ``tensors``' devices are now: done when the work issued so far on them
    (what produced the tensors, for instance a backward on a side stream) has run."""
    b = _backend()
    return Ticket.all(b.mark(d) for d in _devices(b, tensors))


def _devices(b, tensors: Iterable[Optional[torch.Tensor]]) -> list:
    """The devices (as the backend names them) of ``tensors`` reached by copies, each once."""
    return [b.device_of(t) for t in on_each_device(tensors)]


def on_each_device(tensors: Iterable[Optional[torch.Tensor]]) -> list:
    """One of ``tensors`` per device reached by copies: all that :func:`produced` and :func:`own_streams` look
    at, for a caller that passes the same tensors again and again."""
    b = _backend()
    one: dict[str, torch.Tensor] = {}
    for t in tensors:
        if t is not None and b.crosses(t.device):
            one.setdefault(repr(b.device_of(t)), t)
    return list(one.values())


@contextlib.contextmanager
def own_streams(tensors: Iterable[torch.Tensor]) -> Iterator[None]:
    """For the block, this thread's work on the devices of ``tensors`` (its copies, and the math it issues)
    goes to a stream of its own on each device instead of the device's default stream, which every thread
    shares. A worker beside backward then neither queues behind the backward work issued so far nor holds
    it up; it orders itself against other threads' work only through :func:`produced` and :func:`after`.

    There is one such stream per device in the process (two optimizers' workers share it, in turn). Memory
    allocated on it is cached for it: GPU memory reserved grows by what the worker's work holds at once."""
    b = _backend()
    with contextlib.ExitStack() as stack:
        for d in _devices(b, tensors):
            stack.enter_context(b.own_stream(d))
        yield


def read_here(tensors: Iterable[Optional[torch.Tensor]]) -> None:
    """``tensors`` (made on other streams, a backward's grads) are read by work this thread has issued on
    its current streams: their memory is not given to other work before that work ran, even once the last
    reference to them is dropped."""
    b = _backend()
    for t in tensors:
        if t is not None and b.crosses(t.device):
            b.read_here(t)


def after(ticket: Ticket) -> None:
    """Work issued from here on by this thread (on its current streams) runs after ``ticket`` is done."""
    if ticket.parts:
        _backend().after(ticket)
