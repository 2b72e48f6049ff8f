"""The turn from forward into backward: the weights of the last modules forward ran stay for backward."""

from __future__ import annotations

import torch

from .holds import release_each
from .store import ParamStore

__all__ = ["Turn"]


# NOTE: backward visits modules in the reverse of forward's order, so the weights forward released last are the
# first backward fetches again: read twice from NVMe within moments. Instead, where the recorded order of fetches
# (the prefetch's) says that the next event after a module's forward is its own backward (forward's last module,
# or one that activation checkpointing recomputes in backward), its post-hook hands its holds of the module's
# weights on NVMe to the turn, which keeps them resident: backward's first fetch of the module takes the kept hold
# instead of fetching (no read). Only while grad is enabled and where the module's weights fit in the parameter
# pool's bytes (the room the prefetches ahead of backward use); resident weights stay within two modules', as
# without it. Whatever is still kept when another module's forward ends, when backward ends, or when the next
# forward begins (no backward came: a skipped iteration), is released then. Forward only reads a kept weight.
class Turn:
    """Holds of the weights forward used last, kept into backward, within the parameter pool's bytes.

    Args:
        store: the parameter store whose weights are held (its pool's bytes are the budget).
    """

    def __init__(self, store: ParamStore):
        self.store = store
        self.budget = store.pool.nbytes
        self._kept: dict[torch.Tensor, None] = {}  # the params kept (in order)
        self.taken = 0  # holds backward took instead of fetching (reads saved), since the store was made

    def release_or_keep(self, params: list[torch.Tensor], *, backward_next: bool) -> None:
        """Forward is done with ``params`` (one hold each, a module's): kept where ``backward_next`` (the module's
        backward is the next fetch recorded), grad is enabled and they fit the budget, else released; what was
        kept before them is released."""
        on_nvme = [p for p in params if p.requires_grad and self.store.records[p].extent is not None]
        keep = backward_next and torch.is_grad_enabled() and \
            0 < sum(self.store.records[p].nbytes for p in on_nvme) <= self.budget
        kept = dict.fromkeys(on_nvme) if keep else {}
        released = [p for p in self._kept if p not in kept]  # a module called twice keeps one hold
        released += [p for p in params if p not in kept or p in self._kept]
        self._kept = kept
        release_each(released, self.store.release)

    def take(self, p: torch.Tensor) -> bool:
        """Backward fetches ``p``: whether a kept hold stands for that fetch (the caller then holds it)."""
        if p not in self._kept:
            return False
        del self._kept[p]
        self.taken += 1
        return True

    def release_all(self) -> None:
        """Release every hold still kept."""
        kept, self._kept = list(self._kept), {}
        release_each(kept, self.store.release)
