"""The host-memory tier of offloaded state: units resident between steps, and how big it may be."""

from __future__ import annotations

import logging
import warnings
from collections import deque
from typing import Any, Optional

import psutil

from ..aio import wait_quietly
from ..buffers import BufferPool, HostBuffer
from ..pipeline import BufferRing
from ..units import GIB, format_size

__all__ = ["HostTier", "TierSource", "auto_cache_bytes"]

log = logging.getLogger("offload")

# What host_cache "auto" takes: this share of the memory available after the pools and a margin.
AUTO_SHARE = 0.5
AUTO_MARGIN_MIN = 2 * GIB
AUTO_MARGIN_FRACTION = 0.10


def auto_cache_bytes(*, pools: int, state: int) -> int:
    """The host cache ``"auto"`` picks: ``AUTO_SHARE`` of (available memory - ``pools`` - a margin of
    max(2 GiB, 10% of total memory)), at most ``state``. It never counts on memory that is not free
    now, so it cannot push the machine into swap; with little memory free it picks little, and says so.
    """
    vm = psutil.virtual_memory()
    margin = max(AUTO_MARGIN_MIN, int(vm.total * AUTO_MARGIN_FRACTION))
    room = max(0, vm.available - pools - margin)
    budget = min(state, int(room * AUTO_SHARE))
    text = (f'host_cache "auto": {format_size(vm.available)} of memory available; keeping '
            f"{format_size(budget)} of {format_size(state)} of optimizer state in host memory "
            f"(half of what is left after the pools, {format_size(pools)}, and a margin of {format_size(margin)})")
    if state and budget < state // 10:
        warnings.warn(text + ". Little memory is free, so most state moves to and from NVMe at each step.",
                      RuntimeWarning, stacklevel=4)
    else:
        log.info(text)
    return budget


# NOTE: a unit resident in the tier has a page-aligned buffer of its own (pinned with the pool), and
# updates run on that buffer directly: the tier never copies state it already holds. Buffers are made
# lazily, up to ``capacity``, so host memory grows to the cache size only as units settle in. A unit
# leaves the tier by being written to its extent (an eviction); its buffer is free again once that
# write has landed. With ``capacity=None`` (``device: "cpu"``) every unit has a home for good.
class HostTier:
    """Units of state resident in host memory.

    Args:
        capacity: how many units may be resident (``None``: all of them, no swap space behind).
        unit_bytes: the size of a unit's buffer (the pool's buffer size).
        pin_memory: pin the buffers for CUDA copies.
    """

    def __init__(self, capacity: Optional[int], unit_bytes: int, *, pin_memory: bool):
        self.capacity = capacity
        self.unit_bytes = unit_bytes
        self.pin_memory = pin_memory
        self.homes: dict[int, HostBuffer] = {}  # id(unit) -> its buffer
        self.free: deque = deque()  # (buffer, pending eviction write or None)
        self.buffers: list[HostBuffer] = []
        self._lived_in: set[int] = set()  # ids of the buffers in homes

    def home(self, unit) -> Optional[HostBuffer]:
        """``unit``'s buffer if it is resident, else None."""
        return self.homes.get(id(unit))

    def resident(self, unit) -> bool:
        return id(unit) in self.homes

    @property
    def nbytes(self) -> int:
        """Host memory the tier holds now."""
        return sum(b.nbytes for b in self.buffers)

    @property
    def resident_count(self) -> int:
        return len(self.homes)

    def settle_in(self, unit) -> HostBuffer:
        """Give ``unit`` a home now (``capacity=None`` tiers, at placement). Its bytes are undefined."""
        buf = self._new()
        self.keep(unit, buf)
        return buf

    def take_free(self, wait: bool) -> Optional[HostBuffer]:
        """A buffer for a unit about to settle in: a free one (once its eviction landed) or a new one while
        under capacity; ``None`` if there is none now (``wait=False``) or none will come (full)."""
        if self.free:
            buf, pending = self.free[0]
            if pending is not None and not wait and not pending.done():
                return None
            self.free.popleft()
            wait_quietly([pending] if pending is not None else [])  # the evicting run reports its error
            return buf
        if self.capacity is None or len(self.buffers) < self.capacity:
            return self._new()
        return None

    def keep(self, unit, buf: HostBuffer) -> None:
        """``unit``, just read into ``buf`` (a tier buffer), stays resident there."""
        self.homes[id(unit)] = buf
        self._lived_in.add(id(buf))

    def leave(self, unit) -> HostBuffer:
        """``unit`` is being written out: it is no longer resident. Returns its former buffer."""
        buf = self.homes.pop(id(unit))
        self._lived_in.discard(id(buf))
        return buf

    def lived_in(self, buf) -> bool:
        """Whether a unit is resident in ``buf``."""
        return id(buf) in self._lived_in

    def release(self, buf: HostBuffer, pending: Any = None) -> None:
        """A tier buffer nobody lives in: free once ``pending`` (its eviction write) has landed."""
        self.free.append((buf, pending))

    def close(self) -> None:
        wait_quietly(p for _, p in self.free if p is not None)
        for b in self.buffers:
            b.close()
        self.buffers, self.homes = [], {}
        self._lived_in.clear()
        self.free.clear()

    def _new(self) -> HostBuffer:
        buf = HostBuffer(self.unit_bytes, pin_memory=self.pin_memory)
        self.buffers.append(buf)
        return buf


# NOTE: the source a StateStore's pipeline draws buffers from. A resident unit gets its own buffer (no
# read, no copy); a unit that is to settle in the tier after this run gets a free tier buffer and is read
# into it; every other unit gets a pool buffer. When a unit was meant to settle in but no tier buffer is
# free at that moment (the evictions that would free one come later in this run's order), it takes a
# pool buffer and is written back like any other: never a wait that cannot end.
class TierSource:
    """A :class:`offload.pipeline.BufferSource` over the pool and a :class:`HostTier`.

    Args:
        pool: the pool's buffers. tier: the tier. settle: ids of the units that are to be resident after
            the run (those already resident stay).
    """

    def __init__(self, pool: Optional[BufferPool], tier: HostTier, settle: set):
        self.ring = BufferRing(list(pool)) if pool is not None else None
        self.pool_ids = {id(b) for b in pool} if pool is not None else set()
        self.tier = tier
        self.settle = settle
        self.settling: set = set()  # ids of units read into a tier buffer by this run

    def take(self, wait: bool, item: Any = None) -> Any:
        home = self.tier.home(item)
        if home is not None:
            return home
        if id(item) in self.settle:
            buf = self.tier.take_free(wait)
            if buf is not None:
                self.settling.add(id(item))
                return buf
            if not wait and self.tier.free:
                return None  # one is being freed: wait for it at the next take
        if self.ring is None:
            raise RuntimeError("a unit without a home in a tier with no pool behind it")  # a bug, not input
        return self.ring.take(wait, item)

    def give(self, buf: Any, pending: Any = None) -> None:
        if id(buf) in self.pool_ids:
            self.ring.give(buf, pending)
        elif not self.tier.lived_in(buf):
            # Evicted (free once the write lands), or taken to settle a unit in and then not kept (an error).
            self.tier.release(buf, pending)

    def is_pool(self, buf: Any) -> bool:
        return id(buf) in self.pool_ids
