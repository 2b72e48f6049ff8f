"""The calls by which checkpoints touch files, in one object: the engine that moves the data files, and
the file-system operations of the commit rule. Saves and loads take one (``storage=``); the default does
what it says, and the fault tests hand in one that fails where they want."""

from __future__ import annotations

import os

from ..aio import Engine
from ..config import AioConfig
from ..modes import dir_mode
from .format import io_error


class Storage:
    """The file-system and engine calls of a save or a load. Subclass it to inject faults."""

    def engine(self, aio: AioConfig) -> Engine:
        """The engine that writes or reads a checkpoint's data file."""
        return Engine(aio)

    def rename(self, src: str, dst: str) -> None:
        os.rename(src, dst)

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def fsync(self, fd: int, path: str) -> None:
        """fsync the open file ``fd`` (``path`` names it in the error)."""
        try:
            os.fsync(fd)
        except OSError as err:
            raise io_error(err, path, "cannot fsync") from err

    def make_dirs(self, path: str) -> bool:
        """Create directory ``path`` and its missing parents (0700, see :mod:`offload.modes`), durably: each
        new name's directory is fsynced, so a power loss cannot take away a directory whose files were made
        durable. Returns whether ``path`` was made."""
        missing = []
        while not os.path.isdir(path):
            missing.append(path)
            parent = os.path.dirname(path)
            if parent == path:
                break
            path = parent
        for new in reversed(missing):
            try:
                os.mkdir(new, dir_mode())
            except FileExistsError:
                if not os.path.isdir(new):
                    raise
            self.fsync_dir(os.path.dirname(new))
        return bool(missing)

    def fsync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            self.fsync(fd, path)
        finally:
            os.close(fd)


DEFAULT_STORAGE = Storage()
