"""``torch.distributed.checkpoint`` (DCP) with nvme-offload: what lives on NVMe streams beside DCP's files.

``get_state_dict(model, optimizer)`` followed by ``dcp.save`` reads every unit of offloaded state (and
every offloaded weight) into memory first; :func:`save` hands DCP everything else and streams the
optimizer's state, and offloaded weights, into ``<checkpoint_id>/offload`` through the pools.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from torch import nn

from . import OFFLOAD_DIR
from ._common import check_fingerprint, fingerprint, has_offloaded_weights, offloaded_optimizer, unwrap_model

__all__ = ["KEY", "OFFLOAD_DIR", "load", "save"]

KEY = "nvme_offload"  # DCP's entry for <checkpoint_id>/offload's fingerprint (its manifest's checksum)


def save(state_dict: dict, checkpoint_id, *, optimizer: Any = None, model: Optional[nn.Module] = None,
         **dcp_kwargs) -> None:
    """``dcp.save(state_dict, checkpoint_id=checkpoint_id)``, with ``optimizer``'s state and ``model``'s
    offloaded weights streamed into ``<checkpoint_id>/offload``.

    Put everything else in ``state_dict`` (the step, the LR scheduler's ``state_dict()``, and a model
    that is not offloaded as ``model.state_dict()``), but not the optimizer's ``state_dict()`` nor an
    offloaded model's: those hold everything in memory at once. One process writes the streamed part
    (rank 0 when ``torch.distributed`` is initialised; every rank keeps the same state under DDP).

    Args:
        state_dict: what DCP saves (as for ``dcp.save``).
        checkpoint_id: the checkpoint directory.
        optimizer: an ``OffloadedAdam`` (or a wrapper around one), or None.
        model: a model with parameters offloaded by ``offload_parameters``, or None.
        dcp_kwargs: passed to ``dcp.save`` (``storage_writer``, ``planner``, ``process_group``, ...).
    """
    import torch.distributed.checkpoint as dcp

    opt, model, ours = _parts(optimizer, model, checkpoint_id)
    streamed = ""
    if _writer() and (opt is not None or model is not None):
        if opt is not None:
            opt.save_checkpoint(ours, model=model, alone=True)
        else:
            from ..checkpoint import save_parameters

            save_parameters(model, ours)
        streamed = fingerprint(ours)
    dcp.save({**state_dict, KEY: streamed}, checkpoint_id=checkpoint_id, **dcp_kwargs)


def load(state_dict: dict, checkpoint_id, *, optimizer: Any = None, model: Optional[nn.Module] = None,
         **dcp_kwargs) -> None:
    """Load what :func:`save` wrote: ``state_dict`` in place (as ``dcp.load``), then the optimizer's
    state and the offloaded weights from ``<checkpoint_id>/offload``. The streamed part is checked to
    be the one DCP's part was saved with before anything is loaded.

    Raises:
        CheckpointError: the two parts come from different saves (a save was interrupted between
            them), or the streamed part does not fit (see ``load_checkpoint``); nothing was loaded.
    """
    import torch.distributed.checkpoint as dcp

    opt, model, ours = _parts(optimizer, model, checkpoint_id)
    if opt is not None or model is not None:
        saved = {KEY: ""}
        dcp.load(saved, checkpoint_id=checkpoint_id, **dcp_kwargs)  # that entry alone
        check_fingerprint(ours, saved[KEY], f"the DCP checkpoint {os.fspath(checkpoint_id)}")
    loaded = {**state_dict, KEY: ""}
    dcp.load(loaded, checkpoint_id=checkpoint_id, **dcp_kwargs)
    for k in state_dict:  # DCP puts values that are not tensors into the dict it was given
        state_dict[k] = loaded[k]
    if opt is not None:
        opt.load_checkpoint(ours, model=model, alone=True)
    elif model is not None:
        from ..checkpoint import load_parameters

        load_parameters(model, ours)


def _parts(optimizer, model, checkpoint_id):
    opt = offloaded_optimizer(optimizer)
    if optimizer is not None and opt is None:
        raise TypeError(f"optimizer must be an OffloadedAdam (or wrap one), got {type(optimizer).__name__}; "
                        "put a torch optimizer's state_dict() in state_dict instead")
    model = unwrap_model(model) if model is not None else None
    return opt, (model if has_offloaded_weights(model) else None), os.path.join(os.fspath(checkpoint_id),
                                                                                 OFFLOAD_DIR)


def _writer() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
