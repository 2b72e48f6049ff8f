"""What an optimizer needs from parameter offload: weights fetched per unit of its state, and gradients."""

from __future__ import annotations

import threading
from typing import Iterable, Optional, Sequence

import torch

from ..buffers import BufferPool
from ..copies import DONE, Ticket
from ..distributed import detached
from ..errors import StateError
from ..interrupts import deferring
from ..sizes import round_up
from .holds import release_each, resident
from .registry import holder, store_of

__all__ = ["ParamAccess"]


# NOTE: an optimizer updates state unit by unit (a unit holds chunks of several parameters, a large
# parameter spans several units). For a parameter whose weights live on NVMe (offload_parameters), the
# weights are fetched at its first chunk and released, written back, after its last, so about one
# unit's worth of weights is resident at a time; the next unit's are prefetched meanwhile. A gradient
# in the grad store is read per chunk into a buffer paired with the state buffer of the same unit, in
# the same pipeline as the state, as far ahead. Ordinary parameters pass through untouched, so an
# optimizer treats every parameter the same way.
class ParamAccess:
    """An optimizer's access to weights and gradients that :func:`offload_parameters` may hold.

    Args:
        pin_memory: pin the buffers offloaded gradients are read into (for CUDA parameters).
    """

    def __init__(self, *, pin_memory: bool = False, handoff_bytes: int = 0):
        self.pin_memory = pin_memory
        self.handoff_bytes = handoff_bytes
        self._grad_pool: Optional[BufferPool] = None
        # Parameters taken at their final gradient (see watch): param -> (store, bytes of weights and grad).
        self._handed: dict[torch.Tensor, tuple] = {}
        self._handed_total = 0
        self._lock = threading.Lock()

    # -- whole parameters (small ones, and loading) -----------------------------------------------

    resident = staticmethod(resident)  # hold the offloaded ones of some parameters for a block

    @staticmethod
    def grad(p: torch.Tensor) -> Optional[torch.Tensor]:
        """``p``'s gradient as a tensor: read whole from the grad store if it lives there, else ``p.grad``."""
        store = store_of(p)
        if store is not None and store.holds_grad(p):
            return store.load_grad(p)
        return p.grad

    @staticmethod
    def forget_grads(params: Iterable[torch.Tensor]) -> None:
        """After ``zero_grad``: gradients the grad store held for ``params`` are gone (or zero)."""
        for p in params:
            store = store_of(p)
            if store is not None:
                store.grads.forget(p)

    # -- updates during backward ------------------------------------------------------------------

    def watch(self, params: Iterable[torch.Tensor], watcher, *, strict: bool = True) -> list:
        """Tell ``watcher.final(p)`` when each of ``params``' gradient is final in a backward, once it is where
        :meth:`UnitPass.grads` and ``p.grad`` will find it; for a parameter on NVMe also ask ``watcher.take(p)``
        first whether the optimizer takes it as it is (then it stays resident, its gradient in memory, until
        the update: see :meth:`adopt`), through its store's :class:`Handoff`. Returns handles to remove.

        A parameter offloaded after this (``offload_parameters`` after the optimizer) then fails its backward
        with a ``StateError`` saying so, unless not ``strict`` (an optimizer that only watches, and watches
        again before it updates inside backward).
        """
        handles = []
        for p in params:
            store = store_of(p)
            if store is not None and store.handoff.reported:
                handles.append(store.handoff.watch(p, watcher))
            else:
                handles.append(p.register_post_accumulate_grad_hook(_direct(watcher, strict)))
        return handles

    def adopt(self, p: torch.Tensor) -> bool:
        """From ``watcher.take(p)``: take over the backward's hold on ``p``'s weights, unless that would keep
        more than ``handoff_bytes`` of weights and gradients waiting for updates. Returns whether taken."""
        store = store_of(p)
        if store is None or p.grad is None:
            return False
        nbytes = p.numel() * p.element_size() * 2
        with self._lock:
            if p in self._handed or self._handed_total + nbytes > self.handoff_bytes:
                return False
            self._handed[p] = (store, nbytes)
            self._handed_total += nbytes
        return True

    def release_handed(self) -> None:
        """Give back the holds taken by :meth:`adopt` that no update used (after a step failed or ended)."""
        with self._lock:
            handed, self._handed, self._handed_total = self._handed, {}, 0
        release_each(handed.items(), lambda item: item[1][0].release(item[0]))

    def _take_handed(self, p: torch.Tensor):
        with self._lock:
            entry = self._handed.pop(p, None)
            if entry is not None:
                self._handed_total -= entry[1]
        return entry

    # -- unit by unit ------------------------------------------------------------------------------

    def units(self, units: Sequence, active: set, *, write_back: bool = True) -> UnitPass:
        """A pass over ``units`` (in the order the optimizer will update them) for the chunks whose slot
        is in ``active`` (ids); use as a context manager so everything held is released at the end.

        ``write_back``: weights fetched are written back when released (False when they are only read).
        """
        return UnitPass(self, units, active, write_back)

    def close(self) -> None:
        """Free the gradient buffers."""
        if self._grad_pool is not None:
            self._grad_pool.close()
            self._grad_pool = None

    @property
    def grad_pool_bytes(self) -> int:
        """Host memory held for reading offloaded gradients (0 until a step needed it)."""
        return self._grad_pool.nbytes if self._grad_pool is not None else 0

    def _grad_buffers(self, count: int, size: int) -> BufferPool:
        pool = self._grad_pool
        if pool is None or len(pool) < count or pool.buffer_size < size:
            if pool is not None:
                pool.close()
            self._grad_pool = pool = BufferPool(count, size, pin_memory=self.pin_memory)
        return pool


class UnitPass:
    """One pass of an optimizer over its units: see :meth:`ParamAccess.units`."""

    def __init__(self, access: ParamAccess, units: Sequence, active: set, write_back: bool):
        self.access = access
        self.units = list(units)
        self.active = active
        self.write_back = write_back
        self._position = {id(u): i for i, u in enumerate(self.units)}
        self._held: dict = {}  # slot -> (store, the tensor fetched in it: the parameter, or FSDP2's shard)
        self._adopted: set = set()  # slots whose hold came from backward (ParamAccess.adopt)
        # Chunks of each slot still to come in this pass: a parameter's weights are released after the
        # last of them, whichever order the units are visited in.
        self._left: dict = {}
        for u in self.units:
            for c in u.chunks:
                if id(c.slot) in active:
                    self._left[c.slot] = self._left.get(c.slot, 0) + 1
        # One buffer for the gradients of a unit that live on NVMe, as large as a unit's could need.
        size = 0
        for u in self.units:
            need = 0
            for c in u.chunks:
                store = store_of(c.slot.param)
                if id(c.slot) in active and store is not None and store.grads.on_disk(c.slot.param):
                    need = round_up(need, store.space.alignment) + store.grads.span(
                        c.slot.param, c.start, c.start + c.numel, on_disk=True)
            size = max(size, need)
        self._buffer = access._grad_buffers(1, size)[0] if size else None
        # Copies to the device still reading the gradients of the unit updated last (from the buffer, or
        # from gradients kept in host memory): the buffer is refilled only after them.
        self._reading: Ticket = DONE

    def __enter__(self) -> UnitPass:
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._reading.wait()
        finally:
            held, self._held = self._held, {}
            release_each(held.items(), lambda item: self._release(*item))

    # -- gradients -----------------------------------------------------------------------------

    def grads(self, unit) -> dict:
        """``{chunk: gradient elements}`` for ``unit``'s active chunks whose gradient is in a grad store
        (read now, from NVMe into the pass's buffer, or as views of gradients kept in host memory); valid
        until the next call."""
        reads, offset = [], 0
        try:
            for c in unit.chunks:
                store = store_of(c.slot.param)
                if id(c.slot) not in self.active or store is None or not store.holds_grad(c.slot.param):
                    continue
                if not reads:
                    # The copies to the device of the units before must have read the buffer first. A unit
                    # without stored grads refills nothing, so it does not wait (the step runs ahead).
                    self._reading.wait()
                    self._reading = DONE
                offset = round_up(offset, store.space.alignment)
                read, span = store.grads.read(c.slot.param, c.start, c.start + c.numel, self._buffer, offset)
                reads.append((c, read))
                offset += span
            return {c: r.wait() for c, r in reads}
        finally:
            for _, r in reads:
                r.wait_quietly()  # after an error: nothing may still be reading into the buffer

    # -- weights -------------------------------------------------------------------------------

    def fetch(self, unit, changing: set, *, skip_read=lambda slot: False) -> None:
        """Make resident the weights of ``changing``, the slots of ``unit``'s chunks the update writes (each
        parameter once, until its last chunk in the pass is done), and start reading the next unit's.
        ``skip_read(slot)``: the update overwrites every element of that slot (an fp32 master copy
        exists), so its old weights need not be read. Weights of other chunks are not fetched, so they are
        never written back."""
        i = self._position[id(unit)]
        if i + 1 < len(self.units):
            for c in self.units[i + 1].chunks:
                store, key = holder(c.slot.param)
                if store is not None and id(c.slot) in self.active and c.slot not in self._held \
                        and not skip_read(c.slot):
                    store.prefetch(key)
        for c in unit.chunks:
            if c.slot in changing:
                self._hold(c.slot, read=not skip_read(c.slot))

    def weights(self, chunk) -> torch.Tensor:
        """The flat weights of ``chunk``'s elements (fetched if offloaded; released by :meth:`done`)."""
        self._hold(chunk.slot, read=True)
        return detached(chunk.slot.param).reshape(-1)[chunk.start:chunk.start + chunk.numel]

    def done(self, unit, reading: Ticket = DONE) -> None:
        """``unit`` is updated: release (write back) the weights whose last chunk in this pass it held.
        ``reading``: the copies still reading the gradients :meth:`grads` gave for it (the next call that fills
        the buffer waits for them, and for those of units before it that did not)."""
        self._reading = self._reading | reading
        for c in unit.chunks:
            if c.slot not in self._left:
                continue
            self._left[c.slot] -= 1
            if self._left[c.slot] == 0 and c.slot in self._held:
                self._release(c.slot, self._held.pop(c.slot))

    def _hold(self, slot, *, read: bool) -> None:
        if slot in self._held:
            return
        store, key = holder(slot.param)  # a DTensor's local shard (FSDP2) is held as a tensor of its own
        if store is None:
            return
        if self.access._take_handed(slot.param) is not None:
            self._adopted.add(slot)  # resident since backward, its gradient in p.grad
        else:
            store.fetch(key, read=read)
        self._held[slot] = (store, key)

    def _release(self, slot, held: tuple) -> None:
        store, key = held
        store.release(key, dirty=self.write_back)
        if slot in self._adopted:
            self._adopted.discard(slot)
            if store.offload_grads:
                store.grads.consume(slot.param)  # updated: the gradient is not needed, nor kept


def _direct(watcher, strict: bool = True):
    @deferring
    def hook(p: torch.Tensor) -> None:
        if strict and store_of(p) is not None:
            raise StateError(
                "offload_parameters was applied to this model after the optimizer was built with "
                "overlap_backward=True, so the optimizer cannot see when an offloaded gradient is in place. "
                "Call offload_parameters first, then build the optimizer.")
        watcher.final(p)
    return hook
