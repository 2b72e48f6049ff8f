"""Export to torch's optimizer state_dict layout, and export of a model's weights (what ``offload-ckpt
export`` runs)."""

from __future__ import annotations

import os
import secrets
from collections import OrderedDict
from typing import Any

import torch

from ..aio import Engine
from ..errors import CheckpointError
from ..state import step_tensor
from .commit import reading
from .format import DATA, MEMORY, read_torch, write_file
from .manifest import read_process
from .model import model_section, state_dict
from .storage import DEFAULT_STORAGE
from .stream import aio_of, read_verified, tool_pool, unit_spans


def export_state_dict(directory: str | os.PathLike, *, include_master: bool = True) -> dict:
    """A checkpoint as torch's optimizer ``state_dict`` (``{"state": ..., "param_groups": ...}``).

    What ``torch.optim.Adam``/``AdamW.load_state_dict`` (and ``OffloadedAdam.load_state_dict``)
    accept. State of fp16/bf16 parameters is fp32, with their fp32 master copy as ``"master"``
    (torch's optimizers ignore it; ``include_master=False`` leaves it out). Needs host memory for
    the whole state; every checksum is verified on the way.

    Raises:
        CheckpointError: incomplete or corrupt checkpoint.
    """
    with reading(directory) as directory:
        return _export_state_dict(directory, include_master)


def _export_state_dict(directory: str, include_master: bool) -> dict:
    manifest = read_process(directory)
    if manifest.optimizer is None:
        raise CheckpointError(f"checkpoint {directory} holds model weights only, no optimizer state to export; "
                              "export the model with export_model_checkpoint (offload-ckpt export --model-out)")
    path = manifest.sized_path(DATA)
    memory = read_torch(manifest.path(MEMORY), manifest.files[MEMORY])
    manifest.check_memory(memory)
    state: dict = {}
    placements: list[list] = [[] for _ in manifest.units]
    for e in manifest.params:
        if not e.initialized:
            continue
        if e.where == "memory":
            state[e.index] = {k: v for k, v in memory["state"][e.index].items() if k != "master" or include_master}
            continue
        entry = {"step": step_tensor(memory["steps"][e.index])}
        for k, dtype in zip(e.keys, e.state_dtypes()):
            if k != "master" or include_master:
                # Moments kept in bf16 (state_dtype "bf16") come out in fp32, torch's layout.
                entry[k] = torch.empty(e.shape, dtype=torch.float32 if dtype == torch.bfloat16 else dtype)
        state[e.index] = entry
        for c in e.chunks:
            placements[c.unit].append((e, c))

    def sink(span, start: int, data: torch.Tensor) -> None:
        buf = data.view(-1)  # the whole unit: the pool's buffers hold the longest
        for e, c in placements[span.key]:
            for k, (key, dtype) in enumerate(zip(e.keys, e.state_dtypes())):
                if key in state[e.index]:
                    at = c.key_offset(k)
                    src = buf[at: at + c.numel * dtype.itemsize].view(dtype)
                    state[e.index][key].view(-1)[c.start:c.start + c.numel].copy_(src)

    with tool_pool([u.length for u in manifest.units], cap=None) as pool:
        engine = Engine(aio_of(manifest))
        try:
            read_verified(engine, path, unit_spans(manifest), list(pool), manifest.files[DATA].xxh3_64, sink=sink)
        finally:
            engine.close()
    return {"state": state, "param_groups": [dict(g) for g in memory["param_groups"]]}


def export_checkpoint(directory: str | os.PathLike, out: str | os.PathLike, *, include_master: bool = True) -> None:
    """Write :func:`export_state_dict` of ``directory`` to ``out`` with ``torch.save`` (atomically)."""
    _save_file(export_state_dict(directory, include_master=include_master), out)


def export_model_state_dict(directory: str | os.PathLike) -> OrderedDict:
    """The model weights of a checkpoint (saved with ``model=`` or ``save_parameters``) as the
    model's ``state_dict``: ``model.load_state_dict()`` of a plain model of the same architecture
    accepts it.

    Unlike saving and loading, this materialises every weight in host memory: the whole dict is
    built (offloaded parameters read one at a time from params.bin, each checksum verified) before
    it is returned.

    Raises:
        CheckpointError: no model in the checkpoint, or it is incomplete or corrupt.
    """
    with reading(directory) as directory:
        manifest = read_process(directory)
        model_section(manifest)
        return state_dict(manifest, aio_of(manifest))


def export_model_checkpoint(directory: str | os.PathLike, out: str | os.PathLike) -> None:
    """Write :func:`export_model_state_dict` of ``directory`` to ``out`` with ``torch.save``
    (atomically); needs host memory for the whole model."""
    _save_file(export_model_state_dict(directory), out)


def _save_file(obj: Any, out: str | os.PathLike) -> None:
    """``torch.save(obj, out)``, fsynced, under a temporary name until complete."""
    out = os.path.abspath(os.fspath(out))
    tmp = f"{out}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        write_file(obj, tmp, DEFAULT_STORAGE.fsync)
        os.replace(tmp, out)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    DEFAULT_STORAGE.fsync_dir(os.path.dirname(out))
