"""Streams units of swapped state through the buffer pool: read(i+1) || update(i) || write(i-1).

# NOTE: the I/O runs on the native engine's threads, and torch's kernels release the GIL, so while
# the caller's update of unit i computes, the read of the next units and the write of the previous
# one proceed on the disk. With B buffers, one holds the unit being updated, one (or more) the
# writes still landing, and the rest the reads ahead (B - 2 of them, at least 1). Buffers are reused
# in the order they were released, so the buffer a read needs is always the one whose write was
# issued longest ago.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Sequence

from .aio import CompletedFuture, wait_quietly
from .buffers import BufferPool, HostBuffer
from .errors import PoolTooSmallError


class Swapper:
    """Runs an update over units whose state lives in a swap space, through a fixed pool.

    Args:
        space: the swap space holding each unit's extent.
        pool: the host buffers (at least 2; 3 or more overlap read, update and write).
        pipeline_read: read units ahead while the current one is updated.
        pipeline_write: let a unit's write land while the next ones are updated.
    """

    def __init__(self, space, pool: BufferPool, *, pipeline_read: bool = True, pipeline_write: bool = True):
        if len(pool) < 2:
            raise PoolTooSmallError(
                f"the swapper needs at least 2 pool buffers, got {len(pool)}; set buffer_count to 3 or more"
            )
        self.space = space
        self.pool = pool
        self.pipeline_read = pipeline_read
        self.pipeline_write = pipeline_write
        self.bytes_read = 0
        self.bytes_written = 0

    @property
    def lookahead(self) -> int:
        """How many reads may be in flight beyond the unit being updated."""
        return max(1, len(self.pool) - 2) if self.pipeline_read else 0

    def run(
        self,
        units: Sequence,
        update: Callable[[object, HostBuffer], bool],
        *,
        needs_read: Callable[[object], bool] = lambda unit: True,
    ) -> None:
        """For each unit: read its extent into a buffer, ``update(unit, buffer)``, write it back.

        ``update`` returns whether the buffer changed and must be written. ``needs_read(unit)``
        returning False skips the read (state not created yet); the buffer then holds stale bytes
        that ``update`` must overwrite.

        Raises:
            OSError: a read or write failed (after every request in flight has landed).
        """
        free: deque = deque((b, None) for b in self.pool)  # (buffer, its pending write)
        reads: deque = deque()  # (unit, buffer, read future), in unit order
        writes: list = []
        next_read = 0
        try:
            for i in range(len(units)):
                while next_read < len(units) and free and next_read <= i + self.lookahead:
                    buf, pending = free.popleft()
                    if pending is not None:
                        pending.wait()
                    u = units[next_read]
                    fut = self.space.read(u.extent, buf, nbytes=u.nbytes) if needs_read(u) else CompletedFuture()
                    reads.append((u, buf, fut))
                    next_read += 1
                u, buf, fut = reads.popleft()
                self.bytes_read += fut.wait()
                if update(u, buf):
                    wfut = self.space.write(u.extent, buf, nbytes=u.nbytes)
                    if not self.pipeline_write:
                        self.bytes_written += wfut.wait()
                        wfut = None
                    else:
                        writes.append(wfut)
                    free.append((buf, wfut))
                else:
                    free.append((buf, None))
            for wfut in writes:
                self.bytes_written += wfut.wait()
        except BaseException:
            # Buffers may still be targets of I/O: let everything land before the error leaves.
            wait_quietly(fut for _, _, fut in reads)
            wait_quietly(writes)
            raise
