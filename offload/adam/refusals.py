"""What the optimizer refuses, or ends, while an update that backward started (overlap_backward) runs.

They take the optimizer's :class:`offload.overlap.BackwardOverlap`, or (all but ``refuse_scaler_in_overlap``)
None without overlap_backward, where they do nothing.
"""

from __future__ import annotations

from typing import Callable, Optional

from ..errors import StateError
from ..overlap import BackwardOverlap

__all__ = [
    "abandon", "abandon_backward_step", "refuse_during_backward_step", "refuse_in_overlap", "refuse_scaler_in_overlap",
]


def refuse_during_backward_step(overlap: Optional[BackwardOverlap], what: str) -> None:
    """With overlap_backward, between a backward and step() the step is running on the pool: what
    reads or changes the state then would race it.

    Raises:
        StateError: such a step is running.
    """
    if overlap is not None and overlap.running:
        raise StateError(f"{what} was called between backward and step() with overlap_backward=True, while "
                         "the update that backward started is still running: call step() first.")


def abandon(overlap: Optional[BackwardOverlap], err: BaseException) -> None:
    """A step left running by a backward (or failed in it) ends with ``err``."""
    if overlap is not None:
        overlap.abandon(err)


def abandon_backward_step(overlap: Optional[BackwardOverlap], what: str) -> None:
    """A load replaces the state: a step left running by a backward (or failed in it) ends first."""
    if overlap is not None and overlap.running:
        overlap.abandon(StateError(f"{what} replaced the state during an overlapped step"))


def refuse_in_overlap(overlap: Optional[BackwardOverlap], mark_failed: Callable[[BaseException], None], *,
                      closure: Optional[Callable], scaler: bool) -> None:
    """What overlap_backward cannot honour in step(), refused when first seen (the state is then failed: the
    updates of the backward just run used grads that were not meant to be stepped on as they were).

    Args:
        closure: step()'s closure.
        scaler: whether a GradScaler handed step() its scale or found infs.

    Raises:
        ValueError: a closure.
        StateError: a GradScaler.
    """
    if overlap is None:
        return
    if closure is not None:
        raise ValueError("step(closure) cannot be used with overlap_backward=True: the update runs during "
                         "backward; call loss.backward() yourself, then step()")
    if scaler:
        refuse_scaler_in_overlap(overlap, mark_failed)


def refuse_scaler_in_overlap(overlap: BackwardOverlap, mark_failed: Callable[[BaseException], None]) -> None:
    """A GradScaler with overlap_backward: the step is abandoned and the state marked failed.

    Raises:
        StateError: always.
    """
    err = StateError(
        "a GradScaler cannot be used with overlap_backward=True: the update ran during backward on the "
        "scaled gradients, before the scaler could unscale them or skip an inf step. Restore the state "
        "(load_checkpoint), then train without the GradScaler (bf16 autocast needs none) or without "
        "overlap_backward.")
    overlap.abandon(err)
    mark_failed(err)
    raise err
