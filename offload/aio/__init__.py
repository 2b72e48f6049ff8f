"""The asynchronous I/O engine: moves bytes between host buffers and files, and opens files for it.

The only layer that talks to the native engine (through ``offload._native``): ``files`` opens files
(O_DIRECT, alignment), ``futures`` holds requests and their results, ``engine`` runs them, ``append`` writes
a new file front to back through it.
"""

from .append import AppendFile
from .engine import HAVE_IO_URING, HAVE_XXHASH, Engine
from .engine import _test_refuse_io_uring as _test_refuse_io_uring  # a testing hook
from .files import (
    AioFile,
    create_private,
    open_file,
    reserve,
    unlink_if_same,
    wrap_fd,
)
from .futures import (
    READ,
    WRITE,
    CheckedRead,
    CompletedFuture,
    Future,
    FutureGroup,
    PieceDigest,
    Segment,
    hex_digest,
    wait_quietly,
)
from .gds import gds_status, warn_use_gds

__all__ = [
    "AppendFile",
    "create_private",
    "reserve",
    "HAVE_IO_URING",
    "HAVE_XXHASH",
    "READ",
    "WRITE",
    "AioFile",
    "CheckedRead",
    "CompletedFuture",
    "Engine",
    "Future",
    "FutureGroup",
    "PieceDigest",
    "Segment",
    "open_file",
    "unlink_if_same",
    "gds_status",
    "hex_digest",
    "wait_quietly",
    "warn_use_gds",
    "wrap_fd",
]
