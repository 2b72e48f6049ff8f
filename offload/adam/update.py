"""The Adam update itself: torch's functional Adam on whole small parameters and on chunks of swapped-in buffers."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch.optim.adam import adam as _torch_adam

from .. import copies
from ..copies import Ticket
from ..distributed import detached, like, local
from ..state import HALF_DTYPES

__all__ = ["GradScaling", "kernel_flags", "run_adam", "update_chunks", "update_in_memory"]

_FUSED_DEVICES = ("cpu", "cuda")


# NOTE: Adam is element-wise, so updating a parameter chunk by chunk (a chunk is the part of it that lies
# in one unit) gives the same bits as updating it whole, as long as each chunk sees the same kernel
# (fused or foreach, chosen as torch chooses), the same step count and the same grad. Clipping
# multiplies the grad by the clip factor exactly as torch's clip_grad_norm_ multiplies p.grad in place;
# a GradScaler's scale goes to the kernel, which divides by it, unless the grads must be unscaled before
# the kernel (to clip them): then they are multiplied by 1/scale first, as GradScaler.unscale_ does.
# A DTensor parameter (FSDP2, tensor parallelism) is updated through its local shard, with its grad's
# local shard: the kernels are element-wise, so that is what torch's DTensor dispatch runs too, and the same bits.


@dataclass(frozen=True)
class GradScaling:
    """What a step does to each grad it reads, in torch's order: ``unscale`` (a GradScaler's 1/scale, as
    ``scaler.unscale_`` multiplies), then ``clip`` (``clip_grad_norm_``'s factor); ``kernel_scale``: a
    GradScaler's scale handed to the fused kernel, which divides by it. Each is None when not used."""

    unscale: Optional[torch.Tensor] = None
    clip: Optional[torch.Tensor] = None
    kernel_scale: Optional[torch.Tensor] = None

    def apply(self, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` unscaled then clipped (a new tensor, or ``grad`` itself when neither applies). A half grad
        is unscaled in fp32, as the fp32 grad of its master would be."""
        if self.unscale is not None:
            if grad.dtype in HALF_DTYPES:
                grad = grad.float()
            grad = grad * self.unscale.to(grad.device)
        if self.clip is not None:
            grad = grad * self.clip.to(grad.device)
        return grad


NO_SCALING = GradScaling()


def kernel_flags(group: dict, device: torch.device) -> dict:
    """The ``fused``/``foreach`` arguments torch's Adam would use for ``group`` on ``device``."""
    fused = group["fused"]
    if fused is None:
        fused = device.type in _FUSED_DEVICES and not group["foreach"]
    return {"fused": bool(fused), "foreach": None if fused else group["foreach"]}


def run_adam(group: dict, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, *,
             grad_scale: Optional[torch.Tensor] = None) -> None:
    """torch's functional Adam over lists of tensors on one device, with ``group``'s hyperparameters."""
    beta1, beta2 = group["betas"]
    dev = params[0].device
    scale = grad_scale.to(dev) if grad_scale is not None else None
    _torch_adam(
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
        **kernel_flags(group, dev),
        capturable=False, differentiable=False, grad_scale=scale,
        found_inf=torch.zeros((), dtype=torch.float32, device=dev) if scale is not None else None,
        has_complex=False, decoupled_weight_decay=group["decoupled_weight_decay"],
        amsgrad=group["amsgrad"], beta1=beta1, beta2=beta2, lr=group["lr"],
        weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
    )


def update_in_memory(state: dict, items, *, grad_of: Callable[[torch.Tensor], torch.Tensor],
                     scaling: GradScaling = NO_SCALING) -> None:
    """Update small parameters whose state stays in memory (``state[p]``, created at the first step).

    Args:
        state: the optimizer's ``state`` mapping.
        items: ``(group, param)`` pairs.
        grad_of: the whole gradient of a parameter (read from a grad store when it has one).
        scaling: what is done to each grad before the kernel (and the scale the kernel divides by).
    """
    by_group: dict[int, list] = {}
    for group, p in items:
        by_group.setdefault(id(group), [group, []])[1].append(p)
    for group, params in by_group.values():
        targets, lists = [], [[], [], [], [], []]
        for p in params:
            st = state[p]
            fused = kernel_flags(group, p.device)["fused"]
            half = p.dtype in HALF_DTYPES
            weights = detached(p)
            if len(st) == 0:
                st["step"] = (torch.zeros((), dtype=torch.float32, device=p.device) if fused
                              else torch.tensor(0.0, dtype=torch.float32))
                if half:
                    # Every fp16/bf16 parameter has an fp32 master, small ones too: their small updates
                    # would otherwise round away, and they would drift from the large ones.
                    st["master"] = like(weights.float().clone(memory_format=torch.preserve_format), p)
                for key in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ()):
                    # A DTensor parameter's state is a DTensor laid out as the parameter, as torch's.
                    st[key] = like(torch.zeros_like(local(st["master"]) if half else weights,
                                                    memory_format=torch.preserve_format), p)
            if fused and st["step"].device != p.device:
                st["step"] = st["step"].to(p.device)
            grad = scaling.apply(local(grad_of(p)))
            targets.append(local(st["master"]) if half else weights)
            lists[0].append(grad.float() if half else grad)
            lists[1].append(local(st["exp_avg"]))
            lists[2].append(local(st["exp_avg_sq"]))
            if group["amsgrad"]:
                lists[3].append(local(st["max_exp_avg_sq"]))
            lists[4].append(st["step"])
        run_adam(group, targets, *lists, grad_scale=scaling.kernel_scale)
        for p, target in zip(params, targets):
            if p.dtype in HALF_DTYPES:
                detached(p).copy_(target)


def update_chunks(chunks, buf, grad_views: dict, *, state: dict,
                  scaling: GradScaling = NO_SCALING) -> tuple[Ticket, Ticket]:
    """Update ``chunks`` (one group's, all in the unit held by ``buf``) in place.

    Args:
        chunks: the unit's chunks to update; their slots say where each state key lies in ``buf``.
        buf: the host buffer holding the unit.
        grad_views: ``{chunk: flat grad}`` for grads read from a grad store (host memory); others come from
            ``p.grad``.
        state: the optimizer's ``state`` mapping (its ``"step"`` counts; they are not incremented here).
        scaling: what is done to each grad before the kernel (and the scale the kernel divides by).

    Returns:
        Two tickets, for parameters on a device: ``read``, done when the copies to the device no longer read
        host memory (the grad views may be refilled after it); ``landed``, done when the updated state is back
        in ``buf`` (it may be written or read after it).
    """
    read, landed = [], []
    try:
        return _update_chunks(chunks, buf, grad_views, state, scaling, read, landed)
    except BaseException:
        # Nothing may still copy from or into the buffers when the caller hands them back.
        with contextlib.suppress(BaseException):
            copies.waited(read + landed)
        raise


def _update_chunks(chunks, buf, grad_views, state, scaling, read: list, landed: list) -> tuple[Ticket, Ticket]:
    group = chunks[0].slot.group
    amsgrad = group["amsgrad"]
    params, grads, m, v, vmax, steps = [], [], [], [], [], []
    writeback, narrow = [], []  # (host view, device tensor); (bf16 moment, its fp32 working copy)
    weights = []  # each chunk's elements of its parameter
    for c in chunks:
        p = c.slot.param
        lo, hi = c.start, c.start + c.numel
        flat_p = detached(p).view(-1)[lo:hi]
        weights.append(flat_p)
        crossing = copies.crosses(p.device)
        flat_g = grad_views.get(c)
        if flat_g is None:
            flat_g = local(p.grad).reshape(-1)[lo:hi]
        elif crossing:
            flat_g, ticket = copies.to_device(flat_g, flat_p)
            read.append(ticket)
        flat_g = scaling.apply(flat_g)
        views = {k: c.slice(buf, k) for k in c.slot.keys}
        if not c.slot.initialized:
            for k, t in views.items():
                if k == "master":
                    t.copy_(flat_p)
                else:
                    t.zero_()
        dev = p.device
        if crossing:
            # State crosses to the parameter's device through the (pinned) buffer.
            on_dev = {}
            for k, t in views.items():
                on_dev[k], ticket = copies.to_device(t, flat_p)
                read.append(ticket)
            writeback.extend((views[k], on_dev[k]) for k in views)
            views = on_dev
        for k in [k for k in views if k != "master" and views[k].dtype == torch.bfloat16]:
            # Narrow state (state_dtype "bf16"): computed in fp32, rounded to nearest when stored.
            wide = views[k].float()
            narrow.append((views[k], wide))
            views[k] = wide
        master = views.get("master")
        target = master if master is not None else flat_p
        params.append(target)
        grads.append(flat_g if flat_g.dtype == target.dtype else flat_g.to(target.dtype))
        m.append(views["exp_avg"])
        v.append(views["exp_avg_sq"])
        if amsgrad:
            vmax.append(views["max_exp_avg_sq"])
        step = state[p]["step"]
        # A copy per chunk: the kernel increments it, and a parameter may span several chunks.
        if kernel_flags(group, dev)["fused"] and crossing:
            step, ticket = copies.to_device(step, flat_p)
            read.append(ticket)
            steps.append(step)
        else:
            steps.append(step.clone())
    run_adam(group, params, grads, m, v, vmax, steps, grad_scale=scaling.kernel_scale)
    for stored, wide in narrow:
        stored.copy_(wide)
    for c, flat_p, target in zip(chunks, weights, params):
        if "master" in c.slot.keys:
            flat_p.copy_(target)
    for host, dev_t in writeback:
        landed.append(copies.to_host(host, dev_t))
    return Ticket.all(read), Ticket.all(landed)
