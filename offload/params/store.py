"""Parameter storage on the swap space: each parameter's bytes in one extent, moved through a pool.

# NOTE: a released parameter keeps its Python object, shape, dtype, device and requires_grad; only its
# storage is shrunk to zero bytes (``untyped_storage().resize_(0)``, as FSDP does). A fetch grows the
# SAME storage object back and fills it, so every alias of the parameter (autograd's saved tensors,
# ``weight.t()`` views, activation checkpointing's detached copies) sees the fetched bytes again.
#
# Bytes move between the swap space and the parameter through a fixed pool of page-aligned buffers
# (O_DIRECT needs aligned memory; a parameter's own storage is not). A parameter larger than one
# buffer is read in buffer-sized pieces, several in flight at once. Prefetches hold buffers with
# reads in flight; they never wait for a buffer, and a fetch that finds no free buffer takes one from
# the prefetch issued last (waiting for its read and dropping it), so the pool cannot deadlock
# whatever order parameters are asked for in.
#
# Everything here runs under one lock: autograd may call hooks from its own device threads.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Optional

import torch

from ..aio import CompletedFuture, wait_quietly
from ..buffers import BufferPool, HostBuffer
from ..config import Config
from ..errors import StateError
from ..space import Extent, SwapSpace
from ..units import ALIGNMENT, round_up
from .guard import OffloadedParameter, make_placeholder

__all__ = ["GradRead", "ParamStore", "resident", "store_of"]

# id(parameter) -> (weak reference to it, the store holding it); the optimizer asks this to learn that
# a parameter's storage may be released. (A WeakKeyDictionary would compare tensors with ==.) The
# weak reference tells a live entry from a reused id; stores remove their entries when they close.
_STORES: dict[int, tuple[weakref.ref, ParamStore]] = {}


def store_of(param: torch.Tensor) -> Optional[ParamStore]:
    """The :class:`ParamStore` holding ``param``'s bytes, or ``None`` for an ordinary parameter."""
    entry = _STORES.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    return entry[1]



_NONE, _ZERO, _STORED = 0, 1, 2  # what a grad extent holds


class GradRead:
    """A read of part of a stored gradient into a host buffer.

    ``wait_io()`` waits for the bytes (returns how many moved); ``wait()`` then gives the elements as a
    typed view with pending clip factors applied (once, however often it is called).
    """

    def __init__(self, future, view: torch.Tensor, zero: bool, scales: list):
        self._future, self._view, self._zero, self._scales = future, view, zero, scales
        self._ready = False

    def wait_io(self) -> int:
        return self._future.wait()

    def wait(self) -> torch.Tensor:
        if not self._ready:
            self._future.wait()
            if self._zero:
                self._view.zero_()
            for coef in self._scales:
                self._view.mul_(coef)  # pending clip factors, applied in order as torch would have
            self._ready = True
        return self._view

    def done(self) -> bool:
        return self._future.done()

    def settle(self) -> None:
        """Let the read land, ignoring its error (error paths: the buffer is about to be reused)."""
        wait_quietly([self._future])


@dataclass(eq=False)
class _Slot:
    """A pool buffer and what still uses it."""

    buffer: HostBuffer
    pending: object = None  # a write future whose source is this buffer
    event: object = None  # a CUDA event: the last copy out of this buffer to the device


@dataclass(eq=False)
class _Record:
    """One offloaded parameter."""

    param: torch.Tensor
    nbytes: int
    extent: Optional[Extent] = None  # None: kept in the host cache instead
    host: Optional[torch.Tensor] = None  # the host cache's copy (uint8), device parameters only
    users: int = 0  # fetches not yet released
    resident: bool = True
    dirty: bool = False
    prefetched: dict = field(default_factory=dict)  # piece index -> (_Slot, read future)
    writes: list = field(default_factory=list)  # write futures of this record's extent
    cls: type = None  # the parameter's class before offload, restored on undo
    name: str = "?"
    # The gradient store (offload_grads): its own extent; what it holds is valid only while p.grad is
    # the placeholder (torch's zero_grad(set_to_none=True) or a user's assignment replaces it).
    grad_extent: Optional[Extent] = None
    placeholder: Optional[torch.Tensor] = None
    grad_state: int = 0  # _NONE, _ZERO or _STORED
    grad_writes: list = field(default_factory=list)  # write futures of the grad extent
    grad_scales: list = field(default_factory=list)  # clip factors not yet applied to the stored bytes


class ParamStore:
    """Holds parameters' bytes on a swap space and materialises them on demand.

    Args:
        params: the parameters to offload (distinct, contiguous, each owning its whole storage).
        config: a :class:`offload.config.Config`; its ``offload_param`` block (nvme_path, buffer_count,
            buffer_size in elements, max_in_cpu, pin_memory) and ``aio`` block are used.
        name: a tag in the swap file name.
        offload_grads: give each parameter that requires grad an extent for its gradient (see
            :meth:`begin_grad` / :meth:`put_grad`).
        names: parameter -> a name for error messages.

    Every parameter is written to the swap space (or copied into the host cache) and released before
    this returns. The pool holds ``buffer_count`` buffers of ``buffer_size`` elements of the widest
    parameter dtype, rounded up to 4 KiB.
    """

    def __init__(self, params: Iterable[torch.Tensor], config: Config, *, name: str = "params",
                 offload_grads: bool = False, names: Optional[dict] = None):
        pc = config.offload_param
        params = list(params)
        self.config = config
        self.offload_grads = offload_grads
        # Set when a load of saved weights failed part-way: some extents hold old bytes, some new.
        self.error: Optional[BaseException] = None
        self._names = names or {}
        self.grad_bytes_read = 0
        self.grad_bytes_written = 0
        self.grad_resident_bytes = 0
        self.grad_resident_bytes_max = 0
        self.device = params[0].device if params else torch.device("cpu")
        self.records: dict[torch.Tensor, _Record] = {}
        self.kept_bytes = 0  # host-cache parameters of a CPU model: left in place, never offloaded
        self._lock = threading.RLock()
        self.bytes_read = 0
        self.bytes_written = 0
        self.cache_hits = 0
        self.prefetch_hits = 0
        self.prefetches_dropped = 0
        self.resident_bytes = 0
        self.resident_bytes_max = 0
        self.scheduler = None  # the module hooks using this store (set by offload_parameters)

        itemsize = max((p.element_size() for p in params), default=4)
        size = round_up(pc.buffer_size * itemsize, ALIGNMENT)
        self.pool = BufferPool(pc.buffer_count, size, pin_memory=pc.pin_memory)
        self._cuda = self.device.type == "cuda"
        # The host cache: smallest parameters first, since for them a disk request costs the most per byte.
        budget = pc.max_in_cpu
        cached = set()
        for p in sorted(params, key=lambda t: t.numel()):
            if p.numel() > budget:
                break
            budget -= p.numel()
            cached.add(p)
        on_disk = [p for p in params if p not in cached]
        reserve = sum(round_up(p.numel() * p.element_size(), ALIGNMENT) for p in on_disk)
        if offload_grads:
            reserve += sum(round_up(p.numel() * p.element_size(), ALIGNMENT) for p in params
                           if p.requires_grad and not (p in cached and not self._cuda))
        try:
            self.space = SwapSpace(pc.nvme_path, reserve, aio=config.aio, buffers=self.pool, name=name)
        except BaseException:
            self.pool.close()
            raise
        self.piece = self.pool.buffer_size // self.space.alignment * self.space.alignment
        self._free: deque[_Slot] = deque(_Slot(b) for b in self.pool)
        self._issued: list[_Record] = []  # records with prefetches in flight, oldest first
        # A GPU model's host cache: one block of page-aligned memory, pinned when the pool is
        # (torch's pinned allocator would round each parameter up to a power of two).
        cache_bytes = sum(round_up(p.numel() * p.element_size(), 64) for p in cached) if self._cuda else 0
        self._host_cache = HostBuffer(cache_bytes, pin_memory=self.pool[0].pinned) if cache_bytes else None
        self._host_used = 0
        try:
            for p in params:
                if p in cached and not self._cuda:
                    self.kept_bytes += p.numel() * p.element_size()
                else:
                    self._add(p, cached=p in cached)
            self._drain()
        except BaseException:
            self.close()
            raise

    # -- what the hooks and the optimizer call -------------------------------------------------

    def fetch(self, param: torch.Tensor, *, read: bool = True) -> None:
        """Make ``param`` resident (one more user); ``read=False``: the caller overwrites every element."""
        with self._lock:
            rec = self.records[param]
            if self.error is not None and not rec.resident:
                raise StateError(
                    f"parameter {rec.name} cannot be fetched: loading saved weights into this model failed "
                    f"part-way ({self.error}), so its weights are a mix of old and new. Load a checkpoint "
                    "(load_parameters, or load_checkpoint with model=) again.")
            rec.users += 1
            if rec.resident:
                return
            self._grow(rec)
            if not read:
                self._drop_prefetch(rec)
                return
            try:
                if rec.host is not None:
                    self._data(rec).copy_(rec.host, non_blocking=True)
                    self.cache_hits += 1
                else:
                    self._load(rec)
            except BaseException:
                rec.users -= 1
                self._shrink(rec)
                raise

    def release(self, param: torch.Tensor, *, dirty: bool = False) -> None:
        """One user fewer; with none left the storage is freed (written back first if anyone changed it)."""
        with self._lock:
            rec = self.records[param]
            if rec.users <= 0:
                raise RuntimeError("release() of a parameter that is not fetched")
            rec.dirty = rec.dirty or dirty
            rec.users -= 1
            if rec.users == 0:
                self._evict(rec)

    def prefetch(self, param: torch.Tensor) -> None:
        """Start reading ``param`` into free pool buffers, if any; never waits."""
        with self._lock:
            rec = self.records.get(param)
            if rec is None or rec.resident or rec.host is not None or rec.prefetched:
                return
            if any(not f.done() for f in rec.writes):
                return  # its latest bytes are still landing; read them when they are there
            for k in range(self._pieces(rec)):
                slot = self._take_free(wait=False)
                if slot is None:
                    break
                rec.prefetched[k] = (slot, self._read_piece(rec, k, slot))
            if rec.prefetched:
                self._issued.append(rec)

    # -- gradients (offload_grads) ------------------------------------------------------------
    #
    # A parameter's gradient lives in its grad extent while p.grad is the record's placeholder. The
    # backward calls begin_grad (a tensor hook, before torch accumulates into p.grad) and put_grad (a
    # post-accumulate-grad hook, after): begin_grad empties p.grad if it holds the placeholder, so
    # torch stores the new gradient alone; put_grad then writes it out, adding the stored one first
    # (buffer = stored; buffer += new, the same operation torch's accumulation does) and puts the
    # placeholder back. Anything else in p.grad at begin_grad (None after zero_grad(set_to_none=True),
    # or a tensor a user assigned) means the stored bytes are stale: torch's accumulation then starts
    # from that, and put_grad writes the result afresh.

    def holds_grad(self, param: torch.Tensor) -> bool:
        """Whether ``param``'s gradient is in the grad store (``param.grad`` is its placeholder)."""
        rec = self.records.get(param)
        return rec is not None and rec.placeholder is not None and param.grad is rec.placeholder

    def begin_grad(self, param: torch.Tensor) -> None:
        """Before torch accumulates a new gradient into ``param.grad``: step the placeholder aside."""
        with self._lock:
            rec = self.records[param]
            if rec.placeholder is not None and param.grad is rec.placeholder:
                param.grad = None
            else:
                rec.grad_state, rec.grad_scales = _NONE, []

    def put_grad(self, param: torch.Tensor) -> None:
        """After torch accumulated into ``param.grad``: move it to the grad store, leave the placeholder."""
        with self._lock:
            rec = self.records[param]
            g = param.grad
            if rec.grad_extent is None or g is None or g is rec.placeholder:
                return
            self._count_grad(rec.nbytes)
            try:
                self._write_grad(rec, g.detach())
            finally:
                self._count_grad(-rec.nbytes)
            param.grad = rec.placeholder
            rec.grad_state, rec.grad_scales = _STORED, []

    def mark_grad_zero(self, param: torch.Tensor) -> None:
        """``param.grad.zero_()`` on the placeholder: the stored gradient is zero from now on."""
        with self._lock:
            rec = self.records[param]
            rec.grad_state, rec.grad_scales = _ZERO, []

    def forget_grad(self, param: torch.Tensor) -> None:
        """The stored gradient is gone (``param.grad`` was set to None)."""
        with self._lock:
            rec = self.records.get(param)
            if rec is not None and param.grad is not rec.placeholder:
                rec.grad_state, rec.grad_scales = _NONE, []

    def scale_grad(self, param: torch.Tensor, coef: torch.Tensor) -> None:
        """Multiply the stored gradient by the 0-dim ``coef`` (applied when it is next read)."""
        with self._lock:
            rec = self.records[param]
            if rec.grad_state == _STORED:
                rec.grad_scales.append(coef.detach().to("cpu"))

    def grad_span(self, param: torch.Tensor, lo: int, hi: int) -> int:
        """Bytes of a buffer that :meth:`read_grad` of elements ``[lo, hi)`` occupies (whole aligned blocks)."""
        align, size = self.space.alignment, param.element_size()
        return round_up(hi * size, align) - (lo * size) // align * align

    def read_grad(self, param: torch.Tensor, lo: int, hi: int, buffer: HostBuffer,
                  buffer_offset: int) -> tuple[GradRead, int]:
        """Start reading elements ``[lo, hi)`` of the stored gradient into ``buffer`` at ``buffer_offset``.

        ``buffer_offset`` must be a multiple of the swap space's alignment. Returns the read (whose
        ``wait()`` gives the elements as a view into ``buffer``) and the bytes of ``buffer`` it spans.
        """
        with self._lock:
            rec = self.records[param]
            if not self.holds_grad(param):
                raise RuntimeError(f"parameter {rec.name} has no gradient in the grad store")
            align = self.space.alignment
            size = param.element_size()
            first, end = lo * size, hi * size
            a, b = first // align * align, round_up(end, align)
            view = buffer.view(param.dtype, buffer_offset + first - a, hi - lo)
            if rec.grad_state == _ZERO:
                return GradRead(CompletedFuture(), view, True, []), b - a
            _land(rec.grad_writes)  # the read must see the latest bytes
            ext = self.space.sub(rec.grad_extent, a, b - a)
            fut = self.space.read(ext, buffer, buffer_offset=buffer_offset, nbytes=b - a)
            self.grad_bytes_read += b - a
            return GradRead(fut, view, False, list(rec.grad_scales)), b - a

    def load_grad(self, param: torch.Tensor) -> Optional[torch.Tensor]:
        """A new tensor holding ``param``'s stored gradient (None without one), read through the pool."""
        with self._lock:
            rec = self.records.get(param)
            if rec is None or not self.holds_grad(param):
                return None
            out = torch.empty(param.shape, dtype=param.dtype, device=param.device)
            self._count_grad(rec.nbytes)
            self._count_grad(-rec.nbytes)  # the caller holds it; counted as one gradient resident at a time
            with torch._C.DisableTorchFunctionSubclass():
                if rec.grad_state == _ZERO:
                    return out.zero_()
                _land(rec.grad_writes)  # the read must see the latest bytes
                self.grad_bytes_read += self._read_into(rec, out.view(-1).view(torch.uint8), rec.grad_extent)
                for coef in rec.grad_scales:
                    out.mul_(coef)
            return out

    def reset_grad_peak(self) -> None:
        """Restart ``grad_resident_bytes_max`` from the gradient bytes resident now."""
        self.grad_resident_bytes_max = self.grad_resident_bytes

    @property
    def grad_swap_bytes(self) -> int:
        """Bytes of the swap space reserved for gradients."""
        return sum(r.grad_extent.nbytes for r in self.records.values() if r.grad_extent is not None)

    def is_resident(self, param: torch.Tensor) -> bool:
        return self.records[param].resident

    def users(self, param: torch.Tensor) -> int:
        return self.records[param].users

    def reset_peak(self) -> None:
        """Restart ``resident_bytes_max`` from the bytes resident now."""
        self.resident_bytes_max = self.resident_bytes

    @property
    def swap_bytes(self) -> int:
        """Bytes of parameters stored on the swap space."""
        return sum(r.extent.nbytes for r in self.records.values() if r.extent is not None)

    @property
    def host_cache_bytes(self) -> int:
        return sum(r.host.numel() for r in self.records.values() if r.host is not None)

    def restore(self) -> None:
        """Bring every parameter (and its offloaded gradient) back into memory for good, then close."""
        with self._lock:
            for rec in self.records.values():
                if not rec.resident:
                    self.fetch(rec.param)
                if rec.placeholder is not None and rec.param.grad is rec.placeholder:
                    rec.param.grad = self.load_grad(rec.param)
            self._drain()
        self.close()

    def close(self) -> None:
        """Forget the parameters, remove the swap file, free the pool.

        Resident parameters get their own class back; released ones stay empty and guarded (any use
        raises), as do gradient placeholders left in ``p.grad``.
        """
        with self._lock:
            for rec in self.records.values():
                if store_of(rec.param) is self:
                    del _STORES[id(rec.param)]
                if rec.resident and type(rec.param) is OffloadedParameter:
                    rec.param.__class__ = rec.cls
                    rec.param.__dict__.pop("_nvme_resident", None)
                    rec.param.__dict__.pop("_nvme_name", None)
            self._drain()
            self.records = {}
            if hasattr(self, "space"):
                self.space.close()
            if getattr(self, "_host_cache", None) is not None:
                self._host_cache.close()
            self.pool.close()

    # -- checkpoints (offload.checkpoint streams weights through the pool) ---------------------
    #
    # A checkpoint moves each parameter's bytes between its extent and a file through this store's
    # own pool, so saving or loading a model needs no memory beyond the pool, and nothing is fetched.
    # ``exclusive()`` holds the store still meanwhile (every write landed, no prefetch in flight);
    # ``current_bytes`` says where a parameter's latest bytes are (a resident or host-cached copy may
    # be newer than its extent), ``load_targets`` where new bytes must go so no stale copy survives.

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[list[HostBuffer]]:
        """Hold the store still for the block and lend the caller every pool buffer.

        Every write has landed and no prefetch is in flight when the block starts; no fetch,
        release or gradient write of another thread runs until it ends (they wait on the lock).
        """
        with self._lock:
            self._drain()
            slots = list(self._free)
            self._free.clear()
            try:
                yield [s.buffer for s in slots]
            finally:
                self._free.extend(slots)

    def current_bytes(self, param: torch.Tensor) -> tuple[Optional[Extent], Optional[torch.Tensor]]:
        """Where ``param``'s latest bytes are: ``(extent, None)`` or ``(None, flat uint8 tensor)``.

        A resident parameter's own storage (changed or not since the fetch) and the host cache's copy
        are newer than, or the only copy of, what is on disk. Call inside :meth:`exclusive`.
        """
        rec = self.records[param]
        if rec.resident:
            return None, self._data(rec)
        if rec.host is not None:
            return None, rec.host.reshape(-1)
        return rec.extent, None

    def load_targets(self, param: torch.Tensor) -> tuple[Optional[Extent], list[torch.Tensor]]:
        """Where new bytes for ``param`` must go: its extent (if any) and the in-memory copies to
        overwrite with them (its storage while resident, the host cache's copy). Call inside
        :meth:`exclusive`, then :meth:`loaded`."""
        rec = self.records[param]
        copies = []
        if rec.resident:
            copies.append(self._data(rec))
        if rec.host is not None:
            copies.append(rec.host.reshape(-1))
        return rec.extent, copies

    def loaded(self, params: Iterable[torch.Tensor]) -> None:
        """New weights of ``params`` are in place: their in-memory copies equal their extents now, and
        the stored gradients, which belonged to the old weights, are gone (as after ``zero_grad``)."""
        with self._lock:
            for p in params:
                rec = self.records[p]
                rec.dirty = False
                if rec.placeholder is not None and p.grad is rec.placeholder:
                    p.grad = None
                rec.grad_state, rec.grad_scales = _NONE, []
            self.error = None

    # -- internals ----------------------------------------------------------------------------

    def _add(self, p: torch.Tensor, *, cached: bool) -> None:
        nbytes = p.numel() * p.element_size()
        rec = _Record(p, nbytes, cls=type(p), name=self._names.get(p, f"of shape {tuple(p.shape)}"))
        if self.offload_grads and p.requires_grad:
            rec.grad_extent = self.space.alloc(nbytes)
            rec.placeholder = make_placeholder(p, rec.name, self.mark_grad_zero)
        if cached:
            rec.host = self._host_cache.tensor[self._host_used:self._host_used + nbytes]
            self._host_used += round_up(nbytes, 64)
            rec.host.copy_(self._data(rec))
        else:
            rec.extent = self.space.alloc(nbytes)
            self._store(rec)
        self.records[p] = rec
        _STORES[id(p)] = (weakref.ref(p), self)
        self.resident_bytes += nbytes
        # From here on a use of the released parameter raises instead of reading freed memory.
        p._nvme_name = rec.name
        p.__class__ = OffloadedParameter
        self._shrink(rec)

    def _data(self, rec: _Record) -> torch.Tensor:
        # .data: copies into it are not autograd's business and do not bump the version counter.
        return rec.param.data.reshape(-1).view(torch.uint8)

    def _pieces(self, rec: _Record) -> int:
        return -(-rec.nbytes // self.piece)

    def _piece_extent(self, rec: _Record, k: int, extent: Optional[Extent] = None) -> tuple[Extent, int]:
        extent = rec.extent if extent is None else extent
        start = k * self.piece
        n = min(self.piece, rec.nbytes - start)
        ext = self.space.sub(extent, start, n)
        return ext, n

    def _grow(self, rec: _Record) -> None:
        rec.param.untyped_storage().resize_(rec.nbytes)
        rec.resident = True
        rec.param._nvme_resident = True
        self.resident_bytes += rec.nbytes
        self.resident_bytes_max = max(self.resident_bytes_max, self.resident_bytes)

    def _shrink(self, rec: _Record) -> None:
        rec.resident = False
        rec.param._nvme_resident = False
        rec.param.untyped_storage().resize_(0)
        self.resident_bytes -= rec.nbytes

    def _evict(self, rec: _Record) -> None:
        if rec.dirty:
            if rec.host is not None:
                rec.host.copy_(self._data(rec))
            else:
                self._store(rec)
            rec.dirty = False
        self._shrink(rec)

    def _take_free(self, *, wait: bool) -> Optional[_Slot]:
        """A buffer nobody uses. ``wait=False``: only one with nothing in flight, else None."""
        if not wait:
            for _ in range(len(self._free)):
                slot = self._free[0]
                if (slot.pending is None or slot.pending.done()) and (
                        slot.event is None or slot.event.query()):
                    self._free.popleft()
                    self._settle(slot)
                    return slot
                self._free.rotate(-1)
            return None
        if not self._free:
            # Every buffer holds a prefetch: drop the one issued last (it is needed latest).
            victim = self._issued[-1]
            self._drop_prefetch(victim)
            self.prefetches_dropped += 1
        slot = self._free.popleft()
        self._settle(slot)
        return slot

    def _settle(self, slot: _Slot) -> None:
        if slot.pending is not None:
            slot.pending.wait()
            slot.pending = None
        if slot.event is not None:
            slot.event.synchronize()
            slot.event = None

    def _drop_prefetch(self, rec: _Record) -> None:
        for slot, fut in rec.prefetched.values():
            wait_quietly([fut])  # a failed read nobody needs is no error; the buffer must be idle
            self._free.append(slot)
        rec.prefetched.clear()
        if rec in self._issued:
            self._issued.remove(rec)

    def _read_piece(self, rec: _Record, k: int, slot: _Slot):
        ext, n = self._piece_extent(rec, k)
        fut = self.space.read(ext, slot.buffer, nbytes=n)
        self.bytes_read += ext.nbytes
        return fut

    def _load(self, rec: _Record) -> None:
        """Fill ``rec``'s (grown) storage from the swap space, pieces pipelined over free buffers."""
        _land(rec.writes)  # the read must see the latest bytes
        pending = rec.prefetched
        rec.prefetched = {}
        if rec in self._issued:
            self._issued.remove(rec)
        if pending:
            self.prefetch_hits += 1
        self.bytes_read += self._read_into(rec, self._data(rec), rec.extent, pending)

    def _read_into(self, rec: _Record, dst: torch.Tensor, extent: Extent, pending: Optional[dict] = None) -> int:
        """Fill ``dst`` (``rec.nbytes`` flat bytes) from ``extent``, pieces read ahead over free buffers;
        ``pending`` holds pieces already in flight (prefetches, counted when issued). Returns the bytes
        this call read from disk."""
        pending = {} if pending is None else pending
        moved = 0

        def issue(k: int, slot: _Slot):
            nonlocal moved
            ext, nb = self._piece_extent(rec, k, extent)
            moved += ext.nbytes
            return self.space.read(ext, slot.buffer, nbytes=nb)

        n = self._pieces(rec)
        try:
            for k in range(n):
                j = k
                while j < n and len(pending) < len(self.pool):
                    if j not in pending:
                        slot = self._take_free(wait=False)
                        if slot is None:
                            break
                        pending[j] = (slot, issue(j, slot))
                    j += 1
                if k not in pending:
                    # We hold no buffer now (pieces are issued in order): one is free or can be taken.
                    slot = self._take_free(wait=True)
                    pending[k] = (slot, issue(k, slot))
                slot, fut = pending.pop(k)
                fut.wait()
                start = k * self.piece
                nb = min(self.piece, rec.nbytes - start)
                dst[start:start + nb].copy_(slot.buffer.tensor[:nb], non_blocking=self._cuda)
                if self._cuda:
                    slot.event = torch.cuda.Event()
                    slot.event.record()
                self._free.append(slot)
        finally:
            for slot, fut in pending.values():
                wait_quietly([fut])
                self._free.append(slot)
        return moved

    def _store(self, rec: _Record) -> None:
        """Write ``rec``'s (resident) bytes to its extent; the writes land while the caller goes on."""
        src = self._data(rec)
        _land(rec.writes)  # requests complete in any order: an old write must not land after this one
        for k in range(self._pieces(rec)):
            slot = self._take_free(wait=True)
            ext, n = self._piece_extent(rec, k)
            start = k * self.piece
            slot.buffer.tensor[:n].copy_(src[start:start + n])
            self.bytes_written += self._write_piece(slot, ext, n, rec.writes)
            self._free.append(slot)

    def _write_piece(self, slot, ext: Extent, n: int, futures: list) -> int:
        """Write the first ``n`` bytes of ``slot``'s buffer to ``ext``; the future goes to the slot and
        to ``futures``. Returns the bytes that reach the disk (``n`` rounded up to the alignment)."""
        if n < ext.nbytes:
            # The tail of the last block goes to disk too: make it deterministic, not stale bytes.
            slot.buffer.tensor[n:ext.nbytes].zero_()
        fut = self.space.write(ext, slot.buffer, nbytes=n)
        slot.pending = fut
        futures.append(fut)
        return ext.nbytes

    def _count_grad(self, nbytes: int) -> None:
        self.grad_resident_bytes += nbytes
        self.grad_resident_bytes_max = max(self.grad_resident_bytes_max, self.grad_resident_bytes)

    def _write_grad(self, rec: _Record, grad: torch.Tensor) -> None:
        """Write ``grad`` to ``rec``'s grad extent, added to what is stored there (per ``rec.grad_state``)."""
        _land(rec.grad_writes)  # earlier writes of this extent first: a read-add sees them, a rewrite follows them
        with torch._C.DisableTorchFunctionSubclass():
            src = grad.reshape(-1)
            if not src.is_contiguous():
                src = src.contiguous()
            raw = src.view(torch.uint8)
            size = src.element_size()
            for k in range(self._pieces(rec)):
                slot = self._take_free(wait=True)
                try:
                    ext, n = self._piece_extent(rec, k, rec.grad_extent)
                    start = k * self.piece
                    if rec.grad_state == _NONE:
                        slot.buffer.tensor[:n].copy_(raw[start:start + n])
                    else:
                        view = slot.buffer.view(src.dtype, 0, n // size)
                        if rec.grad_state == _STORED:
                            self.space.read(ext, slot.buffer, nbytes=n).wait()
                            self.grad_bytes_read += ext.nbytes
                            for coef in rec.grad_scales:
                                view.mul_(coef)
                        else:
                            view.zero_()  # zero_grad(set_to_none=False): torch adds into zeros, so do we
                        piece = src[start // size:(start + n) // size]
                        view.add_(piece if piece.device.type == "cpu" else piece.to("cpu"))
                    self.grad_bytes_written += self._write_piece(slot, ext, n, rec.grad_writes)
                finally:
                    self._free.append(slot)

    def _drain(self) -> None:
        """Let every write and prefetch land (before closing, or before the files are read elsewhere)."""
        for rec in list(self._issued):
            self._drop_prefetch(rec)
        for slot in self._free:
            self._settle(slot)
        for rec in self.records.values():
            rec.writes.clear()  # every write's source is a pool buffer, settled above
            rec.grad_writes.clear()


@contextlib.contextmanager
def resident(params: Iterable[torch.Tensor], *, dirty: bool = False) -> Iterator[None]:
    """Fetch those of ``params`` whose weights are on NVMe for the block; release them after it.

    Ordinary parameters are left alone. ``dirty=True`` writes the fetched ones back afterwards.
    """
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


def _land(futures: list) -> None:
    """Wait for every write of an extent, in the order issued, and forget them."""
    for fut in futures:
        fut.wait()
    futures.clear()
