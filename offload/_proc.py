"""Processes: liveness of a pid, resetting objects in a child after ``os.fork``, the C heap's free pages,
this process's memory figures, and who holds a lock on a file."""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import weakref

__all__ = ["heap_freed", "lock_holders", "pid_alive", "reset_after_fork", "reset_peak_rss", "status_bytes"]


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
        except Exception:  # a failing reset must not kill the child; its object stays unusable
            pass


os.register_at_fork(after_in_child=_after_fork_in_child)


# NOTE: weights fetched from NVMe live in storage torch allocates with malloc, tens of MiB each, freed again at
# their release. glibc keeps what is freed for reuse, and fragments of it pile up: measured with a Llama-style
# model (hidden 2560, batch of 64 tokens), the free pages held grew by about 40 MiB per layer over a step and
# 12 MiB per layer over a backward, 1.1 GiB of peak RSS at 2.7B parameters. malloc_trim(0) gives every arena's
# free pages back (madvise); later allocations fault them in again, and it takes milliseconds on a fragmented
# heap. So the parameter store reports each weight it frees here, and once ``every`` bytes have been freed
# since the last time, the heap is trimmed if more than that much lies free (mallinfo2 counts free bytes,
# given back or not, so that alone would trim on every release of a fragmented heap). A model whose weights
# are smaller than that never pays for it. Where the C library cannot say how much is free (musl; glibc
# before 2.33, whose mallinfo counts in int), this does nothing.
class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


_libc = ctypes.CDLL(None)
_malloc_trim = getattr(_libc, "malloc_trim", None)
_mallinfo2 = getattr(_libc, "mallinfo2", None)
if _mallinfo2 is not None:
    _mallinfo2.restype = _MallInfo2
_freed = 0  # bytes reported freed since the last trim
_freed_lock = threading.Lock()


def heap_freed(nbytes: int, *, every: int = 256 << 20) -> None:
    """``nbytes`` of heap memory were just freed (a released weight). Once ``every`` bytes were since the last
    trim, give the pages the C heap holds free back to the system (glibc's ``malloc_trim(0)``) if more than
    ``every`` bytes of it are free. Call it without holding locks others wait on: a trim takes milliseconds."""
    global _freed
    if _malloc_trim is None or _mallinfo2 is None:
        return
    with _freed_lock:
        _freed += nbytes
        if _freed < every:
            return
        _freed = 0
    if _mallinfo2().fordblks > every:
        _malloc_trim(0)


def status_bytes(key: str) -> int:
    """A byte count of this process from ``/proc/self/status`` (``VmRSS``, ``VmHWM``, ...).

    Raises:
        LookupError: the kernel does not report ``key`` (not Linux, or an old kernel).
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    raise LookupError(f"/proc/self/status has no {key}; memory cannot be measured here")


def reset_peak_rss() -> None:
    """Make ``VmHWM`` start again from the current RSS (Linux's ``clear_refs``, value 5). Raises ``OSError``
    where the kernel does not allow it."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def lock_holders(fd: int) -> list[str]:
    """The processes holding a lock (flock or fcntl) on the file open on ``fd``, each as ``"process PID
    (COMMAND, user NAME)"``, from Linux's /proc/locks; [] where it cannot be read."""
    st = os.fstat(fd)
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    pids = []
    for line in lines:
        parts = line.split()
        if "->" in parts or len(parts) < 6 or parts[5] != key:
            continue  # a waiter, or another file
        with contextlib.suppress(ValueError):
            pids.append(int(parts[4]))
    return [_describe(pid) for pid in dict.fromkeys(pids)]


def _describe(pid: int) -> str:
    """``"process PID (COMMAND, user NAME)"`` for ``pid``, as far as /proc tells."""
    command = user = "?"
    with contextlib.suppress(OSError), open(f"/proc/{pid}/comm") as f:
        command = f.read().strip()
    with contextlib.suppress(OSError, ValueError, StopIteration, IndexError):
        with open(f"/proc/{pid}/status") as f:
            user = next(line for line in f if line.startswith("Uid:")).split()[1]
        import pwd

        with contextlib.suppress(KeyError):
            user = pwd.getpwuid(int(user)).pw_name
    return f"process {pid} ({command}, user {user})"
