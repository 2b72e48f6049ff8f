"""The parameter store: each offloaded parameter's bytes in one extent, materialised on demand."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch

from .. import copies
from .._proc import heap_freed
from ..aio import wait_quietly
from ..buffers import BufferPool
from ..bytes import ByteStore, Stored
from ..config import Config
from ..copies import DONE, Ticket
from ..errors import StateError
from ..space import Extent, SwapSpace
from . import registry
from .checkpointing import Checkpointing
from .gradstore import GradStore
from .guard import OffloadedParameter
from .handoff import Handoff
from .mapped import MappedMemory, Region, regions
from .placement import HostCache, pool_buffer_bytes, reserve, smallest_within
from .transfer import BufferLender, NoPool, TensorIO

__all__ = ["ParamStore"]


@dataclass(eq=False, kw_only=True)
class _Record(Stored):
    """One offloaded parameter: its bytes (``extent``, None when kept in the host cache instead; the writes
    and checksums of its blocks) and its residency."""

    param: torch.Tensor
    host: Optional[torch.Tensor] = None  # the host cache's copy (uint8), device parameters only
    copying: Ticket = DONE  # the last copy between ``host`` and the parameter's device
    users: int = 0  # fetches not yet released
    resident: bool = True
    dirty: bool = False
    loads: int = 0  # times new weights were put in place from outside (load_parameters, load_safetensors)
    prefetched: dict = field(default_factory=dict)  # block index -> (PoolBuffer, read future)
    region: Optional[Region] = None  # a CPU weight's pages (see offload.params.mapped), else resized to free
    cls: type = None  # the parameter's class before offload, restored on undo
    name: str = "?"

    def data(self) -> torch.Tensor:
        """The parameter's bytes, flat (uint8)."""
        # .data: copies into it are not autograd's business and do not bump the version counter. A plain
        # tensor, not a guarded view: the store reads and writes it only while it holds the bytes.
        with torch._C.DisableTorchFunctionSubclass():
            return self.param.data.reshape(-1).view(torch.uint8)

    def what(self) -> str:
        """What the bytes are, for messages."""
        return f"the offloaded weights of {self.name}"


# NOTE: a released parameter keeps its Python object, shape, dtype, device and requires_grad; only its
# storage is shrunk to zero bytes (``untyped_storage().resize_(0)``, as FSDP does). A fetch grows the
# SAME storage object back and fills it, so every alias of the parameter (autograd's saved tensors,
# ``weight.t()`` views, activation checkpointing's detached copies) sees the fetched bytes again.
# Bytes move through a fixed pool of page-aligned buffers (O_DIRECT needs aligned memory; a
# parameter's own storage is not) in blocks of one buffer, pipelined (TensorIO). Everything here runs
# under one lock: autograd may call hooks from its own device threads.
class ParamStore(Checkpointing):
    """Holds parameters' bytes on a swap space and materialises them on demand.

    Args:
        params: the parameters to offload (distinct, contiguous, each owning its whole storage).
        config: a :class:`offload.config.Config`; its ``offload_param`` block (nvme_path, buffer_count,
            buffer_size in elements, max_in_cpu, pin_memory) and ``aio`` block are used.
        name: a tag in the swap file name.
        offload_grads: give each parameter that requires grad a place in the grad store (``grads``).
        names: parameter -> a name for error messages.
        handoff: the overlap hand-off between this store's hooks and an optimizer (a new one if None).
        fresh: parameters with no values yet (their storage empty; see :mod:`offload.params.meta`): they
            get their place but nothing is written for them.
        guard: make each released parameter an ``OffloadedParameter`` (any torch use raises). ``False`` for
            tensors that are not the user's parameters (FSDP2's sharded buffers, see :mod:`offload.params.shards`):
            their class stays, and their owner's hooks keep every read of them inside a fetch.

    Every parameter is written to the swap space (or copied into the host cache) and released before
    this returns. The pool holds ``buffer_count`` buffers of at most ``buffer_size`` elements of the widest
    parameter dtype (rounded up to 4 KiB), each no larger than the largest weight or gradient on NVMe (whole
    MiB); with nothing on NVMe it has no buffers (see :func:`offload.params.placement.pool_buffer_bytes`).
    """

    def __init__(self, params: Iterable[torch.Tensor], config: Config, *, name: str = "params",
                 offload_grads: bool = False, names: Optional[dict] = None, handoff: Optional[Handoff] = None,
                 fresh: Iterable[torch.Tensor] = (), guard: bool = True):
        pc = config.offload_param
        self._guard = guard
        params = list(params)
        self.config = config
        self.offload_grads = offload_grads
        self._names = names or {}
        self.device = params[0].device if params else torch.device("cpu")
        self.records: dict[torch.Tensor, _Record] = {}
        # Host-cache parameters of a CPU model: left in place, never offloaded (a figure users read, see
        # docs/integrations.md).
        self.kept_bytes = 0
        self._lock = threading.RLock()
        self.bytes_read = self.bytes_written = 0
        self.cache_hits = self.prefetch_hits = self.prefetches_dropped = 0
        self.resident_bytes = self.resident_bytes_max = 0
        # Between the hooks and an optimizer updating during backward (overlap_backward).
        self.handoff = handoff if handoff is not None else Handoff()
        self._issued: list[_Record] = []  # records with prefetches in flight, oldest first

        # A device model's weights cross to it by copies (and its host cache is a copy of them); a CPU model's
        # are used where they are.
        self._on_device = copies.crosses(self.device)
        cached = smallest_within(params, pc.max_in_cpu)
        size, needed = pool_buffer_bytes(params, cached, grads=offload_grads, on_device=self._on_device,
                                         max_grad_in_cpu=pc.max_grad_in_cpu, buffer_size=pc.buffer_size,
                                         itemsize=max((p.element_size() for p in params), default=4))
        pin = pc.pin_memory if pc.pin_memory != "auto" else self.device.type == "cuda"
        self.pool = BufferPool(pc.buffer_count, size, pin_memory=pin,
                               keys=("offload_param.buffer_count", "offload_param.buffer_size")) if needed \
            else NoPool(size)
        self.pinned = self.pool[0].pinned if len(self.pool) else bool(pin)  # the host memory made beside it
        self._host_cache = self.space = self.grads = None
        self._memory = MappedMemory()
        try:
            self._open(name)
            self._take_in(params, cached, {id(p) for p in fresh})
            self._quiesce()
        except BaseException:
            self.close()
            raise

    def _open(self, name: str) -> None:
        """The swap space, the byte store on it, and the pool's lender, transfers and grad store."""
        pc = self.config.offload_param
        self.space = SwapSpace(pc.nvme_path, 0, aio=self.config.aio, buffers=self.pool, name=name)
        # Weights are fetched one parameter at a time: a block whose bytes changed on disk names itself
        # at each fetch, and fails nothing else.
        self.bytes = ByteStore(self.space, self.pool.buffer_size // self.space.alignment * self.space.alignment,
                               checksum=pc.checksum, mismatch_fails=False, remedy=(
                                   "Load a checkpoint (load_checkpoint(..., model=) or load_parameters) to "
                                   "restore it."))
        self.lender = BufferLender(self.pool, self._drop_latest_prefetch)
        self.io = TensorIO(self.bytes, self.lender)
        self.grads = GradStore(self.io, self._lock, pin_memory=self.pinned)

    def _take_in(self, params: list, cached: set, fresh_ids: set) -> None:
        """Reserve every extent, then offload each parameter; a CPU model's ``cached`` ones stay where they are,
        a device model's are copied into the host cache."""
        extent_of, grad_extent_of = reserve(self.space, params, cached, grads=self.offload_grads,
                                            on_device=self._on_device,
                                            max_grad_in_cpu=self.config.offload_param.max_grad_in_cpu)
        self._host_cache = HostCache(cached if self._on_device else (), pin_memory=self.pinned)
        for p in params:
            if p in cached and not self._on_device:
                self.kept_bytes += p.numel() * p.element_size()
            else:
                self._add(p, extent_of.get(id(p)), id(p) in grad_extent_of, grad_extent_of.get(id(p)),
                          fresh=id(p) in fresh_ids)

    # -- what the hooks and the optimizer call -------------------------------------------------

    def fetch(self, param: torch.Tensor, *, read: bool = True) -> None:
        """Make ``param`` resident (one more user); ``read=False``: the caller overwrites every element."""
        with self._lock:
            rec = self.records[param]
            if self.error is not None and not rec.resident:
                raise StateError(
                    f"parameter {rec.name} cannot be fetched: a load of saved weights or a write-back of weights "
                    f"failed part-way ({self.error}), so the offloaded weights are lost or a mix of old and new. "
                    "Load a checkpoint (load_parameters, or load_checkpoint with model=) again."
                ) from self.error
            rec.users += 1
            if rec.resident:
                return
            rec.copying.wait()  # its last write-back into the host cache still reads the storage it had
            self._grow(rec)
            if not read:
                self._drop_prefetch(rec)
                return
            try:
                if rec.host is not None:
                    rec.copying = copies.into_device(rec.data(), rec.host)
                    self.cache_hits += 1
                else:
                    self._load(rec)
            except BaseException:
                rec.users -= 1
                self._shrink(rec)
                raise

    def release(self, param: torch.Tensor, *, dirty: bool = False) -> None:
        """One user fewer; with none left the storage is freed (written back first if anyone changed it)."""
        freed = 0
        with self._lock:
            rec = self.records[param]
            if rec.users <= 0:
                raise RuntimeError("release() of a parameter that is not fetched")
            rec.dirty = rec.dirty or dirty
            rec.users -= 1
            if rec.users == 0:
                self._evict(rec)
                freed = 0 if self._on_device or rec.region is not None else rec.nbytes
        if freed:
            heap_freed(freed)  # freed weights must not pile up in the C heap (offload._proc); outside the lock

    def prefetch(self, param: torch.Tensor) -> None:
        """Start reading ``param`` into free pool buffers, if any; never waits."""
        with self._lock:
            rec = self.records.get(param)
            if rec is None or rec.resident or rec.host is not None or rec.prefetched:
                return
            if any(not f.done() for f in rec.writes):
                return  # its latest bytes are still landing; read them when they are there
            for k in range(self.bytes.block_count(rec.nbytes)):
                pbuf = self.lender.take(wait=False)
                if pbuf is None:
                    break
                rec.prefetched[k] = (pbuf, self.bytes.read(rec, pbuf.buffer, k, what=rec.what))
                self.bytes_read += self.bytes.block(rec, k)[0].nbytes
            if rec.prefetched:
                self._issued.append(rec)

    # -- gradients (offload_grads): see GradStore ----------------------------------------------

    def holds_grad(self, param: torch.Tensor) -> bool:
        """Whether ``param``'s gradient is in the grad store (``param.grad`` is its placeholder)."""
        return self.grads.holds(param)

    def load_grad(self, param: torch.Tensor) -> Optional[torch.Tensor]:
        """A new tensor holding ``param``'s stored gradient (None without one), read through the pool."""
        return self.grads.load(param)

    @property
    def grad_bytes_read(self) -> int:
        """Bytes of gradients read from the swap space so far."""
        return self.grads.bytes_read

    @property
    def grad_bytes_written(self) -> int:
        """Bytes of gradients written to the swap space so far."""
        return self.grads.bytes_written

    @property
    def grad_resident_bytes(self) -> int:
        """Bytes of gradients in host memory on their way to the swap space now."""
        return self.grads.resident_bytes

    @property
    def grad_resident_bytes_max(self) -> int:
        """The most :attr:`grad_resident_bytes` has been since :meth:`reset_grad_peak`."""
        return self.grads.resident_bytes_max

    def reset_grad_peak(self) -> None:
        """Restart ``grad_resident_bytes_max`` from the gradient bytes resident now."""
        self.grads.reset_peak()

    # -- failures -------------------------------------------------------------------------------

    @property
    def error(self) -> Optional[BaseException]:
        """Why offloaded weights are lost or half loaded (a load failed part-way, a write-back failed), or
        ``None``. Setting it marks the byte store failed (``None``: restored)."""
        return self.bytes.error

    @error.setter
    def error(self, err: Optional[BaseException]) -> None:
        if err is None:
            self.bytes.mark_restored()
        else:
            self.bytes.mark_failed(err)

    # -- introspection ------------------------------------------------------------------------

    def is_resident(self, param: torch.Tensor) -> bool:
        """Whether ``param``'s weights are in memory now."""
        return self.records[param].resident

    def users(self, param: torch.Tensor) -> int:
        """How many fetches of ``param`` are not released yet."""
        return self.records[param].users

    def reset_peak(self) -> None:
        """Restart ``resident_bytes_max`` from the bytes resident now."""
        self.resident_bytes_max = self.resident_bytes

    @property
    def swap_bytes(self) -> int:
        """Bytes of parameters stored on the swap space."""
        return sum(r.extent.nbytes for r in self.records.values() if r.extent is not None)

    @property
    def grad_host_bytes(self) -> int:
        """Host memory holding gradients kept off the disk (``max_grad_in_cpu``) now."""
        return self.grads.host_bytes

    @property
    def grad_swap_bytes(self) -> int:
        """Bytes of the swap space reserved for gradients."""
        return self.grads.swap_bytes

    @property
    def host_cache_bytes(self) -> int:
        """Host memory of the host cache's copies of device parameters."""
        return sum(r.host.numel() for r in self.records.values() if r.host is not None)

    # -- lifetime -------------------------------------------------------------------------------

    def restore(self) -> None:
        """Bring every parameter (and its offloaded gradient) back into memory for good, then close."""
        with self._lock:
            for rec in self.records.values():
                if not rec.resident:
                    self.fetch(rec.param)
                if self.grads.consumed(rec.param):
                    rec.param.grad = None  # the update took it during backward (overlap_backward)
                elif self.grads.holds(rec.param):
                    rec.param.grad = self.grads.load(rec.param)
            self._quiesce()
        self.close()

    def close(self) -> None:
        """Forget the parameters, remove the swap file, free the pool.

        Resident parameters get their own class back; released ones stay empty and guarded (any use
        raises), as do gradient placeholders left in ``p.grad``.
        """
        with self._lock:
            for rec in self.records.values():
                registry.forget(rec.param, self)
                if rec.resident and type(rec.param) is OffloadedParameter:
                    rec.param.__class__ = rec.cls
                    rec.param.__dict__.pop("_nvme_resident", None)
                    rec.param.__dict__.pop("_nvme_name", None)
            if self.space is not None:
                self._quiesce()
            self.records = {}
            if self.space is not None:
                self.space.close()
            if self._host_cache is not None:
                self._host_cache.close()
            self._memory.close()
            if self.grads is not None:
                self.grads.close()
            self.pool.close()

    # -- internals ----------------------------------------------------------------------------

    def _add(self, p: torch.Tensor, extent: Optional[Extent], grad: bool, grad_extent: Optional[Extent], *,
             fresh: bool) -> None:
        """Take ``p`` in; ``fresh``: it has no values yet, so none are copied or written."""
        nbytes = p.numel() * p.element_size()
        rec = _Record(param=p, nbytes=nbytes, cls=type(p), name=self._names.get(p, f"of shape {tuple(p.shape)}"))
        if grad:
            self.grads.add(p, grad_extent, rec.name)  # no extent: kept in host memory
        if extent is None:
            rec.host = self._host_cache.take(nbytes)
            if not fresh:
                rec.host.copy_(rec.data())
        else:
            rec.extent = extent
            if not fresh:
                self._store(rec)
        self.records[p] = rec
        registry.register(p, self)
        self.resident_bytes += nbytes
        # From here on a use of the released parameter raises instead of reading freed memory.
        p._nvme_name = rec.name
        if self._guard:
            p.__class__ = OffloadedParameter
        self._map(rec)
        self._shrink(rec)

    def _map(self, rec: _Record) -> None:
        """Put a CPU weight's storage on pages of its own (see :mod:`offload.params.mapped`), its bytes written
        already (or none yet: a fresh one): the storage object stays, every alias of it too."""
        if self._on_device or rec.host is not None or rec.nbytes == 0:
            return  # a device's memory is freed by shrinking the storage, as before
        st = rec.param.untyped_storage()
        mine = regions.get(rec.param)
        if mine is not None and mine.storage.data_ptr() == st.data_ptr() and st.nbytes() == rec.nbytes:
            rec.region = mine  # offloaded before (and restored since): its pages are already its own
            return
        if not st.resizable():
            # NumPy (tensor.numpy()) or another foreign owner shares the bytes: moving them would leave it
            # pointing at freed memory, so torch forbids it. The weights stay resident (and written back).
            raise RuntimeError(
                f"the weights of {rec.name} cannot be released to NVMe: their memory is shared with a NumPy array "
                "or another non-resizable view (for instance from param.detach().numpy()). Take copies instead "
                "(param.detach().clone().numpy()); to go on with this model, restore_parameters(model) and "
                "offload_parameters again.")
        region = self._memory.region(rec.nbytes)
        if region is None:
            return
        st._swap_data_ptr_(region.storage)  # region.storage now holds the old memory, freed with it
        region.storage = st
        rec.region = regions[rec.param] = region

    def _check_storage(self, rec: _Record) -> None:
        """Refuse a CPU weight whose storage is no longer its pages: ``set_()`` on the parameter itself, which
        torch does not let the guard see, gave it another one (the store would move bytes to and from memory
        the weight does not use)."""
        if rec.region is not None and rec.param.untyped_storage().data_ptr() != rec.region.storage.data_ptr():
            err = StateError(f"parameter {rec.name} was given another storage (set_() on it, which the guard "
                             "cannot see), so its offloaded weights no longer are its values. Change an offloaded "
                             "weight in place inside `with offload.params.materialized(model, modified=True):`; "
                             "restore_parameters(model) and offload again to go on")
            self.error = err
            raise err

    def _grow(self, rec: _Record) -> None:
        self._check_storage(rec)
        if rec.region is None:
            rec.param.untyped_storage().resize_(rec.nbytes)
        # (A CPU weight's pages are there, reading zeros: the fetch writes its bytes into them.)
        rec.resident = True
        rec.param._nvme_resident = True
        self.resident_bytes += rec.nbytes
        self.resident_bytes_max = max(self.resident_bytes_max, self.resident_bytes)

    def _shrink(self, rec: _Record) -> None:
        self._check_storage(rec)
        rec.resident = False
        rec.param._nvme_resident = False
        if rec.region is not None:
            rec.region.drop()
        else:
            rec.param.untyped_storage().resize_(0)
        self.resident_bytes -= rec.nbytes

    def _evict(self, rec: _Record) -> None:
        if rec.dirty:
            if rec.host is not None:
                rec.copying.wait()  # the copy from the host cache at the fetch no longer reads it
                rec.copying = copies.to_host(rec.host, rec.data())
            else:
                self._store(rec)
            rec.dirty = False
        self._shrink(rec)

    def _drop_prefetch(self, rec: _Record) -> None:
        for pbuf, fut in rec.prefetched.values():
            wait_quietly([fut])  # a failed read nobody needs is no error; the buffer must be idle
            self.lender.give(pbuf)
        rec.prefetched.clear()
        if rec in self._issued:
            self._issued.remove(rec)

    def _drop_latest_prefetch(self) -> None:
        """Every buffer holds a prefetch: drop the one issued last (it is needed latest)."""
        self._drop_prefetch(self._issued[-1])
        self.prefetches_dropped += 1

    def _load(self, rec: _Record) -> None:
        """Fill ``rec``'s (grown) storage from the swap space; prefetched blocks are used first."""
        self._land(rec)  # the read must see the latest bytes
        pending, rec.prefetched = rec.prefetched, {}
        if rec in self._issued:
            self._issued.remove(rec)
            self.prefetch_hits += 1
        self.bytes_read += self.io.read_into(rec.data(), rec, pending=pending, what=rec.what)

    def _store(self, rec: _Record) -> None:
        """Write ``rec``'s (resident) bytes to its extent; the writes land while the caller goes on."""
        self._land(rec)  # requests complete in any order: an old write must not land after this one
        self.bytes_written += self.io.write_from(rec.data(), rec)

    def _land(self, rec: _Record) -> None:
        """Wait for every write of ``rec``'s extent. A failed one lost the weights it carried: the store
        is failed (fetches raise ``StateError``) until a checkpoint is loaded."""
        self.bytes.land(rec)

    def _quiesce(self) -> None:
        """Let every write and prefetch land (before closing, or before the files are read elsewhere)."""
        for rec in list(self._issued):
            self._drop_prefetch(rec)
        self.lender.wait_idle()
        copies.waited(rec.copying for rec in self.records.values())  # the host cache holds the latest bytes
        failed = None
        for rec in self.records.values():
            try:
                self._land(rec)
            except OSError as err:
                failed = failed or err
        self.grads.forget_landed()
        if failed is not None:
            raise failed

