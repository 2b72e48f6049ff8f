"""The ``offload-bench`` command line: argument types, shared options, paths and exit codes."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import shutil
import signal
import sys
import tempfile
import traceback
from typing import Callable, Iterator, Sequence

from .._version import __version__
from ..commit import check_replaceable
from ..config import load_config
from ..errors import OffloadError
from ..sizes import ALIGNMENT, format_size, parse_count, parse_size, round_up

PROG = "offload-bench"

# Modules holding subcommands, in the order ``--help`` lists them.
# NOTE: each subcommand lives in its own module of this package with a ``register(subparsers)``
# function that adds its parser and sets ``run`` (a function of the parsed arguments returning an
# exit code) as the parser's default. Adding a command is one module plus one line in COMMANDS.
# Exit codes: 0 success, 1 a failure while running (I/O error, failed verification, a missing tool),
# 2 a bad argument, 130 interrupted.
COMMANDS = ("offload.tools.io", "offload.tools.sweep", "offload.tools.adam", "offload.tools.checkpoint",
            "offload.tools.params", "offload.tools.scale", "offload.tools.gpu", "offload.tools.plan",
            "offload.tools.doctor", "offload.tools.compare", "offload.tools.quality")

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130

# The direct-I/O alignment every request respects; sizes and block sizes must be multiples of it.


class UsageError(Exception):
    """A bad argument found after parsing (exit code 2); the message names it and what to do."""


class BenchError(Exception):
    """A run that could not be completed for a reason that is not an OSError (exit code 1)."""


# -- argument types ----------------------------------------------------------------------------


def size_arg(text: str) -> int:
    """An argparse type: a human size (``1GiB``, ``512MiB``, ``4096``) of at least one byte."""
    try:
        n = parse_size(text)
    except (ValueError, TypeError) as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"size {text!r} must be positive")
    return n


def block_size_arg(text: str) -> int:
    """An argparse type: a human size that is a positive multiple of the 4096-byte alignment."""
    n = size_arg(text)
    if n % ALIGNMENT:
        raise argparse.ArgumentTypeError(
            f"block size {text!r} ({n} bytes) is not a multiple of {ALIGNMENT}; try {round_up(n, ALIGNMENT)} bytes"
        )
    return n


def positive_int_arg(low: int = 1, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in ``[low, high]``."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if n < low or (high is not None and n > high):
            bound = f"between {low} and {high}" if high is not None else f"at least {low}"
            raise argparse.ArgumentTypeError(f"{n} is out of range: must be {bound}")
        return n

    parse.__name__ = "integer"  # argparse names the type in its messages
    return parse


def count_arg(text: str) -> int:
    """An argparse type: a positive count with decimal suffixes (``64M``, ``1.5G``, ``1e8``)."""
    try:
        n = parse_count(text)
    except (ValueError, TypeError) as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"count must be at least 1, got {text!r}")
    return n


def list_arg(item: Callable[[str], int]) -> Callable[[str], list[int]]:
    """An argparse type: a comma-separated list of ``item`` values (duplicates dropped, order kept)."""

    def parse(text: str) -> list[int]:
        parts = [p.strip() for p in text.split(",")]
        if not parts or any(not p for p in parts):
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list, e.g. 1MiB,4MiB")
        return list(dict.fromkeys(item(p) for p in parts))

    parse.__name__ = "list"
    return parse


def short_size(n: int) -> str:
    """``1048576`` -> ``"1MiB"`` when exact in a binary unit, else :func:`format_size`'s form."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return format_size(n) if n >= 1024 else f"{n}B"


# -- shared options ----------------------------------------------------------------------------


def common_parser() -> argparse.ArgumentParser:
    """Options every subcommand takes (a parent parser)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--debug", action="store_true", help="show a traceback on errors")
    return p


def add_version_option(parser: argparse.ArgumentParser) -> None:
    """``--version``: the program's name and nvme-offload's version, then exit 0 (every command line has it)."""
    parser.add_argument("--version", action="version", version=f"%(prog)s (nvme-offload) {__version__}")


def add_config_option(parser: argparse.ArgumentParser) -> None:
    """``--config FILE``, read with :func:`offload.config.load_config` at parse time (``args.config`` is a
    ``Config``; the defaults without the option). A bad file is an argument error (exit code 2)."""

    def read(path: str):
        try:
            return load_config(path)
        except (OSError, ValueError) as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    parser.add_argument("--config", metavar="FILE", type=read, default=load_config(None),
                        help="a JSON config (ours or a DeepSpeed ds_config.json)")


def config_given(args: argparse.Namespace) -> bool:
    """Whether ``--config`` named a file that changes anything (else a benchmark may pick its own sizes)."""
    return args.config != load_config(None)


def add_path_option(parser: argparse.ArgumentParser) -> None:
    """Add ``--path DIR...`` to ``parser``: the directories of the swap files, one per drive."""
    parser.add_argument(
        "--path", metavar="DIR", action="extend", nargs="+", dest="paths", default=None,
        help="directory for the swap file; give several (one per drive) to stripe over them. "
             "Missing directories are created (their parent must exist) and removed afterwards. "
             "Default: a scratch directory under the system temp dir, removed afterwards",
    )


def check_output_file(option: str, path: str | None, suffixes: Sequence[str] = ()) -> None:
    """Fail now, not after a long run, if ``path`` cannot be written later."""
    if path is None:
        return
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise UsageError(f"{option} {path}: directory {parent} does not exist")
    if os.path.isdir(path):
        raise UsageError(f"{option} {path} is a directory; give a file name")
    try:
        check_replaceable(path)
    except FileExistsError as err:
        raise UsageError(f"{option} {path}: {err.strerror}") from None
    if suffixes and not path.lower().endswith(tuple(suffixes)):
        raise UsageError(f"{option} {path}: the file name must end with one of {', '.join(suffixes)}")


@contextlib.contextmanager
def bench_paths(paths: Sequence[str] | None) -> Iterator[list[str]]:
    """Yield absolute directories to benchmark, and clean up what this created.

    Without ``paths``, a scratch directory under :func:`tempfile.gettempdir` is made, printed, and
    removed afterwards, also on errors and Ctrl-C. Given directories that do not exist are created
    (their parent must exist) and removed afterwards if still empty.

    Raises:
        UsageError: a path whose parent does not exist, a path that is not a directory, or a
            directory given twice.
    """
    if not paths:
        scratch = tempfile.mkdtemp(prefix="offload-bench-", dir=tempfile.gettempdir())
        print(f"scratch directory: {scratch} (removed after the run)", flush=True)
        try:
            yield [scratch]
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return

    resolved: list[str] = []
    for p in paths:
        a = os.path.realpath(os.path.expanduser(p))
        if a in resolved:
            raise UsageError(f"--path {p} is given twice; give each directory once")
        if os.path.exists(a) and not os.path.isdir(a):
            raise UsageError(f"--path {p} is not a directory")
        if not os.path.exists(a) and not os.path.isdir(os.path.dirname(a)):
            raise UsageError(f"--path {p}: its parent directory {os.path.dirname(a)} does not exist; "
                             "create it first")
        resolved.append(a)
    created = []
    try:
        for a in resolved:
            if not os.path.exists(a):
                os.mkdir(a)
                created.append(a)
        yield resolved
    finally:
        for a in reversed(created):
            with contextlib.suppress(OSError):
                os.rmdir(a)  # only if empty: never remove what someone else put there


def check_free_space(paths: Sequence[str], per_path: int, what: str) -> None:
    """Raise :class:`BenchError` if a path has less than ``per_path`` bytes free."""
    for p in paths:
        st = os.statvfs(p)
        free = st.f_bavail * st.f_frsize
        if free < per_path:
            raise BenchError(
                f"{p} has {format_size(free)} free but {what} needs {format_size(per_path)} there; "
                "use a smaller --size or another --path"
            )


# -- entry point -------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The ``offload-bench`` argument parser, with every subcommand."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Measure how fast the swap space moves data on your drives, "
                    "and find the best aio settings.",
        epilog="Sizes take units: 4KiB, 1MiB, 1GiB (binary) or 1MB, 1GB (decimal).",
    )
    add_version_option(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    common = common_parser()
    for name in COMMANDS:
        importlib.import_module(name).register(sub, common)
    return parser


def _on_sigterm(signum, frame):
    # Turn SIGTERM into an exception so ``finally`` blocks close the swap space and remove scratch files.
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``offload-bench``; returns the exit code.

    Args:
        argv: the arguments after the program name (default: ``sys.argv[1:]``).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    previous = None
    with contextlib.suppress(ValueError):  # not in the main thread (embedded use): keep the default
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        for option in ("json", "emit_config"):  # outputs: refused now, not after a long run
            check_output_file(f"--{option.replace('_', '-')}", getattr(args, option, None))
        return int(args.run(args) or 0)
    except UsageError as err:
        print(f"{PROG} {args.command}: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"\n{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (OSError, BenchError, OffloadError) as err:
        if args.debug:
            traceback.print_exc()
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return EXIT_FAILURE
    except Exception:
        if args.debug:
            raise
        traceback.print_exc()
        return EXIT_FAILURE
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
