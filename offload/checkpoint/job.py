"""A job's checkpoints (torch.distributed): the ranks' agreement, a job's save, and its commit in each
directory with the way back."""

from __future__ import annotations

import contextlib
import datetime
import errno as _errno
import json
import os
import secrets
import warnings
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ..distributed import rank_info
from ..errors import CheckpointError
from .commit import _exchange, _fsync_dir, _recover, _rename, _Shard, _write_json
from .format import JOB_FORMAT, JOB_VERSION, MANIFEST, _manifest_digest, _shard_name
from .locks import _Hold, _lock
from .ownership import _clean_stale_jobs, _parse_manifest, _remove_ours, _target_kind


def job_world() -> int | None:
    """The number of ranks of the torch.distributed job this process belongs to, or None where it saves
    and loads alone (torch.distributed not initialised, or a job of one rank)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    info = rank_info()
    return info.world_size if info.distributed else None


_GROUP: list = []  # [(the default process group, the checkpoints' group made for it)]


# NOTE: the ranks of a job agree on a save or a load with all_gather_object over a gloo group of their
# own, made at the first checkpoint of the job (every rank saves or loads, so every rank makes it, as
# new_group requires). gloo moves CPU objects whatever the default backend (nccl would need the right
# CUDA device), the group has the default group's timeout, and its collectives never interleave with
# the training's own on the default group. A rank that dies makes the others' collective fail at once
# (its connections close); one that hangs, once the timeout has passed. Either way a CheckpointError.
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


def _gather(obj: Any, doing: str) -> list:
    """Every rank's ``obj``, by rank (a collective of the checkpoints' group: every rank calls it).

    Raises:
        CheckpointError: a rank did not answer: it died, or did not come within the timeout.
    """
    out: list = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(out, obj, group=_group())
    except Exception as err:  # noqa: BLE001 - gloo raises RuntimeError or DistBackendError
        raise CheckpointError(f"{doing}: not every rank of the job answered (a rank died, or did not get this "
                              f"far within the process group's timeout of {_timeout(dist.group.WORLD)}): "
                              f"{err}") from err
    return out


# NOTE: a job's checkpoint is complete on every rank or is not there. Every rank writes its shard, as
# a save of its own would (streamed from its own swap space, checksummed, fsynced), into a staging
# directory ``<dir>.tmp-job-<id>`` whose id rank 0 draws; the ranks then exchange what they did
# (all_gather over the checkpoints' gloo group). If any failed, or one does not answer (dead, or past
# the process group's timeout), every rank removes its shard and raises: nothing is committed. Else
# the lowest rank among those that see the same staging directory (all of them on a shared file
# system, those of one node with node-local directories) writes the job manifest into it and commits
# it (``_JobCommit`` below): the job manifest is written last, and in each directory by one rank,
# so ranks that share a file system never race on it, and directories that share nothing each get a
# complete manifest of the whole job. The ranks then exchange again: if a directory could not commit,
# the others put their previous checkpoint back. Once all commits are made, a last exchange says
# whether each rank's directory holds this save: one that nobody committed fails the save everywhere too.
def _save_job(optimizer, directory, *, blocking: bool, mirror_to, then: Optional[Callable[[str], None]],
              write_shard: Callable[[_Shard], None]) -> str:
    """``save_checkpoint`` on every rank of a job (see the NOTE above), ``write_shard(shard)`` writing this
    rank's shard as a save of its own would; returns the directory."""
    rank, world = rank_info().rank, job_world()
    given = os.path.abspath(os.fspath(directory))
    if not blocking:
        raise CheckpointError(f"save_checkpoint(blocking=False) is for a process that saves alone; in a job of "
                              f"{world} ranks save with blocking=True (the ranks agree on the commit with "
                              "collectives, which a background thread would interleave with training's), or "
                              "save one rank's state by itself with alone=True")
    if mirror_to is not None:
        raise CheckpointError(f"mirror_to is for a process that saves alone; in a job of {world} ranks copy "
                              "each rank's directory to the second level yourself (offload-ckpt mirror), or "
                              "save one rank's state by itself with alone=True")
    target = os.path.realpath(given)
    token = _gather(secrets.token_hex(8), f"saving {given}")[0]
    stage = f"{target}.tmp-job-{token}"
    name = _shard_name(rank)
    status, own = {"rank": rank, "name": name, "ok": False}, None
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        _target_kind(target, given)  # refused before anything is written (and again at the commit)
        os.makedirs(stage, exist_ok=True)
        shard = _Shard(os.path.join(stage, name))
        write_shard(shard)
        status.update(ok=True, manifest_xxh3_64=shard.manifest["manifest_xxh3_64"], step=shard.manifest["step"],
                      files=shard.manifest["files"])
    except Exception as err:  # noqa: BLE001 - told to the other ranks, then raised
        own = err
        status["error"] = f"{type(err).__name__}: {err}"
    try:
        statuses = _gather(status, f"saving {given}")
    except CheckpointError as err:
        _discard_shard(stage, name)
        if own is not None:
            raise own from err
        raise
    failed = [s for s in statuses if not s["ok"]]
    if failed:
        _discard_shard(stage, name)
        if own is not None:
            raise own
        raise CheckpointError(f"the job's save to {given} failed on rank {failed[0]['rank']} "
                              f"({failed[0]['error']}); nothing was committed on any rank, and the checkpoint "
                              "that was there (if any) is as it was")
    job = _job_manifest(token, statuses)
    commit, result, own = None, {"ok": True}, None
    try:
        here = _ranks_here(stage, statuses, rank)
        if here is not None and min(here) == rank:
            commit = _JobCommit(stage, given)
            commit.commit(job)
    except Exception as err:  # noqa: BLE001 - told to the other ranks, then raised
        if commit is None:  # nothing was committed here (the lock was refused): the shard is not wanted
            _discard_shard(stage, name)
        own = err
        result = {"ok": False, "error": f"{type(err).__name__}: {err}"}
    try:
        results = _gather({"rank": rank, **result}, f"committing {given}")
    except CheckpointError:
        if commit is not None:
            commit.roll_back()
        raise
    failed = [r for r in results if not r["ok"]]
    if not failed:
        # Every commit that was made is made now: each rank checks that its directory holds this save
        # (a directory whose committing rank could not see the shards there would otherwise keep the old
        # checkpoint while every rank reports success).
        try:
            results = _gather({"rank": rank, **_check_committed(target, token, name)}, f"committing {given}")
        except CheckpointError:
            if commit is not None:
                commit.roll_back()
            else:
                _discard_uncommitted(stage, name)
            raise
        failed = [r for r in results if not r["ok"]]
    if failed:
        if commit is not None:
            commit.roll_back()
        else:
            _discard_uncommitted(stage, name)
        if own is not None:
            raise own
        raise CheckpointError(f"the job's save to {given} could not be committed on rank {failed[0]['rank']} "
                              f"({failed[0]['error']}); every directory of the job has its previous checkpoint back")
    if commit is not None:
        commit.finish()
    if then is not None:
        # Every rank agreed the commit: a failure of what follows (Retention's verify and prune) on one
        # rank must not make it report a committed save as failed while the others report success.
        try:
            then(given)
        except Exception as err:  # noqa: BLE001 - reported, the save stands
            warnings.warn(f"the job's checkpoint {given} is committed on every rank, but what follows the save "
                          f"failed on rank {rank}: {type(err).__name__}: {err}", RuntimeWarning, stacklevel=3)
    return given


def _ranks_here(stage: str, statuses: list, rank: int) -> Optional[list]:
    """The ranks whose shards are in the same staging directory as this rank's (those that share its file
    system), or None once another of them has committed it (it is no longer at ``stage``).

    The directory is opened once and read through that descriptor, which follows it if the rank that
    commits it renames it meanwhile; what ``stage`` names after such a rename (the checkpoint it replaced)
    does not hold this rank's shard as written, which tells that it was committed.
    """
    try:
        fd = os.open(stage, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        def digest(name: str) -> Optional[str]:
            try:
                m = os.open(os.path.join(name, MANIFEST), os.O_RDONLY | os.O_CLOEXEC, dir_fd=fd)
            except (FileNotFoundError, NotADirectoryError):
                return None
            with os.fdopen(m, "rb") as f:
                try:
                    return json.loads(f.read()).get("manifest_xxh3_64")
                except (ValueError, AttributeError):
                    return None

        # A staging directory gets the job manifest only at its commit: one that holds a manifest is being
        # committed by another rank, or is already the checkpoint it replaced (whose shard may be
        # byte-identical to this rank's, so the digests alone cannot tell).
        try:
            os.stat(MANIFEST, dir_fd=fd, follow_symlinks=False)
            return None
        except FileNotFoundError:
            pass
        if digest(statuses[rank]["name"]) != statuses[rank]["manifest_xxh3_64"]:
            return None
        return [s["rank"] for s in statuses if digest(s["name"]) == s["manifest_xxh3_64"]]
    finally:
        os.close(fd)


def _check_committed(target: str, token: str, name: str) -> dict:
    """``{"ok": True}`` if ``target`` is this save's checkpoint (its job manifest has ``token``) and holds
    this rank's shard ``name``, else ``{"ok": False, "error": why}``."""
    try:
        manifest = _parse_manifest(target)
    except OSError as err:  # told to the other ranks, who wait for this answer
        return {"ok": False, "error": f"its directory's job manifest cannot be read ({err})"}
    if not isinstance(manifest, dict) or manifest.get("job") != token:
        return {"ok": False, "error": "its directory does not hold this save (the rank that was to commit it did "
                                      "not find the shards there)"}
    if not os.path.isdir(os.path.join(target, name)):
        return {"ok": False, "error": f"its shard {name} is not in the committed directory"}
    return {"ok": True}


def _job_manifest(token: str, statuses: list) -> dict:
    """The job manifest: its id, the world size, every rank's shard with its manifest's checksum and files."""
    shards = [{"rank": s["rank"], "name": s["name"], "manifest_xxh3_64": s["manifest_xxh3_64"], "step": s["step"],
               "files": s["files"]} for s in statuses]
    return {
        "format": JOB_FORMAT,
        "version": JOB_VERSION,
        "job": token,
        "world_size": len(statuses),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "step": max(s["step"] for s in shards),
        "shards": shards,
    }


def _discard_uncommitted(stage: str, name: str) -> None:
    """After a failed commit, on a rank that did not commit: remove its shard from the staging directory if
    nobody committed that directory. Whatever else has the staging name belongs to another rank's commit,
    which puts it right: the checkpoint it replaced (it holds a job manifest) or the directory it replaced
    (it does not hold this rank's shard), or the new checkpoint being rolled back (a job manifest)."""
    if not os.path.lexists(os.path.join(stage, MANIFEST)) and os.path.lexists(os.path.join(stage, name)):
        _discard_shard(stage, name)


def _discard_shard(stage: str, name: str) -> None:
    """Remove this rank's shard from a job's staging directory, and the directory once empty."""
    with contextlib.suppress(OSError):
        path = os.path.join(stage, name)
        if os.path.lexists(path):
            _remove_ours(path, quiet=True)
        os.rmdir(stage)


# NOTE: a job's checkpoint is committed in each directory that holds shards of it (one per node with
# node-local directories, one in all on a shared file system) by one rank there, once every rank has
# reported its shard fsynced: the staging directory, with the job manifest written into it last, takes
# the checkpoint's name in one rename (exchanged with the checkpoint it replaces). The replaced one is
# kept, under the staging name, until every directory of the job has committed: if one could not, the
# others exchange theirs back, so the job's previous checkpoint stays whole everywhere.
class _JobCommit:
    """The commit of a job's checkpoint in one directory, with its way back (see the NOTE above).

    Holds the parent directory's lock, as a save does, from its creation until :meth:`finish` or
    :meth:`roll_back`.
    """

    def __init__(self, stage: str, directory: str):
        self.stage = stage
        self.directory = os.path.abspath(directory)
        self.target = os.path.realpath(self.directory)
        self.parent = os.path.dirname(self.target)
        self.aside: str | None = None  # where the replaced checkpoint (or empty directory) waits
        self.committed = False
        self._release: _Hold | None = _lock(self.parent, exclusive=True)

    def commit(self, manifest: dict) -> None:
        """Write the job manifest into the staging directory, then give it the checkpoint's name."""
        _recover(self.target)
        _target_kind(self.target, self.directory)
        _clean_stale_jobs(self.target, keep=self.stage)
        manifest["manifest_xxh3_64"] = _manifest_digest(manifest)
        _write_json(os.path.join(self.stage, MANIFEST), manifest)
        _fsync_dir(self.stage)
        if _target_kind(self.target, self.directory) == "missing":
            _rename(self.stage, self.target)
        elif _exchange(self.stage, self.target):
            self.aside = self.stage
        else:
            self.aside = f"{self.target}.old-{secrets.token_hex(4)}"
            _rename(self.target, self.aside)
            _rename(self.stage, self.target)  # a crash just before this: _recover() restores `aside`
        self.committed = True
        _fsync_dir(self.parent)

    def finish(self) -> None:
        """Every directory of the job has committed: delete the replaced checkpoint, let the lock go."""
        try:
            if self.aside is not None:
                _remove_ours(self.aside)
        finally:
            self.close()

    def roll_back(self) -> None:
        """Another directory of the job could not commit: put back what this one replaced (if it was
        committed) and delete the new checkpoint; let the lock go."""
        try:
            if self.committed:
                if self.aside is None:
                    _rename(self.target, self.stage)
                elif self.aside == self.stage:
                    if not _exchange(self.stage, self.target):
                        raise OSError(_errno.ENOTSUP, "the file system no longer exchanges directories", self.target)
                else:
                    _rename(self.target, self.stage)
                    _rename(self.aside, self.target)
                self.committed = False
                _fsync_dir(self.parent)
            _remove_ours(self.stage, quiet=True)
        finally:
            self.close()

    def close(self) -> None:
        if self._release is not None:
            self._release()
            self._release = None
