"""What an optimizer needs from parameter offload: weights fetched per unit of its state, and gradients."""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator, Optional, Sequence

import torch

from ..buffers import BufferPool
from ..units import round_up
from .registry import store_of

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

    def __init__(self, *, pin_memory: bool = False):
        self.pin_memory = pin_memory
        self._grad_pool: Optional[BufferPool] = None

    # -- whole parameters (small ones, and loading) -----------------------------------------------

    @staticmethod
    @contextlib.contextmanager
    def resident(params: Iterable[torch.Tensor], *, dirty: bool = False) -> Iterator[None]:
        """Hold the offloaded ones of ``params`` in memory for the block (written back after if ``dirty``)."""
        held = []
        try:
            for p in params:
                store = store_of(p)
                if store is not None:
                    store.fetch(p)
                    held.append((store, p))
            yield
        finally:
            for store, p in held:
                store.release(p, dirty=dirty)

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

    # -- unit by unit ------------------------------------------------------------------------------

    def units(self, units: Sequence, active: set, *, buffers: int = 0, write_back: bool = True) -> UnitPass:
        """A pass over ``units`` (in the order the optimizer will update them) for the chunks whose slot
        is in ``active`` (ids); use as a context manager so everything held is released at the end.

        ``buffers``: how many state buffers the optimizer's pipeline uses (pool indices ``0..buffers-1``);
        offloaded gradients are read into as many grad buffers, paired by index. 0: no gradients are read.
        ``write_back``: weights fetched are written back when released (False when they are only read).
        """
        return UnitPass(self, units, active, buffers, write_back)

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

    def __init__(self, access: ParamAccess, units: Sequence, active: set, buffers: int, write_back: bool):
        self.units = list(units)
        self.active = active
        self.write_back = write_back
        self._position = {id(u): i for i, u in enumerate(self.units)}
        self._held: dict = {}  # slot -> store
        # Chunks of each slot still to come in this pass: a parameter's weights are released after the
        # last of them, whichever order the units are visited in.
        self._left: dict = {}
        for u in self.units:
            for c in u.chunks:
                if id(c.slot) in active:
                    self._left[c.slot] = self._left.get(c.slot, 0) + 1
        self._reads: dict = {}  # id(unit) -> [(chunk, GradRead)]
        self._plans: dict = {}  # id(unit) -> [(chunk, store)]
        size = 0
        for u in self.units if buffers else ():
            plan, need = [], 0
            for c in u.chunks:
                store = store_of(c.slot.param)
                if id(c.slot) in active and store is not None and store.holds_grad(c.slot.param):
                    need = round_up(need, store.space.alignment) + store.grads.span(
                        c.slot.param, c.start, c.start + c.numel)
                    plan.append((c, store))
            if plan:
                self._plans[id(u)] = plan
            size = max(size, need)
        self._pool = access._grad_buffers(buffers, size) if size else None

    def __enter__(self) -> UnitPass:
        return self

    def __exit__(self, *exc) -> None:
        for reads in self._reads.values():
            for _, r in reads:
                r.settle()
        self._reads.clear()
        held, self._held = self._held, {}
        for slot, store in held.items():
            store.release(slot.param, dirty=self.write_back)

    # -- gradients -----------------------------------------------------------------------------

    def read_grads(self, unit, buffer) -> Optional[_Reads]:
        """Start reading ``unit``'s offloaded gradients into the grad buffer paired with ``buffer``."""
        plan = self._plans.get(id(unit))
        if not plan:
            return None
        # The state buffer's pool index pairs it with a grad buffer (none needed for gradients in host memory).
        gbuf = self._pool[buffer.index] if self._pool is not None else None
        reads, offset = [], 0
        try:
            for c, store in plan:
                offset = round_up(offset, store.space.alignment)
                read, span = store.grads.read(c.slot.param, c.start, c.start + c.numel, gbuf, offset)
                reads.append((c, read))
                offset += span
        finally:
            self._reads[id(unit)] = reads
        return _Reads([r for _, r in reads])

    def grads(self, unit) -> dict:
        """``{chunk: gradient elements}`` for ``unit``'s chunks whose gradient is offloaded (read already)."""
        return {c: r.wait() for c, r in self._reads.pop(id(unit), ())}

    # -- weights -------------------------------------------------------------------------------

    def fetch(self, unit, *, skip_read=lambda slot: False) -> None:
        """Make the weights of ``unit``'s active chunks resident (each parameter once, until its last
        chunk is done), and start reading the next unit's; ``skip_read(slot)``: the update overwrites
        every element (an fp32 master copy exists), so the old weights need not be read."""
        i = self._position[id(unit)]
        if i + 1 < len(self.units):
            for c in self.units[i + 1].chunks:
                store = store_of(c.slot.param)
                if store is not None and id(c.slot) in self.active and c.slot not in self._held \
                        and not skip_read(c.slot):
                    store.prefetch(c.slot.param)
        for c in unit.chunks:
            if id(c.slot) in self.active:
                self._hold(c.slot, read=not skip_read(c.slot))

    def weights(self, chunk) -> torch.Tensor:
        """The flat weights of ``chunk``'s elements (fetched if offloaded; released by :meth:`done`)."""
        self._hold(chunk.slot, read=True)
        return chunk.slot.param.detach().reshape(-1)[chunk.start:chunk.start + chunk.numel]

    def done(self, unit) -> None:
        """``unit`` is updated: release (write back) the weights whose last chunk in this pass it held."""
        for c in unit.chunks:
            if c.slot not in self._left:
                continue
            self._left[c.slot] -= 1
            if self._left[c.slot] == 0 and c.slot in self._held:
                self._held.pop(c.slot).release(c.slot.param, dirty=self.write_back)

    def _hold(self, slot, *, read: bool) -> None:
        if slot in self._held:
            return
        store = store_of(slot.param)
        if store is not None:
            store.fetch(slot.param, read=read)
            self._held[slot] = store


class _Reads:
    """Several gradient reads seen as one future (bytes moved)."""

    def __init__(self, reads: list):
        self._reads = reads

    def done(self) -> bool:
        return all(r.done() for r in self._reads)

    def wait(self) -> int:
        total, first = 0, None
        for r in self._reads:
            try:
                total += r.wait_io()
            except OSError as err:
                first = first or err
        if first is not None:
            raise first
        return total
