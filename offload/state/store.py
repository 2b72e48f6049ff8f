"""The one owner of an optimizer's offloaded state: its layout, tiers, pool, pipeline and failures."""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import psutil
import torch

from ..aio import CheckedRead, FutureGroup, hex_digest, wait_quietly
from ..buffers import BufferPool
from ..config import Config
from ..distributed import local
from ..errors import ConfigError, StateError
from ..pipeline import BufferRing, Pipeline
from ..space import SwapSpace
from ..units import MIB, format_size, round_up
from .layout import Chunk, Layout, ParamSlot, Unit
from .tiers import HostTier, TierSource, auto_cache_bytes

__all__ = ["StateStore"]


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
        pool: the host buffers state moves through (``None`` with ``device: "cpu"``).
        space: the :class:`SwapSpace` (``None`` with ``device: "cpu"``).
        tier: the :class:`HostTier` of resident units, or ``None`` without one.
        threshold: the small-parameter threshold. error: why the store is unusable, or ``None``.
    """

    def __init__(self, state: dict, param_groups: list, config: Config, *, name: str = "adam"):
        oc = config.offload_optimizer
        self.state = state
        self.param_groups = param_groups
        self.config = config
        self.threshold = oc.small_param_threshold
        self.checksum = oc.checksum
        self.error: Optional[BaseException] = None
        self.in_memory = oc.device == "cpu"
        self.pin_memory = resolve_pin(oc.pin_memory, (p for g in param_groups for p in g["params"]))
        self.pool = self.space = self.tier = None
        self._reverse = False  # the next step's visiting order
        size = self._pool_buffer_size(oc)
        try:
            if self.in_memory:
                self.tier = HostTier(None, size, pin_memory=self.pin_memory)
            else:
                self.pool = BufferPool(oc.buffer_count, size, pin_memory=self.pin_memory,
                                       keys=("offload_optimizer.buffer_count", "offload_optimizer.buffer_size"))
                self.space = SwapSpace(oc.nvme_path, 0, aio=config.aio, buffers=self.pool, name=name)
        except BaseException:
            _close(self.space, self.pool, self.tier)
            raise
        unit_bytes = self.pool.buffer_size if self.pool is not None else size
        # The pool's buffers in circulation, with the writes still landing from them. It outlives runs:
        # a step returns with its last writes in flight (they land during the next forward), and with a
        # host tier buffers change hands between the pool and resident units (see tiers.TierSource).
        self._ring = BufferRing(list(self.pool), prefer=self._holds) if self.pool is not None else None
        # id(pool buffer) -> the unit whose state it holds as last written from it (see _holds). Like the
        # ring, no lock: one thread uses the store at a time (the overlap worker's step, which every other
        # use of the store refuses to run beside or ends first).
        self._holding: dict[int, Unit] = {}
        self._tail: list = []  # writes a run left landing (futures), until they are seen to have landed
        self.bytes_read = self.bytes_written = 0
        self._guards: list[Callable[[Unit, Any], None]] = []  # see add_change_guard
        # With B buffers: one holds the unit being updated, one (or more) the writes still landing,
        # and the rest the reads ahead (B - 2 of them, at least 1).
        lookahead = max(1, oc.buffer_count - 1) if oc.pipeline_read else 0
        self.pipeline = Pipeline(self._ring, lookahead=lookahead, write_behind=oc.pipeline_write)
        self.layout = Layout(unit_bytes, oc.state_dtype)
        self._finalizer = weakref.finalize(self, _close, self.space, self.pool, self.tier)

    def _pool_buffer_size(self, oc) -> int:
        """``buffer_size``, or when it is the default and the state the optimizer starts with is smaller
        than the pool, about state / ``buffer_count`` (whole MiB): a small model gets a small pool."""
        default = type(oc).__dataclass_fields__["buffer_size"].default
        if oc.buffer_size != default:
            return oc.buffer_size
        state = self.layout_bytes(self._candidates(self.param_groups, trainable_only=True), oc.buffer_size,
                                  oc.state_dtype)
        if state >= oc.buffer_count * oc.buffer_size:
            return oc.buffer_size
        return min(oc.buffer_size, max(MIB, round_up(-(-state // oc.buffer_count), MIB)))

    @staticmethod
    def layout_bytes(candidates: list, unit_bytes: int, state_dtype: str) -> int:
        """Bytes of state ``candidates`` ``(param, group, amsgrad)`` would take in units of ``unit_bytes``."""
        return sum(u.nbytes for u in Layout(unit_bytes, state_dtype).plan(candidates))

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

    def size_cache(self) -> None:
        """Make the host tier ``host_cache`` asks for (after the first placement: "auto" needs the state size)."""
        oc = self.config.offload_optimizer
        if self.in_memory or self.tier is not None:
            return
        budget = oc.host_cache
        if budget == "auto":
            # What the tier would hold for all of the state: a buffer of the pool's size per unit.
            budget = auto_cache_bytes(pools=self.pool.nbytes, state=len(self.layout.units) * self.layout.unit_bytes)
        count = budget // self.layout.unit_bytes
        if count > 0:
            self.tier = HostTier(count, self.layout.unit_bytes, pin_memory=self.pin_memory)
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
            for unit in units:
                self.tier.settle_in(unit)
        else:
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

    def failed(self, err: BaseException) -> None:
        """Record that state may be half written: every use raises until :meth:`restored`."""
        self.error = err
        self._holding.clear()

    def restored(self) -> None:
        """State is whole again (a load succeeded)."""
        self.error = None

    # -- moving units ---------------------------------------------------------------------------

    def run(self, units: Sequence[Unit], update: Callable[[Unit, Any], bool], *,
            needs_read: Callable[[Unit], bool] = lambda unit: True,
            also_read: Optional[Callable[[Unit, Any], Any]] = None,
            before_write: Optional[Callable[[Unit], None]] = None, settle: bool = False,
            drain: bool = True, changes: bool = True) -> None:
        """Stream ``units`` through the pool: read, ``update(unit, buffer)``, write back if it returns True.

        A unit resident in the host tier is updated where it lives (no read, no write). ``needs_read(unit)``
        False skips the read (no chunk's state exists yet; ``update`` overwrites the buffer).
        ``also_read(unit, buffer)`` may start more reads the update needs (a future or None); they are
        waited for with the unit's. ``before_write(unit)`` runs before a unit's write is issued (to wait
        for device copies into its buffer). ``settle=True`` (a step) moves units between the tiers: the
        last ones visited stay resident, resident ones not among them are written out. ``drain=False``
        returns with the last writes still landing (a step: they land during the next forward); a unit
        read later waits for its own write, and :meth:`drain` (checkpoints, ``state_dict``, ``close``)
        for all of them. Every unit read is checked against the checksum of its last write. ``changes``
        False says ``update`` only reads the units (no change guard is called).

        Raises:
            OSError: a read or write failed (file and offset named), in this run or a write an earlier
                run left landing; the store is then failed.
            StateError: a unit's bytes on disk are not the bytes last written there.
        """
        self._collect_tail()
        # Units kept in host memory (resident, or still in a pool buffer) are written without being read
        # first: a write past a cut in a truncated file would leave holes that read back as zeros.
        self._check_intact()
        tier = self.tier
        source = self._ring
        if tier is not None:
            source = TierSource(self._ring, len(self.pool) if self.pool is not None else 0, tier,
                                self._settle_set(units) if settle else set())

        def resident(unit: Unit, buf) -> bool:
            return tier is not None and tier.home(unit) is buf

        def read(unit: Unit, buf):
            if resident(unit, buf):
                fut = None
            elif self._holds(unit, buf):
                self._land(unit)  # its bytes are in the buffer: no read, once its write has landed
                fut = None
            else:
                self._holding.pop(id(buf), None)
                fut = self._read(unit, buf) if needs_read(unit) else None
            more = also_read(unit, buf) if also_read is not None else None
            if more is None:
                return fut
            return FutureGroup([f for f in (fut, more) if f is not None])

        def process(unit: Unit, buf) -> bool:
            at_home = resident(unit, buf)
            for guard in list(self._guards) if changes else ():
                guard(unit, buf)
            try:
                changed = update(unit, buf)
            except BaseException:
                self._holding.pop(id(buf), None)  # the update may have changed the buffer part-way
                raise
            if at_home:
                write = settle and id(unit) not in source.settle  # evicted: the disk copy is stale
            elif tier is not None and id(unit) in source.settling:
                self._holding.pop(id(buf), None)
                tier.keep(unit, buf)  # it stays resident, unwritten, in the buffer it was read into
                source.settled()
                write = False
            else:
                write = changed
            return write

        def write(unit: Unit, buf):
            if before_write is not None:
                before_write(unit)
            if resident(unit, buf):
                tier.leave(unit)
                source.evicted()
            fut = self._write(unit, buf)
            self._forget(unit)
            self._holding[id(buf)] = unit
            if not drain:
                self._tail.append(fut)
            return fut

        self.pipeline.run(units, read=read, process=process, write=write, source=source, drain=drain)
        self._check_intact()  # a cut made while this run went on (the units read there may have been zeros)

    def read_state(self) -> Iterator[tuple[ParamSlot, dict]]:
        """Every initialized slot's state read back: ``(slot, {key: CPU tensor shaped like the parameter})``,
        moments in fp32 (torch's layout) whatever ``state_dtype`` keeps them in. For a DTensor parameter the
        tensors are shaped like its local shard (what this rank stores).

        Needs host memory for the whole state.
        """
        wanted = [s for s in self.layout.slots.values() if s.initialized]
        out = {s: {k: torch.empty(local(s.param).shape, dtype=_export_dtype(s, k)) for k in s.keys} for s in wanted}

        def copy_out(unit: Unit, buf) -> bool:
            for c in unit.chunks:
                if c.slot in out:
                    for k in c.slot.keys:
                        out[c.slot][k].view(-1)[c.start:c.start + c.numel].copy_(c.slice(buf, k))
            return False

        self.run(self.units_of(wanted), copy_out, changes=False)
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
        self.drain(quiet=True)  # what a step left landing is overwritten now: its errors no longer matter
        units = self.units_of(by_slot)
        needs_read = lambda u: any(c.slot.initialized and c.slot not in by_slot for c in u.chunks)  # noqa: E731
        if not any(needs_read(u) for u in self.layout.units):
            self.rewriting_all()

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

        with self._failing_on(BaseException):
            self.run(units, copy_in, needs_read=needs_read)
        for slot in by_slot:
            slot.initialized = True

    def rewriting_all(self) -> None:
        """Say that every unit holding state is about to be overwritten (a whole load): a swap file cut
        behind our back gets its size back, since nothing will be read from the cut."""
        if self.space is not None:
            self.space.regrow()

    def add_change_guard(self, guard: Callable[[Unit, Any], None]) -> Callable[[], None]:
        """Call ``guard(unit, buffer)`` before any run changes a unit's state, with ``buffer`` holding the
        unit's bytes as they are then (read from NVMe, or its host-memory home). For a consistent copy
        taken while training goes on (an asynchronous checkpoint): the guard captures the unit first if
        it has not yet. Returns the function that removes the guard. ``write_unit`` (a load) is not
        guarded: it replaces state wholesale, and must not run while a copy is being taken.
        """
        self._guards.append(guard)
        return lambda: self._guards.remove(guard) if guard in self._guards else None

    # -- units one at a time (checkpoints) ------------------------------------------------------

    def read_unit(self, unit: Unit, buf):
        """Start reading ``unit`` into ``buf`` (a pool-sized buffer), from whichever tier holds it; returns a
        future, or None when it was copied from host memory. Waiting for the future checks the bytes
        against the checksum of the unit's last write (``StateError`` if they differ)."""
        home = self.tier.home(unit) if self.tier is not None else None
        if home is not None:
            buf.tensor[:unit.nbytes].copy_(home.tensor[:unit.nbytes])
            return None
        return self._read(unit, buf)

    def write_unit(self, unit: Unit, buf):
        """Make ``buf``'s first ``unit.nbytes`` bytes ``unit``'s state: copied into its host-memory home if it
        is resident (returns None), else written to its extent (returns the future; checksum recorded)."""
        self._forget(unit)
        home = self.tier.home(unit) if self.tier is not None else None
        if home is not None:
            home.tensor[:unit.nbytes].copy_(buf.tensor[:unit.nbytes])
            return None
        return self._write(unit, buf)

    # -- introspection and lifetime -------------------------------------------------------------

    @property
    def buffers(self) -> list:
        """Buffers a caller may stream units through itself (checkpoints): the pool's, or with ``device:
        "cpu"`` a few of the tier's size made for the purpose."""
        if self.pool is not None:
            self.drain()
            self._holding.clear()  # the caller fills them with whatever it likes
            return self._ring.buffers()
        if not hasattr(self, "_spare"):
            self._spare = BufferPool(2, self.layout.unit_bytes)
            weakref.finalize(self, self._spare.close)
        return list(self._spare)

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
        return not self._finalizer.alive

    def drain(self, *, quiet: bool = False) -> None:
        """Wait for every write a step left landing.

        Args:
            quiet: ignore their errors (state is about to be overwritten: a load).

        Raises:
            OSError: one of them failed (file and offset named); the store is then failed.
        """
        tail, self._tail = self._tail, []
        first = None
        for fut in tail:
            try:
                fut.wait()
            except OSError as err:
                first = first or err
        if quiet:
            self._holding.clear()  # the state is about to be replaced
            for unit in self.layout.units:
                unit.written = None
        elif first is not None:
            self.failed(first)
            raise first

    def close(self) -> None:
        """Let the last writes land, then remove the swap files and free the pool and the host tier."""
        if self._finalizer.alive:
            wait_quietly(self._tail)
            self._tail = []
        self._finalizer()

    def _settle_set(self, units: Sequence[Unit]) -> set:
        """Ids of the units of this run to be resident after it: as many of the last visited as the tier
        has room for, besides resident units this run does not visit."""
        tier = self.tier
        if tier.capacity is None:
            return {id(u) for u in units}
        visiting = {id(u) for u in units}
        elsewhere = sum(1 for u in self.layout.units if tier.resident(u) and id(u) not in visiting)
        room = max(0, tier.capacity - elsewhere)
        return {id(u) for u in list(units)[len(units) - room:]} if room else set()

    @contextlib.contextmanager
    def _failing_on(self, *errors: type):
        """The store is failed (see :meth:`failed`) when the block raises one of ``errors``, then re-raised."""
        try:
            yield
        except errors as err:
            self.failed(err)
            raise

    def _check_intact(self) -> None:
        """Raise (and fail the store) if a swap file was truncated behind our back."""
        if self.space is not None:
            with self._failing_on(OSError):
                self.space.check_intact()

    def _holds(self, unit: Unit, buf) -> bool:
        """Whether pool buffer ``buf`` holds ``unit``'s state: the buffer ``unit`` was last written from, not
        used for anything since. A step that visits it first (the snake order visits first the units the last
        step wrote last) then updates it there instead of reading it back: the pool's buffers act as a small
        cache, at no cost in memory."""
        return self._holding.get(id(buf)) is unit

    def _forget(self, unit: Unit) -> None:
        """No pool buffer holds ``unit``'s state any more (it is being written from elsewhere)."""
        for key in [k for k, u in self._holding.items() if u is unit]:
            del self._holding[key]

    def _write(self, unit: Unit, buf):
        self._land(unit)  # requests complete in any order: an older write must not land after this one
        fut = self.space.write(unit.extent, buf, nbytes=unit.nbytes, digest=self.checksum)
        self.bytes_written += unit.extent.nbytes
        unit.written = fut
        # The checksum of what the write puts on disk, known once it lands (computed by the engine).
        unit.digest = fut if self.checksum else None
        return fut

    def _read(self, unit: Unit, buf):
        self._land(unit)  # a write a step left landing must be there before its bytes are read back
        fut = self.space.read(unit.extent, buf, nbytes=unit.nbytes, digest=self.checksum)
        self.bytes_read += unit.extent.nbytes
        if not (self.checksum and unit.digest is not None):
            return fut
        return CheckedRead(fut, lambda: self._last_digest(unit), lambda found, want: self._corrupt(unit, found))

    def _land(self, unit: Unit) -> None:
        """Wait for ``unit``'s last write; if it failed, the store is failed and the error raised here."""
        if unit.written is None:
            return
        with self._failing_on(OSError):
            unit.written.wait()
        unit.written = None

    def _collect_tail(self) -> None:
        """Forget tail writes that landed; the first that failed fails the store and is raised now."""
        still, first = [], None
        for fut in self._tail:
            if not fut.done():
                still.append(fut)
                continue
            try:
                fut.wait()
            except OSError as err:
                first = first or err
        self._tail = still
        if first is not None:
            self.failed(first)
            raise first

    @staticmethod
    def _last_digest(unit: Unit) -> tuple:
        if not isinstance(unit.digest, tuple):
            unit.digest = unit.digest.digest()  # the write landed long ago
        return unit.digest

    def _corrupt(self, unit: Unit, found: tuple) -> StateError:
        """The error of a read of ``unit`` whose bytes are not those of its last write; the store is failed."""
        index = self.layout.units.index(unit)
        position = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        names = ", ".join(f"parameter {position.get(id(c.slot.param), '?')} (shape {tuple(c.slot.param.shape)})"
                          for c in unit.chunks)
        path, offset = self.space.locate(unit.extent.offset)
        err = StateError(
            f"offloaded optimizer state was changed on disk behind our back: unit {index} ({unit.nbytes} bytes at "
            f"offset {offset} of {path}) holding the state of {names} has xxh3_64 {hex_digest(found)}, its last "
            f"write had {hex_digest(unit.digest)}. Training on it would be silently wrong; restore the state with "
            "load_checkpoint() (or load_state_dict()) before stepping again.")
        self.failed(err)
        return err


def resolve_pin(setting, params: Iterable[torch.Tensor]) -> bool:
    """``pin_memory`` as set, or for ``"auto"`` whether any of ``params`` is on a GPU."""
    if setting == "auto":
        return any(p.device.type == "cuda" for p in params)
    return bool(setting)


def _export_dtype(slot: ParamSlot, key: str) -> torch.dtype:
    """Moments kept in bf16 (``state_dtype: "bf16"``) are exported in fp32, torch's layout."""
    dtype = slot.dtype_of(key)
    return torch.float32 if dtype == torch.bfloat16 and key != "master" else dtype


def _close(space: Optional[SwapSpace], pool: Optional[BufferPool], tier: Optional[HostTier]) -> None:
    try:
        if space is not None:
            space.close()
    finally:
        if tier is not None:
            tier.close()
        if pool is not None:
            pool.close()
