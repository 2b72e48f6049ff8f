"""A checkpoint's manifest as frozen dataclasses: parsed and checked once, when it is read, before anything
uses it; written by the same classes with one ``to_json``.

What parsing refuses (a ``CheckpointError``, a ValueError, naming the manifest's path and the field): a
format or version this library does not read, a field missing or of the wrong type, a size or offset that
is negative, unaligned or beyond its file's size, a chunk outside its unit, a file name that is not a bare
name inside the checkpoint directory, and a data file that is a symbolic link or not a regular file. So
nothing read from a manifest can make a load read or write outside the checkpoint.
"""

from __future__ import annotations

import datetime
import errno as _errno
import json
import os
import re
import stat
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

import torch
import xxhash

from .._version import __version__
from ..errors import CheckpointError, ChecksumError
from ..units import ALIGNMENT, round_up
from .format import (
    DATA,
    FILE_NAMES,
    FORMAT,
    FORMAT_VERSION,
    JOB_FORMAT,
    JOB_VERSION,
    MANIFEST,
    MODEL_MEMORY,
    PARAMS_DATA,
    dtype_name,
    dtype_of,
    io_error,
    jsonable,
)

SHARD_NAME = re.compile(r"^rank-(\d{5,})$")


def shard_name(rank: int) -> str:
    """The directory of ``rank``'s shard inside a job's checkpoint."""
    return f"rank-{rank:05d}"


def digest(body: dict) -> str:
    """The xxh3_64 a manifest records of itself: over its JSON without the ``manifest_xxh3_64`` field."""
    body = {k: v for k, v in body.items() if k != "manifest_xxh3_64"}
    return xxhash.xxh3_64(json.dumps(body, sort_keys=True).encode()).hexdigest()


# -- reading JSON values, each checked with its field's name ----------------------------------------

def _fail(name: str, want: str, value: Any):
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    raise CheckpointError(f"manifest field {name} must be {want}, got {shown}")


def _count(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        _fail(name, "a non-negative integer", value)
    return value


def _number(value: Any, name: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        _fail(name, "a number", value)
    return value


def _text(value: Any, name: str) -> str:
    if not isinstance(value, str):
        _fail(name, "a string", value)
    return value


def _flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        _fail(name, "true or false", value)
    return value


def _dtype(value: Any, name: str) -> str:
    _text(value, name)
    try:
        dtype_of(value)
    except CheckpointError:
        _fail(name, "the name of a torch dtype", value)
    return value


def _bare_name(value: Any, name: str) -> str:
    """A file name inside the checkpoint directory: no separator, not absolute, not ``.`` or ``..``."""
    if not isinstance(value, str) or value in ("", ".", "..") or "/" in value or "\0" in value \
            or os.path.basename(value) != value:
        _fail(name, "a file name inside the checkpoint directory (no '/', not '..')", value)
    return value


def _list(item: Callable[[Any, str], Any]) -> Callable[[Any, str], tuple]:
    def read(value: Any, name: str) -> tuple:
        if not isinstance(value, list):
            _fail(name, "a list", value)
        return tuple(item(v, f"{name}[{i}]") for i, v in enumerate(value))
    return read


def _maybe(check: Callable[[Any, str], Any]) -> Callable[[Any, str], Any]:
    return lambda value, name: None if value is None else check(value, name)


def _one_of(*choices: str) -> Callable[[Any, str], str]:
    def read(value: Any, name: str) -> str:
        if value not in choices:
            _fail(name, "one of " + ", ".join(repr(c) for c in choices), value)
        return value
    return read


def _object(value: Any, name: str) -> dict:
    if not isinstance(value, dict):
        _fail(name, "an object", value)
    return value


_REQUIRED = object()


class _Fields:
    """One JSON object's fields, each read with a check that names it (``params[3].chunks``)."""

    def __init__(self, value: Any, name: str):
        self.value, self.name = _object(value, name or "(the whole manifest)"), name

    def __call__(self, key: str, check: Callable[[Any, str], Any], default: Any = _REQUIRED) -> Any:
        where = f"{self.name}.{key}" if self.name else key
        if key not in self.value:
            if default is _REQUIRED:
                raise CheckpointError(f"manifest field {where} is missing")
            return default
        return check(self.value[key], where)


# -- the entries -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class FileEntry:
    """A file of the checkpoint: its size and xxh3_64, and its name on disk (``file``; the first format
    wrote each file under its fixed name and recorded none)."""

    bytes: int
    xxh3_64: str
    file: Optional[str] = None

    @classmethod
    def parse(cls, value: Any, name: str) -> FileEntry:
        f = _Fields(value, name)
        return cls(f("bytes", _count), f("xxh3_64", _text), f("file", _bare_name, None))

    def on_disk(self, name: str) -> str:
        return self.file or name

    def to_json(self) -> dict:
        out = {"bytes": self.bytes, "xxh3_64": self.xxh3_64}
        if self.file is not None:
            out["file"] = self.file
        return out


def _files(value: Any, name: str) -> dict:
    _object(value, name)
    for key in value:
        if key not in FILE_NAMES:
            _fail(f"{name}[{key!r}]", "one of the format's files (" + ", ".join(FILE_NAMES) + ")", key)
    return {key: FileEntry.parse(v, f"{name}[{key!r}]") for key, v in value.items()}


@dataclass(frozen=True)
class Unit:
    """A unit of state.bin: ``length`` bytes (padded) at ``offset``, ``nbytes`` of them state, and their
    xxh3_64 over the padded length."""

    offset: int
    length: int
    nbytes: Optional[int] = None
    xxh3_64: Optional[str] = None

    @classmethod
    def parse(cls, value: Any, name: str) -> Unit:
        f = _Fields(value, name)
        unit = cls(f("offset", _count), f("length", _count), f("nbytes", _count, None), f("xxh3_64", _text, None))
        if unit.offset % ALIGNMENT or unit.length % ALIGNMENT:
            _fail(name, f"a range aligned to {ALIGNMENT} bytes", value)
        if unit.nbytes is not None and unit.nbytes > unit.length:
            _fail(f"{name}.nbytes", f"at most its length {unit.length}", unit.nbytes)
        return unit

    def to_json(self) -> dict:
        out = {"offset": self.offset, "length": self.length}
        if self.nbytes is not None:
            out["nbytes"] = self.nbytes
        if self.xxh3_64 is not None:
            out["xxh3_64"] = self.xxh3_64
        return out


@dataclass(frozen=True)
class Chunk:
    """Where elements ``[start, start + numel)`` of a parameter's state lie in state.bin: in unit ``unit``
    from byte ``offset``, each state key's slice ``stride`` bytes after the previous one, or, where the
    keys' dtypes differ (``stride`` 0), at its own offset in ``slices``. On disk a list
    ``[unit, start, numel, offset, stride]`` (and ``slices``)."""

    unit: int
    start: int
    numel: int
    offset: int
    stride: int
    slices: Optional[tuple] = None

    @classmethod
    def parse(cls, value: Any, name: str) -> Chunk:
        if not isinstance(value, list) or len(value) not in (5, 6):
            _fail(name, "a list of 5 numbers (and the keys' offsets)", value)
        numbers = [_count(v, f"{name}[{i}]") for i, v in enumerate(value[:5])]
        slices = _list(_count)(value[5], f"{name}[5]") if len(value) == 6 else None
        return cls(*numbers, slices)

    def key_offset(self, k: int) -> int:
        """Byte offset of state key ``k``'s slice within the unit."""
        return self.offset + (self.slices[k] if self.slices is not None else k * self.stride)

    def to_json(self) -> list:
        row = [self.unit, self.start, self.numel, self.offset, self.stride]
        return row + [list(self.slices)] if self.slices is not None else row


@dataclass(frozen=True)
class ParamEntry:
    """A parameter of the optimizer (by its index in the param groups) and where its state is: ``swap``
    (state.bin, by ``chunks``), ``memory`` (memory.pt) or ``none``."""

    index: int
    where: str
    initialized: bool
    shape: Optional[tuple] = None
    dtype: Optional[str] = None
    numel: Optional[int] = None
    keys: tuple = ()
    state_dtype: Optional[str] = None
    key_dtypes: Optional[tuple] = None
    chunks: tuple = ()
    step: Optional[float] = None

    @classmethod
    def parse(cls, value: Any, name: str) -> ParamEntry:
        f = _Fields(value, name)
        e = cls(f("index", _count), f("where", _one_of("swap", "memory", "none")), f("initialized", _flag),
                f("shape", _maybe(_list(_count)), None), f("dtype", _maybe(_dtype), None),
                f("numel", _maybe(_count), None), f("keys", _list(_text), ()), f("state_dtype", _dtype, None),
                f("key_dtypes", _list(_dtype), None), f("chunks", _list(Chunk.parse), ()), f("step", _number, None))
        if e.shape is not None and e.numel is not None and _product(e.shape) != e.numel:
            _fail(f"{name}.numel", f"the product of its shape {list(e.shape)}", e.numel)
        if e.key_dtypes is not None and len(e.key_dtypes) != len(e.keys):
            _fail(f"{name}.key_dtypes", f"a list of {len(e.keys)} (one per key)", list(e.key_dtypes))
        if e.where == "swap" and e.keys and e.state_dtype is None and e.key_dtypes is None:
            raise CheckpointError(f"manifest field {name}.state_dtype is missing")
        for i, c in enumerate(e.chunks):
            if c.slices is not None and len(c.slices) != len(e.keys):
                _fail(f"{name}.chunks[{i}][5]", f"a list of {len(e.keys)} (one per key)", list(c.slices))
            if e.numel is not None and c.start + c.numel > e.numel:
                _fail(f"{name}.chunks[{i}]", f"elements within the parameter's {e.numel}", c.to_json())
        return e

    @classmethod
    def offloaded(cls, index: int, shape, dtype, slot, keys, chunks, *, initialized: bool = True,
                  step: Optional[float] = None) -> ParamEntry:
        """The entry of a parameter whose state ``keys`` (of ``slot``'s, a ``state.layout`` slot) lie in
        state.bin in ``chunks``."""
        dtypes = [dtype_name(slot.dtype_of(k)) for k in keys]
        return cls(index, "swap", initialized, tuple(shape), dtype_name(dtype), _product(shape), tuple(keys),
                   dtype_name(slot.dtype), tuple(dtypes) if len(set(slot.dtypes)) > 1 else None, tuple(chunks), step)

    def state_dtypes(self) -> list:
        """The torch dtype of each state key, in ``keys`` order."""
        return [dtype_of(n) for n in (self.key_dtypes or [self.state_dtype] * len(self.keys))]

    def to_json(self) -> dict:
        out = {"index": self.index, "where": self.where, "initialized": self.initialized,
               "shape": list(self.shape) if self.shape is not None else None, "dtype": self.dtype,
               "numel": self.numel}
        if self.where != "none":
            out.update(keys=list(self.keys), state_dtype=self.state_dtype)
        if self.where == "swap":
            out["chunks"] = [c.to_json() for c in self.chunks]
        if self.key_dtypes is not None:
            out["key_dtypes"] = list(self.key_dtypes)
        if self.step is not None:
            out["step"] = self.step
        return out


@dataclass(frozen=True)
class TensorEntry:
    """A tensor of the model, by its ``state_dict`` name: the same tensor as another name (``same_as``), or
    in ``model.pt``, or ``length`` bytes at ``offset`` in ``params.bin`` with their xxh3_64."""

    name: str
    same_as: Optional[str] = None
    kind: Optional[str] = None
    shape: Optional[tuple] = None
    dtype: Optional[str] = None
    where: Optional[str] = None
    offset: Optional[int] = None
    length: Optional[int] = None
    xxh3_64: Optional[str] = None

    @classmethod
    def parse(cls, value: Any, name: str) -> TensorEntry:
        f = _Fields(value, name)
        if "same_as" in f.value:
            return cls(f("name", _text), same_as=f("same_as", _text))
        e = cls(f("name", _text), None, f("kind", _one_of("param", "buffer")), f("shape", _list(_count)),
                f("dtype", _dtype), f("where", _one_of(PARAMS_DATA, MODEL_MEMORY)))
        if e.where == PARAMS_DATA:
            e = replace(e, offset=f("offset", _count), length=f("length", _count), xxh3_64=f("xxh3_64", _text))
            if e.offset % ALIGNMENT:
                _fail(f"{name}.offset", f"a multiple of {ALIGNMENT}", e.offset)
            if e.length != _product(e.shape) * dtype_of(e.dtype).itemsize:
                _fail(f"{name}.length", f"the bytes of its shape and dtype ({list(e.shape)}, {e.dtype})", e.length)
        return e

    def to_json(self) -> dict:
        if self.same_as is not None:
            return {"name": self.name, "same_as": self.same_as}
        out = {"name": self.name, "kind": self.kind, "shape": list(self.shape), "dtype": self.dtype,
               "where": self.where}
        if self.where == PARAMS_DATA:
            out.update(offset=self.offset, length=self.length, xxh3_64=self.xxh3_64)
        return out


@dataclass(frozen=True)
class ModelSection:
    """The model's tensors in ``state_dict`` order, and the bytes of those in params.bin."""

    tensors: tuple
    offloaded_bytes: Optional[int] = None

    @classmethod
    def parse(cls, value: Any, name: str) -> ModelSection:
        f = _Fields(value, name)
        section = cls(f("tensors", _list(TensorEntry.parse)), f("offloaded_bytes", _count, None))
        names = {t.name: t for t in section.tensors}
        if len(names) != len(section.tensors):
            _fail(f"{name}.tensors", "a list of distinct names", [t.name for t in section.tensors])
        for i, t in enumerate(section.tensors):
            if t.same_as is not None and (t.same_as not in names or names[t.same_as].same_as is not None):
                _fail(f"{name}.tensors[{i}].same_as", "the name of a tensor listed with its own bytes", t.same_as)
        return section

    def source(self, name: str) -> TensorEntry:
        """The entry holding the bytes of tensor ``name`` (itself, or the one it is the same as)."""
        entry = next(t for t in self.tensors if t.name == name)
        return entry if entry.same_as is None else self.source(entry.same_as)

    def on_disk(self) -> list:
        """The entries in params.bin, by offset."""
        return sorted((t for t in self.tensors if t.where == PARAMS_DATA), key=lambda t: t.offset)

    def to_json(self) -> dict:
        out: dict = {"tensors": [t.to_json() for t in self.tensors]}
        if self.offloaded_bytes is not None:
            out["offloaded_bytes"] = self.offloaded_bytes
        return out


def _product(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def chunk_table(units, index_of: Callable[[Any], int]) -> dict:
    """Per parameter index, the :class:`Chunk` of each of its chunks in ``units`` (a ``state.layout``'s,
    in state.bin's order); ``index_of(param)`` is a parameter's index."""
    chunks_of: dict = {}
    for ui, u in enumerate(units):
        for c in u.chunks:
            row = Chunk(ui, c.start, c.numel, c.offset, c.stride, None if c.stride else tuple(c.slices))
            chunks_of.setdefault(index_of(c.slot.param), []).append(row)
    return chunks_of


def _group(value: Any, name: str) -> dict:
    f = _Fields(value, name)
    f("params", _list(_count))
    return value


# -- a process's manifest ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Manifest:
    """The manifest of one process's checkpoint in directory ``root``.

    Build one with the fields a save knows, or read one with :func:`read` (or :meth:`parse`), which checks
    it whole; :meth:`to_json` is what ``manifest.json`` holds. :meth:`path` is the only way from a file of
    the format to a path: always inside ``root``, never through a symbolic link.
    """

    optimizer: Optional[str]
    files: dict
    units: tuple = ()
    params: tuple = ()
    param_groups: tuple = ()
    step: float = 0
    steps: tuple = ()
    config: dict = field(default_factory=dict)
    buffer_size: int = 0
    threshold: Optional[int] = None
    model: Optional[ModelSection] = None
    snapshot: Optional[dict] = None
    library_version: Optional[str] = None
    torch_version: Optional[str] = None
    created: Optional[str] = None
    manifest_xxh3_64: Optional[str] = None
    version: int = FORMAT_VERSION
    root: str = field(default="", compare=False)

    @classmethod
    def new(cls, optimizer: Optional[str], *, files: dict, params: tuple = (), param_groups: list = (),
            config: dict, buffer_size: int = 0, **fields) -> Manifest:
        """A manifest a save writes: ``files`` as ``write_file`` returned them, ``param_groups`` in torch's
        layout; the step, the versions and the time filled in."""
        steps = sorted({p.step for p in params if p.step is not None})
        return cls(optimizer, {n: FileEntry(**e) for n, e in files.items()}, params=tuple(params),
                   param_groups=tuple({k: jsonable(v) for k, v in g.items()} for g in param_groups),
                   step=max(steps) if steps else 0, steps=tuple(steps), config=config, buffer_size=buffer_size,
                   library_version=__version__, torch_version=torch.__version__,
                   created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **fields)

    @classmethod
    def parse(cls, raw: Any, root: str) -> Manifest:
        """Check ``raw`` (the JSON of the manifest of checkpoint ``root``) whole and return it typed.

        Raises:
            CheckpointError: the first field that is missing, of the wrong type or out of range, named.
        """
        f = _Fields(raw, "")
        m = cls(
            version=f("version", _count), optimizer=f("optimizer", _maybe(_text), None), files=f("files", _files),
            units=f("units", _list(Unit.parse)), params=f("params", _list(ParamEntry.parse), ()),
            param_groups=f("param_groups", _list(_group), ()), step=f("step", _number, 0),
            steps=f("steps", _list(_number), ()), config=f("config", _object, {}),
            buffer_size=f("buffer_size", _count, 0), threshold=f("threshold", _count, None),
            model=f("model", ModelSection.parse, None), snapshot=f("snapshot", _object, None),
            library_version=f("library_version", _maybe(_text), None),
            torch_version=f("torch_version", _maybe(_text), None), created=f("created", _maybe(_text), None),
            manifest_xxh3_64=f("manifest_xxh3_64", _text, None), root=root)
        m._check_ranges()
        for name in m.files:
            m.path(name, must_exist=False)
        return m

    def _check_ranges(self) -> None:
        """Every index, offset and size within what it points into."""
        data = self.files.get(DATA)
        if self.units and data is None:
            raise CheckpointError(f"manifest field units lists {len(self.units)} units, and files has no {DATA}")
        for i, u in enumerate(self.units):
            if u.offset + u.length > data.bytes:
                _fail(f"units[{i}]", f"a range within {DATA}'s {data.bytes} bytes", u.to_json())
        for i, p in enumerate(self.params):
            if p.index != i:
                _fail(f"params[{i}].index", f"{i} (its place in the list)", p.index)
            sizes = [d.itemsize for d in p.state_dtypes()] if p.keys else []
            for j, c in enumerate(p.chunks):
                name = f"params[{i}].chunks[{j}]"
                if c.unit >= len(self.units):
                    raise CheckpointError(f"manifest field {name} names unit {c.unit}, and there are "
                                          f"{len(self.units)}")
                unit = self.units[c.unit]
                room = unit.nbytes if unit.nbytes is not None else unit.length
                if any(c.key_offset(k) + c.numel * size > room for k, size in enumerate(sizes)):
                    _fail(name, f"slices within unit {c.unit}'s {room} bytes", c.to_json())
        for i, g in enumerate(self.param_groups):
            for j, index in enumerate(g["params"]):
                if index >= len(self.params):
                    _fail(f"param_groups[{i}].params[{j}]", f"the index of one of the {len(self.params)} params",
                          index)
        if self.model is not None:
            for i, t in enumerate(self.model.tensors):
                where = t.where if t.same_as is None else None
                if where is not None and where not in self.files:
                    raise CheckpointError(f"manifest field model.tensors[{i}].where names {where}, and files has "
                                          f"no {where}")
                if where == PARAMS_DATA and t.offset + round_up(t.length, ALIGNMENT) > self.files[where].bytes:
                    _fail(f"model.tensors[{i}]", f"a range within {PARAMS_DATA}'s {self.files[where].bytes} bytes",
                          t.to_json())

    def path(self, name: str, *, must_exist: bool = True) -> str:
        """The path of the format's file ``name`` in this checkpoint: in its directory, under the name its
        entry records, a regular file (not a symbolic link).

        Raises:
            CheckpointError: the manifest does not list ``name``, or the file is missing (``must_exist``),
                or it is a link or not a regular file.
        """
        entry = self.files.get(name)
        if entry is None:
            raise CheckpointError(f"checkpoint {self.root} has no {name} (its manifest does not list one)")
        path = os.path.join(self.root, entry.on_disk(name))
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            if must_exist:
                raise CheckpointError(f"checkpoint {self.root} is missing {name}, which its manifest lists") from None
            return path
        if not stat.S_ISREG(st.st_mode):
            what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a regular file"
            raise CheckpointError(f"checkpoint {self.root}: its {name} ({path}) is {what}; a checkpoint's files are "
                                  "its own, so it is not read. Load another checkpoint, or replace the link by the "
                                  "file itself")
        return path

    def sized_path(self, name: str) -> str:
        """:meth:`path`, after checking the file has the size the manifest gives."""
        path = self.path(name)
        size, expected = os.stat(path).st_size, self.files[name].bytes
        if size != expected:
            raise ChecksumError(f"{path}: {size} bytes, the manifest says {expected} (truncated or extended); the "
                                "checkpoint is corrupt, load an older one")
        return path

    def holders(self, unit: int) -> list:
        """The indices of the parameters with a chunk in unit ``unit``."""
        return [p.index for p in self.params if any(c.unit == unit for c in p.chunks)]

    def to_json(self) -> dict:
        out = {"format": FORMAT, "version": self.version, "optimizer": self.optimizer, "step": self.step,
               "steps": list(self.steps), "param_groups": list(self.param_groups),
               "params": [p.to_json() for p in self.params], "config": self.config,
               "buffer_size": self.buffer_size, "units": [u.to_json() for u in self.units],
               "files": {n: e.to_json() for n, e in self.files.items()}}
        for key in ("threshold", "snapshot", "library_version", "torch_version", "created", "manifest_xxh3_64"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.model is not None:
            out["model"] = self.model.to_json()
        return out


# -- a job's manifest --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Shard:
    """A rank's shard of a job's checkpoint: its directory, its manifest's name and xxh3_64, its files."""

    rank: int
    name: str
    manifest_xxh3_64: str
    files: dict
    manifest: str = MANIFEST
    step: Optional[float] = None

    @classmethod
    def parse(cls, value: Any, name: str) -> Shard:
        f = _Fields(value, name)
        shard = cls(f("rank", _count), f("name", _text), f("manifest_xxh3_64", _text), f("files", _files),
                    f("manifest", _bare_name, MANIFEST), f("step", _number, None))
        if shard.name != shard_name(shard.rank):
            _fail(f"{name}.name", f"{shard_name(shard.rank)!r} (its rank's directory)", shard.name)
        return shard

    def to_json(self) -> dict:
        out = {"rank": self.rank, "name": self.name, "manifest": self.manifest,
               "manifest_xxh3_64": self.manifest_xxh3_64, "files": {n: e.to_json() for n, e in self.files.items()}}
        if self.step is not None:
            out["step"] = self.step
        return out


@dataclass(frozen=True)
class JobManifest:
    """The manifest of a torch.distributed job's checkpoint in directory ``root``: one shard per rank."""

    job: str
    world_size: int
    shards: tuple
    step: float = 0
    created: Optional[str] = None
    manifest_xxh3_64: Optional[str] = None
    version: int = JOB_VERSION
    root: str = field(default="", compare=False)

    @classmethod
    def parse(cls, raw: Any, root: str) -> JobManifest:
        """As :meth:`Manifest.parse`, for a job's manifest."""
        f = _Fields(raw, "")
        m = cls(version=f("version", _count), job=f("job", _text), world_size=f("world_size", _count),
                shards=f("shards", _list(Shard.parse)), step=f("step", _number, 0),
                created=f("created", _maybe(_text), None), manifest_xxh3_64=f("manifest_xxh3_64", _text, None),
                root=root)
        if len(m.shards) != m.world_size:
            raise CheckpointError(f"manifest field shards lists {len(m.shards)} shards for a world_size of "
                                  f"{m.world_size}")
        for i, s in enumerate(m.shards):
            if s.rank != i:
                _fail(f"shards[{i}].rank", f"{i} (its place in the list)", s.rank)
        return m

    def refusal(self, world: int) -> str:
        """Why this job's checkpoint does not load into a job of ``world`` ranks, and how to convert it."""
        here = "this process runs alone" if world == 1 else f"this job has {world} ranks"
        shard = os.path.join(self.root, self.shards[0].name)
        saved = self.world_size
        return (f"checkpoint {self.root} was saved by a job of {saved} ranks (one shard per rank) and {here}; a "
                f"job's checkpoint loads only into a job of the same size. Load it on every rank of a job of {saved} "
                "ranks (each rank finds its own shard). To go on with another number of ranks: where every rank "
                f"holds the whole state (DDP), load one rank's shard on every rank, load_checkpoint(opt, {shard!r}); "
                f"where the state is sharded (FSDP2), convert through torch.distributed.checkpoint: on {saved} ranks "
                "load this checkpoint and dcp.save({'optim': get_optimizer_state_dict(model, opt)}, ...), then on "
                "the new ranks dcp.load it and set_optimizer_state_dict(model, opt, ...), which reshards")

    def to_json(self) -> dict:
        out = {"format": JOB_FORMAT, "version": self.version, "job": self.job, "world_size": self.world_size,
               "step": self.step, "shards": [s.to_json() for s in self.shards]}
        for key in ("created", "manifest_xxh3_64"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


# -- from disk ---------------------------------------------------------------------------------------

def raw_manifest(directory: str, name: str = MANIFEST) -> Any:
    """The JSON in ``directory/name``, unchecked; None if there is none or it does not parse."""
    try:
        with open(os.path.join(directory, name), "rb") as f:
            return json.loads(f.read())
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError, ValueError):
        return None


def parse(raw: Any, root: str, where: str) -> Manifest | JobManifest:
    """Check ``raw`` (the JSON read from ``where``, the manifest of checkpoint ``root``): its format, its
    version, its own checksum, then its whole shape (:meth:`Manifest.parse`, :meth:`JobManifest.parse`).

    Raises:
        CheckpointError: not a manifest of ours, a version this library does not read, or a field
            wrong (named); ``ChecksumError``: its checksum does not hold.
    """
    kind = raw.get("format") if isinstance(raw, dict) else None
    if kind not in (FORMAT, JOB_FORMAT):
        raise CheckpointError(f"{where} is not an nvme-offload checkpoint manifest")
    version = JOB_VERSION if kind == JOB_FORMAT else FORMAT_VERSION
    if raw.get("version") != version:
        raise CheckpointError(f"{where} has format version {raw.get('version')!r}; this library reads version "
                              f"{version}. Load it with the nvme-offload version that saved it (a newer one, if its "
                              "version is higher), or load another checkpoint")
    found = digest(raw)
    if found != raw.get("manifest_xxh3_64"):
        raise ChecksumError(f"{where}: xxh3_64 of its content is {found}, it records "
                            f"{raw.get('manifest_xxh3_64')}; the manifest is corrupt")
    try:
        return (JobManifest if kind == JOB_FORMAT else Manifest).parse(raw, root)
    except CheckpointError as err:
        raise CheckpointError(f"{where}: {err}; the checkpoint is damaged or was edited: load another one") from None


def read(directory: str) -> Manifest | JobManifest:
    """The manifest of checkpoint ``directory`` (absolute), parsed and checked (:func:`parse`). A job's
    shard has the manifest its job manifest names; anything else ``manifest.json``.

    Raises:
        FileNotFoundError: no such directory.
        CheckpointError: no manifest (no save of ours finished there), or one :func:`parse` refuses.
    """
    if not os.path.isdir(directory):
        raise FileNotFoundError(_errno.ENOENT, "no checkpoint directory", directory)
    path = os.path.join(directory, _manifest_name(directory))
    try:
        with open(path, "rb") as f:
            text = f.read()
    except FileNotFoundError:
        raise CheckpointError(f"{directory} is not a complete checkpoint (no {MANIFEST}); a save commits by "
                              f"writing its {MANIFEST} last, so no save of ours finished here") from None
    except OSError as err:
        raise io_error(err, path, "cannot read") from err
    try:
        raw = json.loads(text)
    except ValueError as err:
        raise ChecksumError(f"{path} is not valid JSON ({err}); the checkpoint is corrupt") from None
    return parse(raw, directory, path)


def read_process(directory: str) -> Manifest:
    """:func:`read` of a checkpoint that must be one process's, not a job's.

    Raises:
        CheckpointError: it is a job's (the message says how to load it), or :func:`read` refuses it.
    """
    manifest = read(directory)
    if isinstance(manifest, JobManifest):
        raise CheckpointError(manifest.refusal(1))
    return manifest


def _manifest_name(directory: str) -> str:
    """A job's shard's manifest is named by the job manifest in the directory above (a save writes it under
    the job's generation); a name that is not a bare file name there is ignored."""
    parent, name = os.path.split(directory)
    job = raw_manifest(parent)
    if SHARD_NAME.match(name) and isinstance(job, dict) and job.get("format") == JOB_FORMAT:
        for entry in job.get("shards") if isinstance(job.get("shards"), list) else ():
            if isinstance(entry, dict) and entry.get("name") == name:
                try:
                    return _bare_name(entry.get("manifest", MANIFEST), "manifest")
                except CheckpointError:
                    break
    return MANIFEST
