"""Ctrl-C (SIGINT) held off while the library's state is in flux, and delivered where it leaves nothing half
done."""

from __future__ import annotations

import contextlib
import functools
import signal
import sys
import threading
from typing import Callable, Iterator, Optional

__all__ = ["deferred", "deferring", "holding", "safe_point"]


class _Held(threading.local):
    def __init__(self) -> None:
        self.depth = 0
        self.previous: Optional[Callable] = None  # the SIGINT handler in place before the outermost deferred()
        self.pending: list = []  # (signum, frame) of each SIGINT held off
        self.urgent = False  # the innermost deferred() lets a safe point deliver the first one


_held = _Held()


# NOTE: a KeyboardInterrupt is raised between any two bytecodes of the main thread. Landing between a pool
# buffer's take and its give, between a unit's capture and its completion, or inside a commit, it left
# buffers lost (the next step: IndexError from an empty pool), waits that no one would end, or state half
# written. So the library's work that must not be cut anywhere runs inside deferred(): SIGINT is then only
# recorded, and delivered (the previous handler called: KeyboardInterrupt by default, or the user's own) when
# the block ends, or at a safe_point() of a loop that can stop cleanly between two items (a save, a load):
# there the exception unwinds through code written for errors at that very place. A step is not cut by the
# first Ctrl-C (a step cut part-way leaves state that must be restored): it finishes, then the interrupt is
# delivered; a second Ctrl-C stops it at its next unit. Only the main thread receives signals; elsewhere, or
# where the SIGINT handler is not Python's (SIG_IGN, SIG_DFL), this does nothing.
@contextlib.contextmanager
def deferred(*, urgent: bool = True) -> Iterator[None]:
    """Hold SIGINT off for the block, delivering it at its end (or at a :func:`safe_point` inside it).

    Args:
        urgent: a safe point delivers the first Ctrl-C (a save, a load); False: only a second one, the first
            waiting for the block's end (a step, which a cut would leave half done).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    outer = _held.depth == 0
    if outer:
        previous = signal.getsignal(signal.SIGINT)
        if not callable(previous):
            yield  # SIGINT is ignored, or not Python's to handle
            return
        _held.previous, _held.pending = previous, []
        signal.signal(signal.SIGINT, _hold)
    was_urgent, _held.urgent = _held.urgent, urgent if outer else (_held.urgent and urgent)
    _held.depth += 1
    try:
        yield
    finally:
        _held.depth -= 1
        _held.urgent = was_urgent
        if outer:
            now = signal.getsignal(signal.SIGINT)
            handler = _held.previous
            if now is _hold:
                signal.signal(signal.SIGINT, handler)
            else:  # the block installed a handler of its own (the user's code, called back): it stays, and gets it
                handler = now if callable(now) else None
            pending, _held.pending = _held.pending, []
            if pending and callable(handler):
                _deliver(handler, pending[0])


def holding() -> bool:
    """Whether this thread holds SIGINT off now (inside :func:`deferred`): a long wait there must then poll
    :func:`safe_point`, or a Ctrl-C would not end it."""
    return _held.depth > 0 and threading.current_thread() is threading.main_thread()


def safe_point() -> None:
    """Where the caller can stop cleanly: deliver a SIGINT held off by :func:`deferred` (the first one where
    it is urgent, else a second one), raising what its handler raises (KeyboardInterrupt)."""
    pending = _held.pending
    if _held.depth and pending and (_held.urgent or len(pending) > 1):
        _held.pending = []
        _deliver(_held.previous, pending[-1])


def _hold(signum, frame) -> None:
    _held.pending.append((signum, frame))
    if len(_held.pending) == 1 and not _held.urgent:
        print("\nnvme-offload: interrupted; finishing this optimizer step first, so that its state stays whole "
              "(Ctrl-C again stops it now: restore the state with load_checkpoint() then)", file=sys.stderr,
              flush=True)


def _deliver(handler, event) -> None:
    signum, frame = event
    handler(signum, frame)


def deferring(fn: Optional[Callable] = None, *, urgent: bool = True):
    """``fn`` run inside :func:`deferred` (a decorator, with or without ``urgent=``)."""

    def wrap(f: Callable) -> Callable:
        @functools.wraps(f)
        def inner(*args, **kwargs):
            with deferred(urgent=urgent):
                return f(*args, **kwargs)

        return inner

    return wrap(fn) if fn is not None else wrap
