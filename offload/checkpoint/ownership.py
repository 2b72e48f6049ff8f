"""What a save may replace and what may be removed: our manifest, our file names, and removals that
never delete a file a save of ours did not write."""

from __future__ import annotations

import contextlib
import errno as _errno
import json
import os
import re
import secrets
import stat
import warnings

from .._proc import pid_alive
from .format import (
    _SHARD,
    DATA,
    EXTRA,
    FORMAT,
    JOB_FORMAT,
    MANIFEST,
    MEMORY,
    MODEL_MEMORY,
    PARAMS_DATA,
    _manifest_digest,
)

# Every name a save of this format writes into a checkpoint directory. A leftover of a save (a
# temporary sibling without a trustworthy manifest) is ours only if it holds nothing else.
_OUR_FILES = frozenset({MANIFEST, DATA, MEMORY, EXTRA, PARAMS_DATA, MODEL_MEMORY})

_WHAT_TO_DO = "save into a new directory, or remove this one yourself if nothing in it is needed"


def _listing(names: list[str], most: int = 5) -> str:
    names = sorted(names)
    shown = ", ".join(repr(n) for n in names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def _foreign(path: str, allowed: frozenset) -> list[str]:
    """Entries of directory ``path`` that are not regular files named in ``allowed``."""
    out = []
    for n in os.listdir(path):
        try:
            regular = stat.S_ISREG(os.lstat(os.path.join(path, n)).st_mode)
        except FileNotFoundError:
            continue
        if n not in allowed or not regular:
            out.append(n)
    return out


def _parse_manifest(path: str):
    """The JSON in ``path/manifest.json``; None if there is none or it does not parse."""
    try:
        with open(os.path.join(path, MANIFEST), "rb") as f:
            return json.loads(f.read())
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError, ValueError):
        return None


def _manifest_problem(path: str) -> tuple[dict | None, str | None]:
    """``(manifest, None)`` if directory ``path`` holds a manifest of ours whose checksum holds,
    else ``(None, why not)``."""
    if not os.path.lexists(os.path.join(path, MANIFEST)):
        return None, f"is not an nvme-offload checkpoint (no {MANIFEST}; it holds {_listing(os.listdir(path))})"
    manifest = _parse_manifest(path)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return None, f"has a {MANIFEST} that is not an nvme-offload checkpoint's"
    if _manifest_digest(manifest) != manifest.get("manifest_xxh3_64") or not isinstance(manifest.get("files"), dict):
        return None, (f"has an nvme-offload {MANIFEST} that fails its checksum (corrupt or edited), so which of "
                      "its files belong to the checkpoint cannot be told")
    return manifest, None


def _is_our_format(path: str) -> bool:
    """Whether directory ``path`` has a manifest that says it is one of our checkpoints, a process's or a
    job's (unchecked)."""
    manifest = _parse_manifest(path)
    return isinstance(manifest, dict) and manifest.get("format") in (FORMAT, JOB_FORMAT)


def _is_job(path: str) -> bool:
    """Whether directory ``path`` is (or was being staged as) a job's checkpoint: a job manifest, or no
    manifest and shard directories (``rank-<n>``)."""
    manifest = _parse_manifest(path)
    if manifest is not None:
        return isinstance(manifest, dict) and manifest.get("format") == JOB_FORMAT
    try:
        return any(_SHARD.match(n) and os.path.isdir(os.path.join(path, n)) for n in os.listdir(path))
    except OSError:
        return False


def _checkpoint_problem(path: str) -> str | None:
    """None if directory ``path`` is a complete checkpoint of ours with nothing else in it (so a save
    may replace it and retention may delete it); else why not, for an error message. A job's checkpoint
    is complete when its manifest holds and every shard in it is the complete one the manifest lists;
    shards of other ranks may be elsewhere (node-local directories)."""
    job = _parse_manifest(path)
    if isinstance(job, dict) and job.get("format") == JOB_FORMAT:
        return _job_problem(path, job)
    manifest, problem = _manifest_problem(path)
    if problem is not None:
        return problem
    foreign = _foreign(path, frozenset(manifest["files"]) | {MANIFEST})
    if foreign:
        return f"is a checkpoint but also holds {_listing(foreign)}, which are not part of it"
    return None


def _job_problem(path: str, job: dict) -> str | None:
    """:func:`_checkpoint_problem` of a job's checkpoint ``path`` whose manifest is ``job``."""
    shards = job.get("shards")
    if _manifest_digest(job) != job.get("manifest_xxh3_64") or not isinstance(shards, list):
        return (f"has an nvme-offload job {MANIFEST} that fails its checksum (corrupt or edited), so which of "
                "its shards belong to the checkpoint cannot be told")
    listed = {s.get("name"): s for s in shards if isinstance(s, dict)}
    foreign = []
    for n in os.listdir(path):
        p = os.path.join(path, n)
        if n == MANIFEST:
            continue
        if n not in listed or os.path.islink(p) or not os.path.isdir(p):
            foreign.append(n)
            continue
        problem = _checkpoint_problem(p)
        if problem is not None:
            return f"is a job's checkpoint whose shard {n} {problem}"
        if (_parse_manifest(p) or {}).get("manifest_xxh3_64") != listed[n].get("manifest_xxh3_64"):
            return f"is a job's checkpoint whose shard {n} is not the one its {MANIFEST} lists (another save's)"
    if foreign:
        return f"is a job's checkpoint but also holds {_listing(foreign)}, which are not part of it"
    return None


def _ours(path: str) -> frozenset | None:
    """The names that may be deleted from directory ``path`` if all of it is ours (a complete
    checkpoint with nothing else in it, or what a save that died left: only files of our names and no
    manifest of someone else's); None if anything in it is not ours."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return None
    except FileNotFoundError:
        return None
    manifest, _ = _manifest_problem(path)
    allowed = _OUR_FILES | (frozenset(manifest["files"]) if manifest is not None else frozenset())
    if _foreign(path, allowed):
        return None
    found = _parse_manifest(path)
    if found is not None and not (isinstance(found, dict) and found.get("format") == FORMAT):
        return None  # valid JSON that is not our manifest: someone else's directory
    return allowed


def _delete(path: str, allowed: frozenset) -> bool:
    """Unlink the regular files named in ``allowed`` from directory ``path`` (the manifest first, so
    that a half-deleted directory is never complete), then the directory if it is then empty."""
    names = sorted(set(os.listdir(path)) & allowed, key=lambda n: n != MANIFEST)
    for n in names:
        p = os.path.join(path, n)
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISREG(os.lstat(p).st_mode):
                os.unlink(p)
    try:
        os.rmdir(path)
    except OSError as err:
        if err.errno not in (_errno.ENOTEMPTY, _errno.EEXIST):
            raise
        warnings.warn(f"left {path} in place: besides a checkpoint's files it holds "
                      f"{_listing(os.listdir(path))}, which are not ours to delete", RuntimeWarning, stacklevel=3)
        return False
    return True


def _remove_ours(path: str, *, quiet: bool = False) -> bool:
    """Delete directory ``path`` if everything in it is ours (see :func:`_ours`); True if it is gone.

    Anything else is left where it is, with a warning unless ``quiet``: this never deletes a file
    that a save of ours did not write. I/O errors while deleting become warnings too (the callers
    run after a commit, when the save itself has succeeded).
    """
    try:
        if _is_job(path):
            return _remove_job(path, quiet=quiet)
        allowed = _ours(path)
        if allowed is None:
            if not quiet and os.path.lexists(path):
                warnings.warn(f"left {path} in place: it holds {_listing(_foreign(path, _OUR_FILES))}, which are "
                              "not a checkpoint's and not ours to delete", RuntimeWarning, stacklevel=2)
            return False
        return _delete(path, allowed)
    except OSError as err:
        warnings.warn(f"could not delete {path}: {err}", RuntimeWarning, stacklevel=2)
        return False


def _remove_job(path: str, *, quiet: bool) -> bool:
    """:func:`_remove_ours` of a job's checkpoint, or of what a job's save left staged: the job manifest
    first (a half-deleted job is never complete), then each shard that is all ours, then the directory."""
    manifest = os.path.join(path, MANIFEST)
    if os.path.lexists(manifest):
        os.unlink(manifest)  # _is_job() read it: a job manifest of ours
    for n in os.listdir(path):
        if _SHARD.match(n):
            _remove_ours(os.path.join(path, n), quiet=quiet)
    try:
        os.rmdir(path)
    except OSError as err:
        if err.errno not in (_errno.ENOTEMPTY, _errno.EEXIST):
            raise
        if not quiet:
            warnings.warn(f"left {path} in place: besides a job checkpoint's shards it holds "
                          f"{_listing(os.listdir(path))}, which are not ours to delete", RuntimeWarning, stacklevel=3)
        return False
    return True


def _clean_stale_jobs(directory: str, keep: str) -> None:
    """Remove what saves of a job into ``directory`` left staged (``<directory>.tmp-job-<hex>``) when
    their job stopped, except ``keep`` (the save in progress). Only what is all ours is removed."""
    parent, name = os.path.split(directory)
    pattern = re.compile(re.escape(name) + r"\.tmp-job-[0-9a-f]+$")
    for n in os.listdir(parent):
        p = os.path.join(parent, n)
        if pattern.match(n) and p != keep and _is_job(p):
            _remove_ours(p, quiet=True)


def _remove_checkpoint(path: str) -> bool:
    """Delete checkpoint ``path`` if it is a complete checkpoint of ours with nothing else in it; it is
    renamed first, so a half-deleted one never carries a checkpoint's name. Otherwise warn and leave
    it. True if it is gone."""
    problem = "is a symbolic link" if os.path.islink(path) else _checkpoint_problem(path)
    if problem is not None:
        warnings.warn(f"not deleting {path}: it {problem}", RuntimeWarning, stacklevel=2)
        return False
    doomed = f"{path}.tmp-del-{secrets.token_hex(4)}"
    os.rename(path, doomed)
    return _remove_ours(doomed)


# NOTE: a save replaces the whole directory it is given, so it must never be given one that holds
# anything of the user's: ``save_checkpoint(".")`` or into a run's output folder or the nvme_path
# would otherwise swap that directory out and delete it. The rule, checked under the parent's lock
# before anything is written and again just before the exchange: the target may be missing, an
# empty directory (replaced, not filled: filling in place would lose atomicity, and a save that died
# half way would leave a directory no later save may replace), or a complete checkpoint of ours (our
# manifest, its checksum good, no other files). A manifest that fails its checksum cannot say which
# files are the checkpoint's, so that directory is refused too. A symbolic link is followed: the
# checkpoint it points to is replaced and the link stays. Refusals are FileExistsError (an OSError
# with the path, as os.mkdir raises for a name that is taken), not CheckpointError: nothing is wrong
# with any checkpoint, the name is taken by something else.
def _target_kind(path: str, given: str) -> str:
    """What is at ``path`` (the real path of the ``given`` one): "missing", "empty" (a directory with
    nothing in it) or "checkpoint" (a complete one of ours); raises for anything a save must not replace.

    Raises:
        FileExistsError: ``path`` is a file, or a directory that is not one of our checkpoints.
        OSError: ``path`` is a mount point (EBUSY: a save renames the directory, a mount point cannot be).
    """
    name = given if given == path else f"{given} (a link to {path})"
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "missing"
    if stat.S_ISLNK(st.st_mode):
        raise FileExistsError(_errno.EEXIST, f"checkpoint path {name} is a symbolic link that does not resolve "
                              "(a loop); point it at a directory or remove it", given)
    if not stat.S_ISDIR(st.st_mode):
        raise FileExistsError(_errno.EEXIST, f"checkpoint path {name} is a file, not a checkpoint directory; not "
                              f"replacing it: {_WHAT_TO_DO.replace('this one', 'the file')}", given)
    if os.path.ismount(path):
        raise OSError(_errno.EBUSY, f"checkpoint path {name} is a mount point, which a save cannot replace (it "
                      "renames the directory); save into a directory inside it", given)
    if not os.listdir(path):
        return "empty"
    problem = _checkpoint_problem(path)
    if problem is not None:
        raise FileExistsError(_errno.EEXIST, f"checkpoint path {name} exists and {problem}. A save replaces the "
                              "whole directory, so it only replaces an nvme-offload checkpoint or an empty "
                              f"directory: {_WHAT_TO_DO}", given)
    return "checkpoint"


def _clean_stale(directory: str) -> None:
    """Remove temporary siblings of ``directory`` left by saves whose process is gone.

    Only siblings named as a save names them and holding nothing but what a save writes are removed
    (see :func:`_ours`); a directory of someone else's that happens to match the name is left alone.
    """
    parent, name = os.path.split(directory)
    pattern = re.compile(re.escape(name) + r"\.(tmp-(?P<pid>\d+)-[0-9a-f]+|tmp-del-[0-9a-f]+|old-[0-9a-f]+)$")
    for n in os.listdir(parent):
        m = pattern.match(n)
        if m is None:
            continue
        if m["pid"] is not None and pid_alive(int(m["pid"])):
            continue  # a save in progress in another live process
        _remove_ours(os.path.join(parent, n), quiet=True)


def _used_elsewhere(path: str) -> int | None:
    """The id of another process with a file under directory ``path`` open (or it as its working
    directory), or None. Linux's /proc; processes this one may not look into are not seen."""
    prefix = os.path.realpath(path) + os.sep
    me = os.getpid()
    try:
        pids = [int(n) for n in os.listdir("/proc") if n.isdigit()]
    except OSError:
        return None
    for pid in pids:
        if pid == me:
            continue
        base = f"/proc/{pid}"
        try:
            links = [os.path.join(base, "fd", fd) for fd in os.listdir(base + "/fd")] + [base + "/cwd"]
        except OSError:
            continue  # gone, or not ours to look at
        for link in links:
            try:
                target = os.readlink(link)
            except OSError:
                continue
            if (target + os.sep).startswith(prefix):
                return pid
    return None
