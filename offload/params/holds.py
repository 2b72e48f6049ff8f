"""Holding offloaded weights for a block, and releasing many holds even when one release fails."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Iterator

import torch

from ..interrupts import deferred
from .registry import holder

__all__ = ["release_each", "resident"]


@contextlib.contextmanager
def resident(params: Iterable[torch.Tensor], *, dirty: bool = False) -> Iterator[None]:
    """Fetch those of ``params`` whose weights are on NVMe for the block; release them after it.

    A DTensor parameter whose local shard is on NVMe (FSDP2) has the shard fetched. Ordinary parameters are left
    alone. ``dirty=True`` writes the fetched ones back afterwards.
    """
    held = []
    try:
        with deferred():  # a Ctrl-C stops the fetches between two of them, each counted to be released
            for p in params:
                store, key = holder(p)
                if store is not None:
                    store.fetch(key)
                    held.append((store, key))
        yield
    finally:
        with deferred(urgent=False):
            release_each(held, lambda item: item[0].release(item[1], dirty=dirty))


def release_each(items: Iterable, release: Callable) -> None:
    """``release(item)`` for every item, even after one fails (a write-back error, a refused release):
    the others never stay resident for good. The first error is raised after all were tried."""
    first = None
    for item in items:
        try:
            release(item)
        except BaseException as err:  # re-raised below, once every item was tried
            first = first or err
    if first is not None:
        raise first

