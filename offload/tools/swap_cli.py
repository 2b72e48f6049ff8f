"""The ``offload-swap`` command line: list and remove swap files left by runs that died.

A swap file is stale when no process holds its lock and it is provably ours (this user's, ending in the
seal written when it was made, as long as the seal says; see ``SwapSpace.find_stale``): a file of a live
run, in this process or any other, or a file merely named like a swap file, is never listed nor removed.
Exit codes: 0 success, 1 a path that is not a directory (nothing is listed or removed then), 2 a bad argument.

Examples::

    offload-swap list /mnt/nvme0/offload /mnt/nvme1/offload
    offload-swap clean /mnt/nvme0/offload
    offload-swap list -r /mnt/nvme       # and every directory below it
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Iterator, Sequence

from .._version import __version__
from ..sizes import format_size
from ..space import SwapSpace
from ..space.files import find_unproven

PROG = "offload-swap"
EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


def build_parser() -> argparse.ArgumentParser:
    """The ``offload-swap`` argument parser (``list``, ``clean``)."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="List or remove stale nvme-offload swap files (those no live process holds).")
    parser.add_argument("--version", action="version", version=f"%(prog)s (nvme-offload) {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, text in (("list", "print the stale swap files and the space they hold"),
                       ("clean", "remove the stale swap files (a live run's files are never touched)")):
        p = sub.add_parser(name, help=text)
        p.add_argument("paths", metavar="PATH", nargs="+", help="swap directories (nvme_path)")
        p.add_argument("-r", "--recursive", action="store_true",
                       help="also every directory below each PATH (symbolic links are not followed)")
    return parser


def _directories(path: str, recursive: bool) -> Iterator[str]:
    yield path
    if recursive:
        for top, dirs, _ in os.walk(path):
            dirs.sort()
            for d in dirs:
                yield os.path.join(top, d)


def _allocated(path: str) -> int:
    try:
        return os.lstat(path).st_blocks * 512
    except OSError:
        return 0  # removed meanwhile


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``offload-swap``; returns the exit code.

    Args:
        argv: the arguments after the program name (default: ``sys.argv[1:]``).
    """
    args = build_parser().parse_args(argv)
    # Every path is checked before anything is listed or removed: a typo in one of them is an error on its own,
    # not a count of "0 stale swap files" that reads as if the directory had been looked at.
    missing = [path for path in args.paths if not os.path.isdir(path)]
    for path in missing:
        why = "does not exist" if not os.path.lexists(path) else "is not a directory"
        print(f"{PROG} {args.command}: error: {path} {why}; give the swap directory (the nvme_path of the run)",
              file=sys.stderr)
    if missing:
        return EXIT_FAILURE
    status, count, total = EXIT_OK, 0, 0
    for path in args.paths:
        for directory in _directories(path, args.recursive):
            if args.command == "list":
                for f in SwapSpace.find_stale(directory):
                    size = _allocated(f)
                    print(f"{f}\t{format_size(size)}")
                    count, total = count + 1, total + size
            else:
                sizes = {f: _allocated(f) for f in SwapSpace.find_stale(directory)}
                for f in SwapSpace.remove_stale(directory):
                    print(f"removed {f}\t{format_size(sizes.get(f, 0))}")
                    count, total = count + 1, total + sizes.get(f, 0)
    what = "stale swap file(s) holding" if args.command == "list" else "stale swap file(s) removed, freeing"
    print(f"{count} {what} {format_size(total)}")
    unproven = [f for path in args.paths if os.path.isdir(path) for d in _directories(path, args.recursive)
                for f in find_unproven(d)]
    if unproven:
        print(f"{len(unproven)} file(s) named like swap files that nobody holds are not provably ours and are left "
              "alone (made before swap files were sealed, or changed since, or another user's); remove them with "
              "rm once you know no run uses them:")
        for f in unproven:
            print(f"  {f}\t{format_size(_allocated(f))}")
    return status


if __name__ == "__main__":
    sys.exit(main())
