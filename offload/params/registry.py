"""Which parameter store holds a parameter's bytes (asked by the optimizer, checkpoints and clipping)."""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch

__all__ = ["forget", "register", "store_of"]

# id(parameter) -> (weak reference to it, the store holding it). A WeakKeyDictionary would compare
# tensors with ==; the weak reference tells a live entry from a reused id. Stores remove their entries
# when they close.
_STORES: dict[int, tuple[weakref.ref, Any]] = {}


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
