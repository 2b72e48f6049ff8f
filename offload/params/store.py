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

import threading
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch

from ..buffers import BufferPool, HostBuffer
from ..config import Config
from ..space import Extent, SwapSpace

__all__ = ["ParamStore", "store_of"]

_ALIGN = 4096

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


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


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


class ParamStore:
    """Holds parameters' bytes on a swap space and materialises them on demand.

    Args:
        params: the parameters to offload (distinct, contiguous, each owning its whole storage).
        config: a :class:`offload.config.Config`; its ``offload_param`` block (nvme_path, buffer_count,
            buffer_size in elements, max_in_cpu, pin_memory) and ``aio`` block are used.
        name: a tag in the swap file name.

    Every parameter is written to the swap space (or copied into the host cache) and released before
    this returns. The pool holds ``buffer_count`` buffers of ``buffer_size`` elements of the widest
    parameter dtype, rounded up to 4 KiB.
    """

    def __init__(self, params: Iterable[torch.Tensor], config: Config, *, name: str = "params"):
        pc = config.offload_param
        params = list(params)
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

        itemsize = max((p.element_size() for p in params), default=4)
        size = _round_up(pc.buffer_size * itemsize, _ALIGN)
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
        reserve = sum(_round_up(p.numel() * p.element_size(), _ALIGN) for p in on_disk)
        try:
            self.space = SwapSpace(pc.nvme_path, reserve, aio=config.aio, buffers=self.pool, name=name)
        except BaseException:
            self.pool.close()
            raise
        self.piece = self.pool.buffer_size // self.space.alignment * self.space.alignment
        self._free: deque[_Slot] = deque(_Slot(b) for b in self.pool)
        self._issued: list[_Record] = []  # records with prefetches in flight, oldest first
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
        """Bring every parameter back into its own storage for good, then close."""
        with self._lock:
            for rec in self.records.values():
                if not rec.resident:
                    self.fetch(rec.param)
            self._drain()
        self.close()

    def close(self) -> None:
        """Forget the parameters (released ones stay empty), remove the swap file, free the pool."""
        with self._lock:
            for rec in self.records.values():
                if store_of(rec.param) is self:
                    del _STORES[id(rec.param)]
            self._drain()
            self.records = {}
            if hasattr(self, "space"):
                self.space.close()
            self.pool.close()

    # -- internals ----------------------------------------------------------------------------

    def _add(self, p: torch.Tensor, *, cached: bool) -> None:
        nbytes = p.numel() * p.element_size()
        rec = _Record(p, nbytes)
        if cached:
            host = self._data(rec).to("cpu", copy=True)
            rec.host = host.pin_memory() if self._cuda and self.pool[0].pinned else host
        else:
            rec.extent = self.space.alloc(nbytes)
            self._store(rec)
        self.records[p] = rec
        _STORES[id(p)] = (weakref.ref(p), self)
        self.resident_bytes += nbytes
        self._shrink(rec)

    def _data(self, rec: _Record) -> torch.Tensor:
        # .data: copies into it are not autograd's business and do not bump the version counter.
        return rec.param.data.reshape(-1).view(torch.uint8)

    def _pieces(self, rec: _Record) -> int:
        return -(-rec.nbytes // self.piece)

    def _piece_extent(self, rec: _Record, k: int) -> tuple[Extent, int]:
        start = k * self.piece
        n = min(self.piece, rec.nbytes - start)
        ext = Extent(rec.extent.offset + start, _round_up(n, self.space.alignment), rec.extent.owner)
        return ext, n

    def _grow(self, rec: _Record) -> None:
        rec.param.untyped_storage().resize_(rec.nbytes)
        rec.resident = True
        self.resident_bytes += rec.nbytes
        self.resident_bytes_max = max(self.resident_bytes_max, self.resident_bytes)

    def _shrink(self, rec: _Record) -> None:
        rec.param.untyped_storage().resize_(0)
        rec.resident = False
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
            _quiet_wait(fut)  # a failed read nobody needs is no error; the buffer must be idle
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
        for fut in rec.writes:
            fut.wait()  # the read must see the latest bytes
        rec.writes.clear()
        pending = rec.prefetched
        rec.prefetched = {}
        if rec in self._issued:
            self._issued.remove(rec)
        if pending:
            self.prefetch_hits += 1
        dst = self._data(rec)
        n = self._pieces(rec)
        try:
            for k in range(n):
                j = k
                while j < n and len(pending) < len(self.pool):
                    if j not in pending:
                        slot = self._take_free(wait=False)
                        if slot is None:
                            break
                        pending[j] = (slot, self._read_piece(rec, j, slot))
                    j += 1
                if k not in pending:
                    # We hold no buffer now (pieces are issued in order): one is free or can be taken.
                    slot = self._take_free(wait=True)
                    pending[k] = (slot, self._read_piece(rec, k, slot))
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
                _quiet_wait(fut)
                self._free.append(slot)

    def _store(self, rec: _Record) -> None:
        """Write ``rec``'s (resident) bytes to its extent; the writes land while the caller goes on."""
        src = self._data(rec)
        rec.writes = [f for f in rec.writes if not f.done()]
        for k in range(self._pieces(rec)):
            slot = self._take_free(wait=True)
            ext, n = self._piece_extent(rec, k)
            start = k * self.piece
            slot.buffer.tensor[:n].copy_(src[start:start + n])
            if n % self.space.alignment:
                # The tail of the last block goes to disk too: make it deterministic, not stale bytes.
                slot.buffer.tensor[n:_round_up(n, self.space.alignment)].zero_()
            fut = self.space.write(ext, slot.buffer, nbytes=n)
            self.bytes_written += ext.nbytes
            slot.pending = fut
            rec.writes.append(fut)
            self._free.append(slot)

    def _drain(self) -> None:
        """Let every write and prefetch land (before closing, or before the files are read elsewhere)."""
        for rec in list(self._issued):
            self._drop_prefetch(rec)
        for slot in self._free:
            self._settle(slot)
        for rec in self.records.values():
            rec.writes.clear()


def _quiet_wait(fut) -> None:
    try:
        fut.wait()
    except OSError:
        pass
