"""Page-aligned host buffers, allocated once, for the engine and the GPU to share."""

from __future__ import annotations

import errno
import mmap
import warnings
from typing import Iterator, Optional

import psutil
import torch

from .errors import ConfigError, PoolTooSmallError
from .sizes import format_size, round_up

PAGE_SIZE = mmap.PAGESIZE


# NOTE: buffers come from an anonymous private mmap, not torch's pinned allocator. mmap memory is
# page-aligned (O_DIRECT needs that), sized exactly (torch's caching host allocator rounds blocks up
# to powers of two), and plain anonymous memory is what io_uring accepts as fixed buffers on every
# kernel. With CUDA present and ``pin_memory`` on, the same pages are registered with
# ``cudaHostRegister`` so host<->GPU copies are DMA and can be asynchronous.
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
        try:
            self._mmap: Optional[mmap.mmap] = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except OSError as err:
            raise OSError(err.errno, f"{err.strerror}: cannot map a host buffer of {_size(self.nbytes)}") from err
        self._tensor: Optional[torch.Tensor] = torch.frombuffer(self._mmap, dtype=torch.uint8)
        # Fault the pages in now so the first step does not pay for it.
        self._tensor.zero_()
        self.address = self._tensor.data_ptr()
        self.pinned = False
        if pin_memory:
            self.pinned = _cuda_host_register(self.address, self.nbytes)
            if self.pinned:
                # A fork would copy page-locked pages at once (the kernel will not share pages a device may
                # DMA to), for every DataLoader worker: a child gets no mapping instead. A CUDA child cannot
                # use the parent's optimizer anyway.
                self._mmap.madvise(mmap.MADV_DONTFORK)

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
        """Whether the buffer is closed (its memory given back)."""
        return self._tensor is None

    def __enter__(self) -> HostBuffer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"HostBuffer(nbytes={self.nbytes}, index={self.index}, pinned={self.pinned})"


# NOTE: the pool's total is checked against the memory the machine has before the first byte is mapped.
# Buffers are faulted in at once (and may be pinned), so a pool that does not fit is not slow, it is an
# OOM kill some seconds later; the check turns that into an error that names the settings. A limit that
# memory figures do not show (ulimit -v, strict overcommit) still makes mmap fail with ENOMEM, which is
# reported the same way, after the buffers already made are released.
class BufferPool:
    """``count`` buffers of ``size`` bytes, allocated once; the only host memory state moves through.

    Args:
        count: number of buffers (at least 1; the swapper needs 2, and 3+ to overlap fully).
        size: bytes per buffer, rounded up to whole pages.
        pin_memory: register with CUDA for DMA copies (see :class:`HostBuffer`).
        keys: the names of the count and size settings, for messages, e.g.
            ``("offload_optimizer.buffer_count", "offload_optimizer.buffer_size")``; by default
            ``buffer_count`` and ``buffer_size``.

    Raises:
        PoolTooSmallError: ``count`` is below 1.
        ValueError: ``size`` is not a positive int.
        ConfigError: the pool would not fit in the memory this machine has available, or mapping a
            buffer failed for lack of memory; the message names the settings, the total and what to set.
    """

    def __init__(self, count: int, size: int, *, pin_memory: bool = False, keys: tuple[str, str] | None = None):
        if not isinstance(count, int) or count < 1:
            raise PoolTooSmallError(f"buffer_count must be at least 1, got {count!r}")
        if not isinstance(size, int) or size <= 0:
            raise ValueError(f"buffer size must be a positive number of bytes, got {size!r}")
        count_key, size_key = keys or ("buffer_count", "buffer_size")
        each = round_up(size, PAGE_SIZE)
        asked = f"{count_key} x {size_key} = {count} x {_size(each)} = {_size(count * each)} of host memory"
        memory = psutil.virtual_memory()
        if count * each > memory.available:
            fit = memory.available // each
            hint = (f"at this buffer size at most {fit} fit" if fit
                    else f"one buffer of {_size(each)} alone does not fit; lower {size_key}")  # fmt: skip
            raise ConfigError(
                f"the host buffer pool does not fit in memory: {asked}, but this machine has "
                f"{_size(memory.available)} available ({_size(memory.total)} in all). Set {count_key} or "
                f"{size_key} lower, leaving room for the rest of the process; {hint}."
            )
        self.buffers: list[HostBuffer] = []
        try:
            for i in range(count):
                self.buffers.append(HostBuffer(each, pin_memory=pin_memory, index=i))
        except BaseException as err:
            self.close()
            self.buffers = []
            if isinstance(err, MemoryError) or (isinstance(err, OSError) and err.errno == errno.ENOMEM):
                raise ConfigError(
                    f"could not allocate host buffer {i + 1} of {count}: {asked} ({err}). Set {count_key} or "
                    f"{size_key} lower, or free memory; a limit such as ulimit -v or strict overcommit "
                    "(vm.overcommit_memory = 2) can refuse it even when memory looks free."
                ) from err
            raise
        self.buffer_size = each

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
        """Close every buffer of the pool."""
        for b in self.buffers:
            b.close()

    def __enter__(self) -> BufferPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable


def _cuda_host_register(address: int, nbytes: int) -> bool:
    if not torch.cuda.is_available():
        warnings.warn("pin_memory=True but CUDA is not available: host buffers are not pinned", stacklevel=3)
        return False
    # Portable: page-locked for every CUDA context, so a copy on any GPU of the process is DMA.
    rc = torch.cuda.cudart().cudaHostRegister(address, nbytes, _CUDA_HOST_REGISTER_PORTABLE)
    if int(rc) != 0:
        warnings.warn(f"cudaHostRegister failed ({rc}); host buffers are not pinned", stacklevel=3)
        return False
    return True


def _cuda_host_unregister(address: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(address)


def _size(nbytes: int) -> str:
    # format_size divides in floating point; a size of more than 2^100 bytes is a typo anyway.
    return format_size(nbytes) if nbytes < 1 << 100 else f"about 2^{nbytes.bit_length() - 1} bytes"

