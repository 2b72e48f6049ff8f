"""What a save takes at the call: the optimizer's plan, and state.bin as the units were then (the clone,
the change guard that copies a unit before a step changes it, and the walk that writes and checks the rest)."""

from __future__ import annotations

import copy
import errno as _errno
import os
import threading
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import xxhash

from ..aio import wait_quietly
from ..buffers import BufferPool
from ..config import AioConfig
from ..errors import CheckpointError, ChecksumError
from ..pipeline import BufferRing
from ..units import ALIGNMENT, format_size, round_up
from .commit import _Staged
from .format import DATA, _chunk_table, _cpu_state, _dtype_name, _io_error, _torch_groups
from .stream import _clone_range, _stream


@dataclass
class _Plan:
    """What a save takes from the optimizer at the call (copies: training may go on)."""

    units: list
    entries: list
    groups: list
    memory_state: dict
    steps: dict



def _plan(opt) -> _Plan:
    """Everything of the optimizer a save needs besides the units' bytes, copied now."""
    store = opt.state_store
    params = [p for g in opt.param_groups for p in g["params"]]
    index = {p: i for i, p in enumerate(params)}
    slots = store.layout.slots
    units = [u for u in store.layout.units if any(c.slot.initialized for c in u.chunks)]
    entries = []
    chunks_of = _chunk_table(units, index.__getitem__)
    memory_state, steps = {}, {}
    for i, p in enumerate(params):
        slot = slots.get(p)
        st = opt.state.get(p, {})
        entry = {"index": i, "shape": list(p.shape), "dtype": _dtype_name(p.dtype), "numel": p.numel()}
        if slot is not None and (slot.initialized or i in chunks_of):
            entry.update(where="swap", initialized=slot.initialized, keys=list(slot.keys),
                         state_dtype=_dtype_name(slot.dtype), chunks=chunks_of.get(i, []))
            if len(set(slot.dtypes)) > 1:
                entry["key_dtypes"] = [_dtype_name(d) for d in slot.dtypes]
            if slot.initialized:
                steps[i] = st["step"].detach().to("cpu", copy=True)
        elif slot is None and len(st) > 0:
            memory_state[i] = _cpu_state(st)
            entry.update(where="memory", initialized=True, keys=sorted(k for k in st if k != "step"),
                         state_dtype=_dtype_name(p.dtype))
        else:
            entry.update(where="none", initialized=False)
        if entry["initialized"]:
            entry["step"] = float(steps[i] if i in steps else memory_state[i].get("step", 0.0))
        entries.append(entry)
    groups = copy.deepcopy(_torch_groups(opt.param_groups, index))  # hyperparameters may change in place
    return _Plan(units, entries, groups, memory_state, steps)


# -- state.bin: the units as they were at the call ------------------------------------------------

_PENDING, _READING, _CAPTURING, _IN_FILE = range(4)


# NOTE: state.bin holds every unit as it was when the save was called, while training may go on.
# Each unit is in one of four states: pending; being read from the store by the save's thread
# (reading); being copied by the change guard (capturing); or already in state.bin (in file: cloned
# at the call, or written by the guard). A step calls the guard before it changes a unit: a pending
# unit is then copied from the step's own buffer (no extra read) into a spare buffer and written
# to state.bin, and a unit being read is waited for (that unit alone). The save's thread goes
# through the units in file order: it reads pending ones from the store and writes them, and reads
# back those in file, so that every unit's checksum and the file's are computed in order, and what
# the guard wrote is checked. A blocking save is the same walk with no guard, through the
# optimizer's own pool.
class _StateCopy:
    """state.bin of one save: offsets, what each unit's bytes are doing, the clone, the walk and the guard."""

    def __init__(self, store, staged: _Staged, aio: AioConfig, units: Sequence):
        self.store = store
        self.units = list(units)
        n = len(self.units)
        self.index = {id(u): i for i, u in enumerate(self.units)}
        self.lengths = [round_up(u.nbytes, ALIGNMENT) for u in self.units]
        self.offsets, pos = [], 0
        for length in self.lengths:
            self.offsets.append(pos)
            pos += length
        self.total = pos
        self.path = staged.path(DATA)
        self.state = [_PENDING] * n
        self.reads: list = [None] * n  # the save's read of a unit from the store (the guard waits for it)
        self.written: list = [None] * n  # the guard's write of a unit
        self.expected: list = [None] * n  # xxh3_64 of what the guard wrote
        self.issued = [threading.Event() for _ in range(n)]  # reads[i] is set, or the unit is in file
        # The slots that had state at the call: the guard trusts a step's buffer only while they still
        # do (a step reads such a unit; load_state_dict resets them all and then does not read).
        self.had_state = [[c.slot for c in u.chunks if c.slot.initialized] for u in self.units]
        self.digests = [""] * n
        tier = store.tier
        self.on_disk = sum(1 for u in self.units if u.extent is not None and not (tier and tier.resident(u)))
        self.cloned = self.cloned_bytes = 0
        self.why_not: Optional[str] = None
        self.mu = threading.Condition()
        self.failure: Optional[BaseException] = None
        self.guards = 0  # guard calls under way
        self.closed = False
        self._remove_guard: Optional[Callable[[], None]] = None
        self.spares: Optional[BufferPool] = None
        self.spares_ready = threading.Event()
        self.ring: Optional[BufferRing] = None
        self.storage = staged.storage
        self.engine = staged.storage.engine(aio)
        self.file = None
        try:
            self.file = self.engine.open(self.path, "x+")
            if self.file.alignment > ALIGNMENT:
                raise CheckpointError(f"{self.path}: the file system wants {self.file.alignment}-byte direct I/O; "
                                      f"checkpoints use {ALIGNMENT}. Set aio.o_direct to false for this path")
        except BaseException:
            self.close()
            raise

    def reserve(self) -> None:
        """Allocate state.bin's space for the units that were not cloned (a full disk is reported now,
        before any data moves)."""
        runs, start = [], None
        for i in range(len(self.units) + 1):
            copied = i < len(self.units) and self.state[i] != _IN_FILE
            if copied and start is None:
                start = i
            elif not copied and start is not None:
                runs.append((self.offsets[start], self.offsets[i - 1] + self.lengths[i - 1]))
                start = None
        need = sum(b - a for a, b in runs)
        try:
            for a, b in runs:
                os.posix_fallocate(self.file.fd, a, b - a)
        except OSError as err:
            st = os.statvfs(os.path.dirname(self.path))
            raise OSError(err.errno, f"cannot reserve {need} bytes for the checkpoint data ({err.strerror}; "
                          f"{st.f_bavail * st.f_frsize} bytes free)", self.path) from err

    # -- the clone -----------------------------------------------------------------------------------

    def clone(self) -> None:
        """Clone every unit that lies on the swap files into state.bin (metadata only), where the file
        system can; the rest is copied later. The swap files must have no write in flight."""
        space, tier = self.store.space, self.store.tier
        if space is None or not self.on_disk:
            self.why_not = "the state lives in host memory" if space is None else None
            return
        devices = {os.stat(p).st_dev for p in space.files}
        if devices != {os.stat(self.path).st_dev}:
            self.why_not = "the checkpoint is not on the swap files' file system"
            return
        need = sum(self.lengths[i] for i, u in enumerate(self.units) if not (tier and tier.resident(u)))
        sources = {p: os.open(p, os.O_RDONLY | os.O_CLOEXEC) for p in space.files}
        pad = os.open(self.path, os.O_WRONLY | os.O_CLOEXEC)  # buffered: padding is not block-sized
        try:
            for i, u in enumerate(self.units):
                if u.extent is None or (tier and tier.resident(u)):
                    continue  # resident: its bytes are in memory, copied by the walk
                for path, offset, within, n in space.file_ranges(u.extent, self.lengths[i]):
                    if not _clone_range(sources[path], offset, n, self.file.fd, self.offsets[i] + within):
                        self.why_not = "the file system cannot clone these extents (no reflink)"
                        return  # this unit (maybe cloned in part) and the rest are copied by the walk
                    if not self.cloned:
                        self._check_room(need)
                gap = self.lengths[i] - u.nbytes
                if gap:
                    os.pwrite(pad, bytes(gap), self.offsets[i] + u.nbytes)  # as a copy pads: zeros
                self.state[i] = _IN_FILE
                self.issued[i].set()
                self.cloned += 1
                self.cloned_bytes += self.lengths[i]
        except OSError as err:
            raise _io_error(err, self.path, "cannot clone the state into") from err
        finally:
            for fd in sources.values():
                os.close(fd)
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
        """Copy units before any step changes them, until the walk is over (asynchronous saves); nothing to
        do when every unit was cloned."""
        if all(s == _IN_FILE for s in self.state):
            self.spares_ready.set()
            return
        self._remove_guard = self.store.add_change_guard(self._guard)

    def make_spares(self) -> None:
        """The guard's two spare buffers, made by the save's thread (zeroing them is not the caller's time);
        a guard call before then waits for them."""
        try:
            if self._remove_guard is not None and self.spares is None:
                self.spares = BufferPool(2, self.store.layout.unit_bytes)
                self.ring = BufferRing(list(self.spares))
        finally:
            self.spares_ready.set()

    def _guard(self, unit, buf) -> None:
        i = self.index.get(id(unit))
        if i is None:
            return  # no state at the call: not in this checkpoint
        with self.mu:
            was = self.state[i]
            if was != _PENDING or self.closed or self.failure is not None:
                take = False
            else:
                self.state[i], take = _CAPTURING, True
                self.guards += 1
        if was == _READING:
            self.issued[i].wait()
            # The save's read of this unit has its bytes: the step may go on.
            wait_quietly([f for f in (self.reads[i],) if f is not None])
            return
        if not take:
            return
        try:
            self._capture(i, unit, buf)
        except BaseException as err:  # noqa: BLE001 - the save fails, training goes on
            with self.mu:
                self.failure = self.failure or err
        finally:
            self.issued[i].set()
            with self.mu:
                self.guards -= 1
                self.mu.notify_all()

    def _capture(self, i: int, unit, buf) -> None:
        n, length = unit.nbytes, self.lengths[i]
        self.spares_ready.wait()
        if self.ring is None:
            raise CheckpointError("the save's spare buffers could not be made")
        spare = self.ring.take(wait=True)
        pending = None
        try:
            tier = self.store.tier
            if (tier is not None and tier.home(unit) is buf) or all(s.initialized for s in self.had_state[i]):
                spare.tensor[:n].copy_(buf.tensor[:n])
            else:  # the step did not read this unit: its bytes are still where the store keeps them
                self.store.read_unit(unit, spare).wait()
            spare.tensor[n:length].zero_()
            pending = self.engine.write_async(self.file, spare, self.offsets[i], length)
            self.written[i] = pending
            self.expected[i] = xxhash.xxh3_64(spare.tensor[:length].numpy()).hexdigest()
            self.state[i] = _IN_FILE
        finally:
            self.ring.give(spare, pending)

    # -- the walk ------------------------------------------------------------------------------------

    def run(self, buffers: Sequence, bar) -> dict:
        """Put every unit not in state.bin yet there, hash the file in order, fsync; returns the file's
        entry and the units' table (as ``stream._write_data``)."""
        whole = xxhash.xxh3_64()
        from_store = [False] * len(self.units)

        def read(i: int, buf):
            with self.mu:
                if self.failure is not None:
                    raise self.failure
                was = self.state[i]
                if was == _PENDING:
                    self.state[i] = _READING
            if was == _PENDING:
                from_store[i] = True
                fut = None
                try:
                    fut = self.store.read_unit(self.units[i], buf)  # checked against the unit's last write
                finally:
                    self.reads[i] = fut
                    self.issued[i].set()
                return fut
            self.issued[i].wait()
            with self.mu:
                if self.failure is not None:
                    raise self.failure
            if self.written[i] is not None:
                self.written[i].wait()
            return self.engine.read_async(self.file, buf, self.offsets[i], self.lengths[i])

        def process(i: int, buf) -> bool:
            n, length = self.units[i].nbytes, self.lengths[i]
            if from_store[i]:
                buf.tensor[n:length].zero_()  # padding: same state, same bytes
            data = buf.tensor[:length].numpy()
            digest = xxhash.xxh3_64(data).hexdigest()
            if self.expected[i] is not None and digest != self.expected[i]:
                raise ChecksumError(f"{self.path}: bytes [{self.offsets[i]}, {self.offsets[i] + length}) read back "
                                    f"have xxh3_64 {digest}, {self.expected[i]} was written there")
            self.digests[i] = digest
            whole.update(data)
            bar.update(length)
            return from_store[i]

        def write(i: int, buf):
            return self.engine.write_async(self.file, buf, self.offsets[i], self.lengths[i])

        if buffers and all(b.index == k for k, b in enumerate(buffers)):
            try:
                self.engine.register_buffers(list(buffers))
            except (ValueError, RuntimeError, OSError):
                pass  # fixed buffers only save a little CPU
        _stream(range(len(self.units)), list(buffers), read=read, process=process, write=write)
        self.storage.fsync(self.file.fd, self.path)
        table = [{"offset": o, "nbytes": u.nbytes, "length": n, "xxh3_64": d}
                 for u, o, n, d in zip(self.units, self.offsets, self.lengths, self.digests)]
        return {"file": {"bytes": self.total, "xxh3_64": whole.hexdigest()}, "units": table}

    def close(self) -> None:
        """Stop guarding (waiting for a guard call under way), let the guard's writes land, release all."""
        self.spares_ready.set()  # a guard call waiting for spares goes on (and finds none)
        with self.mu:
            self.closed = True
            if self._remove_guard is not None:
                self._remove_guard()
                self._remove_guard = None
            while self.guards:
                self.mu.wait()
        wait_quietly([f for f in self.written if f is not None])
        if self.file is not None:
            self.file.close()
            self.file = None
        self.engine.close()
        if self.spares is not None:
            self.spares.close()
            self.spares = None
