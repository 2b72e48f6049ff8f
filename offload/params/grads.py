"""Reading and clipping gradients that live in the grad store (``offload_parameters(offload_grads=True)``)."""

from __future__ import annotations

from typing import Iterable, Optional, Union

import torch
from torch import nn

from ..clipping import clip_coef, grad_norm, uses_foreach
from ..clipping import total_norm as total_of
from .registry import store_of

__all__ = ["clip_grad_norm_", "grad_reads", "load_grad"]


_READS = [0]  # calls of load_grad and clip_grad_norm_ so far: see grad_reads


def grad_reads() -> int:
    """How many times this process called :func:`load_grad` or :func:`clip_grad_norm_`: an optimizer that learns
    whether its updates may run inside backward (which consumes offloaded grads) watches whether a loop reads
    or clips them between backward and step."""
    return _READS[0]


def load_grad(param: torch.Tensor) -> Optional[torch.Tensor]:
    """A copy of ``param``'s gradient: read from the grad store if offloaded, else ``param.grad``'s.

    Returns ``None`` when the parameter has no gradient, as ``param.grad`` would be.
    """
    _READS[0] += 1
    store = store_of(param)
    if store is not None and store.holds_grad(param):
        return store.load_grad(param)
    return None if param.grad is None else param.grad.detach().clone()


def _params(model_or_params) -> list[torch.Tensor]:
    if isinstance(model_or_params, nn.Module):
        return list(model_or_params.parameters())
    if isinstance(model_or_params, torch.Tensor):
        return [model_or_params]
    return list(model_or_params)


# NOTE: torch's utilities read ``p.grad`` directly, and an offloaded gradient's ``p.grad`` is a
# placeholder that refuses to be read. ``clip_grad_norm_`` here does what torch's does, in the same
# order and with the same kernels, so results are bit for bit torch's: each gradient's norm is taken
# whole (one gradient resident at a time, read through the parameter pool), gradients grouped by
# (device, dtype) in order of first appearance as torch groups them, the total is the norm of the
# stacked norms, and the clip factor is torch's. Offloaded gradients are not rewritten: the factor is
# recorded and applied as the gradient is next read (by the optimizer, another clip or accumulation),
# which is the same multiplication torch does in place, at the cost of no extra write.
@torch.no_grad()
def clip_grad_norm_(
    model_or_params: Union[nn.Module, torch.Tensor, Iterable[torch.Tensor]],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: Optional[bool] = None,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for models whose gradients may live in the grad store.

    Same arguments, result and numbers as torch's (bit for bit on the same device), for offloaded
    and ordinary gradients alike. Offloaded gradients are streamed one at a time, so memory holds
    at most one parameter's gradient; the clip factor is applied when each is next read.

    Args:
        model_or_params: a module (its parameters), one tensor, or an iterable of parameters.
        max_norm: the largest total norm allowed.
        norm_type: the p of the p-norm (``float("inf")`` for the max norm).
        error_if_nonfinite: raise if the total norm is nan or inf (check the returned norm instead to
            skip a step on overflow, e.g. with a hand-made loss scale).
        foreach: as torch's: None picks the foreach kernels where the device supports them.

    Returns:
        The total norm of the gradients (viewed as one vector), a 0-dim tensor.

    Raises:
        RuntimeError: ``error_if_nonfinite`` and the norm is not finite, or ``foreach=True`` on a
            device without foreach kernels.
    """
    _READS[0] += 1
    params = [p for p in _params(model_or_params) if p.grad is not None]
    max_norm, norm_type = float(max_norm), float(norm_type)
    if not params:
        return torch.tensor(0.0)
    groups: dict = {}
    for p in params:
        groups.setdefault((p.grad.device, p.grad.dtype), []).append(p)
    norms = []
    for p in params:
        store = store_of(p)
        g = store.load_grad(p) if store is not None and store.holds_grad(p) else p.grad
        norms.append(grad_norm(g, norm_type, foreach))
        del g  # one gradient resident at a time
    total_norm = total_of([p.grad for p in params], norms, norm_type)
    if error_if_nonfinite and torch.logical_or(total_norm.isnan(), total_norm.isinf()):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it "
            "cannot be clipped. To disable this error and scale the gradients by the non-finite norm "
            "anyway, set `error_if_nonfinite=False`"
        )
    coef = clip_coef(total_norm, max_norm)
    for (device, _), group in groups.items():
        use_foreach = uses_foreach(device, foreach)
        ordinary = []
        for p in group:
            store = store_of(p)
            if store is not None and store.holds_grad(p):
                store.grads.scale(p, coef)
            else:
                ordinary.append(p.grad)
        if ordinary:
            coef_d = coef.to(device)
            if use_foreach:
                torch._foreach_mul_(ordinary, coef_d)
            else:
                for g in ordinary:
                    g.mul_(coef_d)
    return total_norm
