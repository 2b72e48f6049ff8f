"""Periodic checkpoints under one root: keep the last N plus milestones, delete only after verifying,
and only what is ours."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

from .ownership import _is_our_format, _remove_checkpoint, _remove_ours
from .save import save_checkpoint
from .verify import verify_checkpoint


@dataclass
class _Entry:
    step: int
    path: str


class Retention:
    """Periodic checkpoints under ``root``: keep the last ``keep_last`` plus milestones.

    Checkpoints are named ``step-<step>`` (zero-padded). A milestone is kept for good: a step for
    which ``milestones`` says so (a set of steps, or a function of the step), or one saved with
    ``milestone=True`` (marked by a ``step-<step>.keep`` file next to it; delete that file to let
    it go). Older checkpoints are deleted only after the newest one has been read back and
    verified, and only if they are complete checkpoints of ours with nothing else in them: a
    ``step-<n>`` directory of someone else's, or one a user put a file into, is left alone (with a
    warning).

    Example::

        keep = Retention("/ckpt", keep_last=2, milestones=lambda step: step % 10_000 == 0)
        if keep.latest() is not None:
            extra = load_checkpoint(opt, keep.latest(), model=model)
        ...
        keep.save(opt, step, model=model, extra={"step": step})
    """

    _NAME = re.compile(r"^step-(\d+)$")
    _DELETING = re.compile(r"^step-\d+\.tmp-del-[0-9a-f]+$")  # a deletion that a crash interrupted

    def __init__(self, root: str | os.PathLike, keep_last: int = 2,
                 milestones: Iterable[int] | Callable[[int], bool] = (), *, verify: bool = True):
        if not isinstance(keep_last, int) or keep_last < 1:
            raise ValueError(f"keep_last must be at least 1, got {keep_last!r}")
        self.root = os.path.abspath(os.fspath(root))
        self.keep_last = keep_last
        self._is_milestone = milestones if callable(milestones) else set(milestones).__contains__
        self.verify = verify

    def path_for(self, step: int) -> str:
        return os.path.join(self.root, f"step-{int(step):010d}")

    def checkpoints(self) -> list[str]:
        """Checkpoints (``step-<n>`` directories with a manifest of ours), oldest first."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        found = []
        for n in names:
            m = self._NAME.match(n)
            if m and _is_our_format(os.path.join(self.root, n)):
                found.append(_Entry(int(m[1]), os.path.join(self.root, n)))
        return [e.path for e in sorted(found, key=lambda e: e.step)]

    def latest(self) -> Optional[str]:
        """The newest complete checkpoint, or None."""
        found = self.checkpoints()
        return found[-1] if found else None

    def is_milestone(self, path: str) -> bool:
        m = self._NAME.match(os.path.basename(path))
        return os.path.exists(path + ".keep") or (m is not None and bool(self._is_milestone(int(m[1]))))

    def save(self, optimizer, step: int, *, model=None, extra: Any = None, milestone: bool = False) -> str:
        """Save ``step`` (with ``model``'s weights if given), verify it, then delete what is no longer
        kept; returns its directory."""
        os.makedirs(self.root, exist_ok=True)
        path = save_checkpoint(optimizer, self.path_for(step), model=model, extra=extra)
        if milestone:
            with open(path + ".keep", "w"):
                pass
        if self.verify:
            verify_checkpoint(path)
        self.prune()
        return path

    def prune(self) -> list[str]:
        """Delete checkpoints beyond the last ``keep_last`` that are not milestones; returns them.

        Only a complete checkpoint of ours (its manifest's checksum good, no other files in it) is
        deleted; any other is left in place with a warning.
        """
        for n in os.listdir(self.root) if os.path.isdir(self.root) else ():
            if self._DELETING.match(n):
                _remove_ours(os.path.join(self.root, n), quiet=True)
        found = self.checkpoints()
        removed = []
        for path in found[: max(0, len(found) - self.keep_last)]:
            if not self.is_milestone(path) and _remove_checkpoint(path):
                removed.append(path)
        return removed


def save_with_retention(optimizer, root: str | os.PathLike, step: int, *, keep_last: int = 2,
                        milestones: Iterable[int] | Callable[[int], bool] = (), model=None, extra: Any = None,
                        milestone: bool = False) -> str:
    """``Retention(root, keep_last, milestones).save(optimizer, step, ...)`` in one call."""
    return Retention(root, keep_last, milestones).save(optimizer, step, model=model, extra=extra,
                                                       milestone=milestone)
