"""What the optimizer checks of its parameters and grads before it places or updates state."""

from __future__ import annotations

import contextlib
import warnings
from typing import Callable

import torch

from .. import codes
from ..distributed import built_by_zero_redundancy, check_grad_layout, is_dtensor, local

__all__ = [
    "check_dtensor_options", "check_master_weights", "check_max_grad_norm", "check_params", "check_seed",
    "check_state_dtype",
    "check_torch_options", "no_duplicate_warning", "params_with_grads",
]


@contextlib.contextmanager
def no_duplicate_warning():
    """torch's warning about a parameter listed twice is silenced: check_params refuses it with a clearer error."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*duplicate parameters", category=UserWarning)
        yield


def check_torch_options(*, capturable: bool, differentiable: bool) -> None:
    """torch's Adam options that offloaded state cannot honour, refused."""
    if capturable:
        raise ValueError("capturable=True is not supported by OffloadedAdam (state is not on the device)")
    if differentiable:
        raise ValueError("differentiable=True is not supported by OffloadedAdam")


def check_max_grad_norm(max_grad_norm) -> None:
    """``max_grad_norm`` is None or a positive number."""
    if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0):
        raise ValueError(f"max_grad_norm must be a positive number, got {max_grad_norm!r}")


def check_seed(seed) -> int:
    """``seed`` (of the stochastic rounding's stream) as a non-negative int below 2**64."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << 64:
        raise ValueError(f"seed must be an int from 0 to 2**64 - 1, got {seed!r}")
    return seed


def check_state_dtype(groups: list[dict], state_dtype: str, small_param_threshold: int) -> None:
    """What 8-bit state cannot hold, refused; what it leaves as it was, said.

    Raises:
        ValueError: ``state_dtype`` is "int8" and a parameter is fp64 (the 8-bit formula computes in fp32).
    """
    if state_dtype != "int8":
        return
    kept = []
    for gi, group in enumerate(groups):
        for i, p in enumerate(group["params"]):
            if p.dtype == torch.float64:
                raise ValueError(
                    f'state_dtype="int8" computes the update in fp32 (torchao\'s formula), and parameter {i} of group '
                    f"{gi} (shape {tuple(p.shape)}) is fp64: its weights would lose their precision. Keep fp64 "
                    'parameters in an optimizer with state_dtype "fp32", or convert them to fp32.')
            n = local(p).numel()
            if codes.eligible(n) and n < small_param_threshold and p.requires_grad:
                kept.append(f"parameter {i} of group {gi} ({n} elements)")
    if kept:
        warnings.warn(
            f'state_dtype="int8": {", ".join(kept[:3])}{" and more" if len(kept) > 3 else ""} stay in memory with '
            f"fp32 moments (small_param_threshold={small_param_threshold}), so they are not 8-bit as torchao's "
            f"would be; set small_param_threshold to {codes.MIN_NUMEL} or less to have them quantized and "
            "offloaded.", stacklevel=3)


def check_master_weights(groups: list[dict], master_weights: bool) -> None:
    """Weights kept without an fp32 master are bf16 ones: fp16 parameters are refused then.

    Raises:
        ValueError: ``master_weights`` is off and a parameter is fp16, naming it and what to do.
    """
    if master_weights:
        return
    for gi, group in enumerate(groups):
        for i, p in enumerate(group["params"]):
            if p.dtype == torch.float16 and p.requires_grad:
                raise ValueError(
                    f"master_weights=False keeps bf16 weights without an fp32 master, and parameter {i} of group "
                    f"{gi} (shape {tuple(p.shape)}) is fp16: fp16's 5-bit exponent loses the small updates that "
                    "stochastic rounding relies on (and it rounds to bf16). Convert the model to bf16 "
                    "(model.to(torch.bfloat16)), or keep master_weights=True.")


def check_params(groups: list[dict]) -> None:
    """Every parameter usable for offloaded state, and listed once across all groups."""
    seen: set = set()
    for gi, group in enumerate(groups):
        for p in group["params"]:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"optimizer parameters must be tensors, got {type(p).__name__}")
            if id(p) in seen:
                raise ValueError(
                    f"a parameter of shape {tuple(p.shape)} is listed twice (again in group {gi}); its state would "
                    "be updated once and its step counted twice. List each parameter once.")
            seen.add(id(p))
            if p.is_complex():
                raise ValueError("complex parameters are not supported by OffloadedAdam; use torch.view_as_real")
            if not p.is_floating_point():
                raise ValueError(f"parameters must be floating point, got {p.dtype}")
            if p.device.type == "meta":
                raise ValueError(
                    f"a parameter of shape {tuple(p.shape)} is on the meta device (it has no data); materialise the "
                    "model (e.g. model.to_empty(device=...) and initialise it) before building the optimizer")
            if not p.is_contiguous():
                raise ValueError(
                    f"parameter of shape {tuple(p.shape)} is not contiguous; offloaded state is stored flat, so "
                    "make the parameter contiguous (p.data = p.data.contiguous()) before building the optimizer")


def check_grad(p: torch.Tensor) -> None:
    """``p``'s gradient is one the update can use (dense, real)."""
    if p.grad.is_sparse:
        raise RuntimeError("OffloadedAdam does not support sparse gradients; consider torch.optim.SparseAdam")
    if p.grad.is_complex():
        raise RuntimeError("complex gradients are not supported by OffloadedAdam")
    check_grad_layout(p)


def params_with_grads(groups: list[dict], is_small: Callable[[torch.Tensor], bool]) -> tuple[list, list, list]:
    """The parameters a step updates, their grads checked: ``(group, param)`` pairs of those whose state is
    in memory (``is_small``) and of those whose state is offloaded, and all of them in the groups' order (as
    torch's clip stacks norms)."""
    in_memory, offloaded, with_grad = [], [], []
    for group in groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            check_grad(p)
            with_grad.append(p)
            (in_memory if is_small(p) else offloaded).append((group, p))
    return in_memory, offloaded, with_grad


def check_dtensor_options(groups: list, *, max_grad_norm) -> None:
    """What does not work with DTensor parameters, refused before anything is reserved.

    Raises:
        ValueError: ``max_grad_norm`` over both DTensor and plain parameters, or on one rank's partition
            (ZeroRedundancyOptimizer), where it would clip by that partition's norm alone.
    """
    if max_grad_norm is not None and built_by_zero_redundancy():
        raise ValueError(
            "max_grad_norm under ZeroRedundancyOptimizer: each rank's optimizer holds only its partition of the "
            "parameters, so it would clip them by the norm of that partition, not the model's. Clip with "
            "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) before step() instead, and leave "
            "max_grad_norm unset.")
    trainable = [p for g in groups for p in g["params"] if p.requires_grad]
    sharded = sum(1 for p in trainable if is_dtensor(p))
    if max_grad_norm is not None and 0 < sharded < len(trainable):
        raise ValueError(
            f"max_grad_norm with {sharded} DTensor parameters and {len(trainable) - sharded} plain ones: the total "
            "norm is taken across ranks from the DTensors' local norms, and a plain tensor's norm cannot join them "
            "(torch.nn.utils.clip_grad_norm_ refuses the same mix: 'mixed torch.Tensor and DTensor'). Make every "
            "parameter a DTensor (fully_shard the modules that hold the plain ones, or distribute_tensor them "
            "with Replicate placements), or give the plain ones an optimizer of their own.")
