"""The swap space: aligned extents of one logical address space, striped over one preallocated file per drive."""

from __future__ import annotations

import itertools
import multiprocessing.util
import os
import threading
import weakref
from typing import Iterable, Sequence

from .._proc import reset_after_fork
from ..aio import READ, WRITE, FutureGroup, Segment, wait_quietly
from ..buffers import HostBuffer
from ..config import AioConfig
from ..errors import ConfigError
from ..sizes import round_up
from . import files as _files
from .extents import Extent, ExtentAllocator
from .fileset import FileSet
from .paths import PathsLike, check_paths

__all__ = ["SwapSpace"]

_owner_ids = itertools.count(1)


# NOTE: each directory in ``paths`` gets one swap file, preallocated with fallocate so that a full
# disk is reported when space is reserved (with bytes needed and free), not in the middle of
# training. The logical address space is striped over the files in ``stripe_unit`` pieces (software
# RAID0): logical offset L lives in stripe s = L // unit, in file s % N, at file offset
# (s // N) * unit + L % unit. Every path has its own Engine (its own queue), and a read or write of
# an extent becomes one vectored request per path, so N drives move an extent in parallel and one
# slow drive does not stall the others' queues. Space grows only by whole stripes on every file,
# and always before the allocator records an extent there: a failed growth changes nothing. The files,
# their engines, sizes and guard blocks are the FileSet's (offload.space.fileset).
class SwapSpace:
    """Aligned extents over one preallocated swap file per directory, striped RAID0-style.

    Args:
        paths: one directory, or a list of directories (one per drive). A missing directory is
            created when its parent exists.
        nbytes: bytes to reserve up front (fallocate). Prefer :meth:`alloc_many`, which reserves
            exactly what its extents need.
        aio: engine settings; one Engine per path is started with them.
        stripe_unit: bytes per stripe; a multiple of ``aio.block_size`` and of the alignment.
            Defaults to ``aio.block_size``.
        buffers: host buffers (a BufferPool, or HostBuffers carrying their pool index) to register
            with every engine as fixed buffers; registration failing is not an error.
        name: a tag in the swap file names (``nvme-offload-{name}-{host}-{pid}-{random}.swap``).
        o_direct: ``"auto"``, ``True`` or ``False``; overrides ``aio.o_direct``.

    Attributes:
        paths: the directories, absolute. files: the swap files, one per path.
        alignment: offsets and lengths of extents are multiples of this (at least 4096).
        stripe_unit: bytes per stripe. capacity: bytes of address space reserved (each file also has a
        guard block of ``alignment`` bytes after its share). used: bytes in live extents.
        backend: the engines' backend, ``"io_uring"`` or ``"threads"``.
        o_direct: whether every swap file is open with O_DIRECT.

    Raises:
        FileNotFoundError, NotADirectoryError, PermissionError: a path is unusable; the message says why.
        OSError: ``ENOSPC`` when the drives cannot hold ``nbytes``, with bytes needed and free per path.
        ValueError: duplicate paths or bad settings.

    A space belongs to the process that built it: in a child forked later its I/O raises
    ``RuntimeError``, and closing it there deletes nothing (the parent still owns the files).

    Example::

        with BufferPool(2, 1 << 20) as pool, SwapSpace(["/nvme0", "/nvme1"], buffers=pool) as space:
            a, b = space.alloc_many([3_000_000, 500_000])
            space.write(a, pool[0], nbytes=1 << 20).wait()
    """

    def __init__(self, paths: PathsLike, nbytes: int = 0, *, aio: AioConfig | None = None,
                 stripe_unit: int | None = None, buffers: Iterable[HostBuffer] | HostBuffer = (),
                 name: str = "swap", o_direct=None):
        aio = aio or AioConfig()
        _check_nbytes(nbytes)
        if o_direct is not None and o_direct not in ("auto", True, False):
            raise ConfigError(f'o_direct must be "auto", true or false, got {o_direct!r}')
        self.paths = check_paths(paths)
        self._lock = threading.RLock()
        self._pid = os.getpid()
        self._forked_from: int | None = None
        self._res = FileSet()
        self._finalizer = weakref.finalize(self, self._res.close)
        self._owner = next(_owner_ids)
        try:
            self._open(aio, stripe_unit, buffers, name, aio.o_direct if o_direct is None else o_direct)
            self.reserve(nbytes)
        except BaseException:
            self._finalizer()
            raise
        reset_after_fork(self)
        # NOTE: a child of multiprocessing's fork or forkserver methods ends with os._exit, after running
        # multiprocessing's own finalizers but not atexit's (where weakref.finalize runs): a space it made would
        # stay on disk. Registered there too, it is closed, and its files deleted, when such a child returns.
        # The finalizer runs once whoever calls it first; in a child forked after this space was made, closing
        # deletes nothing (the parent owns the files), and multiprocessing forgets the parent's finalizers.
        multiprocessing.util.Finalize(self, self._finalizer, exitpriority=10)

    def _open(self, aio, stripe_unit, buffers, name, o_direct) -> None:
        """Create the swap files and their engines, check the stripe unit, start the books empty, and warn of
        stale swap files found in the paths."""
        stale = {p: _files.find_stale(p) for p in self.paths}
        self._res.open(self.paths, aio, [buffers] if isinstance(buffers, HostBuffer) else list(buffers), name,
                       o_direct)
        self.files = list(self._res.names)
        self.backend = self._res.engines[0].backend
        self.o_direct = all(f.o_direct for f in self._res.files)
        self.alignment = self._res.alignment
        self.stripe_unit = _check_stripe_unit(aio.block_size if stripe_unit is None else stripe_unit,
                                              aio.block_size, self.alignment)
        self._alloc = ExtentAllocator(0, self.alignment, self._owner)
        _files.warn_stale(stale, stacklevel=3)

    def _after_fork_in_child(self) -> None:
        # The engines' threads stayed in the parent, and a parent thread may have held the lock.
        # Close the child's copies of the descriptors now: a long-lived child must not keep the
        # parent's swap files locked after the parent is gone.
        self._forked_from = self._pid
        self._lock = threading.RLock()
        for f in self._res.files:
            f._after_fork_in_child()
            f.close()

    # -- space --------------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Bytes of logical address space backed by preallocated file space."""
        return self._alloc.capacity

    @property
    def used(self) -> int:
        """Bytes held by live extents (padding included)."""
        return self._alloc.used

    def reserve(self, nbytes: int) -> None:
        """Make ``capacity >= nbytes`` by preallocating more of every swap file.

        Raises:
            OSError: ``ENOSPC`` with bytes needed and bytes free on each path; the space is left
                as it was.
        """
        _check_nbytes(nbytes)
        with self._lock:
            self._check_open()
            n = len(self.paths)
            per_file = round_up(nbytes, n * self.stripe_unit) // n
            self._res.grow(per_file, f"reserving {nbytes} bytes")
            self._alloc.grow(per_file * n)

    def alloc(self, nbytes: int) -> Extent:
        """An extent of at least ``nbytes`` (rounded up to ``alignment``), reusing freed space first.

        ``alloc(0)`` returns ``Extent(0, 0)``: valid to free, read and write (a no-op), holding no space.
        Grows the swap files when no free range fits; if that fails the space is left as it was.

        Raises:
            OSError: ``ENOSPC`` (or ``EDQUOT``) with bytes needed and free on each path.
        """
        _check_nbytes(nbytes)
        with self._lock:
            self._check_open()
            extent = self._alloc.alloc(nbytes)
            return extent if extent is not None else self.alloc_many([nbytes])[0]

    def alloc_many(self, sizes: Sequence[int]) -> list[Extent]:
        """Extents of at least ``sizes[i]`` bytes each, all or nothing.

        Everything the new extents need beyond the free space is reserved in one growth of the
        swap files first; only then are the extents recorded. Reusing freed space first, the
        extents come back in the order of ``sizes``.

        Raises:
            OSError: ``ENOSPC`` (or ``EDQUOT``) naming the bytes the whole request needs and the
                bytes free on each path; the space is then exactly as before (capacity, used, free
                ranges, file sizes) and its extents stay usable.
            ValueError: a size that is not a non-negative integer.
        """
        sizes = list(sizes)
        for n in sizes:
            _check_nbytes(n)
        with self._lock:
            self._check_open()
            plan = self._alloc.copy()
            extents = []
            for n in sizes:
                extent = plan.alloc(n)
                if extent is None:
                    plan.grow(plan.capacity_for(n))
                    extent = plan.alloc(n)
                    assert extent is not None  # grown to hold it
                extents.append(extent)
            npaths = len(self.paths)
            per_file = round_up(plan.capacity, npaths * self.stripe_unit) // npaths
            self._res.grow(per_file, f"{len(sizes)} extent(s) of {sum(e.nbytes for e in extents)} bytes")
            plan.grow(per_file * npaths)
            self._alloc = plan
            return extents

    def check_intact(self) -> None:
        """Raise if a swap file is shorter than it was preallocated to (truncated behind our back).

        A read inside the cut reports it too, but a write past the cut first would fill the gap with a
        hole that reads back as zeros: a caller that may write units it has not read since (from a copy in
        memory) checks first. Each file ends with a guard block that no extent reaches, so a cut made
        while our writes went on is still seen after them.

        Raises:
            OSError: ``ENODATA`` naming the swap file, its size and the size it should have.
        """
        with self._lock:
            self._check_open()
            self._res.check_intact()

    def regrow(self) -> None:
        """Give every swap file its preallocated size back, after a cut that :meth:`check_intact` named:
        for a caller about to rewrite every byte of state the space holds (a whole load), so that nothing is
        read from the cut.

        Raises:
            OSError: the file system cannot allocate the space again (ENOSPC naming the file).
        """
        with self._lock:
            self._check_open()
            self._res.regrow()

    def free(self, extent: Extent) -> None:
        """Give an extent back for reuse.

        Raises:
            ValueError: a double free, or an extent of another space.
        """
        with self._lock:
            self._check_open()
            self._alloc.free(extent)

    # -- I/O ----------------------------------------------------------------------------------

    def write(self, extent: Extent, buffer, *, buffer_offset: int = 0,
              nbytes: int | None = None, digest: bool = False) -> FutureGroup:
        """Start writing ``nbytes`` (default: the whole extent) from ``buffer[buffer_offset:]``.

        ``nbytes`` is rounded up to ``alignment``; the buffer must hold the rounded length. Returns a
        future: ``wait()`` returns the bytes moved or raises ``OSError`` naming the swap file; with
        ``digest``, its ``digest()`` is a checksum of the bytes written (a tuple of xxh3_64, one per
        swap file the extent is striped over), which a read of the same extent reproduces.
        """
        return self._submit(WRITE, extent, buffer, buffer_offset, nbytes, digest)

    def read(self, extent: Extent, buffer, *, buffer_offset: int = 0,
             nbytes: int | None = None, digest: bool = False) -> FutureGroup:
        """Start reading ``nbytes`` (default: the whole extent) into ``buffer[buffer_offset:]``.

        Same rules as :meth:`write`. ``wait()`` returns exactly the bytes asked (rounded up to the
        alignment), or raises ``OSError``: ``ENODATA`` naming the swap file, the file offset and the
        bytes expected and got when the file is shorter than the extent (it was truncated since it
        was preallocated, so the state there is lost).
        """
        return self._submit(READ, extent, buffer, buffer_offset, nbytes, digest)

    def sub(self, extent: Extent, start: int, nbytes: int) -> Extent:
        """The part of ``extent`` from ``start`` (a multiple of the alignment) holding ``nbytes`` bytes,
        its length rounded up to the alignment, for I/O on a piece of a larger extent.

        Raises:
            ValueError: ``start`` is not aligned, or the part does not lie inside ``extent``.
        """
        length = round_up(nbytes, self.alignment)
        if start % self.alignment or start < 0 or nbytes < 0 or start + length > extent.nbytes:
            raise ValueError(
                f"[{start}, {start + length}) is not an aligned part of an extent of {extent.nbytes} bytes "
                f"(alignment {self.alignment})"
            )
        return Extent(extent.offset + start, length, extent.owner)

    def locate(self, offset: int) -> tuple[str, int]:
        """Where logical ``offset`` lives: ``(swap file path, offset in that file)`` (for messages)."""
        n = len(self._res.names)
        if n == 1:
            return self._res.names[0], offset
        stripe, within = divmod(offset, self.stripe_unit)
        return self._res.names[stripe % n], (stripe // n) * self.stripe_unit + within

    def file_ranges(self, extent: Extent, nbytes: int | None = None) -> list[tuple[str, int, int, int]]:
        """Where the first ``nbytes`` (default: all) of ``extent`` lie on the swap files, in order:
        ``(swap file path, offset in that file, offset within the extent, length)`` per stripe piece
        (to clone an extent's bytes with the file system instead of copying them)."""
        length = extent.nbytes if nbytes is None else min(extent.nbytes, nbytes)
        out: list[tuple[str, int, int, int]] = []
        for segs in self._segments(extent.offset, length, b"", 0):
            out.extend((s.file.path, s.file_offset, s.buffer_offset, s.nbytes) for s in segs)
        return sorted(out, key=lambda r: r[2])

    def _submit(self, op, extent, buffer, buffer_offset, nbytes, digest=False) -> FutureGroup:
        with self._lock:
            self._check_open()
            length = self._check_range(extent, nbytes)
            self._check_buffer(buffer, buffer_offset, length)
            return self._start(op, extent.offset, length, buffer, buffer_offset, digest)

    def _check_range(self, extent, nbytes) -> int:
        """Check that ``extent`` is one of this space's and ``nbytes`` of it (all if None) fit in it; returns
        the length to move (``nbytes`` rounded up to the alignment)."""
        if not isinstance(extent, Extent):
            raise TypeError(f"expected an Extent, got {type(extent).__name__}")
        if extent.owner not in (0, self._owner):
            raise ValueError(f"{extent} belongs to another swap space")
        length = extent.nbytes if nbytes is None else round_up(nbytes, self.alignment)
        if (nbytes is not None and nbytes < 0) or length > extent.nbytes:
            raise ValueError(f"nbytes={nbytes} does not fit in {extent} (rounded to alignment "
                             f"{self.alignment}: {length})")
        if extent.offset % self.alignment or extent.end > self.capacity:
            raise ValueError(f"{extent} is not an extent of this swap space (capacity {self.capacity})")
        return length

    def _check_buffer(self, buffer, buffer_offset: int, length: int) -> None:
        """Check that ``length`` bytes at ``buffer_offset`` fit in ``buffer``, aligned for direct I/O."""
        size = buffer.nbytes if isinstance(buffer, HostBuffer) else memoryview(buffer).nbytes
        if buffer_offset < 0 or buffer_offset + length > size:
            raise ValueError(f"the buffer holds {size} bytes; {length} bytes (nbytes rounded up to the "
                             f"alignment {self.alignment}) at buffer offset {buffer_offset} do not fit")
        if (isinstance(buffer, HostBuffer) and self.o_direct
                and (buffer.address + buffer_offset) % self.alignment):
            raise ValueError(f"buffer_offset {buffer_offset} must be a multiple of the alignment "
                             f"{self.alignment}")

    def _start(self, op, offset: int, length: int, buffer, buffer_offset: int, digest: bool) -> FutureGroup:
        """Submit the request on every path's engine: one vectored request per path the range is striped over."""
        futures = []
        try:
            for i, segs in enumerate(self._segments(offset, length, buffer, buffer_offset)):
                if segs:
                    # Every byte of an extent lies inside the preallocated files: a read that
                    # meets end of file found a truncated file, never a legitimate prefix.
                    futures.append(self._res.engines[i].submit(op, segs, exact=True, digest=digest))
        except BaseException:
            wait_quietly(futures)  # don't leave half a request running against the caller's buffer
            raise
        return FutureGroup(futures)

    def _segments(self, offset: int, nbytes: int, buffer, buffer_offset: int) -> list[list[Segment]]:
        files = self._res.files
        n = len(files)
        per_path: list[list[Segment]] = [[] for _ in range(n)]
        if nbytes == 0:
            return per_path
        if n == 1:
            per_path[0].append(Segment(files[0], offset, buffer, buffer_offset, nbytes))
            return per_path
        stripe_unit = self.stripe_unit
        pos, end = offset, offset + nbytes
        while pos < end:
            stripe, within = divmod(pos, stripe_unit)
            take = min(stripe_unit - within, end - pos)
            i = stripe % n
            per_path[i].append(Segment(files[i], (stripe // n) * stripe_unit + within, buffer,
                                       buffer_offset + pos - offset, take))
            pos += take
        return per_path

    # -- testing and introspection --------------------------------------------------------------

    def inject_fault(self, kind: str, **kw) -> None:
        """Testing hook: arm the same fault on every path's engine (see :meth:`Engine.inject_fault`)."""
        with self._lock:
            self._check_open()
            for engine in self._res.engines:
                engine.inject_fault(kind, **kw)

    def stats(self, *, per_path: bool = False):
        """The engines' counters summed (``fixed_buffers`` is the smallest), or one dict per path."""
        with self._lock:
            self._check_open()
            each = [e.stats() for e in self._res.engines]
        if per_path:
            return each
        total = {k: sum(s[k] for s in each) for k in each[0]}
        total["fixed_buffers"] = min(s["fixed_buffers"] for s in each)
        return total

    # -- stale files ------------------------------------------------------------------------------

    @staticmethod
    def find_stale(path: str | os.PathLike) -> list[str]:
        """Swap files in ``path`` left by runs that ended without cleaning up (e.g. a crash).

        A swap file is stale when no live process holds its lock; a file held by a live space is
        never reported. Special files and symlinks named like swap files are never opened or followed.
        """
        return _files.find_stale(path)

    @staticmethod
    def remove_stale(path: str | os.PathLike) -> list[str]:
        """Delete the stale swap files in ``path`` (see :meth:`find_stale`); returns those removed."""
        return _files.remove_stale(path)

    # -- lifetime ---------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Whether the swap space is closed (its files deleted)."""
        return not self._finalizer.alive

    def close(self) -> None:
        """Wait for I/O in flight, then close and delete the swap files. Safe to call twice.

        In a child forked after the space was built, it only lets go of the child's copy.
        """
        with self._lock:
            self._finalizer()

    def _check_open(self) -> None:
        if self._forked_from is not None:
            raise RuntimeError(
                f"this swap space was created in process {self._forked_from} before a fork and cannot be "
                f"used in the child (process {os.getpid()}): its engines' I/O threads exist only in the "
                "parent. Build a new swap space (or optimizer) in the child."
            )
        if not self._finalizer.alive:
            raise ValueError("the swap space is closed")

    def __enter__(self) -> SwapSpace:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        if self.closed:
            return "SwapSpace(closed)"
        return (f"SwapSpace(paths={self.paths!r}, capacity={self.capacity}, used={self.used}, "
                f"stripe_unit={self.stripe_unit}, alignment={self.alignment}, backend={self.backend!r})")


def _check_nbytes(nbytes) -> None:
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
        raise ValueError(f"nbytes must be a non-negative number of bytes, got {nbytes!r}")


def _check_stripe_unit(unit, block_size: int, alignment: int) -> int:
    """``unit`` if it is a positive multiple of ``block_size`` and of ``alignment``; raises ConfigError if not."""
    if (not isinstance(unit, int) or isinstance(unit, bool) or unit <= 0 or unit % block_size
            or unit % alignment):
        raise ConfigError(f"stripe_unit must be a positive multiple of block_size ({block_size}) "
                          f"and of the direct-I/O alignment ({alignment}), got {unit!r}")
    return unit
