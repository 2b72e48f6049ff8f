"""Files opened for the engine: O_DIRECT turned on where the file system takes it (with one warning
where it does not), the direct-I/O alignment, and descriptors kept open while requests use them."""

from __future__ import annotations

import errno as _errno
import fcntl
import os
import stat
import threading
import warnings
from typing import Union

from .._native import ffi, lib
from .._proc import reset_after_fork
from ..errors import user_stacklevel
from ..modes import file_mode
from ..sizes import ALIGNMENT

_MODES = {
    "r": os.O_RDONLY,
    "r+": os.O_RDWR,
    "w+": os.O_RDWR | os.O_CREAT,
    "x+": os.O_RDWR | os.O_CREAT | os.O_EXCL,
}

# Warnings given once: per file system refusing O_DIRECT (its st_dev), and per process for the
# engine's fallback to threads (see offload.aio.engine).
_warned: set = set()
_warn_lock = threading.Lock()


def _new_warn_lock() -> None:
    global _warn_lock
    _warn_lock = threading.Lock()  # another thread may have held it at the fork


os.register_at_fork(after_in_child=_new_warn_lock)


def _warn_once(key, message: str) -> None:
    """Warn (RuntimeWarning, naming the user's line) unless a warning of ``key`` was given already."""
    with _warn_lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=user_stacklevel())


class AioFile:
    """A file opened for the engine. Use as a context manager, or call :meth:`close`.

    Attributes:
        path: the path it was opened with.
        fd: the file descriptor.
        o_direct: whether the file is open with O_DIRECT.
        alignment: bytes that offsets, lengths and buffer addresses must be multiples of
            (1 when not O_DIRECT).
    """

    def __init__(self, path: str, fd: int, o_direct: bool, alignment: int):
        self.path = path
        self.fd = fd
        self.o_direct = o_direct
        self.alignment = alignment
        # Requests carry the descriptor number: closing it under them would let a newly opened
        # file take the number and receive their bytes. close() defers to the last request.
        self._lock = threading.Lock()
        self._pending = 0
        self._closing = False
        reset_after_fork(self)

    def _after_fork_in_child(self) -> None:
        # The child runs none of the parent's requests, and a parent thread may have held the lock
        # at the fork: start over, so close() works (and closes at once) in the child.
        self._lock = threading.Lock()
        self._pending = 0
        if self._closing:
            self._close_fd()

    def fileno(self) -> int:
        """The file descriptor (``ValueError`` once the file is closed)."""
        if self.closed:
            raise ValueError(f"I/O operation on closed file {self.path}")
        return self.fd

    @property
    def closed(self) -> bool:
        """Whether the file is closed, or closing once its last requests have finished."""
        return self.fd < 0 or self._closing

    def close(self) -> None:
        """Close the file; with requests still in flight, once the last of them has finished."""
        with self._lock:
            self._closing = True
            if self._pending == 0:
                self._close_fd()

    def _close_fd(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)

    def _acquire(self) -> int:
        with self._lock:
            if self.closed:
                raise ValueError(f"I/O operation on closed file {self.path}")
            self._pending += 1
            return self.fd

    def _release(self) -> None:
        with self._lock:
            self._pending -= 1
            if self._pending == 0 and self._closing:
                self._close_fd()

    def __enter__(self) -> AioFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if getattr(self, "_lock", None) is not None:
            self.close()

    def __repr__(self) -> str:
        return f"AioFile({self.path!r}, o_direct={self.o_direct}, alignment={self.alignment})"


def create_private(path: str | os.PathLike, *, text: bool = False, within: int = 0o777):
    """A new file ``path`` open for writing, readable by its owner only (0600: state and weights are the
    user's data; ``OFFLOAD_FILE_MODE`` widens it, see :mod:`offload.modes`, and ``within`` narrows it: a
    copy passes its original's mode), created exclusively and without following a link: a name someone
    planted there (a link, a file) raises FileExistsError and is never written through or truncated."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, file_mode() & within)
    return os.fdopen(fd, "w" if text else "wb")


def open_file(path: str | os.PathLike, mode: str = "r", *, o_direct: Union[bool, str] = "auto",
              no_links: bool = False) -> AioFile:
    """Open a file for the engine.

    Args:
        path: the file.
        mode: ``"r"`` read-only, ``"r+"`` read-write, ``"w+"`` read-write created if missing (never
            truncated), ``"x+"`` read-write, must not exist.
        o_direct: ``"auto"`` tries O_DIRECT and falls back to buffered I/O with one warning per file
            system; ``True`` requires it; ``False`` never uses it.
        no_links: refuse a symbolic link and anything but a regular file (a FIFO is not waited on): for
            files whose names come from elsewhere (a checkpoint's).

    Raises:
        OSError: from ``open(2)``, with the path (``FileNotFoundError``, ``PermissionError``, ...);
            ``EINVAL`` when ``o_direct=True`` and the file system refuses O_DIRECT (a file this call
            created is removed again).
        ValueError: a bad mode or o_direct value.
    """
    path = os.fspath(path)
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {sorted(_MODES)}, got {mode!r}")
    _check_o_direct(o_direct)
    fd, created = _open_fd(path, mode, extra=os.O_NOFOLLOW | os.O_NONBLOCK if no_links else 0)
    try:
        if no_links and not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(_errno.EINVAL, "not a regular file; refused", path)
        return wrap_fd(fd, path, o_direct=o_direct)
    except BaseException:
        if created:
            unlink_if_same(path, fd)
        os.close(fd)
        raise


# NOTE: O_DIRECT is turned on after the open (fcntl F_SETFL), not asked for in it. open(2) with
# O_CREAT creates the file before the file system gets to refuse O_DIRECT, so a refused O_DIRECT
# open leaves a new file behind and an O_EXCL retry then fails on it. F_SETFL runs the same kernel
# check (EINVAL where the file system has no direct I/O), and F_GETFL confirms the flag took.
def wrap_fd(fd: int, path: str, *, o_direct: Union[bool, str] = "auto") -> AioFile:
    """An :class:`AioFile` over an open descriptor, with O_DIRECT turned on as ``o_direct`` asks.

    On success the AioFile owns ``fd``; on an exception the caller still does.

    Args:
        fd: a descriptor open for reading (and writing, to write through it).
        path: the file's path, for messages.
        o_direct: as for :func:`open_file`.

    Raises:
        OSError: ``EINVAL`` when ``o_direct=True`` and the file system refuses O_DIRECT.
    """
    _check_o_direct(o_direct)
    if o_direct is False:
        return AioFile(path, fd, False, 1)
    if _set_o_direct(fd):
        return AioFile(path, fd, True, _dio_alignment(fd))
    if o_direct is True:
        raise OSError(
            _errno.EINVAL,
            "the file system refuses O_DIRECT; set o_direct to \"auto\" or false to use buffered I/O",
            path,
        )
    _warn_once(
        ("no O_DIRECT", os.fstat(fd).st_dev),
        f"the file system holding {path} refuses O_DIRECT; using buffered I/O there "
        "(slower, and it fills the page cache). Set o_direct=false to silence this.",
    )
    return AioFile(path, fd, False, 1)


def _check_o_direct(o_direct) -> None:
    if o_direct not in ("auto", True, False):
        raise ValueError(f'o_direct must be "auto", true or false, got {o_direct!r}')


def _open_fd(path: str, mode: str, *, extra: int = 0) -> tuple[int, bool]:
    """``(fd, created)``: open ``path`` in ``mode`` (and ``extra`` flags), knowing whether this call created
    the file."""
    flags = _MODES[mode] | os.O_CLOEXEC | extra
    if mode in ("r", "r+"):
        return os.open(path, flags), False  # nothing created: no mode to choose
    if mode != "w+":
        return os.open(path, flags, file_mode()), mode == "x+"
    # "w+": create exclusively, else open what exists; twice, in case it vanishes in between.
    for _ in range(2):
        try:
            return os.open(path, flags | os.O_EXCL, file_mode()), True
        except FileExistsError:
            pass
        try:
            return os.open(path, flags & ~os.O_CREAT), False
        except FileNotFoundError:
            pass
    return os.open(path, flags, file_mode()), False  # e.g. a dangling symlink: open(2) creates its target


def _set_o_direct(fd: int) -> bool:
    """Turn O_DIRECT on for ``fd``; False where the file system refuses it."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    if not flags & os.O_DIRECT:
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT)
        except OSError as err:
            if err.errno != _errno.EINVAL:
                raise
            return False
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)


_fallocate = None  # fallocate(2) through the C library, its argument types set: found once


def _fallocate_call():
    global _fallocate
    if _fallocate is None:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        call = getattr(libc, "fallocate64", None) or getattr(libc, "fallocate", None)
        if call is not None:
            call.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
            call.restype = ctypes.c_int
        _fallocate = (call, ctypes.get_errno)
    return _fallocate


def reserve(fd: int, offset: int, length: int, path: str) -> bool:
    """Allocate ``length`` bytes of the file ``fd`` from ``offset`` now (fallocate(2), which also extends it),
    so that a full disk is reported before data moves. False where the file system cannot reserve space
    (nothing was written: glibc's ``posix_fallocate`` would write a byte per block instead, which fails on
    an O_DIRECT descriptor and crawls on a network mount). A call that fails may leave the file partly
    allocated and longer: the callers remove it.

    Raises:
        OSError: ENOSPC, EDQUOT, EFBIG or another failure, naming ``path``, the bytes asked and the bytes free.
    """
    if length <= 0:
        return True
    call, get_errno = _fallocate_call()
    while True:
        if call is None:  # a C library without it: the portable call (whose fallback writes)
            try:
                os.posix_fallocate(fd, offset, length)
                return True
            except OSError as err:
                assert err.errno is not None  # the C call's errno
                code = err.errno
        elif call(fd, 0, offset, length) == 0:
            return True
        else:
            code = get_errno()
        if code != _errno.EINTR:
            break
    if code in (_errno.EOPNOTSUPP, _errno.ENOSYS, _errno.ENODEV):
        return False
    st = os.statvfs(os.path.dirname(os.path.abspath(path)))
    raise OSError(code, f"cannot reserve {length} bytes ({os.strerror(code)}; {st.f_bavail * st.f_frsize} bytes "
                        "free)", path)


def unlink_if_same(path: str, fd: int) -> None:
    """Remove ``path`` if it still names the file open on ``fd`` (never someone else's file)."""
    try:
        st, lst = os.fstat(fd), os.lstat(path)
        if (st.st_dev, st.st_ino) == (lst.st_dev, lst.st_ino):
            os.unlink(path)
    except OSError:
        pass


def _dio_alignment(fd: int) -> int:
    mem = ffi.new("uint32_t *")
    off = ffi.new("uint32_t *")
    lib.ofl_dio_alignment(fd, mem, off)
    return max(ALIGNMENT, int(mem[0]), int(off[0]))
