"""What the optimizer's writes mean for the drives: said once, in terabytes per day of training."""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

__all__ = ["WEAR_WARN_BYTES_PER_DAY", "WearMeter"]

log = logging.getLogger("offload")

# Past this many bytes written per day the figure is a WARNING (else INFO): about one drive write per day of a
# 2 TB consumer NVMe drive, whose endurance rating (600-1200 TB written) it would use up within a few years of
# training, or within months at several times the rate.
WEAR_WARN_BYTES_PER_DAY = 2 * 10**12


class WearMeter:
    """Once, at the first step that writes after an earlier step: the bytes written per day at the rate seen
    between the two steps (a whole iteration: forward, backward, step), on logger ``offload``.

    Args:
        threshold: bytes per day from which the message is a WARNING.
        clock: seconds, monotonic (a parameter for tests).
    """

    def __init__(self, threshold: int = WEAR_WARN_BYTES_PER_DAY, clock: Callable[[], float] = time.monotonic):
        self.threshold = threshold
        self.clock = clock
        self.said = False
        self._last: Optional[tuple[float, int]] = None

    def step(self, written: int) -> None:
        """After a step; ``written``: the optimizer's bytes written so far."""
        if self.said:
            return
        now = self.clock()
        last, self._last = self._last, (now, written)
        if last is None or written == last[1] or now <= last[0]:
            return
        self.said = True
        per_day = (written - last[1]) * 86400 / (now - last[0])
        level = logging.WARNING if per_day >= self.threshold else logging.INFO
        advice = ": check your drives' endurance rating (TBW); a host_cache or state_dtype \"bf16\" writes less"
        log.log(level, "the optimizer writes %.1f TB of optimizer state per day of training at this rate (%.2f GiB "
                "per step, one step every %.2f s; offloaded weights and grads come on top)%s", per_day / 1e12,
                (written - last[1]) / (1 << 30), now - last[0], advice if level == logging.WARNING else "")
