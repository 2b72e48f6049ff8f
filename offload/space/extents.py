"""Extents of a swap space's logical address space, and their allocator (bookkeeping only, no I/O)."""

from __future__ import annotations

import bisect
import copy
from dataclasses import dataclass, field

from ..sizes import ALIGNMENT, round_up

__all__ = ["Extent", "ExtentAllocator"]


@dataclass(frozen=True)
class Extent:
    """A range of a swap space's logical address space.

    Attributes:
        offset: start, a multiple of the space's ``alignment``.
        nbytes: reserved length, a multiple of the space's ``alignment`` (at least what was asked;
            0 only for a zero-length allocation).
        owner: the allocating space's id (0: unknown, e.g. built by hand), so that freeing another
            space's extent is caught. Not part of equality.
    """

    offset: int
    nbytes: int
    owner: int = field(default=0, compare=False, repr=False)

    @property
    def end(self) -> int:
        """The offset just past the extent."""
        return self.offset + self.nbytes


# NOTE: best fit over a sorted list of free ranges; a freed extent merges with its free neighbours,
# so once everything is freed the space is one free range again and fragmentation cannot
# accumulate. The allocator never does I/O: the swap space grows its files first, then the allocator.
class ExtentAllocator:
    """Bookkeeping of a ``[0, capacity)`` address space in aligned extents.

    Args:
        capacity: initial size of the address space (a multiple of ``alignment``).
        alignment: every offset and length is a multiple of this.
        owner: id stamped on the extents handed out (see :attr:`Extent.owner`).
    """

    def __init__(self, capacity: int = 0, alignment: int = ALIGNMENT, owner: int = 0):
        if alignment <= 0 or capacity < 0 or capacity % alignment:
            raise ValueError(f"capacity {capacity} must be a non-negative multiple of alignment {alignment}")
        self.alignment = alignment
        self.owner = owner
        self.capacity = 0
        self.used = 0
        self._free_starts: list[int] = []  # sorted
        self._free_len: dict[int, int] = {}  # start -> length
        self._live: dict[int, int] = {}  # offset -> length
        self.grow(capacity)

    def copy(self) -> ExtentAllocator:
        """An independent copy, to try a series of allocations and keep the result only if it fits."""
        other = copy.copy(self)
        other._free_starts = list(self._free_starts)
        other._free_len = dict(self._free_len)
        other._live = dict(self._live)
        return other

    def size_for(self, nbytes: int) -> int:
        """``nbytes`` rounded up to the alignment (what an extent of that request reserves)."""
        return round_up(nbytes, self.alignment)

    def alloc(self, nbytes: int) -> Extent | None:
        """An extent of at least ``nbytes``, or ``None`` if no free range is large enough."""
        size = self.size_for(nbytes)
        if size == 0:
            return Extent(0, 0, self.owner)
        best = None
        for start in self._free_starts:
            length = self._free_len[start]
            if length >= size and (best is None or length < self._free_len[best]):
                best = start
                if length == size:
                    break
        if best is None:
            return None
        length = self._free_len.pop(best)
        i = bisect.bisect_left(self._free_starts, best)
        if length == size:
            del self._free_starts[i]
        else:
            # Keep the remainder where it is: the start moves up, so the list stays sorted.
            self._free_starts[i] = best + size
            self._free_len[best + size] = length - size
        self._live[best] = size
        self.used += size
        return Extent(best, size, self.owner)

    def capacity_for(self, nbytes: int) -> int:
        """The smallest capacity at which ``alloc(nbytes)`` would succeed (growing from the end)."""
        size = self.size_for(nbytes)
        tail = 0
        if self._free_starts:
            last = self._free_starts[-1]
            if last + self._free_len[last] == self.capacity:
                tail = self._free_len[last]
        return self.capacity + max(0, size - tail)

    def grow(self, capacity: int) -> None:
        """Extend the address space to ``capacity`` (no-op if it is already that large)."""
        if capacity % self.alignment:
            raise ValueError(f"capacity {capacity} is not a multiple of the alignment {self.alignment}")
        if capacity <= self.capacity:
            return
        old, self.capacity = self.capacity, capacity
        self._insert_free(old, capacity - old)

    def free(self, extent: Extent) -> None:
        """Return an extent. Raises ValueError for a double free or an extent this space did not give."""
        if not isinstance(extent, Extent):
            raise TypeError(f"expected an Extent, got {type(extent).__name__}")
        if extent.owner not in (0, self.owner):
            raise ValueError(f"{extent} belongs to another swap space (owner {extent.owner}, "
                             f"this is {self.owner})")
        if extent.nbytes == 0:
            return
        if self._live.get(extent.offset) != extent.nbytes:
            if self._is_free(extent.offset):
                raise ValueError(f"{extent} is already free (double free)")
            raise ValueError(f"{extent} was not allocated from this swap space")
        del self._live[extent.offset]
        self.used -= extent.nbytes
        self._insert_free(extent.offset, extent.nbytes)

    def free_ranges(self) -> list[tuple[int, int]]:
        """The free ``(offset, nbytes)`` ranges, sorted (for tests and diagnostics)."""
        return [(s, self._free_len[s]) for s in self._free_starts]

    def live_extents(self) -> list[Extent]:
        """The extents handed out and not freed, sorted by offset."""
        return [Extent(o, n, self.owner) for o, n in sorted(self._live.items())]

    def _is_free(self, offset: int) -> bool:
        i = bisect.bisect_right(self._free_starts, offset) - 1
        return i >= 0 and offset < self._free_starts[i] + self._free_len[self._free_starts[i]]

    def _insert_free(self, start: int, length: int) -> None:
        i = bisect.bisect_left(self._free_starts, start)
        # Merge with the following range if it starts where this one ends.
        if i < len(self._free_starts) and self._free_starts[i] == start + length:
            length += self._free_len.pop(self._free_starts[i])
            del self._free_starts[i]
        # Merge with the preceding range if it ends where this one starts.
        if i > 0:
            prev = self._free_starts[i - 1]
            if prev + self._free_len[prev] == start:
                self._free_len[prev] += length
                return
        self._free_starts.insert(i, start)
        self._free_len[start] = length
