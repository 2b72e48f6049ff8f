"""The parameter pool: its buffers shared by fetches, write-backs, gradients and prefetches, and the
unit-by-unit moves of a tensor's bytes between an extent and memory."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..aio import wait_quietly
from ..buffers import BufferPool, HostBuffer
from ..pipeline import Pipeline
from ..store import ByteStore, Stored

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
    """Moves a tensor's bytes between its extent and memory in blocks of one pool buffer, pipelined.

    Reads, writes, checksums and the landing of writes are the byte store's; this adds the pipeline
    over the pool's slots and the copies between the blocks and the tensor.

    Args:
        store: the :class:`offload.store.ByteStore` the bytes live in. slots: the pool. cuda: copies to and
            from the device are asynchronous (each records an event on its slot).
    """

    def __init__(self, store: ByteStore, slots: SlotPool, *, cuda: bool):
        self.store = store
        self.space = store.space
        self.slots = slots
        self.cuda = cuda
        self.unit_bytes = store.block_bytes
        self.pipeline = Pipeline(slots, lookahead=max(0, len(slots) - 1))

    def count(self, nbytes: int) -> int:
        """Blocks of a tensor of ``nbytes`` bytes."""
        return self.store.block_count(nbytes)

    def read_into(self, dst: torch.Tensor, stored: Stored, *, pending: Optional[dict] = None,
                  what: Callable[[], str] = lambda: "a tensor") -> int:
        """Fill ``dst`` (flat uint8) from ``stored``'s extent, each block checked. ``pending``: ``{block: (slot,
        read future)}`` already in flight (prefetches: blocks 0..m-1); they are consumed (and their slots
        given back) first. The caller lands the extent's writes first.

        Returns:
            The bytes this call read from disk (prefetched blocks were counted when issued).
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
            moved += self.store.block(stored, k)[0].nbytes
            return self.store.read(stored, slot.buffer, k, what=what)

        first = max(pending, default=-1) + 1 if pending else 0
        rest = [k for k in range(self.count(nbytes)) if k >= first]
        self.pipeline.run(rest, read=read, process=copy)
        return moved

    def write_from(self, src: torch.Tensor, stored: Stored, *, fill: Optional[Callable] = None,
                   read_first: Optional[Callable[[int], bool]] = None) -> int:
        """Write ``src`` (flat uint8, in memory) to ``stored``'s extent; the writes land while the caller goes
        on (they join ``stored.writes``; a later read or write of the extent lands them first). The caller
        lands the extent's earlier writes first.

        ``fill(k, view, stored)`` replaces the plain copy of block ``k`` into the buffer view (``stored``:
        the block was read first, because ``read_first(k)`` said so).

        Returns:
            The bytes that reach the disk (blocks rounded up to the alignment).
        """
        nbytes = src.numel()
        moved = 0
        # Weights written back are often not read first (an fp32 master holds them): a write past a cut in
        # a truncated file would fill it with a hole from which other tensors read back as zeros.
        self.store.check_intact(fails=False)

        def read(k: int, slot: Slot):
            if read_first is None or not read_first(k):
                return None
            return self.store.read(stored, slot.buffer, k)

        def process(k: int, slot: Slot) -> bool:
            ext, n = self.store.block(stored, k)
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
            fut = self.store.write(stored, slot.buffer, k)
            moved += self.store.block(stored, k)[0].nbytes
            return fut

        self.pipeline.run(range(self.count(nbytes)), read=read, process=process, write=write, drain=False)
        return moved
