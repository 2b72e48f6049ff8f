"""Export to and import from torch's optimizer state_dict layout, and export of a model's weights
(what ``offload-ckpt`` runs)."""

from __future__ import annotations

import os
import secrets
from collections import OrderedDict
from typing import Any

import torch

from ..aio import Engine
from ..config import Config, config_to_dict, load_config
from ..errors import CheckpointError
from ..state import Layout, step_tensor
from .commit import Staged, reading, write_atomically
from .format import DATA, MEMORY, dtype_name, dtype_of, read_torch, write_file
from .manifest import Manifest, ParamEntry, chunk_table, read_process
from .model import model_section, state_dict
from .snapshot import Plan, cpu_state, torch_groups, write_small_files
from .storage import DEFAULT_STORAGE
from .stream import aio_of, read_verified, tool_pool, unit_spans, write_data


def export_state_dict(directory: str | os.PathLike, *, include_master: bool = True) -> dict:
    """A checkpoint as torch's optimizer ``state_dict`` (``{"state": ..., "param_groups": ...}``).

    What ``torch.optim.Adam``/``AdamW.load_state_dict`` (and ``OffloadedAdam.load_state_dict``)
    accept. State of fp16/bf16 parameters is fp32, with their fp32 master copy as ``"master"``
    (torch's optimizers ignore it; ``include_master=False`` leaves it out). Needs host memory for
    the whole state; every checksum is verified on the way.

    Raises:
        CheckpointError: incomplete or corrupt checkpoint.
    """
    with reading(directory) as directory:
        return _export_state_dict(directory, include_master)


def _export_state_dict(directory: str, include_master: bool) -> dict:
    manifest = read_process(directory)
    if manifest.optimizer is None:
        raise CheckpointError(f"checkpoint {directory} holds model weights only, no optimizer state to export; "
                              "export the model with export_model_checkpoint (offload-ckpt export --model-out)")
    path = manifest.sized_path(DATA)
    memory = read_torch(manifest.path(MEMORY), manifest.files[MEMORY])
    manifest.check_memory(memory)
    state: dict = {}
    placements: list[list] = [[] for _ in manifest.units]
    for e in manifest.params:
        if not e.initialized:
            continue
        if e.where == "memory":
            state[e.index] = {k: v for k, v in memory["state"][e.index].items() if k != "master" or include_master}
            continue
        entry = {"step": step_tensor(memory["steps"][e.index])}
        for k, dtype in zip(e.keys, e.state_dtypes()):
            if k != "master" or include_master:
                # Moments kept in bf16 (state_dtype "bf16") come out in fp32, torch's layout.
                entry[k] = torch.empty(e.shape, dtype=torch.float32 if dtype == torch.bfloat16 else dtype)
        state[e.index] = entry
        for c in e.chunks:
            placements[c.unit].append((e, c))

    def sink(span, start: int, data: torch.Tensor) -> None:
        buf = data.view(-1)  # the whole unit: the pool's buffers hold the longest
        for e, c in placements[span.key]:
            for k, (key, dtype) in enumerate(zip(e.keys, e.state_dtypes())):
                if key in state[e.index]:
                    at = c.key_offset(k)
                    src = buf[at: at + c.numel * dtype.itemsize].view(dtype)
                    state[e.index][key].view(-1)[c.start:c.start + c.numel].copy_(src)

    with tool_pool([u.length for u in manifest.units], cap=None) as pool:
        engine = Engine(aio_of(manifest))
        try:
            read_verified(engine, path, unit_spans(manifest), list(pool), manifest.files[DATA].xxh3_64, sink=sink)
        finally:
            engine.close()
    return {"state": state, "param_groups": [dict(g) for g in memory["param_groups"]]}


def export_checkpoint(directory: str | os.PathLike, out: str | os.PathLike, *, include_master: bool = True) -> None:
    """Write :func:`export_state_dict` of ``directory`` to ``out`` with ``torch.save`` (atomically)."""
    _save_file(export_state_dict(directory, include_master=include_master), out)


def export_model_state_dict(directory: str | os.PathLike) -> OrderedDict:
    """The model weights of a checkpoint (saved with ``model=`` or ``save_parameters``) as the
    model's ``state_dict``: ``model.load_state_dict()`` of a plain model of the same architecture
    accepts it.

    Unlike saving and loading, this materialises every weight in host memory: the whole dict is
    built (offloaded parameters read one at a time from params.bin, each checksum verified) before
    it is returned.

    Raises:
        CheckpointError: no model in the checkpoint, or it is incomplete or corrupt.
    """
    with reading(directory) as directory:
        manifest = read_process(directory)
        model_section(manifest)
        return state_dict(manifest, aio_of(manifest))


def export_model_checkpoint(directory: str | os.PathLike, out: str | os.PathLike) -> None:
    """Write :func:`export_model_state_dict` of ``directory`` to ``out`` with ``torch.save``
    (atomically); needs host memory for the whole model."""
    _save_file(export_model_state_dict(directory), out)


def _save_file(obj: Any, out: str | os.PathLike) -> None:
    """``torch.save(obj, out)``, fsynced, under a temporary name until complete."""
    out = os.path.abspath(os.fspath(out))
    tmp = f"{out}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        write_file(obj, tmp, DEFAULT_STORAGE.fsync)
        os.replace(tmp, out)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    DEFAULT_STORAGE.fsync_dir(os.path.dirname(out))


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
    if isinstance(state_dict, (str, os.PathLike)):
        state_dict = torch.load(os.fspath(state_dict), map_location="cpu", weights_only=True)
    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        raise CheckpointError("expected an optimizer state dict with 'state' and 'param_groups'")
    groups = state_dict["param_groups"]
    n = sum(len(g["params"]) for g in groups)
    old_ids = [i for g in groups for i in g["params"]]
    renumber = {old: new for new, old in enumerate(old_ids)}
    state = {renumber[k]: v for k, v in state_dict["state"].items() if k in renumber}
    unknown = [k for k in state_dict["state"] if k not in renumber]
    if unknown:
        raise CheckpointError(f"the state dict has state for parameter(s) {unknown} that no group lists")

    shapes: list = [None] * n
    dtypes: list = [None] * n
    if like is not None:
        with reading(like) as like:
            ref = read_process(like)
        cfg = load_config(ref.config)
        threshold = ref.threshold if ref.threshold is not None else cfg.offload_optimizer.small_param_threshold
        if len(ref.params) != n:
            raise CheckpointError(f"the state dict has {n} parameters, checkpoint {like} has {len(ref.params)}")
        for e in ref.params:
            shapes[e.index] = tuple(e.shape) if e.shape is not None else None
            dtypes[e.index] = dtype_of(e.dtype) if e.dtype is not None else None
    else:
        cfg = load_config(config) if not isinstance(config, Config) else config
        threshold = cfg.offload_optimizer.small_param_threshold
    unit_bytes = cfg.offload_optimizer.buffer_size
    amsgrad_of = {}
    for g in groups:
        for old in g["params"]:
            amsgrad_of[renumber[old]] = bool(g.get("amsgrad", False))
    for i, entry in state.items():
        ref_t = entry.get("exp_avg")
        if not torch.is_tensor(ref_t):
            raise CheckpointError(f"parameter {i}: state without an 'exp_avg' tensor is not Adam's")
        if shapes[i] is None:
            shapes[i] = tuple(ref_t.shape)
        elif tuple(ref_t.shape) != shapes[i]:
            raise CheckpointError(f"parameter {i}: exp_avg has shape {tuple(ref_t.shape)}, checkpoint {like} "
                                  f"has {shapes[i]}")
        if dtypes[i] is None:
            dtypes[i] = ref_t.dtype

    # Lay out the parameters with state, as an optimizer with this config would.
    metas = {}
    layout = Layout(unit_bytes, cfg.offload_optimizer.state_dtype)
    offloaded = []
    for i in range(n):
        if i in state and _numel(shapes[i]) >= threshold:
            metas[i] = torch.empty(shapes[i], dtype=dtypes[i], device="meta")
            offloaded.append((metas[i], {"index": i}, amsgrad_of[i]))
    layout.commit(layout.plan(offloaded))
    meta_index = {id(t): i for i, t in metas.items()}

    def fill(unit, buf) -> None:
        for c in unit.chunks:
            i = meta_index[id(c.slot.param)]
            for key in c.slot.keys:
                view = c.slice(buf, key)
                src = state[i].get(key)
                if src is None:
                    if key == "master":
                        view.zero_()  # never read: "master" is absent from the manifest's keys below
                        continue
                    raise CheckpointError(f"parameter {i}: state {key!r} is missing from the state dict")
                view.copy_(src.detach().reshape(-1)[c.start:c.start + c.numel])

    def write(staged: Staged) -> Manifest:
        units = layout.units
        with tool_pool([unit_bytes], cap=None) as pool:
            data = write_data(staged, cfg.aio, list(pool), units, read=None, fill=fill, nbytes_of=lambda u: u.nbytes)
        chunks_of = chunk_table(units, lambda param: meta_index[id(param)])
        entries, memory_state, steps = [], {}, {}
        for i in range(n):
            shape, dtype = shapes[i], dtypes[i]
            numel = _numel(shape) if shape is not None else None
            name = dtype_name(dtype) if dtype is not None else None
            step = float(state[i].get("step", 0.0)) if i in state else None
            if i not in state:
                e = ParamEntry(i, "none", False, shape, name, numel)
            elif i in metas:
                slot = layout.slots[metas[i]]
                keys = [k for k in slot.keys if k in state[i]]
                e = ParamEntry.offloaded(i, shape, dtype, slot, keys, chunks_of.get(i, ()), step=step)
                steps[i] = step_tensor(state[i].get("step", 0.0))
            else:
                memory_state[i] = cpu_state(state[i])
                e = ParamEntry(i, "memory", True, shape, name, numel, tuple(sorted(k for k in state[i] if k != "step")),
                               name, step=step)
            entries.append(e)
        taken = Plan(units, entries, torch_groups(groups, renumber), memory_state, steps)
        return write_small_files(staged, taken, data, kind="imported", extra=extra,
                                 config=config_to_dict(cfg, only=None), unit_bytes=unit_bytes, threshold=threshold)

    return write_atomically(directory, write)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
