"""Copies between host memory and CUDA devices, on two copy streams per device (and a worker's stream)."""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Optional

import torch

from . import Ticket

__all__ = ["CudaCopies"]


class _Recorded:
    """A CUDA event and the device whose stream recorded it (a part of a :class:`Ticket`)."""

    __slots__ = ("event", "device")

    def __init__(self, stream, device: torch.device):
        self.event = torch.cuda.Event()
        self.event.record(stream)
        self.device = device

    def query(self) -> bool:
        return self.event.query()

    def synchronize(self) -> None:
        self.event.synchronize()


# NOTE: each device gets two copy streams, one per direction, so the next unit's copy to the device runs
# while the current unit's copy back runs (a pinned buffer moves about as fast both ways at once as one way).
# A copy to the device waits for the work queued so far on the device's current stream (its destination may
# be memory that work just freed or still reads), and that stream waits for the copy; a copy back waits for
# the current stream (the work that made its source) and keeps its source alive until it ran
# (record_stream). Events are recorded on the stream that ran the copy, taken from the tensor's device: in a
# worker thread the current device is device 0 whatever the parameters' device is, and an event there would
# complete before a copy on another device. The device is made current around each copy (torch.cuda.device
# restores the old one only where it has a context), so the worker thread makes no CUDA context on device 0.
# The overlap_backward worker issues all its work on a third stream per device (own_stream), current with its
# device for the whole step, ordered against backward only by the events of the grads it reads (produced).
class CudaCopies:
    """The backend of :mod:`offload.copies` for CUDA devices (CPU tensors are copied at once)."""

    def __init__(self) -> None:
        self._streams: dict = {}
        self._lock = threading.Lock()

    @staticmethod
    def crosses(device: torch.device) -> bool:
        """Whether ``device`` is reached by copies: a CUDA device."""
        return device.type == "cuda"

    @staticmethod
    def device_of(t: torch.Tensor) -> torch.device:
        """``t``'s device, as this backend names devices."""
        return t.device

    def _stream(self, device: torch.device, direction: str):
        key = (device.index, direction)
        stream = self._streams.get(key)
        if stream is None:
            with self._lock:
                stream = self._streams.get(key)
                if stream is None:
                    stream = self._streams[key] = torch.cuda.Stream(device=device)
        return stream

    def h2d(self, dst: Optional[torch.Tensor], src: torch.Tensor, device: torch.device):
        """Copy ``src`` (host memory) into ``dst`` on ``device`` (a new tensor where ``dst`` is None) on the
        device's copy stream, ordered before later work on its current stream; returns the tensor and the
        ticket that says when ``src`` may be reused."""
        if device.type != "cuda":
            out = src.to(device, copy=True) if dst is None else dst.copy_(src)
            return out, Ticket()
        compute = torch.cuda.current_stream(device)
        side = self._stream(device, "h2d")
        if dst is None:
            dst = torch.empty(src.shape, dtype=src.dtype, device=device)  # allocated for the compute stream
        # The destination may be memory the compute stream just freed or still reads.
        side.wait_stream(compute)
        with torch.cuda.device(device), torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)
        done = _Recorded(side, device)
        compute.wait_event(done.event)
        return dst, Ticket([done])

    def d2h(self, dst: torch.Tensor, src: torch.Tensor, device: torch.device) -> Ticket:
        """Copy ``src`` (on ``device``) into ``dst`` (host memory) after the work issued on its current stream;
        ``dst`` holds the bytes once the ticket is done."""
        if device.type != "cuda":
            dst.copy_(src)
            return Ticket()
        side = self._stream(device, "d2h")
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.device(device), torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)
        src.record_stream(side)  # not reused by the allocator before the copy ran
        return Ticket([_Recorded(side, device)])

    @contextlib.contextmanager
    def own_stream(self, device: torch.device) -> Iterator[None]:
        """Make ``device``, and its worker stream, current for the block."""
        # The device first: torch.cuda.stream alone would switch devices and, on the way out, make the
        # thread's old device current again, creating a context there (device 0 in a worker thread).
        with torch.cuda.device(device), torch.cuda.stream(self._stream(device, "worker")):
            yield

    @staticmethod
    def read_here(t: torch.Tensor) -> None:
        """Keep ``t``'s memory from other work until what its device's current stream has queued has run."""
        t.record_stream(torch.cuda.current_stream(t.device))

    @staticmethod
    def mark(device: torch.device):
        """A ticket done once the work issued so far on ``device``'s current stream has run."""
        return Ticket([_Recorded(torch.cuda.current_stream(device), device)])

    @staticmethod
    def after(ticket: Ticket) -> None:
        """Make the current streams of ``ticket``'s devices wait for its events before the work issued from here."""
        for part in ticket.parts:
            if isinstance(part, _Recorded):
                torch.cuda.current_stream(part.device).wait_event(part.event)
