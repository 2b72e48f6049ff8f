"""Export to and import from torch's optimizer state_dict layout, and export of a model's weights
(what ``offload-ckpt`` runs)."""

from __future__ import annotations

import os
import secrets
from collections import OrderedDict
from typing import Any

import torch
import xxhash

from ..aio import Engine
from ..buffers import BufferPool
from ..config import Config, config_to_dict, load_config
from ..errors import CheckpointError
from ..state import Layout, step_tensor
from ..units import ALIGNMENT
from .commit import _fsync_dir, _Staged, _write_atomically, reading
from .format import (
    MEMORY,
    _check_data_digest,
    _check_data_size,
    _check_unit,
    _chunk_table,
    _cpu_state,
    _dtype,
    _dtype_name,
    _key_dtypes,
    _numel,
    _read_torch,
    _slice_offset,
    _torch_groups,
    _write_memory_and_manifest,
    create_private,
)
from .model import _model_section, _read_state_dict
from .stream import _aio_of, _stream, _tool_pool, _write_data
from .verify import read_manifest


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
    manifest = read_manifest(directory)
    if manifest.get("optimizer") is None:
        raise CheckpointError(f"checkpoint {directory} holds model weights only, no optimizer state to export; "
                              "export the model with export_model_checkpoint (offload-ckpt export --model-out)")
    path = _check_data_size(directory, manifest)
    memory = _read_torch(directory, MEMORY, manifest["files"][MEMORY])
    state: dict = {}
    for e in manifest["params"]:
        if not e.get("initialized"):
            continue
        i = e["index"]
        if e["where"] == "memory":
            state[i] = {k: v for k, v in memory["state"][i].items() if k != "master" or include_master}
            continue
        entry = {"step": step_tensor(memory["steps"][i])}
        for k, dtype in zip(e["keys"], _key_dtypes(e)):
            if k == "master" and not include_master:
                continue
            # Moments kept in bf16 (state_dtype "bf16") come out in fp32, torch's layout.
            entry[k] = torch.empty(e["shape"], dtype=torch.float32 if dtype == torch.bfloat16 else dtype)
        state[i] = entry
    placements: list[list] = [[] for _ in manifest["units"]]
    for e in manifest["params"]:
        if e.get("initialized") and e["where"] == "swap":
            for chunk in e["chunks"]:
                placements[chunk[0]].append((e, chunk))
    units = manifest["units"]
    whole = xxhash.xxh3_64()
    with _tool_pool(manifest) as pool:
        engine = Engine(_aio_of(manifest))
        try:
            with engine.open(path, "r") as f:
                def read(u, buf):
                    return engine.read_async(f, buf, units[u]["offset"], units[u]["length"])

                def process(u, buf):
                    _check_unit(manifest, path, u, buf)
                    whole.update(buf.tensor[: units[u]["length"]].numpy())
                    for e, chunk in placements[u]:
                        _, start, numel = chunk[:3]
                        for k, (key, dtype) in enumerate(zip(e["keys"], _key_dtypes(e))):
                            if key in state[e["index"]]:
                                dest = state[e["index"]][key].view(-1)[start:start + numel]
                                dest.copy_(buf.view(dtype, _slice_offset(chunk, k), numel))
                    return False

                _stream(range(len(units)), list(pool), read=read, process=process)
        finally:
            engine.close()
    _check_data_digest(manifest, path, whole.hexdigest())
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
        manifest = read_manifest(directory)
        _model_section(manifest, directory)
        return _read_state_dict(directory, manifest, _aio_of(manifest))


def export_model_checkpoint(directory: str | os.PathLike, out: str | os.PathLike) -> None:
    """Write :func:`export_model_state_dict` of ``directory`` to ``out`` with ``torch.save``
    (atomically); needs host memory for the whole model."""
    _save_file(export_model_state_dict(directory), out)


def _save_file(obj: Any, out: str | os.PathLike) -> None:
    """``torch.save(obj, out)``, fsynced, under a temporary name until complete."""
    out = os.path.abspath(os.fspath(out))
    tmp = f"{out}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        with create_private(tmp) as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(os.path.dirname(out))


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
        ref = read_manifest(like)
        cfg = load_config(ref["config"])
        threshold = ref.get("threshold", cfg.offload_optimizer.small_param_threshold)
        if len(ref["params"]) != n:
            raise CheckpointError(f"the state dict has {n} parameters, checkpoint {like} has {len(ref['params'])}")
        for e in ref["params"]:
            shapes[e["index"]] = tuple(e["shape"])
            dtypes[e["index"]] = _dtype(e["dtype"])
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

    def write(staged: _Staged) -> dict:
        units = layout.units
        with BufferPool(3, max(unit_bytes, ALIGNMENT)) as pool:
            data = _write_data(staged, cfg.aio, list(pool), units, read=None, fill=fill,
                               nbytes_of=lambda u: u.nbytes)
        chunks_of = _chunk_table(units, lambda param: meta_index[id(param)])
        entries, memory_state, steps = [], {}, {}
        for i in range(n):
            e = {"index": i, "shape": list(shapes[i]) if shapes[i] is not None else None,
                 "dtype": _dtype_name(dtypes[i]) if dtypes[i] is not None else None,
                 "numel": _numel(shapes[i]) if shapes[i] is not None else None}
            if i not in state:
                e.update(where="none", initialized=False)
            elif i in metas:
                slot = layout.slots[metas[i]]
                keys = [k for k in slot.keys if k in state[i]]
                e.update(where="swap", initialized=True, keys=keys, state_dtype=_dtype_name(slot.dtype),
                         chunks=chunks_of.get(i, []))
                if len(set(slot.dtypes)) > 1:
                    e["key_dtypes"] = [_dtype_name(slot.dtype_of(k)) for k in keys]
                steps[i] = step_tensor(state[i].get("step", 0.0))
            else:
                memory_state[i] = _cpu_state(state[i])
                e.update(where="memory", initialized=True, keys=sorted(k for k in state[i] if k != "step"),
                         state_dtype=_dtype_name(dtypes[i]))
            if e["initialized"]:
                e["step"] = float(state[i].get("step", 0.0))
            entries.append(e)
        return _write_memory_and_manifest(
            staged, kind="imported", groups=_torch_groups(groups, renumber), entries=entries,
            memory_state=memory_state, steps=steps, extra=extra, config=config_to_dict(cfg, only=None),
            unit_bytes=unit_bytes, threshold=threshold, data=data)

    return _write_atomically(directory, write)
