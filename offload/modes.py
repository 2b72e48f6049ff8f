"""Who may read what this library creates: its owner alone, unless ``OFFLOAD_FILE_MODE`` widens it."""

from __future__ import annotations

import os

__all__ = ["ENV", "dir_mode", "file_mode"]

ENV = "OFFLOAD_FILE_MODE"
_DEFAULT = 0o600
_MOST = 0o644  # readers may be added; writers never (a checkpoint others can change is not the user's)


# NOTE: swap files, checkpoints and Hugging Face saves hold the user's weights and optimizer state, so they
# are created 0600 (directories 0700) whatever the umask would allow. A team that shares checkpoints sets
# OFFLOAD_FILE_MODE=0640 (or 0644): files get that mode and directories the same with search (x) added
# where reading is, both still narrowed by the umask. Read at each creation, so a process can change it.
def file_mode() -> int:
    """The mode new files are created with: ``OFFLOAD_FILE_MODE`` (octal, 0600 to 0644), else 0600.

    Raises:
        ValueError: the variable is set to something else, naming it and what it may be.
    """
    text = os.environ.get(ENV, "").strip()
    if not text:
        return _DEFAULT
    try:
        mode = int(text, 8)
    except ValueError:
        mode = -1
    if mode < 0 or mode & _DEFAULT != _DEFAULT or mode & ~_MOST:
        raise ValueError(f"{ENV}={text!r} is not a mode this library creates files with: give an octal mode "
                         "from 0600 to 0644 that keeps the owner's read and write and adds only reading for the "
                         "group or others (0640: the group may read), or unset it for 0600")
    return mode


def dir_mode() -> int:
    """The mode new directories are created with: :func:`file_mode` with search (x) wherever reading is."""
    mode = file_mode()
    return mode | (mode & 0o444) >> 2
