"""The swap space: aligned extents of one logical address space, striped over one file per drive.

# NOTE: each directory in ``paths`` gets one swap file, preallocated with fallocate so that a full
# disk is reported when the space is built (with bytes needed and free), not in the middle of
# training. The logical address space is striped over the files in ``stripe_unit`` pieces (software
# RAID0): logical offset L lives in stripe s = L // unit, in file s % N, at file offset
# (s // N) * unit + L % unit. Every path has its own Engine (its own queue), and a read or write of
# an extent becomes one vectored request per path, so N drives move an extent in parallel and one
# slow drive does not stall the others' queues.
#
# Swap files are named ``nvme-offload-{name}-{host}-{pid}-{random}.swap`` and held under an
# exclusive flock while open. A file of that pattern that nobody holds locked is left over from a
# crashed run: it is never reused, only reported (``find_stale``) and removed on request
# (``remove_stale``).

Example::

    with BufferPool(2, 1 << 20) as pool, SwapSpace(["/nvme0", "/nvme1"], 1 << 30, buffers=pool) as space:
        extent = space.alloc(3_000_000)
        space.write(extent, pool[0], nbytes=1 << 20).wait()
"""

from __future__ import annotations

import bisect
import errno as _errno
import fcntl
import itertools
import os
import re
import secrets
import socket
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Iterable, Sequence, Union

from ._proc import pid_alive
from .aio import READ, WRITE, AioFile, Engine, FutureGroup, Segment, wait_quietly
from .buffers import HostBuffer
from .config import AioConfig
from .errors import ConfigError
from .units import ALIGNMENT, format_size, round_up

__all__ = ["Extent", "ExtentAllocator", "SwapSpace"]

_PREFIX = "nvme-offload-"
_SUFFIX = ".swap"
# name, host, pid, random: the name is reduced to [A-Za-z0-9_] so the first dash ends it.
_PATTERN = re.compile(r"^nvme-offload-(?P<name>[A-Za-z0-9_]+)-(?P<host>[A-Za-z0-9.\-]+)-(?P<pid>\d+)-"
                      r"(?P<rand>[0-9a-f]{8})\.swap$")
# A file is created and then locked a moment later; one younger than this, whose owner is alive on
# this host, is never called stale even when unlocked.
_STALE_MIN_AGE_S = 10.0

_owner_ids = itertools.count(1)

PathsLike = Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]]




@dataclass(frozen=True)
class Extent:
    """A range of a swap space's logical address space.

    Attributes:
        offset: start, a multiple of the space's ``alignment``.
        nbytes: reserved length, a multiple of the space's ``alignment`` (at least what was asked;
            0 only for a zero-length allocation).
        owner: the allocating space's id (0: unknown, e.g. built by hand), so that freeing another
            space's extent is caught. Not part of equality.
    """

    offset: int
    nbytes: int
    owner: int = field(default=0, compare=False, repr=False)

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


class ExtentAllocator:
    """Bookkeeping of a ``[0, capacity)`` address space in aligned extents (no I/O).

    Best fit over a sorted list of free ranges; a freed extent merges with free neighbours, so after
    everything is freed the space is one free range again and fragmentation cannot accumulate.

    Args:
        capacity: initial size of the address space (a multiple of ``alignment``).
        alignment: every offset and length is a multiple of this.
        owner: id stamped on the extents handed out (see :attr:`Extent.owner`).
    """

    def __init__(self, capacity: int = 0, alignment: int = ALIGNMENT, owner: int = 0):
        if alignment <= 0 or capacity < 0 or capacity % alignment:
            raise ValueError(f"capacity {capacity} must be a non-negative multiple of alignment {alignment}")
        self.alignment = alignment
        self.owner = owner
        self.capacity = 0
        self.used = 0
        self._free_starts: list[int] = []  # sorted
        self._free_len: dict[int, int] = {}  # start -> length
        self._live: dict[int, int] = {}  # offset -> length
        self.grow(capacity)

    def size_for(self, nbytes: int) -> int:
        """``nbytes`` rounded up to the alignment (what an extent of that request reserves)."""
        return round_up(nbytes, self.alignment)

    def alloc(self, nbytes: int) -> Extent | None:
        """An extent of at least ``nbytes``, or ``None`` if no free range is large enough."""
        size = self.size_for(nbytes)
        if size == 0:
            return Extent(0, 0, self.owner)
        best = None
        for start in self._free_starts:
            length = self._free_len[start]
            if length >= size and (best is None or length < self._free_len[best]):
                best = start
                if length == size:
                    break
        if best is None:
            return None
        length = self._free_len.pop(best)
        i = bisect.bisect_left(self._free_starts, best)
        if length == size:
            del self._free_starts[i]
        else:
            # Keep the remainder where it is: the start moves up, so the list stays sorted.
            self._free_starts[i] = best + size
            self._free_len[best + size] = length - size
        self._live[best] = size
        self.used += size
        return Extent(best, size, self.owner)

    def capacity_for(self, nbytes: int) -> int:
        """The smallest capacity at which ``alloc(nbytes)`` would succeed (growing from the end)."""
        size = self.size_for(nbytes)
        tail = 0
        if self._free_starts:
            last = self._free_starts[-1]
            if last + self._free_len[last] == self.capacity:
                tail = self._free_len[last]
        return self.capacity + max(0, size - tail)

    def grow(self, capacity: int) -> None:
        """Extend the address space to ``capacity`` (no-op if it is already that large)."""
        if capacity % self.alignment:
            raise ValueError(f"capacity {capacity} is not a multiple of the alignment {self.alignment}")
        if capacity <= self.capacity:
            return
        old, self.capacity = self.capacity, capacity
        self._insert_free(old, capacity - old)

    def free(self, extent: Extent) -> None:
        """Return an extent. Raises ValueError for a double free or an extent this space did not give."""
        if not isinstance(extent, Extent):
            raise TypeError(f"expected an Extent, got {type(extent).__name__}")
        if extent.owner not in (0, self.owner):
            raise ValueError(f"{extent} belongs to another swap space (owner {extent.owner}, "
                             f"this is {self.owner})")
        if extent.nbytes == 0:
            return
        if self._live.get(extent.offset) != extent.nbytes:
            if self._is_free(extent.offset):
                raise ValueError(f"{extent} is already free (double free)")
            raise ValueError(f"{extent} was not allocated from this swap space")
        del self._live[extent.offset]
        self.used -= extent.nbytes
        self._insert_free(extent.offset, extent.nbytes)

    def free_ranges(self) -> list[tuple[int, int]]:
        """The free ``(offset, nbytes)`` ranges, sorted (for tests and diagnostics)."""
        return [(s, self._free_len[s]) for s in self._free_starts]

    def live_extents(self) -> list[Extent]:
        """The extents handed out and not freed, sorted by offset."""
        return [Extent(o, n, self.owner) for o, n in sorted(self._live.items())]

    def _is_free(self, offset: int) -> bool:
        i = bisect.bisect_right(self._free_starts, offset) - 1
        return i >= 0 and offset < self._free_starts[i] + self._free_len[self._free_starts[i]]

    def _insert_free(self, start: int, length: int) -> None:
        i = bisect.bisect_left(self._free_starts, start)
        # Merge with the following range if it starts where this one ends.
        if i < len(self._free_starts) and self._free_starts[i] == start + length:
            length += self._free_len.pop(self._free_starts[i])
            del self._free_starts[i]
        # Merge with the preceding range if it ends where this one starts.
        if i > 0:
            prev = self._free_starts[i - 1]
            if prev + self._free_len[prev] == start:
                self._free_len[prev] += length
                return
        self._free_starts.insert(i, start)
        self._free_len[start] = length


class _Files:
    """What a SwapSpace must release: its engines, open files and their names.

    Kept apart from the SwapSpace so a ``weakref.finalize`` can release it at garbage collection or
    interpreter exit without keeping the space alive.
    """

    def __init__(self):
        self.engines: list[Engine] = []
        self.files: list[AioFile] = []
        self.names: list[str] = []
        self.pid = os.getpid()

    def close(self) -> None:
        first = None
        for engine in self.engines:
            try:
                engine.close()  # waits for everything in flight
            except Exception as err:  # noqa: BLE001 - keep releasing the rest, report the first
                first = first or err
        # A forked child inherits this object; only the creating process deletes the files.
        owner = os.getpid() == self.pid
        for name in self.names:
            if owner:
                try:
                    os.unlink(name)  # while still locked, so nobody sees it as stale
                except FileNotFoundError:
                    pass
                except OSError as err:
                    first = first or err
        for f in self.files:
            f.close()  # releases the flock
        self.engines, self.files, self.names = [], [], []
        if first is not None:
            raise first


class SwapSpace:
    """Aligned extents over one preallocated swap file per directory, striped RAID0-style.

    Args:
        paths: one directory, or a list of directories (one per drive). A missing directory is
            created when its parent exists.
        nbytes: bytes to reserve up front (fallocate), so a full disk is reported now.
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
        stripe_unit: bytes per stripe. capacity: bytes reserved. used: bytes in live extents.
        backend: the engines' backend, ``"io_uring"`` or ``"threads"``.
        o_direct: whether every swap file is open with O_DIRECT.

    Raises:
        FileNotFoundError, NotADirectoryError, PermissionError: a path is unusable; the message says why.
        OSError: ``ENOSPC`` when the drives cannot hold ``nbytes``, with bytes needed and free per path.
        ValueError: duplicate paths or bad settings.
    """

    def __init__(self, paths: PathsLike, nbytes: int = 0, *, aio: AioConfig | None = None,
                 stripe_unit: int | None = None, buffers: Iterable[HostBuffer] | HostBuffer = (),
                 name: str = "swap", o_direct=None):
        aio = aio or AioConfig()
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise ValueError(f"nbytes must be a non-negative number of bytes, got {nbytes!r}")
        if o_direct is not None and o_direct not in ("auto", True, False):
            raise ConfigError(f'o_direct must be "auto", true or false, got {o_direct!r}')
        self.paths = _check_paths(paths)
        self._lock = threading.RLock()
        self._res = _Files()
        self._finalizer = weakref.finalize(self, self._res.close)
        self._owner = next(_owner_ids)
        try:
            self._open(aio, stripe_unit, buffers, name, o_direct, nbytes)
        except BaseException:
            self._finalizer()
            raise

    def _open(self, aio, stripe_unit, buffers, name, o_direct, nbytes) -> None:
        stale = {p: SwapSpace.find_stale(p) for p in self.paths}
        tag = re.sub(r"[^A-Za-z0-9_]", "_", str(name)) or "swap"
        host = re.sub(r"[^A-Za-z0-9.\-]", "", socket.gethostname()) or "localhost"
        buffers = [buffers] if isinstance(buffers, HostBuffer) else list(buffers)
        for path in self.paths:
            engine = Engine(aio)
            self._res.engines.append(engine)
            if buffers:
                try:
                    engine.register_buffers(buffers)
                except (ValueError, RuntimeError, OSError):
                    pass  # fixed buffers are an optimisation; plain reads and writes work the same
            fname = os.path.join(path, f"{_PREFIX}{tag}-{host}-{os.getpid()}-{secrets.token_hex(4)}{_SUFFIX}")
            try:
                f = engine.open(fname, "x+", o_direct=o_direct)
            except PermissionError as err:
                raise PermissionError(
                    err.errno, f"cannot create a swap file in {path} ({err.strerror}); "
                    "give this user write access or choose another nvme_path", fname) from err
            self._res.files.append(f)
            self._res.names.append(fname)
            try:
                fcntl.flock(f.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                pass  # a file system without flock: stale detection falls back on the pid in the name
        self.files = list(self._res.names)
        self.backend = self._res.engines[0].backend
        self.o_direct = all(f.o_direct for f in self._res.files)
        self.alignment = max([ALIGNMENT] + [f.alignment for f in self._res.files])
        unit = aio.block_size if stripe_unit is None else stripe_unit
        if (not isinstance(unit, int) or isinstance(unit, bool) or unit <= 0 or unit % aio.block_size
                or unit % self.alignment):
            raise ConfigError(f"stripe_unit must be a positive multiple of block_size ({aio.block_size}) "
                              f"and of the direct-I/O alignment ({self.alignment}), got {unit!r}")
        self.stripe_unit = unit
        self._per_file = 0
        self._alloc = ExtentAllocator(0, self.alignment, self._owner)
        self._warn_stale(stale)
        self.reserve(nbytes)

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
            OSError: ``ENOSPC`` with bytes needed and bytes free on each path (the files are left
                as they were).
        """
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise ValueError(f"nbytes must be a non-negative number of bytes, got {nbytes!r}")
        with self._lock:
            self._check_open()
            n = len(self.paths)
            per_file = round_up(nbytes, n * self.stripe_unit) // n
            if per_file <= self._per_file:
                return
            grown = []
            try:
                for f in self._res.files:
                    os.posix_fallocate(f.fd, self._per_file, per_file - self._per_file)
                    grown.append(f)
            except OSError as err:
                # Give back what this call took, on the file that failed too (it may have grown part-way).
                for g in self._res.files[:len(grown) + 1]:
                    try:
                        os.ftruncate(g.fd, self._per_file)
                    except OSError:
                        pass
                if err.errno in (_errno.ENOSPC, _errno.EDQUOT):
                    raise OSError(err.errno, self._no_space_message(per_file - self._per_file),
                                  self._res.files[len(grown)].path) from err
                raise OSError(err.errno, f"cannot preallocate the swap file ({err.strerror})",
                              self._res.files[len(grown)].path) from err
            self._per_file = per_file
            self._alloc.grow(per_file * n)

    def alloc(self, nbytes: int) -> Extent:
        """An extent of at least ``nbytes`` (rounded up to ``alignment``), reusing freed space first.

        ``alloc(0)`` returns ``Extent(0, 0)``: valid to free, read and write (a no-op), holding no space.
        Grows the swap files when no free range fits (see :meth:`reserve`).
        """
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise ValueError(f"nbytes must be a non-negative number of bytes, got {nbytes!r}")
        with self._lock:
            self._check_open()
            extent = self._alloc.alloc(nbytes)
            if extent is None:
                self.reserve(self._alloc.capacity_for(nbytes))
                extent = self._alloc.alloc(nbytes)
            return extent

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
              nbytes: int | None = None) -> FutureGroup:
        """Start writing ``nbytes`` (default: the whole extent) from ``buffer[buffer_offset:]``.

        ``nbytes`` is rounded up to ``alignment``; the buffer must hold the rounded length. Returns a
        future: ``wait()`` returns the bytes moved or raises ``OSError`` naming the swap file.
        """
        return self._submit(WRITE, extent, buffer, buffer_offset, nbytes)

    def read(self, extent: Extent, buffer, *, buffer_offset: int = 0,
             nbytes: int | None = None) -> FutureGroup:
        """Start reading ``nbytes`` (default: the whole extent) into ``buffer[buffer_offset:]``.

        Same rules as :meth:`write`.
        """
        return self._submit(READ, extent, buffer, buffer_offset, nbytes)

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

    def _submit(self, op, extent, buffer, buffer_offset, nbytes) -> FutureGroup:
        with self._lock:
            self._check_open()
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
            size = buffer.nbytes if isinstance(buffer, HostBuffer) else memoryview(buffer).nbytes
            if buffer_offset < 0 or buffer_offset + length > size:
                raise ValueError(f"the buffer holds {size} bytes; {length} bytes (nbytes rounded up to the "
                                 f"alignment {self.alignment}) at buffer offset {buffer_offset} do not fit")
            if (isinstance(buffer, HostBuffer) and self.o_direct
                    and (buffer.address + buffer_offset) % self.alignment):
                raise ValueError(f"buffer_offset {buffer_offset} must be a multiple of the alignment "
                                 f"{self.alignment}")
            futures = []
            try:
                for i, segs in enumerate(self._segments(extent.offset, length, buffer, buffer_offset)):
                    if segs:
                        futures.append(self._res.engines[i].submit(op, segs))
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
        unit = self.stripe_unit
        pos, end = offset, offset + nbytes
        while pos < end:
            stripe, within = divmod(pos, unit)
            take = min(unit - within, end - pos)
            i = stripe % n
            per_path[i].append(Segment(files[i], (stripe // n) * unit + within, buffer,
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

        A swap file is stale when no process holds its lock and it is not one being created right
        now (its process is gone, or it is older than a few seconds).
        """
        path = os.fspath(path)
        try:
            names = sorted(os.listdir(path))
        except (FileNotFoundError, NotADirectoryError):
            return []
        host = socket.gethostname()
        stale = []
        for fname in names:
            m = _PATTERN.match(fname)
            if m is None:
                continue
            full = os.path.join(path, fname)
            try:
                fd = os.open(full, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                continue  # gone, or not ours to judge
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    continue  # held by a live space (or flock unsupported: cannot tell, so not stale)
                age = time.time() - os.fstat(fd).st_ctime
                if age < _STALE_MIN_AGE_S and (m["host"] != re.sub(r"[^A-Za-z0-9.\-]", "", host)
                                               or pid_alive(int(m["pid"]))):
                    continue
                stale.append(full)
            finally:
                os.close(fd)
        return stale

    @staticmethod
    def remove_stale(path: str | os.PathLike) -> list[str]:
        """Delete the stale swap files in ``path`` (see :meth:`find_stale`); returns those removed."""
        removed = []
        for full in SwapSpace.find_stale(path):
            try:
                fd = os.open(full, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # still nobody's: safe to delete
                os.unlink(full)
                removed.append(full)
            except OSError:
                pass
            finally:
                os.close(fd)
        return removed

    def _warn_stale(self, stale: dict[str, list[str]]) -> None:
        found = {p: files for p, files in stale.items() if files}
        if not found:
            return
        parts = []
        for p, files in found.items():
            held = sum(_allocated(f) for f in files)
            parts.append(f"{p}: {len(files)} file(s) holding {format_size(held)}")
        warnings.warn(
            "stale swap files from runs that did not clean up (not reused): " + "; ".join(parts)
            + ". Remove them with SwapSpace.remove_stale(path) or `rm` once no run uses them.",
            RuntimeWarning, stacklevel=4)

    def _no_space_message(self, per_file_more: int) -> str:
        by_dev: dict[int, list[str]] = {}
        for p in self.paths:
            by_dev.setdefault(os.stat(p).st_dev, []).append(p)
        lines = []
        for group in by_dev.values():
            st = os.statvfs(group[0])
            free = st.f_bavail * st.f_frsize
            need = per_file_more * len(group)
            where = group[0] if len(group) == 1 else " and ".join(group) + " (one file system)"
            lines.append(f"{where}: needs {need} bytes ({format_size(need)}), "
                         f"has {free} bytes ({format_size(free)}) free")
        total = per_file_more * len(self.paths)
        return (f"not enough disk space for {total} more bytes ({format_size(total)}) of swap: "
                + "; ".join(lines) + ". Free some space, add or choose a larger nvme_path, or offload less.")

    # -- lifetime ---------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Wait for I/O in flight, then close and delete the swap files. Safe to call twice."""
        with self._lock:
            self._finalizer()

    def _check_open(self) -> None:
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


def _check_paths(paths: PathsLike) -> list[str]:
    if isinstance(paths, (str, bytes, os.PathLike)):
        paths = [paths]
    try:
        paths = [os.path.abspath(os.fsdecode(p)) for p in paths]
    except TypeError as err:
        raise ValueError(f"paths must be a directory or a list of directories, got {paths!r}") from err
    if not paths:
        raise ValueError("paths is empty: give at least one directory (one per drive)")
    seen: dict[tuple[int, int], str] = {}
    for p in paths:
        if not os.path.exists(p):
            parent = os.path.dirname(p)
            if not os.path.isdir(parent):
                raise FileNotFoundError(_errno.ENOENT, f"swap directory does not exist, nor does its parent "
                                        f"{parent}; create it or choose another nvme_path", p)
            try:
                os.mkdir(p)
            except FileExistsError:
                pass  # another process made it meanwhile
            except OSError as err:
                raise type(err)(err.errno, f"cannot create the swap directory ({err.strerror}); create it "
                                "or choose another nvme_path", p) from err
        if not os.path.isdir(p):
            raise NotADirectoryError(_errno.ENOTDIR, "swap path is not a directory; nvme_path must name "
                                     "directories (one per drive)", p)
        if os.statvfs(p).f_flag & os.ST_RDONLY:
            raise PermissionError(_errno.EROFS, "swap directory is on a read-only file system; choose a "
                                  "writable nvme_path", p)
        if not os.access(p, os.W_OK | os.X_OK):
            raise PermissionError(_errno.EACCES, "swap directory is not writable by this user; fix its "
                                  "permissions or choose another nvme_path", p)
        st = os.stat(p)
        key = (st.st_dev, st.st_ino)
        if key in seen:
            raise ValueError(f"paths lists the same directory twice ({seen[key]!r} and {p!r}); give each "
                             "directory once (one per drive)")
        seen[key] = p
    return paths


def _allocated(path: str) -> int:
    try:
        return os.stat(path).st_blocks * 512
    except OSError:
        return 0
