"""Atomic commit of a checkpoint directory: staging, fsync, exchange, recovery after a crash, locking.

# NOTE: everything is written into a sibling ``<dir>.tmp-<pid>-<random>``, fsynced (files, then
# the directory), and only then given the target's name. If the target exists, the two directories
# are swapped with renameat2(RENAME_EXCHANGE) in one step and the old one (now under the temporary
# name) is deleted. Where the file system cannot exchange, the old one is first renamed to
# ``<dir>.old-<random>``; a crash between that rename and the next leaves no ``<dir>``, and the next
# save or load puts the old one back (see ``_recover``). So the name ``<dir>`` only ever points at a
# complete checkpoint, and a directory under a temporary name is never loaded by accident.
#
# ``_rename`` and ``_exchange`` are looked up here at each call, so the fault tests can make the
# process "die" between any two steps of a commit.
"""

from __future__ import annotations

import ctypes
import errno as _errno
import fcntl
import json
import os
import re
import secrets
import shutil
import threading
from typing import Callable

from .._proc import pid_alive
from .format import MANIFEST, _manifest_digest

# Parents whose lock a save in this process holds (directory -> count), see recover_for_reading.
_HELD: dict[str, int] = {}
_HELD_LOCK = threading.Lock()

def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
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


def _remove_tree(path: str) -> None:
    """Delete a directory; renamed first, so a half-deleted one never carries a checkpoint's name."""
    if not os.path.exists(path):
        return
    doomed = path if ".tmp-" in os.path.basename(path) else f"{path}.tmp-del-{secrets.token_hex(4)}"
    if doomed != path:
        os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _recover(directory: str) -> None:
    """Put back a checkpoint left aside by a save that died between its two renames."""
    if os.path.exists(directory):
        return
    parent, name = os.path.split(directory)
    try:
        aside = sorted(n for n in os.listdir(parent) if n.startswith(name + ".old-"))
    except FileNotFoundError:
        return
    for n in aside:
        if os.path.isfile(os.path.join(parent, n, MANIFEST)):
            os.rename(os.path.join(parent, n), directory)
            _fsync_dir(parent)
            return


def recover_for_reading(directory: str) -> None:
    """:func:`_recover` for readers, under the parent's lock as saves take it, so that it never runs
    between a save's two renames (where it would put the old checkpoint back under the new one's name).

    Only a missing directory needs it. A parent this process already locks (a save in progress here)
    is not locked again: flock on a second descriptor would wait for ourselves.
    """
    if os.path.exists(directory):
        return
    parent = os.path.dirname(directory)
    with _HELD_LOCK:
        held = parent in _HELD
    if held:
        _recover(directory)
        return
    try:
        fd = os.open(parent, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        _recover(directory)
    finally:
        os.close(fd)


def _clean_stale(directory: str) -> None:
    """Remove temporary siblings of ``directory`` left by saves whose process is gone."""
    parent, name = os.path.split(directory)
    pattern = re.compile(re.escape(name) + r"\.(tmp-(?P<pid>\d+)-[0-9a-f]+|tmp-del-[0-9a-f]+|old-[0-9a-f]+)$")
    for n in os.listdir(parent):
        m = pattern.match(n)
        if m is None:
            continue
        if m["pid"] is not None and pid_alive(int(m["pid"])):
            continue  # a save in progress in another live process
        shutil.rmtree(os.path.join(parent, n), ignore_errors=True)


class _Staged:
    """A checkpoint being written under a temporary sibling name, then committed atomically."""

    def __init__(self, directory: str):
        self.directory = os.path.abspath(os.fspath(directory))
        parent = os.path.dirname(self.directory)
        os.makedirs(parent, exist_ok=True)
        self.parent = parent
        self._lock_fd = os.open(parent, os.O_RDONLY | os.O_CLOEXEC)
        # Saves of one directory from several processes queue here rather than race on the renames.
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        with _HELD_LOCK:
            _HELD[parent] = _HELD.get(parent, 0) + 1
        try:
            _recover(self.directory)
            _clean_stale(self.directory)
            self.tmp = f"{self.directory}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
            os.mkdir(self.tmp, 0o755)
        except BaseException:
            self.close()
            raise

    def path(self, name: str) -> str:
        return os.path.join(self.tmp, name)

    def commit(self, manifest: dict) -> None:
        manifest["manifest_xxh3_64"] = _manifest_digest(manifest)
        with open(self.path(MANIFEST), "x") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(self.tmp)
        if not os.path.exists(self.directory):
            _rename(self.tmp, self.directory)
            _fsync_dir(self.parent)
            return
        if _exchange(self.tmp, self.directory):
            # The old checkpoint now carries the temporary name: from here on only the new is loadable.
            _fsync_dir(self.parent)
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        aside = f"{self.directory}.old-{secrets.token_hex(4)}"
        _rename(self.directory, aside)
        _rename(self.tmp, self.directory)  # a crash just before this: _recover() restores `aside`
        _fsync_dir(self.parent)
        shutil.rmtree(aside, ignore_errors=True)

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    def close(self) -> None:
        if self._lock_fd >= 0:
            with _HELD_LOCK:
                _HELD[self.parent] -= 1
                if not _HELD[self.parent]:
                    del _HELD[self.parent]
            os.close(self._lock_fd)
            self._lock_fd = -1


def _write_atomically(directory: str, write: Callable[[_Staged], dict]) -> str:
    """Stage ``directory``, let ``write`` fill it and return its manifest, then commit; returns the path.

    On any error (or interruption) the staged directory is removed and ``directory`` is untouched.
    """
    staged = _Staged(directory)
    try:
        staged.commit(write(staged))
    except BaseException:
        staged.abort()
        raise
    finally:
        staged.close()
    return staged.directory
