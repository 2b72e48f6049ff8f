"""Processes: liveness of a pid, and resetting objects in a child after ``os.fork``."""

from __future__ import annotations

import os
import weakref

__all__ = ["pid_alive", "reset_after_fork"]


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (one we may not signal counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# NOTE: a forked child gets a copy of the parent's memory but only the thread that forked. Objects
# whose work runs on other threads (the engine's workers), or whose locks another thread may have
# held at the fork, must learn in the child that they are copies. Each registers itself here,
# weakly, and its ``_after_fork_in_child()`` runs in every child forked while it lives.
_registered: weakref.WeakSet = weakref.WeakSet()


def reset_after_fork(obj) -> None:
    """Call ``obj._after_fork_in_child()`` in every child forked while ``obj`` lives.

    The method must only reset ``obj``'s own state (it runs with the child's single thread, in no
    given order among the registered objects) and must not raise.
    """
    _registered.add(obj)


def _after_fork_in_child() -> None:
    for obj in list(_registered):
        try:
            obj._after_fork_in_child()
        except Exception:  # noqa: BLE001 - a failing reset must not kill the child; its object stays unusable
            pass


os.register_at_fork(after_in_child=_after_fork_in_child)
