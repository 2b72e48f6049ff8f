"""Saved optimizer state in torch's layout: the one check that it fits an optimizer, and in-memory state."""

from __future__ import annotations

from typing import Iterable, Optional

import torch

from ..distributed import is_dtensor, local, shard_like
from .layout import HALF_DTYPES, state_keys_for

__all__ = ["check_param_state", "check_state_dict", "in_memory_state", "local_entry", "match_groups", "step_tensor"]


def match_groups(groups: list[dict], saved: list[dict], *, where: str, error: type = ValueError) -> dict:
    """Check saved param groups (torch's layout: params as indices) against an optimizer's.

    Args:
        groups: the optimizer's ``param_groups``.
        saved: the saved ``param_groups``.
        where: what was saved, for messages (``"the state dict"``, ``"checkpoint /ckpt/1"``).
        error: the exception class to raise (a ``ValueError`` subclass).

    Returns:
        ``{saved index: parameter}``.

    Raises:
        error: different numbers of groups or of parameters in a group, a different ``amsgrad`` (the
            offloaded layout depends on it), or an index listed twice.
    """
    if len(saved) != len(groups):
        raise error(f"{where} has {len(saved)} parameter groups, this optimizer has {len(groups)}")
    out: dict = {}
    for gi, (g, s) in enumerate(zip(groups, saved)):
        if len(g["params"]) != len(s["params"]):
            raise error(f"{where}: parameter group {gi} has {len(s['params'])} parameters, this optimizer's has "
                        f"{len(g['params'])}")
        if bool(g["amsgrad"]) != bool(s.get("amsgrad", False)):
            raise error(f"{where}: parameter group {gi} has amsgrad={s.get('amsgrad', False)}, this optimizer's "
                        f"has amsgrad={g['amsgrad']}; the offloaded layout depends on it, so build the optimizer "
                        "with the same value")
        for i, p in zip(s["params"], g["params"]):
            if i in out:
                raise error(f"{where}: parameter index {i} is listed twice")
            out[i] = p
    return out


def check_param_state(p: torch.Tensor, index, *, shape: Optional[Iterable[int]], dtype: Optional[torch.dtype],
                      keys: Optional[Iterable[str]], amsgrad: bool, where: str, error: type = ValueError) -> None:
    """Check one parameter's saved state against the parameter: its shape and dtype (when saved), and
    that every state tensor Adam needs is there (an fp32 master copy may be missing: it is seeded from
    the weights).

    Raises:
        error: naming the parameter's index, what was saved and what this optimizer has.
    """
    saved = "the checkpoint" if where.startswith("checkpoint") else "the state dict"
    if shape is not None and tuple(shape) != tuple(p.shape):
        raise error(f"{where}: parameter {index} has shape {tuple(shape)} in {saved}, {tuple(p.shape)} in this "
                    "optimizer")
    if dtype is not None and dtype != p.dtype:
        raise error(f"{where}: parameter {index} has dtype {str(dtype).removeprefix('torch.')} in {saved}, "
                    f"{str(p.dtype).removeprefix('torch.')} in this optimizer")
    if keys is not None:
        missing = sorted(set(state_keys_for(p, amsgrad)) - {"master"} - set(keys))
        if missing:
            raise error(f"{where}: parameter {index} lacks state {missing}")


def check_state_dict(groups: list[dict], state_dict: dict) -> dict:
    """Check a torch-layout optimizer state dict against an optimizer's groups, before anything changes.

    Returns:
        ``{saved index: parameter}``.

    Raises:
        ValueError: it is not an optimizer state dict, or does not fit (the first mismatch named).
    """
    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        raise ValueError("expected an optimizer state dict with 'state' and 'param_groups'")
    where = "the state dict"
    params = match_groups(groups, state_dict["param_groups"], where=where)
    amsgrad = {id(p): bool(g["amsgrad"]) for g in groups for p in g["params"]}
    for key, entry in state_dict["state"].items():
        if key not in params:
            raise ValueError(f"{where} has state for parameter {key}, which no group lists")
        p = params[key]
        for name, value in entry.items():
            if name != "step" and torch.is_tensor(value) and value.shape != p.shape:
                raise ValueError(f"{where}: state {name!r} of parameter {key} has shape {tuple(value.shape)}, the "
                                 f"parameter has {tuple(p.shape)}")
        tensors = [k for k, v in entry.items() if k != "step" and torch.is_tensor(v)]
        check_param_state(p, key, shape=None, dtype=None, keys=tensors, amsgrad=amsgrad[id(p)], where=where)
    return params


def step_tensor(step) -> torch.Tensor:
    """A saved step (a tensor or a number) as the CPU float32 scalar the optimizers keep."""
    if torch.is_tensor(step):
        return step.detach().to("cpu", torch.float32).clone()
    return torch.tensor(float(step), dtype=torch.float32)


def in_memory_state(p: torch.Tensor, entry: dict, *, master: bool = True) -> dict:
    """A small parameter's state for the optimizer's ``state`` dict: the step as :func:`step_tensor`, the
    saved tensors on ``p``'s device, in ``p``'s dtype, or for an fp16/bf16 parameter in fp32 with its fp32
    master (the saved one, else a copy of the weights) unless a bf16 one is kept without (``master`` off:
    a saved master is dropped, the weights being what is trained)."""
    half = p.dtype in HALF_DTYPES
    with_master = half and (master or p.dtype == torch.float16)
    dtype = torch.float32 if half else p.dtype
    st = {"step": step_tensor(entry.get("step", 0.0))}
    for k, v in entry.items():
        if k == "step" or (k == "master" and not with_master):
            continue
        st[k] = v.detach().to(device=p.device, dtype=dtype).clone() if torch.is_tensor(v) else v
    if with_master and "master" not in st:
        st["master"] = p.detach().to(torch.float32, copy=True)
    return st


def local_entry(entry: dict, p: torch.Tensor) -> dict:
    """A saved state entry of ``p`` with its tensors as this rank's part of them when ``p`` is a DTensor."""
    if not is_dtensor(p):
        return entry
    return {k: local(shard_like(v, p)) if k != "step" and torch.is_tensor(v) else v for k, v in entry.items()}
