"""Passes over the optimizer's units: each unit's fate in a pass, decided in one place, and the pipeline."""

from __future__ import annotations

import enum
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

from ..buffers import BufferPool
from ..bytes import ByteStore, HostTier, TierSource
from ..errors import StateError
from ..pipeline import BufferRing, BufferSource, Pipeline
from .layout import Layout, Unit

__all__ = ["After", "Fate", "UnitMover", "UnitStream"]

# With ``keep_first`` (a step in backward's order, see :meth:`UnitMover.step`), the pool buffers left to stream
# the other units through. One: each of them is read, updated and written in turn, and every other buffer holds a
# unit for the next step. Two would let the read of the next unit overlap the update of this one, but holds a
# unit fewer: on the 64M bf16 model (4 buffers of 64 MiB, weights and state on NVMe) one is faster in every mode
# measured, interleaved (iteration 1.52 s against 1.62 s with fp32 state, 0.90 against 0.93 with int8, 0.57
# against 0.60 with int8 and no master; 26.7 bytes per parameter against 28.3 with fp32 state).
STREAMING = 1


class After(enum.Enum):
    """What becomes of a unit once a pass has updated it."""

    STAYS = "stays"  # resident in the host tier, changed where it lives: nothing is written
    EVICTED = "evicted"  # resident, but not among those to stay: written out, its buffer joins the pool
    SETTLES = "settles"  # read into a pool buffer and to stay: the buffer becomes its home, unwritten
    WRITTEN = "written"  # written back from the pool buffer, which then still holds its bytes
    UNCHANGED = "unchanged"  # the pass only read it


@dataclass(frozen=True)
class Fate:
    """A unit's fate in one pass: whether it is read and what becomes of it after its update.

    ``home``: it is resident in the host tier, so it is updated in its home buffer and never read.
    ``read``: it is read from NVMe (unless a pool buffer still holds its bytes as last written, which
    the pipeline then hands it: see :meth:`UnitMover.holds`). ``after``: see :class:`After`.
    """

    home: bool
    read: bool
    after: After


# NOTE: three passes move units, each a named operation: a step (update in snake order; units the step
# visits last stay resident in the host tier, and its last writes are left landing for the next forward
# to hide), an export (every unit read, none written) and a restore (units overwritten from a state dict,
# read first only where they also hold state that is kept). ``fates`` decides for every unit of a pass,
# before it starts, whether it is read and what becomes of it; the pipeline's read/process/write steps
# only follow those decisions. The pool's buffers double as a small cache: a buffer keeps the bytes of
# the unit last written from it until it is used for another, and a unit visited again gets it back
# without a read (``holds``). No lock: one thread uses the store at a time (the overlap worker's step,
# which every other use of the store refuses to run beside or ends first).
class UnitMover:
    """Moves units through the pool (and the host tier) in passes: :meth:`step`, :meth:`export`, :meth:`restore`.

    Args:
        bytes: the byte store (reads, writes, failures).
        pool: the pool (``None`` with ``device: "cpu"``: every unit is resident).
        tier: the host tier of resident units, or ``None``; the owner sets :attr:`tier` when it makes one later.
        layout: the layout (every unit, for the tier's room).
        lookahead, write_behind: the pipeline's.
        describe: ``describe(unit)`` names a unit in messages.
    """

    def __init__(self, bytes: ByteStore, pool: Optional[BufferPool], layout: Layout, *, lookahead: int,
                 write_behind: bool, describe: Callable[[Unit], str], tier: Optional[HostTier] = None):
        self.bytes = bytes
        self.tier = tier
        self.describe = describe
        self.pool = pool
        self.layout = layout
        # The pool's buffers in circulation, with the writes still landing from them. It outlives passes:
        # a step returns with its last writes in flight, and with a host tier buffers change hands between
        # the pool and resident units (see offload.bytes.TierSource).
        self.ring = BufferRing(list(pool), prefer=self.holds) if pool is not None else None
        self.pipeline = Pipeline(self.ring, lookahead=lookahead, write_behind=write_behind)
        self._holding: dict[int, Unit] = {}  # id(pool buffer) -> the unit whose latest bytes it holds
        # Pool buffers kept out of the ring (see step's keep_first), each holding a unit for the next step, unwritten
        # or with its write-back still landing: id(buffer) -> (buffer, write future or None).
        self._aside: dict[int, tuple[Any, Any]] = {}
        # Ids of the units held aside whose bytes there are newer than their extent's (not written back: see
        # flush); every other unit's extent holds its state, once its writes land.
        self._unwritten: set[int] = set()
        self._spare: Optional[BufferPool] = None  # see lend
        # Steps begun and ended (an asynchronous save rides on the next one), and the time between the last two.
        self.steps_started = self.steps_done = 0
        self.step_interval: Optional[float] = None
        self._step_started: Optional[float] = None
        bytes.on_failure.append(self._holding.clear)
        bytes.on_failure.append(self._unwritten.clear)

    # -- the three passes ---------------------------------------------------------------------

    def step(self, units: Sequence[Unit], *, keep_first: bool = False) -> UnitStream:
        """One step over ``units`` (in the order given), as a loop (:class:`UnitStream`).

        ::

            with store.moves.step(units) as units_in:
                for unit, buf in units_in:
                    units_in.changing(unit, buf)
                    ...  # update the unit's state in buf

        Each unit is read (unless it is resident in host memory, still in a pool buffer, or has no state yet),
        handed out in a buffer, and once the body is done with it written back, kept resident or evicted as
        :meth:`fates` decides. Every unit read is checked against the checksum of its last write. The last
        writes are left landing (they land during the next forward); a unit read later waits for its own write,
        and the store's drain (checkpoints, loads) for all of them, after :meth:`flush`.

        ``keep_first``: the next step visits ``units`` in the same order (backward's, with overlap_backward), so
        the pool buffers of the first units are set aside once updated, holding them unwritten for it (see
        :meth:`flush`), and the rest stream through :data:`STREAMING` buffers (see :meth:`kept`). Without a
        host tier only.

        Raises:
            OSError: a read or write failed (file and offset named), in this step or a write an earlier
                step left landing; the store is then failed.
            StateError: a unit's bytes on disk are not the bytes last written there.
        """
        keep = self.kept(units) if keep_first else set()
        return UnitStream(self, units, self.fates(units, step=True), drain=False, keep=keep, counts_step=True)

    def _step_begins(self) -> None:
        """A step's stream is entered: counted, and the time since the last one's start noted."""
        now = time.monotonic()
        if self._step_started is not None:
            self.step_interval = now - self._step_started
        self._step_started = now
        self.steps_started += 1

    def export(self, units: Sequence[Unit]) -> UnitStream:
        """A pass that reads ``units``, as a loop: nothing is written or frozen."""
        return UnitStream(self, units, self.fates(units, changes=False), changes=False)

    def restore(self, units: Sequence[Unit], keeps_state: Callable[[Unit], bool]) -> UnitStream:
        """A pass that overwrites ``units``, as a loop; a unit is read first only if ``keeps_state(unit)`` (it
        also holds state that is not replaced)."""
        return UnitStream(self, units, self.fates(units, exists=keeps_state))

    # -- each unit's fate ---------------------------------------------------------------------

    def fates(self, units: Sequence[Unit], *, step: bool = False, changes: bool = True,
              exists: Optional[Callable[[Unit], bool]] = None) -> dict[int, Fate]:
        """Every unit's fate in a pass, by ``id``; decided here and nowhere else.

        Read: a unit resident in the host tier is not (it is updated where it lives); nor is one without
        state yet (``exists(unit)`` False; in a step, no chunk initialized: the update fills the buffer).
        After: only a step moves units between the tiers. The units it visits last stay resident, as many as
        the tier has room for beside resident units it does not visit; a resident unit not among them is
        evicted, and a unit read into a pool buffer that is among them settles in that buffer. Every other
        unit is written back if the pass changes it.
        """
        tier = self.tier
        if exists is None:
            exists = _has_state if step else _always
        stay = self._to_stay(units, tier) if step and tier is not None else set()
        out = {}
        for u in units:
            home = tier is not None and tier.resident(u)
            to_stay = id(u) in stay
            if home:
                after = After.STAYS if to_stay or not step else After.EVICTED
            elif to_stay:
                after = After.SETTLES
            else:
                after = After.WRITTEN if changes else After.UNCHANGED
            out[id(u)] = Fate(home=home, read=not home and exists(u), after=after)
        return out

    def _to_stay(self, units: Sequence[Unit], tier: HostTier) -> set:
        """Ids of the units of a step to be resident after it: as many of the last visited as ``tier`` has
        room for, besides resident units the step does not visit."""
        if tier.capacity is None:
            return {id(u) for u in units}
        visiting = {id(u) for u in units}
        elsewhere = sum(1 for u in self.layout.units if tier.resident(u) and id(u) not in visiting)
        room = max(0, tier.capacity - elsewhere)
        return {id(u) for u in list(units)[len(units) - room:]} if room else set()

    def kept(self, units: Sequence[Unit]) -> set:
        """Ids of the units of a step in a repeated order whose buffers are set aside for the next step: the
        first ones, as many as the pool has beyond :data:`STREAMING` (none with a host tier, whose resident
        units are never read anyway, or without a pool)."""
        if self.tier is not None or self.pool is None:
            return set()
        return {id(u) for u in list(units)[:max(0, len(self.pool) - STREAMING)]}

    # -- single units and the pool's buffers --------------------------------------------------

    def read(self, unit: Unit, buf):
        """Start reading ``unit`` from its extent into ``buf``, once its last write landed (checked)."""
        self.bytes.land(unit)
        return self.bytes.read(unit, buf, what=lambda: self.describe(unit))

    def write(self, unit: Unit, buf, *, landing: bool = False):
        """Start writing ``unit`` from ``buf`` to its extent, after its last write (an older write must not
        land after this one)."""
        self.bytes.land(unit)
        self.forget(unit)
        return self.bytes.write(unit, buf, landing=landing)

    def flush(self) -> None:
        """Write back every unit held aside unwritten (see step's ``keep_first``), left landing (the store's
        drain waits for them): its extent then holds its state, and it stays held for the next step."""
        for key, (buf, _) in list(self._aside.items()):
            unit = self._holding.get(key)
            if unit is not None and id(unit) in self._unwritten:
                self._aside[key] = (buf, self._write_back(unit, buf))

    def _write_back(self, unit: Unit, buf):
        """Write ``unit``, held unwritten in ``buf``, left landing; the buffer still holds it. Returns the future."""
        self._unwritten.discard(id(unit))
        fut = self.write(unit, buf, landing=True)
        self._holding[id(buf)] = unit
        return fut

    def written_back(self, unit: Unit) -> bool:
        """Whether ``unit``'s extent is to hold its latest state once its writes land (False while the pool holds
        it unwritten: see :meth:`flush`)."""
        return id(unit) not in self._unwritten

    def check_written(self, unit: Unit) -> None:
        """Refuse to read ``unit`` from its extent while the pool holds its latest state unwritten."""
        if not self.written_back(unit):
            raise StateError(f"{self.describe(unit)} is held in a pool buffer, newer than its extent: drain the "
                             "store before reading units one at a time (a bug)")

    def holds(self, unit: Unit, buf) -> bool:
        """Whether pool buffer ``buf`` holds ``unit``'s state: the buffer ``unit`` was last written from (or set
        aside unwritten in), not used for anything since. A step that visits it first (the snake order visits
        first the units the last step wrote last) then updates it there instead of reading it back."""
        return self._holding.get(id(buf)) is unit

    def forget(self, unit: Optional[Unit] = None) -> None:
        """No pool buffer holds ``unit``'s state any more (every unit's with None)."""
        if unit is None:
            self._holding.clear()
            self._unwritten.clear()
            return
        self._unwritten.discard(id(unit))
        for key in [k for k, u in self._holding.items() if u is unit]:
            del self._holding[key]

    def _put_back(self, keep: frozenset | set = frozenset()) -> None:
        """Buffers set aside go back to the ring, but those holding a unit of ``keep`` (ids): a buffer
        whose unit is not to be kept any more (written back first if it was not), or that holds nothing now
        (forgotten), is the pool's again."""
        for key, (buf, pending) in list(self._aside.items()):
            unit = self._holding.get(key)
            if unit is None or id(unit) not in keep:
                if unit is not None and id(unit) in self._unwritten:
                    pending = self._write_back(unit, buf)
                del self._aside[key]
                assert self.ring is not None, "only pool buffers are set aside"
                self.ring.give(buf, pending)

    def lend(self) -> list:
        """Buffers for a caller that fills them with whatever it likes (a checkpoint): every pool buffer, or
        with ``device: "cpu"`` (no pool) two of a unit's size, made once for the purpose."""
        self._put_back()  # units held aside unwritten are written back first
        self.bytes.drain()
        self.forget()
        if self.ring is not None:
            return self.ring.buffers()
        if self._spare is None:
            self._spare = BufferPool(2, self.layout.unit_bytes)
            # Freed with the mover, not at close(): a save still streaming through them may outlive it.
            weakref.finalize(self, self._spare.close)
        return list(self._spare)


# NOTE: a pass is a loop over the units, each handed out in a buffer as its fate decided (read, or a resident unit's
# home, or the pool buffer that still holds it), with the pipeline's reads ahead and writes behind. The caller's
# body changes the buffer; going on to the next unit writes it, keeps it unwritten, settles it in the tier or
# evicts it, as decided. Only the body knows when a unit starts to change (a step first waits for its grads):
# it says so with changing(), which lets an asynchronous save copy the unit first, and tells an error after it
# (the buffer may be half changed: not the unit's bytes any more) from one before (the buffer is as it was).
class UnitStream:
    """One pass of a :class:`UnitMover` over units, as a loop in a ``with`` block.

    ::

        with mover.step(units) as units_in:
            for unit, buf in units_in:
                units_in.changing(unit, buf)
                ...  # update buf

    Raises:
        OSError: a read or write failed (file and offset named), in this pass or a write an earlier pass left
            landing; the store is then failed.
        StateError: a unit's bytes on disk are not the bytes last written there.
    """

    def __init__(self, mover: UnitMover, units: Sequence[Unit], fates: dict, *, changes: bool = True,
                 drain: bool = True, keep: frozenset | set = frozenset(), counts_step: bool = False):
        self.mover = mover
        # A step's: counted (UnitMover.steps_started) once entered, and its end (steps_done) however it ends.
        self.counts_step = counts_step
        self.units = units
        self.fates = fates
        self.changes = changes
        self.drain = drain
        self.keep = keep
        self.tiered: Optional[TierSource] = None  # the source over the pool and the tier, where there is a tier
        self.stream: Any = None
        self.current: Optional[tuple] = None  # (unit, buffer) in the body now
        self.changed = False  # whether the current unit's buffer may have changed

    def __enter__(self) -> UnitStream:
        if self.counts_step:
            self.mover._step_begins()
        try:
            return self._start()
        except BaseException:
            self._ended()
            raise

    def _ended(self) -> None:
        if self.counts_step:
            self.counts_step = False
            self.mover.steps_done += 1

    def _start(self) -> UnitStream:
        mover, store, tier = self.mover, self.mover.bytes, self.mover.tier
        store.collect_landed()
        # Units kept in host memory (resident, or still in a pool buffer) are written without being read
        # first: a write past a cut in a truncated file would leave holes that read back as zeros.
        store.check_intact()
        mover._put_back(self.keep)
        source: Optional[BufferSource] = mover.ring
        if self.keep:
            source = _Aside(mover, self.keep)
        if tier is not None:
            settling = {i for i, f in self.fates.items() if f.after is After.SETTLES}
            source = self.tiered = TierSource(mover.ring, len(mover.pool) if mover.pool is not None else 0, tier,
                                              settling)
        self.stream = mover.pipeline.stream(self.units, read=self._read, write=self._write, source=source,
                                            drain=self.drain).__enter__()
        return self

    def __iter__(self) -> Iterator[tuple[Unit, Any]]:
        if self.stream is None:
            raise RuntimeError("iterate a pass over units inside its with block (it ends the pass's I/O)")
        for unit, buf in self.stream:
            self.current, self.changed = (unit, buf), False
            yield unit, buf
            self._done()

    def changing(self, unit: Unit, buf) -> None:
        """The body is about to change ``unit``'s bytes in ``buf``: every freeze guard sees them first. A pass
        that changes units must say so for each (an export changes none)."""
        if not self.changes:
            raise RuntimeError("an export pass changes no unit")
        self.changed = True
        self.mover.bytes.changing(unit, buf)

    def written(self, unit: Unit) -> bool:
        """Whether ``unit`` is written once the body is done with it."""
        return self.fates[id(unit)].after in (After.EVICTED, After.WRITTEN) and id(unit) not in self.keep

    def _done(self) -> None:
        """The body is done with the current unit: its fate is carried out (the stream then writes it or not)."""
        if self.current is None:
            return
        (unit, buf), self.current = self.current, None
        if self.changes and not self.changed:
            raise RuntimeError("a pass that changes units went past one without changing() (a bug)")
        if not self._after(unit, buf):
            self.stream.skip_write()

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self._finish(exc_type, exc, tb)
        finally:
            self._ended()

    def _finish(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            try:
                self._done()  # the loop was left by a break: the unit in it still meets its fate
            except BaseException as err:
                self.stream.__exit__(type(err), err, err.__traceback__)
                raise
        elif self.current is not None and self.changed:
            unit, buf = self.current
            self.mover._holding.pop(id(buf), None)  # the buffer may be changed part-way
            if id(unit) in self.mover._unwritten:
                # Its only current copy was that buffer: the extent is steps older. The state is lost.
                self.mover._unwritten.discard(id(unit))
                self.mover.bytes.mark_failed(exc if isinstance(exc, Exception) else StateError(
                    f"a step stopped part-way through a unit held in memory for it ({exc!r})"))
        self.stream.__exit__(exc_type, exc, tb)
        if exc_type is None:
            self.mover.bytes.check_intact()  # a cut made during the pass (units read there may have been zeros)

    def _read(self, unit: Unit, buf):
        fate, mover = self.fates[id(unit)], self.mover
        if fate.home:
            return None
        if mover.holds(unit, buf):
            mover.bytes.land(unit)  # its bytes are in the buffer: no read, once its write has landed
            return None
        mover._holding.pop(id(buf), None)
        return mover.read(unit, buf) if fate.read else None

    def _after(self, unit: Unit, buf) -> bool:
        """The body is done with ``unit``: settle it, or hold it unwritten; whether it is written."""
        fate, mover, tier = self.fates[id(unit)], self.mover, self.mover.tier
        if fate.after is After.SETTLES:
            assert tier is not None and self.tiered is not None, "a unit settles only in a tier"
            mover._holding.pop(id(buf), None)
            tier.keep(unit, buf)
            self.tiered.settled()
        if id(unit) in self.keep and fate.after is After.WRITTEN:
            mover._holding[id(buf)] = unit  # set aside unwritten: the next step updates it there
            mover._unwritten.add(id(unit))
        return self.written(unit)

    def _write(self, unit: Unit, buf):
        mover, tier = self.mover, self.mover.tier
        if self.fates[id(unit)].after is After.EVICTED:
            assert tier is not None and self.tiered is not None, "only a tier's units are evicted"
            tier.leave(unit)
            self.tiered.evicted()
        fut = mover.write(unit, buf, landing=not self.drain)
        mover._holding[id(buf)] = unit
        return fut


# NOTE: the pool doubles as a cache (holds): a buffer keeps the bytes of the unit last written from it until it is
# used for another. A step after backward visits units in snake order, so the units it writes last are the next
# one's first, and the whole pool hits. A step inside backward (overlap_backward) follows backward's order, the
# same every iteration: the units it writes first are the next one's first, and every later unit would reuse
# their buffers. So those buffers are set aside once updated, out of the ring, holding their units for the next
# step, which takes each back at its unit's turn and updates it there; the other units stream through the rest.
# A unit set aside is not written back: the next step would only overwrite it (that saves its write as well as
# its read). Whatever reads the swap space first drains the store (a checkpoint, state_dict(), a load; see
# flush), which writes such units back and keeps them held. A buffer set aside whose unit the next step does not
# keep goes back to the ring when a pass starts, written back first; one whose hold was forgotten (a failure, a
# load), as it is; and every one of them when the pool is lent.
class _Aside:
    """The source of a step that sets buffers aside (a :class:`offload.pipeline.BufferSource` over the ring).

    Args:
        mover: the mover, whose ring, holds and buffers set aside this works on.
        keep: ids of the units whose buffers are set aside once updated (unwritten).
    """

    def __init__(self, mover: UnitMover, keep: frozenset | set):
        assert mover.ring is not None, "only pool buffers are set aside"
        self.mover = mover
        self.ring = mover.ring
        self.keep = keep

    def lends(self, item: Any) -> bool:
        """Every unit takes a buffer of the pool (one set aside for it, or the ring's)."""
        return True

    def take(self, wait: bool, item: Any = None) -> Any:
        """The buffer set aside holding ``item`` (once a write-back from it has landed), else one of the ring's."""
        for key, (buf, pending) in list(self.mover._aside.items()):
            if self.mover.holds(item, buf):
                del self.mover._aside[key]
                self.ring.give(buf, pending)  # the ring's take prefers it, and waits for its write
                return self.ring.take(wait, item)
        return self.ring.take(wait, item)

    def give(self, buf: Any, pending: Any = None) -> None:
        """Set ``buf`` aside if it holds a unit to keep (just updated in it), else give it to the ring."""
        unit = self.mover._holding.get(id(buf))
        if unit is not None and id(unit) in self.keep:
            self.mover._aside[id(buf)] = (buf, pending)
        else:
            self.ring.give(buf, pending)


def _has_state(unit: Unit) -> bool:
    """Whether any chunk of ``unit`` has state yet (else a step's update fills the buffer from nothing)."""
    return any(c.slot.initialized for c in unit.chunks)


def _always(unit: Unit) -> bool:
    return True
