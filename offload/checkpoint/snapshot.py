"""What a save takes at the call: the optimizer's plan, and state.bin as the units were then (the clone,
the change guard that copies a unit before a step changes it, and the walk that writes and checks the rest)."""

from __future__ import annotations

import copy
import errno as _errno
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import xxhash

from ..aio import hex_digest, wait_quietly
from ..buffers import BufferPool
from ..config import AioConfig
from ..errors import CheckpointError
from ..pipeline import BufferRing
from ..sizes import format_size
from ..state.plans import StateItems, save_plan
from .commit import Staged
from .format import DATA, EXTRA, MEMORY, dtype_name, io_error, write_file
from .manifest import LocalPart, Manifest, ParamEntry, Unit
from .stream import DataFile, stream


@dataclass
class Plan:
    """What a save takes from the optimizer at the call (copies: training may go on): the units with
    state, the manifest's parameter entries, the param groups in torch's layout, small parameters'
    state and offloaded parameters' steps (by index)."""

    units: StateItems
    entries: list
    groups: list
    memory_state: dict
    steps: dict
    index: dict  # id(param) -> its index in the groups (what names the state in a model's section)


def cpu_state(state: dict) -> dict:
    """A parameter's in-memory state copied to the CPU, as memory.pt holds it."""
    return {k: (v.detach().to("cpu", copy=True) if torch.is_tensor(v) else v) for k, v in state.items()}


def torch_groups(param_groups: list[dict], index: dict) -> list[dict]:
    """param_groups as torch's state_dict writes them: params as indices, the rest copied."""
    return [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[p] for p in g["params"]]}
            for g in param_groups]


def plan(opt) -> Plan:
    """Everything of the optimizer a save needs besides the units' bytes, copied now."""
    store = opt.state_store
    params = [p for g in opt.param_groups for p in g["params"]]
    index = {p: i for i, p in enumerate(params)}
    units, saved = save_plan(store, params)
    entries = []
    memory_state, steps = {}, {}
    for i, p in enumerate(params):
        st = opt.state.get(p, {})
        part = LocalPart.of(p)  # a DTensor's state is its local shard's: where that lies in the whole
        if i in saved:
            step = None
            if saved[i].initialized:
                steps[i] = st["step"].detach().to("cpu", copy=True)
                step = float(steps[i])
            entries.append(ParamEntry.offloaded(i, p.shape, p.dtype, saved[i], step=step, local=part))
        elif store.slot(p) is None and len(st) > 0:
            memory_state[i] = cpu_state(st)
            entries.append(ParamEntry(i, "memory", True, tuple(p.shape), dtype_name(p.dtype), p.numel(),
                                      tuple(sorted(k for k in st if k != "step")), dtype_name(p.dtype),
                                      step=float(memory_state[i].get("step", 0.0)), local=part))
        else:
            entries.append(ParamEntry(i, "none", False, tuple(p.shape), dtype_name(p.dtype), p.numel(), local=part))
    groups = copy.deepcopy(torch_groups(opt.param_groups, index))  # hyperparameters may change in place
    return Plan(units, entries, groups, memory_state, steps, {id(p): i for p, i in index.items()})


# -- state.bin: the units as they were at the call ------------------------------------------------

_PENDING, _READING, _CAPTURING, _IN_FILE = range(4)
_REAP_S = 0.5  # how long a wait for a capture goes before it looks whether the capturing call still runs


# How long an asynchronous save waits for a step to start and hand it the units: RIDE_STEPS step intervals,
# within [RIDE_MIN_S, RIDE_MAX_S]; RIDE_FIRST_S when the store has not timed two steps yet. Once a step has
# started, the save waits for it to end, however long it takes.
RIDE_MIN_S = 2.0
RIDE_MAX_S = 30.0
RIDE_FIRST_S = 10.0
RIDE_STEPS = 2.0


# NOTE: state.bin holds every unit as it was at the call while training goes on (docs/checkpoint.md, "Saves
# that do not stop training", says how; this is the mechanism). Each unit is pending, being read from the store
# by the save's thread (reading), being copied by the change guard from a step's own buffer (capturing), or in
# file (cloned at the call, or written by the guard). The walk goes through the units in file order so that
# every checksum is computed in order; a unit the guard wrote keeps the checksum of the bytes it wrote, a clone
# the store's, and neither is read back (state.bin then has no checksum of its own). While riding, the walk
# waits for the next step to capture pending units on disk instead of reading them itself. A blocking save is
# the same walk with no guard, through the optimizer's own pool.
class StateCopy:
    """state.bin of one save: offsets, what each unit's bytes are doing, the clone, the walk and the guard."""

    def __init__(self, items: StateItems, staged: Staged, aio: AioConfig):
        self.items = items
        n = len(items.nbytes)
        self.data = DataFile(staged, aio, DATA, items.nbytes)
        self.offsets, self.lengths, self.total = self.data.offsets, self.data.lengths, self.data.total
        self.state = [_PENDING] * n
        self.reads: list = [None] * n  # the save's read of a unit from the store (the guard waits for it)
        self.written: list = [None] * n  # the guard's write of a unit
        self.issued = [threading.Event() for _ in range(n)]  # reads[i] is set, or the unit is in file
        self.digests = [""] * n
        # Per unit, the piece size of a checksum taken from the store at the clone (the engine's, of the
        # bytes the clone shared); None: the walk hashes the unit as it passes.
        self.pieces: list = [None] * n
        self.on_disk = sum(1 for i in range(n) if items.on_disk(i))
        self.cloned = self.cloned_bytes = 0
        self.why_not: Optional[str] = None
        self.mu = threading.Condition()
        self.failure: Optional[BaseException] = None
        # Per unit being captured, the guard call capturing it: (its thread's id, a token of that call).
        self.capturing: dict = {}
        self.closed = False
        self.riding = False  # the walk waits for the steps to capture pending units (asynchronous saves)
        self.rides: list = [False] * n  # per unit, whether the walk waits for it (its bytes are on disk)
        self._ride_from = (0, 0)  # the store's steps_started and steps_done at the call
        self._ride_until = 0.0
        self._remove_guard: Optional[Callable[[], None]] = None
        self.spares: Optional[BufferPool] = None
        self.spares_ready = threading.Event()
        self.ring: Optional[BufferRing] = None
        self.path, self.engine, self.file = self.data.path, self.data.engine, self.data.file

    def reserve(self) -> None:
        """Allocate state.bin's space for the units that were not cloned (a full disk is reported now,
        before any data moves)."""
        self.data.reserve([(self.offsets[i], self.offsets[i] + self.lengths[i])
                           for i in range(len(self.lengths)) if self.state[i] != _IN_FILE])

    # -- the clone -----------------------------------------------------------------------------------

    def clone(self) -> None:
        """Clone every unit that lies on the swap files into state.bin (metadata only), where the file
        system can; the rest is copied later. The swap files must have no write in flight."""
        need = sum(n for i, n in enumerate(self.lengths) if not self.items.in_host(i))
        pad = os.open(self.path, os.O_WRONLY | os.O_CLOEXEC)  # buffered: padding is not block-sized

        def cloned(i: int, known) -> None:
            if not self.cloned:
                self._check_room(need)
            nbytes = self.items.nbytes[i]
            if known is not None:
                # The store zeroes a unit's padding as it writes it, so the clone is what a copy
                # writes; the checksum is of the bytes shared, padding included.
                self.digests[i], self.pieces[i] = hex_digest(known[0]), known[1]
            elif self.lengths[i] > nbytes:
                os.pwrite(pad, bytes(self.lengths[i] - nbytes), self.offsets[i] + nbytes)  # as a copy pads: zeros
            self.state[i] = _IN_FILE
            self.issued[i].set()
            self.cloned += 1
            self.cloned_bytes += self.lengths[i]

        try:
            self.why_not = self.items.clone_into(self.file.fd, self.path, self.offsets, self.lengths, cloned)
        except OSError as err:
            raise io_error(err, self.path, "cannot clone the state into") from err
        finally:
            os.close(pad)

    def _check_room(self, need: int) -> None:
        """A clone shares blocks until training overwrites them; each overwrite then needs new space. As a
        streamed save's fallocate would, refuse now (undoing the first clone) if that space is not free."""
        st = os.statvfs(self.path)
        if st.f_bavail * st.f_frsize < need:
            os.ftruncate(self.file.fd, 0)
            raise OSError(_errno.ENOSPC, f"a clone of {format_size(need)} of state needs as much free space for "
                          f"training to overwrite it ({format_size(st.f_bavail * st.f_frsize)} free)", self.path)

    def summary(self, *, asynchronous: bool) -> dict:
        """The manifest's ``snapshot`` entry: how state.bin was made."""
        cloned = self.cloned_bytes
        method = "clone" if cloned and cloned == self.total else "clone+stream" if cloned else "stream"
        return {"method": method, "cloned_bytes": cloned, "streamed_bytes": self.total - cloned,
                "asynchronous": asynchronous}

    # -- the guard -----------------------------------------------------------------------------------

    def guard_on(self) -> None:
        """Copy units before any step changes them, until the walk is over, and let the walk wait for the
        steps to hand them over (asynchronous saves); nothing to do when every unit was cloned."""
        if all(s == _IN_FILE for s in self.state):
            self.spares_ready.set()
            return
        self._remove_guard = self.items.guard(self._guard)
        self._ride()

    def _ride(self) -> None:
        """Let the walk wait for the steps to capture the units (see the note above :class:`StateCopy`)."""
        # Only units read from disk are worth waiting for: one in host memory is copied either way, and
        # better by the save's thread than by the step.
        rides = [s == _PENDING and self.items.on_disk(i) for i, s in enumerate(self.state)]
        if not any(rides):
            return
        started, done, interval = self.items.steps()
        wait = RIDE_FIRST_S if interval is None else min(RIDE_MAX_S, max(RIDE_MIN_S, RIDE_STEPS * interval))
        with self.mu:
            self.rides = rides
            self.riding = True
            self._ride_from = (started, done)
            self._ride_until = time.monotonic() + wait

    def hurry(self) -> None:
        """Somebody waits for the save: the walk reads what the steps have not captured, now."""
        with self.mu:
            self.riding = False
            self.mu.notify_all()

    def _await_capture(self, i: int) -> None:
        """Under ``mu``: wait while riding for the guard to take unit ``i``."""
        main = threading.main_thread()
        while (self.riding and self.rides[i] and self.state[i] == _PENDING and self.failure is None
               and not self.closed):
            started, done = self._ride_from
            now_started, now_done, _ = self.items.steps()
            if (now_done > done or not main.is_alive()
                    or (now_started == started and time.monotonic() > self._ride_until)):
                self.riding = False
                return
            self.mu.wait(0.05)

    def make_spares(self) -> None:
        """The guard's two spare buffers, made by the save's thread (zeroing them is not the caller's time);
        a guard call before then waits for them."""
        try:
            if self._remove_guard is not None and self.spares is None:
                self.spares = BufferPool(2, self.items.unit_bytes)
                self.ring = BufferRing(list(self.spares))
        finally:
            self.spares_ready.set()

    # NOTE: a guard call that marks a unit as being captured must complete it (its bytes in the file, or the save
    # failed) whatever happens, or the walk, a step waiting for that unit and close() would wait for ever. Signals
    # are held off during a step (offload.interrupts), but any exception can still cut the call between two
    # lines, its clean-up included. So the unit records which call captures it, in one statement, and whoever
    # waits for a capture looks, when the wait grows long, whether that call is still running (its thread's
    # frames, sys._current_frames): a capture whose call is gone is ended as a failure of the save.
    def _guard(self, unit, buf) -> None:
        i = self.items.index(unit)
        if i is None:
            return  # no state at the call: not in this checkpoint
        token = object()
        try:
            with self.mu:
                was = self.state[i]
                if was == _PENDING and not self.closed and self.failure is None:
                    self.state[i], self.capturing[i] = _CAPTURING, (threading.get_ident(), token)
                    self.mu.notify_all()  # a walk waiting for this unit stops waiting
            if was == _READING:
                self._wait_issued(i)
                # The save's read of this unit has its bytes: the step may go on.
                wait_quietly([f for f in (self.reads[i],) if f is not None])
                return
            if self.capturing.get(i, (None, None))[1] is token:
                self._capture(i, unit, buf)
        except BaseException as err:  # the save fails, training goes on
            failure = err
            if not isinstance(err, Exception):  # a KeyboardInterrupt (or exit) in the step: the step's too
                failure = CheckpointError(f"the save was interrupted ({type(err).__name__}) in the step that was "
                                          "handing it the state")
                failure.__cause__ = err
            self._fail(failure)
            if failure is not err:
                raise
        finally:
            self._captured(i, token)

    def _captured(self, i: int, token) -> None:
        """The capture of unit ``i`` by the guard call of ``token`` is over (a no-op if that call captures
        nothing)."""
        with self.mu:
            if self.capturing.get(i, (None, None))[1] is token:
                self._end_capture(i, "interrupted")

    def _end_capture(self, i: int, how: str) -> None:
        """Under ``mu``: the capture of unit ``i`` is over; a unit not in the file by then fails the save."""
        if self.state[i] != _IN_FILE:
            self.failure = self.failure or CheckpointError(
                f"the save did not get unit {i} from the step that was capturing it (the step was {how})")
        self.issued[i].set()
        del self.capturing[i]  # last: until here a reaper that finds the call gone ends the capture itself
        self.mu.notify_all()

    def _fail(self, failure: BaseException) -> None:
        with self.mu:
            self.failure = self.failure or failure
            self.mu.notify_all()

    def _reap(self) -> None:
        """Under ``mu``: end the captures whose guard call is no longer running (cut by an exception before it
        could end them itself)."""
        frames = sys._current_frames()
        for i, (ident, token) in list(self.capturing.items()):
            frame = frames.get(ident)
            while frame is not None and not (frame.f_code is _GUARD_CODE and frame.f_locals.get("token") is token):
                frame = frame.f_back
            if frame is None:
                self._end_capture(i, "cut short")

    def _wait_issued(self, i: int) -> None:
        """Wait until unit ``i`` is read or in the file; a capture whose guard call is gone ends the wait."""
        while not self.issued[i].wait(_REAP_S):
            with self.mu:
                self._reap()
    def _capture(self, i: int, unit, buf) -> None:
        n, length = self.items.nbytes[i], self.lengths[i]
        self.spares_ready.wait()
        if self.ring is None:
            raise CheckpointError("the save's spare buffers could not be made")
        spare = self.ring.take(wait=True)
        pending = None
        try:
            if self.items.step_has(i, buf):
                spare.tensor[:n].copy_(buf.tensor[:n])
            else:  # the step did not read this unit: its bytes are still where the store keeps them
                self.items.read(i, spare).wait()
            spare.tensor[n:length].zero_()
            pending = self.engine.write_async(self.file, spare, self.offsets[i], length)
            self.written[i] = pending
            self.digests[i] = xxhash.xxh3_64(spare.tensor[:length].numpy()).hexdigest()  # what was written
            self.state[i] = _IN_FILE
        finally:
            self.ring.give(spare, pending)

    # -- the walk ------------------------------------------------------------------------------------

    def run(self, buffers: Sequence, bar) -> dict:
        """Put every unit not in state.bin yet there, fsync; returns the file's entry and the units' table
        (as ``stream.write_data``). Units cloned with the store's checksum and units the guard wrote (it took
        their checksum as it wrote them) are not read back. The file has a checksum of its own only when
        every unit passes here in order (a blocking save that cloned nothing); else its units' cover it."""
        count = len(self.lengths)
        walk = [i for i in range(count) if self.pieces[i] is None]
        whole = xxhash.xxh3_64() if len(walk) == count and self._remove_guard is None else None
        bar.update(sum(self.lengths[i] for i in range(count) if self.pieces[i] is not None))
        from_store = [False] * count

        def read(i: int, buf):
            with self.mu:
                if self.failure is not None:
                    raise self.failure
                self._await_capture(i)
                was = self.state[i]
                if was == _PENDING:
                    self.state[i] = _READING
            if was == _PENDING:
                from_store[i] = True
                fut = None
                try:
                    fut = self.items.read(i, buf)  # checked against the unit's last write
                finally:
                    self.reads[i] = fut
                    self.issued[i].set()
                return fut
            self._wait_issued(i)
            with self.mu:
                if self.failure is not None:
                    raise self.failure
            if self.written[i] is not None:
                self.written[i].wait()
                return None  # the guard wrote it, and took its checksum
            return self.engine.read_async(self.file, buf, self.offsets[i], self.lengths[i])

        def process(i: int, buf) -> bool:
            n, length = self.items.nbytes[i], self.lengths[i]
            if self.written[i] is not None:  # the guard wrote it: nothing read, its checksum taken
                bar.update(length)
                return False
            if from_store[i]:
                buf.tensor[n:length].zero_()  # padding: same state, same bytes
            data = buf.tensor[:length].numpy()
            digest = xxhash.xxh3_64(data).hexdigest()
            self.digests[i] = digest
            if whole is not None:
                whole.update(data)
            bar.update(length)
            return from_store[i]

        self.data.register(buffers)
        stream(walk, list(buffers), read=read, process=process, write=self.data.write)
        self.data.sync()
        table = [Unit(o, n, size, d, k) for size, o, n, d, k in
                 zip(self.items.nbytes, self.offsets, self.lengths, self.digests, self.pieces)]
        return {"bytes": self.total, "xxh3_64": whole.hexdigest() if whole is not None else None}, table

    def close(self) -> None:
        """Stop guarding (waiting for a guard call under way), let the guard's writes land, release all."""
        self.spares_ready.set()  # a guard call waiting for spares goes on (and finds none)
        with self.mu:
            self.closed = True
            if self._remove_guard is not None:
                self._remove_guard()
                self._remove_guard = None
            while self.capturing:
                if not self.mu.wait(_REAP_S):
                    self._reap()
        wait_quietly([f for f in self.written if f is not None])
        self.data.close()
        if self.spares is not None:
            self.spares.close()
            self.spares = None


def write_small_files(staged: Staged, plan: Plan, data: tuple, *, kind: str, extra, config: dict, unit_bytes: int,
                      threshold: int, memory=None) -> Manifest:
    """Write memory.pt (``memory``, serialized at the call, else made from ``plan``) and extra.pt (unless
    ``extra`` is None) into ``staged`` beside state.bin (``data``: its file entry and units, as
    :meth:`StateCopy.run` returns them); returns the manifest to commit. ``kind``: the optimizer's class
    name, or ``"imported"``."""
    file, units = data
    files = {DATA: file}
    if memory is None:
        memory = {"param_groups": plan.groups, "state": plan.memory_state, "steps": plan.steps}
    files[MEMORY] = write_file(memory, staged.path(MEMORY), staged.storage.fsync)
    if extra is not None:
        files[EXTRA] = write_file(extra, staged.path(EXTRA), staged.storage.fsync)
    return Manifest.new(kind, files=files, params=plan.entries, param_groups=plan.groups, config=config,
                        buffer_size=unit_bytes, threshold=threshold, units=tuple(units))


_GUARD_CODE = StateCopy._guard.__code__
