"""Page-aligned host buffers, allocated once, for the engine and the GPU to share.

# NOTE: buffers come from an anonymous private mmap, not torch's pinned allocator. mmap memory is
# page-aligned (O_DIRECT needs that), sized exactly (torch's caching host allocator rounds blocks up
# to powers of two), and plain anonymous memory is what io_uring accepts as fixed buffers on every
# kernel. With CUDA present and ``pin_memory`` on, the same pages are registered with
# ``cudaHostRegister`` so host<->GPU copies are DMA and can be asynchronous.
"""

from __future__ import annotations

import mmap
import warnings
from typing import Iterator

import torch

from .errors import PoolTooSmallError
from .units import round_up

PAGE_SIZE = mmap.PAGESIZE



class HostBuffer:
    """One page-aligned block of host memory.

    Args:
        nbytes: size in bytes (rounded up to whole pages).
        pin_memory: register the pages with CUDA (ignored, with a warning, without CUDA).
        index: position in its pool (the engine's fixed-buffer index), or -1.
    """

    def __init__(self, nbytes: int, *, pin_memory: bool = False, index: int = -1):
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"buffer size must be a positive number of bytes, got {nbytes!r}")
        self.nbytes = round_up(nbytes, PAGE_SIZE)
        self.index = index
        self._mmap = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._tensor = torch.frombuffer(self._mmap, dtype=torch.uint8)
        # Fault the pages in now so the first step does not pay for it.
        self._tensor.zero_()
        self.address = self._tensor.data_ptr()
        self.pinned = False
        if pin_memory:
            self.pinned = _cuda_host_register(self.address, self.nbytes)

    @property
    def tensor(self) -> torch.Tensor:
        """The whole buffer as a flat ``torch.uint8`` tensor sharing its memory."""
        if self._tensor is None:
            raise ValueError("buffer is closed")
        return self._tensor

    def view(self, dtype: torch.dtype, offset: int = 0, numel: int | None = None) -> torch.Tensor:
        """A typed 1-D tensor over ``[offset, offset + numel * itemsize)`` of the buffer."""
        itemsize = dtype.itemsize
        if offset % itemsize:
            raise ValueError(f"offset {offset} is not a multiple of {dtype}'s size {itemsize}")
        if numel is None:
            numel = (self.nbytes - offset) // itemsize
        end = offset + numel * itemsize
        if offset < 0 or numel < 0 or end > self.nbytes:
            raise ValueError(f"view [{offset}, {end}) is outside the buffer of {self.nbytes} bytes")
        return self.tensor[offset:end].view(dtype)

    def numpy(self):
        """The buffer as a numpy ``uint8`` array sharing its memory."""
        return self.tensor.numpy()

    def close(self) -> None:
        """Release the memory (unpinning it first). Views still alive keep it mapped.

        The mapping is never closed explicitly: torch tensors over it do not hold a buffer export,
        so ``mmap.close()`` would succeed and leave them pointing at unmapped memory. Dropping our
        references unmaps it at once when nothing else holds it, or when the last view goes.
        """
        if self._tensor is None:
            return
        if self.pinned:
            _cuda_host_unregister(self.address)
            self.pinned = False
        self._tensor = None
        self._mmap = None

    @property
    def closed(self) -> bool:
        return self._tensor is None

    def __enter__(self) -> HostBuffer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"HostBuffer(nbytes={self.nbytes}, index={self.index}, pinned={self.pinned})"


class BufferPool:
    """``count`` buffers of ``size`` bytes, allocated once; the only host memory state moves through.

    Args:
        count: number of buffers (at least 1; the swapper needs 2, and 3+ to overlap fully).
        size: bytes per buffer, rounded up to whole pages.
        pin_memory: register with CUDA for DMA copies (see :class:`HostBuffer`).
    """

    def __init__(self, count: int, size: int, *, pin_memory: bool = False):
        if not isinstance(count, int) or count < 1:
            raise PoolTooSmallError(f"buffer_count must be at least 1, got {count!r}")
        self.buffers = [HostBuffer(size, pin_memory=pin_memory, index=i) for i in range(count)]
        self.buffer_size = self.buffers[0].nbytes

    @property
    def nbytes(self) -> int:
        """Host memory held by the pool."""
        return sum(b.nbytes for b in self.buffers)

    def __len__(self) -> int:
        return len(self.buffers)

    def __iter__(self) -> Iterator[HostBuffer]:
        return iter(self.buffers)

    def __getitem__(self, i: int) -> HostBuffer:
        return self.buffers[i]

    def close(self) -> None:
        for b in self.buffers:
            b.close()

    def __enter__(self) -> BufferPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _cuda_host_register(address: int, nbytes: int) -> bool:
    if not torch.cuda.is_available():
        warnings.warn("pin_memory=True but CUDA is not available: host buffers are not pinned", stacklevel=3)
        return False
    rc = torch.cuda.cudart().cudaHostRegister(address, nbytes, 0)
    if int(rc) != 0:
        warnings.warn(f"cudaHostRegister failed ({rc}); host buffers are not pinned", stacklevel=3)
        return False
    return True


def _cuda_host_unregister(address: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(address)

