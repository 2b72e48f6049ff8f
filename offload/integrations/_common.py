"""What the adapters share: our optimizer and offloaded weights found behind a framework's wrappers."""

from __future__ import annotations

from typing import Any, Optional

from torch import nn

from ..adam import OffloadedAdam
from ..params import store_of

_DEPTH = 8  # wrappers around wrappers (accelerate's around Lightning's around ours) stop here


def offloaded_optimizer(optimizer: Any) -> Optional[OffloadedAdam]:
    """The :class:`OffloadedAdam` inside ``optimizer`` (accelerate's and Lightning's wrappers are
    looked through), or None."""
    for _ in range(_DEPTH):
        if optimizer is None or isinstance(optimizer, OffloadedAdam):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
    return None


def unwrap_model(model: nn.Module) -> nn.Module:
    """``model`` without DDP/DataParallel's ``module`` and torch.compile's ``_orig_mod`` around it."""
    for _ in range(_DEPTH):
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        else:
            break
    return model


def has_offloaded_weights(model: Optional[nn.Module]) -> bool:
    """Whether any parameter of ``model`` lives on NVMe (``offload_parameters`` on it or a submodule)."""
    return model is not None and any(store_of(p) is not None for p in model.parameters())


def has_offloaded_grads(model: Optional[nn.Module]) -> bool:
    """Whether any parameter of ``model`` has its gradient in a grad store (placeholders in ``p.grad``)."""
    if model is None:
        return False
    return any(getattr(store_of(p), "offload_grads", False) for p in model.parameters())


def fingerprint(directory: str) -> str:
    """What identifies one save of a checkpoint directory: its manifest's own checksum, which covers the
    checksum of every file in it."""
    from ..checkpoint import read_manifest

    return read_manifest(directory)["manifest_xxh3_64"]


def check_fingerprint(directory: str, expected: str, beside: str) -> None:
    """Raise unless ``directory`` is still the save whose fingerprint ``beside`` recorded.

    Raises:
        CheckpointError: it is another save's (a crash between the two writes, or a copy of one
            without the other), or not a checkpoint at all.
    """
    from ..errors import CheckpointError

    try:
        found = fingerprint(directory)
    except FileNotFoundError:
        raise CheckpointError(f"{beside} names {directory}, which is missing; copy the two together") from None
    if found != expected:
        raise CheckpointError(f"{directory} is not the save {beside} was written with (a run interrupted between the "
                              "two writes, or one copied without the other); resume from an earlier checkpoint")
