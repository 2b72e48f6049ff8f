"""Gradient clipping as torch computes it (``torch.nn.utils.clip_grad_norm_``), one piece at a time."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch.utils._foreach_utils import _device_has_foreach_support, _has_foreach_support

__all__ = ["clip_coef", "grad_norm", "total_norm", "uses_foreach"]


# NOTE: torch's clip_grad_norm_ groups gradients by (device, dtype) in order of first appearance, takes
# each group's norms with the foreach kernel where the device has one (else one vector_norm per tensor:
# a foreach norm of a list is one norm per tensor too, the same bits), stacks the norms in that order on
# the first gradient's device, and takes their norm. Split into these pieces, a norm can be taken as
# soon as a gradient is final (in backward) and the total once all of them are, with torch's bits.
# DTensor gradients (FSDP2, tensor parallelism) go through the same calls, hence through DTensor's own
# rules, as in torch's clip (DTensor counts as a foreach type once torch.distributed.tensor is imported):
# each norm is its local shard's, laid out as a partial norm (no communication); their stack stays
# partial; the norm of the stack first makes it whole (the stacked local norms squared, one all-reduce
# of that vector, a sum over the mesh, then the square roots) and then takes the norm of the whole
# vector, on every rank alike. Such a total is handed back as a plain tensor (torch's ``full_tensor()``).
def uses_foreach(device: torch.device, foreach: Optional[bool] = None) -> bool:
    """Whether torch's clip_grad_norm_ would use the foreach kernels for gradients on ``device``.

    Raises:
        RuntimeError: ``foreach=True`` on a device without foreach kernels (torch's message).
    """
    if foreach is None:
        return _has_foreach_support([torch.empty(0, device=device)], device)
    if foreach and not _device_has_foreach_support(device):
        raise RuntimeError(f"foreach=True was passed, but can't use the foreach API on {device.type} tensors")
    return bool(foreach)


def grad_norm(grad: torch.Tensor, norm_type: float = 2.0, foreach: Optional[bool] = None) -> torch.Tensor:
    """One gradient's norm, as torch's clip_grad_norm_ takes it."""
    if uses_foreach(grad.device, foreach):
        return torch._foreach_norm([grad], norm_type)[0]
    return torch.linalg.vector_norm(grad, norm_type)


def total_norm(grads: Sequence[torch.Tensor], norms: Sequence[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The norm of all gradients from their norms (``norms[i]`` of ``grads[i]``, in parameter order):
    stacked in torch's order (grouped by device and dtype, in order of first appearance) on the first
    gradient's device. ``grads`` may be anything with ``device`` and ``dtype`` (metadata only is read).

    With DTensor norms this is a collective (every rank of their mesh calls it), and the total a plain
    tensor, the same on every rank."""
    order: dict = {}
    for i, g in enumerate(grads):
        order.setdefault((g.device, g.dtype), []).append(i)
    first = grads[0].device
    stacked = torch.stack([norms[i].to(first) for idx in order.values() for i in idx])
    total = torch.linalg.vector_norm(stacked, norm_type)
    whole = getattr(total, "full_tensor", None)  # a DTensor's (replicated by now: no communication)
    return whole() if whole is not None else total


def clip_coef(total: torch.Tensor, max_norm: float) -> torch.Tensor:
    """torch's clip factor: max_norm / (total + 1e-6), at most 1."""
    return torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
