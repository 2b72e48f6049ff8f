"""The Adam update itself: torch's functional Adam (or, for 8-bit state, torchao's formula) on whole small
parameters and on chunks of swapped-in buffers."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch.optim.adam import adam as _torch_adam

from .. import copies
from ..copies import Ticket
from ..distributed import detached, like, local
from ..state import HALF_DTYPES
from . import lowbit

__all__ = ["GradScaling", "Math", "kernel_flags", "run_adam", "update_chunks", "update_in_memory"]

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


# NOTE: two formulas. torch's Adam kernels (the default: bit for bit torch.optim.Adam/AdamW) and, with 8-bit
# state, torchao's AdamW8bit formula for every parameter (those that keep fp32 moments too), which the 8-bit
# results are tested against bit for bit. Weights kept without an fp32 master (master_weights=False, bf16) are
# updated in fp32 either way and rounded back stochastically; the random stream is keyed by the seed, the
# parameter's position in the optimizer, the step it makes and the element, so nothing about a run (its
# chunking, a resume) changes what is drawn.
@dataclass(frozen=True)
class Math:
    """How a step computes its updates.

    Attributes:
        int8: torchao's formula (``state_dtype: "int8"``) instead of torch's kernels.
        seed: the seed of the stochastic rounding of weights kept without a master.
        position: ``{id(param): its index over the optimizer's groups}``, for the rounding's stream.
    """

    int8: bool = False
    seed: int = 0
    position: dict = field(default_factory=dict)

    def key(self, p: torch.Tensor, step: float) -> tuple[int, int]:
        """The stream that rounds ``p``'s weights as its update makes its step count ``step``."""
        if id(p) not in self.position:
            raise RuntimeError("a parameter without a position in the optimizer is updated: its groups changed "
                               "behind add_param_group()")
        return lowbit.stream_key(self.seed, self.position[id(p)], int(step))


TORCH_MATH = Math()


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
                     scaling: GradScaling = NO_SCALING, math: Math = TORCH_MATH, master: bool = True) -> None:
    """Update small parameters whose state stays in memory (``state[p]``, created at the first step).

    Args:
        state: the optimizer's ``state`` mapping.
        items: ``(group, param)`` pairs.
        grad_of: the whole gradient of a parameter (read from a grad store when it has one).
        scaling: what is done to each grad before the kernel (and the scale the kernel divides by).
        math: the formula, and the rounding stream of weights without a master.
        master: whether bf16 parameters keep an fp32 master (fp16 ones always do).
    """
    by_group: dict[int, list] = {}
    for group, p in items:
        by_group.setdefault(id(group), [group, []])[1].append(p)
    for group, params in by_group.values():
        targets, lists, rounded = [], [[], [], [], [], []], []
        for p in params:
            st = state[p]
            fused = kernel_flags(group, p.device)["fused"] and not math.int8
            weights = detached(p)
            with_master = keeps_master(p, master)
            if len(st) == 0:
                _init_in_memory(st, p, weights, group, fused=fused, with_master=with_master)
            if fused and st["step"].device != p.device:
                st["step"] = st["step"].to(p.device)
            grad = scaling.apply(local(grad_of(p)))
            target = local(st["master"]) if with_master else weights
            if math.int8:
                _lowbit_in_memory(math, group, p, st, target, grad)
                continue
            if target.dtype in HALF_DTYPES:  # no master: computed in fp32, rounded back after
                rounded.append((p, target, target.float()))
                target = rounded[-1][2]
            targets.append(target)
            lists[0].append(grad if grad.dtype == target.dtype else grad.to(target.dtype))
            lists[1].append(local(st["exp_avg"]))
            lists[2].append(local(st["exp_avg_sq"]))
            if group["amsgrad"]:
                lists[3].append(local(st["max_exp_avg_sq"]))
            lists[4].append(st["step"])
        if targets:
            run_adam(group, targets, *lists, grad_scale=scaling.kernel_scale)
        for p, weights, wide in rounded:
            weights.copy_(lowbit.round_bf16(wide, key=math.key(p, state[p]["step"])).view(weights.shape))
        for p in params:
            if keeps_master(p, master):
                detached(p).copy_(state[p]["master"])


def keeps_master(p: torch.Tensor, master: bool = True) -> bool:
    """Whether ``p`` has an fp32 master copy: every fp16 parameter, and bf16 ones unless ``master`` is off."""
    return p.dtype == torch.float16 or (p.dtype == torch.bfloat16 and master)


def _init_in_memory(st: dict, p: torch.Tensor, weights: torch.Tensor, group: dict, *, fused: bool,
                    with_master: bool) -> None:
    """A small parameter's first state: its step, its fp32 master (small ones too: their small updates would
    otherwise round away, and they would drift from the large ones), zero moments."""
    st["step"] = (torch.zeros((), dtype=torch.float32, device=p.device) if fused
                  else torch.tensor(0.0, dtype=torch.float32))
    if with_master:
        st["master"] = like(weights.float().clone(memory_format=torch.preserve_format), p)
    moment = local(st["master"]) if with_master else (weights.float() if p.dtype in HALF_DTYPES else weights)
    for key in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ()):
        # A DTensor parameter's state is a DTensor laid out as the parameter, as torch's.
        st[key] = like(torch.zeros_like(moment, memory_format=torch.preserve_format), p)


def _lowbit_in_memory(math: Math, group: dict, p: torch.Tensor, st: dict, target: torch.Tensor,
                      grad: torch.Tensor) -> None:
    """torchao's formula on a small parameter (fp32 moments, as torchao keeps for small ones)."""
    count = float(st["step"]) + 1
    moments = {k: local(st[k]).view(-1) for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if k in st}
    flat = target.reshape(-1)
    if not target.is_contiguous():
        flat = flat.clone()  # a copy, written back below
    lowbit.step_chunk(lowbit.constants(group, count), flat, grad.reshape(-1).contiguous(), moments,
                      key=math.key(p, count))
    if flat.data_ptr() != target.data_ptr():
        target.copy_(flat.view(target.shape))
    st["step"] += 1


def update_chunks(chunks, buf, grad_views: dict, *, state: dict, scaling: GradScaling = NO_SCALING,
                  math: Math = TORCH_MATH) -> tuple[Ticket, Ticket]:
    """Update ``chunks`` (one group's, all in the unit held by ``buf``) in place.

    Args:
        chunks: the unit's chunks to update; their slots say where each state key lies in ``buf``.
        buf: the host buffer holding the unit.
        grad_views: ``{chunk: flat grad}`` for grads read from a grad store (host memory); others come from
            ``p.grad``.
        state: the optimizer's ``state`` mapping (its ``"step"`` counts; they are not incremented here).
        scaling: what is done to each grad before the kernel (and the scale the kernel divides by).
        math: the formula, and the rounding stream of weights without a master.

    Returns:
        Two tickets, for parameters on a device: ``read``, done when the copies to the device no longer read
        host memory (the grad views may be refilled after it); ``landed``, done when the updated state is back
        in ``buf`` (it may be written or read after it).
    """
    read, landed = [], []
    try:
        return _update_chunks(chunks, buf, grad_views, state, scaling, math, read, landed)
    except BaseException:
        # Nothing may still copy from or into the buffers when the caller hands them back.
        with contextlib.suppress(BaseException):
            copies.waited(read + landed)
        raise


def _update_chunks(chunks, buf, grad_views, state, scaling, math: Math, read: list,
                   landed: list) -> tuple[Ticket, Ticket]:
    group = chunks[0].slot.group
    lists = _KernelLists()
    writeback, masters = [], []  # (host view, device tensor); (weights, their master)
    for c in chunks:
        p = c.slot.param
        flat_p = detached(p).view(-1)[c.start:c.start + c.numel]
        flat_g = _chunk_grad(c, grad_views, flat_p, read, scaling)
        views = _chunk_views(c, buf, flat_p, read, writeback)
        master = views.get("master")
        if master is not None:
            masters.append((flat_p, master))
        if math.int8:
            # torchao's formula, chunk by chunk (element-wise, blocks whole): the same bits as on the whole.
            count = float(state[p]["step"]) + 1
            moments = {k: t for k, t in views.items() if k != "master"}
            lowbit.step_chunk(lowbit.constants(group, count), master if master is not None else flat_p,
                              flat_g.contiguous(), moments, first=c.start, key=math.key(p, count))
        else:
            lists.add(c, flat_p, flat_g, views, state[p]["step"], group, read)
    if lists.params:
        run_adam(group, lists.params, lists.grads, lists.m, lists.v, lists.vmax, lists.steps,
                 grad_scale=scaling.kernel_scale)
    lists.store(state, math)
    for flat_p, master in masters:
        flat_p.copy_(master)
    for host, dev_t in writeback:
        landed.append(copies.to_host(host, dev_t))
    return Ticket.all(read), Ticket.all(landed)


def _chunk_grad(c, grad_views: dict, flat_p: torch.Tensor, read: list, scaling: GradScaling) -> torch.Tensor:
    """Chunk ``c``'s gradient where the kernel reads it (on the parameter's device), scaled."""
    flat_g = grad_views.get(c)
    if flat_g is None:
        flat_g = local(c.slot.param.grad).reshape(-1)[c.start:c.start + c.numel]
    elif copies.crosses(flat_p.device):
        flat_g, ticket = copies.to_device(flat_g, flat_p)
        read.append(ticket)
    return scaling.apply(flat_g)


def _chunk_views(c, buf, flat_p: torch.Tensor, read: list, writeback: list) -> dict:
    """Chunk ``c``'s state tensors where the kernel updates them: views of ``buf`` (made first when the state
    is new: zeros, the master from the weights), or copies on the parameter's device, to be copied back."""
    views = {k: c.slice(buf, k) for k in c.slot.keys}
    if not c.slot.initialized:
        for k, t in views.items():
            if k == "master":
                t.copy_(flat_p)
            else:
                t.zero_()
    if not copies.crosses(flat_p.device):
        return views
    # State crosses to the parameter's device through the (pinned) buffer.
    on_dev = {}
    for k, t in views.items():
        on_dev[k], ticket = copies.to_device(t, flat_p)
        read.append(ticket)
    writeback.extend((views[k], on_dev[k]) for k in views)
    return on_dev


class _KernelLists:
    """The lists torch's functional Adam takes, chunk by chunk, and what is stored back after it ran: bf16
    moments rounded to nearest, weights without a master rounded stochastically."""

    def __init__(self):
        self.params, self.grads, self.m, self.v, self.vmax, self.steps = [], [], [], [], [], []
        self.narrow: list = []  # (bf16 moment, its fp32 working copy)
        self.rounded: list = []  # (chunk, weights, their fp32 working copy)

    def add(self, c, flat_p: torch.Tensor, flat_g: torch.Tensor, views: dict, step: torch.Tensor, group: dict,
            read: list) -> None:
        for k in [k for k in views if k != "master" and views[k].dtype == torch.bfloat16]:
            # Narrow state (state_dtype "bf16"): computed in fp32, rounded to nearest when stored.
            wide = views[k].float()
            self.narrow.append((views[k], wide))
            views[k] = wide
        target = views.get("master", flat_p)
        if target.dtype in HALF_DTYPES:  # no master: computed in fp32, rounded back stochastically after
            self.rounded.append((c, flat_p, target.float()))
            target = self.rounded[-1][2]
        self.params.append(target)
        self.grads.append(flat_g if flat_g.dtype == target.dtype else flat_g.to(target.dtype))
        self.m.append(views["exp_avg"])
        self.v.append(views["exp_avg_sq"])
        if group["amsgrad"]:
            self.vmax.append(views["max_exp_avg_sq"])
        # A copy per chunk: the kernel increments it, and a parameter may span several chunks.
        if kernel_flags(group, flat_p.device)["fused"] and copies.crosses(flat_p.device):
            step, ticket = copies.to_device(step, flat_p)
            read.append(ticket)
            self.steps.append(step)
        else:
            self.steps.append(step.clone())

    def store(self, state: dict, math: Math) -> None:
        for stored, wide in self.narrow:
            stored.copy_(wide)
        for c, flat_p, wide in self.rounded:
            count = float(state[c.slot.param]["step"]) + 1
            flat_p.copy_(lowbit.round_bf16(wide, first=c.start, key=math.key(c.slot.param, count)))
