"""The copy of a committed checkpoint to a second level (another drive, a network mount): atomic, and
verified by checksum once written."""

from __future__ import annotations

import errno as _errno
import os
from dataclasses import replace
from typing import Optional

from ..aio import create_private
from ..errors import CheckpointError, ChecksumError
from .commit import Staged, reading, write_atomically
from .format import MANIFEST, io_error
from .manifest import Manifest, read_process
from .stream import progress_bar
from .verify import verify_files

__all__ = ["mirror_checkpoint"]


def mirror_checkpoint(source: str | os.PathLike, destination: str | os.PathLike, *,
                      progress: Optional[bool] = None) -> str:
    """Copy the checkpoint ``source`` to ``destination`` (another drive, a network mount), atomically, and
    verify the copy by checksum after it is written (``offload-ckpt mirror SRC DST``).

    ``source`` is held still (:func:`reading`) while it is copied; the copy is staged and committed
    like a save, so ``destination`` is either the previous checkpoint there or the whole verified
    copy, and it may only replace what a save may (missing, an empty directory, a checkpoint of
    ours). Files are copied with ``copy_file_range`` (a server-side copy or a reflink where the file
    systems offer one), then read back with O_DIRECT and checked against the manifest.

    Returns:
        ``destination`` (absolute).

    Raises:
        ChecksumError: the source, or the copy as read back, fails a checksum (the copy is not committed).
        CheckpointError: ``source`` is not a complete checkpoint.
        FileExistsError: ``destination`` is something a save may not replace.
        OSError: reading or writing failed (file named).
    """
    src = os.path.abspath(os.fspath(source))
    dst = os.path.abspath(os.fspath(destination))
    if os.path.realpath(src) == os.path.realpath(dst):
        raise ValueError(f"cannot mirror {src} onto itself")

    def write(staged: Staged) -> Manifest:
        with reading(src):  # inside the save of dst's parent: a read there counts up, never waits for itself
            manifest = read_process(src)
            staged.within = os.stat(os.path.join(src, MANIFEST)).st_mode  # the copy's manifest: no wider
            total = sum(e.bytes for e in manifest.files.values())
            with progress_bar(total, "mirror", progress) as bar:
                for name in sorted(manifest.files):
                    _copy_file(manifest.path(name), staged.path(name), bar)
        copy = replace(manifest, root=staged.target, manifest_xxh3_64=None,
                       files={n: replace(e, file=staged.written[n]) for n, e in manifest.files.items()})
        verify_files(copy)  # the copy, read back from its drive
        return copy

    return write_atomically(dst, write)


_COPY_CHUNK = 64 << 20
_NO_COPY_RANGE = frozenset({_errno.EXDEV, _errno.EINVAL, _errno.ENOSYS, _errno.EOPNOTSUPP, _errno.ENOTSUP,
                            _errno.EBADF, _errno.EPERM})


def _copy_file(src: str, dst: str, bar) -> None:
    """Copy ``src`` to the new file ``dst`` and fsync it (``copy_file_range``, else reads and writes)."""
    try:
        fin = open(src, "rb")
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {os.path.dirname(src)} is missing {os.path.basename(src)}, which its "
                              "manifest lists") from None
    with fin:
        try:
            # A copy never lets more people read it than its original does.
            with create_private(dst, within=os.fstat(fin.fileno()).st_mode) as fout:
                size = os.fstat(fin.fileno()).st_size
                pos, ranged = 0, True
                while pos < size:
                    want = min(_COPY_CHUNK, size - pos)
                    if ranged:
                        try:
                            n = os.copy_file_range(fin.fileno(), fout.fileno(), want, pos, pos)
                        except OSError as err:
                            if err.errno not in _NO_COPY_RANGE:
                                raise
                            ranged = False
                            continue
                    else:
                        data = os.pread(fin.fileno(), min(want, 8 << 20), pos)
                        n = len(data)
                        view = memoryview(data)
                        while view:
                            view = view[os.pwrite(fout.fileno(), view, pos + n - len(view)):]
                    if n == 0:
                        raise ChecksumError(f"{src}: ends at byte {pos}, {size} expected (it shrank while copied)")
                    pos += n
                    bar.update(n)
                fout.flush()
                os.fsync(fout.fileno())
        except OSError as err:
            raise io_error(err, dst, "cannot copy to") from err
