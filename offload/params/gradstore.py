"""The grad store: each offloaded parameter's gradient in its own extent while ``p.grad`` is a placeholder."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Optional

import torch

from .. import copies
from ..aio import CompletedFuture, wait_quietly
from ..buffers import HostBuffer
from ..bytes import Stored
from ..copies import DONE, Ticket
from ..sizes import round_up
from ..space import Extent
from .guard import make_placeholder
from .transfer import TensorIO

__all__ = ["GradRead", "GradStore"]

_NONE, _ZERO, _STORED, _CONSUMED = 0, 1, 2, 3  # what a grad extent holds (_CONSUMED: see consume())


class GradRead:
    """A read of part of a stored gradient into a host buffer.

    ``wait()`` waits for the bytes, then gives the elements as a typed view with pending clip factors
    applied (once, however often it is called).
    """

    def __init__(self, future, view: torch.Tensor, zero: bool, scales: list):
        self._future, self._view, self._zero, self._scales = future, view, zero, scales
        self._ready = False

    def wait(self) -> torch.Tensor:
        """The gradient's elements once read, with the pending clip factors applied (once)."""
        if not self._ready:
            self._future.wait()
            if self._zero:
                self._view.zero_()
            for coef in self._scales:
                self._view.mul_(coef)  # pending clip factors, applied in order as torch would have
            self._ready = True
        return self._view

    def done(self) -> bool:
        """Whether the read has landed."""
        return self._future.done()

    def wait_quietly(self) -> None:
        """Let the read land, ignoring its error (error paths: the buffer is about to be reused)."""
        wait_quietly([self._future])


@dataclass(eq=False, kw_only=True)
class _Grad(Stored):
    """One parameter's gradient in the store (``extent`` None: kept in host memory, ``host``, instead). Its
    bytes are valid only while ``p.grad`` is the placeholder (torch's zero_grad(set_to_none=True) or a
    user's assignment replaces it). No checksums: a gradient lives for one iteration, read in parts."""

    param: torch.Tensor
    placeholder: torch.Tensor
    digests: Optional[list] = None
    in_host: bool = False  # kept in host memory, never written to NVMe
    host: Optional[torch.Tensor] = None  # the gradient (a CPU tensor) while in_host and stored
    copying: Ticket = DONE  # the copy of a device gradient into ``host``: read ``host`` after it
    state: int = _NONE  # _NONE, _ZERO, _STORED or _CONSUMED
    scales: list = field(default_factory=list)  # clip factors not yet applied to the stored bytes


# NOTE: backward calls begin (a tensor hook, before torch accumulates into p.grad) and put (a
# post-accumulate-grad hook, after): begin empties p.grad if it holds the placeholder, so torch stores
# the new gradient alone; put then writes it out, adding the stored one first (buffer = stored;
# buffer += new, the same operation torch's accumulation does) and puts the placeholder back. Anything
# else in p.grad at begin (None after zero_grad(set_to_none=True), or a tensor a user assigned) means
# the stored bytes are stale: torch's accumulation then starts from that, and put writes the result
# afresh. A clip factor is recorded, not applied, and multiplied in when the gradient is next read.
# Gradients that fit ``max_grad_in_cpu`` skip the disk: a CPU model's gradient tensor itself is kept (a
# GPU model's is copied to host memory), and zeroing, accumulating and clipping act on it directly, with
# the same operations torch applies to ``p.grad``.
class GradStore:
    """Gradients of offloaded parameters, on the parameter store's swap space and through its pool.

    Args:
        io: the parameter store's unit mover (its space and pool).
        lock: the parameter store's lock (hooks may run on autograd's device threads).
        pin_memory: pin the host memory that device gradients are kept in (``max_grad_in_cpu``).
    """

    def __init__(self, io: TensorIO, lock: threading.RLock, *, pin_memory: bool = False):
        self.io = io
        self._lock = lock
        self._pin = pin_memory
        self._block: Optional[HostBuffer] = None  # host memory for device gradients kept there, made at first use
        self._places: dict[torch.Tensor, int] = {}
        self.grads: dict[torch.Tensor, _Grad] = {}
        self.bytes_read = 0
        self.bytes_written = 0
        self.resident_bytes = 0
        self.resident_bytes_max = 0

    def add(self, param: torch.Tensor, extent: Optional[Extent], name: str) -> None:
        """Give ``param``'s gradient a place: ``extent`` (as large as the parameter), or host memory (None)."""
        self.grads[param] = _Grad(param=param, nbytes=param.numel() * param.element_size(), extent=extent,
                                  placeholder=make_placeholder(param, name, self.mark_zero), in_host=extent is None)

    @property
    def host_bytes(self) -> int:
        """Host memory holding gradients kept off the disk now."""
        return sum(g.host.numel() * g.host.element_size() for g in self.grads.values() if g.host is not None)

    def holds(self, param: torch.Tensor) -> bool:
        """Whether ``param``'s gradient is here (``param.grad`` is its placeholder)."""
        g = self.grads.get(param)
        return g is not None and param.grad is g.placeholder

    def placeholder(self, param: torch.Tensor) -> Optional[torch.Tensor]:
        """``param.grad``'s placeholder while its gradient is stored here, else None."""
        g = self.grads.get(param)
        return g.placeholder if g is not None else None

    def begin(self, param: torch.Tensor) -> None:
        """Before torch accumulates a new gradient into ``param.grad``: step the placeholder aside."""
        with self._lock:
            g = self.grads[param]
            if param.grad is g.placeholder:
                self._check_not_consumed(g, "accumulate a new gradient onto it")
                param.grad = None
            else:
                self._forget(g)

    def put(self, param: torch.Tensor) -> None:
        """After torch accumulated into ``param.grad``: move it here, leave the placeholder."""
        with self._lock:
            g = self.grads.get(param)
            grad = param.grad
            if g is None or grad is None or grad is g.placeholder:
                return
            if g.in_host:
                self._keep(g, grad.detach())
            else:
                self._count(g.nbytes)
                try:
                    self._write(g, grad.detach())
                finally:
                    self._count(-g.nbytes)
            param.grad = g.placeholder
            g.state, g.scales = _STORED, []

    def merge(self, param: torch.Tensor) -> None:
        """After torch accumulated into ``param.grad``, for a gradient the optimizer takes as it is: add the
        stored one into it (``stored + new``, as :meth:`put` would) and forget it; nothing is written."""
        with self._lock:
            g = self.grads.get(param)
            grad = param.grad
            if g is None or grad is None or grad is g.placeholder or g.state == _NONE:
                return
            with torch._C.DisableTorchFunctionSubclass():
                if g.state == _ZERO:
                    stored = torch.zeros_like(grad)
                else:
                    stored = self._stored(g, grad.device)
                param.grad = stored.add_(grad)
            self._forget(g)

    def consumed(self, param: torch.Tensor) -> bool:
        """Whether ``param``'s gradient was consumed by an update during backward (see :meth:`consume`)."""
        g = self.grads.get(param)
        return g is not None and g.state == _CONSUMED and param.grad is g.placeholder

    def consume(self, param: torch.Tensor) -> None:
        """The optimizer updated ``param`` from ``param.grad`` during backward (overlap_backward): free the
        gradient, leaving the placeholder; reading it raises until ``zero_grad()``. The update's work, issued on
        the calling thread's streams, may not have run yet: the gradient's memory waits for it."""
        with self._lock:
            g = self.grads.get(param)
            if g is None or param.grad is None or param.grad is g.placeholder:
                return
            copies.read_here([param.grad])
            param.grad = g.placeholder
            self._settle(g)
            g.host, g.state, g.scales = None, _CONSUMED, []

    def mark_zero(self, param: torch.Tensor) -> None:
        """``param.grad.zero_()`` on the placeholder: the stored gradient is zero from now on."""
        with self._lock:
            g = self.grads[param]
            if g.in_host and g.host is not None:
                self._settle(g)
                g.host.zero_()  # as torch zeroes p.grad in place
                g.state, g.scales = _STORED, []
            else:
                g.state, g.scales = _ZERO, []

    def forget(self, param: torch.Tensor) -> None:
        """The stored gradient is gone (``param.grad`` was set to None or replaced)."""
        with self._lock:
            g = self.grads.get(param)
            if g is not None and param.grad is not g.placeholder:
                self._forget(g)

    def clear(self, param: torch.Tensor) -> None:
        """Drop the stored gradient (new weights were loaded: it belonged to the old ones)."""
        with self._lock:
            g = self.grads.get(param)
            if g is not None:
                if param.grad is g.placeholder:
                    param.grad = None
                self._forget(g)

    def scale(self, param: torch.Tensor, coef: torch.Tensor) -> None:
        """Multiply the stored gradient by the 0-dim ``coef`` (applied when it is next read, or at once to a
        gradient in host memory, as torch multiplies ``p.grad`` in place)."""
        with self._lock:
            g = self.grads[param]
            if g.state == _STORED and g.in_host:
                self._settle(g)
                g.host.mul_(coef.detach().to("cpu"))
            elif g.state == _STORED:
                g.scales.append(coef.detach().to("cpu"))

    def on_disk(self, param: torch.Tensor) -> bool:
        """Whether ``param``'s gradient, when stored, is on NVMe (not kept in host memory)."""
        g = self.grads.get(param)
        return g is not None and not g.in_host

    def span(self, param: torch.Tensor, lo: int, hi: int, *, on_disk: bool = False) -> int:
        """Bytes of a buffer that :meth:`read` of elements ``[lo, hi)`` occupies (whole aligned blocks);
        ``on_disk``: as if the gradient were on NVMe (an upper bound)."""
        if self.grads[param].in_host and not on_disk:
            return 0
        align, size = self.io.space.alignment, param.element_size()
        return round_up(hi * size, align) - (lo * size) // align * align

    def read(self, param: torch.Tensor, lo: int, hi: int, buffer: HostBuffer,
             buffer_offset: int) -> tuple[GradRead, int]:
        """Start reading elements ``[lo, hi)`` of the stored gradient into ``buffer`` at ``buffer_offset``.

        ``buffer_offset`` must be a multiple of the swap space's alignment. Returns the read (whose
        ``wait()`` gives the elements as a view into ``buffer``, or into the gradient itself when it is kept
        in host memory) and the bytes of ``buffer`` it spans.
        """
        with self._lock:
            g = self.grads[param]
            if not self.holds(param):
                raise RuntimeError(f"parameter {g.placeholder._nvme_name} has no gradient in the grad store")
            self._check_not_consumed(g, "read it")
            if g.in_host:
                self._settle(g)
                return GradRead(CompletedFuture(), g.host.view(-1)[lo:hi], False, []), 0
            align, size = self.io.space.alignment, param.element_size()
            a, b = (lo * size) // align * align, round_up(hi * size, align)
            view = buffer.view(param.dtype, buffer_offset + lo * size - a, hi - lo)
            if g.state == _ZERO:
                return GradRead(CompletedFuture(), view, True, []), b - a
            self._land(g)  # the read must see the latest bytes
            fut = self.io.store.read_range(g, a, b - a, buffer, buffer_offset=buffer_offset)
            self.bytes_read += b - a
            return GradRead(fut, view, False, list(g.scales)), b - a

    def load(self, param: torch.Tensor) -> Optional[torch.Tensor]:
        """A new tensor holding ``param``'s stored gradient (None without one), read through the pool."""
        with self._lock:
            g = self.grads.get(param)
            if g is None or not self.holds(param):
                return None
            self._check_not_consumed(g, "read it")
            with torch._C.DisableTorchFunctionSubclass():
                if g.state == _ZERO:
                    return torch.zeros(param.shape, dtype=param.dtype, device=param.device)
                return self._stored(g, param.device)

    def _stored(self, g: _Grad, device: torch.device) -> torch.Tensor:
        """A new tensor on ``device`` holding the stored gradient, pending clip factors applied."""
        param = g.param
        if g.in_host:
            self._settle(g)
            if not copies.crosses(device):
                return g.host.to(device, copy=True)
            # The kept gradient is not changed until this copy read it (see _settle).
            out, g.copying = copies.to_device(g.host, param)
            return out
        out = torch.empty(param.shape, dtype=param.dtype, device=device)
        self._count(g.nbytes)
        self._count(-g.nbytes)  # the caller holds it; counted as one gradient resident at a time
        self._land(g)  # the read must see the latest bytes
        self.bytes_read += self.io.read_into(out.view(-1).view(torch.uint8), g,
                                             what=lambda: f"the gradient of {g.placeholder._nvme_name}")
        for coef in g.scales:
            out.mul_(coef)
        return out

    @staticmethod
    def _check_not_consumed(g: _Grad, what: str) -> None:
        if g.state == _CONSUMED:
            raise RuntimeError(
                f"cannot {what}: the gradient of {g.placeholder._nvme_name} was consumed by the optimizer's update "
                "during backward (overlap_backward=True) and is not kept. Call zero_grad() after step(); read the "
                "clipped norm from the optimizer's last_grad_norm (max_grad_norm=...), or build the optimizer "
                "without overlap_backward to keep offloaded gradients readable.")

    def reset_peak(self) -> None:
        """Restart ``resident_bytes_max`` from the gradient bytes resident now."""
        self.resident_bytes_max = self.resident_bytes

    @property
    def swap_bytes(self) -> int:
        """Bytes of the swap space reserved for gradients."""
        return sum(g.extent.nbytes for g in self.grads.values() if g.extent is not None)

    def forget_landed(self) -> None:
        """Forget landed writes (the pool's buffers are idle: every write's source was one of them)."""
        for g in self.grads.values():
            g.writes.clear()

    def _land(self, g: _Grad) -> None:
        """Wait for every write of ``g``'s extent. If one failed, the stored gradient is gone (raised once,
        here; ``p.grad`` no longer claims it, so the next backward starts afresh). A lost gradient fails
        nothing else: the weights and the optimizer's state are whole."""
        try:
            self.io.store.land(g, fails=False)
        except OSError:
            g.state, g.scales = _NONE, []
            if g.param.grad is g.placeholder:
                g.param.grad = None
            raise

    def _forget(self, g: _Grad) -> None:
        g.state, g.scales = _NONE, []
        if g.host is not None and not copies.crosses(g.param.device):
            g.host = None  # a CPU model's gradient tensor itself: let it go with p.grad

    def _keep(self, g: _Grad, grad: torch.Tensor) -> None:
        """Keep ``grad`` in host memory, accumulated onto what is stored as torch would (stored += new)."""
        with torch._C.DisableTorchFunctionSubclass():
            if g.state == _NONE or g.host is None:
                if not copies.crosses(grad.device):
                    g.host = grad  # the tensor torch made: nothing to copy
                    return
                self._settle(g)
                if g.host is None:
                    g.host = self._host_place(g)
                # Backward goes on while the gradient lands; whoever reads ``host`` waits for it first.
                g.copying = copies.to_host(g.host, grad)
                return
            self._settle(g)
            if g.state == _ZERO:
                g.host.zero_()
            g.host.add_(copies.on_host(grad) if copies.crosses(grad.device) else grad)

    @staticmethod
    def _settle(g: _Grad) -> None:
        """Wait until the device gradient being copied into ``g.host`` is there."""
        g.copying.wait()
        g.copying = DONE

    def _host_place(self, g: _Grad) -> torch.Tensor:
        """``g``'s place in the host memory for device gradients: one page-aligned block for all of them, made
        at first use (torch's pinned allocator would round each gradient up to a power of two)."""
        if self._block is None:
            offset = 0
            for p, other in self.grads.items():
                if other.in_host:
                    self._places[p] = offset
                    offset += round_up(other.nbytes, 64)
            self._block = HostBuffer(max(offset, 1), pin_memory=self._pin)
        start = self._places[g.param]
        return self._block.tensor[start:start + g.nbytes].view(g.param.dtype).view(g.param.shape)

    def close(self) -> None:
        """Free the host memory of kept device gradients (after every copy into it)."""
        copies.waited(g.copying for g in self.grads.values())
        if self._block is not None:
            self._block.close()
            self._block = None

    def _count(self, nbytes: int) -> None:
        self.resident_bytes += nbytes
        self.resident_bytes_max = max(self.resident_bytes_max, self.resident_bytes)

    def _write(self, g: _Grad, grad: torch.Tensor) -> None:
        """Write ``grad`` to ``g``'s extent, added to what is stored there (per ``g.state``)."""
        self._land(g)  # earlier writes of this extent first: a read-add sees them, a rewrite follows them
        with torch._C.DisableTorchFunctionSubclass():
            src = grad.reshape(-1)
            if not src.is_contiguous():
                src = src.contiguous()
            raw = src.view(torch.uint8)
            size = src.element_size()
            unit = self.io.block_bytes
            state, scales = g.state, g.scales

            crossing = copies.crosses(src.device)

            def fill(k: int, view: torch.Tensor, stored: bool):
                n = view.numel()
                part = src[k * unit // size:(k * unit + n) // size]
                if state == _NONE and crossing:
                    return copies.to_host(view, raw[k * unit:k * unit + n])  # waited for before the disk write
                if state == _NONE:
                    view.copy_(raw[k * unit:k * unit + n])
                    return None
                typed = view.view(src.dtype)
                if stored:
                    self.bytes_read += round_up(n, self.io.space.alignment)
                    for coef in scales:
                        typed.mul_(coef)
                else:
                    typed.zero_()  # zero_grad(set_to_none=False): torch adds into zeros, so do we
                typed.add_(copies.on_host(part) if crossing else part)
                return None

            self.bytes_written += self.io.write_from(raw, g, fill=fill, read_first=lambda k: state == _STORED)

