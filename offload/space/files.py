"""Swap files: their names, their creation under an exclusive lock, and finding and removing stale ones."""

from __future__ import annotations

import errno as _errno
import fcntl
import mmap
import os
import re
import socket
import stat
import struct
import warnings
from typing import Mapping

from .._proc import pid_alive
from ..aio import AioFile, unlink_if_same, wrap_fd
from ..commit import fresh, rename
from ..distributed import rank_info
from ..modes import file_mode
from ..sizes import format_size

__all__ = ["create_swap_file", "find_stale", "find_unproven", "remove_stale", "seal", "warn_stale"]

_PREFIX = "nvme-offload-"
_SUFFIX = ".swap"
# name, host, pid, random: the name is reduced to [A-Za-z0-9_] so the first dash ends it.
_FIELDS = (r"nvme-offload-(?P<name>[A-Za-z0-9_]+)-(?P<host>[A-Za-z0-9.\-]+)-(?P<pid>\d+)-"
           r"(?P<rand>[0-9a-f]{8})\.swap")
_PATTERN = re.compile(rf"^{_FIELDS}$")
# A file being created: hidden, and a name the stale scan of live files never matches.
_NEW_PATTERN = re.compile(rf"^\.{_FIELDS}\.new$")
# The seal: the last bytes of a swap file's guard block, which say the file is ours and how long we made it:
# a magic, the bytes of address space before the guard block, the guard block's size, and the random part
# of the file's name.
_SEAL = struct.Struct("<24sQQ8s")
_MAGIC = b"nvme-offload swap file 1"


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.\-]", "", socket.gethostname()) or "localhost"


# NOTE: a swap file is created under a hidden name the stale scan never matches, locked (flock,
# exclusive) and only then renamed to its swap-file name; the lock belongs to the open file and
# survives the rename. So every file a scan can see under a swap-file name is locked from its
# first moment until its owner unlinks it (close unlinks, then unlocks). A scan that takes the
# lock of a file therefore knows its owner is gone, once it has checked that the name still
# leads to that file. Where the file system has no flock, the pid in the name is the evidence.
def create_swap_file(directory: str, name: str, *, o_direct) -> AioFile:
    """Create, lock and open a new swap file ``nvme-offload-{name}-{host}-{pid}-{random}.swap``.

    In a job of several ranks the tag ends in the rank (``nvme-offload-adam_rank3-...``), so ranks sharing
    a drive tell their files apart at a glance (the pid and random part already keep the names apart).

    Args:
        directory: where (checked beforehand).
        name: a tag; characters other than ``[A-Za-z0-9_]`` become ``_``.
        o_direct: ``"auto"``, ``True`` or ``False`` (see :func:`offload.aio.open_file`).

    Raises:
        PermissionError: the directory refuses new files.
        OSError: ``EINVAL`` when ``o_direct=True`` and the file system refuses O_DIRECT. Nothing is
            left behind on any error.
    """
    tag = re.sub(r"[^A-Za-z0-9_]", "_", str(name)) or "swap"
    info = rank_info()
    if info.distributed:
        tag += f"_rank{info.rank}"
    base = f"{_PREFIX}{tag}-{_host()}-{os.getpid()}-"

    def create(final: str) -> AioFile:
        temp = os.path.join(directory, "." + os.path.basename(final) + ".new")
        if os.path.lexists(final):
            raise FileExistsError(_errno.EEXIST, "taken", final)
        try:
            fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, file_mode())
        except PermissionError as err:
            raise PermissionError(
                err.errno, f"cannot create a swap file in {directory} ({err.strerror}); "
                "give this user write access or choose another nvme_path", final) from err
        try:
            _lock(fd, temp)
            f = wrap_fd(fd, final, o_direct=o_direct)
        except BaseException:
            unlink_if_same(temp, fd)
            os.close(fd)
            raise
        try:
            seal(f, 0, max(4096, f.alignment))  # ours from its first moment under a swap-file name
            rename(temp, final)
        except BaseException:
            unlink_if_same(temp, f.fd)
            f.close()
            raise
        return f

    return fresh(create, lambda token: os.path.join(directory, f"{base}{token}{_SUFFIX}"), directory, nbytes=4)


def seal(f: AioFile, data_bytes: int, guard: int) -> None:
    """Write ``f``'s guard block, the ``guard`` bytes after its ``data_bytes`` of address space: zeros, then the
    seal that proves the file is ours and how long we made it (what :func:`find_stale` checks before it calls a
    file stale). Called when the file is created and each time it grows, after its size was checked.

    Raises:
        OSError: the write failed or was short, naming the file.
    """
    named = _PATTERN.match(os.path.basename(f.path))
    assert named is not None  # a swap file of ours
    token = named["rand"].encode()
    with mmap.mmap(-1, guard) as block:  # page-aligned, as direct I/O needs
        block[guard - _SEAL.size:] = _SEAL.pack(_MAGIC, data_bytes, guard, token)
        try:
            done = os.pwrite(f.fd, block, data_bytes)
        except OSError as err:
            raise OSError(err.errno, f"cannot write the swap file's guard block ({err.strerror})", f.path) from err
    if done != guard:
        raise OSError(_errno.EIO, f"short write of the swap file's guard block ({done} of {guard} bytes)", f.path)


def _sealed_by_us(fd: int, rand: str) -> bool:
    """Whether the file open on ``fd`` is a swap file we made: this user's, ending in our seal with its name's
    random part, exactly as long as the seal says. A file merely named like one is never ours."""
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_size < _SEAL.size:
            return False
        raw = os.pread(fd, _SEAL.size, st.st_size - _SEAL.size)
    except OSError:
        return False
    if len(raw) != _SEAL.size:
        return False
    magic, data_bytes, guard, token = _SEAL.unpack(raw)
    return (magic == _MAGIC and token == rand.encode() and guard >= _SEAL.size and guard % 4096 == 0
            and data_bytes % 4096 == 0 and data_bytes + guard == st.st_size)


def _lock(fd: int, path: str) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as err:
        raise OSError(err.errno, "a new swap file is locked by another process", path) from err
    except OSError:
        pass  # a file system without flock: stale detection falls back on the pid in the name


def find_stale(path: str | os.PathLike) -> list[str]:
    """Swap files in ``path`` left by runs that ended without cleaning up (e.g. a crash).

    A swap file is stale when no process holds its lock (or, where the file system has no locks,
    when its process on this host is gone), and it is provably ours: this user's regular file, ending in
    the seal we wrote with its name's random part, as long as the seal says. A file that is merely named
    like one (a user's, or one cut short) is never reported; special files and symlinks named like swap
    files are never opened, followed or reported.
    """
    return _scan(path)[0]


def find_unproven(path: str | os.PathLike) -> list[str]:
    """Files in ``path`` named like swap files that nobody holds but that are not provably ours (no seal: made
    by a version before swap files were sealed, or cut short, changed, or another user's): never removed
    here; a user who knows no run uses them removes them by hand."""
    return _scan(path)[1]


def _scan(path) -> tuple[list[str], list[str]]:
    """(stale swap files, unlocked files named like swap files that are not provably ours)."""
    path = os.fspath(path)
    try:
        names = sorted(os.listdir(path))
    except (FileNotFoundError, NotADirectoryError):
        return [], []
    host = _host()
    stale: list[str] = []
    unproven: list[str] = []
    for fname in names:
        m = _PATTERN.match(fname)
        creating = m is None
        if m is None:
            m = _NEW_PATTERN.match(fname)
            if m is None:
                continue
        gone = m["host"] == host and not pid_alive(int(m["pid"]))
        if creating and not gone:
            continue  # being created right now: its creator locks and renames it in a moment
        full = os.path.join(path, fname)
        fd = _open_regular(full)
        if fd is None:
            continue
        try:
            if _take_lock(fd, gone) and _still_named(full, fd):
                (stale if _sealed_by_us(fd, m["rand"]) else unproven).append(full)
        finally:
            os.close(fd)
    return stale, unproven


def remove_stale(path: str | os.PathLike) -> list[str]:
    """Delete the stale swap files in ``path`` (see :func:`find_stale`); returns those removed."""
    removed = []
    host = _host()
    for full in find_stale(path):
        fd = _open_regular(full)
        if fd is None:
            continue
        try:
            m = _PATTERN.match(os.path.basename(full)) or _NEW_PATTERN.match(os.path.basename(full))
            gone = m is not None and m["host"] == host and not pid_alive(int(m["pid"]))
            # Under the lock, checked again: still nobody's, still ours, and still the file the name leads to.
            if m is not None and _take_lock(fd, gone) and _sealed_by_us(fd, m["rand"]) and _still_named(full, fd):
                os.unlink(full)
                removed.append(full)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def warn_stale(stale: Mapping[str, list[str]], stacklevel: int = 2) -> None:
    """One RuntimeWarning naming the directories with stale swap files and the space they hold."""
    found = {p: files for p, files in stale.items() if files}
    if not found:
        return
    parts = []
    for p, files in found.items():
        held = sum(_allocated(f) for f in files)
        parts.append(f"{p}: {len(files)} file(s) holding {format_size(held)}")
    warnings.warn(
        "stale swap files from runs that did not clean up (not reused): " + "; ".join(parts)
        + ". Remove them with `offload-swap clean PATH` (or SwapSpace.remove_stale(path)), which removes only "
        "files proved ours whose run is gone.",
        RuntimeWarning, stacklevel=stacklevel + 1)


def _open_regular(full: str) -> int | None:
    """A read-only descriptor of ``full`` if it is a regular file (never a FIFO, device or symlink)."""
    try:
        st = os.lstat(full)
        if not stat.S_ISREG(st.st_mode):
            return None
        # O_NONBLOCK and O_NOFOLLOW: if the name was swapped for a FIFO or a link since the lstat,
        # the open neither blocks nor follows it, and the fstat below turns it away.
        fd = os.open(full, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fst = os.fstat(fd)
    except OSError:
        os.close(fd)
        return None
    if not stat.S_ISREG(fst.st_mode) or (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino):
        os.close(fd)
        return None
    return fd


def _take_lock(fd: int, owner_gone: bool) -> bool:
    """Whether nobody holds the file: its lock can be taken, or (no flock here) its owner is gone."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False  # held by a live space
    except OSError:
        return owner_gone  # a file system without flock: only the pid in the name can tell
    return True


def _still_named(full: str, fd: int) -> bool:
    """Whether ``full`` still leads to the file open on ``fd`` (not unlinked or replaced meanwhile)."""
    try:
        st, lst = os.fstat(fd), os.lstat(full)
    except OSError:
        return False
    return st.st_nlink > 0 and (st.st_dev, st.st_ino) == (lst.st_dev, lst.st_ino)


def _allocated(path: str) -> int:
    try:
        return os.lstat(path).st_blocks * 512
    except OSError:
        return 0
