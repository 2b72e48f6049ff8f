"""A model as a Hugging Face checkpoint directory (config.json, sharded safetensors and their index), written
one tensor at a time and committed by one rename."""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import shutil
import stat
import struct
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import torch
from torch import nn

from ..aio import AppendFile, Engine, create_private, fsync_path
from ..buffers import BufferPool
from ..config import AioConfig
from ..errors import CheckpointError, StateError
from ..modes import dir_mode, file_mode
from ..params import store_of
from ..pipeline import Pipeline
from ..progress import progress as progress_bar
from ..units import parse_size
from .files import INDEX, SINGLE, dtype_name
from .load import _named

__all__ = ["Tensor", "save_into", "save_pretrained", "saved_dtype", "write_checkpoint", "write_dtype"]

_DEFAULT_SHARD = "5GB"  # Hugging Face's default max_shard_size
# What a Hugging Face save puts in a directory: an existing one holding only these may be replaced.
_HF_FILES = ("config.json", "generation_config.json", INDEX, SINGLE)


@dataclass
class Tensor:
    """One tensor to save: its name, shape, dtype, and ``write(f)``, which writes its bytes to the open file."""

    name: str
    shape: tuple
    dtype: torch.dtype
    write: Callable = None

    @property
    def nbytes(self) -> int:
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


def _header(tensors: list[Tensor]) -> bytes:
    """The safetensors header (its 8-byte length first): the tensors back to back in the given order,
    padded with spaces to a multiple of 8 bytes as the format's writers do."""
    meta: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        meta[t.name] = {"dtype": dtype_name(t.dtype), "shape": list(t.shape),
                        "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(meta, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _refuse(directory: str, overwrite: bool) -> None:
    """Refuse a target that holds anything, unless ``overwrite`` and all it holds is a Hugging Face save."""
    if not os.path.lexists(directory):
        return
    if not os.path.isdir(directory) or os.path.islink(directory):
        raise CheckpointError(f"{directory} exists and is not a directory; choose another path for the checkpoint")
    names = os.listdir(directory)
    if not names:
        return
    foreign = [n for n in names if not (n in _HF_FILES or (n.startswith("model-") and n.endswith(".safetensors")))]
    if not overwrite:
        raise CheckpointError(f"{directory} exists and is not empty; choose a new directory, or pass overwrite=True "
                              "(--overwrite) to replace a Hugging Face checkpoint there")
    if foreign:
        raise CheckpointError(f"{directory} holds files a Hugging Face save does not write ({', '.join(foreign[:4])}"
                              f"{', ...' if len(foreign) > 4 else ''}); not replacing it: choose another directory")


def write_checkpoint(directory: str | os.PathLike, tensors: Iterable[Tensor], *,
                     max_shard_size: int | str = _DEFAULT_SHARD, extra: Optional[Callable[[str], None]] = None,
                     overwrite: bool = False, aio: Optional[AioConfig] = None,
                     progress: Optional[bool] = None) -> str:
    """Write ``tensors`` as a Hugging Face safetensors checkpoint in ``directory``, atomically.

    Everything goes to a fresh directory beside ``directory``; each file is fsynced, then one rename
    puts it in place. Tensors are written one at a time by their ``write``.

    Args:
        directory: the checkpoint directory: new, empty, or (``overwrite``) a Hugging Face checkpoint.
        tensors: what to save, in order.
        max_shard_size: bytes per shard at most (``"5GB"``, ``"500MiB"`` or an int); one shard is
            ``model.safetensors``, several are ``model-0000i-of-0000n.safetensors`` with
            ``model.safetensors.index.json``.
        extra: ``extra(tmp_dir)`` writes more files (config.json) into the new directory before the commit.
        overwrite: replace an existing Hugging Face checkpoint (only its own kinds of files) at ``directory``.
        aio: the engine settings the shards are written with (``o_direct`` among them); the defaults if None.
        progress: a progress bar on stderr (bytes written) for a save that lasts; None: where stderr is a
            terminal (see :mod:`offload.progress`).

    Returns:
        ``directory``, absolute.

    Raises:
        CheckpointError: ``directory`` is not new or empty (and not replaceable).
        OSError: writing failed; ``directory`` is left as it was and the new files are removed.
    """
    directory = os.path.abspath(os.fspath(directory))
    limit = parse_size(max_shard_size)
    if limit <= 0:
        raise ValueError(f"max_shard_size must be positive, got {max_shard_size!r}")
    _refuse(directory, overwrite)
    parent, base = os.path.split(directory)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{base}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    os.mkdir(tmp, dir_mode())  # the user's weights: the owner's alone, as every checkpoint of ours (offload.modes)
    old = None
    try:
        shards = _shards(list(tensors), limit)
        n = len(shards)
        names = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        weight_map = {}
        # Direct I/O where the file system has it (see AppendFile), every shard through the same three buffers.
        with Engine(aio) as engine, BufferPool(3, 8 << 20) as buffers, \
                progress_bar(sum(s.nbytes for s in shards), f"saving {base}", nbytes=True, enabled=progress) as bar:
            for name, shard in zip(names, shards):
                header = _header(shard.tensors)
                size = len(header) + shard.nbytes  # reserved: a disk too full for this shard shows at once
                with AppendFile(os.path.join(tmp, name), engine, buffers=buffers, size=size) as f:  # fsynced at close
                    f.write(header)
                    for t in shard.tensors:
                        start = f.tell()
                        t.write(f)
                        if f.tell() - start != t.nbytes:
                            raise CheckpointError(f"{t.name!r} wrote {f.tell() - start} bytes, not {t.nbytes}")
                        weight_map[t.name] = name
                        bar.update(t.nbytes)
        if n > 1:
            with create_private(os.path.join(tmp, INDEX), text=True) as f:
                json.dump({"metadata": {"total_size": sum(s.nbytes for s in shards)}, "weight_map": weight_map}, f,
                          indent=2, sort_keys=True)
                f.write("\n")
        if extra is not None:
            extra(tmp)
        for name in os.listdir(tmp):
            if not os.path.islink(os.path.join(tmp, name)):
                # What extra() wrote too (config.json): narrowed to the mode, never widened past the umask.
                path = os.path.join(tmp, name)
                os.chmod(path, stat.S_IMODE(os.lstat(path).st_mode) & file_mode())
            fsync_path(os.path.join(tmp, name))
        fsync_path(tmp)
        _refuse(directory, overwrite)  # again: something may have appeared meanwhile
        if os.path.isdir(directory) and os.listdir(directory):
            old = os.path.join(parent, f".{base}.old-{os.getpid()}-{secrets.token_hex(4)}")
            os.rename(directory, old)
        os.replace(tmp, directory)  # an empty directory is replaced by the rename itself
        fsync_path(parent)
    except BaseException:
        if old is not None and not os.path.exists(directory):
            os.rename(old, directory)
            old = None
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return directory


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
        nbytes, unit = param.numel() * param.element_size(), store.unit_bytes

        def write(k: int, buf) -> bool:
            f.write(buf.tensor[:min(unit, nbytes - k * unit)].numpy())
            return False  # nothing goes back to the swap space

        # The pipeline reads ahead as far as the pool allows and drains its reads on an error.
        Pipeline(list(buffers)).run(range(-(-nbytes // unit)), read=lambda k, buf: store.read_unit(param, k, buf),
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
                    overwrite: bool = False, progress: Optional[bool] = None) -> str:
    """Save ``model`` as a directory ``transformers``' ``from_pretrained`` loads as it is.

    Weights go to safetensors shards of at most ``max_shard_size`` (with ``model.safetensors.index.json``
    when there are several), one tensor at a time: an offloaded parameter streams from the swap space
    through its store's pool, each block's checksum verified, so memory holds the pool (and at most one
    weight that is not offloaded), whatever the model's size. A Hugging Face model's
    ``config`` (and ``generation_config``) are saved beside them. Tied weights are saved once, under their
    first ``state_dict`` name. The directory is written beside ``directory`` and renamed into place when
    complete (see :func:`write_checkpoint`).

    Args:
        model: the model, offloaded with :func:`offload.offload_parameters` or not.
        directory: a new or empty directory (or, with ``overwrite``, a Hugging Face checkpoint to replace).
        max_shard_size: bytes per shard at most (``"5GB"``, Hugging Face's default, or an int).
        overwrite: replace a Hugging Face checkpoint already at ``directory``.
        progress: a progress bar on stderr; None: where stderr is a terminal.

    The config.json written says the dtype the weights are saved in (``dtype``, and ``torch_dtype`` where the
    config has that older key), so ``from_pretrained`` loads them as saved, not as the config said before.

    Returns:
        ``directory``, absolute.

    Raises:
        CheckpointError: ``directory`` exists and is not empty (or holds other files).
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
                            overwrite=overwrite, aio=stores[0].config.aio if stores else None, progress=progress)


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


def _hf_weights(name: str) -> bool:
    return name in (SINGLE, INDEX) or (name.startswith("model-") and name.endswith(".safetensors"))


def save_into(model: nn.Module, directory: str | os.PathLike, *, max_shard_size: int | str = _DEFAULT_SHARD) -> str:
    """:func:`save_pretrained` into a directory that may hold other files (a training run's output, as
    ``Trainer.save_model`` writes it): the checkpoint is written complete beside it, then each of its files
    is renamed in (replacing the same name), and weight files of an earlier save that the new one does not
    have (shards of another count) are removed. Files a Hugging Face save does not write are never touched.

    Returns:
        ``directory``, absolute.
    """
    directory = os.path.abspath(os.fspath(directory))
    if not os.path.isdir(directory) or not os.listdir(directory):
        return save_pretrained(model, directory, max_shard_size=max_shard_size)
    parent, base = os.path.split(directory)
    tmp = save_pretrained(model, os.path.join(parent, f".{base}.new-{os.getpid()}-{secrets.token_hex(4)}"),
                          max_shard_size=max_shard_size)
    try:
        written = os.listdir(tmp)
        # Shards before the index and config that name them; stale weights after the new ones are in.
        for name in sorted(written, key=lambda n: (not n.endswith(".safetensors"), n)):
            os.replace(os.path.join(tmp, name), os.path.join(directory, name))
        for name in os.listdir(directory):
            if _hf_weights(name) and name not in written:
                os.unlink(os.path.join(directory, name))
        fsync_path(directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return directory
