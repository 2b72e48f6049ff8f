"""Periodic checkpoints under one root, and a mirror level: keep the last N plus milestones, delete only after a
newer one verified, never what is in use, and only what is ours."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import stat
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional

from ..aio import create_private
from ..commit import fsync_fd, fsync_path
from ..distributed import rank_info
from ..errors import CheckpointError
from .commit import SaveHandle, lock_directory
from .format import DEFAULT_STORAGE, JOB_FORMAT
from .job import gather, job_world
from .load import load_checkpoint
from .manifest import raw_manifest, read
from .ownership import is_our_format, remove_checkpoint, remove_leftovers, used_elsewhere
from .save import save
from .verify import verify_checkpoint, verify_job

log = logging.getLogger("offload")


@dataclass
class _Entry:
    step: int
    path: str


class Retention:
    """Periodic checkpoints under ``root``: keep the last ``keep_last`` plus milestones, on one or two levels.

    Checkpoints are named ``step-<step>`` (zero-padded). A milestone is kept for good: a step for
    which ``milestones`` says so (a set of steps, or a function of the step), or one saved with
    ``milestone=True`` (marked by a ``step-<step>.keep`` file next to it; delete that file to let
    it go). An older checkpoint is deleted only once a newer one has been read back and verified
    (the newest verified one is never deleted), only the files its manifest names, and never while
    it is in use: a process reading it (``reading()``, a load, a verify) or holding one of its files
    open makes pruning it wait for the next save. A ``step-<n>`` directory of someone else's is left
    alone, and so is a user's file inside one of ours (its directory stays, with a warning).

    Args:
        root: the directory holding the checkpoints.
        keep_last: how many of the newest to keep (besides milestones).
        milestones: steps to keep for good, or a function of the step saying so.
        verify: read every new checkpoint back and verify it before pruning older ones.
        mirror: a second level (another drive, a network mount): a ``Retention`` with its own
            ``keep_last`` and ``milestones``, or a directory (then the same ones as this level).
            Every committed checkpoint is copied there in the background and verified after the
            copy; loading falls back to it (:meth:`load_latest`).

    Example::

        keep = Retention("/ckpt", keep_last=2, milestones=lambda step: step % 10_000 == 0,
                         mirror=Retention("/mnt/remote/ckpt", keep_last=4))
        path, extra = keep.load_latest(opt, model=model)
        ...
        keep.save(opt, step, model=model, extra={"step": step}, blocking=False)
    """

    _NAME = re.compile(r"^step-(\d+)$")

    def __init__(self, root: str | os.PathLike, keep_last: int = 2,
                 milestones: Iterable[int] | Callable[[int], bool] = (), *, verify: bool = True,
                 mirror: Retention | str | os.PathLike | None = None):
        if not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1:
            raise ValueError(f"keep_last must be at least 1, got {keep_last!r}")
        self.root = os.path.abspath(os.fspath(root))
        self.keep_last = keep_last
        self._is_milestone = milestones if callable(milestones) else set(milestones).__contains__
        self.verify = verify
        if mirror is not None and not isinstance(mirror, Retention):
            mirror = Retention(mirror, keep_last, milestones, verify=verify)
        if mirror is not None and os.path.realpath(mirror.root) == os.path.realpath(self.root):
            raise ValueError(f"the mirror level {mirror.root} is this level's own directory; give another drive "
                             "or a network mount")
        self.mirror: Optional[Retention] = mirror
        self._verified: dict[str, str] = {}  # path -> manifest checksum of the checkpoint verified there

    def path_for(self, step: int) -> str:
        """The directory of ``step``'s checkpoint at this level (``step-`` and ten digits)."""
        return os.path.join(self.root, f"step-{int(step):010d}")

    def checkpoints(self) -> list[str]:
        """Checkpoints (``step-<n>`` directories with a manifest of ours), oldest first."""
        return [e.path for e in self._entries()]

    def _named(self) -> list[_Entry]:
        """Every ``step-<n>`` name under the root, ours or not."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        return [_Entry(int(m[1]), os.path.join(self.root, n)) for n in names if (m := self._NAME.match(n))]

    def _entries(self) -> list[_Entry]:
        return sorted((e for e in self._named() if is_our_format(e.path)), key=lambda e: e.step)

    def latest(self) -> Optional[str]:
        """The newest complete checkpoint of this level, or None."""
        found = self.checkpoints()
        return found[-1] if found else None

    def is_milestone(self, path: str) -> bool:
        """Whether the checkpoint at ``path`` is kept for good: a milestone's step, or a ``.keep`` file beside it."""
        m = self._NAME.match(os.path.basename(path))
        return os.path.exists(path + ".keep") or (m is not None and bool(self._is_milestone(int(m[1]))))

    def save(self, optimizer, step: int, *, model=None, extra: Any = None, milestone: bool = False,
             blocking: bool = True, snapshot: str = "auto", progress: Optional[bool] = None,
             alone: bool = False) -> str | SaveHandle:
        """Save ``step`` (with ``model``'s weights if given), verify it, then delete what is no longer kept;
        with a mirror level, copy it there in the background and prune that level once the copy is verified.
        The arguments are :func:`offload.checkpoint.save_checkpoint`'s; with ``blocking=False`` the
        verification and pruning follow the commit in the background.
        """
        DEFAULT_STORAGE.make_dirs(self.root)  # durably: a power loss must not take the root away

        def then(path: str) -> None:
            if milestone:
                _mark(path)
            if self.verify:
                _verify(path)
                self._remember(path)
            self.prune()

        def then_mirror(copy: str) -> None:
            if milestone:
                _mark(copy)
            self.mirror._remember(copy)  # verified as it was copied
            self.mirror.prune()

        return save(optimizer, self.path_for(step), model=model, extra=extra, blocking=blocking,
                     mirror=None if self.mirror is None else self.mirror.path_for(step), snapshot=snapshot,
                     progress=progress, then=then, then_mirror=then_mirror, alone=alone)

    def prune(self) -> list[str]:
        """Delete checkpoints beyond the last ``keep_last`` that are not milestones, as the class says (older
        than the newest that verifies, ours, not in use: else left to the next save); returns them."""
        self._remove_leftovers()
        found = self.checkpoints()
        doomed = [p for p in found[: max(0, len(found) - self.keep_last)] if not self.is_milestone(p)]
        if not doomed:
            return []
        good = self._newest_good(found)
        if good is None:
            warnings.warn(f"not pruning {self.root}: none of its checkpoints verifies", RuntimeWarning, stacklevel=2)
            return []
        removed = []
        for path in doomed:
            if found.index(path) >= found.index(good):
                continue
            if not self._remove(path):
                continue
            self._verified.pop(path, None)
            removed.append(path)
        return removed

    def _remove_leftovers(self) -> None:
        """Delete ``step-<n>`` directories that hold only what a save or a deletion cut short left."""
        for path in (e.path for e in self._named()):
            if not is_our_format(path) and os.path.isdir(path):
                with _locked_now(path) as free:
                    if free:  # else a save is writing it
                        remove_leftovers(path)

    def _remove(self, path: str) -> bool:
        """Delete checkpoint ``path`` unless it is in use: read or written (its lock) or held open by
        another process; True if it is gone."""
        with _locked_now(path) as free:
            if not free:
                log.info("not deleting %s now: it is being read or written", path)
                return False
            pid = used_elsewhere(path)
            for _ in range(_USE_RETRIES):  # another rank pruning the same directory reads a manifest briefly
                if pid is None:
                    break
                time.sleep(_USE_WAIT)
                pid = used_elsewhere(path)
            if pid is not None:
                log.info("not deleting %s now: process %d has a file of it open", path, pid)
                return False
            return remove_checkpoint(path)

    def load_latest(self, optimizer, *, model=None, alone: bool = False) -> tuple[Optional[str], Any]:
        """Load the newest checkpoint that loads, from this level or else from the mirror level; returns
        ``(its directory, its extra)``, or ``(None, None)`` when there is none.

        A checkpoint missing or corrupt here is loaded from the mirror's copy; one that loads from
        neither is skipped for the next older one, with a ``RuntimeWarning``.

        In a job of several ranks (torch.distributed) every rank calls it and the ranks load the same
        step (see :func:`offload.checkpoint.load_checkpoint`), unless ``alone``.

        Raises:
            CheckpointError: there are checkpoints, and none of them loads (the newest's error chained).
        """
        job = not alone and job_world() is not None
        steps = {e.step for e in self._entries()}
        if job:  # the ranks try the same steps, newest first: every step any rank has here
            steps = set().union(*gather(sorted(steps), f"listing {self.root}"))
        elif self.mirror is not None:
            steps |= {e.step for e in self.mirror._entries()}
        first = None
        for step in sorted(steps, reverse=True):
            copies = [self.path_for(step)] + ([self.mirror.path_for(step)] if self.mirror and not job else [])
            for path in [p for p in copies if job or os.path.isdir(p)]:
                try:
                    return path, load_checkpoint(optimizer, path, model=model, alone=alone)
                except Exception as err:  # a job's load raises on every rank alike; all go on
                    if not (job or isinstance(err, (CheckpointError, OSError))):
                        raise
                    # A corruption found while streaming has overwritten part of the state: the next
                    # copy's load replaces it whole.
                    first = first or err
                    warnings.warn(f"{path} does not load ({err}); trying the "
                                  + ("mirror's copy" if path != copies[-1] else "next older checkpoint"),
                                  RuntimeWarning, stacklevel=2)
        if first is not None:
            raise CheckpointError(f"no checkpoint under {self.root}" + (f" or {self.mirror.root}" if self.mirror
                                                                          else "") + " loads") from first
        return None, None

    # -- verification -------------------------------------------------------------------------------

    def _remember(self, path: str) -> None:
        digest = _manifest_checksum(path)
        if digest is not None:
            self._verified[path] = digest

    def _newest_good(self, found: list[str]) -> Optional[str]:
        """The newest of ``found`` that verifies (without ``verify``: the newest)."""
        if not self.verify:
            return found[-1] if found else None
        for path in reversed(found):
            if self._verified.get(path) is not None and self._verified[path] == _manifest_checksum(path):
                return path
            try:
                _verify(path)
            except (CheckpointError, OSError) as err:
                warnings.warn(f"{path} does not verify ({err}); older checkpoints are kept", RuntimeWarning,
                              stacklevel=3)
                continue
            self._remember(path)
            return path
        return None


_USE_RETRIES, _USE_WAIT = 5, 0.1  # a file of a checkpoint open elsewhere for under half a second is not a use


@contextlib.contextmanager
def _locked_now(path: str) -> Iterator[bool]:
    """Hold directory ``path``'s lock exclusively if nobody holds it now; yields whether it is held."""
    try:
        held = lock_directory(path, exclusive=True, timeout=0)
    except (CheckpointError, OSError):
        held = None
    try:
        yield held is not None
    finally:
        if held is not None:
            held.release()


def _verify(path: str) -> None:
    """Verify checkpoint ``path``. A job's: on a rank of the job, its job manifest and this rank's own
    shard (every rank checks its own, once, whether or not the ranks share a file system); elsewhere
    the shards that are here."""
    if not is_our_format(path, (JOB_FORMAT,)):
        verify_checkpoint(path)
    elif job_world() is not None:
        verify_job(read(os.path.abspath(path)), ranks={rank_info().rank})
    else:
        verify_checkpoint(path, local=True)


def _manifest_checksum(path: str) -> Optional[str]:
    manifest = raw_manifest(path)
    return manifest.get("manifest_xxh3_64") if isinstance(manifest, dict) else None


def _mark(path: str) -> None:
    """Mark checkpoint ``path`` a milestone (``<path>.keep``), durably; a name planted there that is not a
    plain file (a link to someone's file) is refused, never followed."""
    keep = path + ".keep"
    try:
        with create_private(keep) as f:  # the marker's commit: created exclusively, fsynced, then its name
            fsync_fd(f.fileno(), keep)
    except FileExistsError:
        if not stat.S_ISREG(os.lstat(keep).st_mode):
            raise CheckpointError(f"cannot mark {path} as a milestone: {keep} exists and is not a plain file (a "
                                  "link?); it is left as it is. Remove it, then mark the step again") from None
        return  # marked before
    fsync_path(os.path.dirname(keep))


def save_with_retention(optimizer, root: str | os.PathLike, step: int, *, keep_last: int = 2,
                        milestones: Iterable[int] | Callable[[int], bool] = (), model=None, extra: Any = None,
                        milestone: bool = False, blocking: bool = True,
                        mirror: str | os.PathLike | None = None, alone: bool = False) -> str | SaveHandle:
    """``Retention(root, keep_last, milestones, mirror=mirror).save(optimizer, step, ...)`` in one call."""
    return Retention(root, keep_last, milestones, mirror=mirror).save(optimizer, step, model=model, extra=extra,
                                                                       milestone=milestone, blocking=blocking,
                                                                       alone=alone)
