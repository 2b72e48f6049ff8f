"""The lock of a directory that saves write into and readers read (a checkpoint's, a Hugging Face save's): a
flock on a private file of ours in it, waited for, and named when held too long."""

from __future__ import annotations

import errno as _errno
import fcntl
import math
import os
import stat
import time

from ._proc import lock_holders
from .errors import CheckpointError
from .interrupts import holding, safe_point
from .regular import kind_of

__all__ = ["LOCK_FILE", "SHARED_LOCK_TIMEOUT_S", "DirectoryLock", "lock_directory"]

# The lock of a directory: a file of ours in it, 0600, there while somebody holds it.
LOCK_FILE = ".nvme-offload.lock"
_NO_LOCKS = (_errno.ENOLCK, _errno.EOPNOTSUPP, _errno.ENOTSUP, _errno.EINVAL, _errno.ENOSYS)
_CANNOT_MAKE = (_errno.EACCES, _errno.EPERM, _errno.EROFS)  # a reader of a directory it may not write
# How long a lock that others can open is waited for before the error naming who holds it (a private one,
# which only this user's processes can hold, is waited for as long as their save takes).
SHARED_LOCK_TIMEOUT_S = 60.0


# NOTE: saves hold a directory's lock (a checkpoint's, a Hugging Face save's) exclusively from their first
# file to the deletion of the previous save's files, readers hold it shared, so a load never has a file
# deleted under it and two saves of one directory never interleave. The lock is a flock on a file of ours in
# the directory (LOCK_FILE), created 0600 whatever OFFLOAD_FILE_MODE says: a flock needs an open descriptor, so
# only processes that may open the file can hold it, and nobody else can stop this user's saves by locking a
# directory they may read (a flock on the directory itself, as it was, could be taken by anyone who can list
# it). Where the file is not private (another user's, in a directory others write) the lock is waited for
# SHARED_LOCK_TIMEOUT_S at most, then refused naming who holds it. A lock file deleted or replaced while
# waited for (a checkpoint pruned) is opened again.
class DirectoryLock:
    """A directory's lock, held (from :func:`lock_directory`) until :meth:`release`."""

    def __init__(self, fd: int, lock: str):
        self.fd = fd
        self.lock = lock

    def release(self) -> None:
        """Let the lock go. Where nobody else holds it now, the lock file is deleted first (a process waiting
        for it opens it again), so a directory keeps no file of ours between saves and reads."""
        fd, self.fd = self.fd, -1
        if fd < 0:
            return
        try:
            # Converting a shared lock to an exclusive one may let another process in between: then that
            # process holds it, and the file stays.
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if _still_named(self.lock, fd):
                os.unlink(self.lock)
        except OSError:
            pass  # held by another, or not ours to delete (a reader of another user's directory): it stays
        finally:
            os.close(fd)


def lock_directory(path: str, *, exclusive: bool, timeout: float | None = None) -> DirectoryLock | None:
    """Take directory ``path``'s lock (exclusive for a writer, shared for a reader); returns it
    (:meth:`DirectoryLock.release` lets it go), or None for a reader where the directory is missing, the lock
    file cannot be made (a directory it may not write), or the file system has no flock.

    Raises:
        CheckpointError: ``timeout`` passed (or, for a lock others can open, SHARED_LOCK_TIMEOUT_S), naming
            who holds it; or a link or special file is where the lock file goes.
        OSError: a writer cannot open the directory or make the lock file.
    """
    try:
        os.stat(path)
    except OSError:
        if exclusive:
            raise
        return None
    lock = os.path.join(path, LOCK_FILE)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        fd = _open_lock(lock, exclusive)
        if fd is None:
            return None
        try:
            private = _private(fd)
            limit = deadline if private else min(deadline or math.inf, time.monotonic() + SHARED_LOCK_TIMEOUT_S)
            if not _flock(fd, exclusive, limit, path, lock, private, timeout):
                os.close(fd)
                return None  # no flock on this file system
            if _still_named(lock, fd):
                return DirectoryLock(fd, lock)
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # deleted or replaced while we waited: the lock is the file now there


def _open_lock(lock: str, exclusive: bool) -> int | None:
    """The lock file open (created 0600 if missing); None for a reader that may not create it."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        return os.open(lock, flags | os.O_CREAT, 0o600)
    except OSError as err:
        if err.errno in _CANNOT_MAKE:
            try:
                return os.open(lock, flags)  # there, but not ours to create: use it if it may be opened
            except OSError:
                if exclusive:
                    raise
                return None
        if err.errno in (_errno.ELOOP, _errno.ENXIO) or (err.errno == _errno.EISDIR):
            raise CheckpointError(f"{lock} is not a regular file (a link or a special file was put where a "
                                  "checkpoint's lock file goes); remove it") from None
        if exclusive or err.errno not in (_errno.ENOENT, _errno.ENOTDIR):
            raise
        return None


def _private(fd: int) -> bool:
    """Whether only this user's processes can open the lock file on ``fd`` (made so if it is ours)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"a checkpoint's lock file is {kind_of(st.st_mode)}; remove it")
    if st.st_uid != os.geteuid():
        return False
    if st.st_mode & 0o077:
        try:
            os.fchmod(fd, 0o600)
        except OSError:
            return False
    return True


def _flock(fd: int, exclusive: bool, deadline: float | None, path: str, lock: str, private: bool,
           timeout: float | None) -> bool:
    """flock ``fd`` (waiting until ``deadline`` at most); False where the file system has no flock. Raises
    CheckpointError at the deadline, naming who holds the lock."""
    op = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
    delay = 0.005
    poll = deadline is not None or holding()  # a Ctrl-C held off must still end the wait: poll for it
    while True:
        try:
            fcntl.flock(fd, op | (fcntl.LOCK_NB if poll else 0))
            return True
        except BlockingIOError:
            left = math.inf if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise _held(path, lock, fd, exclusive, private, timeout) from None
            safe_point()
            time.sleep(min(delay, left))
            delay = min(2 * delay, 0.25)
        except OSError as err:
            if exclusive or err.errno not in _NO_LOCKS:
                raise
            return False


def _held(path: str, lock: str, fd: int, exclusive: bool, private: bool, timeout: float | None) -> CheckpointError:
    holders = lock_holders(fd)
    who = ", ".join(holders) if holders else "another process"
    if not private:
        return CheckpointError(
            f"{lock}, the lock of checkpoint directory {path}, can be opened by other users, and {who} has held it "
            f"for {SHARED_LOCK_TIMEOUT_S:g} s: not waiting longer for it. Make the directory and the lock file your "
            "own (or remove the lock file when no save runs), or save into a directory of your own")
    if exclusive:
        return CheckpointError(f"checkpoint directory {path} is in use by {who}; waited {timeout:g} s")
    return CheckpointError(
        f"a save into {path} is in progress ({who} holds its lock); waited {timeout:g} s for it to finish. Load "
        "again once it is done, or load another checkpoint")


def _still_named(lock: str, fd: int) -> bool:
    """Whether ``lock`` still names the file open on ``fd`` (not deleted or replaced while its lock was waited
    for)."""
    try:
        a, b = os.fstat(fd), os.lstat(lock)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
