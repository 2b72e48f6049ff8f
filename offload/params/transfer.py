"""The parameter pool: its buffers shared by fetches, write-backs, gradients and prefetches, and the
unit-by-unit moves of a tensor's bytes between an extent and memory."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..aio import CheckedRead, hex_digest, wait_quietly
from ..buffers import BufferPool, HostBuffer
from ..errors import StateError
from ..pipeline import Pipeline
from ..space import Extent, SwapSpace

__all__ = ["TensorIO", "Slot", "SlotPool"]


@dataclass(eq=False)
class Slot:
    """A pool buffer and what may still be using it."""

    buffer: HostBuffer
    pending: object = None  # a write future whose source is this buffer
    event: object = None  # a CUDA event: the last copy out of this buffer to the device

    def idle(self) -> bool:
        return (self.pending is None or self.pending.done()) and (self.event is None or self.event.query())

    def settle(self) -> None:
        """Wait until nothing uses the buffer. A failed write is not raised here: whoever issued it
        holds its future and reports it."""
        if self.pending is not None:
            wait_quietly([self.pending])
            self.pending = None
        if self.event is not None:
            self.event.synchronize()
            self.event = None


# NOTE: prefetches hold slots between calls, with reads in flight. They never wait for a slot; a take
# that must have one and finds none free calls ``reclaim``, which drops the prefetch issued last (it
# is needed latest), so the pool cannot deadlock whatever order parameters are asked for in.
class SlotPool:
    """The pool's buffers as :class:`Slot` s, lent to pipelines (a :class:`offload.pipeline.BufferSource`).

    Args:
        pool: the buffers.
        reclaim: called when a slot is needed and none is free; must give at least one back.
    """

    def __init__(self, pool: BufferPool, reclaim: Callable[[], None]):
        self.pool = pool
        self.free: deque[Slot] = deque(Slot(b) for b in pool)
        self._reclaim = reclaim

    def __len__(self) -> int:
        return len(self.pool)

    def take(self, wait: bool, item=None) -> Optional[Slot]:
        """A slot nobody uses; ``wait=False``: only one idle now, else None."""
        if not wait:
            for _ in range(len(self.free)):
                slot = self.free[0]
                if slot.idle():
                    self.free.popleft()
                    slot.settle()
                    return slot
                self.free.rotate(-1)
            return None
        if not self.free:
            self._reclaim()
        slot = self.free.popleft()
        slot.settle()
        return slot

    def give(self, slot: Slot, pending=None) -> None:
        slot.pending = pending
        self.free.append(slot)

    def settle(self) -> None:
        """Every free slot idle (its writes landed, its copies done)."""
        for slot in self.free:
            slot.settle()


class TensorIO:
    """Moves a tensor's bytes between an extent and memory in units of one buffer, pipelined.

    With ``checksum``, each unit written has the checksum of the bytes it put on disk recorded (in the
    caller's ``digests`` list; computed by the engine as the write lands), and each unit read is checked
    against it as its read lands, so bytes changed on disk behind our back are named, not used.

    Args:
        space: the swap space. slots: the pool. cuda: copies to and from the device are asynchronous
            (each records an event on its slot). checksum: keep and check the units' checksums.
    """

    def __init__(self, space: SwapSpace, slots: SlotPool, *, cuda: bool, checksum: bool = True):
        self.space = space
        self.slots = slots
        self.cuda = cuda
        self.checksum = checksum
        self.unit_bytes = slots.pool.buffer_size // space.alignment * space.alignment
        self.pipeline = Pipeline(slots, lookahead=max(0, len(slots) - 1))

    def count(self, nbytes: int) -> int:
        """Units of a tensor of ``nbytes`` bytes."""
        return -(-nbytes // self.unit_bytes)

    def extent_of(self, extent: Extent, k: int, nbytes: int) -> tuple[Extent, int]:
        """The sub-extent of unit ``k`` of a tensor of ``nbytes`` bytes, and the bytes it holds."""
        start = k * self.unit_bytes
        n = min(self.unit_bytes, nbytes - start)
        return self.space.sub(extent, start, n), n

    def read_unit(self, extent: Extent, k: int, nbytes: int, buffer, *, digests: Optional[list] = None,
                  what: Callable[[], str] = lambda: "a tensor"):
        """Start reading unit ``k`` into ``buffer`` (a HostBuffer); returns the future. With ``digests``
        holding unit ``k``'s last write, waiting for the future also checks the bytes (``StateError``)."""
        ext, n = self.extent_of(extent, k, nbytes)
        check = self.checksum and digests is not None and digests[k] is not None
        fut = self.space.read(ext, buffer, nbytes=n, digest=check)
        if not check:
            return fut

        def expected() -> Optional[tuple]:
            if digests[k] is not None and not isinstance(digests[k], tuple):
                digests[k] = digests[k].digest()  # the write landed long ago
            return digests[k]

        def mismatch(found, want) -> StateError:
            return StateError(
                f"{what()}: unit {k} ({n} bytes at byte {k * self.unit_bytes} of it) has xxh3_64 {hex_digest(found)} "
                f"on disk, its last write had {hex_digest(want)}; the swap file was changed behind our back. Load a "
                "checkpoint (load_checkpoint(..., model=) or load_parameters) to restore it.")

        return CheckedRead(fut, expected, mismatch)

    def write_unit(self, extent: Extent, k: int, nbytes: int, buffer, *, digests: Optional[list] = None):
        """Start writing unit ``k`` from ``buffer``; its checksum goes to ``digests[k]`` (if given)."""
        ext, n = self.extent_of(extent, k, nbytes)
        fut = self.space.write(ext, buffer, nbytes=n, digest=self.checksum and digests is not None)
        if digests is not None:
            digests[k] = fut if self.checksum else None
        return fut

    def read_into(self, dst: torch.Tensor, extent: Extent, *, digests: Optional[list] = None,
                  pending: Optional[dict] = None, what: Callable[[], str] = lambda: "a tensor") -> int:
        """Fill ``dst`` (flat uint8) from ``extent``. ``pending``: ``{unit: (slot, read future)}`` already
        in flight (prefetches: units 0..m-1); they are consumed (and their slots given back) first.

        Returns:
            The bytes this call read from disk (prefetched units were counted when issued).
        """
        nbytes = dst.numel()
        pending = dict(pending or {})

        def copy(k: int, slot: Slot) -> bool:
            start = k * self.unit_bytes
            n = min(self.unit_bytes, nbytes - start)
            dst[start:start + n].copy_(slot.buffer.tensor[:n], non_blocking=self.cuda)
            if self.cuda:
                slot.event = torch.cuda.Event()
                slot.event.record()
            return False

        try:
            for k in sorted(pending):
                slot, fut = pending.pop(k)
                try:
                    fut.wait()
                    copy(k, slot)
                finally:
                    self.slots.give(slot)
        finally:
            for slot, fut in pending.values():
                wait_quietly([fut])
                self.slots.give(slot)
        moved = 0

        def read(k: int, slot: Slot):
            nonlocal moved
            moved += self.extent_of(extent, k, nbytes)[0].nbytes
            return self.read_unit(extent, k, nbytes, slot.buffer, digests=digests, what=what)

        first = max(pending, default=-1) + 1 if pending else 0
        rest = [k for k in range(self.count(nbytes)) if k >= first]
        self.pipeline.run(rest, read=read, process=copy)
        return moved

    def write_from(self, src: torch.Tensor, extent: Extent, futures: list, *,
                   digests: Optional[list] = None, fill: Optional[Callable] = None,
                   read_first: Optional[Callable[[int], bool]] = None) -> int:
        """Write ``src`` (flat uint8, in memory) to ``extent``; the writes land while the caller goes on
        (their futures go to ``futures``; a later read or write of the extent must wait for them).

        ``fill(k, view, stored)`` replaces the plain copy of unit ``k`` into the buffer view (``stored``:
        the unit was read first, because ``read_first(k)`` said so).

        Returns:
            The bytes that reach the disk (units rounded up to the alignment).
        """
        nbytes = src.numel()
        moved = 0
        # Weights written back are often not read first (an fp32 master holds them): a write past a cut in
        # a truncated file would fill it with a hole from which other tensors read back as zeros.
        self.space.check_intact()

        def read(k: int, slot: Slot):
            if read_first is None or not read_first(k):
                return None
            return self.read_unit(extent, k, nbytes, slot.buffer)

        def process(k: int, slot: Slot) -> bool:
            ext, n = self.extent_of(extent, k, nbytes)
            view = slot.buffer.tensor[:n]
            if fill is None:
                view.copy_(src[k * self.unit_bytes:k * self.unit_bytes + n])
            else:
                fill(k, view, read_first is not None and read_first(k))
            # The tail of the last block goes to disk too: make it deterministic, not stale bytes.
            slot.buffer.tensor[n:ext.nbytes].zero_()
            return True

        def write(k: int, slot: Slot):
            nonlocal moved
            fut = self.write_unit(extent, k, nbytes, slot.buffer, digests=digests)
            futures.append(fut)
            moved += self.extent_of(extent, k, nbytes)[0].nbytes
            return fut

        self.pipeline.run(range(self.count(nbytes)), read=read, process=process, write=write, drain=False)
        return moved
