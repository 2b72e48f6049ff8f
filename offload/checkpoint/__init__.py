"""Streaming checkpoints of offloaded optimizer state and model weights: save, load, verify, export,
import, retention.

The package's modules, lowest layer first:

- ``format``: file names, the manifest's building blocks, checksums and checks of single files.
- ``commit``: the atomic commit of a checkpoint directory (temporary sibling, fsync, renameat2
  exchange), recovery after a crash between renames, and the lock that serialises saves.
- ``stream``: moving state.bin through a few host buffers with the native engine.
- ``verify``: reading a checkpoint without an optimizer (manifest, full verification, summary).
- ``model``: a model's weights (offloaded parameters streamed through their store's pool).
- ``save`` and ``load``: an offloaded optimizer, and optionally its model, to and from a checkpoint.
- ``export``: to and from torch's optimizer state_dict layout; a model's weights to its state_dict.
- ``retention``: keep the last N checkpoints plus milestones.

Example::

    from offload.checkpoint import load_checkpoint, save_checkpoint

    save_checkpoint(opt, "/ckpt/run1", model=model, extra={"step": step})
    extra = load_checkpoint(opt, "/ckpt/run1", model=model)
"""

from __future__ import annotations

from ..errors import CheckpointError, ChecksumError
from .commit import reading
from .export import (
    export_checkpoint,
    export_model_checkpoint,
    export_model_state_dict,
    export_state_dict,
    import_state_dict,
)
from .format import FORMAT_VERSION
from .load import load_checkpoint
from .retention import Retention, save_with_retention
from .save import save_checkpoint
from .verify import inspect_checkpoint, read_manifest, verify_checkpoint
from .weights import load_parameters, save_parameters

__all__ = [
    "CheckpointError",
    "ChecksumError",
    "FORMAT_VERSION",
    "Retention",
    "export_checkpoint",
    "export_model_checkpoint",
    "export_model_state_dict",
    "export_state_dict",
    "import_state_dict",
    "inspect_checkpoint",
    "load_checkpoint",
    "load_parameters",
    "read_manifest",
    "reading",
    "save_checkpoint",
    "save_parameters",
    "save_with_retention",
    "verify_checkpoint",
]
