"""The parameter pool: its buffers shared by fetches, write-backs, gradients and prefetches, and the
block-by-block moves of a tensor's bytes between its extent and memory."""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

from .. import copies
from ..aio import wait_quietly
from ..buffers import BufferPool, HostBuffer
from ..bytes import ByteStore, Stored
from ..copies import DONE, Ticket
from ..pipeline import Pipeline

__all__ = ["BufferLender", "NoPool", "PoolBuffer", "TensorIO"]


class NoPool:
    """The parameter pool of a store with nothing on NVMe: no buffers, no memory. ``buffer_size`` is what one
    would be, the block size of the store's byte store (a checkpoint streams host-cached weights through buffers
    of that size, made for it: see ``Checkpointing.exclusive``)."""

    nbytes = 0

    def __init__(self, buffer_size: int):
        self.buffer_size = buffer_size

    def __len__(self) -> int:
        return 0

    def __iter__(self) -> Iterator[HostBuffer]:
        return iter(())

    def close(self) -> None:
        """Nothing to close."""


@dataclass(eq=False)
class PoolBuffer:
    """A pool buffer and what may still be using it."""

    buffer: HostBuffer
    pending: object = None  # a write future whose source is this buffer
    copying: Ticket = DONE  # the last copy out of this buffer to a device

    def idle(self) -> bool:
        """Whether nothing uses the buffer now: its write landed and its copy to a device completed."""
        return (self.pending is None or self.pending.done()) and self.copying.done()

    def wait_idle(self) -> None:
        """Wait until nothing uses the buffer. A failed write is not raised here: whoever issued it
        holds its future and reports it."""
        if self.pending is not None:
            wait_quietly([self.pending])
            self.pending = None
        self.copying.wait()
        self.copying = DONE


# NOTE: prefetches hold buffers between calls, with reads in flight. They never wait for a buffer; a take
# that must have one and finds none free calls ``reclaim``, which drops the prefetch issued last (it
# is needed latest), so the pool cannot deadlock whatever order parameters are asked for in.
class BufferLender:
    """The pool's buffers as :class:`PoolBuffer` s, lent to pipelines (a :class:`offload.pipeline.BufferSource`).

    Args:
        pool: the buffers.
        reclaim: called when a buffer is needed and none is free; must give at least one back.
    """

    def __init__(self, pool: BufferPool, reclaim: Callable[[], None]):
        self.pool = pool
        self.free: deque[PoolBuffer] = deque(PoolBuffer(b) for b in pool)
        self._reclaim = reclaim

    def __len__(self) -> int:
        return len(self.pool)

    def take(self, wait: bool, item=None) -> Optional[PoolBuffer]:
        """A pool buffer nobody uses; ``wait=False``: only one idle now, else None."""
        if not wait:
            for _ in range(len(self.free)):
                pbuf = self.free[0]
                if pbuf.idle():
                    self.free.popleft()
                    pbuf.wait_idle()
                    return pbuf
                self.free.rotate(-1)
            return None
        if not self.free:
            self._reclaim()
        pbuf = self.free.popleft()
        pbuf.wait_idle()
        return pbuf

    def give(self, pbuf: PoolBuffer, pending=None) -> None:
        """Give ``pbuf`` back; ``pending``: a write still reading it, or None."""
        pbuf.pending = pending
        self.free.append(pbuf)

    def wait_idle(self) -> None:
        """Every free buffer idle (its writes landed, its copies done)."""
        for pbuf in self.free:
            pbuf.wait_idle()

    @contextlib.contextmanager
    def lend_all(self) -> Iterator[list[HostBuffer]]:
        """Every free buffer, idle, for the block (a checkpoint streams through them); given back after it.
        The caller holds the store still meanwhile (no prefetch in flight: every buffer is free)."""
        self.wait_idle()
        lent = list(self.free)
        self.free.clear()
        try:
            yield [pbuf.buffer for pbuf in lent]
        finally:
            self.free.extend(lent)


class TensorIO:
    """Moves a tensor's bytes between its extent and memory in blocks of one pool buffer, pipelined.

    Reads, writes, checksums and the landing of writes are the byte store's; this adds the pipeline
    over the pool's buffers and the copies between the blocks and the tensor.

    Args:
        store: the :class:`offload.bytes.ByteStore` the bytes live in. lender: the pool.

    Copies between a block and a tensor on a device are asynchronous (:mod:`offload.copies`): a pool buffer
    a copy reads is lent again only after it completed, and one a copy fills is written only after.
    """

    def __init__(self, store: ByteStore, lender: BufferLender):
        self.store = store
        self.space = store.space
        self.lender = lender
        self.block_bytes = store.block_bytes
        self.pipeline = Pipeline(lender, lookahead=max(0, len(lender) - 1))

    def count(self, nbytes: int) -> int:
        """Blocks of a tensor of ``nbytes`` bytes."""
        return self.store.block_count(nbytes)

    def read_into(self, dst: torch.Tensor, stored: Stored, *, pending: Optional[dict] = None,
                  what: Callable[[], str] = lambda: "a tensor") -> int:
        """Fill ``dst`` (flat uint8) from ``stored``'s extent, each block checked. ``pending``: ``{block: (pbuf,
        read future)}`` already in flight (prefetches: blocks 0..m-1); they are consumed (and their buffers
        given back) first. The caller lands the extent's writes first.

        Returns:
            The bytes this call read from disk (prefetched blocks were counted when issued).
        """
        nbytes = dst.numel()
        pending = dict(pending or {})
        crossing = copies.crosses(dst.device)

        def copy(k: int, pbuf: PoolBuffer) -> bool:
            start = k * self.block_bytes
            n = min(self.block_bytes, nbytes - start)
            if crossing:
                pbuf.copying = copies.into_device(dst[start:start + n], pbuf.buffer.tensor[:n])
            else:
                dst[start:start + n].copy_(pbuf.buffer.tensor[:n])
            return False

        first = max(pending, default=-1) + 1  # the prefetched blocks are the first ones: read the rest
        try:
            for k in sorted(pending):
                pbuf, fut = pending.pop(k)
                try:
                    fut.wait()
                    copy(k, pbuf)
                finally:
                    self.lender.give(pbuf)
        finally:
            for pbuf, fut in pending.values():
                wait_quietly([fut])
                self.lender.give(pbuf)
        moved = 0

        def read(k: int, pbuf: PoolBuffer):
            nonlocal moved
            moved += self.store.block(stored, k)[0].nbytes
            return self.store.read(stored, pbuf.buffer, k, what=what)

        rest = [k for k in range(self.count(nbytes)) if k >= first]
        self.pipeline.run(rest, read=read, process=copy)
        return moved

    def write_from(self, src: torch.Tensor, stored: Stored, *, fill: Optional[Callable] = None,
                   read_first: Optional[Callable[[int], bool]] = None) -> int:
        """Write ``src`` (flat uint8, in memory) to ``stored``'s extent; the writes land while the caller goes
        on (they join ``stored.writes``; a later read or write of the extent lands them first). The caller
        lands the extent's earlier writes first.

        ``fill(k, view, stored)`` replaces the plain copy of block ``k`` into the buffer view (``stored``:
        the block was read first, because ``read_first(k)`` said so); it may return the :class:`Ticket` of a
        copy into the view, which the block's write waits for.

        Returns:
            The bytes that reach the disk (blocks rounded up to the alignment).
        """
        nbytes = src.numel()
        moved = 0
        crossing = copies.crosses(src.device)
        landing: dict[int, Ticket] = {}  # block -> its copy from the device into the pool buffer
        # Weights written back are often not read first (an fp32 master holds them): a write past a cut in
        # a truncated file would fill it with a hole from which other tensors read back as zeros.
        self.store.check_intact(fails=False)

        def read(k: int, pbuf: PoolBuffer):
            if read_first is None or not read_first(k):
                return None
            return self.store.read(stored, pbuf.buffer, k)

        def process(k: int, pbuf: PoolBuffer) -> bool:
            n = self.store.block(stored, k)[1]
            view = pbuf.buffer.tensor[:n]
            if fill is None and crossing:
                landing[k] = copies.to_host(view, src[k * self.block_bytes:k * self.block_bytes + n])
            elif fill is None:
                view.copy_(src[k * self.block_bytes:k * self.block_bytes + n])
            else:
                ticket = fill(k, view, read_first is not None and read_first(k))
                if ticket is not None:
                    landing[k] = ticket
            return True  # the tail of the last block: ByteStore.write zeroes it

        def write(k: int, pbuf: PoolBuffer):
            nonlocal moved
            landing.pop(k, DONE).wait()  # the bytes from the device are in the buffer
            fut = self.store.write(stored, pbuf.buffer, k)
            moved += self.store.block(stored, k)[0].nbytes
            return fut

        try:
            self.pipeline.run(range(self.count(nbytes)), read=read, process=process, write=write, drain=False)
        finally:
            copies.waited(landing.values())  # a block that failed before its write: its buffer is lent again
        return moved
