"""Files read because a user or another file names them (a checkpoint's, a config, a shard): regular files only,
and small ones read whole only up to a bound."""

from __future__ import annotations

import errno as _errno
import os
import stat
from typing import Optional

__all__ = ["CHUNK", "KIND_NAMES", "SMALL_FILE_LIMIT", "FileTooLargeError", "NotRegularFileError", "kind_of",
           "open_regular", "read_regular"]

# The most bytes moved by one read or copy call, or held by one buffer of a tool that reads a whole file.
CHUNK = 64 << 20
# The most bytes a small file read whole may hold: a header, an index, a save's marker or record.
SMALL_FILE_LIMIT = 64 << 20

# What stat's file types are called in messages.
KIND_NAMES = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISLNK, "a symbolic link"),
)


def kind_of(mode: int) -> str:
    """What a file of stat mode ``mode`` is, in words (``"a FIFO (named pipe)"``, ``"a regular file"``)."""
    return next((name for test, name in KIND_NAMES if test(mode)), "a regular file" if stat.S_ISREG(mode)
                else "a special file")


class NotRegularFileError(OSError):
    """A name that had to lead to a regular file leads to something else (a FIFO, a device, a socket, a
    directory, or a link where links are refused). An ``OSError`` with the path: the callers say what the
    file was for."""


class FileTooLargeError(OSError):
    """A file read whole is larger than it may be for what it is (a manifest, a config)."""


# NOTE: open(2) of a FIFO blocks until a writer comes, and a link to /dev/zero or a character device reads
# for ever: a checkpoint's manifest, a config or an index planted as one of them would hang or exhaust the
# memory of every reader. So every such file is opened with O_NONBLOCK (a FIFO opens at once; the flag means
# nothing for a regular file) and checked with fstat on the descriptor itself (no race with a rename) before
# a byte is read; small files are read whole only up to a bound that a file of their kind never reaches.
def open_regular(path: str | os.PathLike, *, follow: bool = True) -> int:
    """A read-only descriptor of ``path``, which must be a regular file (close it).

    Args:
        path: the file; a symbolic link is followed unless ``follow`` is False (then it is refused).

    Raises:
        NotRegularFileError: ``path`` is not a regular file (the message says what it is).
        OSError: from ``open(2)`` (``FileNotFoundError``, ``PermissionError``, ...).
    """
    path = os.fspath(path)
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as err:
        if err.errno == _errno.ELOOP and not follow:
            raise NotRegularFileError(_errno.ELOOP, "a symbolic link, not a regular file", path) from None
        if err.errno in (_errno.ENXIO, _errno.EOPNOTSUPP):  # a socket, or a FIFO on some file systems
            raise NotRegularFileError(err.errno, "a socket, not a regular file", path) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFileError(_errno.EINVAL, f"{kind_of(mode)}, not a regular file", path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: str | os.PathLike, *, limit: int, follow: bool = True, size: Optional[int] = None) -> bytes:
    """The bytes of the regular file ``path``, which may hold at most ``limit`` bytes.

    Args:
        path: the file (see :func:`open_regular`).
        limit: the most bytes a file of its kind holds; a larger one is refused before it is read.
        follow: follow a symbolic link (else refuse it).
        size: the size the file must have, if known (a checkpoint file's, from its manifest): a file of
            another size is returned as read up to ``size + 1`` bytes, for the caller's check to refuse.

    Raises:
        NotRegularFileError: not a regular file.
        FileTooLargeError: more than ``limit`` bytes.
        OSError: it cannot be opened or read.
    """
    fd = open_regular(path, follow=follow)
    try:
        have = os.fstat(fd).st_size
        want = limit if size is None else min(limit, size)
        if have > limit:
            raise FileTooLargeError(_errno.EFBIG, f"{have} bytes, more than the {limit} a file of its kind holds",
                                    os.fspath(path))
        # A file that grows while it is read is cut at one byte past what it may hold: its size is then wrong.
        out = bytearray()
        while len(out) <= want:
            chunk = os.read(fd, min(want + 1 - len(out), CHUNK))
            if not chunk:
                break
            out += chunk
        return bytes(out)
    finally:
        os.close(fd)
