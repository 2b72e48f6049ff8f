"""A model's weights in a checkpoint: offloaded parameters streamed through their store's own pool."""

from __future__ import annotations

import contextlib
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import xxhash
from torch import nn

from ..aio import Engine
from ..buffers import BufferPool
from ..config import AioConfig, config_to_dict
from ..errors import CheckpointError, ChecksumError, StateError
from ..params import store_of
from ..space import Extent
from ..units import ALIGNMENT, round_up
from .commit import _Staged, _write_atomically
from .format import (
    MODEL_MEMORY,
    PARAMS_DATA,
    _base_manifest,
    _check_data_digest,
    _check_data_size,
    _dtype,
    _dtype_name,
    _read_torch,
    _write_torch,
    file_path,
)
from .storage import DEFAULT_STORAGE, Storage
from .stream import _DONE, _TOOL_BUFFER_MAX, _stream, _write_data


def _named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor, str]]:
    """``(name, tensor, "param" | "buffer")`` for every entry ``model.state_dict()`` would have, in
    its order (a module's parameters, its persistent buffers, then its children; tied or shared
    tensors under each of their names)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    out = []
    for prefix, module in model.named_modules(remove_duplicate=False):
        dot = prefix + "." if prefix else ""
        for name, p in module._parameters.items():
            if p is not None:
                out.append((dot + name, p, "param"))
        for name, b in module._buffers.items():
            if b is not None and name not in module._non_persistent_buffers_set:
                out.append((dot + name, b, "buffer"))
    return out


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    with torch._C.DisableTorchFunctionSubclass():
        return t.detach().reshape(-1).view(torch.uint8)


def _unit_size(buffers: Sequence, stores: Sequence) -> int:
    """Bytes per request: fits every buffer, a multiple of the checkpoint's and every swap space's
    alignment (so a parameter's units lie back to back in params.bin and in its extent)."""
    step = max([ALIGNMENT] + [s.space.alignment for s in stores])
    unit_bytes = min(b.nbytes for b in buffers) // step * step
    if unit_bytes <= 0:
        raise CheckpointError(f"the parameter pool's buffers ({min(b.nbytes for b in buffers)} bytes) are "
                              f"smaller than the {step}-byte alignment; use a larger buffer_size")
    return unit_bytes


@contextlib.contextmanager
def _held(stores: Sequence):
    """Every store held still (``ParamStore.exclusive``); yields buffers to move bytes through: the
    first store's pool, or ``None`` when the model has no offloaded parameters."""
    with contextlib.ExitStack() as stack:
        lent = [stack.enter_context(s.exclusive()) for s in stores]
        yield lent[0] if lent else None


def _stores_of(tensors) -> list:
    out = []
    for t in tensors:
        s = store_of(t)
        if s is not None and s not in out:
            out.append(s)
    return out


# -- saving -----------------------------------------------------------------------------------


@dataclass(eq=False)
class _Unit:
    """Bytes ``[start, start + n)`` of one tensor on their way to or from params.bin."""

    entry: dict
    start: int
    n: int
    extent: Optional[Extent] = None  # on a swap space (of ``store``)
    store: Any = None
    memory: Optional[torch.Tensor] = None  # or in memory (flat uint8)
    copies: tuple = ()  # loading: in-memory copies to refresh
    from_file: bool = False  # loading: read from params.bin (else from ``memory``)
    param: Optional[torch.Tensor] = None  # the parameter whose extent this is (with ``store``)

    def store_unit(self, unit_bytes: int) -> Optional[int]:
        """This unit's index among the store's own units (of ``unit_bytes``), or None when sizes differ."""
        if self.store is None or self.store.unit_bytes != unit_bytes:
            return None
        return self.start // unit_bytes


# NOTE: with ``model=`` (or ``save_parameters``) a checkpoint also holds the model's tensors, by
# qualified name, in ``state_dict`` order:
#
#   params.bin  each offloaded parameter's bytes at a 4096-aligned offset, copied from the parameter
#               store's swap space through the store's own pool with the native engine (O_DIRECT).
#               Nothing is fetched, so host memory stays the pool whatever the model size. A
#               parameter resident now (in use, maybe changed in place) or held in the host cache is
#               saved from that copy, which is its latest.
#   model.pt    torch.save of the rest: parameters that are not offloaded, persistent buffers.
#
# The manifest's "model" section lists every name with its shape and dtype and where it is
# ("params.bin" with offset, length and xxh3_64 of its bytes, or "model.pt"); a tied name (the same
# tensor under a second name, as ``state_dict`` lists it) says ``same_as`` instead.
#
# Loading checks names, shapes and dtypes, model.pt's checksum, and (in a first read of params.bin)
# every parameter's checksum before anything changes; then a second pass streams the bytes into
# the extents and into any in-memory copy (a resident parameter's storage, the host cache), so no
# stale copy survives. Stored gradients are dropped: they belong to the old weights, and torch does
# not save gradients either. Bytes may move between the two files' kinds: a parameter offloaded
# when saved loads into a model that keeps it in memory, and the other way round.
def _save_model(model: nn.Module, staged: _Staged) -> tuple[dict, dict]:
    """Write params.bin and model.pt into ``staged``; returns the manifest's "model" section and the
    two files' entries."""
    named = _named_tensors(model)
    first: dict[int, str] = {}
    entries, offloaded, memory = [], [], {}
    for name, t, kind in named:
        if id(t) in first:
            entries.append({"name": name, "same_as": first[id(t)]})
            continue
        first[id(t)] = name
        e = {"name": name, "kind": kind, "shape": list(t.shape), "dtype": _dtype_name(t.dtype)}
        store = store_of(t) if kind == "param" else None
        if store is not None:
            e["where"] = PARAMS_DATA
            offloaded.append((e, t, store))
        else:
            e["where"] = MODEL_MEMORY
            memory[name] = _cpu_copy(t, name)
        entries.append(e)

    stores = _stores_of(t for _, t, _ in offloaded)
    for s in stores:
        if s.error is not None:
            raise StateError(f"not saving the model: its offloaded weights were lost or half loaded ({s.error}). "
                             "Load a checkpoint again first.")
    hashes = {id(e): xxhash.xxh3_64() for e, _, _ in offloaded}
    with _held(stores) as buffers:
        units = []
        if offloaded:
            unit_bytes = _unit_size(buffers, stores)
            for e, t, store in offloaded:
                nbytes = t.numel() * t.element_size()
                extent, current = store.current_bytes(t)
                for start in range(0, nbytes, unit_bytes):
                    units.append(_Unit(e, start, min(unit_bytes, nbytes - start), extent, store, current, param=t))

        def read(u: _Unit, buf):
            if u.extent is None:
                return _DONE
            if u.store_unit(unit_bytes) is not None:
                # Checked as it lands: a checkpoint never copies weights changed on disk behind our back.
                return u.store.read_unit(u.param, u.store_unit(unit_bytes), buf)
            space = u.store.space
            return space.read(space.sub(u.extent, u.start, u.n), buf, nbytes=u.n)

        def fill(u: _Unit, buf) -> None:
            if u.memory is not None:
                buf.tensor[:u.n].copy_(u.memory[u.start:u.start + u.n])
            hashes[id(u.entry)].update(buf.tensor[:u.n].numpy())

        aio = stores[0].config.aio if stores else AioConfig()
        data = _write_data(staged, aio, buffers or [], units, read=read, fill=fill, nbytes_of=lambda u: u.n,
                           name=PARAMS_DATA, unit_digests=False)
    for u, row in zip(units, data["units"]):
        if u.start == 0:
            u.entry["offset"] = row["offset"]
    for e, t, _ in offloaded:
        e["length"] = t.numel() * t.element_size()
        e["xxh3_64"] = hashes[id(e)].hexdigest()
    files = {PARAMS_DATA: data["file"], MODEL_MEMORY: _write_torch(memory, staged.path(MODEL_MEMORY),
                                                                          staged.storage.fsync)}
    section = {"tensors": entries, "offloaded_bytes": sum(e["length"] for e, _, _ in offloaded)}
    return section, files


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


def _save_model_only(model: nn.Module, directory: str | os.PathLike) -> str:
    """A checkpoint of ``model``'s weights alone (``offload.params.save_parameters``)."""

    def write(staged: _Staged) -> dict:
        section, files = _save_model(model, staged)
        stores = _stores_of(t for _, t, _ in _named_tensors(model))
        config = config_to_dict(stores[0].config, only=None) if stores else {}
        manifest = _base_manifest(None, [], [], config, 0)
        manifest.update(units=[], files=files, model=section)
        return manifest

    return _write_atomically(directory, write)


# -- reading params.bin -----------------------------------------------------------------------


def _model_section(manifest: dict, directory: str) -> dict:
    section = manifest.get("model")
    if section is None:
        raise CheckpointError(f"checkpoint {directory} holds no model weights (it was saved without model=); "
                              "load the model from where its weights were saved, or pass no model")
    return section


def _on_disk(section: dict) -> list[dict]:
    return sorted((e for e in section["tensors"] if e.get("where") == PARAMS_DATA), key=lambda e: e["offset"])


def _params_path(directory: str, manifest: dict) -> str:
    return _check_data_size(directory, manifest, PARAMS_DATA)


def _bad_param(path: str, e: dict, found: str) -> ChecksumError:
    return ChecksumError(
        f"{path}: parameter {e['name']!r} (bytes [{e['offset']}, {e['offset'] + e['length']})) has xxh3_64 "
        f"{found}, the manifest says {e['xxh3_64']}; the checkpoint is corrupt, load an older one")


def _scan_params(directory: str, manifest: dict, engine: Engine, buffers: Sequence,
                 sink: Optional[Callable[[dict, int, torch.Tensor], None]] = None) -> None:
    """Read params.bin once, checking every parameter's checksum and the file's; ``sink(entry, start,
    bytes)`` gets each parameter's bytes as they pass (verified only once the last unit is in)."""
    path = _params_path(directory, manifest)
    entries = _on_disk(_model_section(manifest, directory))
    unit_bytes = _unit_size(buffers, ())
    units = [(e, off, min(unit_bytes, round_up(e["length"], ALIGNMENT) - off))
              for e in entries for off in range(0, round_up(e["length"], ALIGNMENT), unit_bytes)]
    whole = xxhash.xxh3_64()
    hashes = {id(e): xxhash.xxh3_64() for e in entries}
    with engine.open(path, "r") as f:
        def read(item, buf):
            e, off, n = item
            return engine.read_async(f, buf, e["offset"] + off, n)

        def process(item, buf) -> bool:
            e, off, n = item
            whole.update(buf.tensor[:n].numpy())
            real = buf.tensor[:max(0, min(n, e["length"] - off))]
            hashes[id(e)].update(real.numpy())
            if sink is not None:
                sink(e, off, real)
            if off + n >= e["length"]:
                found = hashes[id(e)].hexdigest()
                if found != e["xxh3_64"]:
                    raise _bad_param(path, e, found)
            return False

        _stream(units, list(buffers), read=read, process=process)
    _check_data_digest(manifest, path, whole.hexdigest(), PARAMS_DATA)


def _tool_pool(manifest: dict, directory: str) -> BufferPool:
    longest = max([e["length"] for e in _on_disk(_model_section(manifest, directory))] + [ALIGNMENT])
    return BufferPool(3, min(round_up(longest, ALIGNMENT), _TOOL_BUFFER_MAX))


def _verify_model(directory: str, manifest: dict, aio: AioConfig) -> None:
    """Check model.pt's and params.bin's checksums, and every parameter's in params.bin."""
    _read_torch(directory, MODEL_MEMORY, manifest["files"][MODEL_MEMORY])
    with _tool_pool(manifest, directory) as pool:
        engine = Engine(aio)
        try:
            _scan_params(directory, manifest, engine, list(pool))
        finally:
            engine.close()


def _read_state_dict(directory: str, manifest: dict, aio: AioConfig) -> OrderedDict:
    """The checkpoint's model as a ``state_dict`` (every tensor in memory), checksums verified."""
    memory = _read_torch(directory, MODEL_MEMORY, manifest["files"][MODEL_MEMORY])
    section = _model_section(manifest, directory)
    out: OrderedDict = OrderedDict()
    flat: dict[int, torch.Tensor] = {}
    for e in section["tensors"]:
        if "same_as" in e:
            out[e["name"]] = out[e["same_as"]]
        elif e["where"] == MODEL_MEMORY:
            out[e["name"]] = memory[e["name"]]
        else:
            t = torch.empty(e["shape"], dtype=_dtype(e["dtype"]))
            out[e["name"]] = t
            flat[id(e)] = _flat_bytes(t)

    def sink(e, start, data):
        flat[id(e)][start:start + data.numel()].copy_(data)

    with _tool_pool(manifest, directory) as pool:
        engine = Engine(aio)
        try:
            _scan_params(directory, manifest, engine, list(pool), sink)
        finally:
            engine.close()
    return out


# -- loading ----------------------------------------------------------------------------------


def _match(model: nn.Module, directory: str, manifest: dict) -> list[tuple[str, torch.Tensor, dict]]:
    """Check the model against the checkpoint; returns ``(name, tensor, entry)`` per distinct tensor."""
    section = _model_section(manifest, directory)
    where = f"checkpoint {directory}"
    saved = {e["name"]: e for e in section["tensors"]}
    named = _named_tensors(model)
    present = {n for n, _, _ in named}
    for name, _, kind in named:
        if name not in saved:
            raise CheckpointError(f"{where} has no {kind} {name!r}, which this model has")
    for e in section["tensors"]:
        if e["name"] not in present:
            raise CheckpointError(f"{where} has {e['name']!r}, which this model lacks")

    def source(name: str) -> dict:
        e = saved[name]
        for _ in range(len(saved)):
            if "same_as" not in e:
                return e
            e = saved[e["same_as"]]
        raise CheckpointError(f"{where}: the manifest's tied names around {name!r} form a cycle")

    jobs, seen = [], set()
    for name, t, _ in named:
        if id(t) in seen:
            continue  # a tied name: the tensor is loaded once, under its first name
        seen.add(id(t))
        e = source(name)
        if tuple(e["shape"]) != tuple(t.shape):
            raise CheckpointError(f"{where}: {name!r} has shape {tuple(e['shape'])} in the checkpoint, "
                                  f"{tuple(t.shape)} in this model")
        if _dtype(e["dtype"]) != t.dtype:
            raise CheckpointError(f"{where}: {name!r} has dtype {e['dtype']} in the checkpoint, "
                                  f"{_dtype_name(t.dtype)} in this model")
        jobs.append((name, t, e))
    return jobs


def _load_model(model: nn.Module, directory: str, manifest: dict, aio: Optional[AioConfig] = None, *,
               on_partial: Optional[Callable[[BaseException], None]] = None,
               storage: Storage = DEFAULT_STORAGE) -> None:
    """Load the checkpoint's model section into ``model``: check everything, then stream (with an
    engine of ``storage``).

    ``on_partial(err)`` is called when streaming failed after the first bytes changed.

    Raises:
        CheckpointError: the checkpoint does not fit the model (first mismatch named) or holds no
            model; ``ChecksumError`` a file or parameter is corrupt. Nothing was changed.
        OSError: reading or writing failed while streaming: the offloaded weights are then a mix of
            old and new, and the store refuses fetches (``StateError``) until a load succeeds.
    """
    jobs = _match(model, directory, manifest)
    memory = _read_torch(directory, MODEL_MEMORY, manifest["files"][MODEL_MEMORY])
    for _, _, e in jobs:
        if e["where"] == MODEL_MEMORY:
            src = memory.get(e["name"]) if isinstance(memory, dict) else None
            if not torch.is_tensor(src) or tuple(src.shape) != tuple(e["shape"]) or src.dtype != _dtype(e["dtype"]):
                raise CheckpointError(f"checkpoint {directory}: {MODEL_MEMORY} lacks {e['name']!r} as its manifest "
                                      "describes it")
    _params_path(directory, manifest)
    stores = _stores_of(t for _, t, _ in jobs)
    if aio is None:
        aio = stores[0].config.aio if stores else AioConfig()
    own_pool = None if stores else _tool_pool(manifest, directory)
    engine = storage.engine(aio)
    try:
        with _held(stores) as lent:
            buffers = lent if lent is not None else list(own_pool)
            # First pass: every checksum, before anything changes.
            _scan_params(directory, manifest, engine, buffers)
            try:
                _stream_in(directory, manifest, jobs, memory, engine, buffers, stores)
            except BaseException as err:
                for s in stores:
                    s.error = err
                if on_partial is not None:
                    on_partial(err)
                raise
            for s in stores:
                s.loaded([t for _, t, _ in jobs if store_of(t) is s])
    finally:
        engine.close()
        if own_pool is not None:
            own_pool.close()


def _stream_in(directory: str, manifest: dict, jobs: list, memory: dict, engine: Engine, buffers: list,
               stores: list) -> None:
    """Second pass: every tensor's new bytes into the extents and the in-memory copies."""
    path = file_path(directory, PARAMS_DATA, manifest["files"][PARAMS_DATA])
    unit_bytes = _unit_size(buffers, stores)
    units, direct, after = [], [], []
    for _, t, e in jobs:
        store = store_of(t)
        src = memory[e["name"]] if e["where"] == MODEL_MEMORY else None
        if store is None and src is not None:
            direct.append((t, src))  # memory to memory
            continue
        nbytes = t.numel() * t.element_size()
        if store is not None:
            extent, copies = store.load_targets(t)
        else:
            with torch._C.DisableTorchFunctionSubclass():
                dest = t.detach()
                if not (dest.is_contiguous() and dest.device.type == "cpu"):
                    tmp = torch.empty(dest.shape, dtype=dest.dtype)
                    after.append((dest, tmp))
                    dest = tmp
            extent, copies = None, [_flat_bytes(dest)]
        memory_bytes = _flat_bytes(src.contiguous()) if src is not None else None
        for start in range(0, nbytes, unit_bytes):
            units.append(_Unit(e, start, min(unit_bytes, nbytes - start), extent, store, memory_bytes, tuple(copies),
                                 from_file=src is None, param=t))

    for store in {id(u.store): u.store for u in units if u.store is not None}.values():
        store.rewriting([u.param for u in units if u.store is store])
    hashes = {id(u.entry): xxhash.xxh3_64() for u in units if u.from_file}
    with engine.open(path, "r") as f:
        def read(u: _Unit, buf):
            if not u.from_file:
                return _DONE
            return engine.read_async(f, buf, u.entry["offset"] + u.start, round_up(u.n, ALIGNMENT))

        def process(u: _Unit, buf) -> bool:
            data = buf.tensor[:u.n]
            if u.from_file:
                hashes[id(u.entry)].update(data.numpy())
                if u.start + u.n == u.entry["length"] and hashes[id(u.entry)].hexdigest() != u.entry["xxh3_64"]:
                    # Verified a moment ago: the file changed under us.
                    raise _bad_param(path, u.entry, hashes[id(u.entry)].hexdigest())
            else:
                data.copy_(u.memory[u.start:u.start + u.n])
            for c in u.copies:
                c[u.start:u.start + u.n].copy_(data)
            if u.extent is None:
                return False
            # The tail of the last block goes to disk too: zeros, as the store writes it.
            buf.tensor[u.n:round_up(u.n, u.store.space.alignment)].zero_()
            return True

        def write(u: _Unit, buf):
            if u.store_unit(unit_bytes) is not None:
                return u.store.write_unit(u.param, u.store_unit(unit_bytes), buf)  # its checksum kept
            space = u.store.space
            return space.write(space.sub(u.extent, u.start, u.n), buf, nbytes=u.n)

        _stream(units, buffers, read=read, process=process, write=write)
    with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
        for t, src in direct:
            t.copy_(src)
        for dest, tmp in after:
            dest.copy_(tmp)
