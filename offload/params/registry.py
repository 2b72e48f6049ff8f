"""Which parameter store holds a parameter's bytes (asked by the optimizer, checkpoints and clipping)."""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch

__all__ = ["forget", "forget_shard", "holder", "register", "register_shard", "store_of"]

# id(parameter) -> (weak reference to it, the store holding it). A WeakKeyDictionary would compare
# tensors with ==; the weak reference tells a live entry from a reused id. Stores remove their entries
# when they close.
_STORES: dict[int, tuple[weakref.ref, Any]] = {}
# id(DTensor parameter) -> (weak reference to it, the store, the tensor the store holds for it): FSDP2's sharded
# parameters, whose local shard's storage (FSDP2's padded sharded buffer) the store holds as a plain tensor of
# its own. ``store_of`` does not name them (their bytes are not the parameter's global ones); ``holder`` does.
_SHARDS: dict[int, tuple[weakref.ref, Any, torch.Tensor]] = {}


def store_of(param: torch.Tensor) -> Optional[Any]:
    """The :class:`offload.params.store.ParamStore` holding ``param``'s bytes, or ``None``."""
    entry = _STORES.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    return entry[1]


def register(param: torch.Tensor, store: Any) -> None:
    """Record that ``store`` holds ``param``."""
    _STORES[id(param)] = (weakref.ref(param), store)


def forget(param: torch.Tensor, store: Any) -> None:
    """``store`` no longer holds ``param``."""
    if store_of(param) is store:
        del _STORES[id(param)]


def register_shard(param: torch.Tensor, held: torch.Tensor, store: Any) -> None:
    """Record that ``store`` holds the local shard of the DTensor ``param`` as its tensor ``held``."""
    _SHARDS[id(param)] = (weakref.ref(param), store, held)


def forget_shard(param: torch.Tensor, store: Any) -> None:
    """``store`` no longer holds ``param``'s local shard."""
    entry = _SHARDS.get(id(param))
    if entry is not None and entry[0]() is param and entry[1] is store:
        del _SHARDS[id(param)]


def holder(param: torch.Tensor) -> tuple[Optional[Any], Optional[torch.Tensor]]:
    """``(store, key)``: the store holding ``param``'s weights (its own, or its local shard's under FSDP2) and the
    tensor to fetch and release in it; ``(None, None)`` for weights in memory."""
    store = store_of(param)
    if store is not None:
        return store, param
    entry = _SHARDS.get(id(param))
    if entry is None or entry[0]() is not param:
        return None, None
    return entry[1], entry[2]
