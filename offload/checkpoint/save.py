"""Saving an offloaded optimizer (its swapped state streams through its own pool into state.bin), and a model."""

from __future__ import annotations

import os
from typing import Any

from torch import nn

from ..config import config_to_dict
from .commit import _Staged, _write_atomically
from .format import _chunk_table, _cpu_state, _dtype_name, _torch_groups, _write_memory_and_manifest
from .model import _save_model
from .stream import _write_data


def save_checkpoint(optimizer, directory: str | os.PathLike, *, model: nn.Module | None = None,
                    extra: Any = None) -> str:
    """Save an offloaded optimizer's whole state to ``directory``, atomically, without materialising it.

    Offloaded state streams from the swap space through the optimizer's pool to ``state.bin`` with
    the native engine; small parameters' state and the steps go to ``memory.pt``. With ``model``,
    its weights go into the same directory: offloaded parameters stream from the parameter store's
    swap space through the store's pool to ``params.bin`` (nothing is fetched), the rest of the
    model (other parameters, persistent buffers) to ``model.pt``. ``extra`` (e.g. ``{"step": step}``)
    goes to ``extra.pt``. Model and optimizer are thus always saved together; an existing checkpoint
    at ``directory`` is replaced only once the new one is complete on disk.

    Args:
        optimizer: an :class:`offload.OffloadedAdam` or ``OffloadedAdamW``.
        directory: the checkpoint directory; its parent is created if missing.
        model: the model whose weights to save too (offloaded with ``offload_parameters`` or not).
        extra: anything ``torch.save`` can write and ``torch.load(weights_only=True)`` can read back.

    Returns:
        The checkpoint directory (absolute).

    Raises:
        StateError: the optimizer's last step failed part-way, so its state must not be saved (or
            loading weights into ``model`` failed part-way).
        OSError: writing failed (the message names file, offset and errno); the previous checkpoint
            at ``directory``, if any, is left as it was and nothing half written remains.
    """
    optimizer.state_store.check_usable("save a checkpoint")
    optimizer.state_store.drain()  # the last step's writes, and their errors, before anything is copied
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")

    def write(staged: _Staged) -> dict:
        manifest = _save_into(optimizer, staged, extra)
        if model is not None:
            manifest["model"], files = _save_model(model, staged)
            manifest["files"].update(files)
        return manifest

    return _write_atomically(directory, write)


def _save_into(opt, staged: _Staged, extra: Any) -> dict:
    store = opt.state_store
    params = [p for g in opt.param_groups for p in g["params"]]
    index = {p: i for i, p in enumerate(params)}
    slots = store.layout.slots
    units = [u for u in store.layout.units if any(c.slot.initialized for c in u.chunks)]
    # A unit read from NVMe is checked against the checksum of its last write as its read lands: a
    # checkpoint never copies state that changed on disk behind our back.
    data = _write_data(staged, opt.config.aio, store.buffers, units, read=store.read_unit, fill=None,
                       nbytes_of=lambda u: u.nbytes)

    entries = []
    chunks_of = _chunk_table(units, index.__getitem__)
    memory_state, steps = {}, {}
    for i, p in enumerate(params):
        slot = slots.get(p)
        st = opt.state.get(p, {})
        entry = {"index": i, "shape": list(p.shape), "dtype": _dtype_name(p.dtype), "numel": p.numel()}
        if slot is not None and (slot.initialized or i in chunks_of):
            entry.update(where="swap", initialized=slot.initialized, keys=list(slot.keys),
                         state_dtype=_dtype_name(slot.dtype), chunks=chunks_of.get(i, []))
            if len(set(slot.dtypes)) > 1:
                entry["key_dtypes"] = [_dtype_name(d) for d in slot.dtypes]
            if slot.initialized:
                steps[i] = st["step"].detach().to("cpu", copy=True)
        elif slot is None and len(st) > 0:
            memory_state[i] = _cpu_state(st)
            entry.update(where="memory", initialized=True, keys=sorted(k for k in st if k != "step"),
                         state_dtype=_dtype_name(p.dtype))
        else:
            entry.update(where="none", initialized=False)
        if entry["initialized"]:
            entry["step"] = float(steps[i] if i in steps else memory_state[i].get("step", 0.0))
        entries.append(entry)

    return _write_memory_and_manifest(
        staged, kind=type(opt).__name__, groups=_torch_groups(opt.param_groups, index), entries=entries,
        memory_state=memory_state, steps=steps, extra=extra, config=config_to_dict(opt.config, only=None),
        unit_bytes=store.layout.unit_bytes, threshold=store.threshold, data=data)
