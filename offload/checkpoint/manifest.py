"""A checkpoint's manifest: the file (where a directory's is, its JSON, its format, version and own checksum)
and its content as frozen dataclasses, parsed and checked whole once, when it is read, before anything uses
it (what is refused: docs/checkpoint.md, "What a manifest may say"); written by the same classes with one
``to_json``. So nothing read from a manifest can make a load read or write outside the checkpoint.
"""

from __future__ import annotations

import datetime
import errno as _errno
import json
import math
import os
import re
import stat
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import torch
import xxhash

from .. import codes
from .._version import __version__
from ..config.rules import MAX_BLOCK_SIZE
from ..distributed import Box, local, local_box
from ..errors import CheckpointError, ChecksumError
from ..regular import FileTooLargeError, NotRegularFileError, read_regular
from ..sizes import ALIGNMENT, MIB
from .fields import (
    RULES,
    Entry,
    bare_name,
    check_value,
    count,
    dtype_value,
    fail,
    flag,
    json_field,
    json_object,
    list_of,
    maybe,
    memory_holds,
    number,
    one_of,
    string,
)
from .format import (
    DATA,
    FILE_NAMES,
    FORMAT,
    FORMAT_VERSION,
    JOB_FORMAT,
    JOB_VERSION,
    MANIFEST,
    MEMORY,
    MODEL_MEMORY,
    PARAMS_DATA,
    PIECES_VERSION,
    dtype_name,
    dtype_of,
    io_error,
    jsonable,
    read_torch,
)

SHARD_NAME = re.compile(r"^rank-(\d{5,})$")


def shard_name(rank: int) -> str:
    """The directory of ``rank``'s shard inside a job's checkpoint."""
    return f"rank-{rank:05d}"


def digest(body: dict) -> str:
    """The xxh3_64 a manifest records of itself: over its JSON without the ``manifest_xxh3_64`` field."""
    body = {k: v for k, v in body.items() if k != "manifest_xxh3_64"}
    return xxhash.xxh3_64(json.dumps(body, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class FileEntry(Entry):
    """A file of the checkpoint: its size and xxh3_64, and its name on disk (``file``; the first format
    wrote each file under its fixed name and recorded none)."""

    bytes: int = json_field(count, required=True)
    # Null only for state.bin whose units' checksums cover the whole file (fields.units_cover_data): a clone
    # takes them from the optimizer's store, and no pass over the file in order computes its own.
    xxh3_64: Optional[str] = json_field(maybe(string), required=True, null=True)
    file: Optional[str] = json_field(bare_name, None)

    def on_disk(self, name: str) -> str:
        """The file's name in the checkpoint directory (``name``, the format's, where none is recorded)."""
        return self.file or name


def _files(value: Any, name: str) -> dict:
    json_object(value, name)
    for key in value:
        if key not in FILE_NAMES:
            fail(f"{name}[{key!r}]", "one of the format's files (" + ", ".join(FILE_NAMES) + ")", key)
    entries = {key: FileEntry.parse(v, f"{name}[{key!r}]") for key, v in value.items()}
    for key, entry in entries.items():
        if entry.xxh3_64 is None and key != DATA:
            fail(f"{name}[{key!r}].xxh3_64", f"a string (only {DATA}'s may be null)", None)
    return entries


PIECE_MIN, PIECE_MAX = ALIGNMENT, MAX_BLOCK_SIZE  # the engine's piece sizes: what aio.block_size accepts
piece_size = check_value(f"a piece size: a multiple of {PIECE_MIN} from {PIECE_MIN} to {PIECE_MAX}",
                         lambda v: isinstance(v, int) and not isinstance(v, bool) and PIECE_MIN <= v <= PIECE_MAX
                         and v % PIECE_MIN == 0)


@dataclass(frozen=True)
class Unit(Entry):
    """A unit of state.bin: ``length`` bytes (padded with zeros) at ``offset``, ``nbytes`` of them state, and
    a checksum of all ``length`` bytes: their xxh3_64, or with ``pieces`` the engine's checksum
    (:class:`offload.aio.PieceDigest`): the xxh3_64 of the xxh3_64s of consecutive ``pieces``-byte pieces
    of them (the last one shorter), as 64-bit little-endian words."""

    offset: int = json_field(count, required=True)
    length: int = json_field(count, required=True)
    nbytes: Optional[int] = json_field(count, None)
    xxh3_64: Optional[str] = json_field(string, None)
    pieces: Optional[int] = json_field(piece_size, None)

    def check(self, name: str) -> None:
        """Refuse a range not aligned to the direct-I/O alignment, more state bytes than the range holds, or a
        piece size without the checksum it is the size of."""
        if self.offset % ALIGNMENT or self.length % ALIGNMENT:
            fail(name, f"a range aligned to {ALIGNMENT} bytes", self.to_json())
        if self.nbytes is not None and self.nbytes > self.length:
            fail(f"{name}.nbytes", f"at most its length {self.length}", self.nbytes)
        if self.pieces is not None:
            self.require(name, "xxh3_64")


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
        """Read a chunk from its JSON list ``value`` (field ``name``), checking every number."""
        if not isinstance(value, list) or len(value) not in (5, 6):
            fail(name, "a list of 5 numbers (and the keys' offsets)", value)
        numbers = [count(v, f"{name}[{i}]") for i, v in enumerate(value[:5])]
        return cls(*numbers, list_of(count)(value[5], f"{name}[5]") if len(value) == 6 else None)

    def key_offset(self, k: int) -> int:
        """Byte offset of state key ``k``'s slice within the unit."""
        return self.offset + (self.slices[k] if self.slices is not None else k * self.stride)

    def to_json(self) -> list:
        """The chunk as the manifest's JSON holds it: ``[unit, start, numel, offset, stride]`` (and ``slices``)."""
        row = [self.unit, self.start, self.numel, self.offset, self.stride]
        return row + [list(self.slices)] if self.slices is not None else row


@dataclass(frozen=True)
class LocalPart(Entry):
    """The part of a tensor the rank that saved it held (its local shard, in the flat element order of
    that shard): ``shape`` elements along each dimension of the full tensor from ``offsets``, or where
    ``offsets`` is null a layout that is no such box (a DTensor placed otherwise than by ``Shard`` and
    ``Replicate``). A plain tensor's is the whole of it."""

    shape: tuple = json_field(list_of(count), required=True)
    offsets: Optional[tuple] = json_field(maybe(list_of(count)), None, required=True, null=True)

    @classmethod
    def of(cls, t: torch.Tensor) -> LocalPart:
        """The part of ``t`` this rank holds (its local shard if a DTensor)."""
        box = local_box(t)
        return cls(tuple(local(t).shape), None) if box is None else cls(box.shape, box.offsets)

    @property
    def box(self) -> Optional[Box]:
        """As a :class:`offload.distributed.Box`, or None where it is none."""
        return None if self.offsets is None else Box(tuple(self.offsets), tuple(self.shape))

    @property
    def numel(self) -> int:
        """Elements in the part."""
        return math.prod(self.shape)

    def check_within(self, shape: Optional[tuple], name: str) -> None:
        """Refuse a part that does not lie inside a tensor of ``shape`` (None: unknown)."""
        if shape is None:
            return
        if len(self.shape) != len(shape) or (self.offsets is not None and not self.box.within(shape)):
            fail(name, f"a part of a tensor of shape {list(shape)}", self.to_json())


@dataclass(frozen=True)
class ParamEntry(Entry):
    """A parameter of the optimizer (by its index in the param groups) and where its state is: ``swap``
    (state.bin, by ``chunks``), ``memory`` (memory.pt) or ``none``."""

    index: int = json_field(count, required=True)
    where: str = json_field(one_of("swap", "memory", "none"), required=True)
    initialized: bool = json_field(flag, required=True)
    shape: Optional[tuple] = json_field(maybe(list_of(count)), None, null=True)
    dtype: Optional[str] = json_field(maybe(dtype_value), None, null=True)
    numel: Optional[int] = json_field(maybe(count), None, null=True)
    keys: tuple = json_field(list_of(string), ())
    state_dtype: Optional[str] = json_field(dtype_value, None)
    key_dtypes: Optional[tuple] = json_field(list_of(dtype_value), None)
    chunks: tuple = json_field(list_of(Chunk.parse), ())
    step: Optional[float] = json_field(number, None)
    # The part of the parameter the saving rank held, whose elements the chunks and memory.pt's state
    # hold; absent in checkpoints saved before it was recorded (reshard.with_parts: then the whole where the
    # rank held all of it, else unknown).
    local: Optional[LocalPart] = json_field(LocalPart.parse, None)

    @classmethod
    def offloaded(cls, index: int, shape, dtype, saved, *, initialized: Optional[bool] = None,
                  step: Optional[float] = None, local: Optional[LocalPart] = None) -> ParamEntry:
        """The entry of a parameter whose state lies in state.bin as ``saved`` (a save plan's
        :class:`offload.state.plans.SavedParam`) says (``initialized``: as ``saved`` says where None)."""
        dtypes = None if saved.key_dtypes is None else tuple(dtype_name(d) for d in saved.key_dtypes)
        chunks = tuple(Chunk(*row) for row in saved.chunks)
        initialized = saved.initialized if initialized is None else initialized
        return cls(index, "swap", initialized, tuple(shape), dtype_name(dtype), math.prod(shape),
                   tuple(saved.keys), dtype_name(saved.state_dtype), dtypes, chunks, step, local)

    def check(self, name: str) -> None:
        """Refuse a ``numel`` that is not the product of the shape, and a list of dtypes or of slice offsets
        that does not hold one per state key."""
        if self.shape is not None and self.numel is not None and math.prod(self.shape) != self.numel:
            fail(f"{name}.numel", f"the product of its shape {list(self.shape)}", self.numel)
        if self.key_dtypes is not None and len(self.key_dtypes) != len(self.keys):
            fail(f"{name}.key_dtypes", f"a list of {len(self.keys)} (one per key)", list(self.key_dtypes))
        if self.keys and self.key_dtypes is None:
            self.require(name, "state_dtype")
        if self.local is not None:
            self.local.check_within(self.shape, f"{name}.local")
        held = self.local.numel if self.local is not None else self.numel
        for i, c in enumerate(self.chunks):
            if c.slices is not None and len(c.slices) != len(self.keys):
                fail(f"{name}.chunks[{i}][5]", f"a list of {len(self.keys)} (one per key)", list(c.slices))
            if held is not None and c.start + c.numel > held:
                fail(f"{name}.chunks[{i}]", f"elements within the {held} of the parameter saved here", c.to_json())

    def state_dtypes(self) -> list:
        """The torch dtype of each state key, in ``keys`` order."""
        return [dtype_of(n) for n in (self.key_dtypes or [self.state_dtype] * len(self.keys))]

    def value_keys(self) -> list:
        """The keys of its state in torch's layout: the moments (and master), not the absmax of 8-bit codes."""
        return [k for k in self.keys if not k.endswith(codes.ABSMAX)]

    def values(self, c: Chunk, key: str, unit: torch.Tensor) -> torch.Tensor:
        """State ``key`` of chunk ``c`` as values (8-bit codes dequantized to fp32), from ``unit``, the bytes of
        the unit ``c`` lies in (a uint8 tensor from its first byte)."""
        k = self.keys.index(key)
        dtype = self.state_dtypes()[k]
        at = c.key_offset(k)
        raw = unit[at: at + codes.elements(key, c.numel) * dtype.itemsize].view(dtype)
        if dtype != torch.uint8:
            return raw
        absmax = self.values(c, key + codes.ABSMAX, unit)
        return codes.dequantize(raw, absmax, signed=codes.signed_for(key))


@dataclass(frozen=True)
class TensorEntry(Entry):
    """A tensor of the model, by its ``state_dict`` name: the same tensor as another name (``same_as``), or
    in ``model.pt``, or ``length`` bytes at ``offset`` in ``params.bin`` with their xxh3_64."""

    name: str = json_field(string, required=True)
    same_as: Optional[str] = json_field(string, None)
    kind: Optional[str] = json_field(one_of("param", "buffer"), None)
    shape: Optional[tuple] = json_field(list_of(count), None)
    dtype: Optional[str] = json_field(dtype_value, None)
    where: Optional[str] = json_field(one_of(PARAMS_DATA, MODEL_MEMORY), None)
    offset: Optional[int] = json_field(count, None)
    length: Optional[int] = json_field(count, None)
    xxh3_64: Optional[str] = json_field(string, None)
    # The optimizer's index of this parameter (its ``params`` entry), when saved beside the optimizer's state:
    # what names the state, so the fp32 masters can be exported by parameter name.
    param: Optional[int] = json_field(count, None)
    # The part of the tensor the saving rank held (ParamEntry.local): what model.pt holds of a DTensor.
    local: Optional[LocalPart] = json_field(LocalPart.parse, None)

    def check(self, name: str) -> None:
        """Refuse bytes of its own in a tied tensor, and a tensor without its kind, shape, dtype and place (or,
        in params.bin, without an aligned range as long as its shape and dtype make it)."""
        if self.same_as is not None:
            for extra in ("where", "offset", "length", "xxh3_64"):
                if getattr(self, extra) is not None:
                    fail(f"{name}.{extra}", f"absent: a tied tensor (same_as {self.same_as!r}) has no bytes of its "
                          "own", getattr(self, extra))
            return
        self.require(name, "kind", "shape", "dtype", "where")
        if self.local is not None:
            self.local.check_within(self.shape, f"{name}.local")
            if self.where == PARAMS_DATA and self.local.box != Box.whole(self.shape):
                fail(f"{name}.local", f"the whole tensor (its bytes in {PARAMS_DATA} are all of it)",
                     self.local.to_json())
        if self.where == PARAMS_DATA:
            self.require(name, "offset", "length", "xxh3_64")
            if self.offset % ALIGNMENT:
                fail(f"{name}.offset", f"a multiple of {ALIGNMENT}", self.offset)
            if self.length != math.prod(self.shape) * dtype_of(self.dtype).itemsize:
                fail(f"{name}.length", f"the bytes of its shape and dtype ({list(self.shape)}, {self.dtype})",
                      self.length)


@dataclass(frozen=True)
class ModelSection(Entry):
    """The model's tensors in ``state_dict`` order, and the bytes of those in params.bin."""

    tensors: tuple = json_field(list_of(TensorEntry.parse), (), required=True)
    offloaded_bytes: Optional[int] = json_field(count, None)

    def check(self, name: str) -> None:
        """Refuse a name listed twice, and a tied tensor whose ``same_as`` names no tensor with bytes of its own."""
        names = {t.name: t for t in self.tensors}
        if len(names) != len(self.tensors):
            fail(f"{name}.tensors", "a list of distinct names", [t.name for t in self.tensors])
        for i, t in enumerate(self.tensors):
            if t.same_as is not None and (t.same_as not in names or names[t.same_as].same_as is not None):
                fail(f"{name}.tensors[{i}].same_as", "the name of a tensor listed with its own bytes", t.same_as)

    def source(self, name: str) -> TensorEntry:
        """The entry holding the bytes of tensor ``name`` (itself, or the one it is the same as)."""
        entry = next(t for t in self.tensors if t.name == name)
        return entry if entry.same_as is None else self.source(entry.same_as)

    def on_disk(self) -> list:
        """The entries in params.bin, by offset."""
        return sorted((t for t in self.tensors if t.where == PARAMS_DATA), key=lambda t: t.offset)


def _group(value: Any, name: str) -> dict:
    list_of(count)(json_object(value, name).get("params"), f"{name}.params")
    return value


# -- the manifests -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Manifest(Entry):
    """The manifest of one process's checkpoint in directory ``root``: made by a save (:meth:`new`) or read
    (:func:`read`). :meth:`path` is the only way from a file of the format to a path: always inside
    ``root``, never through a symbolic link."""

    optimizer: Optional[str] = json_field(maybe(string), None, null=True)
    files: dict = json_field(_files, {}, required=True)
    units: tuple = json_field(list_of(Unit.parse), (), required=True)
    params: tuple = json_field(list_of(ParamEntry.parse), ())
    param_groups: tuple = json_field(list_of(_group), ())
    step: float = json_field(number, 0)
    steps: tuple = json_field(list_of(number), ())
    config: dict = json_field(json_object, {})
    buffer_size: int = json_field(count, 0)
    threshold: Optional[int] = json_field(count, None)
    model: Optional[ModelSection] = json_field(ModelSection.parse, None)
    snapshot: Optional[dict] = json_field(json_object, None)
    library_version: Optional[str] = json_field(maybe(string), None)
    torch_version: Optional[str] = json_field(maybe(string), None)
    created: Optional[str] = json_field(maybe(string), None)
    manifest_xxh3_64: Optional[str] = json_field(string, None)
    format: str = json_field(one_of(FORMAT), FORMAT)
    version: int = json_field(count, FORMAT_VERSION)
    root: str = field(default="", compare=False)

    @classmethod
    def new(cls, optimizer: Optional[str], *, files: dict, params: tuple = (), param_groups: list = (),
            config: dict, **more) -> Manifest:
        """A manifest a save writes: ``files`` as ``format.write_file`` returned them, ``param_groups`` in
        torch's layout; the step, the versions and the time filled in."""
        steps = sorted({p.step for p in params if p.step is not None})
        manifest = cls(optimizer, {n: FileEntry(**e) for n, e in files.items()}, params=tuple(params),
                       param_groups=tuple({k: jsonable(v) for k, v in g.items()} for g in param_groups),
                       step=max(steps) if steps else 0, steps=tuple(steps), config=config,
                       library_version=__version__, torch_version=torch.__version__,
                       created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **more)
        return replace(manifest, version=PIECES_VERSION) if manifest.in_pieces else manifest

    @property
    def in_pieces(self) -> bool:
        """Whether some unit is checksummed in pieces or state.bin has no checksum of its own (what needs
        format version 2)."""
        data = self.files.get(DATA)
        return any(u.pieces is not None for u in self.units) or (data is not None and data.xxh3_64 is None)

    def check(self, name: str) -> None:
        """The rules over the whole manifest (fields.RULES), in order; a manifest is the root, so ``name``
        is not needed to name a field."""
        for rule in RULES:
            rule(self)

    def path(self, name: str, *, must_exist: bool = True) -> str:
        """The path of the format's file ``name`` in this checkpoint: in its directory, under the name its
        entry records; CheckpointError where the manifest does not list it, it is missing (``must_exist``),
        or it is a link or not a regular file."""
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

    def memory(self) -> dict:
        """memory.pt's content, checksum verified, once it is found to hold what the manifest says
        (:func:`fields.memory_holds`: CheckpointError naming the first thing missing)."""
        memory = read_torch(self.path(MEMORY), self.files[MEMORY])
        memory_holds(self, memory)
        return memory

    def holders(self, unit: int) -> list:
        """The indices of the parameters with a chunk in unit ``unit``."""
        return [p.index for p in self.params if any(c.unit == unit for c in p.chunks)]


@dataclass(frozen=True)
class Shard(Entry):
    """A rank's shard of a job's checkpoint: its directory, its manifest's name and xxh3_64, its files."""

    rank: int = json_field(count, required=True)
    name: str = json_field(string, required=True)
    manifest_xxh3_64: str = json_field(string, required=True)
    files: dict = json_field(_files, {}, required=True)
    manifest: str = json_field(bare_name, MANIFEST)
    step: Optional[float] = json_field(number, None)

    def check(self, name: str) -> None:
        """Refuse a shard whose directory is not its rank's."""
        if self.name != shard_name(self.rank):
            fail(f"{name}.name", f"{shard_name(self.rank)!r} (its rank's directory)", self.name)


@dataclass(frozen=True)
class JobManifest(Entry):
    """The manifest of a torch.distributed job's checkpoint in directory ``root``: one shard per rank."""

    job: str = json_field(string, required=True)
    world_size: int = json_field(count, required=True)
    shards: tuple = json_field(list_of(Shard.parse), (), required=True)
    step: float = json_field(number, 0)
    created: Optional[str] = json_field(maybe(string), None)
    manifest_xxh3_64: Optional[str] = json_field(string, None)
    format: str = json_field(one_of(JOB_FORMAT), JOB_FORMAT)
    version: int = json_field(count, JOB_VERSION)
    root: str = field(default="", compare=False)

    def check(self, name: str) -> None:
        """Refuse a list of shards that is not one per rank, in rank order."""
        if len(self.shards) != self.world_size:
            raise CheckpointError(f"manifest field shards lists {len(self.shards)} shards for a world_size of "
                                  f"{self.world_size}")
        for i, s in enumerate(self.shards):
            if s.rank != i:
                fail(f"shards[{i}].rank", f"{i} (its place in the list)", s.rank)

    def refusal(self) -> str:
        """Why this job's checkpoint is not read as one process's (by the tools, export, a mirror), and what
        to do instead."""
        shard = os.path.join(self.root, self.shards[0].name)
        return (f"checkpoint {self.root} was saved by a job of {self.world_size} ranks, one shard per rank, in "
                f"{self.root}/rank-<n>: read or export a rank's shard ({shard!r}). load_checkpoint loads the "
                "whole checkpoint, on any number of ranks or in one process (each rank reads its part of the "
                "parameters from the shards that hold it)")


# -- from disk ---------------------------------------------------------------------------------------

# The most bytes a manifest may hold: about 600 bytes per parameter, so over 400,000 parameters. A larger
# file is not one a save wrote (a planted one would take the memory of every reader).
MANIFEST_LIMIT = 256 * MIB


def raw_manifest(directory: str, name: str = MANIFEST) -> Any:
    """The JSON in ``directory/name``, unchecked; None if there is none, it does not parse, or it is not a
    regular file of a manifest's size (a FIFO or a device is never read)."""
    try:
        return json.loads(read_regular(os.path.join(directory, name), limit=MANIFEST_LIMIT))
    except (FileNotFoundError, NotADirectoryError, NotRegularFileError, FileTooLargeError, ValueError):
        return None


def _manifest_name(directory: str) -> str:
    """A job's shard (a directory named ``rank-<n>``) has the manifest its job manifest in the directory
    above names (a save writes it under the job's generation); anything else ``manifest.json``. A name that
    is not a bare file name there is ignored."""
    parent, name = os.path.split(directory)
    job = raw_manifest(parent) if SHARD_NAME.match(name) else None
    if isinstance(job, dict) and job.get("format") == JOB_FORMAT and isinstance(job.get("shards"), list):
        for entry in job["shards"]:
            if isinstance(entry, dict) and entry.get("name") == name:
                try:
                    return bare_name(entry.get("manifest", MANIFEST), "manifest")
                except CheckpointError:
                    break
    return MANIFEST


def parse(raw: Any, root: str, where: str) -> Manifest | JobManifest:
    """Check ``raw`` (the JSON read from ``where``, the manifest of checkpoint ``root``): its format, its
    version and its own checksum (else ``ChecksumError``), then its whole shape (CheckpointError naming
    the field)."""
    kind = raw.get("format") if isinstance(raw, dict) else None
    if kind not in (FORMAT, JOB_FORMAT):
        raise CheckpointError(f"{where} is not an nvme-offload checkpoint manifest")
    versions = (JOB_VERSION,) if kind == JOB_FORMAT else (FORMAT_VERSION, PIECES_VERSION)
    if raw.get("version") not in versions:
        raise CheckpointError(f"{where} has format version {raw.get('version')!r}; this library reads version "
                              f"{' or '.join(map(str, versions))}. Load it with the nvme-offload version that saved it "
                              "(a newer one, if its version is higher), or load another checkpoint")
    found = digest(raw)
    if found != raw.get("manifest_xxh3_64"):
        raise ChecksumError(f"{where}: xxh3_64 of its content is {found}, it records "
                            f"{raw.get('manifest_xxh3_64')}; the manifest is corrupt")
    try:
        return (JobManifest if kind == JOB_FORMAT else Manifest).parse(raw, "", root=root)
    except CheckpointError as err:
        raise CheckpointError(f"{where}: {err}; the checkpoint is damaged or was edited: load another one") from None


def read(directory: str) -> Manifest | JobManifest:
    """The manifest of checkpoint ``directory`` (absolute), parsed and checked (:func:`parse`). A job's
    shard has the manifest its job manifest names; anything else ``manifest.json``. FileNotFoundError
    where there is no such directory, CheckpointError where there is no manifest."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(_errno.ENOENT, "no checkpoint directory", directory)
    path = os.path.join(directory, _manifest_name(directory))
    try:
        text = read_regular(path, limit=MANIFEST_LIMIT)
    except FileNotFoundError:
        raise CheckpointError(f"{directory} is not a complete checkpoint (no {MANIFEST}); a save commits by "
                              f"writing its {MANIFEST} last, so no save of ours finished here") from None
    except (NotRegularFileError, FileTooLargeError) as err:
        raise CheckpointError(f"{path} is {err.strerror}: a checkpoint's manifest is a regular file its save "
                              "wrote, so this is not one of our checkpoints (or it was tampered with); load "
                              "another one") from None
    except OSError as err:
        raise io_error(err, path, "cannot read") from err
    try:
        raw = json.loads(text)
    except ValueError as err:
        raise ChecksumError(f"{path} is not valid JSON ({err}); the checkpoint is corrupt") from None
    return parse(raw, directory, path)


def read_process(directory: str) -> Manifest:
    """:func:`read` of a checkpoint that must be one process's, not a job's (CheckpointError, saying how
    to load it, for a job's)."""
    manifest = read(directory)
    if isinstance(manifest, JobManifest):
        raise CheckpointError(manifest.refusal())
    return manifest
