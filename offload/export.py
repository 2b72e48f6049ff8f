"""A checkpoint's model as a Hugging Face checkpoint: its weights as saved, or the optimizer's fp32 masters by
parameter name (what DeepSpeed's ``zero_to_fp32.py`` gives), one tensor in memory at a time.

Both verify the whole checkpoint first (every file's and every unit's checksum), then read each tensor by its
offsets under the checkpoint's read lock (no save replaces it meanwhile), each weight of params.bin checked
again against its own checksum as it passes.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

import torch
import xxhash

from .aio import create_private
from .checkpoint import ChecksumError, verify_checkpoint
from .checkpoint.commit import reading
from .checkpoint.format import DATA, MEMORY, MODEL_MEMORY, PARAMS_DATA
from .checkpoint.manifest import read_process
from .config.files import read_config_bytes
from .errors import CheckpointError
from .pretrained import write_checkpoint
from .pretrained.save import Tensor, saved_dtype, write_dtype
from .regular import CHUNK

__all__ = ["export_fp32", "export_hf"]

_HF_CONFIGS = ("config.json", "generation_config.json")


def export_hf(directory: str | os.PathLike, out: str | os.PathLike, *, config: Optional[str] = None,
              max_shard_size: int | str = "5GB", overwrite: bool = False, progress: Optional[bool] = None) -> str:
    """Write a checkpoint's model weights, as saved (their own dtypes), as a Hugging Face checkpoint in ``out``.

    Args:
        directory: the checkpoint (saved with ``model=``, or by ``save_parameters``).
        out: a new or empty directory (or, with ``overwrite``, a Hugging Face checkpoint to replace).
        config: a Hugging Face model directory whose config.json (and generation_config.json) go with the
            weights, the ``dtype`` it names set to the weights' (so ``from_pretrained`` loads them as saved).
        max_shard_size, overwrite, progress: as for :func:`offload.pretrained.write_checkpoint`.

    Returns:
        ``out``, absolute.

    Raises:
        CheckpointError: no model weights in the checkpoint, no config.json in ``config``, or a corrupt
            checkpoint (``ChecksumError`` naming the tensor).
    """
    with reading(directory) as directory:
        manifest = _verified(directory, config)
        if manifest.model is None:
            raise CheckpointError(f"checkpoint {directory} holds no model weights; save it with model=")
        reader = _ModelReader(manifest)
        tensors = [Tensor(e.name, tuple(e.shape), getattr(torch, e.dtype), reader.writer(e))
                   for e in manifest.model.tensors if e.same_as is None]
        return write_checkpoint(out, tensors, max_shard_size=max_shard_size, extra=_configs(config, tensors),
                                overwrite=overwrite, progress=progress)


def export_fp32(directory: str | os.PathLike, out: str | os.PathLike, *, config: Optional[str] = None,
                max_shard_size: int | str = "5GB", overwrite: bool = False, progress: Optional[bool] = None) -> str:
    """Write the optimizer's fp32 master weights, by parameter name, as a Hugging Face checkpoint in ``out``.

    The equivalent of DeepSpeed's ``zero_to_fp32.py``: every parameter of the model as float32. A bf16/fp16
    parameter with optimizer state gets its fp32 master copy (the weights training really holds); an fp32
    parameter's weights are its masters; a parameter the optimizer has not stepped (or does not train), and
    every floating buffer, get their saved values as float32. Names are the model's ``state_dict`` names (tied
    weights once, under their first name), so ``from_pretrained`` of ``out`` (with ``config``) loads them.

    Args:
        directory: a checkpoint saved by an optimizer with ``model=`` (which records each parameter's name).
        out, config, max_shard_size, overwrite, progress: as for :func:`export_hf`; the config's ``dtype``
            is set to float32.

    Returns:
        ``out``, absolute.

    Raises:
        CheckpointError: the checkpoint has no optimizer state, or no model (its parameters have no names), or
            is corrupt; each says what to do.
    """
    with reading(directory) as directory:
        manifest = _verified(directory, config)
        if manifest.optimizer is None:
            raise CheckpointError(f"checkpoint {directory} holds model weights only, no optimizer state and so no "
                                  "fp32 masters; export its weights as saved with offload-ckpt export --hf")
        if manifest.model is None or not any(e.param is not None for e in manifest.model.tensors):
            raise CheckpointError(
                f"checkpoint {directory} does not name its parameters: it was saved without model= (or by a version "
                "that did not record names). Save with opt.save_checkpoint(dir, model=model) and export that; or "
                "export the optimizer's state by index with offload-ckpt export CKPT OUT.pt")
        reader = _ModelReader(manifest)
        entries = {e.index: e for e in manifest.params}
        memory = manifest.memory()["state"] if MEMORY in manifest.files else {}
        tensors = []
        for e in manifest.model.tensors:
            if e.same_as is not None:
                continue
            dtype = torch.float32 if getattr(torch, e.dtype).is_floating_point else getattr(torch, e.dtype)
            state = entries.get(e.param) if e.param is not None else None
            if state is not None and "master" in state.keys and state.initialized:
                write = _master_writer(manifest, state, memory, e.name)
            else:
                write = reader.writer(e, as_dtype=dtype)
            tensors.append(Tensor(e.name, tuple(e.shape), dtype, write))
        return write_checkpoint(out, tensors, max_shard_size=max_shard_size, extra=_configs(config, tensors),
                                overwrite=overwrite, progress=progress)


def _verified(directory: str, config: Optional[str]):
    """The checkpoint's manifest, every checksum verified; a ``config`` directory without config.json refused
    first."""
    if config is not None and not os.path.lexists(os.path.join(config, "config.json")):
        raise CheckpointError(f"--config {config}: no config.json there; give the model's Hugging Face directory")
    verify_checkpoint(directory)
    return read_process(directory)


def _configs(config: Optional[str], tensors: list) -> Callable[[str], None]:
    """What goes beside the weights: ``config``'s config.json (its dtype the weights') and generation_config.json."""
    copied = {}  # read now: regular files of a config's size only (a FIFO there would hang the copy)
    for name in _HF_CONFIGS if config is not None else ():
        if os.path.lexists(os.path.join(config, name)):
            copied[name] = read_config_bytes(os.path.join(config, name))

    def extra(tmp: str) -> None:
        if config is None:
            return
        for name, data in copied.items():
            with create_private(os.path.join(tmp, name)) as f:
                f.write(data)
        write_dtype(os.path.join(tmp, "config.json"), saved_dtype(tensors))
    return extra


class _ModelReader:
    """A checkpoint's model tensors, each written to a file as it is read: from params.bin in slices (its
    checksum checked again), or from model.pt mapped, not read whole."""

    def __init__(self, manifest):
        on_disk = any(e.where == PARAMS_DATA for e in manifest.model.tensors)
        self.params = manifest.path(PARAMS_DATA) if on_disk else None
        self.memory = torch.load(manifest.path(MODEL_MEMORY), mmap=True, weights_only=True, map_location="cpu")

    def writer(self, e, as_dtype: Optional[torch.dtype] = None) -> Callable:
        saved = getattr(torch, e.dtype)
        convert = as_dtype is not None and as_dtype != saved

        def write(f) -> None:
            if e.where != PARAMS_DATA:
                t = self.memory[e.name]
                f.write(_raw(t.to(as_dtype) if convert else t))
                return
            digest = xxhash.xxh3_64()
            item = saved.itemsize
            step = max(item, CHUNK // item * item)  # whole elements per slice, to convert them
            with open(self.params, "rb") as src:
                for start in range(0, e.length, step):
                    data = os.pread(src.fileno(), min(step, e.length - start), e.offset + start)
                    if not data:
                        break
                    digest.update(data)
                    if convert:
                        data = _raw(torch.frombuffer(bytearray(data), dtype=saved).to(as_dtype))
                    f.write(data)
            if digest.hexdigest() != e.xxh3_64:
                raise ChecksumError(f"{self.params}: {e.name!r} changed since it was verified")
        return write


def _master_writer(manifest, state, memory: dict, name: str) -> Callable:
    """Writes parameter ``name``'s fp32 master: from memory.pt, or chunk by chunk from state.bin."""
    k = state.keys.index("master")
    dtype = state.state_dtypes()[k]

    def write(f) -> None:
        if state.where == "memory":
            f.write(_raw(memory[state.index]["master"].to(torch.float32)))
            return
        with open(manifest.path(DATA), "rb") as src:
            for c in sorted(state.chunks, key=lambda c: c.start):
                at, length = manifest.units[c.unit].offset + c.key_offset(k), c.numel * dtype.itemsize
                for start in range(0, length, CHUNK):
                    data = os.pread(src.fileno(), min(CHUNK, length - start), at + start)
                    if len(data) != min(CHUNK, length - start):
                        raise CheckpointError(f"{manifest.path(DATA)}: the master of {name!r} ends early")
                    f.write(data)
    if state.where != "memory" and dtype != torch.float32:
        raise CheckpointError(f"the master of {name!r} is stored as {dtype}, not float32")
    return write


def _raw(t: torch.Tensor):
    """``t``'s bytes, contiguous, as a buffer a file takes."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data
