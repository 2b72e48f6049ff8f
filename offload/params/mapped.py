"""Host memory of offloaded weights: page-aligned regions of anonymous mappings, whose pages are given back to
the system at a release while their addresses stay valid."""

from __future__ import annotations

import mmap
import warnings
from typing import Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..errors import user_stacklevel

__all__ = ["MappedMemory", "Region", "regions"]

PAGE = mmap.PAGESIZE
_SLAB = 1 << 30  # bytes of address space per mapping (a larger weight gets one of its own)
_warned = False
# parameter -> its Region, kept after restore_parameters (a weight offloaded again keeps its pages).
regions = WeakIdKeyDictionary()


def _pages(n: int) -> int:
    return -(-max(n, 1) // PAGE) * PAGE


class Region:
    """One weight's pages: ``storage`` (an UntypedStorage of exactly its bytes, on them) and :meth:`drop`."""

    def __init__(self, mapping: mmap.mmap, offset: int, nbytes: int):
        self._mapping = mapping
        self._offset = offset
        self._length = _pages(nbytes)
        # The storage holds the mapping (a buffer export of it): the pages stay mapped as long as anything
        # shares them, whatever happens to this object.
        self.storage = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=offset).untyped_storage()

    def drop(self) -> None:
        """Give the pages back to the system (the weight's bytes become zeros; nothing is freed)."""
        self._mapping.madvise(mmap.MADV_DONTNEED, self._offset, self._length)


# NOTE: a released weight used to give its memory back by shrinking its storage to zero bytes, which frees it;
# anything sharing that memory that the parameter guard cannot see (a tensor from torch.ops.aten.* called
# directly, set_() on its untyped_storage(), torch.utils.dlpack.to_dlpack, Tensor._make_subclass, a NumPy
# array, a raw data_ptr()) then read freed or reused memory, or killed the process with SIGSEGV. Instead, each
# CPU weight lives in its own pages of an anonymous private mapping, put under its storage once
# (UntypedStorage._swap_data_ptr_, so every alias keeps seeing the same storage at the same address). A
# release gives the pages back with madvise(MADV_DONTNEED): the memory is returned to the system at once, and
# the addresses stay mapped, reading zeros until the next fetch writes the weight's bytes into them (faulting
# pages in as it does). Nothing that shares the weight can read freed memory. Weights are packed page-aligned
# into mappings of up to 1 GiB (one VMA for many weights: the kernel limits their number).
class MappedMemory:
    """Page-aligned regions of anonymous mappings, handed out one weight at a time."""

    def __init__(self):
        self._mapping: Optional[mmap.mmap] = None
        self._used = 0

    def region(self, nbytes: int) -> Optional[Region]:
        """Pages for a weight of ``nbytes`` bytes; None where no mapping can be made (the address space or the
        kernel's limit on mappings is exhausted: the caller keeps freeing the memory by shrinking it, and a
        warning says so once)."""
        length = _pages(nbytes)
        if self._mapping is None or self._used + length > len(self._mapping):
            try:
                self._mapping = mmap.mmap(-1, max(_SLAB, length), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
                                          | getattr(mmap, "MAP_NORESERVE", 0), prot=mmap.PROT_READ | mmap.PROT_WRITE)
            except OSError as err:
                _warn(err)
                self._mapping = None
                return None
            self._used = 0
        region = Region(self._mapping, self._used, nbytes)
        self._used += length
        return region

    def close(self) -> None:
        """Hand out no more regions (those handed out keep their pages as long as their storages live)."""
        self._mapping = None


def _warn(err: OSError) -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(f"no mapping could be made for offloaded weights ({err}); their memory is freed at each "
                      "release instead, so a tensor sharing a released weight's memory that the guard cannot see "
                      "(from torch.ops.aten.*, set_(), DLPack) reads freed memory. Raise vm.max_map_count or the "
                      "address-space limit (ulimit -v)", RuntimeWarning, stacklevel=user_stacklevel())
