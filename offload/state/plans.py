"""The offloaded state's side of a checkpoint: what a save takes (a save plan) and how a load puts it back (a
load plan), so that :mod:`offload.checkpoint` moves named items and byte ranges and never sees the layout,
the host tier or the swap space.

A save plan (:func:`save_plan`, :func:`import_plan`) is the units with state as items ``0..n-1`` of
state.bin (their sizes, a way to read each into a buffer or to clone it from the swap files) and, per
parameter index, a :class:`SavedParam`: its state keys, their dtypes and its chunks as plain rows
``(item, start, numel, offset, stride, slices)``. A load plan (:class:`StateLoad`) takes the saved element
ranges of each parameter's state and writes them into the units as they are laid out here: as they are
where the saved rows match this layout (:meth:`StateLoad.packed_as`), re-chunked by element ranges else.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import math
import os
import struct
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Sequence

import torch

from .. import codes
from ..errors import CheckpointError
from ..pipeline import Pipeline
from .codec import exported_keys, set_chunk_values
from .layout import HALF_DTYPES, Layout

__all__ = ["HALF_DTYPES", "ImportedState", "SavedParam", "StateItems", "StateLoad", "ValueSource", "clone_range",
           "import_plan", "mark_initialized", "save_plan"]


# -- cloning extents (reflink) -------------------------------------------------------------------------

FICLONERANGE = 0x4020940D  # _IOW(0x94, 13, struct file_clone_range)
# What a file system says when it cannot share extents between these two files: no reflink support
# (ext4, tmpfs), two file systems, or offsets and lengths that are not multiples of its block size.
NO_CLONE_ERRORS = frozenset({errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV, errno.EINVAL, errno.ENOTTY,
                             errno.ENOSYS, errno.EBADF})


def clone_range(src_fd: int, src_offset: int, length: int, dst_fd: int, dst_offset: int) -> bool:
    """Make ``length`` bytes of ``dst_fd`` at ``dst_offset`` share the extents of ``src_fd`` at
    ``src_offset`` (``FICLONERANGE``: XFS with reflink, btrfs): metadata only, whatever the length.
    False where the file system cannot (the caller copies the bytes instead); OSError on any other
    failure (ENOSPC, EIO, ...)."""
    try:
        fcntl.ioctl(dst_fd, FICLONERANGE, struct.pack("qQQQ", src_fd, src_offset, length, dst_offset))
    except OSError as err:
        if err.errno in NO_CLONE_ERRORS:
            return False
        raise
    return True


@dataclass(frozen=True)
class SavedParam:
    """An offloaded parameter's state in a save plan: whether it exists yet, its ``keys`` (as saved), the
    moments' dtype, each key's dtype (None where all of the slot's keys share the moments'), and its chunks
    as rows ``(item, start, numel, offset, stride, slices)`` (``slices``: the keys' byte offsets, where
    ``stride`` is 0 because their dtypes differ; else None)."""

    initialized: bool
    keys: tuple
    state_dtype: torch.dtype
    key_dtypes: Optional[tuple]
    chunks: tuple


def _rows(units: Sequence, index_of: Callable[[Any], int]) -> dict:
    """Per parameter index, the rows of its chunks in ``units`` (in state.bin's order)."""
    rows: dict = {}
    for ui, u in enumerate(units):
        for c in u.chunks:
            row = (ui, c.start, c.numel, c.offset, c.stride, None if c.stride else tuple(c.slices))
            rows.setdefault(index_of(c.slot.param), []).append(row)
    return rows


def _saved(slot, keys, rows) -> SavedParam:
    mixed = len(set(slot.dtypes)) > 1
    return SavedParam(slot.initialized, tuple(keys), slot.dtype,
                      tuple(slot.dtype_of(k) for k in keys) if mixed else None, tuple(rows))


class StateItems:
    """The units with state at a save's call as the items of state.bin, each read, cloned or handed over by a
    step through these methods (``store``: the :class:`offload.state.StateStore`, None for imported state)."""

    def __init__(self, store, units: Sequence):
        self.store = store
        self.units = list(units)
        self.nbytes = [u.nbytes for u in self.units]
        self._index = {id(u): i for i, u in enumerate(self.units)}
        # The slots that had state at the call: a step's buffer holds a unit's bytes only while they still do (a
        # step reads such a unit; load_state_dict resets them all and then does not read).
        self._had_state = [[c.slot for c in u.chunks if c.slot.initialized] for u in self.units]

    @property
    def unit_bytes(self) -> int:
        """The size of a unit (what a buffer that holds any item needs)."""
        return self.store.layout.unit_bytes

    @property
    def _swap_files(self) -> Optional[list]:
        """The paths of the swap files the items' bytes lie on, or None where the state lives in host memory."""
        return None if self.store.space is None else list(self.store.space.files)

    def in_host(self, i: int) -> bool:
        """Whether item ``i``'s bytes are resident in host memory (its extent, if any, may be older)."""
        tier = self.store.tier
        return tier is not None and tier.resident(self.units[i])

    def on_disk(self, i: int) -> bool:
        """Whether item ``i``'s bytes are on the swap files only (not resident in host memory)."""
        return self.units[i].extent is not None and not self.in_host(i)

    def clone_into(self, fd: int, path: str, offsets: Sequence[int], lengths: Sequence[int],
                   cloned: Callable[[int, Optional[tuple]], None]) -> Optional[str]:
        """Make each item that lies on the swap files share its extents with ``lengths[i]`` bytes of the file
        ``fd`` (at ``path``) at ``offsets[i]`` (``FICLONERANGE``: metadata only, whatever the length) where the
        file system can, calling ``cloned(i, known)`` for each (``known``: the store's checksum of the bytes
        shared, as :meth:`StateStore.landed_digest` gives it, or None); returns why the others were not
        cloned (None: all were, or none lies on the swap files). The swap files must have no write in flight.

        Raises:
            OSError: a clone failed otherwise than for want of support (ENOSPC, EIO, ...).
        """
        files = self._swap_files
        if files is None:
            return "the state lives in host memory"
        on_disk = [i for i in range(len(self.units)) if self.on_disk(i)]
        if not on_disk:
            return None
        if {os.stat(p).st_dev for p in files} != {os.stat(path).st_dev}:
            return "the checkpoint is not on the swap files' file system"
        sources = {p: os.open(p, os.O_RDONLY | os.O_CLOEXEC) for p in files}
        try:
            for i in on_disk:
                # What the store knows of the bytes about to be shared, taken now: no write is in flight and no
                # step runs until the save's call returns, so it is the checksum of exactly these bytes.
                known = self.store.landed_digest(self.units[i])
                if known is not None and known[2] != lengths[i]:
                    known = None  # the swap space's alignment is not the checkpoint's: not the same bytes
                for src, offset, within, n in self.store.space.file_ranges(self.units[i].extent, lengths[i]):
                    if not clone_range(sources[src], offset, n, fd, offsets[i] + within):
                        # This item (maybe cloned in part) and the rest are copied by the caller.
                        return "the file system cannot clone these extents (no reflink)"
                cloned(i, known)
        finally:
            for source in sources.values():
                os.close(source)
        return None

    def read(self, i: int, buf):
        """Start reading item ``i`` into ``buf`` (checked against its last write); a future, or None."""
        return self.store.read_unit(self.units[i], buf)

    def guard(self, call: Callable[[Any, Any], None]) -> Callable[[], None]:
        """Call ``call(handle, buffer)`` before a step changes a unit (``buffer``: the bytes the step has;
        :meth:`index` of ``handle``: the item, or None for a unit not in the plan); returns the function that
        removes the guard."""
        return self.store.add_change_guard(call)

    def index(self, handle) -> Optional[int]:
        """The item a guard's ``handle`` is, or None where it is none of the plan's (no state at the call)."""
        return self._index.get(id(handle))

    def step_has(self, i: int, buf) -> bool:
        """Whether ``buf``, a step's buffer handed to the guard, holds item ``i``'s bytes as they were at the call
        (else the step did not read the unit, and :meth:`read` gets them)."""
        tier = self.store.tier
        return (tier is not None and tier.home(self.units[i]) is buf) or all(s.initialized for s in self._had_state[i])

    def steps(self) -> tuple[int, int, Optional[float]]:
        """The store's steps started and done, and the time between the starts of the last two (None: unknown)."""
        moves = self.store.moves
        return moves.steps_started, moves.steps_done, moves.step_interval


def save_plan(store, params: Sequence[torch.Tensor]) -> tuple[StateItems, dict]:
    """The save plan of ``store``'s state: its units with state as items, and per index into ``params`` (the
    optimizer's, in group order) of an offloaded parameter that has state or chunks, its :class:`SavedParam`."""
    index = {p: i for i, p in enumerate(params)}
    units = [u for u in store.layout.units if any(c.slot.initialized for c in u.chunks)]
    rows = _rows(units, index.__getitem__)
    out = {}
    for i, p in enumerate(params):
        slot = store.layout.slots.get(p)
        if slot is not None and (slot.initialized or i in rows):
            out[i] = _saved(slot, slot.keys, rows.get(i, ()))
    return StateItems(store, units), out


def mark_initialized(store, value: bool, params: Optional[Sequence[torch.Tensor]] = None) -> None:
    """Mark the state of ``params`` (None: of every offloaded parameter) as existing (``value``) or not."""
    slots = store.layout.slots
    for slot in (slots.values() if params is None else (slots[p] for p in params)):
        slot.initialized = value


# -- imported state: laid out as an optimizer with a given config would -----------------------------


class ImportedState(StateItems):
    """A torch-layout state dict laid out in units as an optimizer of these settings would (``state``: index ->
    state; ``shapes``/``dtypes``: per index, None while unknown)."""

    def __init__(self, state: dict, layout: Layout, metas: dict):
        self.layout, self.state, self.metas = layout, state, metas
        self.meta_index = {id(t): i for i, t in metas.items()}
        super().__init__(None, layout.units)

    @property
    def unit_bytes(self) -> int:
        """The size of a unit."""
        return self.layout.unit_bytes

    @property
    def _swap_files(self) -> Optional[list]:
        """None: the items are made in host memory."""
        return None

    def in_host(self, i: int) -> bool:
        """True: every item is made in host memory."""
        return True

    def read(self, i: int, buf) -> None:
        """``buf`` filled with item ``i``'s state from the state dict (at once: returns None).

        Raises:
            CheckpointError: a state key of a parameter is missing from the state dict (named).
        """
        for c in self.units[i].chunks:
            index = self.meta_index[id(c.slot.param)]
            for key in exported_keys(c.slot):
                src = self.state[index].get(key)
                if src is None:
                    if key == "master":
                        set_chunk_values(c, buf, key, None)  # never read: "master" is absent from the keys saved
                        continue
                    raise CheckpointError(f"parameter {index}: state {key!r} is missing from the state dict")
                set_chunk_values(c, buf, key, src.detach().reshape(-1)[c.start:c.start + c.numel])

    def params(self) -> dict:
        """Per index of an offloaded parameter, its :class:`SavedParam` (keys: those the state dict has)."""
        rows = _rows(self.units, lambda param: self.meta_index[id(param)])
        out = {}
        for i, meta in self.metas.items():
            slot, have = self.layout.slots[meta], self.state[i]
            keys = [k for k in slot.keys if k in have or (k.endswith(codes.ABSMAX) and k.removesuffix(codes.ABSMAX)
                                                          in have)]
            out[i] = _saved(slot, keys, rows.get(i, ()))
        return out


def import_plan(state: dict, shapes: list, dtypes: list, amsgrad_of: dict, *, unit_bytes: int, state_dtype: str,
                master: bool, threshold: int) -> ImportedState:
    """Lay out the parameters with state (``state``, by index) with at least ``threshold`` elements as an
    optimizer with these settings would; the rest keep their state in memory."""
    layout = Layout(unit_bytes, state_dtype, master=master)
    metas, offloaded = {}, []
    for i in range(len(shapes)):
        if i in state and math.prod(map(int, shapes[i])) >= threshold:
            metas[i] = torch.empty(shapes[i], dtype=dtypes[i], device="meta")
            offloaded.append((metas[i], {"index": i}, amsgrad_of[i]))
    layout.commit(layout.plan(offloaded))
    return ImportedState(state, layout, metas)


# -- loading: saved element ranges into this layout's units ------------------------------------------


class ValueSource(Protocol):
    """What a load plan reads saved state through (:mod:`offload.checkpoint` implements it)."""

    def copy(self, index: int, key: str, lo: int, hi: int, dest: torch.Tensor,
             absmax: Callable[[], torch.Tensor]) -> bool:
        """Copy elements ``[lo, hi)`` of state ``key`` of parameter ``index`` into ``dest`` as the bytes saved
        (8-bit codes with their absmax into ``absmax()``), if they were saved in ``dest``'s dtype; else False."""

    def values(self, index: int, key: str, lo: int, hi: int,
               weights: Optional[Callable[[], torch.Tensor]]) -> Optional[torch.Tensor]:
        """Elements ``[lo, hi)`` of state ``key`` of parameter ``index`` as values; a master not saved from
        ``weights()`` (the elements' flat weights; None: the result is None)."""


class StateLoad:
    """A load plan of ``store``'s units: ``params``, the optimizer's parameters by the checkpoint's indices, and
    ``saved``, the indices with saved state."""

    def __init__(self, store, params: list, saved: set):
        self.store, self.params, self.saved = store, params, set(saved)
        self.index = {p: i for i, p in enumerate(params)}
        units = store.layout.units
        self.units = [u for u in units if any(self.index[c.slot.param] in self.saved for c in u.chunks)]
        # The slots whose state is loaded (ids), what an access to the weights (a master seeded from them) needs.
        self.active = {id(c.slot) for u in self.units for c in u.chunks if self.index[c.slot.param] in self.saved}

    def packed_as(self, buffer_size: int, nbytes: Sequence[int], lengths: Sequence[int],
                  entries: Sequence, buffers: Sequence) -> Optional[dict]:
        """{saved item: unit} when every saved item (``nbytes``, padded to ``lengths``, of a save with units of
        ``buffer_size``) is packed exactly like one of this store's units, so bytes move as they are, through
        ``buffers`` (:meth:`StateStore.lend_buffers`); None when state must be re-chunked. ``entries``: the saved
        parameters (``index``, ``where``, ``initialized``, ``keys``, ``state_dtypes()``, ``chunks`` of rows)."""
        store = self.store
        if buffer_size != store.layout.unit_bytes or any(n > min(b.nbytes for b in buffers) for n in lengths):
            return None
        signature: list[list] = [[] for _ in nbytes]
        for e in entries:
            if e.initialized:
                slot = store.slot(self.params[e.index])
                if (e.where == "memory") != (slot is None):
                    return None  # small here and offloaded there, or the other way round
                if slot is not None and (list(slot.keys) != list(e.keys) or list(slot.dtypes) != e.state_dtypes()):
                    return None  # e.g. an imported state without the fp32 master copy, or another state_dtype
            for c in e.chunks:
                signature[c.unit].append((e.index, c.start, c.numel, c.offset, c.stride, c.slices or ()))
        by_sig = {tuple(sorted(self._signature(u))): u for u in store.layout.units}
        plan = {}
        for i, sig in enumerate(signature):
            target = by_sig.get(tuple(sorted(sig)))
            if target is None or target.nbytes != nbytes[i]:
                return None
            plan[i] = target
        return plan

    def _signature(self, unit) -> list:
        return [(self.index[c.slot.param], c.start, c.numel, c.offset, c.stride, () if c.stride else tuple(c.slices))
                for c in unit.chunks]

    def write(self, unit, buf):
        """Write ``buf`` as ``unit``'s bytes (a target of :meth:`packed_as`)."""
        return self.store.write_unit(unit, buf)

    def fill(self, unit, buf, source: ValueSource, weights) -> bool:
        """``buf`` filled with ``unit``'s state from ``source`` (``weights``: the access's pass, for masters)."""
        for c in unit.chunks:
            i = self.index[c.slot.param]
            if i not in self.saved:
                continue
            lo, hi = c.start, c.start + c.numel
            for key in exported_keys(c.slot):
                absmax = functools.partial(c.slice, buf, key + codes.ABSMAX)
                if not source.copy(i, key, lo, hi, c.slice(buf, key), absmax):
                    flat = functools.cache(lambda c=c: weights.weights(c))  # fetched once, where no master is saved
                    set_chunk_values(c, buf, key, source.values(i, key, lo, hi, flat))
        weights.done(unit)
        return True

    def run(self, source: ValueSource, weights, buffers: Sequence) -> None:
        """Every unit holding a parameter with saved state, filled from ``source`` and written (``weights``: a
        pass of the optimizer's access to the weights over :attr:`units`, for :attr:`active`), through
        ``buffers`` (:meth:`StateStore.lend_buffers`) but the first, which ``source`` reads into."""
        if self.units:
            Pipeline(list(buffers[1:])).run(self.units, write=self.store.write_unit,
                                            process=lambda unit, buf: self.fill(unit, buf, source, weights))
