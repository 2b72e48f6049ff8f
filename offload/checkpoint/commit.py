"""Atomic commit of a checkpoint directory: what a save may replace, staging, fsync, exchange, recovery
after a crash, and the parent-directory lock that saves hold alone and readers share (``reading``)."""

from __future__ import annotations

import contextlib
import ctypes
import errno as _errno
import fcntl
import json
import os
import re
import secrets
import shutil
import stat
import threading
import time
import warnings
from typing import Callable, Iterator

from .._proc import pid_alive
from ..errors import CheckpointError
from .format import (
    DATA,
    EXTRA,
    FORMAT,
    MANIFEST,
    MEMORY,
    MODEL_MEMORY,
    PARAMS_DATA,
    _io_error,
    _manifest_digest,
)

# Every name a save of this format writes into a checkpoint directory. A leftover of a save (a
# temporary sibling without a trustworthy manifest) is ours only if it holds nothing else.
_OUR_FILES = frozenset({MANIFEST, DATA, MEMORY, EXTRA, PARAMS_DATA, MODEL_MEMORY})

_WHAT_TO_DO = "save into a new directory, or remove this one yourself if nothing in it is needed"


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


# -- what is ours -------------------------------------------------------------------------------


def _listing(names: list[str], most: int = 5) -> str:
    names = sorted(names)
    shown = ", ".join(repr(n) for n in names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def _foreign(path: str, allowed: frozenset) -> list[str]:
    """Entries of directory ``path`` that are not regular files named in ``allowed``."""
    out = []
    for n in os.listdir(path):
        try:
            regular = stat.S_ISREG(os.lstat(os.path.join(path, n)).st_mode)
        except FileNotFoundError:
            continue
        if n not in allowed or not regular:
            out.append(n)
    return out


def _parse_manifest(path: str):
    """The JSON in ``path/manifest.json``; None if there is none or it does not parse."""
    try:
        with open(os.path.join(path, MANIFEST), "rb") as f:
            return json.loads(f.read())
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError, ValueError):
        return None


def _manifest_problem(path: str) -> tuple[dict | None, str | None]:
    """``(manifest, None)`` if directory ``path`` holds a manifest of ours whose checksum holds,
    else ``(None, why not)``."""
    if not os.path.lexists(os.path.join(path, MANIFEST)):
        return None, f"is not an nvme-offload checkpoint (no {MANIFEST}; it holds {_listing(os.listdir(path))})"
    manifest = _parse_manifest(path)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return None, f"has a {MANIFEST} that is not an nvme-offload checkpoint's"
    if _manifest_digest(manifest) != manifest.get("manifest_xxh3_64") or not isinstance(manifest.get("files"), dict):
        return None, (f"has an nvme-offload {MANIFEST} that fails its checksum (corrupt or edited), so which of "
                      "its files belong to the checkpoint cannot be told")
    return manifest, None


def _is_our_format(path: str) -> bool:
    """Whether directory ``path`` has a manifest that says it is one of our checkpoints (unchecked)."""
    manifest = _parse_manifest(path)
    return isinstance(manifest, dict) and manifest.get("format") == FORMAT


def _checkpoint_problem(path: str) -> str | None:
    """None if directory ``path`` is a complete checkpoint of ours with nothing else in it (so a save
    may replace it and retention may delete it); else why not, for an error message."""
    manifest, problem = _manifest_problem(path)
    if problem is not None:
        return problem
    foreign = _foreign(path, frozenset(manifest["files"]) | {MANIFEST})
    if foreign:
        return f"is a checkpoint but also holds {_listing(foreign)}, which are not part of it"
    return None


def _ours(path: str) -> frozenset | None:
    """The names that may be deleted from directory ``path`` if all of it is ours (a complete
    checkpoint with nothing else in it, or what a save that died left: only files of our names and no
    manifest of someone else's); None if anything in it is not ours."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return None
    except FileNotFoundError:
        return None
    manifest, _ = _manifest_problem(path)
    allowed = _OUR_FILES | (frozenset(manifest["files"]) if manifest is not None else frozenset())
    if _foreign(path, allowed):
        return None
    found = _parse_manifest(path)
    if found is not None and not (isinstance(found, dict) and found.get("format") == FORMAT):
        return None  # valid JSON that is not our manifest: someone else's directory
    return allowed


def _delete(path: str, allowed: frozenset) -> bool:
    """Unlink the regular files named in ``allowed`` from directory ``path`` (the manifest first, so
    that a half-deleted directory is never complete), then the directory if it is then empty."""
    names = sorted(set(os.listdir(path)) & allowed, key=lambda n: n != MANIFEST)
    for n in names:
        p = os.path.join(path, n)
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISREG(os.lstat(p).st_mode):
                os.unlink(p)
    try:
        os.rmdir(path)
    except OSError as err:
        if err.errno not in (_errno.ENOTEMPTY, _errno.EEXIST):
            raise
        warnings.warn(f"left {path} in place: besides a checkpoint's files it holds "
                      f"{_listing(os.listdir(path))}, which are not ours to delete", RuntimeWarning, stacklevel=3)
        return False
    return True


def _remove_ours(path: str, *, quiet: bool = False) -> bool:
    """Delete directory ``path`` if everything in it is ours (see :func:`_ours`); True if it is gone.

    Anything else is left where it is, with a warning unless ``quiet``: this never deletes a file
    that a save of ours did not write. I/O errors while deleting become warnings too (the callers
    run after a commit, when the save itself has succeeded).
    """
    try:
        allowed = _ours(path)
        if allowed is None:
            if not quiet and os.path.lexists(path):
                warnings.warn(f"left {path} in place: it holds {_listing(_foreign(path, _OUR_FILES))}, which are "
                              "not a checkpoint's and not ours to delete", RuntimeWarning, stacklevel=2)
            return False
        return _delete(path, allowed)
    except OSError as err:
        warnings.warn(f"could not delete {path}: {err}", RuntimeWarning, stacklevel=2)
        return False


def _remove_checkpoint(path: str) -> bool:
    """Delete checkpoint ``path`` if it is a complete checkpoint of ours with nothing else in it; it is
    renamed first, so a half-deleted one never carries a checkpoint's name. Otherwise warn and leave
    it. True if it is gone."""
    problem = "is a symbolic link" if os.path.islink(path) else _checkpoint_problem(path)
    if problem is not None:
        warnings.warn(f"not deleting {path}: it {problem}", RuntimeWarning, stacklevel=2)
        return False
    doomed = f"{path}.tmp-del-{secrets.token_hex(4)}"
    os.rename(path, doomed)
    return _remove_ours(doomed)


# NOTE: a save replaces the whole directory it is given, so it must never be given one that holds
# anything of the user's: ``save_checkpoint(".")`` or into a run's output folder or the nvme_path
# would otherwise swap that directory out and delete it. The rule, checked under the parent's lock
# before anything is written and again just before the exchange: the target may be missing, an
# empty directory (replaced, not filled: filling in place would lose atomicity, and a save that died
# half way would leave a directory no later save may replace), or a complete checkpoint of ours (our
# manifest, its checksum good, no other files). A manifest that fails its checksum cannot say which
# files are the checkpoint's, so that directory is refused too. A symbolic link is followed: the
# checkpoint it points to is replaced and the link stays. Refusals are FileExistsError (an OSError
# with the path, as os.mkdir raises for a name that is taken), not CheckpointError: nothing is wrong
# with any checkpoint, the name is taken by something else.
def _target_kind(path: str, given: str) -> str:
    """What is at ``path`` (the real path of the ``given`` one): "missing", "empty" (a directory with
    nothing in it) or "checkpoint" (a complete one of ours); raises for anything a save must not replace.

    Raises:
        FileExistsError: ``path`` is a file, or a directory that is not one of our checkpoints.
        OSError: ``path`` is a mount point (EBUSY: a save renames the directory, a mount point cannot be).
    """
    name = given if given == path else f"{given} (a link to {path})"
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "missing"
    if stat.S_ISLNK(st.st_mode):
        raise FileExistsError(_errno.EEXIST, f"checkpoint path {name} is a symbolic link that does not resolve "
                              "(a loop); point it at a directory or remove it", given)
    if not stat.S_ISDIR(st.st_mode):
        raise FileExistsError(_errno.EEXIST, f"checkpoint path {name} is a file, not a checkpoint directory; not "
                              f"replacing it: {_WHAT_TO_DO.replace('this one', 'the file')}", given)
    if os.path.ismount(path):
        raise OSError(_errno.EBUSY, f"checkpoint path {name} is a mount point, which a save cannot replace (it "
                      "renames the directory); save into a directory inside it", given)
    if not os.listdir(path):
        return "empty"
    problem = _checkpoint_problem(path)
    if problem is not None:
        raise FileExistsError(_errno.EEXIST, f"checkpoint path {name} exists and {problem}. A save replaces the "
                              "whole directory, so it only replaces an nvme-offload checkpoint or an empty "
                              f"directory: {_WHAT_TO_DO}", given)
    return "checkpoint"


# -- recovery and clean-up ---------------------------------------------------------------------


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


def _clean_stale(directory: str) -> None:
    """Remove temporary siblings of ``directory`` left by saves whose process is gone.

    Only siblings named as a save names them and holding nothing but what a save writes are removed
    (see :func:`_ours`); a directory of someone else's that happens to match the name is left alone.
    """
    parent, name = os.path.split(directory)
    pattern = re.compile(re.escape(name) + r"\.(tmp-(?P<pid>\d+)-[0-9a-f]+|tmp-del-[0-9a-f]+|old-[0-9a-f]+)$")
    for n in os.listdir(parent):
        m = pattern.match(n)
        if m is None:
            continue
        if m["pid"] is not None and pid_alive(int(m["pid"])):
            continue  # a save in progress in another live process
        _remove_ours(os.path.join(parent, n), quiet=True)


# -- the parent-directory lock ------------------------------------------------------------------

# Parent locks held in this process, by (st_dev, st_ino, thread): [exclusive, count, fd].
_HELD: dict[tuple[int, int, int], list] = {}
_HELD_LOCK = threading.Lock()
_NO_LOCKS = (_errno.ENOLCK, _errno.EOPNOTSUPP, _errno.ENOTSUP, _errno.EINVAL, _errno.ENOSYS)


# NOTE: saves take the parent directory's flock exclusively for their whole duration, readers
# (``reading``) take it shared, so a load never sees a checkpoint being replaced under it, and a
# reader's recovery of a ``.old-`` sibling never runs between a save's two renames. flock locks
# belong to open files, so a second flock of the same thread on another descriptor would wait for
# itself: a thread that already holds the parent (a read inside a save, a read inside a read, a save
# inside a save) counts up instead. A save inside the same thread's read is refused (it would wait
# forever for its own reader). Other threads of the process take their own flock and wait like
# other processes.
def _lock(parent: str, *, exclusive: bool, timeout: float | None = None) -> Callable[[], None]:
    """Take the lock of directory ``parent``; returns the function that lets it go.

    Readers go on without a lock where the file system has no flock (or the directory cannot be
    opened); a save then fails with the error.
    """
    try:
        fd = os.open(parent, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECTORY)
    except OSError:
        if exclusive:
            raise
        return lambda: None
    try:
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino, threading.get_ident())
        with _HELD_LOCK:
            held = _HELD.get(key)
            if held is not None:
                if exclusive and not held[0]:
                    raise CheckpointError(f"cannot save into {parent} while this thread is reading a checkpoint "
                                          "there (inside reading()); finish reading first")
                held[1] += 1
        if held is not None:
            os.close(fd)
            fd = -1
            return lambda: _unlock(key)
        try:
            _flock(fd, parent, exclusive, timeout)
        except OSError as err:
            if exclusive or err.errno not in _NO_LOCKS:
                raise
            os.close(fd)
            return lambda: None
        with _HELD_LOCK:
            _HELD[key] = [exclusive, 1, fd]
        return lambda: _unlock(key)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise


def _flock(fd: int, parent: str, exclusive: bool, timeout: float | None) -> None:
    op = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
    if timeout is None:
        fcntl.flock(fd, op)
        return
    deadline = time.monotonic() + timeout
    delay = 0.005
    while True:
        try:
            fcntl.flock(fd, op | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CheckpointError(
                    f"a save into {parent} is in progress (another process or thread holds its lock); waited "
                    f"{timeout:g} s for it to finish. Load again once it is done, or load another checkpoint"
                ) from None
            time.sleep(min(delay, left))
            delay = min(2 * delay, 0.25)


def _unlock(key: tuple) -> None:
    with _HELD_LOCK:
        held = _HELD[key]
        held[1] -= 1
        if held[1]:
            return
        del _HELD[key]
    os.close(held[2])  # closing the last descriptor of the open file releases its flock


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
        self._release: Callable[[], None] | None = _lock(self.parent, exclusive=True)
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
        path = self.path(MANIFEST)
        try:
            with open(path, "x") as f:
                json.dump(manifest, f, indent=1, sort_keys=True)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError as err:
            raise _io_error(err, path, "cannot write") from err

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

    def close(self) -> None:
        if self._release is not None:
            self._release()
            self._release = None


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
