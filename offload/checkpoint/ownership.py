"""What is ours in a checkpoint directory: the files its manifest names, and what a save that died left
under a generation's name. Nothing else there is ever written over or deleted."""

from __future__ import annotations

import contextlib
import errno as _errno
import os
import re
import stat
import warnings
from typing import Callable

from ..errors import CheckpointError
from ..locks import LOCK_FILE
from .format import FORMAT, JOB_FORMAT, MANIFEST
from .manifest import SHARD_NAME, JobManifest, Manifest, parse, raw_manifest

_WHAT_TO_DO = "save into a new directory, or remove this one yourself if nothing in it is needed"

# A file a save writes is named for its generation: ``state.<16 hex>.bin``, ``manifest.<16 hex>.json``
# (the manifest before the rename that commits it, or a shard's). Only names of this shape that no
# manifest names are a dead save's leftovers; the fixed names of the first format (``state.bin``, ...)
# are deleted only where a manifest names them.
_GENERATION_FILE = re.compile(r"^(?:state|memory|extra|params|model|manifest)\.[0-9a-f]{16}\.(?:bin|pt|json)$")


def fresh_name(name: str, generation: str) -> str:
    """The name under which a save of ``generation`` writes the file ``name`` (``state.bin`` ->
    ``state.<generation>.bin``)."""
    stem, ext = os.path.splitext(name)
    return f"{stem}.{generation}{ext}"


def _listing(names: list[str], most: int = 5) -> str:
    names = sorted(names)
    shown = ", ".join(repr(n) for n in names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def our_manifest(path: str) -> Manifest | JobManifest | None:
    """The manifest of directory ``path`` if it is one of ours (a process's or a job's) that parses and
    whose checksum holds, else None."""
    try:
        return parse(raw_manifest(path), path, os.path.join(path, MANIFEST))
    except CheckpointError:
        return None


def is_our_format(path: str, formats: tuple = (FORMAT, JOB_FORMAT)) -> bool:
    """Whether directory ``path`` has a manifest that says it is one of our checkpoints (of one of
    ``formats``: a process's or a job's), unchecked."""
    manifest = raw_manifest(path)
    return isinstance(manifest, dict) and manifest.get("format") in formats


def named_files(manifest: Manifest | JobManifest | None) -> dict[str, set[str]]:
    """Every file that ``manifest`` names, by the directory it is in (``""`` for its own, else a shard's
    name): the files a later save may delete once it has committed."""
    if manifest is None:
        return {}
    if isinstance(manifest, Manifest):
        return {"": {e.on_disk(n) for n, e in manifest.files.items()}}
    return {s.name: {e.on_disk(n) for n, e in s.files.items()} | {s.manifest} for s in manifest.shards}


def _leftovers_only(path: str) -> bool:
    """Whether directory ``path`` holds nothing but what saves that died left (generation files, and
    shard directories of only those)."""
    for n in os.listdir(path):
        p = os.path.join(path, n)
        if (_GENERATION_FILE.match(n) or n == LOCK_FILE) and stat.S_ISREG(os.lstat(p).st_mode):
            continue
        if SHARD_NAME.match(n) and stat.S_ISDIR(os.lstat(p).st_mode) and _leftovers_only(p):
            continue
        return False
    return True


def checkpoint_problem(path: str) -> str | None:
    """None if directory ``path`` holds a checkpoint of ours whose manifest's checksum holds (so a save
    may write its next generation there and retention may delete it); else why not."""
    if not os.path.lexists(os.path.join(path, MANIFEST)):
        return f"is not an nvme-offload checkpoint (no {MANIFEST}; it holds {_listing(_user_names(path))})"
    if not is_our_format(path):
        return f"has a {MANIFEST} that is not an nvme-offload checkpoint's"
    try:
        parse(raw_manifest(path), path, os.path.join(path, MANIFEST))
    except CheckpointError as err:
        return (f"has an nvme-offload {MANIFEST} that fails its checksum or its checks (corrupt or edited: {err}), "
                "so which of its files belong to the checkpoint cannot be told")
    return None


# NOTE: a save writes its files under fresh names into the directory it is given and commits them by
# renaming its manifest onto manifest.json; afterwards it deletes the files the previous manifest named.
# So it must only be given a directory that holds nothing of the user's a manifest could name, and one
# where no other tool keeps a manifest.json: missing, empty, one of our checkpoints (its manifest's
# checksum good: a corrupt one cannot say which files are the checkpoint's), or what saves that died
# left there. A user's file inside one of our checkpoints is never named by a manifest and stays.
# Refusals are FileExistsError (an OSError with the path, as os.mkdir raises for a name that is taken),
# not CheckpointError: nothing is wrong with any checkpoint, the name is taken by something else.
def check_target(path: str, given: str) -> None:
    """Refuse directory ``path`` (the real path of the ``given`` one), with FileExistsError, unless a save
    may write there."""
    name = given if given == path else f"{given} (a link to {path})"
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise FileExistsError(_errno.EEXIST, f"checkpoint path {name} is a symbolic link that does not resolve "
                              "(a loop); point it at a directory or remove it", given)
    if not stat.S_ISDIR(st.st_mode):
        raise FileExistsError(_errno.EEXIST, f"checkpoint path {name} is a file, not a checkpoint directory; not "
                              f"writing there: {_WHAT_TO_DO.replace('this one', 'the file')}", given)
    if _leftovers_only(path):
        return
    problem = checkpoint_problem(path)
    if problem is not None:
        raise FileExistsError(_errno.EEXIST, f"checkpoint path {name} exists and {problem}. A save writes only "
                              "into an nvme-offload checkpoint or an empty directory: " + _WHAT_TO_DO, given)


def sweep(path: str, manifest: Manifest | JobManifest | None, shard: str | None = None, *,
          unlink: Callable[[str], None] = os.unlink) -> None:
    """Delete what saves that died left in ``path`` (or in its shard directory ``shard`` only): files of
    a generation's name that ``manifest``, the directory's own, does not name. Run under the directory's
    lock (or, for a shard, by the only rank that writes it), so no save in progress owns them."""
    named = named_files(manifest)
    where = [shard] if shard is not None else ["", *(n for n in os.listdir(path) if SHARD_NAME.match(n))]
    for sub in where:
        d = os.path.join(path, sub)
        keep = named.get(sub, set())
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            for n in os.listdir(d):
                if _GENERATION_FILE.match(n) and n not in keep:
                    with contextlib.suppress(FileNotFoundError):
                        unlink(os.path.join(d, n))
            if sub and sub != shard and not os.listdir(d):
                os.rmdir(d)


def delete_named(path: str, old: dict[str, set[str]], new: dict[str, set[str]], *,
                 unlink: Callable[[str], None] = os.unlink) -> None:
    """Unlink the regular files ``old`` names (see :func:`named_files`) that ``new`` does not, then the
    shard directories this leaves empty. Errors become warnings: this runs once a save has committed."""
    try:
        for sub, names in old.items():
            d = os.path.join(path, sub)
            for n in names - new.get(sub, set()):
                p = os.path.join(d, n)
                with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                    if stat.S_ISREG(os.lstat(p).st_mode):
                        unlink(p)
            if sub and sub not in new:
                with contextlib.suppress(OSError):
                    os.rmdir(d)  # only if empty: a user's file in it stays, and so does the directory
    except OSError as err:
        warnings.warn(f"could not delete the previous checkpoint's files in {path}: {err}", RuntimeWarning,
                      stacklevel=3)


def remove_checkpoint(path: str) -> bool:
    """Delete checkpoint ``path``: the files its manifest names, then the manifest, then the directory
    if nothing else is in it (else it stays, with a warning). Refused, with a warning, where ``path``
    is not a checkpoint of ours. True if the directory is gone."""
    problem = "is a symbolic link" if os.path.islink(path) else checkpoint_problem(path)
    if problem is not None:
        warnings.warn(f"not deleting {path}: it {problem}", RuntimeWarning, stacklevel=2)
        return False
    # The manifest first: a deletion cut short leaves no checkpoint that lacks files, only files of a
    # generation's name that no manifest names, which the next prune deletes (remove_leftovers).
    named = named_files(our_manifest(path))
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(path, MANIFEST))
    delete_named(path, named, {})
    return _remove_directory(path, warn=True)


def _user_names(path: str) -> list[str]:
    """What directory ``path`` holds, but its lock file."""
    return [n for n in os.listdir(path) if n != LOCK_FILE]


def _remove_directory(path: str, *, warn: bool) -> bool:
    """Remove checkpoint directory ``path`` once only its lock file is left (deleted first: the caller holds
    the lock, and a process waiting for it opens it again, finding no directory); True if it is gone. A user's
    file keeps it in place (with a warning, if ``warn``)."""
    if not _user_names(path):
        lock = os.path.join(path, LOCK_FILE)
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISREG(os.lstat(lock).st_mode):
                os.unlink(lock)
        try:
            os.rmdir(path)
            return True
        except OSError as err:
            if err.errno not in (_errno.ENOTEMPTY, _errno.EEXIST):
                raise
    if warn:  # a user's file, or one made after the lock's removal (a waiting process opened the lock again)
        warnings.warn(f"left {path} in place: besides a checkpoint's files it holds "
                      f"{_listing(_user_names(path) or os.listdir(path))}, which are not ours to delete",
                      RuntimeWarning, stacklevel=3)
    return False


def remove_leftovers(path: str) -> bool:
    """Delete directory ``path`` if all it holds is what saves that died (or a deletion cut short) left:
    no manifest, only files of a generation's name. Run under its lock. True if it is gone."""
    if os.path.lexists(os.path.join(path, MANIFEST)) or not _leftovers_only(path):
        return False
    sweep(path, None)
    try:
        return _remove_directory(path, warn=False)
    except OSError:
        return False


def used_elsewhere(path: str) -> int | None:
    """The id of another process with a file under directory ``path`` open (or it as its working
    directory), or None. Linux's /proc; processes this one may not look into are not seen."""
    prefix = os.path.realpath(path) + os.sep
    lock = prefix + LOCK_FILE  # open only to take the lock, which decides by itself
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
            if (target + os.sep).startswith(prefix) and target != lock:
                return pid
    return None
