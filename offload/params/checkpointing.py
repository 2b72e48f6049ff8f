"""A parameter store's checkpoint side: what ``offload.checkpoint`` and ``offload.pretrained`` call.

A checkpoint moves each parameter's bytes between its extent and a file through the store's own pool, so
saving or loading a model needs no memory beyond the pool, and nothing is fetched. ``exclusive()`` holds the
store still meanwhile (every write landed, no prefetch in flight); ``current_bytes`` says where a parameter's
latest bytes are (a resident or host-cached copy may be newer than its extent), ``load_targets`` where new
bytes must go so no stale copy survives.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator, Optional

import torch

from ..buffers import BufferPool, HostBuffer
from ..space import Extent

__all__ = ["Checkpointing", "weight_loads"]

_loads_made = 0  # loads of new weights from outside, in every store of the process (see weight_loads)


def weight_loads() -> int:
    """How many times new weights were put in place from outside in any parameter store of this process: an
    optimizer that saw the same number last time need not look at its parameters' :meth:`ParamStore.loads`."""
    return _loads_made


class Checkpointing:
    """The checkpoint interface of :class:`offload.params.store.ParamStore`, which mixes it in.

    It works on the store's ``records`` (each with ``data()``, ``what()``, ``host``, ``extent``), its byte
    store ``bytes``, transfers ``io``, ``lender``, ``pool`` (and whether it is ``pinned``), grad store ``grads``
    and ``space``, under the store's lock, and lets every write and prefetch land with the store's ``_quiesce``.
    """

    @property
    def block_bytes(self) -> int:
        """Bytes per block: parameters move in blocks of one pool buffer."""
        return self.io.block_bytes

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[list[HostBuffer]]:
        """Hold the store still for the block and lend the caller every pool buffer.

        Every write has landed and no prefetch is in flight when the block starts; no fetch,
        release or gradient write of another thread runs until it ends (they wait on the lock).

        Raises:
            OSError: a write-back had failed (the weights it carried are lost: the store is failed).
        """
        with self._lock:
            self._quiesce()
            if not len(self.pool):
                # Nothing on NVMe, no pool: a device model's host-cached weights still go to a checkpoint through
                # aligned buffers, made for the save or load and freed after it.
                with BufferPool(2, self.pool.buffer_size, pin_memory=self.pinned) as pool:
                    yield list(pool)
                return
            with self.lender.lend_all() as buffers:
                yield buffers

    def current_bytes(self, param: torch.Tensor) -> tuple[Optional[Extent], Optional[torch.Tensor]]:
        """Where ``param``'s latest bytes are: ``(extent, None)`` or ``(None, flat uint8 tensor)``.

        A resident parameter's own storage (changed or not since the fetch) and the host cache's copy
        are newer than, or the only copy of, what is on disk. Call inside :meth:`exclusive`.
        """
        rec = self.records[param]
        if rec.resident:
            return None, rec.data()
        if rec.host is not None:
            return None, rec.host.reshape(-1)
        return rec.extent, None

    def read_block(self, param: torch.Tensor, k: int, buffer):
        """Start reading block ``k`` of ``param``'s extent into ``buffer``; waiting for the future checks the
        bytes against the block's last write (``StateError`` if they changed on disk behind our back)."""
        rec = self.records[param]
        return self.bytes.read(rec, buffer, k, what=rec.what)

    def loads(self, param: torch.Tensor) -> int:
        """How many times new weights of ``param`` were put in place from outside (see :meth:`loaded`): an
        optimizer holding an fp32 master of them tells by it that the master is no longer theirs."""
        return self.records[param].loads

    def load_targets(self, param: torch.Tensor) -> tuple[Optional[Extent], list[torch.Tensor]]:
        """Where new bytes for ``param`` must go: its extent (if any) and the in-memory copies to
        overwrite with them (its storage while resident, the host cache's copy). Call inside
        :meth:`exclusive`, write blocks of :attr:`block_bytes` bytes (with :meth:`write_block`, which keeps
        their checksums), then call :meth:`loaded`."""
        rec = self.records[param]
        targets = []
        if rec.resident:
            targets.append(rec.data())
        if rec.host is not None:
            targets.append(rec.host.reshape(-1))
        self.bytes.forget_digests(rec)
        return rec.extent, targets

    def write_block(self, param: torch.Tensor, k: int, buffer):
        """Start writing block ``k`` of ``param``'s extent from ``buffer``, recording its checksum."""
        return self.bytes.write(self.records[param], buffer, k)

    def loaded(self, params: Iterable[torch.Tensor]) -> None:
        """New weights of ``params`` are in place: their in-memory copies equal their extents now, and
        the stored gradients, which belonged to the old weights, are gone (as after ``zero_grad``)."""
        global _loads_made
        with self._lock:
            for p in params:
                self.records[p].dirty = False
                self.records[p].loads += 1
                self.grads.clear(p)
            _loads_made += 1
            self.bytes.mark_restored()

    def rewriting(self, params: Iterable[torch.Tensor]) -> None:
        """``params``' stored bytes are about to be overwritten (a load). If that is every offloaded tensor, a
        swap file cut behind our back gets its size back: nothing will be read from the cut. A partial load
        leaves the cut to be named."""
        if self.space is not None and {id(p) for p in self.records} <= {id(p) for p in params}:
            self.bytes.regrow()
