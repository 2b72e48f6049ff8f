"""The native I/O engine: moves bytes between host buffers and files with io_uring, or with a thread
pool where the kernel refuses io_uring (saying why, once)."""

from __future__ import annotations

import errno as _errno
import os
import threading
import weakref
from typing import Mapping, Sequence

from .._native import BACKEND_NAMES, BACKENDS, HAVE_IO_URING, HAVE_XXHASH, ffi, lib
from .._proc import reset_after_fork
from ..buffers import HostBuffer
from ..config import AioConfig, Config
from .files import AioFile, _warn_once, open_file
from .futures import READ, WRITE, Future, Segment


def _warn_fallback(err: int) -> None:
    name = _errno.errorcode.get(err, str(err))
    _warn_once(
        "fallback to threads",
        f"io_uring is not available ({name}: {os.strerror(err)}): {_why_no_io_uring(err)}. Using the "
        "thread-pool backend (pread/pwrite), which is slower. Set the aio backend to \"threads\" to "
        "silence this, or to \"io_uring\" to make it an error.",
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

    def open(self, path: str | os.PathLike, mode: str = "r", *, o_direct=None, no_links: bool = False) -> AioFile:
        """Open a file for this engine; ``o_direct`` defaults to the config's. See :func:`open_file`."""
        return open_file(path, mode, o_direct=self.config.o_direct if o_direct is None else o_direct,
                         no_links=no_links)

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

    def submit(self, op: int, segments: Sequence[Segment], *, exact: bool = False, digest: bool = False) -> Future:
        """Queue one request of several segments (``op`` is ``READ`` or ``WRITE``).

        With ``exact``, a read that meets end of file before its last byte fails with
        ``OSError(ENODATA)`` naming the file, the offset and the bytes expected and got, instead of
        returning the prefix (for files whose size is known, such as preallocated ones). With
        ``digest``, the future's ``digest()`` gives the xxh3_64 of the bytes moved, computed on the
        engine's thread as the request completes (in Python where built without libxxhash).
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
                flags = lib.OFL_REQ_DIGEST if digest and HAVE_XXHASH else 0
                rc = lib.ofl_engine_submit_flags(self._handle, op, segs, len(segments), flags, out)
                if rc < 0:
                    raise OSError(-rc, os.strerror(-rc), segments[0].file.path if segments else None)
                future = Future(self, op, out[0], list(segments), keepalive, exact and op == READ, digest)
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
        """Whether the engine is closed: no request may be submitted to it."""
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
