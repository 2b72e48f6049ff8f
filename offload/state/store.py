"""The one owner of an optimizer's offloaded state: its layout, tiers, pool, pipeline and failures."""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import psutil
import torch

from ..buffers import BufferPool
from ..bytes import ByteStore, HostTier, auto_cache_bytes
from ..config import Config
from ..distributed import local
from ..errors import ConfigError, StateError
from ..sizes import MIB, format_size, round_up
from ..space import SwapSpace
from .codec import chunk_values, exported_keys, set_chunk_values
from .layout import Chunk, Layout, ParamSlot, Unit
from .moves import UnitMover

__all__ = ["StateStore", "pool_buffer_size"]


def pool_buffer_size(oc, candidates: list) -> int:
    """The optimizer's pool buffer (one unit of state) for ``candidates`` ``(param, group, amsgrad)`` under the
    ``offload_optimizer`` settings ``oc``: ``buffer_size``, or when it is the default and the state is smaller
    than the pool, about state / ``buffer_count`` (whole MiB): a small model gets a small pool."""
    if oc.buffer_size != type(oc)().buffer_size:
        return oc.buffer_size
    state = sum(u.nbytes for u in Layout(oc.buffer_size, oc.state_dtype, master=oc.master_weights).plan(candidates))
    if state >= oc.buffer_count * oc.buffer_size:
        return oc.buffer_size
    return min(oc.buffer_size, max(MIB, round_up(-(-state // oc.buffer_count), MIB)))


# NOTE: an optimizer keeps torch's bookkeeping (param_groups, ``state`` with every parameter's step,
# the whole state of small parameters) and the math; everything about where offloaded state lives is
# here, behind this interface, which the optimizer and the checkpoint package share:
#
# * the small-parameter rule: parameters with fewer than ``threshold`` elements keep their state in
#   the optimizer's ``state`` dict like torch's Adam (a disk round trip costs more than it saves);
# * the layout (units of one pool buffer, each one extent of the swap space), placed atomically: disk
#   for new units is reserved before anything is recorded, so a full disk leaves the store as it was;
# * the tiers: a unit lives on NVMe, or resident in host memory (``host_cache``; every unit with
#   ``device: "cpu"``, where there is no swap space at all). A step visits units in snake order, so
#   the units it updates last stay resident and are the first the next step updates;
# * the pipeline that moves units through the pool.
# The bytes themselves (checked reads, the landing of writes, the failed state, the swap files' cuts,
# freezes for consistent copies) belong to a ByteStore (``bytes``), as the offloaded weights' do.
class StateStore:
    """Offloaded optimizer state: where it lives and how it moves.

    Args:
        state: the optimizer's ``state`` dict (torch's; shared, not copied).
        param_groups: the optimizer's ``param_groups`` (shared; for naming parameters in errors).
        config: the optimizer's :class:`offload.config.Config` (``offload_optimizer`` and ``aio``).
        name: a tag in the swap file names.

    Attributes:
        layout: the :class:`Layout` (``units``, ``slots``: parameter -> :class:`ParamSlot`).
        pool: the host buffers state moves through (``None`` with ``device: "cpu"``).
        space: the :class:`SwapSpace` (``None`` with ``device: "cpu"``).
        tier: the :class:`HostTier` of resident units, or ``None`` without one.
        threshold: the small-parameter threshold.
        bytes: the :class:`offload.bytes.ByteStore` the units' bytes move through (failed state, checksums).
        moves: the :class:`UnitMover` that moves units in passes; a step is ``with store.moves.step(units) as
            units_in: for unit, buf in units_in: ...`` (:meth:`UnitMover.step`).
    """

    def __init__(self, state: dict, param_groups: list, config: Config, *, name: str = "adam"):
        oc = config.offload_optimizer
        self.state = state
        self.param_groups = param_groups
        self.config = config
        self.threshold = oc.small_param_threshold
        self.in_memory = oc.device == "cpu"
        self.pin_memory = resolve_pin(oc.pin_memory, (p for g in param_groups for p in g["params"]))
        self.pool: Optional[BufferPool] = None
        self.space: Optional[SwapSpace] = None
        self.tier: Optional[HostTier] = None
        self._reverse = False  # the next step's visiting order
        size = self._pool_buffer_size(oc)
        try:
            if self.in_memory:
                self.tier = HostTier(None, size, pin_memory=self.pin_memory)
            else:
                self.pool = BufferPool(oc.buffer_count, size, pin_memory=self.pin_memory,
                                       keys=("offload_optimizer.buffer_count", "offload_optimizer.buffer_size"))
                assert oc.nvme_path is not None  # the configuration's rule for device "nvme"
                self.space = SwapSpace(oc.nvme_path, 0, aio=config.aio, buffers=self.pool, name=name)
        except BaseException:
            _close(self.space, self.pool, self.tier)
            raise
        unit_bytes = self.pool.buffer_size if self.pool is not None else size
        self.on_restored: list[Callable[[], None]] = []  # what an owner redoes after a load
        # Steps started and finished, and the time between the starts of the last two (an asynchronous save
        # waits about that long for a step to start and hand it the units, see offload.checkpoint.snapshot).
        self.bytes = ByteStore(self.space, unit_bytes, checksum=oc.checksum, mismatch_fails=True, remedy=(
            "Training on it would be silently wrong; restore the state with load_checkpoint() (or "
            "load_state_dict()) before stepping again."))
        # With B buffers: one holds the unit being updated, one (or more) the writes still landing,
        # and the rest the reads ahead (B - 2 of them, at least 1).
        lookahead = max(1, oc.buffer_count - 1) if oc.pipeline_read else 0
        self.layout = Layout(unit_bytes, oc.state_dtype, master=oc.master_weights)
        self.moves = UnitMover(self.bytes, self.pool, self.layout, lookahead=lookahead,
                               write_behind=oc.pipeline_write, describe=self._describe, tier=self.tier)
        self._finalizer = weakref.finalize(self, _close, self.space, self.pool, self.tier)

    def _pool_buffer_size(self, oc) -> int:
        return pool_buffer_size(oc, self._candidates(self.param_groups, trainable_only=True))

    def _candidates(self, groups: Iterable[dict], *, only: Optional[set] = None,
                    trainable_only: bool = False) -> list:
        out = []
        for g in groups:
            for p in g["params"]:
                if self.is_small(p) or (trainable_only and not p.requires_grad):
                    continue
                if only is not None and p not in only:
                    continue
                out.append((p, g, bool(g["amsgrad"])))
        return out

    def place_late(self, groups: Iterable[dict], params: Iterable[torch.Tensor]) -> None:
        """:meth:`place` those of ``params`` that have no place yet (parameters frozen when the optimizer was
        built that now have grads or state); nothing to do, and no pass over ``groups``, when all have one."""
        late = {p for p in params if self.slot(p) is None}
        if late:
            self.place(groups, only=late)

    def size_cache(self) -> None:
        """Make the host tier ``host_cache`` asks for (after the first placement: "auto" needs the state size)."""
        oc = self.config.offload_optimizer
        if self.in_memory or self.tier is not None:
            return
        budget = oc.host_cache
        if isinstance(budget, str):  # "auto"
            # What the tier would hold for all of the state: a buffer of the pool's size per unit.
            assert self.pool is not None  # on NVMe there is a pool
            budget = auto_cache_bytes(pools=self.pool.nbytes, state=len(self.layout.units) * self.layout.unit_bytes)
        count = budget // self.layout.unit_bytes
        if count > 0:
            self.tier = self.moves.tier = HostTier(count, self.layout.unit_bytes, pin_memory=self.pin_memory)
            self._finalizer.detach()
            self._finalizer = weakref.finalize(self, _close, self.space, self.pool, self.tier)

    # -- the small-parameter rule and placement ------------------------------------------------

    def is_small(self, p: torch.Tensor) -> bool:
        """Whether ``p``'s state lives in the optimizer's ``state`` dict rather than in units (for a DTensor,
        by the size of this rank's shard)."""
        return local(p).numel() < self.threshold

    def place(self, groups: Iterable[dict], *, only: Optional[set] = None, trainable_only: bool = False) -> None:
        """Give state a place: every parameter of ``groups`` not small and not placed yet (only those in
        ``only``, if given; only those requiring grad with ``trainable_only``).

        Disk (or, with ``device: "cpu"``, host memory) for the new units is reserved first; on failure
        nothing is recorded.

        Raises:
            OSError: the disk cannot hold the new state (ENOSPC, with bytes needed and free).
            ConfigError: ``device: "cpu"`` and host memory cannot hold the new state.
            ValueError: a unit cannot hold one grain of some parameter's state (buffer_size too small).
        """
        units = self.layout.plan(self._candidates(groups, only=only, trainable_only=trainable_only))
        if not units:
            return
        if self.in_memory:
            need = len(units) * self.layout.unit_bytes
            available = psutil.virtual_memory().available
            if need > available:
                raise ConfigError(
                    f'offload_optimizer.device is "cpu": the state needs {format_size(need)} of host memory and '
                    f'{format_size(available)} is available; set device to "nvme" (with a host_cache) instead')
            assert self.tier is not None  # made with the store for device "cpu"
            for unit in units:
                self.tier.settle_in(unit)
        else:
            assert self.space is not None  # made with the store for device "nvme"
            for unit, extent in zip(units, self.space.alloc_many([u.nbytes for u in units])):
                unit.extent = extent
        self.layout.commit(units)

    def slot(self, p: torch.Tensor) -> Optional[ParamSlot]:
        """``p``'s place in the layout, or ``None`` (small, or not placed yet)."""
        return self.layout.slots.get(p)

    def units_of(self, slots: Iterable[ParamSlot]) -> list[Unit]:
        """The units holding a chunk of any of ``slots``, in layout order."""
        wanted = {id(s) for s in slots}
        return [u for u in self.layout.units if any(id(c.slot) in wanted for c in u.chunks)]

    def step_order(self, units: Sequence[Unit]) -> list[Unit]:
        """``units`` in the order the next step visits them: forward and backward in turn (snake order),
        so the units updated last, still resident, are updated first next time."""
        order = list(reversed(units)) if self._reverse else list(units)
        self._reverse = not self._reverse
        return order

    # -- failures -------------------------------------------------------------------------------

    @property
    def error(self) -> Optional[BaseException]:
        """Why the store is unusable, or ``None``."""
        return self.bytes.error

    def check_usable(self, doing: str = "step") -> None:
        """Raise unless state may be used for ``doing`` (e.g. ``"step"``, ``"save a checkpoint"``).

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

    def mark_failed(self, err: BaseException) -> None:
        """Record that state may be half written: every use raises until :meth:`mark_restored`."""
        self.bytes.mark_failed(err)

    def mark_restored(self) -> None:
        """State is whole again (a load succeeded); each of :attr:`on_restored` is called."""
        self.bytes.mark_restored()
        for call in self.on_restored:
            call()

    failed = mark_failed  # the name offload.checkpoint uses
    restored = mark_restored

    @property
    def bytes_read(self) -> int:
        """Bytes of state read from the swap space so far."""
        return self.bytes.bytes_read

    @property
    def bytes_written(self) -> int:
        """Bytes of state written to the swap space so far."""
        return self.bytes.bytes_written

    # -- moving units ---------------------------------------------------------------------------

    def read_state(self) -> Iterator[tuple[ParamSlot, dict]]:
        """Every initialized slot's state read back: ``(slot, {key: CPU tensor shaped like the parameter})``,
        moments in fp32 (torch's layout) whatever ``state_dtype`` keeps them in (8-bit codes dequantized). For
        a DTensor parameter the tensors are shaped like its local shard (what this rank stores).

        Needs host memory for the whole state.
        """
        wanted = [s for s in self.layout.slots.values() if s.initialized]
        out = {s: {k: torch.empty(local(s.param).shape, dtype=_export_dtype(s, k)) for k in exported_keys(s)}
               for s in wanted}

        with self.moves.export(self.units_of(wanted)) as units_in:
            for unit, buf in units_in:
                for c in unit.chunks:
                    if c.slot in out:
                        for k, t in out[c.slot].items():
                            t.view(-1)[c.start:c.start + c.numel].copy_(chunk_values(c, buf, k))
        for s in wanted:
            yield s, out[s]

    def write_state(self, by_slot: dict, *, master_from: Callable[[Chunk], torch.Tensor],
                    after_unit: Callable[[Unit], None] = lambda unit: None) -> None:
        """Write state given per slot as ``{key: tensor shaped like the parameter}`` (torch's layout: 8-bit
        moments are encoded, a dequantized state getting its codes back); missing moments are zeros, a missing
        ``"master"`` is seeded from ``master_from(chunk)`` (the chunk's flat weights); ``after_unit(unit)``
        runs once a unit's buffer is filled (to release weights fetched for it).

        Units that also hold other initialized parameters keep their bytes. The slots are initialized
        after. On failure the store is marked failed.
        """
        if not by_slot:
            return
        self.drain(quiet=True)  # what a step left landing is overwritten now: its errors no longer matter
        units = self.units_of(by_slot)
        needs_read = lambda u: any(c.slot.initialized and c.slot not in by_slot for c in u.chunks)  # noqa: E731
        if not any(needs_read(u) for u in self.layout.units):
            self.rewriting_all()

        with self.bytes.failing_on(BaseException), self.moves.restore(units, keeps_state=needs_read) as units_in:
            for unit, buf in units_in:
                units_in.changing(unit, buf)
                _fill(unit, buf, by_slot, master_from)
                after_unit(unit)
        for slot in by_slot:
            slot.initialized = True

    def rewriting_all(self) -> None:
        """Say that every unit holding state is about to be overwritten (a whole load): a swap file cut
        behind our back gets its size back, since nothing will be read from the cut."""
        self.bytes.regrow()

    def freeze(self, guard: Callable[[Unit, Any], None]) -> Callable[[], None]:
        """Call ``guard(unit, buffer)`` before any run changes a unit's state, with ``buffer`` holding the
        unit's bytes as they are then (read from NVMe, or its host-memory home): see
        :meth:`offload.bytes.ByteStore.freeze`. Returns the function that removes the guard. ``write_unit``
        (a load) is not guarded: it replaces state wholesale, and must not run while a copy is being taken.
        """
        return self.bytes.freeze(guard)

    add_change_guard = freeze  # the name offload.checkpoint uses

    # -- units one at a time (checkpoints) ------------------------------------------------------

    def read_unit(self, unit: Unit, buf):
        """Start reading ``unit`` into ``buf`` (a pool-sized buffer), from whichever tier holds it; returns a
        future, or None when it was copied from host memory. Waiting for the future checks the bytes
        against the checksum of the unit's last write (``StateError`` if they differ)."""
        home = self.tier.home(unit) if self.tier is not None else None
        if home is not None:
            buf.tensor[:unit.nbytes].copy_(home.tensor[:unit.nbytes])
            return None
        self.moves.check_written(unit)
        return self.moves.read(unit, buf)

    def write_unit(self, unit: Unit, buf):
        """Make ``buf``'s first ``unit.nbytes`` bytes ``unit``'s state: copied into its host-memory home if it
        is resident (returns None), else written to its extent (returns the future; checksum recorded)."""
        self.moves.forget(unit)
        home = self.tier.home(unit) if self.tier is not None else None
        if home is not None:
            home.tensor[:unit.nbytes].copy_(buf.tensor[:unit.nbytes])
            return None
        return self.moves.write(unit, buf)

    def landed_digest(self, unit: Unit) -> Optional[tuple[int, int, int]]:
        """What the store knows of ``unit``'s bytes on its extent without reading them: ``(xxh3_64, piece
        size, length)``, the engine's checksum (:class:`offload.aio.PieceDigest` with that piece size) of the
        first ``length`` bytes of the extent, the unit's bytes and zeros to the alignment, as its last write
        put them there. None where that is not known in this one form: checksums off, no write yet (or
        forgotten), a write still landing, a unit resident in host memory (its extent may be older), or
        one striped over several swap files (a checksum per file), a unit the pool holds unwritten (see
        :meth:`drain`). Call with no step running."""
        if self.space is None or unit.extent is None or (self.tier is not None and self.tier.resident(unit)) or \
                not self.moves.written_back(unit):
            return None
        digest = self.bytes.landed_digest(unit)
        length = round_up(unit.nbytes, self.space.alignment)
        if digest is None or len(digest) != 1 or len(self.space.file_ranges(unit.extent, length)) != 1:
            return None
        return digest[0], self.config.aio.block_size, length

    # -- introspection and lifetime -------------------------------------------------------------

    def lend_buffers(self) -> list:
        """Buffers a caller may stream units through itself (checkpoints): the pool's, after every write a
        step left landing has landed and the units the pool held are put back, or with ``device: "cpu"`` a few
        of the tier's size made for the purpose. No step may run while the caller uses them."""
        if self.pool is not None:
            self.drain()
        return self.moves.lend()

    @property
    def state_bytes(self) -> int:
        """Bytes of state in units."""
        return self.layout.state_bytes

    @property
    def resident_bytes(self) -> int:
        """Bytes of unit state resident in host memory now."""
        if self.tier is None:
            return 0
        return sum(u.nbytes for u in self.layout.units if self.tier.resident(u))

    @property
    def host_bytes(self) -> int:
        """Host memory held for offloaded state: the pool and the host tier's buffers."""
        return (self.pool.nbytes if self.pool is not None else 0) + (self.tier.nbytes if self.tier else 0)

    @property
    def closed(self) -> bool:
        """Whether the store is closed (its pool, tier and swap space let go)."""
        return not self._finalizer.alive

    def drain(self, *, quiet: bool = False) -> None:
        """Write back what the pool holds unwritten, then wait for every write a step left landing.

        Args:
            quiet: ignore their errors (state is about to be overwritten: a load).

        Raises:
            OSError: one of them failed (file and offset named); the store is then failed.
        """
        if self.bytes.usable:
            self.moves.flush()  # units the pool holds for the next step, not written back yet
        self.bytes.drain(quiet=quiet)
        if quiet:
            self.moves.forget()  # the state is about to be replaced
            for unit in self.layout.units:
                unit.writes = []

    def close(self) -> None:
        """Let the last writes land, then remove the swap files and free the pool and the host tier."""
        if self._finalizer.alive:
            self.bytes.close()
        self._finalizer()

    def _describe(self, unit: Unit) -> str:
        """``unit`` in words, for a message."""
        index = self.layout.units.index(unit)
        position = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        names = ", ".join(f"parameter {position.get(id(c.slot.param), '?')} (shape {tuple(c.slot.param.shape)})"
                          for c in unit.chunks)
        return f"offloaded optimizer state, unit {index} holding the state of {names}"


def resolve_pin(setting, params: Iterable[torch.Tensor]) -> bool:
    """``pin_memory`` as set, or for ``"auto"`` whether any of ``params`` is on a GPU."""
    if setting == "auto":
        return any(p.device.type == "cuda" for p in params)
    return bool(setting)


def _fill(unit: Unit, buf, by_slot: dict, master_from: Callable[[Chunk], torch.Tensor]) -> None:
    """Copy the state ``by_slot`` gives (torch's layout) into ``unit``'s chunks in ``buf`` (see write_state)."""
    for c in unit.chunks:
        entry = by_slot.get(c.slot)
        if entry is None:
            continue
        for k in exported_keys(c.slot):
            src = entry.get(k)
            if src is not None:
                set_chunk_values(c, buf, k, src.detach().reshape(-1)[c.start:c.start + c.numel])
            elif k == "master":
                set_chunk_values(c, buf, k, master_from(c))
            else:
                set_chunk_values(c, buf, k, None)


def _export_dtype(slot: ParamSlot, key: str) -> torch.dtype:
    """Moments kept in bf16 or 8 bits (``state_dtype``) are exported in fp32, torch's layout."""
    dtype = slot.dtype_of(key)
    return torch.float32 if dtype in (torch.bfloat16, torch.uint8) and key != "master" else dtype


def _close(space: Optional[SwapSpace], pool: Optional[BufferPool], tier: Optional[HostTier]) -> None:
    try:
        if space is not None:
            space.close()
    finally:
        if tier is not None:
            tier.close()
        if pool is not None:
            pool.close()
