"""A file system that forgets, on a simulated power loss, everything that was not made durable.

Run as ``python tests/powerloss.py MOUNTPOINT`` (root, /dev/fuse, libfuse3 and mfusepy); it serves until
unmounted. Files and directories live in memory in two versions: what the last operations made them
(what every process sees) and what the last ``fsync``/``fdatasync`` of the file (its bytes) or of the
directory (its names) made durable. A power loss keeps only the durable versions: a file whose bytes
were synced but whose name was not is gone, a rename not followed by a sync of its directory is undone,
a file written after its last sync is back to its synced bytes.

It is driven through the file ``/.powerloss`` at the mount's root: writing ``arm N`` makes the file system
stop after its N-th sync from then on (that sync completes; every later operation fails with EIO, as on a
machine that lost power); ``crash`` applies the power loss (only durable versions remain) and serves
again; reading it gives ``{"syncs": ..., "stopped": ...}`` as JSON.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import sys
import threading
import time

import mfusepy as fuse

CONTROL = "/.powerloss"
_STATUS_BYTES = 4096


class _Node:
    def __init__(self, mode: int):
        self.mode = mode
        self.data = bytearray()  # a file's bytes as written
        self.durable = b""  # as of its last sync
        self.entries: dict[str, _Node] = {}  # a directory's names as changed
        self.durable_entries: dict[str, _Node] = {}  # as of its last sync
        self.target = ""  # a symbolic link's
        self.mtime = time.time()

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)


class PowerLoss(fuse.Operations):
    """The file system (see the module's docstring)."""

    use_ns = True

    def __init__(self):
        self.root = _Node(stat.S_IFDIR | 0o755)
        self._mu = threading.RLock()
        self.syncs = 0
        self.stop_after: int | None = None
        self.stopped = False
        self.handles: dict[int, _Node] = {}
        self.next_fh = 10

    # -- the model ------------------------------------------------------------------------------

    def _node(self, path: str) -> _Node:
        node = self.root
        for part in [p for p in path.split("/") if p]:
            if not node.is_dir or part not in node.entries:
                raise fuse.FuseOSError(errno.ENOENT)
            node = node.entries[part]
        return node

    def _parent(self, path: str) -> tuple[_Node, str]:
        head, name = os.path.split(path.rstrip("/"))
        parent = self._node(head or "/")
        if not parent.is_dir:
            raise fuse.FuseOSError(errno.ENOTDIR)
        return parent, name

    def _alive(self) -> None:
        if self.stopped:
            raise fuse.FuseOSError(errno.EIO)

    def _synced(self) -> None:
        self.syncs += 1
        if self.stop_after is not None and self.syncs >= self.stop_after:
            self.stopped = True

    def _crash(self) -> None:
        seen = set()

        def revert(node: _Node) -> None:
            if id(node) in seen:
                return
            seen.add(id(node))
            node.data = bytearray(node.durable)
            if node.is_dir:
                node.entries = dict(node.durable_entries)
                for child in node.entries.values():
                    revert(child)

        revert(self.root)
        self.handles.clear()
        self.stopped, self.stop_after = False, None

    def _control(self, text: str) -> None:
        words = text.split()
        if words[:1] == ["arm"]:
            self.stop_after = self.syncs + int(words[1])
            self.stopped = self.stop_after <= self.syncs
        elif words == ["crash"]:
            self._crash()
        else:
            raise fuse.FuseOSError(errno.EINVAL)

    def _status(self) -> bytes:
        raw = json.dumps({"syncs": self.syncs, "stopped": self.stopped}).encode()
        return raw.ljust(_STATUS_BYTES)

    # -- operations -----------------------------------------------------------------------------

    def getattr(self, path, fh=None):
        with self._mu:
            now = time.time()
            if path == CONTROL:
                return {"st_mode": stat.S_IFREG | 0o600, "st_size": _STATUS_BYTES, "st_nlink": 1,
                        "st_atime": now, "st_mtime": now, "st_ctime": now}
            if path != "/":  # the mount's root answers, so the control file can be reached
                self._alive()
            node = self._node(path)
            size = len(node.target) if stat.S_ISLNK(node.mode) else len(node.data)
            return {"st_mode": node.mode, "st_size": size, "st_nlink": 2 if node.is_dir else 1,
                    "st_uid": os.getuid(), "st_gid": os.getgid(), "st_blocks": (size + 511) // 512,
                    "st_atime": node.mtime, "st_mtime": node.mtime, "st_ctime": node.mtime}

    def readdir(self, path, fh):
        with self._mu:
            self._alive()
            node = self._node(path)
            names = list(node.entries)
            return [".", "..", *names, *([CONTROL[1:]] if path == "/" else [])]

    def access(self, path, amode):
        with self._mu:
            if path != CONTROL:
                self._alive()
                self._node(path)
        return 0

    def statfs(self, path):
        return {"f_bsize": 4096, "f_frsize": 4096, "f_blocks": 1 << 22, "f_bfree": 1 << 21, "f_bavail": 1 << 21,
                "f_files": 1 << 20, "f_ffree": 1 << 19, "f_favail": 1 << 19, "f_namemax": 255}

    def mkdir(self, path, mode):
        with self._mu:
            self._alive()
            parent, name = self._parent(path)
            if name in parent.entries:
                raise fuse.FuseOSError(errno.EEXIST)
            parent.entries[name] = _Node(stat.S_IFDIR | (mode & 0o7777))
        return 0

    def rmdir(self, path):
        with self._mu:
            self._alive()
            parent, name = self._parent(path)
            node = self._node(path)
            if not node.is_dir:
                raise fuse.FuseOSError(errno.ENOTDIR)
            if node.entries:
                raise fuse.FuseOSError(errno.ENOTEMPTY)
            del parent.entries[name]
        return 0

    def create(self, path, mode, fi=None):
        with self._mu:
            self._alive()
            parent, name = self._parent(path)
            if name in parent.entries:
                raise fuse.FuseOSError(errno.EEXIST)
            node = parent.entries[name] = _Node(stat.S_IFREG | (mode & 0o7777))
            return self._handle(node)

    def _handle(self, node: _Node) -> int:
        self.next_fh += 1
        self.handles[self.next_fh] = node
        return self.next_fh

    def open(self, path, flags):
        with self._mu:
            if path == CONTROL:
                return 1
            self._alive()
            node = self._node(path)
            if flags & os.O_TRUNC:
                node.data = bytearray()
            return self._handle(node)

    def opendir(self, path):
        with self._mu:
            self._alive()
            return self._handle(self._node(path))

    def _by_handle(self, path: str, fh) -> _Node:
        node = self.handles.get(fh) if fh else None
        return node if node is not None else self._node(path)

    def read(self, path, size, offset, fh):
        with self._mu:
            if path == CONTROL:
                return self._status()[offset:offset + size]
            self._alive()
            return bytes(self._by_handle(path, fh).data[offset:offset + size])

    def write(self, path, data, offset, fh):
        with self._mu:
            if path == CONTROL:
                self._control(bytes(data).decode())
                return len(data)
            self._alive()
            node = self._by_handle(path, fh)
            if offset > len(node.data):
                node.data.extend(bytes(offset - len(node.data)))
            node.data[offset:offset + len(data)] = data
            node.mtime = time.time()
            return len(data)

    def truncate(self, path, length, fh=None):
        with self._mu:
            if path == CONTROL:
                return 0
            self._alive()
            node = self._by_handle(path, fh)
            if length < len(node.data):
                del node.data[length:]
            else:
                node.data.extend(bytes(length - len(node.data)))
        return 0

    def fallocate(self, path, mode, offset, size, fh):
        with self._mu:
            self._alive()
            node = self._by_handle(path, fh)
            if mode:
                raise fuse.FuseOSError(errno.EOPNOTSUPP)
            if offset + size > len(node.data):
                node.data.extend(bytes(offset + size - len(node.data)))
        return 0

    def unlink(self, path):
        with self._mu:
            self._alive()
            parent, name = self._parent(path)
            node = self._node(path)
            if node.is_dir:
                raise fuse.FuseOSError(errno.EISDIR)
            del parent.entries[name]
        return 0

    def rename(self, old, new):
        with self._mu:
            self._alive()
            src, a = self._parent(old)
            dst, b = self._parent(new)
            node = self._node(old)
            there = dst.entries.get(b)
            if there is not None and there.is_dir and there.entries:
                raise fuse.FuseOSError(errno.ENOTEMPTY)
            del src.entries[a]
            dst.entries[b] = node
        return 0

    def link(self, target, source):
        with self._mu:
            self._alive()
            parent, name = self._parent(target)
            if name in parent.entries:
                raise fuse.FuseOSError(errno.EEXIST)
            parent.entries[name] = self._node(source)
        return 0

    def symlink(self, target, source):
        with self._mu:
            self._alive()
            parent, name = self._parent(target)
            if name in parent.entries:
                raise fuse.FuseOSError(errno.EEXIST)
            node = parent.entries[name] = _Node(stat.S_IFLNK | 0o777)
            node.target = source
        return 0

    def readlink(self, path):
        with self._mu:
            self._alive()
            return self._node(path).target

    def chmod(self, path, mode):
        with self._mu:
            if path == CONTROL:
                return 0
            self._alive()
            node = self._node(path)
            node.mode = (node.mode & ~0o7777) | (mode & 0o7777)
        return 0

    def chown(self, path, uid, gid):
        return 0

    def utimens(self, path, times=None):
        with self._mu:
            if path != CONTROL:
                self._alive()
                self._node(path).mtime = time.time()
        return 0

    def fsync(self, path, datasync, fh):
        with self._mu:
            if path == CONTROL:
                return 0
            self._alive()
            node = self._by_handle(path, fh)
            node.durable = bytes(node.data)
            self._synced()
        return 0

    def fsyncdir(self, path, datasync, fh):
        with self._mu:
            self._alive()
            node = self._by_handle(path, fh)
            node.durable_entries = dict(node.entries)
            self._synced()
        return 0

    def flush(self, path, fh):
        return 0

    def release(self, path, fh):
        with self._mu:
            self.handles.pop(fh, None)
        return 0

    def releasedir(self, path, fh):
        return self.release(path, fh)


def main(mountpoint: str) -> None:
    fs = PowerLoss()
    fs.root.durable_entries = {}
    # direct_io and no attribute caching: every read and stat reaches the model, so a power loss (which
    # changes files under the kernel's feet) is seen at once.
    fuse.FUSE(fs, mountpoint, foreground=True, nothreads=False, direct_io=True, attr_timeout=0, entry_timeout=0,
              negative_timeout=0, default_permissions=True)


if __name__ == "__main__":
    main(sys.argv[1])
