"""The host-memory tier of offloaded state: units resident between steps, and how big it may be."""

from __future__ import annotations

import logging
import warnings
from typing import Any, Optional

import psutil

from ..buffers import HostBuffer
from ..pipeline import BufferRing
from ..sizes import GIB, format_size

__all__ = ["HostTier", "TierSource", "auto_cache_bytes"]

log = logging.getLogger("offload")

# What host_cache "auto" takes: this share of the memory available after the pools and a margin.
AUTO_SHARE = 0.5
AUTO_MARGIN_MIN = 2 * GIB
AUTO_MARGIN_FRACTION = 0.10


def auto_cache_bytes(*, pools: int, state: int, available: Optional[int] = None, quiet: bool = False) -> int:
    """The host cache ``"auto"`` picks: ``AUTO_SHARE`` of (available memory - ``pools`` - a margin of
    max(2 GiB, 10% of total memory)), at most ``state``. It never counts on memory that is not free
    now, so it cannot push the machine into swap; with little memory free it picks little, and says so
    (unless ``quiet``). ``available``: the memory to plan for instead of what is available now.
    """
    vm = psutil.virtual_memory()
    available = vm.available if available is None else available
    margin = max(AUTO_MARGIN_MIN, int(vm.total * AUTO_MARGIN_FRACTION))
    room = max(0, available - pools - margin)
    budget = min(state, int(room * AUTO_SHARE))
    if quiet:
        return budget
    text = (f'host_cache "auto": {format_size(available)} of memory available; keeping '
            f"{format_size(budget)} of {format_size(state)} of optimizer state in host memory "
            f"(half of what is left after the pools, {format_size(pools)}, and a margin of {format_size(margin)})")
    if state and budget < state // 10:
        warnings.warn(text + ". Little memory is free, so most state moves to and from NVMe at each step.",
                      RuntimeWarning, stacklevel=4)
    else:
        log.info(text)
    return budget


# NOTE: a unit resident in the tier has a page-aligned buffer of its own (pinned with the pool), and
# updates run on that buffer directly: the tier never copies state it already holds. Buffers change
# hands instead of bytes: a unit settles in by keeping the pool buffer it was read into, and a unit
# leaving the tier (written to its extent: an eviction) gives its buffer to the pool once that write
# has landed. So reads into the tier never wait for evictions, and host memory is the pool plus one
# buffer per resident unit. With ``capacity=None`` (``device: "cpu"``) every unit has a home for good.
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
        self.buffers: list[HostBuffer] = []  # the buffers this tier made (closed with it)
        self._lived_in: set[int] = set()  # ids of the buffers in homes

    def home(self, unit) -> Optional[HostBuffer]:
        """``unit``'s buffer if it is resident, else None."""
        return self.homes.get(id(unit))

    def resident(self, unit) -> bool:
        """Whether ``unit`` is resident (it has a home buffer)."""
        return id(unit) in self.homes

    @property
    def nbytes(self) -> int:
        """Host memory holding resident units now."""
        return sum(b.nbytes for b in self.homes.values())

    def settle_in(self, unit) -> HostBuffer:
        """Give ``unit`` a home now (``capacity=None`` tiers, at placement). Its bytes are undefined."""
        buf = self.new_buffer()
        self.keep(unit, buf)
        return buf

    def new_buffer(self) -> HostBuffer:
        """A buffer of a unit's size, made (and later closed) by the tier."""
        buf = HostBuffer(self.unit_bytes, pin_memory=self.pin_memory)
        self.buffers.append(buf)
        return buf

    def keep(self, unit, buf: HostBuffer) -> None:
        """``unit``, just read into ``buf``, stays resident there."""
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

    def close(self) -> None:
        """Close the buffers this tier made; no unit is resident afterwards."""
        for b in self.buffers:
            b.close()
        self.buffers, self.homes = [], {}
        self._lived_in.clear()


# NOTE: the source a StateStore's pipeline draws buffers from. A resident unit gets its own buffer (no
# read, no copy, no shared buffer); every other unit gets one from the pool's ring. A unit that is to
# stay resident after the run keeps its pool buffer as its home; the ring gets one back either from an
# eviction (a resident unit written out gives its buffer to the ring, free once the write lands) or,
# while the tier is still filling up to its capacity, a new buffer, as soon as the unit has settled. So
# the ring keeps its size, and when no read is queued every buffer in circulation is in it.
class TierSource:
    """A :class:`offload.pipeline.BufferSource` over the pool and a :class:`HostTier`.

    Args:
        ring: the pool's buffers in circulation (a ring that outlives the run; ``None``: every unit is
            resident). size: how many buffers the ring should keep (the pool's count). tier: the tier.
        to_settle: ids of the units read into a pool buffer that they keep as their home (they settle in).
    """

    def __init__(self, ring: Optional[BufferRing], size: int, tier: HostTier, to_settle: set):
        self.ring = ring
        self.tier = tier
        self.to_settle = to_settle
        self.settling: set = set()  # ids of units read into a pool buffer that they keep
        self._size = size
        self._circulating = len(ring) if ring is not None else 0

    def lends(self, item: Any) -> bool:
        """Whether ``item`` takes a shared buffer (a resident unit has its own)."""
        return not self.tier.resident(item)

    def take(self, wait: bool, item: Any = None) -> Any:
        """A resident unit's home, else a buffer of the ring (which the unit keeps where it is to settle in)."""
        home = self.tier.home(item)
        if home is not None:
            return home
        if self.ring is None:
            raise RuntimeError("a unit without a home in a tier with no pool behind it")  # a bug, not input
        buf = self.ring.take(wait, item)
        if buf is not None and id(item) in self.to_settle:
            self.settling.add(id(item))
        return buf

    def give(self, buf: Any, pending: Any = None) -> None:
        """Give a buffer back to the ring, unless it is a unit's home."""
        if self.tier.lived_in(buf):
            return  # a resident unit's home, or a unit that just settled in there
        assert self.ring is not None, "without a pool every buffer is a unit's home"
        self.ring.give(buf, pending)  # a pool buffer, or an evicted unit's former home

    def settled(self) -> None:
        """A unit kept its pool buffer as its home: the ring gets one back (a new one, unless evictions
        of this run have brought it more than it had)."""
        self._circulating -= 1
        if self._circulating < self._size:
            assert self.ring is not None, "a unit settles in a pool buffer"
            self.ring.give(self.tier.new_buffer())
            self._circulating += 1

    def evicted(self) -> None:
        """A resident unit is being written out: its buffer joins the ring when given back."""
        self._circulating += 1
