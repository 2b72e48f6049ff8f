"""Loading a checkpoint into an offloaded optimizer: check everything first, then stream the state back."""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from .. import codes
from ..aio import Engine
from ..distributed import like, local, rank_info
from ..errors import CheckpointError, ChecksumError
from ..interrupts import deferring
from ..params import ParamAccess
from ..sizes import ALIGNMENT
from ..state.dicts import check_param_state, in_memory_state, match_groups, step_tensor
from ..state.plans import HALF_DTYPES, StateLoad, mark_initialized
from .commit import reading, wait_for_save
from .format import DATA, DEFAULT_STORAGE, EXTRA, Storage, dtype_of, read_torch
from .job import failures, job_world, on_every_rank
from .manifest import JobManifest, Manifest, ParamEntry, read
from .model import load_model, model_section
from .reshard import (
    Piece,
    Resharded,
    SavedState,
    Source,
    model_tensors,
    plan,
    same_layout,
    sources_here,
    with_parts,
)
from .stream import progress_bar, read_verified, unit_spans
from .verify import shard_manifest, verify_data


# NOTE: everything is checked before the optimizer changes (docs/checkpoint.md, "Loading checks first, then
# streams"); units packed as this optimizer packs them stream back as they are, else they are re-chunked by
# element ranges, from whichever shards hold them (reshard.py).
@deferring
def load_checkpoint(optimizer, directory: str | os.PathLike, *, model: nn.Module | None = None,
                    progress: Optional[bool] = None, alone: bool = False,
                    storage: Optional[Storage] = None) -> Any:
    """Restore an offloaded optimizer from ``directory``; returns the ``extra`` saved with it (or None).

    Everything that can be checked without touching the optimizer is checked first (manifest, sizes,
    ``memory.pt``, param groups, every parameter's shape and dtype, and with ``model`` its names, shapes,
    dtypes and ``params.bin``'s checksums); then the data streams back, each unit's checksum verified before
    it is written. Works across buffer sizes and small-parameter thresholds (state is re-chunked by element
    ranges) and, for a job's checkpoint, on any number of ranks (``docs/checkpoint.md``, "Another number of
    ranks"). Clears a failed step; waits first for a save of this optimizer still going on.

    Args:
        optimizer: the :class:`offload.OffloadedAdam` or ``OffloadedAdamW`` to restore.
        directory: the checkpoint directory.
        model: the model whose weights to load too.
        progress: a progress bar on stderr for a long load; None: where stderr is a terminal.
        alone: where torch.distributed runs a job of several ranks, the load is the job's: every
            rank calls it, loads its part of the checkpoint (its own shard of a job's saved on as
            many ranks, or the whole of a process's checkpoint), and either all load or all raise.
            ``alone=True`` loads into this process by itself, as outside a job.
        storage: the file-system and engine calls the load makes (:class:`Storage`); the default does
            what they say. Tests pass one that fails where they want it to.

    Raises:
        CheckpointError: the checkpoint does not fit this optimizer or ``model`` (the message names
            the first mismatch: parameter index or name, expected and found) or is incomplete (in
            another layout: elements this rank holds are in no shard here, the range named); nothing
            was changed.
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
        checked, _ = _check(optimizer, directory, model)
        return _apply(optimizer, model, progress, checked, storage or DEFAULT_STORAGE)


@dataclass
class _Checked:
    """What a load found and checked before it changes anything (what :func:`_apply` needs).

    Attributes:
        manifest: the checkpoint whose param groups and ``extra`` are loaded (and whose units, when the
            parameters are laid out as when saved): a process's, this rank's shard, or the first shard
            here of a checkpoint saved in another layout.
        memory: its memory.pt.
        extra: its ``extra``.
        params: the optimizer's parameters by the checkpoint's indices.
        saved: per index, the parameter's saved state as this rank loads it (None: none saved).
        resharded: where the parameters were laid out otherwise when saved: the plan of what each
            rank reads from which shard.
    """

    manifest: Manifest
    memory: dict
    extra: Any
    params: list
    saved: dict
    resharded: Optional[Resharded] = None


# NOTE: a checkpoint loads as saved where this rank holds the part of every tensor the saving rank did;
# otherwise each rank reads its parts from every shard holding some of their elements (reshard.py).
def _check(optimizer, directory: str, model: nn.Module | None, *, world: int = 1,
           rank: int = 0) -> tuple[_Checked, Optional[str]]:
    """Everything a load into rank ``rank`` of a job of ``world`` ranks checks before it changes anything;
    returns what :func:`_apply` needs and, for a job's checkpoint, the job's id."""
    found = read(directory)
    if isinstance(found, JobManifest):
        if found.world_size == world:
            checked = _check_as_saved(optimizer, Source(shard_manifest(found, rank), rank), model)
            if checked is not None:
                return checked, found.job
        sources, missing = sources_here(found)
        return _check_resharded(optimizer, found.root, sources, missing, model), found.job
    source = Source(found)
    checked = _check_as_saved(optimizer, source, model)
    return checked or _check_resharded(optimizer, directory, [source], [], model), None


def _check_source(optimizer, source: Source, model: nn.Module | None) -> tuple[Manifest, dict, Any, list]:
    """The checks of the checkpoint ``source`` against the optimizer (and ``model``): its files, groups and
    parameters; returns its manifest, memory.pt, extra and the optimizer's parameters by its indices."""
    manifest = source.manifest
    if manifest.optimizer is None:
        raise CheckpointError(f"checkpoint {manifest.root} holds model weights only (offload.params.save_parameters), "
                              "no optimizer state; load it with offload.params.load_parameters(model, ...)")
    if model is not None:
        model_section(manifest)  # before anything is read: a checkpoint without the model
    manifest.sized_path(DATA)
    memory = source.memory()
    extra = read_torch(manifest.path(EXTRA), manifest.files[EXTRA]) if EXTRA in manifest.files else None
    return manifest, memory, extra, _match(optimizer, manifest, memory)


def _check_as_saved(optimizer, source: Source, model: nn.Module | None) -> Optional[_Checked]:
    """The checks of a load of ``source`` as it was saved, or None where this rank holds other parts of the
    parameters than the rank that saved it."""
    manifest, memory, extra, params = _check_source(optimizer, source, model)
    if not same_layout(source, params, model):
        return None
    saved = {}
    for e in manifest.params:
        if e.initialized and e.where != "none":
            whole = Piece(source, e, 0, 0, local(params[e.index]).numel())
            saved[e.index] = SavedState.of((whole,), source, e)
    return _Checked(manifest, memory, extra, params, saved)


def _check_resharded(optimizer, root: str, sources: list, missing: list, model: nn.Module | None) -> _Checked:
    """The checks of a load from ``sources`` (the shards here; ``missing``: those that are not) of a
    checkpoint saved by ranks that held other parts of the parameters."""
    for s in sources:
        s.manifest.sized_path(DATA)
    sources = [with_parts(s) for s in sources]
    manifest, memory, extra, params = _check_source(optimizer, sources[0], model) if sources else (None,) * 4
    amsgrad = _amsgrad(optimizer)
    resharded = plan(root, sources, missing, params, {i: amsgrad[id(p)] for i, p in enumerate(params or ())}, model)
    return _Checked(manifest, memory, extra, params, resharded.state, resharded)


def _apply(optimizer, model: nn.Module | None, progress: Optional[bool], checked: _Checked,
           storage: Storage) -> Any:
    """The load's part that changes the optimizer (and ``model``), once :func:`_check` has passed."""
    store = optimizer.state_store
    if model is not None:
        # Weights first: a checkpoint without fp32 masters seeds them from the weights at load.
        # On failure part-way its state is intact, but the weights it updates are half loaded.
        tensors = model_tensors(checked.resharded, model) if checked.resharded is not None else None
        load_model(model, checked.manifest, optimizer.config.aio, on_partial=store.failed, storage=storage,
                   memory=tensors)

    try:
        _load_into(optimizer, checked, progress, storage)
    except BaseException as err:
        mark_initialized(store, False)
        store.failed(err)
        raise
    return checked.extra


# NOTE: the ranks of a job load together: all check, exchange the outcome, and only if every rank passed does
# any change its state; a failure while streaming is exchanged too (docs/checkpoint.md, "Loading").
def _load_job(optimizer, directory, model, progress, storage: Storage) -> Any:
    """:func:`load_checkpoint` on every rank of a job (see the NOTE above)."""
    given = os.path.abspath(os.fspath(directory))
    with contextlib.ExitStack() as stack:
        def check() -> tuple[_Checked, dict]:
            stack.enter_context(reading(given))
            checked, job = _check(optimizer, given, model, world=job_world(), rank=rank_info().rank)
            return checked, {"job": job}

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
            if not isinstance(own, Exception):  # another rank's failure, or a Ctrl-C here: the state is not whole
                optimizer.state_store.failed(err)
            raise err
        return extra


def _amsgrad(opt) -> dict:
    """Per ``id(param)``: whether its group has amsgrad."""
    return {id(p): bool(g["amsgrad"]) for g in opt.param_groups for p in g["params"]}


def _match(opt, manifest: Manifest, memory: dict) -> list:
    """Check the checkpoint against the optimizer; return its parameters in index order."""
    where = f"checkpoint {manifest.root}"
    by_index = match_groups(opt.param_groups, memory["param_groups"], where=where, error=CheckpointError)
    params = [None] * len(manifest.params)
    for i, p in by_index.items():
        if not 0 <= i < len(params):
            raise CheckpointError(f"{where}: parameter index {i} is out of range")
        params[i] = p
    amsgrad = _amsgrad(opt)
    for e in manifest.params:
        p = params[e.index]
        keys = None
        if e.initialized:
            keys = set(memory["state"][e.index]) - {"step"} if e.where == "memory" else e.keys
        check_param_state(p, e.index, shape=e.shape, keys=keys, amsgrad=amsgrad[id(p)], where=where,
                          dtype=dtype_of(e.dtype) if e.dtype is not None else None, error=CheckpointError)
    return params


def _load_into(opt, checked: _Checked, progress: Optional[bool], storage: Storage) -> None:
    store = opt.state_store
    store.drain(quiet=True)  # the last step's writes land first; their state is overwritten now
    store.rewriting_all()  # all of the state is replaced: a swap file cut behind our back is whole again
    store.place_late(opt.param_groups, (checked.params[i] for i, s in checked.saved.items() if s is not None))
    load = StateLoad(store, checked.params, {i for i, s in checked.saved.items() if s is not None})
    buffers = store.lend_buffers()  # the first reads saved values, the others carry units to their extents
    with storage.engine(opt.config.aio) as engine:
        manifest, plan = checked.manifest, None
        if checked.resharded is None:
            plan = load.packed_as(manifest.buffer_size, [u.nbytes for u in manifest.units],
                                  [u.length for u in manifest.units], manifest.params, buffers)
        if plan is not None:
            with progress_bar(manifest.files[DATA].bytes, "load", progress) as bar:
                def write(span, start, buf):
                    bar.update(span.length)
                    return load.write(plan[span.key], buf)

                read_verified(engine, manifest.path(DATA), unit_spans(manifest), buffers,
                              manifest.files[DATA].xxh3_64, write=write)
        with contextlib.ExitStack() as files:
            values = _SavedValues(checked, engine, files, buffers, verified=plan is not None)
            if plan is None:
                # A master copy seeded from weights that live on NVMe (offload_parameters) needs them resident:
                # fetched at the parameter's first chunk, released after its last, as the optimizer's step does.
                with ParamAccess().units(load.units, load.active, write_back=False) as weights:
                    load.run(values, weights, buffers)
            small = {i: values.small(i) for i, s in checked.saved.items()
                     if s is not None and store.is_small(checked.params[i])}

    # The data is in place: now the in-memory side, which cannot fail half way.
    offloaded = {checked.params[i]: s.step for i, s in checked.saved.items()
                 if s is not None and i not in small}
    restore_in_memory(opt, checked.memory["param_groups"],
                      {checked.params[i]: {**state, "step": checked.saved[i].step} for i, state in small.items()},
                      offloaded)
    mark_initialized(store, True, list(offloaded))
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
    mark_initialized(optimizer.state_store, False)
    master = optimizer.config.offload_optimizer.master_weights
    for p, source in small.items():
        # The weights are fetched (if offloaded) only where a master copy is to be made from them.
        with ParamAccess.resident([p] if p.dtype in HALF_DTYPES and "master" not in source else []):
            state = in_memory_state(local(p), source, master=master)
        optimizer.state[p] = {k: like(v, p) if k != "step" and torch.is_tensor(v) else v for k, v in state.items()}
    for p, step in offloaded.items():
        optimizer.state[p] = {"step": step_tensor(step)}


class RangeReader:
    """Copies byte ranges of checkpoints' data files into tensors through one staging buffer, cut into a
    window per file (``files`` of them at most), so that reading from several files in turn does not read
    a window of each again every time."""

    def __init__(self, engine: Engine, buffer, files: int = 1):
        self.engine, self.buffer = engine, buffer
        count = max(1, min(files, buffer.nbytes // ALIGNMENT))
        self.size = buffer.nbytes // count // ALIGNMENT * ALIGNMENT
        self.windows = [[None, 0, 0] for _ in range(count)]  # per window: the file, and the bytes it holds
        self.window_of: dict = {}  # id(file) -> its window

    def copy(self, dest: torch.Tensor, file, file_bytes: int, offset: int) -> None:
        """Fill the 1-D tensor ``dest`` from ``file``'s bytes (``file_bytes`` of them) at ``offset``."""
        k = self.window_of.setdefault(id(file), len(self.window_of) % len(self.windows))
        window, base = self.windows[k], k * self.size
        itemsize = dest.element_size()
        done, total = 0, dest.numel() * itemsize
        while done < total:
            pos = offset + done
            if window[0] is not file or not (window[1] <= pos < window[2]):
                start = pos // ALIGNMENT * ALIGNMENT
                got = self.engine.read(file, self.buffer, start, min(self.size, file_bytes - start), buffer_offset=base)
                window[:] = [file, start, start + got]
                if got < itemsize:
                    raise ChecksumError(f"{file.path}: ends at byte {window[2]}, data expected at {pos}")
            take = min(total - done, window[2] - pos)
            n = take // itemsize
            dest[done // itemsize: done // itemsize + n].copy_(self.buffer.view(dest.dtype, base + pos - window[1], n))
            done += n * itemsize


def _saved_dtype(e: ParamEntry, key: str) -> Optional[torch.dtype]:
    """The dtype state ``key`` is saved in, on disk by entry ``e`` (None where it is not)."""
    return e.state_dtypes()[e.keys.index(key)] if e.where == "swap" and key in e.keys else None


# NOTE: the optimizer's units are filled by element ranges: each chunk's elements [lo, hi) of a key come from
# the pieces of its parameter's saved state (SavedState.within), from state.bin (read in ranges through one
# staging buffer, each data file verified whole first) or memory.pt. Stored alike, the bytes are copied as
# they are (8-bit codes and their absmax too, only where a rank loads its own shard: same elements, same
# blocks); otherwise as values, converted as load_state_dict converts what state_dict() gave: 8-bit codes
# dequantized, then encoded again where the state is 8-bit here. A master copy the checkpoint lacks is
# seeded from the weights.
class _SavedValues:
    """The saved state of ``checked.saved`` by element ranges (what :class:`offload.state.plans.StateLoad`
    fills the units from), and the state of parameters small here."""

    def __init__(self, checked: _Checked, engine: Engine, files: contextlib.ExitStack, buffers: list, *,
                 verified: bool):
        self.checked, self.engine = checked, engine
        self.exact = checked.resharded is None  # the saving rank's elements are this rank's
        self.files: dict = {}
        sources = {id(x.source): x.source for s in checked.saved.values() if s is not None for x in s.pieces
                   if x.entry.where == "swap"}
        self.reader = RangeReader(engine, buffers[0], files=len(sources))
        for source in sources.values():
            if not verified:
                verify_data(source.manifest, engine, buffers)
            self.files[id(source)] = files.enter_context(engine.open(source.manifest.path(DATA), "r", no_links=True))

    def read(self, dest: torch.Tensor, x: Piece, key: str, lo: int, hi: int) -> None:
        """``dest`` filled with elements [lo, hi) of state ``key`` as ``x``'s shard saved them (an absmax
        counts blocks)."""
        e, manifest = x.entry, x.source.manifest
        k = e.keys.index(key)
        itemsize = e.state_dtypes()[k].itemsize
        for c in e.chunks:
            first, n = codes.elements(key, c.start), codes.elements(key, c.numel)
            a, b = max(lo, first), min(hi, first + n)
            if a < b:
                at = manifest.units[c.unit].offset + c.key_offset(k) + (a - first) * itemsize
                self.reader.copy(dest[a - lo: b - lo], self.files[id(x.source)], manifest.files[DATA].bytes, at)

    def piece_values(self, x: Piece, key: str) -> Optional[torch.Tensor]:
        """``x``'s elements of state ``key`` as values (8-bit codes dequantized), or None where its shard
        saved no ``key``."""
        saved = _saved_dtype(x.entry, key)
        if saved is None:
            return x.saved(key)
        lo, hi = x.old, x.old + x.n
        if saved != torch.uint8:
            raw = torch.empty(hi - lo, dtype=saved)
            self.read(raw, x, key, lo, hi)
            return raw
        first = lo // codes.BLOCK * codes.BLOCK  # codes are dequantized by whole blocks of the saving rank's
        raw = torch.empty(hi - first, dtype=torch.uint8)
        self.read(raw, x, key, first, hi)
        absmax = torch.empty(codes.blocks(hi - first), dtype=torch.float32)
        self.read(absmax, x, key + codes.ABSMAX, first // codes.BLOCK, first // codes.BLOCK + absmax.numel())
        return codes.dequantize(raw, absmax, signed=codes.signed_for(key))[lo - first:]

    def _as_saved(self, x: Piece, key: str, dtype: torch.dtype) -> bool:
        """Whether ``x``'s elements of ``key`` are copied as the bytes its shard saved."""
        return _saved_dtype(x.entry, key) == dtype and (dtype != torch.uint8 or (self.exact and x.old == x.new))

    def copy(self, index: int, key: str, lo: int, hi: int, dest: torch.Tensor, absmax) -> bool:
        """Elements [lo, hi) of state ``key`` of parameter ``index`` into ``dest`` as the bytes saved (codes with
        their absmax into ``absmax()``), where every piece saved them in ``dest``'s dtype; else False."""
        parts = self.checked.saved[index].within(lo, hi)
        if not all(self._as_saved(x, key, dest.dtype) for x in parts):
            return False
        for x in parts:
            self.read(dest[x.new - lo: x.new - lo + x.n], x, key, x.old, x.old + x.n)
            if dest.dtype == torch.uint8:  # the same elements: the same blocks, and their absmax
                name = key + codes.ABSMAX
                first = codes.elements(name, lo)
                self.read(absmax(), x, name, first, first + codes.elements(name, hi - lo))
        return True

    def values(self, index: int, key: str, lo: int, hi: int, weights) -> Optional[torch.Tensor]:
        """Elements [lo, hi) of state ``key`` of parameter ``index`` as values (see :meth:`assemble`)."""
        return self.assemble(self.checked.saved[index].within(lo, hi), key, lo, hi, weights)

    def assemble(self, parts: list, key: str, lo: int, hi: int, weights) -> Optional[torch.Tensor]:
        """Elements [lo, hi) of state ``key`` as values from ``parts``; a master copy not saved is taken from
        ``weights()`` (the elements' flat weights); None where ``key`` is not saved and no weights are given."""
        found = []
        for x in parts:
            v = self.piece_values(x, key)
            if v is None:
                if key != "master":
                    raise CheckpointError(f"parameter {x.entry.index}: state {key!r} is not in the checkpoint")
                if weights is None:
                    return None
                v = weights()[x.new - lo: x.new - lo + x.n]
            found.append((x, v))
        if len(found) == 1 and found[0][0].n == hi - lo:
            return found[0][1]
        dtypes = [v.dtype for _, v in found] or [torch.float32]  # (no elements: a local shard of none)
        out = torch.empty(hi - lo, dtype=functools.reduce(torch.promote_types, dtypes))
        for x, v in found:
            out[x.new - lo: x.new - lo + x.n].copy_(v)
        return out

    def small(self, index: int) -> dict:
        """The state of parameter ``index``, small here, as this rank's part of it (a master copy not saved
        is left out: it is seeded from the weights)."""
        state, p = self.checked.saved[index], self.checked.params[index]
        shape = local(p).shape
        out = {}
        for key in state.keys:
            v = self.assemble(state.pieces, key, 0, shape.numel(), None)
            if v is None:
                continue
            out[key] = v.reshape(shape)
        return out
