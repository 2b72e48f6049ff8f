"""A model's weights alone as a checkpoint: ``save_parameters`` and ``load_parameters``."""

from __future__ import annotations

from torch import nn

from .commit import reading
from .model import _load_model, _model_section, _named_tensors, _save_model_only
from .verify import read_manifest

__all__ = ["load_parameters", "save_parameters"]


def save_parameters(model: nn.Module, directory) -> str:
    """Save ``model``'s weights to the checkpoint directory ``directory``, atomically, streaming.

    Offloaded parameters go from the swap space through the parameter pool to ``params.bin`` with
    the native engine (O_DIRECT), each with its xxh3_64: nothing is fetched, so host memory stays the
    pool whatever the model size. A parameter resident now (inside a forward or ``materialized``)
    or held in the host cache is saved from that copy, its latest. The model's other parameters
    and persistent buffers go to ``model.pt``. Gradients are not saved (torch does not save them
    either). With an ``OffloadedAdam`` use ``opt.save_checkpoint(directory, model=model)`` instead,
    which saves both in the same directory. See ``docs/checkpoint.md``.

    Returns:
        The checkpoint directory (absolute).

    Raises:
        StateError: a load of weights into this model failed part-way, so there is nothing sound to save.
        OSError: writing failed (file, offset and errno named); a previous checkpoint at ``directory``
            is left as it was.
    """
    _named_tensors(model)  # checks the type
    return _save_model_only(model, directory)


def load_parameters(model: nn.Module, directory) -> None:
    """Load weights saved by :func:`save_parameters` (or with ``save_checkpoint(..., model=)``) into ``model``.

    First every name, shape and dtype is compared with the model, and every checksum (``model.pt``,
    each parameter in ``params.bin``) verified; the first mismatch is named and nothing changes. Then
    the bytes stream into the parameter store's swap space through its pool (a resident or cached
    copy is overwritten too), the other tensors are copied in, and offloaded gradients are cleared.
    The model need not be offloaded the same way as when it was saved (or at all).

    An optimizer keeping fp32 master copies of these weights (``OffloadedAdam`` over bf16/fp16) does
    not see them: load both with ``opt.load_checkpoint(directory, model=model)``.

    Raises:
        CheckpointError: the checkpoint holds no model, or does not fit this one (names the first
            mismatch), or is incomplete; ``ChecksumError``: corrupt. Nothing was changed.
        OSError: reading or writing failed while streaming; the offloaded weights are then a mix of old
            and new, and fetching them raises ``StateError`` until a load succeeds.
    """
    _named_tensors(model)
    with reading(directory) as directory:
        manifest = read_manifest(directory)
        _model_section(manifest, directory)
        _load_model(model, directory, manifest)
