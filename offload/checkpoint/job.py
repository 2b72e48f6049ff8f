"""A job's checkpoints (torch.distributed): the ranks' agreement, and a job's save committed in each
directory by one rename of the job manifest."""

from __future__ import annotations

import contextlib
import datetime
import os
import secrets
import warnings
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ..distributed import rank_info
from ..errors import CheckpointError
from .commit import Staged, commit_manifest, lock_directory, write_manifest
from .format import MANIFEST, Storage
from .manifest import FileEntry, JobManifest, Shard, raw_manifest, shard_name
from .ownership import check_target, fresh_name, our_manifest, sweep


def job_world() -> int | None:
    """The number of ranks of the torch.distributed job this process belongs to, or None where it saves
    and loads alone (torch.distributed not initialised, or a job of one rank)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    info = rank_info()
    return info.world_size if info.distributed else None


_GROUP: list = []  # [(the default process group, the checkpoints' group made for it)]


# NOTE: the ranks agree over a gloo group of the checkpoints' own, made at the job's first checkpoint (every
# rank makes it, as new_group requires) with the default group's timeout: CPU objects whatever the default
# backend, never interleaved with training's collectives. A rank that dies or hangs fails the others' collective
# (at once, or at the timeout): a CheckpointError.
def _group():
    world = dist.group.WORLD
    if _GROUP and _GROUP[0][0] is world:
        return _GROUP[0][1]
    group = dist.new_group(backend="gloo", timeout=_timeout(world))
    _GROUP[:] = [(world, group)]
    return group


def _timeout(world):
    """The default process group's timeout (``init_process_group(timeout=...)``), else torch's default."""
    from torch.distributed.distributed_c10d import default_pg_timeout

    try:
        device = torch.device("cuda" if dist.get_backend() == "nccl" else "cpu")
        return world._get_backend(device).options._timeout
    except (AttributeError, RuntimeError, ValueError):
        return default_pg_timeout


def gather(obj: Any, doing: str) -> list:
    """Every rank's ``obj``, by rank (a collective of the checkpoints' group: every rank calls it);
    CheckpointError where a rank did not answer (it died, or did not come within the timeout)."""
    out: list = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(out, obj, group=_group())
    except Exception as err:  # gloo raises RuntimeError or DistBackendError
        raise CheckpointError(f"{doing}: not every rank of the job answered (a rank died, or did not get this "
                              f"far within the process group's timeout of {_timeout(dist.group.WORLD)}): "
                              f"{err}") from err
    return out


def on_every_rank(doing: str, step: Callable[[], tuple[Any, dict]]) -> tuple[Any, Optional[BaseException], list]:
    """Run ``step()`` on this rank and tell every rank how it went (a collective: every rank calls it).

    ``step`` returns a result and what to tell the other ranks. Returns the result, this rank's error (None
    when it succeeded) and every rank's status: ``{"rank", "ok"}`` with what its step told, or ``"error"``.
    A Ctrl-C (KeyboardInterrupt) on this rank is told as a failure too, so that every rank stops together;
    the caller raises it once the ranks have agreed.

    Raises:
        CheckpointError: a rank did not answer (this rank's own error, if any, is raised instead, chained).
    """
    status, result, own = {"rank": rank_info().rank, "ok": False}, None, None
    try:
        result, told = step()
        status.update(told, ok=True)
    except BaseException as err:  # told to the other ranks, then raised (a Ctrl-C too: the others wait on it)
        if not isinstance(err, Exception | KeyboardInterrupt):
            raise  # SystemExit and the like: this process is going
        own = err
        status["error"] = f"{type(err).__name__}: {err}"
    try:
        return result, own, gather(status, doing)
    except CheckpointError as err:
        if own is not None:
            raise own from err
        raise


def failures(statuses: list) -> list:
    """The statuses of :func:`on_every_rank` of the ranks that failed."""
    return [s for s in statuses if not s["ok"]]


# NOTE: a job's save is the commit rule of one process's with one rename of the job manifest per directory,
# step by step in docs/checkpoint.md, "The commit, step by step": shards written under the save's generation,
# the ranks' outcome exchanged (any failure: every rank deletes what it wrote and raises), then the lowest rank
# in each directory commits the job manifest there, and a last exchange says whether every directory did.
def save_job(optimizer, directory, *, blocking: bool, mirror, then: Optional[Callable[[str], None]],
              write_shard: Callable[[Staged], None], storage: Storage) -> str:
    """``save_checkpoint`` on every rank of a job (see the NOTE above), ``write_shard(shard)`` writing this
    rank's shard as a save of its own would; returns the directory."""
    rank, world = rank_info().rank, job_world()
    given = os.path.abspath(os.fspath(directory))
    if not blocking:
        raise CheckpointError(f"save_checkpoint(blocking=False) is for a process that saves alone; in a job of "
                              f"{world} ranks save with blocking=True (the ranks agree on the commit with "
                              "collectives, which a background thread would interleave with training's), or "
                              "save one rank's state by itself with alone=True")
    if mirror is not None:
        raise CheckpointError(f"Retention(mirror=...) is for a process that saves alone; in a job of {world} ranks "
                              "copy each rank's directory to the second level yourself (offload-ckpt mirror), or "
                              "save one rank's state by itself with alone=True")
    target = os.path.realpath(given)
    made = not os.path.lexists(target)  # looked at before any rank can make it (the gather waits for all)
    generation = gather(secrets.token_hex(8), f"saving {given}")[0]
    name = shard_name(rank)
    shard = None

    def write() -> tuple[None, dict]:
        nonlocal shard
        check_target(target, given)  # refused before anything is written (and again at the commit)
        storage.make_dirs(target)
        shard = Staged(name, storage=storage, generation=generation, shard_of=target)
        write_shard(shard)
        written = shard.manifest
        return None, {"shard": Shard(rank, name, written.manifest_xxh3_64, written.files, shard.written[MANIFEST],
                                     written.step).to_json()}

    try:
        _, own, statuses = on_every_rank(f"saving {given}", write)
    except Exception:  # a rank did not answer
        _discard(shard, target, made)
        raise
    failed = failures(statuses)
    if failed:
        _discard(shard, target, made=False)
        with contextlib.suppress(CheckpointError):  # every rank has deleted its shard after this
            gather(None, f"cleaning up {given}")
        _discard(None, target, made)  # then the directory this save made goes too
        raise own or CheckpointError(f"the job's save to {given} failed on rank {failed[0]['rank']} "
                                     f"({failed[0]['error']}); nothing was committed on any rank, and the "
                                     "checkpoint that was there (if any) is as it was")

    def commit() -> tuple[None, dict]:
        here = _ranks_here(target, statuses)
        if rank not in here:
            raise CheckpointError(f"this rank's shard {name} is not in {given} as it wrote it")
        if min(here) == rank:
            _commit_job(target, given, generation, _job_manifest(generation, statuses), storage)
        return None, {}

    _, own, results = on_every_rank(f"committing {given}", commit)
    failed = failures(results)
    if failed:
        if getattr(our_manifest(target), "job", None) != generation:
            _discard(shard, target, made)  # nothing here names it
        raise own or CheckpointError(f"the job's save to {given} could not be committed on rank "
                                     f"{failed[0]['rank']} ({failed[0]['error']}); directories that committed "
                                     "hold the new checkpoint, the others their previous one (a load refuses the "
                                     "mix: load the step before)")
    if then is not None:
        # Every rank agreed the commit: a failure of what follows (Retention's verify and prune) on one
        # rank must not make it report a committed save as failed while the others report success.
        try:
            then(given)
        except Exception as err:  # reported, the save stands
            warnings.warn(f"the job's checkpoint {given} is committed on every rank, but what follows the save "
                          f"failed on rank {rank}: {type(err).__name__}: {err}", RuntimeWarning, stacklevel=3)
    return given


def _discard(shard: Optional[Staged], target: str, made: bool) -> None:
    """Delete what this rank wrote for a save that was not committed, and the job's directory if this
    save made it and nothing is left in it."""
    if shard is not None:
        shard.abort()
    if made:
        with contextlib.suppress(OSError):
            os.rmdir(target)  # the last rank to get here removes it


def _ranks_here(target: str, statuses: list) -> list:
    """The ranks whose shards, as they wrote them, are in directory ``target`` here (all of them on a
    shared file system, those of this node with node-local directories)."""
    here = []
    for s in statuses:
        found = raw_manifest(os.path.join(target, s["shard"]["name"]), s["shard"]["manifest"])
        if isinstance(found, dict) and found.get("manifest_xxh3_64") == s["shard"]["manifest_xxh3_64"]:
            here.append(s["rank"])
    return here


def _commit_job(target: str, given: str, generation: str, manifest: JobManifest, storage: Storage) -> None:
    """Commit a job's checkpoint in directory ``target``: under its lock, the job manifest under a fresh
    name, fsynced, then one rename onto manifest.json; then delete the previous checkpoint's files."""
    held = lock_directory(target, exclusive=True)
    try:
        check_target(target, given)
        previous = our_manifest(target)
        staged = os.path.join(target, fresh_name(MANIFEST, generation))
        manifest = write_manifest(staged, manifest, storage)
        commit_manifest(target, staged, manifest, previous, storage)
        sweep(target, manifest, unlink=storage.unlink)  # and what saves that died left here
    finally:
        held.release()


def _job_manifest(generation: str, statuses: list) -> JobManifest:
    """The job manifest: its id, the world size, every rank's shard with its manifest's name, checksum
    and files."""
    shards = tuple(Shard(**{**s["shard"], "files": {n: FileEntry(**e) for n, e in s["shard"]["files"].items()}})
                   for s in statuses)
    return JobManifest(generation, len(statuses), shards, step=max(s.step for s in shards),
                       created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
