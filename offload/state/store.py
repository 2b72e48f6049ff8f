"""The one owner of an optimizer's offloaded state: its layout, swap space, pool, pipeline and failures."""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch
import xxhash

from ..aio import FutureGroup
from ..buffers import BufferPool
from ..config import Config
from ..errors import StateError
from ..pipeline import Pipeline
from ..space import SwapSpace
from .layout import Chunk, Layout, ParamSlot, Unit

__all__ = ["StateStore"]


# NOTE: an optimizer keeps torch's bookkeeping (param_groups, ``state`` with every parameter's step,
# the whole state of small parameters) and the math; everything about where offloaded state lives is
# here, behind this interface, which the optimizer and the checkpoint package share:
#
# * the small-parameter rule: parameters with fewer than ``threshold`` elements keep their state in
#   the optimizer's ``state`` dict like torch's Adam (a disk round trip costs more than it saves);
# * the layout (units of one pool buffer, each one extent of the swap space), placed atomically: disk
#   for new units is reserved before anything is recorded, so a full disk leaves the store as it was;
# * the pipeline that moves units through the pool, and a checksum of every unit written, verified on
#   every read, so that bytes changed on disk behind our back are named instead of trained on;
# * the failure state: after an error part-way through a change of state (a step, a load) the store
#   refuses to be used until state is restored from a state dict or a checkpoint.
class StateStore:
    """Offloaded optimizer state: where it lives and how it moves.

    Args:
        state: the optimizer's ``state`` dict (torch's; shared, not copied).
        param_groups: the optimizer's ``param_groups`` (shared; for naming parameters in errors).
        config: the optimizer's :class:`offload.config.Config` (``offload_optimizer`` and ``aio``).
        name: a tag in the swap file names.

    Attributes:
        layout: the :class:`Layout` (``units``, ``slots``: parameter -> :class:`ParamSlot`).
        pool: the host buffers state moves through. space: the :class:`SwapSpace`.
        threshold: the small-parameter threshold. error: why the store is unusable, or ``None``.
    """

    def __init__(self, state: dict, param_groups: list, config: Config, *, name: str = "adam"):
        oc = config.offload_optimizer
        self.state = state
        self.param_groups = param_groups
        self.config = config
        self.threshold = oc.small_param_threshold
        self.error: Optional[BaseException] = None
        self.pool = BufferPool(oc.buffer_count, oc.buffer_size, pin_memory=oc.pin_memory,
                               keys=("offload_optimizer.buffer_count", "offload_optimizer.buffer_size"))
        try:
            self.space = SwapSpace(oc.nvme_path, 0, aio=config.aio, buffers=self.pool, name=name)
        except BaseException:
            self.pool.close()
            raise
        # With B buffers: one holds the unit being updated, one (or more) the writes still landing,
        # and the rest the reads ahead (B - 2 of them, at least 1).
        lookahead = max(1, len(self.pool) - 2) if oc.pipeline_read else 0
        self.pipeline = Pipeline(list(self.pool), lookahead=lookahead, write_behind=oc.pipeline_write)
        self.layout = Layout(self.pool.buffer_size)
        self._finalizer = weakref.finalize(self, _close, self.space, self.pool)

    # -- the small-parameter rule and placement ------------------------------------------------

    def is_small(self, p: torch.Tensor) -> bool:
        """Whether ``p``'s state lives in the optimizer's ``state`` dict rather than in units."""
        return p.numel() < self.threshold

    def place(self, groups: Iterable[dict], *, only: Optional[set] = None, trainable_only: bool = False) -> None:
        """Give state a place: every parameter of ``groups`` not small and not placed yet (only those in
        ``only``, if given; only those requiring grad with ``trainable_only``).

        Disk for the new units is reserved first; on failure nothing is recorded.

        Raises:
            OSError: the disk cannot hold the new state (ENOSPC, with bytes needed and free).
            ValueError: a unit cannot hold one grain of some parameter's state (buffer_size too small).
        """
        candidates = []
        for g in groups:
            for p in g["params"]:
                if self.is_small(p) or (trainable_only and not p.requires_grad):
                    continue
                if only is not None and p not in only:
                    continue
                candidates.append((p, g, bool(g["amsgrad"])))
        units = self.layout.plan(candidates)
        if not units:
            return
        extents = self.space.alloc_many([u.nbytes for u in units])
        for unit, extent in zip(units, extents):
            unit.extent = extent
        self.layout.commit(units)

    def slot(self, p: torch.Tensor) -> Optional[ParamSlot]:
        """``p``'s place in the layout, or ``None`` (small, or not placed yet)."""
        return self.layout.slots.get(p)

    def units_of(self, slots: Iterable[ParamSlot]) -> list[Unit]:
        """The units holding a chunk of any of ``slots``, in layout order."""
        wanted = {id(s) for s in slots}
        return [u for u in self.layout.units if any(id(c.slot) in wanted for c in u.chunks)]

    # -- failures -------------------------------------------------------------------------------

    def check_usable(self, doing: str = "step") -> None:
        """Raise unless state may be used for ``doing`` (e.g. ``"step"``, ``"save"``).

        Raises:
            ValueError: the store is closed.
            StateError: a change of state failed part-way; restore it first.
        """
        if not self._finalizer.alive:
            raise ValueError("the optimizer is closed")
        if self.error is not None:
            raise StateError(
                f"cannot {doing}: a previous change of the offloaded state failed part-way ({self.error}), so it "
                "may be half written. Restore it with load_state_dict() or load_checkpoint() first."
            ) from self.error

    def failed(self, err: BaseException) -> None:
        """Record that state may be half written: every use raises until :meth:`restored`."""
        self.error = err

    def restored(self) -> None:
        """State is whole again (a load succeeded)."""
        self.error = None

    # -- moving units ---------------------------------------------------------------------------

    def run(self, units: Sequence[Unit], update: Callable[[Unit, Any], bool], *,
            needs_read: Callable[[Unit], bool] = lambda unit: True,
            also_read: Optional[Callable[[Unit, Any], Any]] = None) -> None:
        """Stream ``units`` through the pool: read, ``update(unit, buffer)``, write back if it returns True.

        ``needs_read(unit)`` False skips the read (no chunk's state exists yet; ``update`` overwrites the
        buffer). ``also_read(unit, buffer)`` may start more reads that the update needs (a future or
        None); they are issued with the unit's and waited for before ``update``. Every unit read is
        checked against the checksum of its last write.

        Raises:
            OSError: a read or write failed (file and offset named).
            StateError: a unit's bytes on disk are not the bytes last written there.
        """
        space = self.space

        def read(unit: Unit, buf):
            fut = space.read(unit.extent, buf, nbytes=unit.nbytes) if needs_read(unit) else None
            more = also_read(unit, buf) if also_read is not None else None
            if more is None:
                return fut
            return FutureGroup([f for f in (fut, more) if f is not None])

        def process(unit: Unit, buf) -> bool:
            if needs_read(unit):
                self._verify(unit, buf)
            if not update(unit, buf):
                return False
            unit.digest = _digest(buf, unit.nbytes)
            return True

        def write(unit: Unit, buf):
            return space.write(unit.extent, buf, nbytes=unit.nbytes)

        self.pipeline.run(units, read=read, process=process, write=write)

    def read_state(self) -> Iterator[tuple[ParamSlot, dict]]:
        """Every initialized slot's state read back: ``(slot, {key: CPU tensor shaped like the parameter})``.

        Needs host memory for the whole state.
        """
        wanted = [s for s in self.layout.slots.values() if s.initialized]
        out = {s: {k: torch.empty(s.param.shape, dtype=s.dtype) for k in s.keys} for s in wanted}

        def copy_out(unit: Unit, buf) -> bool:
            for c in unit.chunks:
                if c.slot in out:
                    for k in c.slot.keys:
                        out[c.slot][k].view(-1)[c.start:c.start + c.numel].copy_(c.slice(buf, k))
            return False

        self.run(self.units_of(wanted), copy_out)
        for s in wanted:
            yield s, out[s]

    def write_state(self, by_slot: dict, *, master_from: Callable[[Chunk], torch.Tensor],
                    after_unit: Callable[[Unit], None] = lambda unit: None) -> None:
        """Write state given per slot as ``{key: tensor shaped like the parameter}``; missing moments are
        zeros, a missing ``"master"`` is seeded from ``master_from(chunk)`` (the chunk's flat weights);
        ``after_unit(unit)`` runs once a unit's buffer is filled (to release weights fetched for it).

        Units that also hold other initialized parameters keep their bytes. The slots are initialized
        after. On failure the store is marked failed.
        """
        if not by_slot:
            return
        units = self.units_of(by_slot)

        def copy_in(unit: Unit, buf) -> bool:
            for c in unit.chunks:
                entry = by_slot.get(c.slot)
                if entry is None:
                    continue
                for k in c.slot.keys:
                    view = c.slice(buf, k)
                    src = entry.get(k)
                    if src is not None:
                        view.copy_(src.detach().reshape(-1)[c.start:c.start + c.numel])
                    elif k == "master":
                        view.copy_(master_from(c))
                    else:
                        view.zero_()
            after_unit(unit)
            return True

        try:
            self.run(units, copy_in, needs_read=lambda u: any(
                c.slot.initialized and c.slot not in by_slot for c in u.chunks))
        except BaseException as err:
            self.failed(err)
            raise
        for slot in by_slot:
            slot.initialized = True

    def read_unit(self, unit: Unit, buf):
        """Start reading ``unit`` into ``buf`` (a pool buffer); the caller checks it with :meth:`verify`."""
        return self.space.read(unit.extent, buf, nbytes=unit.nbytes)

    def write_unit(self, unit: Unit, buf):
        """Start writing ``buf``'s first ``unit.nbytes`` bytes as ``unit``'s state (its checksum recorded)."""
        unit.digest = _digest(buf, unit.nbytes)
        return self.space.write(unit.extent, buf, nbytes=unit.nbytes)

    def verify(self, unit: Unit, buf) -> None:
        """Check ``buf`` (``unit`` just read into it) against the checksum of the unit's last write.

        Raises:
            StateError: the bytes differ (the store is marked failed).
        """
        self._verify(unit, buf)

    # -- introspection and lifetime -------------------------------------------------------------

    @property
    def buffers(self) -> list:
        """The pool's buffers, for callers that stream units themselves (checkpoints)."""
        return list(self.pool)

    @property
    def state_bytes(self) -> int:
        """Bytes of state in units."""
        return self.layout.state_bytes

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Remove the swap files and free the pool."""
        self._finalizer()

    def _verify(self, unit: Unit, buf) -> None:
        if unit.digest is None:
            return
        found = _digest(buf, unit.nbytes)
        if found != unit.digest:
            err = StateError(self._corruption(unit, found))
            self.failed(err)
            raise err

    def _corruption(self, unit: Unit, found: int) -> str:
        index = self.layout.units.index(unit)
        position = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        names = ", ".join(f"parameter {position.get(id(c.slot.param), '?')} (shape {tuple(c.slot.param.shape)})"
                          for c in unit.chunks)
        where = self.space.locate(unit.extent) if hasattr(self.space, "locate") else \
            f"{self.space.files[0]} at logical offset {unit.extent.offset}"
        return (f"offloaded optimizer state was changed on disk behind our back: unit {index} ({unit.nbytes} "
                f"bytes, {where}) holding the state of {names} has xxh3_64 {found:016x}, its last write had "
                f"{unit.digest:016x}. Training on it would be silently wrong; restore the state with "
                "load_checkpoint() (or load_state_dict()) before stepping again.")


def _digest(buf, nbytes: int) -> int:
    return xxhash.xxh3_64_intdigest(buf.tensor[:nbytes].numpy())




def _close(space: SwapSpace, pool: BufferPool) -> None:
    try:
        space.close()
    finally:
        pool.close()
