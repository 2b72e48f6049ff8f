"""Progress bars (tqdm) for everything that can run longer than a few seconds: benchmarks, loads, saves, exports.

One rule everywhere: a bar goes to stderr, appears only once the work has lasted ``delay`` seconds (so quick
calls print nothing), and is shown where stderr is a terminal unless asked for or against. ``OFFLOAD_PROGRESS``
decides for a whole process: ``1`` shows every bar from its start to its end, even into a file or a pipe (a log),
``0`` hides them.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from collections.abc import Sized
from typing import Iterable, Iterator, Optional, TypeVar

from tqdm import tqdm

T = TypeVar("T")

__all__ = ["ENV", "progress", "shown", "tracked"]

ENV = "OFFLOAD_PROGRESS"
DELAY_S = 1.0  # seconds of work before a bar appears


def _forced() -> Optional[bool]:
    """What ``OFFLOAD_PROGRESS`` says: True (show), False (hide) or None (not set)."""
    value = os.environ.get(ENV, "").strip().lower()
    return True if value in ("1", "true", "yes", "on") else False if value in ("0", "false", "no", "off") else None


def shown(enabled: Optional[bool] = None) -> bool:
    """Whether to show a bar: ``enabled`` if given, else ``OFFLOAD_PROGRESS`` if set, else whether stderr is a
    terminal."""
    if enabled is not None:
        return bool(enabled)
    forced = _forced()
    if forced is not None:
        return forced
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


# NOTE: tqdm guards its bars with a class-wide lock that includes a multiprocessing semaphore, shared by every
# process forked after it was made. A process killed (SIGKILL, OOM) while it held it, in the middle of a save
# say, leaves it taken for good: every sibling's next bar, and so its save, then waits for ever. The library's
# bars only need to keep this process's threads apart, so their class has a lock of its own, of threads only.
class _Bar(tqdm):
    """tqdm with a lock that no other process shares."""


_Bar.set_lock(threading.RLock())
_Bar._instances = weakref.WeakSet()  # their screen positions too, changed under that lock only


def progress(total: Optional[float] = None, desc: str = "", *, unit: str = "it", nbytes: bool = False,
             enabled: Optional[bool] = None, delay: float = DELAY_S, leave: bool = False) -> tqdm:
    """A tqdm bar on stderr.

    Args:
        total: the amount of work (``None``: unknown, the bar counts and shows the time spent).
        desc: what is being done, as the bar's label.
        unit: what ``update(n)`` counts (``nbytes``: bytes, shown in KiB, MiB, GiB).
        enabled: show it (True), never (False), or decide by :func:`shown` (None).
        delay: seconds before the bar first appears.
        leave: keep the finished bar on screen (else it is cleared, leaving room for the results).
    """
    kwargs = dict(unit="B", unit_scale=True, unit_divisor=1024) if nbytes else dict(unit=unit)
    if _forced():
        delay, leave = 0.0, True  # asked for in a log: every bar, from its start to its last state
    return _Bar(total=total, desc=desc, delay=delay, leave=leave, disable=not shown(enabled), dynamic_ncols=True,
                file=sys.stderr, **kwargs)


def tracked(items: Iterable[T], desc: str, *, total: Optional[int] = None, enabled: Optional[bool] = None,
            delay: float = DELAY_S) -> Iterator[T]:
    """``items`` with a bar counting them (:func:`progress`); ``total`` defaults to ``len(items)``."""
    if total is None and isinstance(items, Sized):
        total = len(items)
    with progress(total, desc, enabled=enabled, delay=delay) as bar:
        for item in items:
            yield item
            bar.update(1)
