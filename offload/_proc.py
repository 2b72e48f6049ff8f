"""Processes: liveness of a pid, resetting objects in a child after ``os.fork``, and the C heap's free pages."""

from __future__ import annotations

import ctypes
import os
import weakref

__all__ = ["pid_alive", "release_free_heap", "reset_after_fork"]


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


# NOTE: weights fetched from NVMe live in storage torch allocates with malloc, tens of MiB each, freed again at
# their release. glibc keeps what is freed for reuse, and fragments of it pile up: measured with a Llama-style
# model (hidden 2560, batch of 64 tokens), the free pages held grew by about 40 MiB per layer over a step and
# 12 MiB per layer over a backward, 1.1 GiB of peak RSS at 2.7B parameters. malloc_trim(0) gives every arena's
# free pages back (madvise); later allocations fault them in again. It is called when a large weight is
# released and at the end of the optimizer's pass over offloaded weights, and does anything only once more
# than ``keep`` bytes lie free (mallinfo2, about 4 us), so a small model never pays the faults and the heap
# never holds more than that unused. Where the C library cannot say how much is free (musl; glibc before
# 2.33, whose mallinfo counts in int), this does nothing rather than trim every time.
class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


_libc = ctypes.CDLL(None)
_malloc_trim = getattr(_libc, "malloc_trim", None)
_mallinfo2 = getattr(_libc, "mallinfo2", None)
if _mallinfo2 is not None:
    _mallinfo2.restype = _MallInfo2


def release_free_heap(keep: int = 256 << 20) -> None:
    """Give the pages the C heap holds free back to the system (glibc's ``malloc_trim(0)``), once more than
    ``keep`` bytes of it are free."""
    if _malloc_trim is None or _mallinfo2 is None or _mallinfo2().fordblks <= keep:
        return
    _malloc_trim(0)
