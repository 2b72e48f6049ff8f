"""Where a parameter store keeps each parameter's bytes: host memory or an extent of the swap space.

The host-memory tier takes the smallest parameters (``max_in_cpu``) and gradients (``max_grad_in_cpu``)
first, since for them a disk request costs the most per byte; the rest get extents, all reserved at once.
A device model's cached weights are copies held in one block of page-aligned memory, :class:`HostCache`.
"""

from __future__ import annotations

from typing import Iterable

import torch

from ..buffers import HostBuffer
from ..sizes import ALIGNMENT, MIB, round_up
from ..space import SwapSpace

__all__ = ["HostCache", "pool_buffer_bytes", "reserve", "smallest_within"]

_SLOT_ALIGNMENT = 64  # bytes: where each copy in the host cache starts


def smallest_within(params: list, budget: int) -> set:
    """The parameters kept in host memory under a budget of ``budget`` elements: smallest first, since for
    them a disk request costs the most per byte."""
    chosen = set()
    for p in sorted(params, key=lambda t: t.numel()):
        if p.numel() > budget:
            break
        budget -= p.numel()
        chosen.add(p)
    return chosen


# NOTE: the pool moves only what has an extent: offloaded weights and offloaded grads. A buffer larger than the
# largest of them is never filled, so the pool's buffers are that large (whole MiB, a multiple of any direct-I/O
# alignment), at most buffer_size elements; with nothing on NVMe (a model under max_in_cpu, its grads under
# max_grad_in_cpu: DeepSpeed's defaults keep a model below a billion parameters in memory) there is no pool at
# all. Configured as DeepSpeed's 5 x 1e8 elements, the pool was 1.9 GiB of host memory for any model.
def pool_buffer_bytes(params: list, cached: set, *, grads: bool, on_device: bool, max_grad_in_cpu: int,
                      buffer_size: int, itemsize: int) -> tuple[int, bool]:
    """The parameter pool's buffer size in bytes, and whether the pool is needed at all (anything on NVMe).

    Args:
        params, cached, grads, on_device, max_grad_in_cpu: as for :func:`reserve`.
        buffer_size: ``offload_param.buffer_size``, in elements.
        itemsize: bytes per element of the widest parameter dtype.

    Returns:
        ``(bytes, needed)``: ``buffer_size * itemsize`` rounded up to 4 KiB, or the largest weight or gradient
        given an extent rounded up to whole MiB where that is smaller (1 MiB with none: what a checkpoint
        streams host-cached weights through); ``needed`` is False when nothing is given an extent.
    """
    most = round_up(buffer_size * itemsize, ALIGNMENT)
    on_disk = [p for p in params if p not in cached]
    _, grads_on_disk = _grad_tiers(params, cached, grads=grads, on_device=on_device, budget=max_grad_in_cpu)
    largest = max((p.numel() * p.element_size() for p in on_disk + grads_on_disk), default=0)
    return min(most, max(MIB, round_up(largest, MIB))), bool(largest)


def reserve(space: SwapSpace, params: list, cached: set, *, grads: bool, on_device: bool,
            max_grad_in_cpu: int) -> tuple[dict, dict]:
    """Extents for the weights not ``cached`` and for the gradients to offload (``grads``: of every parameter
    that requires grad, a CPU model's cached ones aside), all reserved at once (a full disk is reported now,
    with the whole need). Returns ``id(param) ->`` the weights' extent, and ``id(param) ->`` the gradient's
    extent (None: kept in host memory, ``max_grad_in_cpu``)."""
    on_disk = [p for p in params if p not in cached]
    host_grads, grads_on_disk = _grad_tiers(params, cached, grads=grads, on_device=on_device,
                                            budget=max_grad_in_cpu)
    extents = space.alloc_many([p.numel() * p.element_size() for p in on_disk + grads_on_disk])
    extent_of = dict(zip(map(id, on_disk), extents[:len(on_disk)]))
    grad_extent_of = dict(zip(map(id, grads_on_disk), extents[len(on_disk):]))
    grad_extent_of.update((id(p), None) for p in host_grads)
    return extent_of, grad_extent_of


def _grad_tiers(params: list, cached: set, *, grads: bool, on_device: bool, budget: int) -> tuple[set, list]:
    """The gradients to offload (see :func:`reserve`), split into those kept in host memory (smallest first,
    ``budget`` elements) and those given extents."""
    with_grad = [p for p in params if grads and p.requires_grad and (p not in cached or on_device)]
    host = smallest_within(with_grad, budget)
    return host, [p for p in with_grad if p not in host]


class HostCache:
    """A device model's host cache: one block of page-aligned memory holding copies of ``params``' bytes,
    pinned with ``pin_memory`` (torch's pinned allocator would round each parameter up to a power of two).
    No parameters: no memory at all.
    """

    def __init__(self, params: Iterable[torch.Tensor], *, pin_memory: bool):
        nbytes = sum(round_up(p.numel() * p.element_size(), _SLOT_ALIGNMENT) for p in params)
        self._buffer = HostBuffer(nbytes, pin_memory=pin_memory) if nbytes else None
        self._used = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """The next ``nbytes`` of the block (uint8), for one parameter's copy."""
        slot = self._buffer.tensor[self._used:self._used + nbytes]
        self._used += round_up(nbytes, _SLOT_ALIGNMENT)
        return slot

    def close(self) -> None:
        """Free the block."""
        if self._buffer is not None:
            self._buffer.close()
