"""Streaming checkpoints of offloaded optimizer state: save, load, verify, export, import, retention.

The package's modules, lowest layer first:

- ``format``: file names, the manifest's building blocks, checksums and checks of single files.
- ``commit``: the atomic commit of a checkpoint directory (temporary sibling, fsync, renameat2
  exchange), recovery after a crash between renames, and the lock that serialises saves.
- ``stream``: moving state.bin through a few host buffers with the native engine.
- ``verify``: reading a checkpoint without an optimizer (manifest, full verification, summary).
- ``save`` and ``load``: an offloaded optimizer to and from a checkpoint.
- ``export``: to and from torch's optimizer state_dict layout.
- ``retention``: keep the last N checkpoints plus milestones.

Example::

    from offload.checkpoint import load_checkpoint, save_checkpoint

    save_checkpoint(opt, "/ckpt/run1", extra={"model": model.state_dict()})
    extra = load_checkpoint(opt, "/ckpt/run1")
"""

from __future__ import annotations

from ..errors import CheckpointError, ChecksumError
from .export import export_checkpoint, export_state_dict, import_state_dict
from .format import FORMAT_VERSION
from .load import load_checkpoint
from .retention import Retention, save_with_retention
from .save import save_checkpoint
from .verify import inspect_checkpoint, read_manifest, verify_checkpoint

__all__ = [
    "CheckpointError",
    "ChecksumError",
    "FORMAT_VERSION",
    "Retention",
    "export_checkpoint",
    "export_state_dict",
    "import_state_dict",
    "inspect_checkpoint",
    "load_checkpoint",
    "read_manifest",
    "save_checkpoint",
    "save_with_retention",
    "verify_checkpoint",
]
