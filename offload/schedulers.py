"""DeepSpeed's learning-rate schedules (``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``) as torch schedulers.

Each is a ``torch.optim.lr_scheduler.LRScheduler``: ``step()``, ``get_last_lr()``, ``state_dict()`` and the
Hugging Face Trainer work as with torch's own, and the learning rates are DeepSpeed's, step for step: the same
formulas (``deepspeed/runtime/lr_schedules.py``), the same rate set at construction, the same order of
operations in floating point. DeepSpeed counts ``last_batch_iteration`` from -1 at construction and steps the
schedule after each optimizer step; torch counts ``last_epoch`` from 0 after its constructor's first step, so
``last_batch_iteration == last_epoch - 1`` throughout.
"""

from __future__ import annotations

import math
from typing import Sequence, Union

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

__all__ = ["WarmupCosineLR", "WarmupDecayLR", "WarmupLR"]

_WARMUP_TYPES = ("log", "linear")
Rates = Union[float, Sequence[float]]


class WarmupLR(LRScheduler):
    """DeepSpeed's ``WarmupLR``: from ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps`` steps
    (logarithmically, or linearly with ``warmup_type="linear"``), then ``warmup_max_lr``.

    At construction every group's rate is ``warmup_min_lr`` (the first step runs at it); after the optimizer's
    step ``k`` (from 0), ``step()`` sets ``min + (max - min) * gamma(k)``, ``gamma`` being ``log(k + 1) /
    log(n)`` or ``k / n`` below ``n = max(2, warmup_num_steps)``, else 1.

    Args:
        optimizer: the optimizer whose groups' ``lr`` it sets.
        warmup_min_lr, warmup_max_lr: a rate for every group, or one per group.
        warmup_num_steps: steps of warmup (at least 2 are used, as in DeepSpeed).
        warmup_type: ``"log"`` or ``"linear"``.

    Raises:
        ValueError: a rate list of the wrong length, a negative step count, or an unknown warmup type.
    """

    def __init__(self, optimizer: Optimizer, warmup_min_lr: Rates = 0.0, warmup_max_lr: Rates = 0.001,
                 warmup_num_steps: int = 1000, warmup_type: str = "log"):
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.delta_lrs = [big - small for big, small in zip(self.max_lrs, self.min_lrs)]
        self.warmup_num_steps = max(2, _steps(warmup_num_steps, "warmup_num_steps"))
        self.warmup_type = _warmup_type(warmup_type)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        super().__init__(optimizer)

    @property
    def last_batch_iteration(self) -> int:
        """DeepSpeed's count: -1 before the first optimizer step, then the index of the last one."""
        return self.last_epoch - 1

    def get_lr(self) -> list[float]:
        """Each group's rate after the optimizer's last step (``warmup_min_lr`` before the first)."""
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._get_gamma()
        return [min_lr + (delta_lr * gamma) for min_lr, delta_lr in zip(self.min_lrs, self.delta_lrs)]

    def _warmup_gamma(self) -> float:
        if self.warmup_type == "log":
            return self.inverse_log_warm_up * math.log(self.last_batch_iteration + 1)
        return self.last_batch_iteration / self.warmup_num_steps

    def _get_gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_gamma()
        return 1.0


class WarmupDecayLR(WarmupLR):
    """DeepSpeed's ``WarmupDecayLR``: :class:`WarmupLR`'s warmup, then a linear decay to 0 at
    ``total_num_steps``: ``gamma = max(0, (total - k) / max(1, total - n))``.

    Args:
        total_num_steps: the step at which the rate reaches 0.
        others: as for :class:`WarmupLR`.
    """

    def __init__(self, optimizer: Optimizer, total_num_steps: int, warmup_min_lr: Rates = 0.0,
                 warmup_max_lr: Rates = 0.001, warmup_num_steps: int = 1000, warmup_type: str = "log"):
        self.total_num_steps = _steps(total_num_steps, "total_num_steps")
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type)

    def _get_gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_gamma()
        return max(0.0, float(self.total_num_steps - self.last_batch_iteration)
                   / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


# NOTE: DeepSpeed's WarmupCosineLR sets the rates at construction from get_lr() before its first step, which is
# the list [0.0], zipped with the groups: the first group starts at 0 and any other keeps the optimizer's rate
# for the first step. That is reproduced as it is, so a run matches DeepSpeed's from its first step.
class WarmupCosineLR(LRScheduler):
    """DeepSpeed's ``WarmupCosineLR``: each group's rate is its initial rate times a ratio that warms up from
    ``warmup_min_ratio`` to 1 over ``warmup_num_steps`` steps (log or linear), then follows a cosine down to
    ``cos_min_ratio`` at ``total_num_steps``.

    At construction the first group's rate is 0 (DeepSpeed's, see above); after the optimizer's step ``k``,
    below ``n = max(2, warmup_num_steps)`` the ratio is ``min_ratio + g * (1 - min_ratio)`` with ``g`` as in
    :class:`WarmupLR`, else ``max(0, cos_min + (1 - cos_min) * (1 + cos(pi * (k - n + 1) / (total - n))) / 2)``.

    Args:
        optimizer: the optimizer; its groups' current rates are the peaks.
        total_num_steps: the step the cosine ends at; more than the warmup's steps.
        warmup_min_ratio, warmup_num_steps, cos_min_ratio, warmup_type: as in DeepSpeed.

    Raises:
        ValueError: ``total_num_steps`` not above the warmup's steps (DeepSpeed would divide by zero there), a
            negative count, or an unknown warmup type.
    """

    def __init__(self, optimizer: Optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = "log"):
        self.total_num_steps = _steps(total_num_steps, "total_num_steps")
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.cos_min_ratio = float(cos_min_ratio)
        self.warmup_num_steps = max(2, _steps(warmup_num_steps, "warmup_num_steps"))
        if self.total_num_steps <= self.warmup_num_steps:
            raise ValueError(f"total_num_steps ({total_num_steps}) must be more than warmup_num_steps "
                             f"({self.warmup_num_steps}, at least 2): the cosine runs between them")
        self.warmup_type = _warmup_type(warmup_type)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self.org_lrs = [group["lr"] for group in optimizer.param_groups]
        super().__init__(optimizer)

    @property
    def last_batch_iteration(self) -> int:
        """DeepSpeed's count: -1 before the first optimizer step, then the index of the last one."""
        return self.last_epoch - 1

    def get_lr_ratio(self) -> float:
        """The ratio to the groups' initial rates after the optimizer's last step: the warmup's, then the cosine's."""
        if self.last_batch_iteration < self.warmup_num_steps:
            if self.warmup_type == "log":
                ratio = self.inverse_log_warm_up * math.log(self.last_batch_iteration + 1)
            else:
                ratio = self.last_batch_iteration / self.warmup_num_steps
            ratio_delta = 1. - self.warmup_min_ratio
            return self.warmup_min_ratio + ratio * ratio_delta
        real_last_step = self.last_batch_iteration - self.warmup_num_steps + 1
        real_total_steps = self.total_num_steps - self.warmup_num_steps
        ratio_delta = 1. - self.cos_min_ratio
        ratio = (1 + math.cos(math.pi * real_last_step / real_total_steps)) / 2
        return max(0.0, self.cos_min_ratio + ratio_delta * ratio)

    def get_lr(self) -> list[float]:
        """Each group's rate after the optimizer's last step (the first group's is 0 before the first)."""
        if self.last_batch_iteration < 0:
            return [0.0] + [group["lr"] for group in self.optimizer.param_groups[1:]]
        lr_ratio = self.get_lr_ratio()
        return [org_lr * lr_ratio for org_lr in self.org_lrs]


def _per_group(optimizer: Optimizer, value: Rates, name: str) -> list[float]:
    if isinstance(value, (list, tuple)):
        if len(value) != len(optimizer.param_groups):
            raise ValueError(f"{name} lists {len(value)} rates for {len(optimizer.param_groups)} parameter groups; "
                             "give one per group, or one number for all")
        return [float(v) for v in value]
    return [float(value)] * len(optimizer.param_groups)


def _steps(value: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a whole number of steps, at least 0, got {value!r}")
    return value


def _warmup_type(value: str) -> str:
    if value not in _WARMUP_TYPES:
        raise ValueError(f'warmup_type must be "log" or "linear", got {value!r}')
    return value
