"""The copy of a committed checkpoint to a second level (another drive, a network mount): atomic, and
verified by checksum once written."""

from __future__ import annotations

import errno as _errno
import os
import threading
from typing import Optional

from ..errors import CheckpointError, ChecksumError
from .commit import SaveHandle, _Staged, _track, _write_atomically, reading
from .format import _io_error, create_private, file_path
from .stream import _progress
from .verify import _verify_files, read_manifest

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

    def write(staged: _Staged) -> dict:
        with reading(src):  # inside the save of dst's parent: a read there counts up, never waits for itself
            manifest = read_manifest(src)
            total = sum(f["bytes"] for f in manifest["files"].values())
            with _progress(total, "mirror", progress) as bar:
                for name in sorted(manifest["files"]):
                    _copy_file(file_path(src, name, manifest["files"][name]), staged.path(name), bar)
        copy = {k: v for k, v in manifest.items() if k != "manifest_xxh3_64"}
        copy["files"] = {n: {**e, "file": staged.written[n]} for n, e in manifest["files"].items()}
        _verify_files(staged.target, copy)  # the copy, read back from its drive
        return copy

    return _write_atomically(dst, write)


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
            with create_private(dst) as fout:
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
            raise _io_error(err, dst, "cannot copy to") from err


def _mirror_in_background(owner, directory: str, mirror: str, then_mirror) -> None:
    handle = SaveHandle(directory)
    handle.committed = True

    def copy_out() -> None:
        error = None
        try:
            mirror_checkpoint(directory, mirror)
            if then_mirror is not None:
                then_mirror(mirror)
        except BaseException as err:  # noqa: BLE001 - surfaces at the next save
            error = err
        finally:
            handle._finish(error)

    _track(owner, handle)
    threading.Thread(target=copy_out, name="offload-checkpoint-mirror").start()
