"""A model's weights in a checkpoint: offloaded parameters streamed through their store's own pool."""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Callable, Optional, Sequence

import torch
import xxhash
from torch import nn

from ..aio import Engine
from ..config import AioConfig, config_to_dict
from ..errors import CheckpointError, StateError
from ..interrupts import deferring
from ..params import named_tensors, shards_held, store_of
from ..params.plans import block_size, flat_bytes, held, load_blocks, save_blocks, stores_of
from .commit import Staged, reading, write_atomically
from .format import DEFAULT_STORAGE, MODEL_MEMORY, PARAMS_DATA, Storage, dtype_name, dtype_of, read_torch, write_file
from .manifest import LocalPart, Manifest, ModelSection, TensorEntry, read_process
from .stream import read_verified, stream, tensor_spans, tool_pool, write_data

__all__ = ["load_parameters", "save_parameters"]


@deferring
def save_parameters(model: nn.Module, directory) -> str:
    """Save ``model``'s weights to the checkpoint directory ``directory``, atomically, streaming.

    Offloaded parameters go from the swap space through the parameter pool to ``params.bin`` with
    the native engine (O_DIRECT), each with its xxh3_64: nothing is fetched, so host memory stays the
    pool whatever the model size. A parameter resident now (inside a forward or ``materialized``)
    or held in the host cache is saved from that copy, its latest. The model's other parameters
    and persistent buffers go to ``model.pt``. Gradients are not saved (torch does not save them
    either). With an ``OffloadedAdam`` use ``opt.save_checkpoint(directory, model=model)`` instead,
    which saves both in the same directory. See ``docs/checkpoint.md``.

    Returns:
        The checkpoint directory (absolute).

    Raises:
        StateError: a load of weights into this model failed part-way, so there is nothing sound to save.
        OSError: writing failed (file, offset and errno named); a previous checkpoint at ``directory``
            is left as it was.
    """
    named_tensors(model)  # checks the type

    def write(staged: Staged) -> Manifest:
        section, files = save_model(model, staged)
        stores = stores_of(t for _, t, _ in named_tensors(model))
        config = config_to_dict(stores[0].config, only=None) if stores else {}
        return Manifest.new(None, files=files, config=config, model=section)

    return write_atomically(directory, write)


@deferring
def load_parameters(model: nn.Module, directory) -> None:
    """Load weights saved by :func:`save_parameters` (or with ``save_checkpoint(..., model=)``) into ``model``.

    First every name, shape and dtype is compared with the model, and every checksum (``model.pt``,
    each parameter in ``params.bin``) verified; the first mismatch is named and nothing changes. Then
    the bytes stream into the parameter store's swap space through its pool (a resident or cached
    copy is overwritten too), the other tensors are copied in, and offloaded gradients are cleared.
    The model need not be offloaded the same way as when it was saved (or at all).

    An optimizer keeping fp32 master copies of these weights (``OffloadedAdam`` over bf16/fp16) does
    not see them: load both with ``opt.load_checkpoint(directory, model=model)``.

    Raises:
        CheckpointError: the checkpoint holds no model, or does not fit this one (names the first
            mismatch), or is incomplete; ``ChecksumError``: corrupt. Nothing was changed.
        OSError: reading or writing failed while streaming; the offloaded weights are then a mix of old
            and new, and fetching them raises ``StateError`` until a load succeeds.
    """
    named_tensors(model)
    with reading(directory) as directory:
        load_model(model, read_process(directory))


def model_section(manifest: Manifest) -> ModelSection:
    """The manifest's model section; CheckpointError where the checkpoint holds no model weights."""
    if manifest.model is None:
        raise CheckpointError(f"checkpoint {manifest.root} holds no model weights (it was saved without model=); "
                              "load the model from where its weights were saved, or pass no model")
    return manifest.model


def _aio(stores: list) -> AioConfig:
    """The engine settings of the first store (the defaults without one)."""
    return stores[0].config.aio if stores else AioConfig()


# -- saving -----------------------------------------------------------------------------------


# The model's part of a checkpoint (params.bin, model.pt, the manifest's "model" section) and how it is
# saved and loaded are docs/checkpoint.md's "Format", "Saving the model" and "Loading checks first": in
# short, nothing is fetched to save, and a load checks every checksum in a first read of params.bin before
# a second one changes anything, then overwrites every in-memory copy so that no stale one survives.
def save_model(model: nn.Module, staged: Staged, index_of: Optional[dict] = None) -> tuple[ModelSection, dict]:
    """Write params.bin and model.pt into ``staged``; returns the manifest's model section and the two
    files' entries (as ``write_file`` returns them). ``index_of``: ``id(param) ->`` the optimizer's index of it,
    recorded with each parameter it holds. FSDP2's local shards on NVMe are held in memory meanwhile: they are
    saved as the in-memory DTensors they are."""
    with shards_held(model):
        return _save_model(model, staged, index_of or {})


def _save_model(model: nn.Module, staged: Staged, index_of: dict) -> tuple[ModelSection, dict]:
    first: dict[int, str] = {}
    entries, offloaded, memory = [], [], {}
    for name, t, kind in named_tensors(model):
        if id(t) in first:
            entries.append(TensorEntry(name, same_as=first[id(t)]))
            continue
        first[id(t)] = name
        store = store_of(t) if kind == "param" else None
        where = MODEL_MEMORY if store is None else PARAMS_DATA
        index = index_of.get(id(t)) if kind == "param" else None
        entries.append(TensorEntry(name, None, kind, tuple(t.shape), dtype_name(t.dtype), where, param=index,
                                   local=LocalPart.of(t)))
        if store is None:
            memory[name] = _cpu_copy(t, name)
        else:
            offloaded.append((name, t, store))

    stores = stores_of(t for _, t, _ in offloaded)
    for s in stores:
        if s.error is not None:
            raise StateError(f"not saving the model: its offloaded weights were lost or half loaded ({s.error}). "
                             "Load a checkpoint again first.")
    hashes = {name: xxhash.xxh3_64() for name, _, _ in offloaded}
    with held(stores) as buffers:
        unit_bytes = block_size(buffers, stores) if offloaded else 0
        units = save_blocks(offloaded, unit_bytes) if offloaded else []

        def read(i: int, buf):
            # Checked as it lands: a checkpoint never copies weights changed on disk behind our back.
            return units[i].read(buf, unit_bytes)

        def fill(i: int, buf) -> None:
            hashes[units[i].name].update(buf.tensor[:units[i].n].numpy())

        data, offsets = write_data(staged, _aio(stores), buffers or [], [u.n for u in units], read=read, fill=fill,
                                   name=PARAMS_DATA)
    offset = {u.name: at for u, at in zip(units, offsets) if u.start == 0}
    length = {name: t.numel() * t.element_size() for name, t, _ in offloaded}
    entries = [e if e.where != PARAMS_DATA else
               TensorEntry(**{**e.__dict__, "offset": offset[e.name], "length": length[e.name],
                              "xxh3_64": hashes[e.name].hexdigest()}) for e in entries]
    files = {PARAMS_DATA: data, MODEL_MEMORY: write_file(memory, staged.path(MODEL_MEMORY), staged.storage.fsync)}
    return ModelSection(tuple(entries), sum(length.values())), files


def _cpu_copy(t: torch.Tensor, name: str) -> torch.Tensor:
    """What model.pt holds for ``t``: a CPU tensor of its own (torch.save writes whole storages)."""
    with torch._C.DisableTorchFunctionSubclass():
        try:
            d = t.detach()
            if d.device.type != "cpu" or d.untyped_storage().nbytes() != d.numel() * d.element_size() \
                    or not d.is_contiguous():
                d = d.to("cpu", memory_format=torch.contiguous_format, copy=True)
            return d
        except RuntimeError as err:
            raise CheckpointError(f"cannot save {name!r}: {err}") from err


# -- reading params.bin -----------------------------------------------------------------------


def scan_params(manifest: Manifest, engine: Engine, buffers: Sequence,
                sink: Optional[Callable[[TensorEntry, int, torch.Tensor], None]] = None,
                label: Optional[str] = None) -> None:
    """Read params.bin once, checking every parameter's checksum and the file's; ``sink(entry, start,
    bytes)`` gets each parameter's bytes as they pass (verified only once the last unit is in)."""
    model_section(manifest)
    read_verified(engine, manifest.sized_path(PARAMS_DATA), tensor_spans(manifest), buffers,
                  manifest.files[PARAMS_DATA].xxh3_64,
                  sink=None if sink is None else lambda span, start, data: sink(span.key, start, data), label=label)


def _tool_pool(manifest: Manifest):
    return tool_pool([t.length for t in model_section(manifest).on_disk()])


def model_memory(manifest: Manifest) -> dict:
    """model.pt's content, checksum verified, once it is checked to hold each tensor the manifest places
    there with the shape and dtype it records (what a load compares with the model)."""
    section = model_section(manifest)
    memory = read_torch(manifest.path(MODEL_MEMORY), manifest.files[MODEL_MEMORY])
    for e in section.tensors:
        if e.same_as is None and e.where == MODEL_MEMORY:
            t = memory.get(e.name) if isinstance(memory, dict) else None
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(e.shape) or dtype_name(t.dtype) != e.dtype:
                raise CheckpointError(f"checkpoint {manifest.root}: {MODEL_MEMORY} does not hold {e.name!r} as the "
                                      f"manifest records it (shape {list(e.shape)}, {e.dtype}); load another "
                                      "checkpoint")
    return memory


def verify_model(manifest: Manifest, aio: AioConfig) -> None:
    """Check model.pt (:func:`model_memory`), params.bin's checksum and every parameter's in it."""
    model_memory(manifest)
    with _tool_pool(manifest) as pool, Engine(aio) as engine:
        scan_params(manifest, engine, list(pool), label=f"verifying {PARAMS_DATA}")


def state_dict(manifest: Manifest, aio: AioConfig) -> OrderedDict:
    """The checkpoint's model as a ``state_dict`` (every tensor in memory), checksums verified."""
    memory = model_memory(manifest)
    out: OrderedDict = OrderedDict()
    flat: dict[str, torch.Tensor] = {}
    for e in model_section(manifest).tensors:
        if e.same_as is not None:
            out[e.name] = out[e.same_as]
        elif e.where == MODEL_MEMORY:
            out[e.name] = memory[e.name]
        else:
            out[e.name] = torch.empty(e.shape, dtype=dtype_of(e.dtype))
            flat[e.name] = flat_bytes(out[e.name])

    def sink(e: TensorEntry, start: int, data: torch.Tensor) -> None:
        flat[e.name][start:start + data.numel()].copy_(data)

    with _tool_pool(manifest) as pool, Engine(aio) as engine:
        scan_params(manifest, engine, list(pool), sink, label=f"exporting {PARAMS_DATA}")
    return out


# -- loading ----------------------------------------------------------------------------------


def _match(model: nn.Module, manifest: Manifest) -> list[tuple[str, torch.Tensor, TensorEntry]]:
    """Check the model against the checkpoint; returns ``(name, tensor, entry)`` per distinct tensor."""
    section = model_section(manifest)
    where = f"checkpoint {manifest.root}"
    saved = {e.name for e in section.tensors}
    named = named_tensors(model)
    present = {n for n, _, _ in named}
    for name, _, kind in named:
        if name not in saved:
            raise CheckpointError(f"{where} has no {kind} {name!r}, which this model has")
    for e in section.tensors:
        if e.name not in present:
            raise CheckpointError(f"{where} has {e.name!r}, which this model lacks")
    jobs, seen = [], set()
    for name, t, _ in named:
        if id(t) in seen:
            continue  # a tied name: the tensor is loaded once, under its first name
        seen.add(id(t))
        e = section.source(name)
        if tuple(e.shape) != tuple(t.shape):
            raise CheckpointError(f"{where}: {name!r} has shape {tuple(e.shape)} in the checkpoint, "
                                  f"{tuple(t.shape)} in this model")
        if dtype_of(e.dtype) != t.dtype:
            raise CheckpointError(f"{where}: {name!r} has dtype {e.dtype} in the checkpoint, "
                                  f"{dtype_name(t.dtype)} in this model")
        jobs.append((name, t, e))
    return jobs


def load_model(model: nn.Module, manifest: Manifest, aio: Optional[AioConfig] = None, *,
               on_partial: Optional[Callable[[BaseException], None]] = None,
               storage: Storage = DEFAULT_STORAGE, memory: Optional[dict] = None) -> None:
    """Load the checkpoint's model section into ``model``: check everything, then stream (with an
    engine of ``storage``); raises as :func:`load_parameters` says, calling ``on_partial(err)`` first
    where streaming failed after the first bytes changed. ``memory``: model.pt's tensors to load (read
    and checked by the caller, some of them this rank's parts gathered from several shards), instead of
    the checkpoint's own. FSDP2's local shards on NVMe are held in memory meanwhile and written back after."""
    with shards_held(model, modified=True):
        jobs = _match(model, manifest)
        memory = model_memory(manifest) if memory is None else memory
        manifest.sized_path(PARAMS_DATA)
        stores = stores_of(t for _, t, _ in jobs)
        aio = aio or _aio(stores)
        own_pool = None if stores else _tool_pool(manifest)
        with own_pool or contextlib.nullcontext(), storage.engine(aio) as engine, held(stores) as lent:
            buffers = lent if lent is not None else list(own_pool)
            # First pass: every checksum, before anything changes.
            scan_params(manifest, engine, buffers)
            try:
                _stream_in(manifest, jobs, memory, engine, buffers, stores)
            except BaseException as err:
                for s in stores:
                    s.error = err
                if on_partial is not None:
                    on_partial(err)
                raise
            for s in stores:
                s.loaded([t for _, t, _ in jobs if store_of(t) is s])


def _stream_in(manifest: Manifest, jobs: list, memory: dict, engine: Engine, buffers: list, stores: list) -> None:
    """Second pass: every tensor's new bytes into the extents and the in-memory copies."""
    unit_bytes = block_size(buffers, stores)
    blocks, direct, after = load_blocks([(name, t, e, memory[e.name] if e.where == MODEL_MEMORY else None)
                                         for name, t, e in jobs], unit_bytes)
    # From params.bin, checked again as it passes (verified a moment ago: a mismatch is a file changed under us).
    from_file = {(id(b.entry), b.start): b for b in blocks if b.entry is not None}
    spans = [s for s in tensor_spans(manifest) if (id(s.key), 0) in from_file]
    read_verified(engine, manifest.path(PARAMS_DATA), spans, buffers, None, part_bytes=unit_bytes,
                  sink=lambda span, start, data: from_file[(id(span.key), start)].refresh(data),
                  write=lambda span, start, buf: from_file[(id(span.key), start)].write(buf, unit_bytes))
    # From model.pt (a weight offloaded here that was not when saved).
    stream([b for b in blocks if b.entry is None], buffers, process=lambda b, buf: b.take(buf),
           write=lambda b, buf: b.write(buf, unit_bytes))
    with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
        for t, src in direct:
            t.copy_(src)
        for dest, tmp in after:
            dest.copy_(tmp)
