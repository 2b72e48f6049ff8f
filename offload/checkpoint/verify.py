"""Reading a checkpoint without an optimizer or model: its manifest, a full verification, a summary, and
export to torch's layouts (what ``offload-ckpt export`` runs)."""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any, Sequence

import torch

from ..aio import Engine
from ..commit import replace_file
from ..errors import CheckpointError, ChecksumError
from ..state.dicts import step_tensor
from .commit import reading
from .format import (
    DATA,
    EXTRA,
    FORMAT,
    JOB_FORMAT,
    MEMORY,
    MODEL_MEMORY,
    PARAMS_DATA,
    read_checked,
    write_into,
)
from .manifest import JobManifest, Manifest, read, read_process
from .model import state_dict, verify_model
from .stream import aio_of, read_verified, tool_pool, unit_spans


def read_manifest(directory: str | os.PathLike) -> dict:
    """The manifest of a checkpoint as its JSON, checked whole (:mod:`offload.checkpoint.manifest`) and
    against its own checksum, read under :func:`offload.checkpoint.commit.reading` (hold that around the
    whole read to read the rest of the checkpoint consistently with it). A job's checkpoint has one per
    rank's shard, in ``directory/rank-<n>`` (:func:`read_job_manifest` reads the job's).

    Raises:
        FileNotFoundError: no such directory.
        CheckpointError: not a (complete) checkpoint, a format this version cannot read, or a job's.
    """
    with reading(directory) as directory:
        return read_process(directory).to_json()


def read_job_manifest(directory: str | os.PathLike) -> dict:
    """The job manifest of a checkpoint saved by every rank of a torch.distributed job, as its JSON, checked
    whole and against its own checksum: world size, and per rank its shard's name, manifest checksum
    and files (see ``docs/checkpoint.md``, "Saves of a job").

    Raises:
        FileNotFoundError: no such directory.
        CheckpointError: not a (complete) checkpoint of a job.
    """
    with reading(directory) as directory:
        manifest = read(directory)
    if not isinstance(manifest, JobManifest):
        raise CheckpointError(f"{directory} is the checkpoint of one process, not of a job (read it with "
                              "read_manifest)")
    return manifest.to_json()


def shard_manifest(job: JobManifest, rank: int) -> Manifest:
    """The manifest of rank ``rank``'s shard of ``job``, checked to be here (CheckpointError) and to be
    the one the job manifest lists (ChecksumError)."""
    entry = job.shards[rank]
    path = os.path.join(job.root, entry.name)
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {job.root} has no shard of rank {rank} here ({entry.name} is "
                              "missing); with node-local checkpoint directories each node holds the shards of "
                              "the ranks that ran there: start each rank on the node that saved its shard")
    shard = read_process(path)
    if shard.manifest_xxh3_64 != entry.manifest_xxh3_64:
        raise ChecksumError(f"{path}: its manifest has xxh3_64 {shard.manifest_xxh3_64}, the job manifest of "
                            f"{job.root} lists {entry.manifest_xxh3_64} (a shard of another save)")
    return shard


def verify_data(manifest: Manifest, engine: Engine, buffers: Sequence) -> None:
    """Read state.bin once and check every unit's checksum and the file's (units larger than the buffers
    in parts)."""
    read_verified(engine, manifest.sized_path(DATA), unit_spans(manifest), buffers, manifest.files[DATA].xxh3_64,
                  label=f"verifying {DATA}")


def verify_checkpoint(directory: str | os.PathLike, *, local: bool = False) -> dict:
    """Check a checkpoint's manifest, every file's size and checksum, every unit's checksum and, with
    a model, every parameter's checksum in params.bin.

    A job's checkpoint: its job manifest, and each rank's shard as above (each shard's manifest must
    be the one the job manifest lists).

    Args:
        directory: the checkpoint directory.
        local: for a job's checkpoint, check the shards that are here and let the others be elsewhere
            (node-local directories: each node holds its own ranks' shards). Without it, a missing
            shard fails the check.

    Returns:
        The manifest (a job's: the job manifest).

    Raises:
        FileNotFoundError: no such directory.
        CheckpointError: incomplete or unreadable (for a job, the message names every missing
            shard); ``ChecksumError`` names the first bad file and byte range (and the parameters
            whose state it holds, or the model parameter).
        OSError: the data could not be read.
    """
    with reading(directory) as directory:  # no save replaces it while its files are read one by one
        manifest = read(directory)
        if isinstance(manifest, JobManifest):
            verify_job(manifest, local=local)
        else:
            verify_files(manifest)
    return manifest.to_json()


def missing_shards(job: JobManifest) -> list[str]:
    """The names of ``job``'s shards that are not here (node-local directories: on other nodes)."""
    return [s.name for s in job.shards if not os.path.isdir(os.path.join(job.root, s.name))]


def verify_job(job: JobManifest, *, local: bool = False, ranks=None) -> None:
    """Verify the shards of a job's checkpoint that are here (``ranks``: those ranks' only, which must
    be here); without ``local``, a shard that is not here fails it, named."""
    missing = missing_shards(job)
    wanted = [s for s in job.shards if ranks is None or s.rank in ranks]
    lost = [s.name for s in wanted if s.name in missing]
    if lost and (ranks is not None or not local):
        raise CheckpointError(f"checkpoint {job.root} of a job of {job.world_size} ranks is missing the "
                              f"shard(s) {', '.join(lost)} here (with node-local directories they are on other "
                              "nodes: verify there, or pass local=True / --local to check only what is here)")
    for entry in wanted:
        if entry.name not in missing:
            verify_files(shard_manifest(job, entry.rank))


def verify_files(manifest: Manifest) -> None:
    """Check every file ``manifest`` lists (sizes, checksums, every unit and parameter); the data files are
    read with the native engine (O_DIRECT: from the drive, not the page cache)."""
    if EXTRA in manifest.files:
        read_checked(manifest.path(EXTRA), manifest.files[EXTRA])
    if MEMORY in manifest.files:
        manifest.memory()  # checked as a load reads it: checksum, and that it holds what the manifest says
        with tool_pool([u.length for u in manifest.units]) as pool, Engine(aio_of(manifest)) as engine:
            verify_data(manifest, engine, list(pool))
    if manifest.model is not None:
        verify_model(manifest, aio_of(manifest))


def inspect_checkpoint(directory: str | os.PathLike) -> str:
    """A human-readable summary of a checkpoint's manifest (no data is read); for a job's checkpoint,
    the job and each shard that is here."""
    with reading(directory) as directory:
        m = read(directory)
    if isinstance(m, JobManifest):
        return _inspect_job(m)
    offloaded = [e for e in m.params if e.where == "swap" and e.initialized]
    in_memory = [e for e in m.params if e.where == "memory"]
    lines = [f"checkpoint: {directory}",
             f"format: {FORMAT} v{m.version} (library {m.library_version}, torch {m.torch_version})"]
    if m.optimizer is None:
        lines.append(f"created: {m.created}   optimizer: none (model weights only)")
    else:
        lines += [
            f"created: {m.created}   optimizer: {m.optimizer}   step: {m.step}"
            + (f" (steps {list(m.steps)})" if len(m.steps) > 1 else ""),
            f"parameters: {len(m.params)} ({len(offloaded)} with state on disk, {len(in_memory)} in memory, "
            f"{len(m.params) - len(offloaded) - len(in_memory)} without state)",
            f"units: {len(m.units)} of up to {m.buffer_size} bytes",
        ]
    if m.model is not None:
        tensors, on_disk = m.model.tensors, m.model.on_disk()
        tied = [e for e in tensors if e.same_as is not None]
        lines.append(f"model: {len(tensors)} tensors ({len(on_disk)} offloaded parameters in {PARAMS_DATA}, "
                     f"{sum(e.length for e in on_disk)} bytes; {len(tensors) - len(on_disk) - len(tied)} in "
                     f"{MODEL_MEMORY}; {len(tied)} tied names)")
    for gi, g in enumerate(m.param_groups):
        hyper = ", ".join(f"{k}={g[k]}" for k in ("lr", "betas", "eps", "weight_decay", "amsgrad",
                                                   "decoupled_weight_decay") if k in g)
        lines.append(f"group {gi}: {len(g['params'])} params; {hyper}")
    for name, f in sorted(m.files.items()):
        digest = f"xxh3_64 {f.xxh3_64}" if f.xxh3_64 is not None else "checksums per unit (none of the whole file)"
        lines.append(f"file {name}: {f.bytes} bytes, {digest}")
    return "\n".join(lines)


def _inspect_job(job: JobManifest) -> str:
    missing = set(missing_shards(job))
    lines = [
        f"checkpoint: {job.root}",
        f"format: {JOB_FORMAT} v{job.version}: a job of {job.world_size} ranks, job id {job.job}",
        f"created: {job.created}   step: {job.step}",
        f"shards here: {job.world_size - len(missing)} of {job.world_size}"
        + (f" (missing here: {', '.join(sorted(missing))})" if missing else ""),
    ]
    for s in job.shards:
        size = sum(f.bytes for f in s.files.values())
        where = "MISSING here" if s.name in missing else "here"
        lines.append(f"shard {s.name} (rank {s.rank}): {where}, step {s.step}, {size} bytes in "
                     f"{len(s.files)} files, manifest xxh3_64 {s.manifest_xxh3_64}")
    for s in job.shards:
        if s.name not in missing:
            lines += ["", inspect_checkpoint(os.path.join(job.root, s.name))]
            break
    return "\n".join(lines)


# -- export ------------------------------------------------------------------------------------------


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
    memory = manifest.memory()
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
            if k in e.value_keys() and (k != "master" or include_master):
                # Moments kept in bf16 or 8 bits (state_dtype) come out in fp32, torch's layout.
                wide = dtype in (torch.bfloat16, torch.uint8)
                entry[k] = torch.empty(e.shape, dtype=torch.float32 if wide else dtype)
        state[e.index] = entry
        for c in e.chunks:
            placements[c.unit].append((e, c))

    def sink(span, start: int, data: torch.Tensor) -> None:
        buf = data.view(-1)  # the whole unit: the pool's buffers hold the longest
        for e, c in placements[span.key]:
            for key in e.value_keys():
                if key in state[e.index]:
                    state[e.index][key].view(-1)[c.start:c.start + c.numel].copy_(e.values(c, key, buf))

    with tool_pool([u.length for u in manifest.units], cap=None) as pool, Engine(aio_of(manifest)) as engine:
        read_verified(engine, path, unit_spans(manifest), list(pool), manifest.files[DATA].xxh3_64, sink=sink,
                      label=f"exporting {DATA}")
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
        return state_dict(manifest, aio_of(manifest))


def export_model_checkpoint(directory: str | os.PathLike, out: str | os.PathLike) -> None:
    """Write :func:`export_model_state_dict` of ``directory`` to ``out`` with ``torch.save``
    (atomically); needs host memory for the whole model."""
    _save_file(export_model_state_dict(directory), out)


def _save_file(obj: Any, out: str | os.PathLike) -> None:
    """``torch.save(obj, out)``, fsynced, under a fresh name beside ``out`` until complete, then renamed over it
    (``out`` must be a regular file or nothing: :func:`offload.commit.replace_file`)."""
    out = os.path.abspath(os.fspath(out))
    replace_file(out, lambda f: write_into(obj, f, out))
