"""What a step does to the grads: a GradScaler's scale, and clipping to ``max_grad_norm`` as torch clips."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..clipping import clip_coef, grad_norm, total_norm
from .update import GradScaling

__all__ = ["step_scaling"]


def step_scaling(params: list, scale: Optional[torch.Tensor], *, max_grad_norm: Optional[float],
                 norms_taken: Callable[[], dict], grad_of: Callable[[torch.Tensor], torch.Tensor],
                 kernel_takes_scale: bool = True) -> tuple[GradScaling, Optional[torch.Tensor]]:
    """What this step does to ``params``' grads, and their total norm when clipping (else None).

    With max_grad_norm, the total norm of the grads (torch's clip_grad_norm_, bit for bit) gives the factor
    they are multiplied by. Clipping needs unscaled grads: with a scale too, the grads are first multiplied
    by 1/scale as ``scaler.unscale_`` does, so the step is torch's ``unscale_``, ``clip_grad_norm_``,
    ``step`` bit for bit.

    Args:
        params: the parameters with a grad, in the groups' order (as torch's clip stacks norms).
        scale: a GradScaler's, handed to step() (see ``OffloadedAdam._step_supports_amp_scaling``).
        max_grad_norm: the optimizer's.
        norms_taken: ``{id(param): norm}`` of the grads whose norms were taken during backward
            (overlap_backward, where there is no GradScaler).
        grad_of: a parameter's grad, wherever it is held.
        kernel_takes_scale: whether the update's kernel divides by a scale itself (torch's fused Adam); else
            (torchao's formula, 8-bit state) the grads are unscaled first, as ``scaler.unscale_`` does.
    """
    if max_grad_norm is None or not params:
        if scale is not None and not kernel_takes_scale:
            return GradScaling(unscale=scale.double().reciprocal().float()), None
        return GradScaling(kernel_scale=scale), None
    unscaling = GradScaling(unscale=None if scale is None else scale.double().reciprocal().float())
    taken = norms_taken()
    norms = []
    for p in params:
        norm = taken.get(id(p))
        if norm is None:
            g = unscaling.apply(grad_of(p))
            norm = grad_norm(g)
            del g  # one gradient of a grad store in memory at a time
        norms.append(norm)
    total = total_norm([p.grad for p in params], norms)
    return GradScaling(unscale=unscaling.unscale, clip=clip_coef(total, max_grad_norm)), total
