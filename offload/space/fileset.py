"""A swap space's file set: one engine and one preallocated, locked swap file per path, sized together.

Space grows only by the same number of bytes on every file, and a failed growth gives back what it took,
so the files are all grown or all as they were. After its share of the address space each file has one
guard block (the alignment), which no extent reaches: writes of state cannot give a truncated file its
size back, so ``check_intact`` sees a cut made at any time. Only growth (which checks first) and
``regrow`` (for a load that rewrites all the state) ever lengthen a file or write its guard block, which
ends in the seal that lets ``offload-swap clean`` prove a file is ours.
"""

from __future__ import annotations

import errno
import os
from typing import Sequence

from ..aio import AioFile, Engine, reserve
from ..buffers import HostBuffer
from ..config import AioConfig
from ..sizes import ALIGNMENT
from . import files as _files
from .paths import no_space_message

__all__ = ["FileSet"]


def _preallocate(f: AioFile, offset: int, length: int) -> None:
    """Allocate ``length`` bytes of the swap file ``f`` from ``offset`` (its size grows to match). Where the file
    system has no fallocate (ramfs, NFSv3, ext4 without extents) a file open without O_DIRECT gets glibc's
    fallback, a byte written per block; one open with O_DIRECT cannot (those writes fail with EINVAL).

    Raises:
        OSError: ENOSPC or EDQUOT (the caller names the bytes); EOPNOTSUPP for an O_DIRECT file where the file
            system cannot preallocate, saying what to do.
    """
    if reserve(f.fd, offset, length, f.path):
        return
    if not f.o_direct:
        os.posix_fallocate(f.fd, offset, length)
    else:
        raise OSError(errno.EOPNOTSUPP, "cannot preallocate the swap file: this file system has no fallocate "
                      "(NFSv3, ext4 without extents, some FUSE file systems); put nvme_path on a local ext4, "
                      "XFS or btrfs file system, or set aio.o_direct to false", f.path)


class FileSet:
    """The engines, open swap files and file names of a swap space, one of each per path, in path order.

    Kept apart from the SwapSpace so a ``weakref.finalize`` can release it at garbage collection or
    interpreter exit without keeping the space alive.

    Attributes:
        engines, files, names: one per path. paths: the directories. pid: the process that created the
        files. alignment: what every file's direct I/O needs (at least 4096), known once :meth:`open`
        returned. per_file: bytes of address space each file holds (a guard block follows them).
    """

    def __init__(self) -> None:
        self.engines: list[Engine] = []
        self.files: list[AioFile] = []
        self.names: list[str] = []
        self.paths: list[str] = []
        self.pid = os.getpid()
        self.alignment = ALIGNMENT
        self.per_file = 0

    def open(self, paths: Sequence[str], aio: AioConfig, buffers: list[HostBuffer], name: str, o_direct) -> None:
        """Start one engine per path, registering ``buffers`` with it as fixed buffers where it can, and
        create the path's swap file (see :func:`offload.space.files.create_swap_file`)."""
        self.paths = list(paths)
        for path in self.paths:
            engine = Engine(aio)
            self.engines.append(engine)
            if buffers:
                try:
                    engine.register_buffers(buffers)
                except (ValueError, RuntimeError, OSError):
                    pass  # fixed buffers are an optimisation; plain reads and writes work the same
            f = _files.create_swap_file(path, name, o_direct=o_direct)
            self.files.append(f)
            self.names.append(f.path)
        self.alignment = max([ALIGNMENT] + [f.alignment for f in self.files])

    # -- sizes --------------------------------------------------------------------------------------

    def file_bytes(self, per_file: int) -> int:
        """A swap file's size holding ``per_file`` bytes of address space: those and a guard block."""
        return per_file + self.alignment if per_file else 0

    def grow(self, per_file: int, what: str) -> None:
        """Preallocate every swap file to ``per_file`` bytes of address space (and the guard block after
        them), or leave them all as they were.

        Raises:
            OSError: ``ENODATA`` for a file cut short (see :meth:`check_intact`); ``ENOSPC`` or ``EDQUOT``
                naming ``what`` needed it, with bytes needed and free on each path; another error of
                fallocate, naming the file.
        """
        if per_file <= self.per_file:
            return
        # Growing a truncated file would give it its size back with a hole in the cut: name the cut first.
        self.check_intact()
        grown, before = 0, self.file_bytes(self.per_file)
        sizes = [os.fstat(f.fd).st_size for f in self.files]
        try:
            for f in self.files:
                _preallocate(f, before, self.file_bytes(per_file) - before)
                _files.seal(f, per_file, self.alignment)
                grown += 1
        except OSError as err:
            # Give back what this call took, on the file that failed too (it may have grown part-way).
            _shrink_to(self.files[:grown + 1], sizes)
            failed = self.files[grown].path
            if err.errno in (errno.ENOSPC, errno.EDQUOT):
                need = {p: self.file_bytes(per_file) - before for p in self.paths}
                raise OSError(err.errno, no_space_message(need, what), failed) from err
            if err.errno == errno.EOPNOTSUPP:
                raise  # says what to do, naming the file
            assert err.errno is not None  # fallocate's errno
            raise OSError(err.errno, f"cannot preallocate the swap file ({os.strerror(err.errno)})", failed) from err
        self.per_file = per_file

    def check_intact(self) -> None:
        """Raise ``OSError`` (``ENODATA``, naming the file, its size and the size it should have) if a swap file
        is shorter than it was preallocated to."""
        want = self.file_bytes(self.per_file)
        for f in self.files:
            size = os.fstat(f.fd).st_size
            if size < want:
                raise OSError(errno.ENODATA, f"the swap file is {size} bytes, shorter than the {want} bytes it "
                                             "was preallocated to: it was truncated behind our back, so state "
                                             "stored in it is lost", f.path)

    def regrow(self) -> None:
        """Give every swap file cut short its preallocated size back, and its guard block's seal.

        Raises:
            OSError: the file system cannot allocate the space again (ENOSPC naming the file).
        """
        want = self.file_bytes(self.per_file)
        for f in self.files:
            if os.fstat(f.fd).st_size < want:
                try:
                    _preallocate(f, 0, want)
                except OSError as err:
                    if err.errno == errno.EOPNOTSUPP:
                        raise
                    assert err.errno is not None  # fallocate's errno
                    raise OSError(err.errno, f"cannot preallocate the swap file again ({os.strerror(err.errno)})",
                                  f.path) from err
                if self.per_file:
                    _files.seal(f, self.per_file, self.alignment)

    # -- release ------------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the engines (each waits for everything in flight), delete the files (only in the process
        that created them: a forked child inherits this object) and close them, which releases their
        locks. Everything is released; then the first error is raised."""
        first = self._close_engines()
        if os.getpid() == self.pid:
            unlinked = self._unlink()
            first = first or unlinked
        for f in self.files:
            f.close()  # releases the flock
        self.engines, self.files, self.names = [], [], []
        if first is not None:
            raise first

    def _close_engines(self) -> Exception | None:
        """Close every engine (returns at once in a forked child); the first error, or None."""
        first = None
        for engine in self.engines:
            try:
                engine.close()
            except Exception as err:  # keep releasing the rest, report the first
                first = first or err
        return first

    def _unlink(self) -> OSError | None:
        """Delete the swap files, still locked so nobody sees them as stale; the first error, or None."""
        first = None
        for name in self.names:
            try:
                os.unlink(name)
            except FileNotFoundError:
                pass
            except OSError as err:
                first = first or err
        return first


def _shrink_to(files: list[AioFile], sizes: list[int]) -> None:
    """Shrink each file back to the size it had (never lengthening one), ignoring errors."""
    for f, size in zip(files, sizes):
        try:
            if os.fstat(f.fd).st_size > size:
                os.ftruncate(f.fd, size)
        except OSError:
            pass
