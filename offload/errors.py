"""The library's exceptions: one small hierarchy.

I/O failures are raised as ``OSError(errno, strerror, path)`` itself (so Python maps them to
``FileNotFoundError``, ``PermissionError``, ...); the classes here are for everything else.
"""

import sys


class OffloadError(Exception):
    """Base class of the errors this library raises (besides ``OSError`` for I/O)."""


class ConfigError(OffloadError, ValueError):
    """A configuration value or key is wrong; the message names every problem found.

    Attributes:
        problems: ``(JSON path, message)`` of each problem, where the configuration's rules found them.
    """

    problems: list[tuple[str, str]]


class ConfigWarning(UserWarning):
    """A configuration holds keys that the component reading it does not use (named in the message)."""


class StateError(OffloadError, RuntimeError):
    """Offloaded state cannot be used: a step failed part-way, or state was lost or corrupted.

    The optimizer refuses to step until its state is restored (``load_state_dict`` or
    ``load_checkpoint``), so it never trains on half-written state.
    """


class PoolTooSmallError(OffloadError, ValueError):
    """The host buffer pool cannot hold what was asked of it; the message says what to set."""


class CheckpointError(OffloadError, ValueError):
    """A checkpoint is incomplete, corrupt, or does not fit the optimizer; the message says where."""


class ChecksumError(CheckpointError):
    """A checkpoint file's bytes differ from what was saved (bit rot, truncation, tampering)."""


def user_stacklevel() -> int:
    """The ``stacklevel`` at which a warning issued by this function's caller names the first frame outside
    this package (the user's line)."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_globals.get("__name__", "").startswith("offload."):
        frame, level = frame.f_back, level + 1
    return level
