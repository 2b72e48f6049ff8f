"""The parent-directory lock of checkpoints: saves hold it alone, readers share it, and a thread that
holds it already counts up instead of waiting for itself."""

from __future__ import annotations

import errno as _errno
import fcntl
import os
import threading
import time

from ..errors import CheckpointError

# Parent locks held in this process, by (st_dev, st_ino, thread): [exclusive, count, fd].
_HELD: dict[tuple[int, int, int], list] = {}
_HELD_LOCK = threading.Lock()
_NO_LOCKS = (_errno.ENOLCK, _errno.EOPNOTSUPP, _errno.ENOTSUP, _errno.EINVAL, _errno.ENOSYS)


# NOTE: saves take the parent directory's flock exclusively for their whole duration, readers
# (``reading``) take it shared, so a load never sees a checkpoint being replaced under it, and a
# reader's recovery of a ``.old-`` sibling never runs between a save's two renames. flock locks
# belong to open files, so a second flock of the same thread on another descriptor would wait for
# itself: a thread that already holds the parent (a read inside a save, a read inside a read, a save
# inside a save) counts up instead. A save inside the same thread's read is refused (it would wait
# forever for its own reader). Other threads of the process take their own flock and wait like
# other processes.
def _lock(parent: str, *, exclusive: bool, timeout: float | None = None) -> _Hold:
    """Take the lock of directory ``parent``; returns the :class:`_Hold` that lets it go when called.

    Readers go on without a lock where the file system has no flock (or the directory cannot be
    opened); a save then fails with the error.
    """
    try:
        fd = os.open(parent, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECTORY)
    except OSError:
        if exclusive:
            raise
        return _Hold(None)
    try:
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino, threading.get_ident())
        with _HELD_LOCK:
            held = _HELD.get(key)
            if held is not None:
                if exclusive and not held[0]:
                    raise CheckpointError(f"cannot save into {parent} while this thread is reading a checkpoint "
                                          "there (inside reading()); finish reading first")
                held[1] += 1
        if held is not None:
            os.close(fd)
            fd = -1
            return _Hold(key)
        try:
            _flock(fd, parent, exclusive, timeout)
        except OSError as err:
            if exclusive or err.errno not in _NO_LOCKS:
                raise
            os.close(fd)
            return _Hold(None)
        with _HELD_LOCK:
            _HELD[key] = [exclusive, 1, fd]
        return _Hold(key)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise


class _Hold:
    """A lock taken by :func:`_lock`: calling it lets the lock go (once; later calls do nothing)."""

    def __init__(self, key: tuple | None):
        self.key = key

    def __call__(self) -> None:
        key, self.key = self.key, None
        if key is not None:
            _unlock(key)

    def hand_over(self, thread: int) -> None:
        """Make the lock thread ``thread``'s (an asynchronous save's worker finishes what the caller began).

        Raises:
            CheckpointError: this thread holds the lock more than once (a save inside a save or a read),
                so it cannot give it away.
        """
        if self.key is None:
            return
        new = (*self.key[:2], thread)
        with _HELD_LOCK:
            held = _HELD[self.key]
            if held[1] != 1 or new in _HELD:
                raise CheckpointError("cannot save asynchronously while this thread holds the checkpoint directory's "
                                      "lock for something else (inside another save or a reading() block)")
            _HELD[new] = _HELD.pop(self.key)
        self.key = new


def _holds(parent: str) -> bool:
    """Whether this thread holds the lock of directory ``parent`` (shared or exclusive)."""
    try:
        st = os.stat(parent)
    except OSError:
        return False
    with _HELD_LOCK:
        return (st.st_dev, st.st_ino, threading.get_ident()) in _HELD


def _flock(fd: int, parent: str, exclusive: bool, timeout: float | None) -> None:
    op = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
    if timeout is None:
        fcntl.flock(fd, op)
        return
    deadline = time.monotonic() + timeout
    delay = 0.005
    while True:
        try:
            fcntl.flock(fd, op | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CheckpointError(
                    f"a save into {parent} is in progress (another process or thread holds its lock); waited "
                    f"{timeout:g} s for it to finish. Load again once it is done, or load another checkpoint"
                ) from None
            time.sleep(min(delay, left))
            delay = min(2 * delay, 0.25)


def _unlock(key: tuple) -> None:
    with _HELD_LOCK:
        held = _HELD[key]
        held[1] -= 1
        if held[1]:
            return
        del _HELD[key]
    os.close(held[2])  # closing the last descriptor of the open file releases its flock
