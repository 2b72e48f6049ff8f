"""Loading a checkpoint into an offloaded optimizer: check everything first, then stream the state back."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Optional

import torch
from torch import nn

from .. import codes
from ..aio import Engine
from ..distributed import like, local, rank_info
from ..errors import CheckpointError, ChecksumError
from ..interrupts import deferring
from ..params import ParamAccess
from ..state import (
    HALF_DTYPES,
    check_param_state,
    exported_keys,
    in_memory_state,
    local_entry,
    match_groups,
    set_chunk_values,
    step_tensor,
)
from ..units import ALIGNMENT
from .commit import reading, wait_for_save
from .format import DATA, DEFAULT_STORAGE, EXTRA, Storage, dtype_of, read_torch
from .job import failures, job_world, on_every_rank
from .manifest import Manifest, ParamEntry, read_process
from .model import load_model, model_section
from .stream import progress_bar, read_verified, stream, unit_spans
from .verify import job_shard, verify_data


# NOTE: loading checks the manifest, the sizes and every unit's checksum as the bytes pass, and the
# shapes, dtypes and param groups against the optimizer before touching it. When the optimizer
# packs state like the checkpoint (same buffer_size and parameters), units stream back to the swap
# space as they are; otherwise each parameter's element ranges are re-chunked into the new units.
@deferring
def load_checkpoint(optimizer, directory: str | os.PathLike, *, model: nn.Module | None = None,
                    progress: Optional[bool] = None, alone: bool = False,
                    storage: Optional[Storage] = None) -> Any:
    """Restore an offloaded optimizer from ``directory``; returns the ``extra`` saved with it (or None).

    Everything that can be checked without touching the optimizer is checked first: the manifest,
    file sizes, ``memory.pt``'s checksum, param groups, and every parameter's shape and dtype. The
    data then streams back to the swap space with each unit's checksum verified before it is
    written. Works across buffer sizes and small-parameter thresholds (state is re-chunked by
    parameter element ranges). Clears a failed step.

    With ``model`` (the checkpoint must have been saved with one), the model's weights are loaded
    first: names, shapes, dtypes and every parameter's checksum in ``params.bin`` are checked (one
    read of the file) before anything changes, then the weights stream into the parameter store's
    swap space through its pool (a resident or cached copy is overwritten too) and the model's
    other tensors are copied in. Offloaded gradients are cleared.

    A save of this optimizer still going on in the background is waited for first.

    Args:
        optimizer: the :class:`offload.OffloadedAdam` or ``OffloadedAdamW`` to restore.
        directory: the checkpoint directory.
        model: the model whose weights to load too.
        progress: a progress bar on stderr for a long load; None: where stderr is a terminal.
        alone: where torch.distributed runs a job of several ranks, the load is the job's: every
            rank calls it, loads its own shard of a job's checkpoint (or the whole of a process's
            checkpoint), and either all load or all raise. ``alone=True`` loads into this process by
            itself, as outside a job (a process's checkpoint, or one shard ``directory/rank-<n>``).
        storage: the file-system and engine calls the load makes (:class:`Storage`); the default does
            what they say. Tests pass one that fails where they want it to.

    Raises:
        CheckpointError: the checkpoint does not fit this optimizer or ``model`` (the message names
            the first mismatch: parameter index or name, expected and found) or is incomplete;
            nothing was changed.
        ChecksumError: a file is corrupt. If the data file's corruption is found while streaming,
            the optimizer refuses to step until a good checkpoint is loaded.
        OSError: reading or writing failed (same consequence).
    """
    if optimizer.state_store.closed:
        raise ValueError("the optimizer is closed")
    optimizer.end_running_step("load_checkpoint()")  # the state is replaced: a step backward started ends
    # A save in the background copies units as steps change them; a load changes them all unguarded.
    wait_for_save(optimizer.state_store, report=False)
    if not alone and job_world() is not None:
        return _load_job(optimizer, directory, model, progress, storage or DEFAULT_STORAGE)
    # Held for the whole load: a save of the same directory by another process waits until it ends.
    with reading(directory) as directory:
        return _apply(optimizer, model, progress, _check(optimizer, directory, model), storage or DEFAULT_STORAGE)


def _check(optimizer, directory: str, model: nn.Module | None) -> tuple:
    """Everything a load checks before it changes anything; returns what :func:`_apply` needs."""
    manifest = read_process(directory)
    if manifest.optimizer is None:
        raise CheckpointError(f"checkpoint {directory} holds model weights only (offload.params.save_parameters), "
                              "no optimizer state; load it with offload.params.load_parameters(model, ...)")
    if model is not None:
        model_section(manifest)  # before anything is read: a checkpoint without the model
    manifest.sized_path(DATA)
    memory = manifest.memory()
    extra = read_torch(manifest.path(EXTRA), manifest.files[EXTRA]) if EXTRA in manifest.files else None
    params = _match(optimizer, manifest, memory)
    return manifest, memory, extra, params


def _apply(optimizer, model: nn.Module | None, progress: Optional[bool], checked: tuple,
           storage: Storage) -> Any:
    """The load's part that changes the optimizer (and ``model``), once :func:`_check` has passed."""
    store = optimizer.state_store
    manifest, memory, extra, params = checked
    if model is not None:
        # Weights first: a checkpoint without fp32 masters seeds them from the weights at load.
        # On failure part-way its state is intact, but the weights it updates are half loaded.
        load_model(model, manifest, optimizer.config.aio, on_partial=store.failed, storage=storage)

    try:
        _load_into(optimizer, manifest, memory, params, progress, storage)
    except BaseException as err:
        for slot in store.layout.slots.values():
            slot.initialized = False
        store.failed(err)
        raise
    return extra


# NOTE: the ranks of a job load together: each checks everything it can without changing anything (the
# job manifest, its world size, its own shard and that shard against its optimizer), then they exchange
# the outcome, and only if every rank passed does any rank change its state: either all load or all
# raise. A failure while streaming (a unit that fails its checksum, an I/O error) is exchanged too: the
# ranks that loaded then refuse to step, as the one that failed does, until a load succeeds.
def _load_job(optimizer, directory, model, progress, storage: Storage) -> Any:
    """:func:`load_checkpoint` on every rank of a job (see the NOTE above)."""
    given = os.path.abspath(os.fspath(directory))
    with contextlib.ExitStack() as stack:
        def check() -> tuple[tuple, dict]:
            stack.enter_context(reading(given))
            shard, job = job_shard(given, job_world(), rank_info().rank)
            return _check(optimizer, shard, model), {"job": job}

        checked, own, statuses = on_every_rank(f"loading {given}", check)
        failed = failures(statuses)
        if failed:
            raise own or CheckpointError(f"rank {failed[0]['rank']} cannot load {given} ({failed[0]['error']}); "
                                         "nothing was loaded on any rank")
        if len({s["job"] for s in statuses}) > 1:
            raise CheckpointError(f"the ranks found different saves under {given} (a save of the job was cut off "
                                  "between the commits of directories on different nodes); nothing was loaded on any "
                                  "rank: load an older checkpoint")
        try:
            extra, own, statuses = on_every_rank(
                f"loading {given}", lambda: (_apply(optimizer, model, progress, checked, storage), {}))
        except BaseException as err:
            # A rank did not answer: it may have failed its load, so this one's state is not whole either.
            optimizer.state_store.failed(err)
            raise
        failed = failures(statuses)
        if failed:
            err = own or CheckpointError(f"rank {failed[0]['rank']} failed to load its shard of {given} "
                                         f"({failed[0]['error']}); this rank loaded its own, but the job's state is "
                                         "not whole: no rank steps until a load succeeds on every rank")
            if own is None:
                optimizer.state_store.failed(err)
            raise err
        return extra


def _match(opt, manifest: Manifest, memory: dict) -> list:
    """Check the checkpoint against the optimizer; return its parameters in index order."""
    where = f"checkpoint {manifest.root}"
    by_index = match_groups(opt.param_groups, memory["param_groups"], where=where, error=CheckpointError)
    params = [None] * len(manifest.params)
    for i, p in by_index.items():
        if not 0 <= i < len(params):
            raise CheckpointError(f"{where}: parameter index {i} is out of range")
        params[i] = p
    amsgrad = {id(p): bool(g["amsgrad"]) for g in opt.param_groups for p in g["params"]}
    for e in manifest.params:
        p = params[e.index]
        keys = None
        if e.initialized:
            keys = set(memory["state"][e.index]) - {"step"} if e.where == "memory" else e.keys
        check_param_state(p, e.index, shape=e.shape, keys=keys, amsgrad=amsgrad[id(p)], where=where,
                          dtype=dtype_of(e.dtype) if e.dtype is not None else None, error=CheckpointError)
    return params


def _load_into(opt, manifest: Manifest, memory: dict, params: list, progress: Optional[bool],
               storage: Storage) -> None:
    store = opt.state_store
    store.drain(quiet=True)  # the last step's writes land first; their state is overwritten now
    store.rewriting_all()  # all of the state is replaced: a swap file cut behind our back is whole again
    store.place_late(opt.param_groups, (params[e.index] for e in manifest.params if e.initialized))
    path = manifest.path(DATA)
    small_from_swap: list = []
    with storage.engine(opt.config.aio) as engine:
        plan = _same_packing(store, manifest, params)
        if plan is not None:
            with progress_bar(manifest.files[DATA].bytes, "load", progress) as bar:
                def write(span, buf):
                    bar.update(span.length)
                    return store.write_unit(plan[span.key], buf)

                read_verified(engine, path, unit_spans(manifest), store.buffers, manifest.files[DATA].xxh3_64,
                              write=write)
        else:
            verify_data(manifest, engine, store.buffers)
            with engine.open(path, "r", no_links=True) as f:
                small_from_swap = _rechunk(store, manifest, memory, params, engine, f, store.buffers)

    # The data is in place: now the in-memory side, which cannot fail half way.
    small, offloaded = {}, {}
    for e in manifest.params:
        if not e.initialized:
            continue
        p = params[e.index]
        step = memory["steps"][e.index] if e.where == "swap" else memory["state"][e.index].get("step", 0.0)
        if store.is_small(p):
            # As load_state_dict takes it: a DTensor parameter's state as this rank's part of it.
            source = memory["state"][e.index] if e.where == "memory" else small_from_swap[e.index]
            small[p] = local_entry({**source, "step": step}, p)
        else:
            offloaded[p] = step
    restore_in_memory(opt, memory["param_groups"], small, offloaded)
    for p in offloaded:
        store.layout.slots[p].initialized = True
    store.restored()


def restore_in_memory(optimizer, groups: list, small: dict, offloaded: dict) -> None:
    """What every load does once the offloaded state is settled, ``load_state_dict`` and checkpoints
    alike: the groups' hyperparameters from ``groups`` (torch's layout), ``optimizer.state`` rebuilt
    (the whole state of each small parameter in ``small``, the step of each offloaded one in
    ``offloaded``), every slot marked as holding no state (the caller marks those it wrote).

    Args:
        optimizer: an :class:`offload.OffloadedAdam` or ``OffloadedAdamW``.
        groups: the param groups loaded, in order (their ``params`` are ignored).
        small: ``{param: state}`` for parameters whose state lives in memory (a DTensor's as its
            local part); an fp32 master missing from it is seeded from the weights.
        offloaded: ``{param: step}`` for parameters whose state is offloaded.
    """
    for g, s in zip(optimizer.param_groups, groups):
        g.update({k: v for k, v in s.items() if k != "params"})
    optimizer.state.clear()
    for slot in optimizer.state_store.layout.slots.values():
        slot.initialized = False
    master = optimizer.config.offload_optimizer.master_weights
    for p, source in small.items():
        # The weights are fetched (if offloaded) only where a master copy is to be made from them.
        with ParamAccess.resident([p] if p.dtype in HALF_DTYPES and "master" not in source else []):
            state = in_memory_state(local(p), source, master=master)
        optimizer.state[p] = {k: like(v, p) if k != "step" and torch.is_tensor(v) else v for k, v in state.items()}
    for p, step in offloaded.items():
        optimizer.state[p] = {"step": step_tensor(step)}


def _same_packing(store, manifest: Manifest, params: list) -> Optional[dict]:
    """{checkpoint unit: optimizer unit} when every saved unit is packed exactly like one of the
    optimizer's, so bytes can move as they are; None when state must be re-chunked."""
    if manifest.buffer_size != store.layout.unit_bytes or \
            any(u.length > min(b.nbytes for b in store.buffers) for u in manifest.units):
        return None
    index = {p: i for i, p in enumerate(params)}
    signature: list[list] = [[] for _ in manifest.units]
    for e in manifest.params:
        if e.initialized:
            slot = store.slot(params[e.index])
            if (e.where == "memory") != (slot is None):
                return None  # small here and offloaded there, or the other way round
            if slot is not None and (list(slot.keys) != list(e.keys) or list(slot.dtypes) != e.state_dtypes()):
                return None  # e.g. an imported state without the fp32 master copy, or another state_dtype
        for c in e.chunks:
            signature[c.unit].append((e.index, c.start, c.numel, c.offset, c.stride, c.slices or ()))
    by_sig = {}
    for unit in store.layout.units:
        sig = tuple(sorted((index[c.slot.param], c.start, c.numel, c.offset, c.stride,
                            () if c.stride else tuple(c.slices)) for c in unit.chunks))
        by_sig[sig] = unit
    plan = {}
    for u, sig in enumerate(signature):
        target = by_sig.get(tuple(sorted(sig)))
        if target is None or target.nbytes != manifest.units[u].nbytes:
            return None
        plan[u] = target
    return plan


class RangeReader:
    """Copies byte ranges of a checkpoint's data file into tensors through one staging buffer."""

    def __init__(self, engine: Engine, file, buffer, file_bytes: int):
        self.engine, self.file, self.buffer, self.file_bytes = engine, file, buffer, file_bytes
        self.start, self.end = 0, 0  # the window of the file the buffer holds

    def copy(self, dest: torch.Tensor, offset: int) -> None:
        """Fill the 1-D tensor ``dest`` from the file's bytes at ``offset``."""
        itemsize = dest.element_size()
        done, total = 0, dest.numel() * itemsize
        while done < total:
            pos = offset + done
            if not (self.start <= pos < self.end):
                self.start = pos // ALIGNMENT * ALIGNMENT
                length = min(self.buffer.nbytes, self.file_bytes - self.start)
                got = self.engine.read(self.file, self.buffer, self.start, length)
                self.end = self.start + got
                if got < itemsize:
                    raise ChecksumError(f"{self.file.path}: ends at byte {self.end}, data expected at {pos}")
            take = min(total - done, self.end - pos)
            n = take // itemsize
            dest[done // itemsize: done // itemsize + n].copy_(self.buffer.view(dest.dtype, pos - self.start, n))
            done += n * itemsize


def _rechunk(store, manifest: Manifest, memory: dict, params: list, engine: Engine, f, buffers: list) -> dict:
    """Fill the optimizer's units from the checkpoint by parameter element ranges; returns ``{index: {key:
    tensor}}`` for parameters small here whose state the checkpoint holds on disk."""
    reader = RangeReader(engine, f, buffers[0], manifest.files[DATA].bytes)
    index = {p: i for i, p in enumerate(params)}

    def copy_from_disk(dest: torch.Tensor, e: ParamEntry, key: str, lo: int, hi: int) -> None:
        """``dest`` filled with elements [lo, hi) of state ``key`` as saved (an absmax counts blocks)."""
        k = e.keys.index(key)
        saved = e.state_dtypes()[k]
        for c in e.chunks:
            first, n = codes.elements(key, c.start), codes.elements(key, c.numel)
            a, b = max(lo, first), min(hi, first + n)
            if a < b:
                at = manifest.units[c.unit].offset + c.key_offset(k) + (a - first) * saved.itemsize
                reader.copy(dest[a - lo: b - lo], at)

    def values_from_disk(e: ParamEntry, key: str, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of state ``key`` as values: 8-bit codes dequantized (``lo`` starts a block)."""
        saved = e.state_dtypes()[e.keys.index(key)]
        raw = torch.empty(hi - lo, dtype=saved)
        copy_from_disk(raw, e, key, lo, hi)
        if saved != torch.uint8:
            return raw
        absmax = torch.empty(codes.blocks(hi - lo), dtype=torch.float32)
        copy_from_disk(absmax, e, key + codes.ABSMAX, lo // codes.BLOCK, lo // codes.BLOCK + absmax.numel())
        return codes.dequantize(raw, absmax, signed=key == "exp_avg")

    def fill_key(c, buf, e: ParamEntry, key: str) -> None:
        """State ``key`` of chunk ``c`` from the checkpoint: its bytes as they are where it is stored alike, else
        its values converted (another state_dtype)."""
        lo, hi = c.start, c.start + c.numel
        if c.slot.dtype_of(key) == e.state_dtypes()[e.keys.index(key)]:
            copy_from_disk(c.slice(buf, key), e, key, lo, hi)
            if c.slot.dtype_of(key) == torch.uint8:
                absmax = key + codes.ABSMAX
                copy_from_disk(c.slice(buf, absmax), e, absmax, codes.elements(absmax, lo),
                               codes.elements(absmax, lo) + codes.elements(absmax, c.numel))
        else:
            set_chunk_values(c, buf, key, values_from_disk(e, key, lo, hi))

    def wanted(p) -> Optional[ParamEntry]:
        e = manifest.params[index[p]]
        return e if e.initialized else None

    todo = [u for u in store.layout.units if any(wanted(c.slot.param) for c in u.chunks)]
    active = {id(c.slot) for u in todo for c in u.chunks if wanted(c.slot.param)}

    def fill(unit, buf, weights) -> bool:
        for c in unit.chunks:
            e = wanted(c.slot.param)
            if e is None:
                continue
            lo, hi = c.start, c.start + c.numel
            for key in exported_keys(c.slot):
                if e.where == "swap" and key in e.keys:
                    fill_key(c, buf, e, key)
                elif e.where == "memory" and key in memory["state"][e.index]:
                    set_chunk_values(c, buf, key, memory["state"][e.index][key].detach().reshape(-1)[lo:hi])
                elif key == "master":
                    set_chunk_values(c, buf, key, weights.weights(c))
                else:
                    raise CheckpointError(f"parameter {e.index}: state {key!r} is not in the checkpoint")
        weights.done(unit)
        return True

    # A master copy seeded from weights that live on NVMe (offload_parameters) needs them resident:
    # fetched at the parameter's first chunk, released after its last, as the optimizer's step does.
    with ParamAccess().units(todo, active, write_back=False) as weights:
        stream(todo, buffers[1:], process=lambda unit, buf: fill(unit, buf, weights), write=store.write_unit)

    out = {}
    for p in params:
        e = wanted(p)
        if e is None or e.where != "swap" or not store.is_small(p):
            continue
        tensors = {key: values_from_disk(e, key, 0, p.numel()).float().view(p.shape) for key in e.value_keys()}
        out[e.index] = tensors
    return out
