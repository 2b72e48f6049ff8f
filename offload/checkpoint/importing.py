"""Import of a torch-layout optimizer state_dict as a checkpoint (what ``offload-ckpt import`` runs)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..config import Config, config_to_dict, load_config
from ..errors import CheckpointError
from ..regular import NotRegularFileError, open_regular
from ..state.dicts import step_tensor
from ..state.plans import ImportedState, import_plan
from .commit import Staged, reading, write_atomically
from .format import dtype_name, dtype_of
from .manifest import Manifest, ParamEntry, read_process
from .snapshot import Plan, StateCopy, cpu_state, torch_groups, write_small_files
from .stream import progress_bar, tool_pool

__all__ = ["import_state_dict"]


def import_state_dict(state_dict: dict | str | os.PathLike, directory: str | os.PathLike, *,
                      like: str | os.PathLike | None = None, config=None, extra: Any = None) -> str:
    """Write a torch-layout optimizer ``state_dict`` as a checkpoint that ``load_checkpoint`` reads.

    The state dict may come from ``torch.optim.Adam``/``AdamW``, from ``OffloadedAdam.state_dict()``
    or from :func:`export_state_dict` (or be a path to a file ``torch.save`` wrote). Parameter
    shapes come from ``like`` (a checkpoint of the same model, whose dtypes and settings are used)
    or else from the state tensors (parameters without state then go unchecked at load). Which
    parameters are offloaded and the unit size come from ``like``'s config or from ``config``;
    loading re-chunks anyway, so these only matter for speed.

    Args:
        state_dict: the state dict, or a path to one.
        directory: the checkpoint to write (atomically, as :func:`save_checkpoint`).
        like: an existing checkpoint directory of the same model.
        config: a config (path, dict or :class:`offload.config.Config`) when ``like`` is not given.
        extra: stored as the checkpoint's ``extra``.

    Returns:
        The checkpoint directory (absolute).

    Raises:
        CheckpointError: the state dict does not match ``like``, or is not an optimizer state dict.
    """
    state_dict = _read_state_dict(state_dict)
    groups = state_dict["param_groups"]
    renumber = {old: new for new, old in enumerate(i for g in groups for i in g["params"])}
    state = _renumbered(state_dict["state"], renumber)
    target = _target(like, config, sum(len(g["params"]) for g in groups))
    amsgrad_of = {renumber[old]: bool(g.get("amsgrad", False)) for g in groups for old in g["params"]}
    _take_shapes(state, target)
    oc = target.cfg.offload_optimizer
    laid = import_plan(state, target.shapes, target.dtypes, amsgrad_of, unit_bytes=target.unit_bytes,
                       state_dtype=oc.state_dtype, master=oc.master_weights, threshold=target.threshold)

    def write(staged: Staged) -> Manifest:
        with tool_pool([target.unit_bytes], cap=None) as pool:
            state = StateCopy(laid, staged, target.cfg.aio)
            try:
                state.reserve()
                with progress_bar(state.total, "import", False) as bar:
                    data = state.run(list(pool), bar)
            finally:
                state.close()
        entries, memory_state, steps = _entries(laid, target)
        taken = Plan(laid, entries, torch_groups(groups, renumber), memory_state, steps, {})
        return write_small_files(staged, taken, data, kind="imported", extra=extra,
                                 config=config_to_dict(target.cfg, only=None), unit_bytes=target.unit_bytes,
                                 threshold=target.threshold)

    return write_atomically(directory, write)


def _read_state_dict(state_dict: dict | str | os.PathLike) -> dict:
    """The state dict (loaded, when a path), checked to be an optimizer's."""
    if isinstance(state_dict, (str, os.PathLike)):
        path = os.fspath(state_dict)
        try:
            f = os.fdopen(open_regular(path), "rb")  # a FIFO or a device is never read
        except NotRegularFileError as err:
            raise CheckpointError(f"{path} is {err.strerror}; give the file torch.save wrote") from None
        with f:
            state_dict = torch.load(f, map_location="cpu", weights_only=True)
    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        raise CheckpointError("expected an optimizer state dict with 'state' and 'param_groups'")
    return state_dict


def _renumbered(state: dict, renumber: dict) -> dict:
    """``state`` by the parameters' new indices; state of a parameter that no group lists is refused."""
    unknown = [k for k in state if k not in renumber]
    if unknown:
        raise CheckpointError(f"the state dict has state for parameter(s) {unknown} that no group lists")
    return {renumber[k]: v for k, v in state.items()}


@dataclass
class _Target:
    """The checkpoint to write: its settings, and each parameter's shape and dtype (None while unknown)."""

    cfg: Config
    threshold: int  # parameters with fewer elements keep their state in memory
    shapes: list
    dtypes: list
    like: Optional[str]  # the checkpoint the shapes came from, for messages

    @property
    def unit_bytes(self) -> int:
        return self.cfg.offload_optimizer.buffer_size


def _target(like: str | os.PathLike | None, config, n: int) -> _Target:
    """Settings, shapes and dtypes of ``n`` parameters from the checkpoint ``like``, else settings from
    ``config`` and shapes unknown."""
    if like is None:
        cfg = load_config(config) if not isinstance(config, Config) else config
        return _Target(cfg, cfg.offload_optimizer.small_param_threshold, [None] * n, [None] * n, None)
    with reading(like) as like:
        ref = read_process(like)
    cfg = load_config(ref.config)
    threshold = ref.threshold if ref.threshold is not None else cfg.offload_optimizer.small_param_threshold
    if len(ref.params) != n:
        raise CheckpointError(f"the state dict has {n} parameters, checkpoint {like} has {len(ref.params)}")
    target = _Target(cfg, threshold, [None] * n, [None] * n, like)
    for e in ref.params:
        target.shapes[e.index] = tuple(e.shape) if e.shape is not None else None
        target.dtypes[e.index] = dtype_of(e.dtype) if e.dtype is not None else None
    return target


def _take_shapes(state: dict, target: _Target) -> None:
    """Each parameter's shape and dtype, where still unknown, from its ``exp_avg``, which must be Adam's and
    match the shape known."""
    for i, entry in state.items():
        ref_t = entry.get("exp_avg")
        if not torch.is_tensor(ref_t):
            raise CheckpointError(f"parameter {i}: state without an 'exp_avg' tensor is not Adam's")
        if target.shapes[i] is None:
            target.shapes[i] = tuple(ref_t.shape)
        elif tuple(ref_t.shape) != target.shapes[i]:
            raise CheckpointError(f"parameter {i}: exp_avg has shape {tuple(ref_t.shape)}, checkpoint "
                                  f"{target.like} has {target.shapes[i]}")
        if target.dtypes[i] is None:
            target.dtypes[i] = ref_t.dtype


def _entries(laid: ImportedState, target: _Target) -> tuple[list, dict, dict]:
    """The manifest's entry of each parameter, the state kept in memory, and the steps of the offloaded."""
    saved = laid.params()
    entries, memory_state, steps = [], {}, {}
    for i in range(len(target.shapes)):
        shape, dtype = target.shapes[i], target.dtypes[i]
        numel = math.prod(map(int, shape)) if shape is not None else None
        name = dtype_name(dtype) if dtype is not None else None
        if i not in laid.state:
            entries.append(ParamEntry(i, "none", False, shape, name, numel))
            continue
        step = float(laid.state[i].get("step", 0.0))
        if i in saved:
            entries.append(ParamEntry.offloaded(i, shape, dtype, saved[i], initialized=True, step=step))
            steps[i] = step_tensor(laid.state[i].get("step", 0.0))
        else:
            memory_state[i] = cpu_state(laid.state[i])
            keys = tuple(sorted(k for k in laid.state[i] if k != "step"))
            entries.append(ParamEntry(i, "memory", True, shape, name, numel, keys, name, step=step))
    return entries, memory_state, steps
