"""What the optimizer's writes mean for the drives: said once per process, in terabytes per day of training, and
as a WARNING only where it matters for the drives the swap files are on."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable, Iterable, Optional

__all__ = ["WEAR_WARN_BYTES_PER_DAY", "WEAR_WINDOW_S", "WearMeter", "drive_bytes", "wear_threshold"]

log = logging.getLogger("offload")

# Where the drives' size is unknown, the figure is a WARNING from this many bytes written per day: about one
# drive write per day of a 2 TB consumer NVMe drive, whose endurance rating (600-1200 TB written) it would use
# up within a few years of training, or within months at several times the rate.
WEAR_WARN_BYTES_PER_DAY = 2 * 10**12
# Seconds of training the rate is measured over before anything is said: a run shorter than this (an example, a
# test, a smoke run) wears nothing worth a word, and a rate over many steps is a truer projection than two.
WEAR_WINDOW_S = 60.0


# NOTE: how we decide that the writes matter. A projection to a day means something only for a run that goes on:
# so nothing is said before WEAR_WINDOW_S seconds of steps, and a short run (every example, every toy) says
# nothing at all. After that window the rate seen over it (bytes written by the optimizer between its second
# step and the step that closes the window) is projected to a day and held against the drives it lands on: one
# whole drive write per day (the capacity of the file systems holding the swap files) is a WARNING. A consumer
# drive is rated for roughly 0.3-0.6 drive writes per day over five years, so a run writing its whole drive every
# day uses the rating up within one or two years of training; below that the figure is INFO. Said once per
# process, however many optimizers it holds, so a job with several does not repeat it.
class _Once:
    """Whether the process has said it (a test passes its own)."""

    def __init__(self):
        self.said = False
        self.lock = threading.Lock()

    def claim(self) -> bool:
        with self.lock:
            if self.said:
                return False
            self.said = True
            return True


PROCESS = _Once()


def drive_bytes(paths: Iterable[str]) -> int:
    """The capacity of the file systems holding ``paths``, each counted once (0 where none can be read)."""
    seen, total = set(), 0
    for p in paths:
        try:
            st, dev = os.statvfs(p), os.stat(p).st_dev
        except OSError:
            continue
        if dev not in seen:
            seen.add(dev)
            total += st.f_blocks * st.f_frsize
    return total


def wear_threshold(paths: Iterable[str]) -> int:
    """Bytes per day from which the writes matter for the drives of ``paths``: one drive write per day of their
    file systems, or :data:`WEAR_WARN_BYTES_PER_DAY` where their size is unknown."""
    return drive_bytes(paths) or WEAR_WARN_BYTES_PER_DAY


class WearMeter:
    """Once per process, after :data:`WEAR_WINDOW_S` seconds of steps: the bytes the optimizer writes per day at
    the rate seen over that window (whole iterations: forward, backward, step), on logger ``offload``; a WARNING
    from ``threshold`` bytes per day (one drive write per day of the swap files' drives), else INFO.

    Args:
        paths: the swap directories (none: state in host memory, nothing to say).
        threshold: bytes per day from which it is a WARNING (default: :func:`wear_threshold` of ``paths``).
        window: seconds of steps to measure over before saying anything.
        clock: seconds, monotonic (a parameter for tests).
        once: what remembers that the process has said it (a parameter for tests).
    """

    def __init__(self, paths: Iterable[str] = (), *, threshold: Optional[int] = None, window: float = WEAR_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic, once: _Once = PROCESS):
        self.paths = list(paths)
        self.threshold = threshold if threshold is not None else wear_threshold(self.paths)
        self.window = window
        self.clock = clock
        self.once = once
        self._start: Optional[tuple[float, int]] = None  # (time, bytes written) at the first step after writes
        self._steps = 0  # steps since

    def step(self, written: int) -> None:
        """After a step; ``written``: the optimizer's bytes written so far."""
        if not self.paths or self.once.said:
            return
        now = self.clock()
        if self._start is None:
            if written:  # the first step creates the state: measure from the one after it
                self._start = (now, written)
            return
        self._steps += 1
        elapsed, moved = now - self._start[0], written - self._start[1]
        if elapsed < self.window or moved <= 0 or not self.once.claim():
            return
        per_day = moved * 86400 / elapsed
        warn = per_day >= self.threshold
        drives = f"{self.threshold / 1e12:.1f} TB, the capacity of the swap files' drives"
        advice = (f", over one drive write per day ({drives}): check the drives' endurance rating (TBW); a "
                  'host_cache or state_dtype "bf16" writes less')
        log.log(logging.WARNING if warn else logging.INFO,
                "the optimizer writes %.1f TB of optimizer state per day of training at the rate of its last %.0f s "
                "(%.2f GiB per step, one step every %.2f s; offloaded weights and grads come on top)%s",
                per_day / 1e12, elapsed, moved / self._steps / (1 << 30), elapsed / self._steps,
                advice if warn else "")
