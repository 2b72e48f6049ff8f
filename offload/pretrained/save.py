"""A model as a Hugging Face checkpoint directory (config.json, sharded safetensors and their index), written
one tensor at a time and committed by one rename."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import secrets
import stat
import struct
import warnings
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import torch
import xxhash
from torch import nn

from ..aio import AppendFile, Engine, create_private
from ..buffers import BufferPool
from ..commit import fsync_fd, fsync_path, is_staged, make_dirs, rename, replace_file
from ..config import AioConfig
from ..errors import CheckpointError, StateError
from ..interrupts import deferred
from ..locks import LOCK_FILE, lock_directory
from ..modes import dir_mode, file_mode
from ..params import store_of
from ..pipeline import Pipeline
from ..progress import progress as progress_bar
from ..regular import SMALL_FILE_LIMIT, read_regular
from ..sizes import parse_size
from .files import (
    INDEX,
    MARKER,
    RECORD,
    RECORD_FORMAT,
    SINGLE,
    STAGING,
    _finish,
    _regular,
    _settle,
    _sweep,
    _unlink,
    dtype_name,
    read_record,
)
from .load import _named

__all__ = ["Tensor", "save_into", "save_pretrained", "saved_dtype", "write_checkpoint", "write_dtype"]

_DEFAULT_SHARD = "5GB"  # Hugging Face's default max_shard_size


@dataclass
class Tensor:
    """One tensor to save: its name, shape, dtype, and ``write(f)``, which writes its bytes to the open file."""

    name: str
    shape: tuple
    dtype: torch.dtype
    write: Callable = None

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's data."""
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass
class _Shard:
    tensors: list = field(default_factory=list)
    nbytes: int = 0


def _shards(tensors: list[Tensor], max_shard_size: int) -> list[_Shard]:
    """Tensors in order, a new shard when the next would take this one past ``max_shard_size`` (a tensor
    larger than that gets a shard of its own), as Hugging Face shards."""
    shards = [_Shard()]
    for t in tensors:
        if shards[-1].tensors and shards[-1].nbytes + t.nbytes > max_shard_size:
            shards.append(_Shard())
        shards[-1].tensors.append(t)
        shards[-1].nbytes += t.nbytes
    return shards


def _header(tensors: list[Tensor], record: Optional[dict] = None) -> bytes:
    """The safetensors header (its 8-byte length first): the tensors back to back in the given order,
    padded with spaces to a multiple of 8 bytes as the format's writers do; ``record`` (a save's, see
    ``RECORD``) in its metadata, as a JSON string (the format's metadata holds strings)."""
    meta: dict = {"__metadata__": {"format": "pt"}}
    if record is not None:
        meta["__metadata__"][RECORD] = json.dumps(record, sort_keys=True)
    offset = 0
    for t in tensors:
        meta[t.name] = {"dtype": dtype_name(t.dtype), "shape": list(t.shape),
                        "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(meta, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


# NOTE: a Hugging Face save writes into its directory, which may hold other files (a training run's output:
# tokenizer, arguments) and a save of ours before it. What it may delete or replace is only what a save of
# ours wrote, as that save recorded it: the record (RECORD: its generation, its files, the checksums of its
# config files) lives inside the file loaders start from, the save's entry point (model.safetensors' header
# metadata, or the index's metadata), so a committed save and its record change in one rename. Never a file a
# name pattern merely matches, never a directory. The steps, under the directory's lock:
#   1. sweep what a save cut short left (below), then read the record of the save in place (the previous one);
#   2. write every file into a staging directory inside the target (.nvme-offload-save.<generation>, 0700)
#      with its marker (what will move in, the entry point, the previous files that become obsolete), fsync;
#   3. move the shards in (fresh names where the usual ones are taken: nothing reads them yet), then the
#      config files (a replaced one keeps a hard link in the staging directory until the commit), fsync;
#   4. commit: rename the entry point in (a new index behind an old model.safetensors commits when that file,
#      which loaders read first, is deleted: so a save into a directory refuses a model.safetensors its
#      previous record does not list), fsync; a Ctrl-C during 3 and 4 is held off until 4 is done;
#   5. delete the previous save's files the new one does not have, then the staging directory.
# A crash before 4 leaves the previous save (config files of the new one may stand beside its weights until
# the next load or save settles it), after 4 the new one. The next save, or load (files.settle_cut_short),
# sweeps a staging directory proven ours by its marker: it finishes a committed save's deletions, or undoes
# an uncommitted one (its moved files deleted, replaced config files restored), so what loads is one save
# whole. A save cut by an exception settles itself by the same rule (_settle), committed or not as the disk
# says. Every rename is offload.commit.rename (over a regular file or nothing).
def _hexdigest(path: str) -> str:
    return xxhash.xxh3_64(read_regular(path, limit=SMALL_FILE_LIMIT)).hexdigest()


def _listing(names: Iterable[str]) -> str:
    names = sorted(names)
    return ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")


def _check_target(directory: str, previous: Optional[dict], overwrite: bool, into: bool, writes: set) -> None:
    """Refuse a target that holds what this save may not replace (see :func:`write_checkpoint`)."""
    names = {n for n in os.listdir(directory) if n != LOCK_FILE and not n.startswith(STAGING)}
    if not names:
        return
    ours = set(previous["files"]) if previous is not None else set()
    if not (overwrite or into):
        raise CheckpointError(f"{directory} exists and is not empty; choose a new directory, or pass overwrite=True "
                              "(--overwrite) to replace a Hugging Face checkpoint this library saved there")
    # Into a directory: what this save replaces, and a model.safetensors its index would delete (loaders read
    # that file first), must be ours.
    replaced = writes | ({SINGLE} if INDEX in writes else set())
    theirs = names - ours if not into else {n for n in replaced & names if n not in ours}
    if theirs:
        raise CheckpointError(
            f"{directory} holds {_listing(theirs)}, which no save of this library wrote there (its record, in "
            f"{SINGLE} or {INDEX}, does not list them; saves of versions before the record are not known either); "
            "not replacing or deleting them: move them out of the directory, or save to another one")


def write_checkpoint(directory: str | os.PathLike, tensors: Iterable[Tensor], *,
                     max_shard_size: int | str = _DEFAULT_SHARD, extra: Optional[Callable[[str], None]] = None,
                     overwrite: bool = False, aio: Optional[AioConfig] = None, into: bool = False,
                     progress: Optional[bool] = None) -> str:
    """Write ``tensors`` as a Hugging Face safetensors checkpoint in ``directory``, committed as a whole.

    Every file is written and fsynced in a staging directory inside ``directory``, then moved in; one rename
    (of ``model.safetensors`` or of the index) commits the save, and only then are the previous save's files
    it replaces deleted (see the note above ``RECORD``). A crash at any point leaves the previous save or
    this one, never a mix that loads; the next save clears what was left. Tensors are written one at a
    time by their ``write``.

    Args:
        directory: the checkpoint directory: new or empty; with ``overwrite``, one that holds a save of this
            library and nothing else; with ``into``, one that may hold other files too (never touched).
        tensors: what to save, in order.
        max_shard_size: bytes per shard at most (``"5GB"``, ``"500MiB"`` or an int); one shard is
            ``model.safetensors``, several are ``model-0000i-of-0000n.safetensors`` with
            ``model.safetensors.index.json``.
        extra: ``extra(tmp_dir)`` writes more files (config.json) for the save before the commit.
        overwrite: replace a save of this library at ``directory``.
        aio: the engine settings the shards are written with (``o_direct`` among them); the defaults if None.
        into: save into a directory holding other files (a training run's output): only the files a previous
            save of ours recorded are replaced or deleted, and a file of the name this save writes (or a
            ``model.safetensors`` its index would replace) that it did not record is refused.
        progress: a progress bar on stderr (bytes written) for a save that lasts; None: where stderr is a
            terminal (see :mod:`offload.progress`).

    Returns:
        ``directory``, absolute.

    Raises:
        CheckpointError: ``directory`` holds what this save may not replace (named).
        OSError: writing failed; ``directory`` holds the previous save as it was.
    """
    directory = os.path.abspath(os.fspath(directory))
    limit = parse_size(max_shard_size)
    if limit <= 0:
        raise ValueError(f"max_shard_size must be positive, got {max_shard_size!r}")
    if os.path.lexists(directory) and (not os.path.isdir(directory) or os.path.islink(directory)):
        raise CheckpointError(f"{directory} exists and is not a directory; choose another path for the checkpoint")
    made = make_dirs(directory)
    try:
        held = lock_directory(directory, exclusive=True)
    except BaseException:
        if made:
            with contextlib.suppress(OSError):
                os.rmdir(directory)
        raise
    try:
        _sweep(directory)
        previous = read_record(directory)
        _check_target(directory, previous, overwrite, into, set())
        _Save(directory, previous, limit, aio, overwrite, into, made, progress).run(list(tensors), extra)
    finally:
        held.release()
    return directory


class _Save:
    """One save into ``directory`` (see :func:`write_checkpoint`)."""

    def __init__(self, directory: str, previous: Optional[dict], limit: int, aio, overwrite: bool, into: bool,
                 made: bool, progress: Optional[bool] = None):
        self.directory, self.previous, self.limit, self.aio = directory, previous, limit, aio
        self.overwrite, self.into, self.made, self.progress = overwrite, into, made, progress
        self.generation = secrets.token_hex(8)
        self.stage = os.path.join(directory, STAGING + self.generation)
        self.committed = False
        self.shard_names: list[str] = []
        self.obsolete: list[str] = []
        self.files: list[str] = []  # what the save writes, as its record lists it
        self.config: list[str] = []
        self.entry: Optional[str] = None  # SINGLE or INDEX, once known
        self.adding: list[str] = []  # config files the directory does not have yet
        self.replacing: list[str] = []  # config files it has, with other bytes

    def run(self, tensors: list, extra) -> None:
        os.mkdir(self.stage, dir_mode())
        try:
            self._mark(entry=None)  # from here the staging directory is provably ours
            fsync_path(self.directory)
            self._write(tensors, extra)
            # A Ctrl-C from here to the commit is delivered once the commit is done (nothing in it is a safe point).
            with deferred():
                self._move_in()
                self._commit()
        except BaseException:
            self._unwind()
            raise
        try:
            _finish(self.directory, self.stage, self.obsolete, self.files)
        except OSError as err:  # committed: what is left is swept by the next save
            warnings.warn(f"saved {self.directory}, but could not delete what it replaced: {err}", RuntimeWarning,
                          stacklevel=4)

    def _write(self, tensors: list, extra) -> None:
        if extra is not None:
            extra(self.stage)
        self.config = sorted(n for n in os.listdir(self.stage)
                             if n != MARKER and not is_staged(n, MARKER) and _regular(os.path.join(self.stage, n)))
        for name in self.config:
            path = os.path.join(self.stage, name)
            # What extra() wrote (config.json): narrowed to the mode, never widened past the umask.
            os.chmod(path, stat.S_IMODE(os.lstat(path).st_mode) & file_mode())
            fsync_path(path)
        shards = _shards(tensors, self.limit)
        n = len(shards)
        names = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        if n > 1 and any(os.path.lexists(os.path.join(self.directory, s)) for s in names):
            names = [f"model-{self.generation}-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        self.entry = SINGLE if n == 1 else INDEX
        self.shard_names = [] if n == 1 else names
        writes = {self.entry, *self.shard_names, *self.config}
        _check_target(self.directory, self.previous, self.overwrite, self.into, writes)
        clash = [s for s in self.shard_names if os.path.lexists(os.path.join(self.directory, s))]
        if clash:
            raise CheckpointError(f"{self.directory} holds {_listing(clash)} already; save again")
        self.files = sorted(writes)
        record = {"format": RECORD_FORMAT, "generation": self.generation, "files": self.files,
                  "config": {c: _hexdigest(os.path.join(self.stage, c)) for c in self.config}}
        weight_map = {}
        # Direct I/O where the file system has it (see AppendFile), every shard through the same three buffers.
        with Engine(self.aio) as engine, BufferPool(3, 8 << 20) as buffers, \
                progress_bar(sum(s.nbytes for s in shards), f"saving {os.path.basename(self.directory)}",
                             nbytes=True, enabled=self.progress) as bar:
            for name, shard in zip(names, shards):
                header = _header(shard.tensors, record if n == 1 else None)
                size = len(header) + shard.nbytes  # reserved: a disk too full for this shard shows at once
                with AppendFile(os.path.join(self.stage, name), engine, buffers=buffers, size=size) as f:
                    f.write(header)  # fsynced at close
                    for t in shard.tensors:
                        start = f.tell()
                        t.write(f)
                        if f.tell() - start != t.nbytes:
                            raise CheckpointError(f"{t.name!r} wrote {f.tell() - start} bytes, not {t.nbytes}")
                        weight_map[t.name] = name
                        bar.update(t.nbytes)
        if n > 1:
            with create_private(os.path.join(self.stage, INDEX), text=True) as f:
                json.dump({"metadata": {"total_size": sum(s.nbytes for s in shards), RECORD: record},
                           "weight_map": weight_map}, f, indent=2, sort_keys=True)
                f.write("\n")
                f.flush()
                fsync_fd(f.fileno(), os.path.join(self.stage, INDEX))
        previous_files = set(self.previous["files"]) if self.previous is not None else set()
        self.obsolete = sorted(previous_files - writes)
        # Config files: new ones move in (and go again if the save dies), replaced ones keep the file they replace
        # (a hard link, put back if it dies), the same bytes stay as they are.
        self.replacing, self.adding = [], []
        for name in self.config:
            old = os.path.join(self.directory, name)
            if not _regular(old):
                self.adding.append(name)
            elif (read_regular(old, limit=SMALL_FILE_LIMIT)
                  != read_regular(os.path.join(self.stage, name), limit=SMALL_FILE_LIMIT)):
                self.replacing.append(name)
        self._mark(entry=self.entry)

    def _mark(self, *, entry: Optional[str]) -> None:
        """Write the staging directory's marker (what moves in, the entry point, what becomes obsolete), fsynced,
        in place of the one before (a fresh file renamed over it)."""
        doc = {"generation": self.generation, "entry": entry,
               "moved": [*self.shard_names, *self.adding] if entry else [], "obsolete": self.obsolete if entry else [],
               "backups": {c: c + ".replaced" for c in self.replacing} if entry else {}}
        replace_file(os.path.join(self.stage, MARKER), lambda f: f.write(json.dumps(doc).encode()))

    def _move_in(self) -> None:
        d, stage = self.directory, self.stage
        for name in [*self.shard_names, *self.adding]:  # nothing reads these names yet
            rename(os.path.join(stage, name), os.path.join(d, name))
        for name in self.replacing:
            os.link(os.path.join(d, name), os.path.join(stage, name + ".replaced"))
            fsync_path(stage)
            rename(os.path.join(stage, name), os.path.join(d, name))
        fsync_path(d)

    def _commit(self) -> None:
        d, stage = self.directory, self.stage
        rename(os.path.join(stage, self.entry), os.path.join(d, self.entry))
        if self.entry == SINGLE:
            self.committed = True  # loaders read model.safetensors first
        elif _regular(os.path.join(d, SINGLE)):
            fsync_path(d)  # the index is there for good before the file that still wins goes
            os.unlink(os.path.join(d, SINGLE))  # the previous save's (_check_target made sure its record lists it)
            self.committed = True
        else:
            self.committed = True
        fsync_path(d)

    def _unwind(self) -> None:
        """After an exception: settle the save as the disk has it (see :func:`_settle`), so that one cut right after
        its commit is finished, not undone (the previous save is gone by then); best effort, what stays is
        swept by the next save."""
        with contextlib.suppress(OSError):
            if self.committed:
                _finish(self.directory, self.stage, self.obsolete, self.files)
            else:
                _settle(self.directory, self.stage)
            if self.made and os.listdir(self.directory) in ([], [LOCK_FILE]):
                _unlink(os.path.join(self.directory, LOCK_FILE))
                os.rmdir(self.directory)  # made for this save, which left nothing


def _write_tensor(f, t: torch.Tensor) -> None:
    """Write ``t``'s bytes to ``f`` from its own memory (a CPU copy first when it is on a device)."""
    with torch._C.DisableTorchFunctionSubclass():
        d = t.detach()
        if d.device.type != "cpu" or not d.is_contiguous():
            d = d.to("cpu", memory_format=torch.contiguous_format, copy=True)
        n = d.numel() * d.element_size()
        if n:
            # Not .numpy(): a NumPy view would pin the storage, and an offloaded parameter's must be freed after.
            f.write(memoryview((ctypes.c_char * n).from_address(d.data_ptr())))


# NOTE: an offloaded weight is written from its extent through its store's own pool, block by block, reads
# running ahead of the file's writes, each block's checksum verified as it lands: nothing is fetched, so no
# memory is allocated for it (a fetch's new pages cost more than the copy) and memory stays the pool. A
# weight resident now, or in the host cache, is written from that copy, its latest. The store is held still
# (``exclusive``) for the tensor's write.
def _stream_offloaded(f, store, param: torch.Tensor) -> None:
    with store.exclusive() as buffers:
        extent, current = store.current_bytes(param)
        if current is not None:
            _write_tensor(f, current)
            return
        nbytes, unit = param.numel() * param.element_size(), store.block_bytes

        def write(k: int, buf) -> bool:
            f.write(buf.tensor[:min(unit, nbytes - k * unit)].numpy())
            return False  # nothing goes back to the swap space

        # The pipeline reads ahead as far as the pool allows and drains its reads on an error.
        Pipeline(list(buffers)).run(range(-(-nbytes // unit)), read=lambda k, buf: store.read_block(param, k, buf),
                                    process=write)


def model_tensors(model: nn.Module) -> list[Tensor]:
    """``model``'s ``state_dict`` tensors as :class:`Tensor` s: an offloaded parameter streamed from the swap
    space through its store's pool, the others written from memory. A tensor under several names (tied
    weights) is saved once, under its first name, as Hugging Face saves tied weights; ``from_pretrained``
    ties them again."""
    out = []
    for t, names in _named(model).values():
        store = store_of(t)
        if store is not None and store.error is not None:
            raise StateError(f"not saving {names[0]!r}: the offloaded weights were lost or half loaded "
                             f"({store.error}); load a checkpoint again first")

        def write(f, t=t, store=store):
            if store is None:
                _write_tensor(f, t)
            else:
                _stream_offloaded(f, store, t)

        out.append(Tensor(names[0], tuple(t.shape), t.dtype, write))
    return out


def save_pretrained(model: nn.Module, directory: str | os.PathLike, *, max_shard_size: int | str = _DEFAULT_SHARD,
                    overwrite: bool = False, into: bool = False, progress: Optional[bool] = None) -> str:
    """Save ``model`` as a directory ``transformers``' ``from_pretrained`` loads as it is.

    Weights go to safetensors shards of at most ``max_shard_size`` (with ``model.safetensors.index.json``
    when there are several), one tensor at a time: an offloaded parameter streams from the swap space
    through its store's pool, each block's checksum verified, so memory holds the pool (and at most one
    weight that is not offloaded), whatever the model's size. A Hugging Face model's
    ``config`` (and ``generation_config``) are saved beside them. Tied weights are saved once, under their
    first ``state_dict`` name. The save is committed as a whole: a crash leaves the previous save or this
    one (see :func:`write_checkpoint`).

    Args:
        model: the model, offloaded with :func:`offload.offload_parameters` or not.
        directory: a new or empty directory (or, with ``overwrite``, a save of this library to replace).
        max_shard_size: bytes per shard at most (``"5GB"``, Hugging Face's default, or an int).
        overwrite: replace a save of this library already at ``directory``.
        into: save into a directory that holds other files too (see :func:`save_into`).
        progress: a progress bar on stderr; None: where stderr is a terminal.

    The config.json written says the dtype the weights are saved in (``dtype``, and ``torch_dtype`` where the
    config has that older key), so ``from_pretrained`` loads them as saved, not as the config said before.

    Returns:
        ``directory``, absolute.

    Raises:
        CheckpointError: ``directory`` holds what this save may not replace (named).
        StateError: offloaded weights were lost (a failed load or write-back), or changed on disk.
        OSError: writing failed; nothing at ``directory`` changed.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"save_pretrained expects a torch.nn.Module, got {type(model).__name__}")

    tensors = model_tensors(model)

    def extra(tmp: str) -> None:
        for attr in ("config", "generation_config"):
            obj = getattr(model, attr, None)
            if obj is not None and callable(getattr(obj, "save_pretrained", None)):
                obj.save_pretrained(tmp)
        write_dtype(os.path.join(tmp, "config.json"), saved_dtype(tensors))

    # The shards are written with the aio settings the model's weights were offloaded with (o_direct among them).
    stores = [s for s in (store_of(p) for p in model.parameters()) if s is not None]
    return write_checkpoint(directory, tensors, max_shard_size=max_shard_size, extra=extra,
                            overwrite=overwrite, aio=stores[0].config.aio if stores else None, into=into,
                            progress=progress)


def save_into(model: nn.Module, directory: str | os.PathLike, *, max_shard_size: int | str = _DEFAULT_SHARD) -> str:
    """:func:`save_pretrained` into a directory that may hold other files (a training run's output, as
    ``Trainer.save_model`` writes it), committed as a whole (see :func:`write_checkpoint`): only the files a
    previous save of this library recorded there are replaced or deleted; a file of a name this save writes
    (config.json, model.safetensors, ...), or a ``model.safetensors`` a sharded save's index would replace, that
    no save of ours wrote is refused before anything is written, and every other file is left as it is.

    Returns:
        ``directory``, absolute.
    """
    return save_pretrained(model, directory, max_shard_size=max_shard_size, into=True)


def saved_dtype(tensors: Iterable[Tensor]) -> Optional[torch.dtype]:
    """The floating-point dtype most of ``tensors``' floating elements have (what a config's ``dtype`` says of a
    checkpoint), or None without floating tensors."""
    count: dict = {}
    for t in tensors:
        if t.dtype.is_floating_point:
            count[t.dtype] = count.get(t.dtype, 0) + t.nbytes // t.dtype.itemsize
    return max(count, key=count.get) if count else None


# NOTE: transformers loads a checkpoint in the dtype its config.json names (``dtype``; ``torch_dtype`` before
# transformers 4.56) when asked for "auto", and model code reads it too. A config copied or saved from the model
# as it was built says what it was built as: bf16 weights exported with an fp32 config load as fp32. So the
# dtype the shards hold is written into the config, under each key it has.
def write_dtype(config_json: str, dtype: Optional[torch.dtype]) -> None:
    """Set ``dtype`` (and ``torch_dtype``, where present) in the config.json at ``config_json`` to ``dtype``'s
    name; nothing without a file or a dtype. The file keeps its other keys and their order."""
    if dtype is None or not os.path.isfile(config_json):
        return
    with open(config_json, encoding="utf-8") as f:
        doc = json.load(f)
    if not isinstance(doc, dict):
        return
    name = str(dtype).removeprefix("torch.")
    doc["dtype"] = name
    if "torch_dtype" in doc:
        doc["torch_dtype"] = name
    with open(config_json, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2, sort_keys=False)
        f.write("\n")
