"""Pretrained weights from a safetensors checkpoint into a model, one tensor at a time."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn

from ..errors import CheckpointError
from ..params import empty_parameters, named_tensors, offload_parameters, store_of
from ..progress import progress as progress_bar
from ..regular import CHUNK
from .files import Entry, SafetensorsCheckpoint

__all__ = ["Plan", "fill_modules", "load_safetensors", "match", "offload_pretrained"]

# Bytes of a tensor read from its file at once: a large embedding comes in slices of rows, so what is
# in memory besides the destination is this much, whatever the tensor's size.
READ_BYTES = CHUNK  # the most bytes of one tensor read at a time (a test narrows it)


@dataclass
class Plan:
    """What a checkpoint gives a model: ``entries`` maps every name the model has (a tied tensor's names
    all) to the checkpoint's tensor for it; ``missing`` the model's tensors it lacks (all their names),
    ``unexpected`` the checkpoint's names the model lacks."""

    entries: dict[str, Entry] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


def _named(model: nn.Module) -> dict[int, tuple[torch.Tensor, list[str]]]:
    """``id(tensor) -> (tensor, its names)`` for what ``model.state_dict()`` lists, in its order."""
    out: dict[int, tuple[torch.Tensor, list[str]]] = {}
    for name, t, _ in named_tensors(model):
        out.setdefault(id(t), (t, []))[1].append(name)
    return out


def _convertible(src: torch.dtype, dst: torch.dtype) -> bool:
    return src == dst or (src.is_floating_point and dst.is_floating_point)


def match(model: nn.Module, ckpt: SafetensorsCheckpoint, *, strict: bool = True) -> Plan:
    """Compare ``model`` (real, offloaded or on meta) with ``ckpt`` by name, shape and dtype.

    A tensor under several names (tied weights) needs one of them in the checkpoint. Floating-point
    tensors are converted to the model's dtype on the way; other dtypes must match.

    Raises:
        CheckpointError: a shape or dtype differs; with ``strict``, a tensor of the model is missing from
            the checkpoint or the checkpoint has one the model lacks. Each names the tensors and files.
    """
    plan = Plan()
    known: set[str] = set()
    for t, names in _named(model).values():
        known.update(names)
        found = next((ckpt.entries[n] for n in names if n in ckpt.entries), None)
        if found is None:
            plan.missing.extend(names)
            continue
        if tuple(found.shape) != tuple(t.shape):
            raise CheckpointError(
                f"{found.file}: {found.name!r} has shape {tuple(found.shape)}, the model's {names[0]!r} has "
                f"{tuple(t.shape)}; the checkpoint is for another model configuration (check config.json)")
        if not _convertible(found.dtype, t.dtype):
            raise CheckpointError(f"{found.file}: {found.name!r} is {found.dtype}, the model's {names[0]!r} is "
                                  f"{t.dtype}; only floating-point tensors are converted")
        for n in names:
            plan.entries[n] = found
    plan.unexpected = [n for n in ckpt.entries if n not in known]
    if strict and (plan.missing or plan.unexpected):
        parts = []
        if plan.missing:
            parts.append(f"{len(plan.missing)} of the model's tensors are missing from it ({_some(plan.missing)})")
        if plan.unexpected:
            parts.append(f"it holds {len(plan.unexpected)} the model lacks ({_some(plan.unexpected)})")
        raise CheckpointError(
            f"checkpoint {ckpt.path} does not fit the model: {'; '.join(parts)}. Check that the model class and "
            "config match the checkpoint; strict=False loads what matches and leaves the rest")
    return plan


def _some(names: list[str]) -> str:
    return ", ".join(repr(n) for n in names[:6]) + (", ..." if len(names) > 6 else "")


def copy_into(ckpt: SafetensorsCheckpoint, entry: Entry, dest: torch.Tensor) -> None:
    """Copy ``entry``'s values into ``dest`` (in memory, same shape), converting the dtype, a slice of rows
    of at most :data:`READ_BYTES` at a time."""
    with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
        dest = dest.detach()
        if not entry.shape:
            ckpt.read_into(entry.name, dest)
            return
        row = max(1, entry.dtype.itemsize * (dest.numel() // max(1, entry.shape[0])))
        step = max(1, READ_BYTES // row)
        for start in range(0, entry.shape[0], step):
            stop = min(entry.shape[0], start + step)
            ckpt.read_into(entry.name, dest[start:stop], start, stop)


def _bytes_to_load(plan: Plan) -> int:
    """The checkpoint's bytes ``plan`` reads (a tied tensor's once)."""
    return sum(e.nbytes for e in {id(e): e for e in plan.entries.values()}.values())


def load_safetensors(model: nn.Module, path: str | os.PathLike, *, strict: bool = True,
                     drop_behind: Optional[bool] = None, progress: Optional[bool] = None) -> Plan:
    """Load a safetensors checkpoint into ``model``, one tensor at a time.

    ``path`` is a ``.safetensors`` file or a directory with ``model.safetensors`` or shards listed in
    ``model.safetensors.index.json`` (what ``save_pretrained`` writes); names are those of
    ``model.state_dict()``. Everything is checked before anything changes (names, shapes, dtypes, every
    file's header). Then each tensor is read from its memory-mapped file in slices and written where it
    lives: an offloaded parameter is made resident without reading it, filled and written back to the swap
    space, so memory holds one parameter (and one slice of its file) at a time; stored gradients, which
    belonged to the old weights, are dropped. Floating-point tensors are converted to the model's dtype.

    An ``OffloadedAdam`` built before this keeps its own fp32 master copies of bf16/fp16 weights: load
    first, then build the optimizer.

    Args:
        model: a model, offloaded with :func:`offload.offload_parameters` or not.
        path: the checkpoint.
        strict: refuse a checkpoint whose names differ from the model's (else load what matches).
        drop_behind: drop the checkpoint's pages from the page cache once copied (a load larger than memory
            does not push the rest of the cache out); None: unless other ranks of a job may run on this
            machine (they may read the same shards). See :class:`SafetensorsCheckpoint`.
        progress: a progress bar (bytes read) on stderr for a load that lasts; None: where stderr is a
            terminal (see :mod:`offload.progress`).

    Returns:
        The :class:`Plan`: what was loaded, and the names missing or unexpected.

    Raises:
        CheckpointError: the checkpoint is missing, corrupt or does not fit; nothing was changed. A read
            failing part-way leaves the offloaded weights a mix (fetching them raises ``StateError`` until a
            load succeeds).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"load_safetensors expects a torch.nn.Module, got {type(model).__name__}")
    with SafetensorsCheckpoint(path, drop_behind=drop_behind) as ckpt:
        plan = match(model, ckpt, strict=strict)
        done: dict[int, tuple] = {}  # id(tensor) -> (tensor, its store or None)
        with progress_bar(_bytes_to_load(plan), f"loading {os.path.basename(os.fspath(path))}", nbytes=True,
                          enabled=progress) as bar:
            for t, names in _named(model).values():
                entry = next((plan.entries[n] for n in names if n in plan.entries), None)
                if entry is None:
                    continue
                bar.update(entry.nbytes)
                store = store_of(t)
                done[id(t)] = (t, store)
                if store is None:
                    copy_into(ckpt, entry, t)
                    continue
                store.fetch(t, read=False)
                try:
                    copy_into(ckpt, entry, t)
                except BaseException as err:
                    store.error = err  # its extent keeps the old bytes, others have new ones
                    store.release(t)
                    raise
                store.release(t, dirty=True)
        stores = {id(s): s for _, s in done.values() if s is not None}
        for s in stores.values():
            s.loaded([t for t, owner in done.values() if owner is s])
    return plan


def fill_modules(model: nn.Module, ckpt: SafetensorsCheckpoint, plan: Plan,
                 fallback: Optional[Callable[[nn.Module], None]] = None, bar=None) -> Callable[[nn.Module], None]:
    """An ``init`` for :func:`offload.offload_parameters` that fills each module's parameters from ``ckpt``
    as they are materialised from the meta device, so each is written to the swap space once, with its
    pretrained values. Parameters the checkpoint lacks get ``fallback(module)`` (run first) or zeros.
    ``plan`` comes from :func:`match` on the same model, before it was offloaded; ``bar`` (a progress bar)
    counts the bytes read."""
    prefixes: dict[int, str] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        prefixes.setdefault(id(module), prefix + "." if prefix else "")
    done: set[int] = set()

    def init(module: nn.Module) -> None:
        dot = prefixes.get(id(module), "")
        todo = [(n, p) for n, p in module._parameters.items() if p is not None and id(p) not in done]
        if fallback is not None and any(dot + n not in plan.entries for n, _ in todo):
            fallback(module)
        for n, p in todo:
            entry = plan.entries.get(dot + n)
            if entry is not None:
                copy_into(ckpt, entry, p)
                done.add(id(p))
                if bar is not None:
                    bar.update(entry.nbytes)

    init.sets_every_element = not plan.missing  # every parameter comes whole from the checkpoint
    return init


def offload_pretrained(build: Callable[[], nn.Module], path: str | os.PathLike, nvme_path=None, config=None, *,
                       strict: bool = True, init_missing: Optional[Callable[[nn.Module], Callable]] = None,
                       drop_behind: Optional[bool] = None, progress: Optional[bool] = None,
                       **offload_kwargs) -> nn.Module:
    """Build a model with its parameters on meta, then offload it with the weights of a safetensors checkpoint.

    ``build()`` runs under :func:`offload.params.empty_parameters` (parameters on meta, buffers real); the
    model is checked against the checkpoint (names, shapes, dtypes, every header) before anything is written,
    then offloaded with :func:`offload.offload_parameters`, each module's weights read from the checkpoint as
    it is materialised and written to the swap space once; persistent buffers the checkpoint holds are
    copied in. Memory: the pools and one module.

    Args:
        build: makes the model (for Hugging Face models, ``from_config``).
        path: the checkpoint (see :func:`load_safetensors`).
        nvme_path, config, offload_kwargs: for :func:`offload.offload_parameters`.
        strict: refuse a checkpoint whose names differ from the model's.
        init_missing: ``init_missing(model)`` gives the per-module initialiser for tensors the checkpoint
            lacks (with ``strict=False``); default zeros.
        drop_behind, progress: as for :func:`load_safetensors`.

    Raises:
        CheckpointError: the checkpoint is missing, corrupt, or does not fit; no swap file was made.
    """
    with SafetensorsCheckpoint(path, drop_behind=drop_behind) as ckpt:
        with empty_parameters():
            model = build()
        plan = match(model, ckpt, strict=strict)
        buffers = [(n, b) for n, b in model.named_buffers() if n in plan.entries]
        fallback = init_missing(model) if plan.missing and init_missing is not None else None
        with progress_bar(_bytes_to_load(plan), f"loading {os.path.basename(os.fspath(path))}", nbytes=True,
                          enabled=progress) as bar:
            offload_parameters(model, nvme_path, config, init=fill_modules(model, ckpt, plan, fallback, bar),
                               **offload_kwargs)
            for name, b in buffers:
                copy_into(ckpt, plan.entries[name], b)
                bar.update(plan.entries[name].nbytes)
    return model
