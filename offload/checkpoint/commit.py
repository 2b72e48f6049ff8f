"""The commit rule of checkpoints: a save writes its files under fresh names (its generation's), fsyncs
them, writes its manifest last and fsyncs it, and one rename onto ``manifest.json`` commits it; the
previous generation's files are deleted once that rename is durable. Saves of one directory take its
lock alone, readers (``reading``) share it."""

from __future__ import annotations

import contextlib
import os
import secrets
import threading
import time
import traceback
import weakref
from dataclasses import replace
from typing import Callable, Iterator

from ..errors import CheckpointError
from ..interrupts import holding, safe_point
from ..locks import LOCK_FILE, DirectoryLock
from ..locks import lock_directory as _lock_directory
from .format import DEFAULT_STORAGE, JSON, MANIFEST, Storage, write_file
from .manifest import JobManifest, Manifest, digest
from .ownership import check_target, delete_named, fresh_name, named_files, our_manifest, sweep

# -- the directory's lock ------------------------------------------------------------------------

_READING = threading.local()  # the directories (st_dev, st_ino) this thread is inside reading() of


def lock_directory(path: str, *, exclusive: bool, timeout: float | None = None) -> DirectoryLock | None:
    """Checkpoint directory ``path``'s lock (:func:`offload.locks.lock_directory`). A thread that saves into a
    directory it is reading would wait for itself: refused instead."""
    if exclusive:
        try:
            st = os.stat(path)
        except OSError:
            st = None
        if st is not None and (st.st_dev, st.st_ino) in getattr(_READING, "dirs", ()):
            raise CheckpointError(f"cannot save into {path} while this thread is reading it (inside reading()); "
                                  "finish reading first")
    return _lock_directory(path, exclusive=exclusive, timeout=timeout)


@contextlib.contextmanager
def reading(directory: str | os.PathLike, *, timeout: float | None = None) -> Iterator[str]:
    """Hold a checkpoint still while it is read: no save into it commits or deletes meanwhile.

    Takes the checkpoint directory's lock shared (saves take it exclusively): waits for a save in
    progress in another process or thread, and a save started meanwhile waits until the block ends.
    Hold it for the whole of a load (manifest, small files and data). Yields ``directory``, absolute
    (a symbolic link is followed for the lock).

    Raises:
        CheckpointError: ``timeout`` seconds (None: no limit) passed with a save still in progress, or
            this thread saves into the directory inside ``reading`` of it (it would wait for itself).

    Example::

        with reading(ckpt_dir):
            extra = load_checkpoint(opt, ckpt_dir)
    """
    given = os.path.abspath(os.fspath(directory))
    real = os.path.realpath(given)
    held = lock_directory(real, exclusive=False, timeout=timeout)
    if held is None:
        yield given
        return
    try:
        st = os.stat(real)
    except BaseException:
        held.release()
        raise
    key = (st.st_dev, st.st_ino)
    _READING.__dict__.setdefault("dirs", []).append(key)
    try:
        yield given
    finally:
        _READING.dirs.remove(key)
        held.release()


# -- writing and committing ------------------------------------------------------------------------


def write_manifest(path: str, manifest: Manifest | JobManifest, storage: Storage, *,
                   within: int = 0o777) -> Manifest | JobManifest:
    """Write ``manifest`` with its checksum to the new file ``path`` (mode ``within`` at most), fsync it and
    its directory (so every file it names is there after a crash); returns the manifest written."""
    directory = os.path.dirname(path)
    manifest = replace(manifest, manifest_xxh3_64=None, root=directory)
    manifest = replace(manifest, manifest_xxh3_64=digest(manifest.to_json()))
    write_file(JSON(manifest.to_json()), path, storage.fsync, within=within)
    storage.fsync_dir(directory)
    return manifest


def commit_manifest(directory: str, staged: str, manifest: Manifest | JobManifest,
                    previous: Manifest | JobManifest | None, storage: Storage,
                    committed: Callable[[], None] = lambda: None) -> None:
    """The commit: rename the manifest written at ``staged`` onto ``directory``'s manifest.json (then call
    ``committed()``), fsync the directory, then delete the files ``previous`` (the manifest it replaces)
    names and ``manifest`` does not."""
    storage.rename(staged, os.path.join(directory, MANIFEST))
    committed()
    storage.fsync_dir(directory)
    delete_named(directory, named_files(previous), named_files(manifest), unlink=storage.unlink)


class Staged:
    """A checkpoint being written into its directory under its generation's names, then committed.

    ``directory`` is the path as given (absolute); ``target`` the real directory it names (a symbolic
    link followed), where the files go. ``path(name)`` is where the file ``name`` of the format is
    written; :meth:`commit` records those names in the manifest and commits it. Every file-system
    call of the save goes through ``storage``. A job's shard (``shard_of``: the job's directory) is
    written into ``<job>/<directory>`` without a lock of its own (only its rank writes there), and
    :meth:`commit` only writes its manifest: the job manifest, which names it, commits it.
    """

    def __init__(self, directory: str | os.PathLike, *, storage: Storage = DEFAULT_STORAGE,
                 generation: str | None = None, shard_of: str | None = None):
        self.storage = storage
        self.generation = generation or secrets.token_hex(8)
        self.committed = False
        self.written: dict[str, str] = {}  # name in the format -> name on disk
        self.manifest: Manifest | None = None  # as committed
        self.within = 0o777  # the manifest's mode at most (a copy's: its original's)
        self._lock: DirectoryLock | None = None
        if shard_of is not None:
            self.directory = self.target = os.path.join(shard_of, os.fspath(directory))
            self.made = storage.make_dirs(self.target)
            sweep(shard_of, our_manifest(shard_of), shard=os.fspath(directory), unlink=storage.unlink)
            self.previous = None
            return
        self.directory = os.path.abspath(os.fspath(directory))
        self.target = os.path.realpath(self.directory)
        check_target(self.target, self.directory)  # refused before anything is written
        self.made = storage.make_dirs(self.target)
        self._lock = lock_directory(self.target, exclusive=True)
        try:
            check_target(self.target, self.directory)  # again, now that no other save runs here
            self.previous = our_manifest(self.target)
            sweep(self.target, self.previous, unlink=storage.unlink)
        except BaseException:
            self.close()
            raise

    def path(self, name: str) -> str:
        """Where this save writes the format's file ``name``."""
        self.written[name] = fresh_name(name, self.generation)
        return os.path.join(self.target, self.written[name])

    def commit(self, manifest: Manifest) -> None:
        """Name this generation's files in ``manifest`` and write it; then, unless a shard, commit it."""
        files = {n: replace(e, file=self.written[n]) for n, e in manifest.files.items()}
        staged = self.path(MANIFEST)
        self.manifest = write_manifest(staged, replace(manifest, files=files), self.storage, within=self.within)
        if self._lock is not None:
            commit_manifest(self.target, staged, self.manifest, self.previous, self.storage,
                            lambda: setattr(self, "committed", True))

    def abort(self) -> None:
        """Delete what this save wrote (it never committed, so nothing names it). Best effort: on a disk
        that fails (the reason a save is aborted, often) what stays is swept by the next save, since only
        files of a generation no manifest names are left."""
        if not self.committed:
            for name in self.written.values():
                with contextlib.suppress(OSError):
                    self.storage.unlink(os.path.join(self.target, name))
            if self.made:
                with contextlib.suppress(OSError):
                    if self._lock is not None and os.listdir(self.target) == [LOCK_FILE]:
                        os.unlink(self._lock.lock)  # held: a process waiting for it opens it again
                    os.rmdir(self.target)  # only if still empty: it was made for this save

    def close(self) -> None:
        """Let the directory's lock go (a save that has not committed is aborted first by its caller)."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    @contextlib.contextmanager
    def owned(self) -> Iterator[Staged]:
        """The save's block: an error in it aborts the save; at its end the directory's lock goes."""
        try:
            yield self
        except BaseException:
            self.abort()
            raise
        finally:
            self.close()


def write_atomically(directory: str | os.PathLike, write: Callable[[Staged], Manifest],
                     storage: Storage = DEFAULT_STORAGE) -> str:
    """Stage ``directory`` (refused as :func:`ownership.check_target` says before anything is written),
    let ``write`` fill it and return its manifest, then commit; returns the path. On any error what was
    written is removed; an OSError that names no file names the checkpoint directory."""
    with Staged(directory, storage=storage).owned() as staged:
        try:
            manifest = write(staged)
        except OSError as err:
            if err.filename is None and err.errno is not None:
                raise OSError(err.errno, f"cannot write checkpoint {staged.directory}: "
                              f"{err.strerror or os.strerror(err.errno)}", staged.directory) from err
            raise
        staged.commit(manifest)
    return staged.directory


# -- saves that go on in the background ---------------------------------------------------------


class SaveHandle:
    """A save going on in the background: ``save_checkpoint(..., blocking=False)`` returns one.

    Attributes:
        directory: the checkpoint directory (absolute).
        committed: True once the checkpoint at ``directory`` is complete (a copy to a mirror level
            may still be under way).
    """

    def __init__(self, directory: str, hurry: Callable[[], None] = lambda: None):
        self.directory = directory
        self.committed = False
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._observed = False
        self._hurry = hurry  # somebody waits for the save: it stops waiting for steps to help

    def done(self) -> bool:
        """Whether the save (and its copy to a mirror level, if any) has finished, well or not. Never blocks."""
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
        self._finished(timeout)
        self._observed = True
        return self._error

    def _finished(self, timeout: float | None) -> None:
        """Hurry the save and wait for it to end; TimeoutError where ``timeout`` seconds pass first. Where a
        Ctrl-C is held off (:func:`offload.interrupts.holding`), the wait polls for it."""
        self._hurry()
        poll = holding()
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._done.wait(timeout if not poll else 0.05 if deadline is None
                                  else max(0.0, min(0.05, deadline - time.monotonic()))):
            if not poll or (deadline is not None and time.monotonic() >= deadline):
                raise TimeoutError(f"the save to {self.directory} is still in progress after {timeout:g} s")
            safe_point()

    def __repr__(self) -> str:
        state = "running" if not self.done() else "failed" if self._error is not None else "done"
        return f"SaveHandle({self.directory!r}, {state})"


# The save in flight per owner of state (an optimizer's StateStore): a second save waits for it.
_IN_FLIGHT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_IN_FLIGHT_LOCK = threading.Lock()


def in_background(owner, handle: SaveHandle, work: Callable[[], None], name: str) -> None:
    """Run ``work()`` in a thread as ``owner``'s save in flight; what it raises goes to ``handle`` (and,
    if nobody looks there, to the next :func:`wait_for_save` with ``report``)."""

    def run() -> None:
        error = None
        try:
            work()
        except BaseException as err:  # surfaces on the handle and at the next save
            error = err
            # The frames of the save hold the optimizer's store; the error is kept, not what they held.
            traceback.clear_frames(err.__traceback__)
        finally:
            handle._error = error
            handle._hurry = lambda: None  # what it held (the save's state, and through it the store) goes
            handle._done.set()

    with _IN_FLIGHT_LOCK:
        _IN_FLIGHT[owner] = handle
    threading.Thread(target=run, name=name).start()


def wait_for_save(owner, *, report: bool, timeout: float | None = None) -> None:
    """Wait for ``owner``'s save in flight, if any. With ``report``, a failure nobody has looked at yet
    (``wait()``, ``exception()``) is raised now, once, as a CheckpointError with it chained: an
    asynchronous save's error is never lost. TimeoutError where ``timeout`` seconds pass first."""
    with _IN_FLIGHT_LOCK:
        handle = _IN_FLIGHT.get(owner)
    if handle is None:
        return
    handle._finished(timeout)
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
