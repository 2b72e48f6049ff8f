"""Swap directories: their rank placeholders expanded, checked (and created) before any file is made in
them, and their free space."""

from __future__ import annotations

import errno as _errno
import os
from typing import Mapping, Sequence, Union

from ..distributed import expand_placeholders
from ..sizes import format_size

__all__ = ["PathsLike", "check_paths", "no_space_message"]

# NOTE: a missing swap directory is made for the user when its parent exists, except at the file system's root.
# There it is almost never meant: example configs (DeepSpeed's among them) carry "/local_nvme" as a placeholder,
# and a relative nvme_path lands there when the current directory is "/" (a service, a container's default),
# so a directory would appear at the root of the system disk, on the wrong drive, as root.
_AT_ROOT = ("swap directory does not exist{relative}, and a directory at the root of the file system is never "
            "created for you: an nvme_path like this is usually a placeholder of an example config. Give a "
            "directory on your NVMe drive (for instance /mnt/nvme0/offload), or create this one yourself")

PathsLike = Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]]


def check_paths(paths: PathsLike) -> list[str]:
    """The swap directories as absolute paths, each usable, each given once.

    ``{rank}``, ``{local_rank}`` and ``{world_size}`` in a path are replaced by this process's values
    (see :func:`offload.distributed.expand_placeholders`), so ``"/mnt/nvme{local_rank}/offload"`` gives
    each rank of a node its own drive. A missing directory is created when its parent exists and is not the
    file system's root: ``/local_nvme`` (a placeholder of example configs, or a relative path met with the
    current directory at ``/``) must exist already.

    Raises:
        FileNotFoundError, NotADirectoryError, PermissionError: a path is unusable; the message says
            why and what to do.
        ValueError: no path, the same directory twice (by name or through a link), or an unknown
            placeholder.
    """
    if isinstance(paths, (str, bytes, os.PathLike)):
        paths = [paths]
    try:
        given = [expand_placeholders(os.fsdecode(p)) for p in paths]
    except TypeError as err:
        raise ValueError(f"paths must be a directory or a list of directories, got {paths!r}") from err
    dirs = [os.path.abspath(p) for p in given]
    if not dirs:
        raise ValueError("paths is empty: give at least one directory (one per drive)")
    seen: dict[tuple[int, int], str] = {}
    for p, raw in zip(dirs, given):
        if not os.path.exists(p):
            parent = os.path.dirname(p)
            if not os.path.isdir(parent):
                raise FileNotFoundError(_errno.ENOENT, f"swap directory does not exist, nor does its parent "
                                        f"{parent}; create it or choose another nvme_path", p)
            if parent == os.path.dirname(parent):
                raise FileNotFoundError(_errno.ENOENT, _AT_ROOT.format(
                    relative=f" (nvme_path {raw!r} is relative: it was met with the current directory "
                             f"{os.getcwd()})" if not os.path.isabs(raw) else ""), p)
            try:
                os.mkdir(p)
            except FileExistsError:
                pass  # another process made it meanwhile
            except OSError as err:
                raise type(err)(err.errno, f"cannot create the swap directory ({err.strerror}); create it "
                                "or choose another nvme_path", p) from err
        if not os.path.isdir(p):
            raise NotADirectoryError(_errno.ENOTDIR, "swap path is not a directory; nvme_path must name "
                                     "directories (one per drive)", p)
        if os.statvfs(p).f_flag & os.ST_RDONLY:
            raise PermissionError(_errno.EROFS, "swap directory is on a read-only file system; choose a "
                                  "writable nvme_path", p)
        if not os.access(p, os.W_OK | os.X_OK):
            raise PermissionError(_errno.EACCES, "swap directory is not writable by this user; fix its "
                                  "permissions or choose another nvme_path", p)
        st = os.stat(p)
        key = (st.st_dev, st.st_ino)
        if key in seen:
            raise ValueError(f"paths lists the same directory twice ({seen[key]!r} and {p!r}); give each "
                             "directory once (one per drive)")
        seen[key] = p
    return dirs


def no_space_message(need: Mapping[str, int], what: str) -> str:
    """Why growing the swap files by ``need[path]`` bytes per path failed: bytes needed and free.

    Paths on one file system are summed, since they draw on the same free space.
    """
    by_dev: dict[int, list[str]] = {}
    for p in need:
        by_dev.setdefault(os.stat(p).st_dev, []).append(p)
    lines = []
    for group in by_dev.values():
        st = os.statvfs(group[0])
        free = st.f_bavail * st.f_frsize
        more = sum(need[p] for p in group)
        where = group[0] if len(group) == 1 else " and ".join(group) + " (one file system)"
        lines.append(f"{where}: needs {more} bytes ({format_size(more)}), has {free} bytes "
                     f"({format_size(free)}) free")
    total = sum(need.values())
    return (f"not enough disk space for {what}: the swap files must grow by {total} bytes "
            f"({format_size(total)}); " + "; ".join(lines)
            + ". Free some space, add or choose a larger nvme_path, or offload less.")
