"""How the library puts a file in place: every rename it makes is made here, in one shape.

A commit stages the new bytes (an unnamed O_TMPFILE file, or a fresh hidden name where the file system has no
O_TMPFILE), writes them, fsyncs them, writes whatever marks the content complete last (a manifest, a marker, an
entry point), renames it into place (only over a regular file or nothing: a link, a device or a directory planted
there is refused, never replaced or written through), and fsyncs the directory, so that the name survives a power
loss. What a commit cut short leaves (a staged name never renamed) is swept by the next commit of the same name.
Checkpoints (``offload.checkpoint``) and Hugging Face saves build their multi-file commits from these calls; a
file written whole (a ``.pt`` export, a Lightning ``.ckpt``, a report) is :func:`replace_file`.
"""

from __future__ import annotations

import errno as _errno
import os
import re
import secrets
import stat
import time
from typing import Callable, TypeVar

from .modes import dir_mode, file_mode
from .regular import kind_of

__all__ = ["TRIES", "check_replaceable", "fresh", "fsync_fd", "fsync_path", "is_staged", "link_open_file", "make_dirs",
           "rename", "replace_file", "sweep_staged", "unlink_if_same_name"]

T = TypeVar("T")

TRIES = 16  # fresh random names tried before giving up (one clash in 2**48 is already a surprise)


def fresh(make: Callable[[str], T], name: Callable[[str], str], where: str, *, nbytes: int = 6) -> T:
    """``make(name(token))`` for a fresh random ``token`` (``nbytes`` random bytes in hex), tried again while it
    raises FileExistsError.

    Args:
        make: creates the thing under the name it is given (exclusively) and returns it.
        name: the name for a random token (hex).
        where: what a FileExistsError after :data:`TRIES` tries names.
        nbytes: random bytes in a token.

    Raises:
        FileExistsError: every name tried was taken.
    """
    for _ in range(TRIES):
        try:
            return make(name(secrets.token_hex(nbytes)))
        except FileExistsError:
            continue
    raise FileExistsError(_errno.EEXIST, f"no free name after {TRIES} tries", where)


def fsync_fd(fd: int, path: str | os.PathLike) -> None:
    """Make the file open on ``fd`` durable; an error names ``path``."""
    try:
        os.fsync(fd)
    except OSError as err:
        if err.filename is not None:
            raise
        raise OSError(err.errno, f"cannot fsync {os.fspath(path)}: {err.strerror}", os.fspath(path)) from err


def fsync_path(path: str | os.PathLike) -> None:
    """fsync the file or directory ``path`` (a directory: the names in it). An error names ``path``."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fsync_fd(fd, path)
    finally:
        os.close(fd)


def check_replaceable(path: str | os.PathLike) -> None:
    """Refuse to put a file in place of ``path`` unless it is missing or a regular file (never a link, a
    device, a FIFO, a socket or a directory, which would be replaced by a file or written through).

    Raises:
        FileExistsError: ``path`` is something else; the message says what and what to do.
    """
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        raise FileExistsError(_errno.EEXIST, f"{kind_of(mode)} is there, and only a regular file (or nothing) is "
                              "replaced by an output; give the name of a new file", os.fspath(path))


def rename(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """The rename of a commit: the staged regular file ``src`` takes the name ``dst``, which must be missing or a
    regular file (checked just before; see :func:`check_replaceable`). The caller fsyncs the directory after.

    Raises:
        FileExistsError: ``dst`` is not a regular file; nothing was renamed.
        OSError: from rename(2), naming both.
    """
    check_replaceable(dst)
    os.rename(src, dst)


def make_dirs(path: str, fsync_dir: Callable[[str], None] = fsync_path) -> bool:
    """Create directory ``path`` and its missing parents (0700, see :mod:`offload.modes`), durably: each new
    name's directory is fsynced (with ``fsync_dir``), so a power loss cannot take away a directory whose files
    were made durable. Returns whether ``path`` was made."""
    missing = []
    while not os.path.isdir(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    for new in reversed(missing):
        try:
            os.mkdir(new, dir_mode())
        except FileExistsError:
            if not os.path.isdir(new):
                raise
        fsync_dir(os.path.dirname(new))
    return bool(missing)


def unlink_if_same_name(path: str) -> None:
    """Remove the regular file ``path`` if it is there (a staged file of ours); never raises."""
    try:
        if stat.S_ISREG(os.lstat(path).st_mode):
            os.unlink(path)
    except OSError:
        pass


_AT_FDCWD, _AT_SYMLINK_FOLLOW = -100, 0x400


def link_open_file(fd: int, name: str) -> None:
    """Give the file open on ``fd`` (an O_TMPFILE one) the name ``name``: linkat(2) of /proc/self/fd/N with
    AT_SYMLINK_FOLLOW, as open(2) documents (os.link does not follow that link)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.linkat(_AT_FDCWD, f"/proc/self/fd/{fd}".encode(), _AT_FDCWD, os.fsencode(name), _AT_SYMLINK_FOLLOW) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), name)


def _staged_name(parent: str, base: str, token: str) -> str:
    return os.path.join(parent, f".{base}.{token}.tmp")


def is_staged(name: str, base: str) -> bool:
    """Whether ``name`` is one :func:`replace_file` stages a new ``base`` under (``.<base>.<12 hex>.tmp``)."""
    return re.fullmatch(re.escape(f".{base}.") + r"[0-9a-f]{12}\.tmp", name) is not None


# A staged file younger than this may be another process's commit of the same output still being written (ranks
# writing one shared file, on a file system without O_TMPFILE): only older ones are what a cut-short commit left.
STALE_S = 600.0


def sweep_staged(path: str | os.PathLike) -> None:
    """Delete what commits of ``path`` cut short left beside it: regular files of this user named as
    :func:`replace_file` stages (``.<name>.<12 hex>.tmp``), unchanged for :data:`STALE_S` seconds. Never raises."""
    parent, base = os.path.split(os.path.abspath(os.fspath(path)))
    try:
        names = [n for n in os.listdir(parent) if is_staged(n, base)]
    except OSError:
        return
    for n in names:
        try:
            st = os.lstat(os.path.join(parent, n))
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and time.time() - st.st_mtime > STALE_S:
            unlink_if_same_name(os.path.join(parent, n))


def replace_file(path: str | os.PathLike, write, *, private: bool = True, mode: int | None = None) -> None:
    """Write a new file in place of ``path`` atomically and durably: ``write(f)`` fills a binary file object of a
    file staged beside it (unnamed where the file system has O_TMPFILE, else under a fresh hidden name created
    exclusively without following a link), which is fsynced, named, renamed over ``path`` and the directory fsynced.
    A crash leaves ``path`` as it was or the new file; a staged name left by one is swept by the next replace.

    Args:
        path: the output; missing, or a regular file (replaced).
        write: fills the file.
        private: create it as state and weights are (0600, see :mod:`offload.modes`); else readable as the
            umask allows (a report, a configuration).
        mode: the file's mode bits (before the umask) instead of what ``private`` says.

    Raises:
        FileExistsError: ``path`` is not a regular file (see :func:`check_replaceable`).
        OSError: writing failed, naming the file; ``path`` is as it was and the new file is gone.
    """
    path = os.path.abspath(os.fspath(path))
    check_replaceable(path)
    sweep_staged(path)
    parent, base = os.path.split(path)
    if mode is None:
        mode = file_mode() if private else 0o666
    tmp = None
    try:
        # Unnamed while it is written (O_TMPFILE): a crash then leaves nothing behind; named only for the
        # moment between its link and its rename. A file system without it gets a named file from the start.
        fd = os.open(parent, os.O_WRONLY | os.O_TMPFILE | os.O_CLOEXEC, mode)
    except OSError as err:
        if err.errno not in (_errno.EOPNOTSUPP, _errno.EISDIR, _errno.EINVAL, _errno.ENOENT):
            raise
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd, tmp = fresh(lambda name: (os.open(name, flags, mode), name), lambda t: _staged_name(parent, base, t), path)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            fsync_fd(f.fileno(), tmp or path)
            if tmp is None:
                tmp = fresh(lambda name: (link_open_file(f.fileno(), name), name)[1],
                            lambda t: _staged_name(parent, base, t), path)
        rename(tmp, path)
    except BaseException:
        if tmp is not None:
            unlink_if_same_name(tmp)
        raise
    fsync_path(parent)
