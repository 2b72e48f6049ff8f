"""Atomic commit of a checkpoint directory: staging, fsync, and the exchange of the old checkpoint for
the new. Readers (``reading``) hold it still under the parent's lock, and put back a checkpoint that a
save which died half way left aside."""

from __future__ import annotations

import contextlib
import ctypes
import errno as _errno
import json
import os
import re
import secrets
import shutil
import threading
import weakref
from typing import Callable, Iterator

from ..errors import CheckpointError
from .format import MANIFEST, _io_error, _manifest_digest
from .locks import _Hold, _lock
from .ownership import _checkpoint_problem, _clean_stale, _remove_ours, _target_kind


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as err:
        raise _io_error(err, path, "cannot fsync") from err
    finally:
        os.close(fd)


_libc = None
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: str, b: str) -> bool:
    """Swap two paths atomically (renameat2 RENAME_EXCHANGE); False where unsupported."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.renameat2  # noqa: B018 - probe: older C libraries lack it
        except (OSError, AttributeError):
            _libc = False
    if _libc is False:
        return False
    rc = _libc.renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (_errno.EINVAL, _errno.ENOSYS, _errno.ENOTSUP, _errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"cannot exchange {a} and {b}: {os.strerror(err)}", b)


def _rename(src: str, dst: str) -> None:
    os.rename(src, dst)


# -- readers: recovery under the shared lock -------------------------------------------------------


def _recover(directory: str) -> None:
    """Put back a checkpoint left aside by a save that died between its two renames.

    Only a complete checkpoint of ours under ``<directory>.old-<hex>`` is put back, the most recently
    set aside first. Safe to run by several readers at once (they hold the parent's shared lock).
    """
    if os.path.lexists(directory):
        return
    parent, name = os.path.split(directory)
    pattern = re.compile(re.escape(name) + r"\.old-[0-9a-f]+$")
    try:
        aside = [os.path.join(parent, n) for n in os.listdir(parent) if pattern.match(n)]
    except FileNotFoundError:
        return
    found = []
    for p in aside:
        with contextlib.suppress(FileNotFoundError):
            found.append((os.lstat(p).st_ctime_ns, p))
    for _, p in sorted(found, reverse=True):
        if _checkpoint_problem(p) is not None:
            continue
        try:
            os.rename(p, directory)
        except FileNotFoundError:
            continue  # another reader put it back first
        except OSError as err:
            if err.errno in (_errno.ENOTEMPTY, _errno.EEXIST) and os.path.lexists(directory):
                return  # likewise
            raise
        _fsync_dir(parent)
        return


@contextlib.contextmanager
def reading(directory: str | os.PathLike, *, timeout: float | None = None) -> Iterator[str]:
    """Hold a checkpoint still while it is read: no save into its parent directory runs meanwhile.

    Takes the parent directory's lock shared (saves take it exclusively for their whole duration),
    so it waits for a save in progress in another process or thread, and a save started meanwhile
    waits until the block ends. Inside it, a checkpoint that a save which died between its two
    renames left aside as ``<directory>.old-*`` is put back first. A read inside a save of the same
    thread, or inside another ``reading`` of the same parent, takes nothing more. Hold it for the
    whole of a load (manifest, small files and data): files read one by one otherwise may come
    from two different saves.

    Args:
        directory: the checkpoint directory (a symbolic link is followed).
        timeout: seconds to wait for a save in progress; None waits as long as the save takes.

    Yields:
        ``directory``, absolute.

    Raises:
        CheckpointError: ``timeout`` passed with a save still in progress (the message says so).
            A save started inside ``reading`` of the same parent, in the same thread, raises it
            too, instead of waiting forever for its own reader.

    Example::

        with reading(ckpt_dir):
            extra = load_checkpoint(opt, ckpt_dir)
    """
    given = os.path.abspath(os.fspath(directory))
    real = os.path.realpath(given)
    release = _lock(os.path.dirname(real), exclusive=False, timeout=timeout)
    try:
        _recover(real)
        yield given
    finally:
        release()


def recover_for_reading(directory: str) -> None:
    """:func:`_recover` for readers, under the parent's lock (see :func:`reading`), so that it never
    runs between a save's two renames. Only a missing directory needs it."""
    if os.path.exists(directory):
        return
    with reading(directory):
        pass


# -- staging and committing ---------------------------------------------------------------------


def _write_json(path: str, manifest: dict) -> None:
    """Write ``manifest`` to the new file ``path`` and fsync it."""
    try:
        with open(path, "x") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        raise _io_error(err, path, "cannot write") from err


class _Staged:
    """A checkpoint being written under a temporary sibling name, then committed atomically.

    ``directory`` is the path as given (absolute); ``target`` the real directory it names (a symbolic
    link followed), where the renames happen; ``tmp`` the sibling being written.
    """

    def __init__(self, directory: str | os.PathLike):
        self.directory = os.path.abspath(os.fspath(directory))
        self.target = os.path.realpath(self.directory)
        self.parent = os.path.dirname(self.target)
        self._committed = False
        os.makedirs(self.parent, exist_ok=True)
        # Saves of one directory from several processes queue here rather than race on the renames.
        self._release: _Hold | None = _lock(self.parent, exclusive=True)
        try:
            _recover(self.target)
            _target_kind(self.target, self.directory)  # refuse before anything is written
            _clean_stale(self.target)
            self.tmp = f"{self.target}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
            os.mkdir(self.tmp, 0o755)
        except BaseException:
            self.close()
            raise

    def path(self, name: str) -> str:
        return os.path.join(self.tmp, name)

    def _write_manifest(self, manifest: dict) -> None:
        _write_json(self.path(MANIFEST), manifest)

    def commit(self, manifest: dict) -> None:
        manifest["manifest_xxh3_64"] = _manifest_digest(manifest)
        self._write_manifest(manifest)
        _fsync_dir(self.tmp)
        # Again: something may have taken the name while the files were written.
        kind = _target_kind(self.target, self.directory)
        if kind == "missing":
            _rename(self.tmp, self.target)
            self._committed = True
            _fsync_dir(self.parent)
            return
        if _exchange(self.tmp, self.target):
            # The old checkpoint now carries the temporary name: from here on only the new is loadable.
            self._committed = True
            _fsync_dir(self.parent)
            _remove_ours(self.tmp)
            return
        aside = f"{self.target}.old-{secrets.token_hex(4)}"
        _rename(self.target, aside)
        _rename(self.tmp, self.target)  # a crash just before this: _recover() restores `aside`
        self._committed = True
        _fsync_dir(self.parent)
        _remove_ours(aside)

    def abort(self) -> None:
        if not self._committed:
            shutil.rmtree(self.tmp, ignore_errors=True)  # ours: made by this object under a fresh name

    def hand_over(self, thread: int) -> None:
        """The parent's lock becomes thread ``thread``'s, which then finishes (or aborts) and closes this."""
        if self._release is not None:
            self._release.hand_over(thread)

    def close(self) -> None:
        if self._release is not None:
            self._release()
            self._release = None


class _Shard(_Staged):
    """A rank's shard of a job's checkpoint, written in place inside the job's staging directory.

    Only this rank writes there, under a name no other save uses, so no lock is taken (ranks that
    share a file system would otherwise queue on the parent's lock, one shard at a time). Its
    ``commit`` writes the shard's manifest and fsyncs it; the job's commit (``job._JobCommit``)
    gives the staging directory the checkpoint's name.
    """

    def __init__(self, path: str):
        self.directory = self.target = self.tmp = os.path.abspath(path)
        self.parent = os.path.dirname(self.tmp)
        self._committed = False
        self._release = None
        self.manifest: dict | None = None
        os.mkdir(self.tmp, 0o755)

    def commit(self, manifest: dict) -> None:
        manifest["manifest_xxh3_64"] = _manifest_digest(manifest)
        self._write_manifest(manifest)
        _fsync_dir(self.tmp)
        _fsync_dir(self.parent)
        self.manifest = manifest


def _write_atomically(directory: str | os.PathLike, write: Callable[[_Staged], dict]) -> str:
    """Stage ``directory``, let ``write`` fill it and return its manifest, then commit; returns the path.

    ``directory`` must be missing, an empty directory or a complete checkpoint of ours (see
    :func:`_target_kind`); anything else is refused before anything is written. On any error (or
    interruption) the staged directory is removed and ``directory`` is untouched; an I/O error names
    the file (or, where the failing call did not say, the checkpoint directory).

    Raises:
        FileExistsError: ``directory`` is a file, or a directory that is not one of our checkpoints.
        OSError: writing failed (``OSError(errno, message, path)``, the original chained).
    """
    staged = _Staged(directory)
    try:
        try:
            manifest = write(staged)
        except OSError as err:
            if err.filename is None and err.errno is not None:
                raise OSError(err.errno, f"cannot write checkpoint {staged.directory}: "
                              f"{err.strerror or os.strerror(err.errno)}", staged.directory) from err
            raise
        staged.commit(manifest)
    except BaseException:
        staged.abort()
        raise
    finally:
        staged.close()
    return staged.directory


# -- saves that go on in the background ---------------------------------------------------------


class SaveHandle:
    """A save going on in the background: ``save_checkpoint(..., blocking=False)`` returns one.

    Attributes:
        directory: the checkpoint directory (absolute).
        committed: True once the checkpoint at ``directory`` is complete (a copy to ``mirror_to``
            may still be under way).
    """

    def __init__(self, directory: str):
        self.directory = directory
        self.committed = False
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._observed = False

    def done(self) -> bool:
        """Whether the save (and its copy to ``mirror_to``, if any) has finished, well or not. Never blocks."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> str:
        """Wait for the save to finish; returns the checkpoint directory.

        Raises:
            TimeoutError: ``timeout`` seconds passed first.
            Whatever the save raised (``OSError`` naming the file, ``CheckpointError``, ``StateError``).
        """
        error = self.exception(timeout)
        if error is not None:
            raise error
        return self.directory

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Wait for the save to finish; returns what it raised, or None if it succeeded.

        Raises:
            TimeoutError: ``timeout`` seconds passed first.
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"the save to {self.directory} is still in progress after {timeout:g} s")
        self._observed = True
        return self._error

    def _finish(self, error: BaseException | None = None) -> None:
        self._error = error
        self._done.set()

    def __repr__(self) -> str:
        state = "running" if not self.done() else "failed" if self._error is not None else "done"
        return f"SaveHandle({self.directory!r}, {state})"


# The save in flight per owner of state (an optimizer's StateStore): a second save waits for it.
_IN_FLIGHT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_IN_FLIGHT_LOCK = threading.Lock()


def _track(owner, handle: SaveHandle) -> None:
    with _IN_FLIGHT_LOCK:
        _IN_FLIGHT[owner] = handle


def _settle(owner, *, report: bool, timeout: float | None = None) -> None:
    """Wait for ``owner``'s save in flight, if any. With ``report``, a failure nobody has looked at yet
    (``wait()``, ``exception()``) is raised now, once: an asynchronous save's error is never lost.

    Raises:
        CheckpointError: ``report`` and that save failed (its error chained).
        TimeoutError: ``timeout`` seconds passed first.
    """
    with _IN_FLIGHT_LOCK:
        handle = _IN_FLIGHT.get(owner)
    if handle is None:
        return
    if not handle._done.wait(timeout):
        raise TimeoutError(f"the save to {handle.directory} is still in progress after {timeout:g} s")
    unseen = handle._error is not None and not handle._observed
    with _IN_FLIGHT_LOCK:
        if _IN_FLIGHT.get(owner) is handle and (report or not unseen):  # else the next save reports it
            del _IN_FLIGHT[owner]
    if report and unseen:
        handle._observed = True
        err = handle._error
        done = "was committed, but its copy to the mirror failed" if handle.committed else "failed"
        raise CheckpointError(f"the previous asynchronous save to {handle.directory} {done}: {err}. Nothing "
                              "of it was lost silently; save again (this save did not start)") from err
