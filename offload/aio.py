"""The asynchronous I/O engine: moves bytes between host buffers and files, and opens files for it.

The only layer that talks to the native engine (through ``offload._native``).
"""

from __future__ import annotations

import errno as _errno
import fcntl
import os
import sys
import threading
import warnings
import weakref
from typing import Mapping, NamedTuple, Sequence, Union

from ._native import BACKEND_NAMES, BACKENDS, HAVE_IO_URING, ffi, lib
from ._proc import reset_after_fork
from .buffers import HostBuffer
from .config import AioConfig, Config
from .units import ALIGNMENT

READ = lib.OFL_OP_READ
WRITE = lib.OFL_OP_WRITE
_OP_NAMES = {READ: "read", WRITE: "write"}

_MODES = {
    "r": os.O_RDONLY,
    "r+": os.O_RDWR,
    "w+": os.O_RDWR | os.O_CREAT,
    "x+": os.O_RDWR | os.O_CREAT | os.O_EXCL,
}

# Warnings given once: per file system refusing O_DIRECT, and per process for the threads fallback.
_warned_devices: set = set()
_warned_fallback = False
_warn_lock = threading.Lock()


def _new_warn_lock() -> None:
    global _warn_lock
    _warn_lock = threading.Lock()  # another thread may have held it at the fork


os.register_at_fork(after_in_child=_new_warn_lock)


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
        if self.closed:
            raise ValueError(f"I/O operation on closed file {self.path}")
        return self.fd

    @property
    def closed(self) -> bool:
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


def open_file(path: str | os.PathLike, mode: str = "r", *, o_direct: Union[bool, str] = "auto") -> AioFile:
    """Open a file for the engine.

    Args:
        path: the file.
        mode: ``"r"`` read-only, ``"r+"`` read-write, ``"w+"`` read-write created if missing (never
            truncated), ``"x+"`` read-write, must not exist.
        o_direct: ``"auto"`` tries O_DIRECT and falls back to buffered I/O with one warning per file
            system; ``True`` requires it; ``False`` never uses it.

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
    fd, created = _open_fd(path, mode)
    try:
        return wrap_fd(fd, path, o_direct=o_direct)
    except BaseException:
        if created:
            _unlink_if_same(path, fd)
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
    _warn_no_o_direct(path, fd)
    return AioFile(path, fd, False, 1)


def _check_o_direct(o_direct) -> None:
    if o_direct not in ("auto", True, False):
        raise ValueError(f'o_direct must be "auto", true or false, got {o_direct!r}')


def _open_fd(path: str, mode: str) -> tuple[int, bool]:
    """``(fd, created)``: open ``path`` in ``mode``, knowing whether this call created the file."""
    flags = _MODES[mode] | os.O_CLOEXEC
    if mode != "w+":
        return os.open(path, flags, 0o600), mode == "x+"
    # "w+": create exclusively, else open what exists; twice, in case it vanishes in between.
    for _ in range(2):
        try:
            return os.open(path, flags | os.O_EXCL, 0o600), True
        except FileExistsError:
            pass
        try:
            return os.open(path, flags & ~os.O_CREAT), False
        except FileNotFoundError:
            pass
    return os.open(path, flags, 0o600), False  # e.g. a dangling symlink: open(2) creates its target


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


def _unlink_if_same(path: str, fd: int) -> None:
    """Remove ``path`` if it still names the file open on ``fd`` (never someone else's file)."""
    try:
        st, lst = os.fstat(fd), os.lstat(path)
        if (st.st_dev, st.st_ino) == (lst.st_dev, lst.st_ino):
            os.unlink(path)
    except OSError:
        pass


def _warn_no_o_direct(path: str, fd: int) -> None:
    dev = os.fstat(fd).st_dev
    with _warn_lock:
        if dev in _warned_devices:
            return
        _warned_devices.add(dev)
    warnings.warn(
        f"the file system holding {path} refuses O_DIRECT; using buffered I/O there "
        "(slower, and it fills the page cache). Set o_direct=false to silence this.",
        RuntimeWarning,
        stacklevel=_caller_outside_package(),
    )


def _caller_outside_package() -> int:
    """The ``stacklevel`` at which a warning issued by this function's caller names user code."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_globals.get("__name__", "").startswith("offload."):
        frame, level = frame.f_back, level + 1
    return level


def _warn_fallback(err: int) -> None:
    global _warned_fallback
    with _warn_lock:
        if _warned_fallback:
            return
        _warned_fallback = True
    name = _errno.errorcode.get(err, str(err))
    warnings.warn(
        f"io_uring is not available ({name}: {os.strerror(err)}): {_why_no_io_uring(err)}. Using the "
        "thread-pool backend (pread/pwrite), which is slower. Set the aio backend to \"threads\" to "
        "silence this, or to \"io_uring\" to make it an error.",
        RuntimeWarning,
        stacklevel=_caller_outside_package(),
    )


def _why_no_io_uring(err: int) -> str:
    """What an io_uring setup errno means, in words."""
    if not HAVE_IO_URING:
        return ("this build has no io_uring: liburing was not found when it was built (apt-get install "
                "liburing-dev, then reinstall)")
    if err == _errno.ENOSYS:
        return ("the kernel has no io_uring, or a seccomp filter (a container runtime's default profile, "
                "for one) blocks its system calls")
    if err in (_errno.EPERM, _errno.EACCES):
        try:
            with open("/proc/sys/kernel/io_uring_disabled") as f:
                disabled = f.read().strip()
        except OSError:
            disabled = None
        if disabled not in (None, "0"):
            return (f"the sysctl kernel.io_uring_disabled is {disabled} (1: only members of "
                    "kernel.io_uring_group may use it, 2: nobody may)")
        where = " (kernel.io_uring_disabled is 0)" if disabled == "0" else " or the sysctl kernel.io_uring_disabled"
        return f"a seccomp filter or a security module refuses it{where}"
    if err == _errno.ENOMEM:
        return "the rings need more locked memory than allowed (raise ulimit -l, or lower queue_depth)"
    if err in (_errno.EMFILE, _errno.ENFILE):
        return "too many open files for the rings' descriptors (raise ulimit -n)"
    return "the kernel refused to set up a ring"


def _test_refuse_io_uring(err: int) -> int:
    """Testing hook: make every later io_uring start in this process fail with ``err`` (0: stop).

    Returns the previous value.
    """
    return int(lib.ofl_test_refuse_io_uring(err))


def _dio_alignment(fd: int) -> int:
    mem = ffi.new("uint32_t *")
    off = ffi.new("uint32_t *")
    lib.ofl_dio_alignment(fd, mem, off)
    return max(ALIGNMENT, int(mem[0]), int(off[0]))


class Segment(NamedTuple):
    """One contiguous transfer of a request: ``nbytes`` between ``buffer[buffer_offset:]`` and
    ``file`` at ``file_offset``."""

    file: AioFile
    file_offset: int
    buffer: object  # HostBuffer, or any object exposing a contiguous buffer
    buffer_offset: int
    nbytes: int


def _io_error(err: int, op: int, path: str, offset: int) -> OSError:
    return OSError(err, f"{os.strerror(err)} ({_OP_NAMES[op]} at offset {offset})", path)


def _short_read_error(segments: Sequence[Segment], got: int) -> OSError:
    """The error of an exact read that met end of file after ``got`` bytes of the request."""
    start = 0
    for s in segments:
        if got < start + s.nbytes:
            return OSError(
                _errno.ENODATA,
                f"short read at file offset {s.file_offset}: expected {s.nbytes} bytes, got {got - start} "
                f"(the file ends at offset {s.file_offset + got - start}, inside data it should hold: it "
                "was truncated after it was written)",
                s.file.path,
            )
        start += s.nbytes
    raise AssertionError(f"no short segment at {got} of {start} bytes")  # pragma: no cover - internal


class Future:
    """One request in flight. ``wait()`` returns the bytes moved or raises ``OSError``.

    A read that meets the end of the file returns the length of the prefix it read, unless the
    request was submitted ``exact``: then it raises ``OSError(ENODATA)``.
    """

    def __init__(self, engine: Engine, op: int, request, segments: Sequence[Segment], keepalive,
                 exact: bool = False):
        self._engine = engine
        self._op = op
        self._request = request
        self._segments = segments
        self._keepalive = keepalive  # buffers must outlive the I/O that targets them
        self._exact = exact
        self._result: int | None = None
        self._error: OSError | None = None
        # Whoever finishes the request frees it in C: a second waiter (another thread, or the
        # engine closing) must wait for the first rather than free it twice.
        self._lock = threading.Lock()

    def done(self) -> bool:
        """True if the request has completed (successfully or not). Never blocks."""
        if self._request is None:
            return True
        self._engine._check_same_process()
        if not self._lock.acquire(blocking=False):
            return False  # another thread is finishing it right now
        try:
            if self._request is None:
                return True
            return bool(lib.ofl_request_done(self._engine._handle, self._request))
        finally:
            self._lock.release()

    def wait(self) -> int:
        """Block until the request completes; return the bytes moved.

        Raises:
            OSError: the first piece that failed, with errno, the file's path and the offset.
            RuntimeError: called in a process forked after the engine was created.
        """
        if self._request is not None:
            self._engine._check_same_process()
            self._finish()
        if self._error is not None:
            raise self._error
        return self._result

    def _finish(self) -> None:
        with self._lock:
            if self._request is not None:
                self._finish_locked()

    def _finish_locked(self) -> None:
        result = ffi.new("int64_t *")
        seg = ffi.new("int *")
        offset = ffi.new("int64_t *")
        handle = self._engine._handle
        rc = lib.ofl_request_wait(handle, self._request, result, seg, offset)
        lib.ofl_request_free(handle, self._request)
        self._request = None
        self._engine._futures.discard(self)
        if rc < 0:
            path = self._segments[seg[0]].file.path if 0 <= seg[0] < len(self._segments) else None
            self._error = _io_error(-rc, self._op, path, int(offset[0]))
        self._result = int(result[0])
        if rc == 0 and self._exact and self._result < sum(s.nbytes for s in self._segments):
            self._error = _short_read_error(self._segments, self._result)
        self._keepalive = None
        for s in self._segments:
            s.file._release()

    def __del__(self):
        if (getattr(self, "_request", None) is not None and not self._engine.closed
                and self._engine._forked_from is None):
            self._finish()
            if self._error is not None:
                warnings.warn(f"an I/O error nobody waited for: {self._error}", RuntimeWarning, stacklevel=2)


class CompletedFuture:
    """A future for work that needed no I/O (e.g. a read of state that does not exist yet)."""

    def __init__(self, result: int = 0):
        self._result = result

    def wait(self) -> int:
        return self._result

    def done(self) -> bool:
        return True


def wait_quietly(futures) -> None:
    """Wait for every future, ignoring I/O errors.

    For error paths: a buffer may be the target of requests still in flight, so they must all land
    before the buffer is reused or the first error is raised; their own errors add nothing.
    """
    for fut in futures:
        try:
            fut.wait()
        except OSError:
            pass


class FutureGroup:
    """Several futures seen as one: ``wait()`` waits for all, then raises the first error."""

    def __init__(self, futures: Sequence):
        self._futures = list(futures)

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def wait(self) -> int:
        total, first = 0, None
        for f in self._futures:
            try:
                total += f.wait()
            except OSError as err:
                first = first or err
        if first is not None:
            raise first
        return total


# NOTE: a request is a list of segments (file range <-> buffer range); the native side cuts it into
# ``block_size`` pieces, keeps ``queue_depth`` of them in flight per worker and checks every
# completion. A Future stands for one request: ``wait()`` returns the bytes moved or raises
# ``OSError(errno, strerror, path)``. Waiting happens in C with the GIL released, so Python threads
# keep running meanwhile. The workers are threads of the creating process, which is why an engine
# refuses use in a forked child (see offload._proc.reset_after_fork).
class Engine:
    """The native I/O engine.

    Args:
        config: an :class:`AioConfig`, an ``aio`` block as a mapping, or ``None`` for the defaults.
        **overrides: fields of ``AioConfig`` to change, e.g. ``backend="threads"``.

    Attributes:
        config: the settings in force.
        backend: ``"io_uring"`` or ``"threads"``, the one actually running.
        fallback_reason: why ``"auto"`` fell back to threads (an ``OSError``), or ``None``. The first
            fallback in a process also warns (RuntimeWarning) with the reason.

    Raises:
        OSError: the native engine could not start (``backend="io_uring"`` where the kernel refuses it).
        ValueError: a bad setting.

    An engine belongs to the process that created it: in a child forked later (the workers are
    threads, which ``fork`` does not copy), every use raises ``RuntimeError``, and ``close`` (or
    garbage collection, or interpreter exit) returns at once without touching the parent's work.

    Example::

        with Engine(AioConfig(queue_depth=32)) as engine, BufferPool(1, 1 << 20) as pool:
            with engine.open("/mnt/nvme/data", "w+") as f:
                engine.write(f, pool[0], offset=0)
    """

    def __init__(self, config: AioConfig | Mapping | None = None, **overrides):
        # AioConfig validates itself (ConfigError naming every bad field); a mapping is read with the
        # config loader's rules (human sizes, DeepSpeed's key names).
        if config is None:
            config = AioConfig()
        elif isinstance(config, Mapping):
            config = Config(aio=dict(config)).aio
        if overrides:
            config = Config(aio=config).replace(aio=overrides).aio
        self.config = config
        self._futures: weakref.WeakSet = weakref.WeakSet()
        self._lock = threading.Lock()
        self._registered: list[HostBuffer] = []
        self._registered_memory: list = []
        self._handle = None
        self._pid = os.getpid()
        self._forked_from: int | None = None
        cfg = ffi.new("ofl_config *")
        cfg.backend = BACKENDS[config.backend]
        cfg.thread_count = config.thread_count
        cfg.queue_depth = config.queue_depth
        cfg.block_size = config.block_size
        cfg.single_submit = int(bool(config.single_submit))
        cfg.overlap_events = int(bool(config.overlap_events))
        out = ffi.new("ofl_engine **")
        rc = lib.ofl_engine_create(cfg, out)
        if rc < 0:
            what = "io_uring is not available" if config.backend == "io_uring" else "cannot start the engine"
            hint = "" if HAVE_IO_URING else (
                " (built without liburing: apt-get install liburing-dev, then reinstall)")
            raise OSError(-rc, f"{os.strerror(-rc)}: {what}{hint}")
        self._handle = out[0]
        reset_after_fork(self)
        self.backend = BACKEND_NAMES[lib.ofl_engine_backend(self._handle)]
        reason = lib.ofl_engine_fallback_reason(self._handle)
        self.fallback_reason = OSError(-reason, os.strerror(-reason)) if reason < 0 else None
        if self.fallback_reason is not None:
            _warn_fallback(-reason)

    def _after_fork_in_child(self) -> None:
        # The native workers exist only in the parent; a parent thread may have held the lock.
        self._forked_from = self._pid
        self._lock = threading.Lock()

    # -- files and buffers ------------------------------------------------------------------

    def open(self, path: str | os.PathLike, mode: str = "r", *, o_direct=None) -> AioFile:
        """Open a file for this engine; ``o_direct`` defaults to the config's. See :func:`open_file`."""
        return open_file(path, mode, o_direct=self.config.o_direct if o_direct is None else o_direct)

    def register_buffers(self, buffers: Sequence[HostBuffer]) -> bool:
        """Register pool buffers with every ring so reads and writes use them as fixed buffers.

        Buffers must carry their position in the sequence as ``index``. Returns False (and the
        engine goes on with plain reads and writes) where the kernel refuses, e.g. for lack of
        locked memory.
        """
        self._check_open()
        buffers = list(buffers)
        for i, b in enumerate(buffers):
            if b.index != i:
                raise ValueError(f"buffer {b!r} is at position {i} but has index {b.index}")
            if b.closed:
                raise ValueError(f"{b!r} is closed")
        addrs = ffi.new("void *[]", [ffi.cast("void *", b.address) for b in buffers])
        lens = ffi.new("int64_t[]", [b.nbytes for b in buffers])
        with self._lock:
            self._check_open()
            rc = lib.ofl_engine_register_buffers(self._handle, addrs, lens, len(buffers))
            if rc == -_errno.EBUSY:
                raise RuntimeError(
                    "cannot register buffers while requests are in flight; wait for them first")
            self._registered = buffers if rc == 0 else []
            # The kernel holds the registered pages: keep their mappings alive while registered.
            self._registered_memory = [b.tensor for b in self._registered]
        return rc == 0

    # -- I/O --------------------------------------------------------------------------------

    def submit(self, op: int, segments: Sequence[Segment], *, exact: bool = False) -> Future:
        """Queue one request of several segments (``op`` is ``READ`` or ``WRITE``).

        With ``exact``, a read that meets end of file before its last byte fails with
        ``OSError(ENODATA)`` naming the file, the offset and the bytes expected and got, instead of
        returning the prefix (for files whose size is known, such as preallocated ones).
        """
        self._check_open()
        segs = ffi.new("ofl_segment[]", max(1, len(segments)))
        keepalive = []
        for i, s in enumerate(segments):
            address, index, keep = self._address(s, op)
            keepalive.append(keep)
            f = s.file
            segs[i].fd = f.fileno()
            segs[i].buf_index = index
            segs[i].buf = ffi.cast("void *", address)
            segs[i].len = s.nbytes
            segs[i].offset = s.file_offset
            if f.o_direct:
                a = f.alignment
                checks = (("file offset", s.file_offset), ("length", s.nbytes), ("buffer address", address))
                for name, value in checks:
                    if value % a:
                        raise ValueError(
                            f"{name} {value} is not a multiple of {a}, which O_DIRECT on {f.path} requires"
                        )
        out = ffi.new("ofl_request **")
        held: list[AioFile] = []
        try:
            for s in segments:
                s.file._acquire()  # the descriptor stays open until the request is over
                held.append(s.file)
            with self._lock:  # close() must not free the engine between the check and the call
                self._check_open()
                rc = lib.ofl_engine_submit(self._handle, op, segs, len(segments), out)
                if rc < 0:
                    raise OSError(-rc, os.strerror(-rc), segments[0].file.path if segments else None)
                future = Future(self, op, out[0], list(segments), keepalive, exact and op == READ)
                self._futures.add(future)
        except BaseException:
            for f in held:
                f._release()
            raise
        return future

    def read_async(self, file: AioFile, buffer, offset: int, nbytes: int | None = None, *,
                   buffer_offset: int = 0) -> Future:
        """Start reading ``nbytes`` (default: the rest of the buffer) at ``offset`` into the buffer."""
        return self.submit(READ, [self._segment(file, buffer, offset, nbytes, buffer_offset)])

    def write_async(self, file: AioFile, buffer, offset: int, nbytes: int | None = None, *,
                    buffer_offset: int = 0) -> Future:
        """Start writing ``nbytes`` (default: the rest of the buffer) of the buffer at ``offset``."""
        return self.submit(WRITE, [self._segment(file, buffer, offset, nbytes, buffer_offset)])

    def read(self, file: AioFile, buffer, offset: int, nbytes: int | None = None, *,
             buffer_offset: int = 0) -> int:
        """Read and wait; returns the bytes read (fewer at end of file)."""
        return self.read_async(file, buffer, offset, nbytes, buffer_offset=buffer_offset).wait()

    def write(self, file: AioFile, buffer, offset: int, nbytes: int | None = None, *,
              buffer_offset: int = 0) -> int:
        """Write and wait; returns the bytes written."""
        return self.write_async(file, buffer, offset, nbytes, buffer_offset=buffer_offset).wait()

    # -- introspection and testing ----------------------------------------------------------

    def stats(self) -> dict:
        """Counters since the engine started: requests, pieces, bytes, resubmits, retries, ..."""
        self._check_open()
        st = ffi.new("ofl_stats *")
        lib.ofl_engine_stats(self._handle, st)
        names = ("requests", "pieces", "bytes", "resubmits", "retries", "failures", "fixed_buffers",
                 "workers")
        return {name: int(getattr(st, name)) for name in names}

    def inject_fault(self, kind: str, *, op: str | None = None, skip: int = 0, count: int = 1,
                     errno: int = _errno.EIO) -> None:
        """Testing hook: make upcoming pieces fail or come back short.

        Args:
            kind: ``"error"`` (the piece fails with ``errno`` without being sent), ``"short"`` (half
                the piece is sent, so the engine must resubmit the rest) or ``"none"`` (disarm).
            op: ``"read"``, ``"write"`` or ``None`` for both.
            skip: matching pieces to let through first.
            count: pieces to affect; -1 for all of them.
        """
        self._check_open()
        kinds = {"none": lib.OFL_FAULT_NONE, "short": lib.OFL_FAULT_SHORT, "error": lib.OFL_FAULT_ERROR}
        ops = {None: -1, "read": READ, "write": WRITE}
        if kind not in kinds or op not in ops:
            raise ValueError(f"kind must be one of {sorted(kinds)} and op one of read, write, None")
        rc = lib.ofl_engine_inject_fault(self._handle, ops[op], kinds[kind], skip, count, errno)
        if rc < 0:
            raise ValueError(f"bad fault: skip={skip}, count={count}, errno={errno}")

    # -- lifetime ---------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._handle is None

    def close(self) -> None:
        """Wait for everything in flight, then stop the workers. Futures keep their results.

        In a child forked after the engine was created, only forgets the parent's engine.
        """
        if self._forked_from is not None:
            # The native engine is a copy whose threads live in the parent: leave it be.
            self._handle = None
            self._registered = []
            self._registered_memory = []
            return
        with self._lock:
            if self._handle is None:
                return
            for f in list(self._futures):
                if f._request is not None:
                    f._finish()
            lib.ofl_engine_destroy(self._handle)
            self._handle = None
            self._registered = []
            self._registered_memory = []

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if getattr(self, "_handle", None) is not None:
            self.close()

    def __repr__(self) -> str:
        c = self.config
        return (f"Engine(backend={self.backend!r}, block_size={c.block_size}, queue_depth={c.queue_depth}, "
                f"thread_count={c.thread_count})")

    # -- helpers ----------------------------------------------------------------------------

    def _check_open(self) -> None:
        self._check_same_process()
        if self._handle is None:
            raise ValueError("I/O operation on a closed engine")

    def _check_same_process(self) -> None:
        if self._forked_from is not None:
            raise RuntimeError(
                f"this engine was created in process {self._forked_from} before a fork and cannot be "
                f"used in the child (process {os.getpid()}): its I/O threads exist only in the parent. "
                "Build a new engine (swap space, optimizer) in the child."
            )

    @staticmethod
    def _segment(file, buffer, offset, nbytes, buffer_offset) -> Segment:
        size = buffer.nbytes if isinstance(buffer, HostBuffer) else memoryview(buffer).nbytes
        if nbytes is None:
            nbytes = size - buffer_offset
        if buffer_offset < 0 or nbytes < 0 or buffer_offset + nbytes > size:
            raise ValueError(
                f"{nbytes} bytes at buffer offset {buffer_offset} do not fit in a buffer of {size} bytes"
            )
        if offset < 0:
            raise ValueError(f"file offset must not be negative, got {offset}")
        return Segment(file, offset, buffer, buffer_offset, nbytes)

    def _address(self, s: Segment, op: int):
        """(address, fixed-buffer index or -1, object to keep alive) for a segment's buffer range."""
        b = s.buffer
        if isinstance(b, HostBuffer):
            if b.closed:
                raise ValueError(f"{b!r} is closed")
            if s.buffer_offset < 0 or s.buffer_offset + s.nbytes > b.nbytes:
                raise ValueError(f"{s.nbytes} bytes at offset {s.buffer_offset} overflow {b!r}")
            registered = 0 <= b.index < len(self._registered) and self._registered[b.index] is b
            index = b.index if registered else -1
            return b.address + s.buffer_offset, index, (b, b.tensor)
        cdata = ffi.from_buffer(b, require_writable=(op == READ))
        if s.buffer_offset < 0 or s.buffer_offset + s.nbytes > len(cdata):
            raise ValueError(
                f"{s.nbytes} bytes at offset {s.buffer_offset} overflow a buffer of {len(cdata)}")
        return int(ffi.cast("uintptr_t", cdata)) + s.buffer_offset, -1, (cdata, b)
