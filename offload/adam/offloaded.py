"""The offloaded part of a step: one loop over the units of a StateStore, the update in its body."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .. import copies
from ..copies import DONE, Ticket
from ..params import ParamAccess
from ..state import ParamSlot, StateStore
from .update import NO_SCALING, GradScaling, Math, update_chunks
from .weights import WeightWatch

__all__ = ["OffloadedStep"]


# NOTE: the overlap worker runs this with nothing but what it holds, never the optimizer itself: dropped without
# close() or step() (after an interrupted backward), the optimizer is collected, and that ends the step in
# progress, so the worker does not wait for ever holding the pool and swap files.
class OffloadedStep:
    """The update of an optimizer's offloaded units, and what it needs of the optimizer.

    Args:
        store: the owner of the offloaded state.
        access: the optimizer's access to weights and grads that ``offload_parameters`` holds.
        state: the optimizer's ``state`` (``{param: {"step": ...}}``), whose steps are counted here.
        weights: the optimizer's watch over weights replaced under a master.
        groups: the optimizer's ``param_groups``.
        math: the formula, and the rounding stream of weights without a master.

    Attributes:
        scaling: what this step does to the grads it reads, asked at each unit's update after its gate (with
            overlap_backward and clipping, step() sets it once the norms are known).
    """

    def __init__(self, store: StateStore, access: ParamAccess, state: dict, weights: WeightWatch, groups: list,
                 math: Math):
        self.store, self.access, self.state, self.weights, self.groups = store, access, state, weights, groups
        self.math = math
        self.scaling: GradScaling = NO_SCALING

    def run(self, slots: list[ParamSlot], gate: Optional[Callable] = None, order: Optional[list] = None) -> set:
        """Update the units of ``slots`` (in ``order``, else the store's snake order); ``gate(unit)`` runs
        before each update (overlap_backward: until its grads are final). A chunk is updated when its slot
        is one of ``slots`` and its parameter has a grad then. Returns the slots updated. An ``order`` given is
        backward's, which the next step follows again: the pool holds its first units for it."""
        store = self.store
        units = order if order is not None else store.step_order(store.units_of(slots))
        updates = _UnitUpdates(self.state, slots, lambda: self.scaling, self.math)
        try:
            # The step's last writes land while the caller goes on (the next forward); reading a unit back, a
            # checkpoint, state_dict() or close() waits for them.
            with self.access.units(units, updates.candidates) as unit_pass, \
                    store.moves.step(units, keep_first=order is not None) as units_in:
                updates.unit_pass = unit_pass
                for unit, buf in units_in:
                    if gate is not None:
                        gate(unit)  # overlap_backward: until the unit's grads are final
                    units_in.changing(unit, buf)  # an asynchronous checkpoint copies the unit first
                    updates.update(unit, buf)
                    if units_in.written(unit):
                        updates.before_write(unit)  # its state back from the device before its write
        finally:
            # Units resident in host memory are never written: their copies back must land before the step
            # ends (and after a failure, before anyone reuses their buffers).
            copies.waited(updates.copying.values())
        _count_steps(self.state, updates.updated)
        return updates.updated

    def slots_now(self) -> list[ParamSlot]:
        """The slots a step may update now: placed parameters that require grad."""
        self.weights.check()  # before backward starts any update
        return [self.store.slot(p) for g in self.groups for p in g["params"]
                if p.requires_grad and self.store.slot(p) is not None]

    def hyperparameters(self) -> list:
        """The groups' hyperparameters now (for the update inside backward: those it ran with)."""
        return [{k: float(v) if torch.is_tensor(v) else v for k, v in g.items() if k not in ("params", "param_names")}
                for g in self.groups]


class _UnitUpdates:
    """The update of each unit of one pass, and what it leaves: the slots updated, the copies of their
    state back into the units' buffers."""

    def __init__(self, state: dict, slots: list[ParamSlot], scaling: Callable[[], GradScaling], math: Math):
        self.state = state
        self.math = math
        self.candidates = {id(s) for s in slots}
        self.scaling = scaling
        self.unit_pass = None  # the ParamAccess pass over the units, set once it starts
        self.copying: dict[int, Ticket] = {}  # id(unit) -> the copies of its updated state back into its buffer
        self.updated: set = set()

    def update(self, unit, buf) -> None:
        """Update ``unit``, swapped in to ``buf`` (the body of the step's loop)."""
        chunks = self._chunks_to_update(unit)
        grads = self.unit_pass.grads(unit)
        # With an fp32 master copy the old weights are not read: the update rewrites all of them.
        self.unit_pass.fetch(unit, {c.slot for c in chunks}, skip_read=lambda slot: slot.has_master)
        by_group = self._start(chunks)
        read, landed = self._run_kernels(by_group, buf, grads)
        self.copying[id(unit)] = landed
        self.unit_pass.done(unit, read)

    def before_write(self, unit) -> None:
        """The state copied back from the device must be in the buffer before it is written."""
        self.copying.pop(id(unit), DONE).wait()

    def _chunks_to_update(self, unit) -> list:
        # What this update changes: the chunks whose parameter has a grad now. Only their weights are fetched
        # (and written back); a parameter unused in this iteration keeps its weights on NVMe untouched
        # (fetched without a read, as a master allows, they would go back as garbage).
        return [c for c in unit.chunks if id(c.slot) in self.candidates and c.slot.param.grad is not None]

    def _start(self, chunks: list) -> dict[int, list]:
        """``chunks`` by group, each slot counted as updated and given its state entry."""
        by_group: dict[int, list] = {}
        for c in chunks:
            by_group.setdefault(id(c.slot.group), []).append(c)
            self.updated.add(c.slot)
            # A state entry only for a parameter that is updated (a parameter without a grad gets none, as
            # in torch); made once, not a tensor per chunk per step.
            st = self.state[c.slot.param]
            if "step" not in st:
                st["step"] = torch.tensor(0.0, dtype=torch.float32)
        return by_group

    def _run_kernels(self, by_group: dict[int, list], buf, grads) -> tuple[Ticket, Ticket]:
        """torch's Adam over each group's chunks; returns the tickets of the reads of ``buf`` and of the
        state landed back in it."""
        read = landed = DONE
        try:
            for chunks in by_group.values():
                r, w = update_chunks(chunks, buf, grads, state=self.state, scaling=self.scaling(), math=self.math)
                read, landed = read | r, landed | w
        except BaseException:
            # The pipeline hands the buffer back at once: no copy of an earlier group may be in flight.
            copies.waited([read, landed])
            raise
        return read, landed


def _count_steps(state: dict, updated: set) -> None:
    """Each updated slot holds state now, and its parameter's step is counted."""
    for s in updated:
        s.initialized = True
        state[s.param]["step"] += 1
