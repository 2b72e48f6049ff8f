"""Moving a checkpoint's data file through host buffers: ranged reads and the writer of state.bin and params.bin."""

from __future__ import annotations

import errno as _errno
import fcntl
import os
import struct
import sys
from typing import Any, Callable, Optional, Sequence

import torch
import xxhash
from tqdm import tqdm

from ..aio import CompletedFuture, Engine
from ..buffers import BufferPool
from ..config import AioConfig, load_config
from ..errors import CheckpointError, ChecksumError
from ..pipeline import Pipeline
from ..units import ALIGNMENT, round_up
from .commit import _Staged
from .format import DATA

# Pool for tools that read a checkpoint without an optimizer (verify, export): per buffer.
_TOOL_BUFFER_MAX = 64 << 20


# NOTE: save, load, verify, export and import all move state.bin with the native engine through a
# few page-aligned buffers (the optimizer's pool, or a small one of the tools' own), never holding
# more than those buffers in host memory. ``_stream`` overlaps the reads ahead, the processing of
# one buffer and the writes behind; ``_write_data`` lays units out in state.bin and hashes them as
# they pass. Every engine that touches a data file comes from the save's or load's ``Storage``.
def _tool_pool(manifest: dict) -> BufferPool:
    longest = max([u["length"] for u in manifest["units"]] + [ALIGNMENT])
    return BufferPool(3, min(longest, _TOOL_BUFFER_MAX))


def _aio_of(manifest: dict) -> AioConfig:
    try:
        return load_config({"aio": manifest["config"]["aio"]}).aio
    except Exception:  # noqa: BLE001 - a config this version cannot read: the defaults do
        return AioConfig()


_DONE = CompletedFuture()


def _progress(total: int, what: str, enabled: Optional[bool] = None, *, delay: float = 1.0) -> tqdm:
    """A progress bar of ``total`` bytes on stderr, shown once the work has lasted ``delay`` seconds;
    ``enabled`` None shows it only where stderr is a terminal."""
    if enabled is None:
        enabled = sys.stderr.isatty()
    return tqdm(total=total, desc=what, unit="B", unit_scale=True, unit_divisor=1024, delay=delay, leave=False,
                disable=not enabled, dynamic_ncols=True, file=sys.stderr)


# -- cloning extents (reflink) ----------------------------------------------------------------------

FICLONERANGE = 0x4020940D  # _IOW(0x94, 13, struct file_clone_range)
# What a file system says when it cannot share extents between these two files: no reflink support
# (ext4, tmpfs), two file systems, or offsets and lengths that are not multiples of its block size.
_NO_CLONE = frozenset({_errno.EOPNOTSUPP, _errno.ENOTSUP, _errno.EXDEV, _errno.EINVAL, _errno.ENOTTY,
                       _errno.ENOSYS, _errno.EBADF})


def _clone_range(src_fd: int, src_offset: int, length: int, dst_fd: int, dst_offset: int) -> bool:
    """Make ``length`` bytes of ``dst_fd`` at ``dst_offset`` share the extents of ``src_fd`` at
    ``src_offset`` (``FICLONERANGE``: XFS with reflink, btrfs): metadata only, whatever the length.
    False where the file system cannot (the caller copies the bytes instead).

    Raises:
        OSError: any other failure (ENOSPC, EIO, ...).
    """
    try:
        fcntl.ioctl(dst_fd, FICLONERANGE, struct.pack("qQQQ", src_fd, src_offset, length, dst_offset))
    except OSError as err:
        if err.errno in _NO_CLONE:
            return False
        raise
    return True


def _stream(items: Sequence, buffers: Sequence, *, read: Optional[Callable] = None,
            process: Callable[[Any, Any], bool], write: Optional[Callable] = None) -> None:
    """:meth:`offload.pipeline.Pipeline.run` over ``buffers``, reads as far ahead as buffers allow."""
    if len(items):
        Pipeline(list(buffers)).run(items, read=read, process=process, write=write)


class _RangeReader:
    """Copies byte ranges of a checkpoint's data file into tensors through one staging buffer."""

    def __init__(self, engine: Engine, file, buffer, file_bytes: int):
        self.engine, self.file, self.buffer, self.file_bytes = engine, file, buffer, file_bytes
        self.start, self.end = 0, 0  # the window of the file the buffer holds

    def copy(self, dest: torch.Tensor, offset: int) -> None:
        """Fill the 1-D tensor ``dest`` from the file's bytes at ``offset``."""
        itemsize = dest.element_size()
        done, total = 0, dest.numel() * itemsize
        while done < total:
            pos = offset + done
            if not (self.start <= pos < self.end):
                self.start = pos // ALIGNMENT * ALIGNMENT
                length = min(self.buffer.nbytes, self.file_bytes - self.start)
                got = self.engine.read(self.file, self.buffer, self.start, length)
                self.end = self.start + got
                if got < itemsize:
                    raise ChecksumError(f"{self.file.path}: ends at byte {self.end}, data expected at {pos}")
            take = min(total - done, self.end - pos)
            n = take // itemsize
            dest[done // itemsize: done // itemsize + n].copy_(self.buffer.view(dest.dtype, pos - self.start, n))
            done += n * itemsize


# -- writing a data file (state.bin, params.bin) -------------------------------------------


def _write_data(staged: _Staged, aio: AioConfig, buffers: Sequence, units: Sequence, *,
                read: Optional[Callable], fill: Optional[Callable], nbytes_of: Callable[[Any], int],
                name: str = DATA, unit_digests: bool = True) -> dict:
    """Write ``units`` to the data file ``name`` in order through ``buffers``, each at a 4096-aligned
    offset; returns the file entry and the units' table (offsets, lengths and, with
    ``unit_digests``, each unit's xxh3_64 over its padded length)."""
    lengths = [round_up(nbytes_of(u), ALIGNMENT) for u in units]
    offsets, pos = [], 0
    for n in lengths:
        offsets.append(pos)
        pos += n
    total = pos
    path = staged.path(name)
    engine = staged.storage.engine(aio)
    try:
        if buffers and all(b.index == i for i, b in enumerate(buffers)):
            try:
                engine.register_buffers(list(buffers))
            except (ValueError, RuntimeError, OSError):
                pass  # fixed buffers only save a little CPU
        with engine.open(path, "x+") as f:
            if f.alignment > ALIGNMENT:
                raise CheckpointError(f"{path}: the file system wants {f.alignment}-byte direct I/O; "
                                      f"checkpoints use {ALIGNMENT}. Set aio.o_direct to false for this path")
            if total:
                try:
                    os.posix_fallocate(f.fd, 0, total)
                except OSError as err:
                    st = os.statvfs(staged.parent)
                    raise OSError(err.errno, f"cannot reserve {total} bytes for the checkpoint data "
                                  f"({err.strerror}; {st.f_bavail * st.f_frsize} bytes free)", path) from err
            whole = xxhash.xxh3_64()
            digests: list[str] = [""] * len(units)
            index = {id(u): i for i, u in enumerate(units)}

            def process(u, buf) -> bool:
                i = index[id(u)]
                if fill is not None:
                    fill(u, buf)
                n = nbytes_of(u)
                buf.tensor[n: lengths[i]].zero_()  # padding: same state, same bytes
                data = buf.tensor[: lengths[i]].numpy()
                if unit_digests:
                    digests[i] = xxhash.xxh3_64(data).hexdigest()
                whole.update(data)
                return True

            def write(u, buf):
                i = index[id(u)]
                return engine.write_async(f, buf, offsets[i], lengths[i])

            _stream(list(units), list(buffers), read=read, process=process, write=write)
            staged.storage.fsync(f.fd, path)
    finally:
        engine.close()
    entry = {"bytes": total, "xxh3_64": whole.hexdigest()}
    table = [{"offset": o, "nbytes": nbytes_of(u), "length": n, "xxh3_64": d}
             for u, o, n, d in zip(units, offsets, lengths, digests)]
    if not unit_digests:
        for t in table:
            del t["xxh3_64"]
    return {"file": entry, "units": table}
