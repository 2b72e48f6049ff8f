"""The turn from forward into backward: the weights of the last modules forward ran stay for backward."""

from __future__ import annotations

from typing import Sequence

import torch

from .holds import release_each
from .store import ParamStore

__all__ = ["BACKWARD", "FORWARD", "Turn"]

FORWARD, BACKWARD = 0, 1  # the kinds of event in the recorded order of fetches (offload.params.hooks)


# NOTE: backward visits modules in the reverse of forward's order, so the weights forward released last are the
# first backward fetches again: read twice from NVMe within moments. Instead the post-hooks of forward's last
# modules hand their holds of the modules' weights on NVMe to the turn, which keeps them resident: backward's first
# fetch of each takes the kept hold instead of fetching (no read), and releases it as it would its own.
#
# Which modules: the recorded order of fetches (the prefetch's) is played through once (``plan``), keeping as the
# run does: at a module's forward, where the next event of that module is its own backward (a module called twice
# keeps at its last call; one that activation checkpointing recomputes keeps at the recomputation, not at the
# forward whose weights the recomputation fetches again), its weights join the kept ones, newest last; the oldest
# are dropped while the kept bytes exceed the budget; a backward event takes its module's. The forward events whose
# kept weights some backward event took keep those weights in the run (``release_or_keep(keep=...)``): the
# last modules before the turn (backward takes them LIFO, the last first), as many as fit, and none earlier in
# forward that would be dropped before backward came. The run keeps the same way, so a parent's own weights
# (kept at its post-hook, after its children's; the play keeps them at its pre-hook) or an order that changed
# cost no more than the budget: at worst a kept hold is dropped (released) before backward takes it.
#
# The budget: the parameter pool's bytes. The kept weights are in the weights' own storage, not in the pool:
# they hold no pool buffer, so they cannot stall a fetch, a prefetch or a gradient's write, whose buffers come
# from the pool only (a prefetch never waits for one; a take that must have one drops the prefetch issued last).
# A kept module is an event of the prefetch's window like any other, whose weights being resident need no read:
# while backward works through the kept modules, the pool is left to their gradients' writes, and backward's
# reads begin ``prefetch`` events ahead of the first module not kept, as everywhere else. So the weights ahead of
# backward's need at the turn are the kept ones (at most the pool's bytes) plus, in the pool, the reads in
# flight (at most the pool's buffers).
#
# The bound: the kept bytes never exceed the budget (every keep drops the oldest until they fit, before anything
# else is fetched), and every other resident weight is held by a forward in progress, by backward (until its
# gradient is final) or by the step, exactly as without the turn (a kept hold taken by backward stands for the
# fetch backward would have made). So the most resident at once is at most the pool's bytes more than without
# the turn: for a model whose forward and backward hold one module at a time, the pool's bytes plus the largest
# module's.
#
# Released: only while grad is enabled and the model trains is anything kept (not under no_grad, not in eval).
# What is still kept when backward ends, when the next forward begins (no backward came: a skipped iteration, or
# one whose backward raised), or when the hooks are removed, is released then. Forward only reads a kept weight.
class Turn:
    """Holds of the weights forward used last, kept into backward, within the parameter pool's bytes.

    Args:
        store: the parameter store whose weights are held.
        budget: the most bytes kept at once: the store's pool's (``offload_parameters(keep_for_backward=True)``),
            or 0 (nothing kept).
    """

    def __init__(self, store: ParamStore, *, budget: int):
        self.store = store
        self.budget = budget
        self._kept: dict[torch.Tensor, None] = {}  # the params kept, oldest first
        self.held_bytes = 0
        self.taken = 0  # holds backward took instead of fetching (reads saved), since the store was made
        self._planned: tuple = (None, {})  # (the order played, its plan)

    def _keepable(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Those of ``params`` worth keeping (their weights are read from NVMe, and backward fetches them)."""
        records = self.store.records
        return [p for p in dict.fromkeys(params) if p.requires_grad and records[p].extent is not None]

    def plan(self, order: list, params: list) -> dict:
        """Position in ``order`` (the recorded fetch events, ``(module index, kind)``) -> the weights its forward
        event keeps for backward (a dict, as a set by identity), for those that keep any; ``params[index]``: a
        module's weights. Played once per order."""
        if self._planned[0] is order:
            return self._planned[1]
        following: list = [None] * len(order)  # position -> the position of the same module's next event
        later: dict = {}
        for pos in range(len(order) - 1, -1, -1):
            following[pos] = later.get(order[pos][0])
            later[order[pos][0]] = pos
        nbytes = {p: r.nbytes for p, r in self.store.records.items()}
        kept: dict = {}  # param -> the position that kept it, oldest first
        held = 0
        useful: dict = {}  # position -> the weights kept there that a backward event took
        for pos, (index, kind) in enumerate(order):
            mine = self._keepable(params[index])
            if kind == BACKWARD:
                for p in mine:
                    if p in kept:
                        useful.setdefault(kept.pop(p), {})[p] = None
                        held -= nbytes[p]
                continue
            nxt = following[pos]
            if nxt is None or order[nxt] != (index, BACKWARD) or not 0 < sum(nbytes[p] for p in mine) <= self.budget:
                continue
            for p in mine:
                held += 0 if kept.pop(p, None) is not None else nbytes[p]
                kept[p] = pos
            while held > self.budget:
                oldest = next(iter(kept))
                held -= nbytes[oldest]
                del kept[oldest]
        self._planned = (order, useful)
        return self._planned[1]

    def replan(self) -> None:
        """The modules' weights changed (an external parameter declared): play the order again at its next use."""
        self._planned = (None, {})

    def release_or_keep(self, params: list[torch.Tensor], *, keep=()) -> None:
        """Forward is done with ``params`` (one hold each, a module's): those in ``keep`` (what the plan keeps at
        this forward event) are kept where grad is enabled and they fit the budget, the others released; the
        oldest kept are released while the kept bytes exceed the budget."""
        mine = dict.fromkeys(p for p in self._keepable(params) if p in keep) if torch.is_grad_enabled() else {}
        if sum(self.store.records[p].nbytes for p in mine) > self.budget:
            mine = {}
        released = [p for p in params if p not in mine]
        for p in mine:
            if p in self._kept:  # kept already (a module called twice, a shared weight): one hold, newest now
                del self._kept[p]
                released.append(p)
            else:
                self.held_bytes += self.store.records[p].nbytes
            self._kept[p] = None
        while self.held_bytes > self.budget:
            oldest = next(iter(self._kept))
            del self._kept[oldest]
            self.held_bytes -= self.store.records[oldest].nbytes
            released.append(oldest)
        release_each(released, self.store.release)

    def take(self, p: torch.Tensor) -> bool:
        """Backward fetches ``p``: whether a kept hold stands for that fetch (the caller then holds it)."""
        if p not in self._kept:
            return False
        del self._kept[p]
        self.held_bytes -= self.store.records[p].nbytes
        self.taken += 1
        return True

    def release_all(self) -> None:
        """Release every hold still kept."""
        kept, self._kept, self.held_bytes = list(self._kept), {}, 0
        release_each(kept, self.store.release)
