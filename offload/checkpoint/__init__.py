"""Streaming, atomic, checksummed checkpoints of offloaded optimizer state and model weights.

Save and load, verify, export to and import from torch's layouts, and retention; the modules and
the format are described in ``docs/checkpoint.md``.

Example::

    from offload.checkpoint import load_checkpoint, save_checkpoint

    save_checkpoint(opt, "/ckpt/run1", model=model, extra={"step": step})
    extra = load_checkpoint(opt, "/ckpt/run1", model=model)

    handle = save_checkpoint(opt, "/ckpt/run2", blocking=False)
    ...  # training goes on; the checkpoint holds the state at the call
    handle.wait()
"""

from __future__ import annotations

from ..errors import CheckpointError, ChecksumError
from .commit import SaveHandle, reading
from .format import FORMAT_VERSION, Storage
from .importing import import_state_dict
from .load import load_checkpoint
from .model import load_parameters, save_parameters
from .retention import Retention, save_with_retention
from .save import mirror_checkpoint, save_checkpoint, wait_for_saves
from .verify import (
    export_checkpoint,
    export_model_checkpoint,
    export_model_state_dict,
    export_state_dict,
    inspect_checkpoint,
    read_manifest,
    verify_checkpoint,
)

__all__ = [
    "CheckpointError",
    "ChecksumError",
    "FORMAT_VERSION",
    "Retention",
    "SaveHandle",
    "Storage",
    "export_checkpoint",
    "export_model_checkpoint",
    "export_model_state_dict",
    "export_state_dict",
    "import_state_dict",
    "inspect_checkpoint",
    "load_checkpoint",
    "load_parameters",
    "mirror_checkpoint",
    "read_manifest",
    "reading",
    "save_checkpoint",
    "save_parameters",
    "save_with_retention",
    "verify_checkpoint",
    "wait_for_saves",
]
