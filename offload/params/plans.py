"""The parameter stores' side of a checkpoint of a model's weights: each offloaded tensor's bytes as blocks that
a checkpoint moves between a data file and wherever the bytes live (an extent of a store's swap space, a
resident or host-cached copy), so that :mod:`offload.checkpoint` never sees extents or swap spaces.

A save plan is :func:`save_blocks` (each block reads its bytes into a buffer), a load plan :func:`load_blocks`
(each block writes a buffer's bytes where they go, and into every in-memory copy). Every store is held still
meanwhile (:func:`held`), and the blocks move through its own pool.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional, Sequence

import torch

from ..errors import CheckpointError
from ..sizes import ALIGNMENT, round_up
from ..space import Extent
from .registry import store_of

__all__ = ["WeightBlock", "block_size", "flat_bytes", "held", "load_blocks", "save_blocks", "stores_of"]


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat uint8 view."""
    with torch._C.DisableTorchFunctionSubclass():
        return t.detach().reshape(-1).view(torch.uint8)


def stores_of(tensors: Iterable[torch.Tensor]) -> list:
    """The parameter stores of ``tensors`` (those offloaded), each once, in order."""
    out: list = []
    for t in tensors:
        s = store_of(t)
        if s is not None and s not in out:
            out.append(s)
    return out


@contextlib.contextmanager
def held(stores: Sequence) -> Iterator[Optional[list]]:
    """Every store held still (``ParamStore.exclusive``); yields buffers to move bytes through: the first
    store's pool, or ``None`` when there is no store."""
    with contextlib.ExitStack() as stack:
        lent = [stack.enter_context(s.exclusive()) for s in stores]
        yield lent[0] if lent else None


def block_size(buffers: Sequence, stores: Sequence) -> int:
    """Bytes per block: fits every buffer, a multiple of the checkpoint's and every swap space's alignment (so a
    parameter's blocks lie back to back in the data file and in its extent)."""
    step = max([ALIGNMENT] + [s.space.alignment for s in stores])
    block_bytes = min(b.nbytes for b in buffers) // step * step
    if block_bytes <= 0:
        raise CheckpointError(f"the parameter pool's buffers ({min(b.nbytes for b in buffers)} bytes) are "
                              f"smaller than the {step}-byte alignment; use a larger buffer_size")
    return block_bytes


@dataclass(eq=False)
class WeightBlock:
    """Bytes ``[start, start + n)`` of one tensor (``name``) on their way to or from a data file: on a swap
    space (an extent of ``store``, the one of ``param``) or in ``memory`` (flat uint8); when loading, the
    in-memory ``copies`` to refresh and the saved ``entry`` read from the data file (else from ``memory``)."""

    name: str
    start: int
    n: int
    extent: Optional[Extent] = None
    store: Any = None
    memory: Optional[torch.Tensor] = None
    copies: tuple = ()
    entry: Any = None
    param: Optional[torch.Tensor] = None

    @property
    def on_disk(self) -> bool:
        """Whether the bytes are (or go) on a swap space."""
        return self.extent is not None

    def read(self, buf, block_bytes: int):
        """Saving: start reading the bytes into ``buf`` (a future; checked against their last write), or copy
        them from memory (None)."""
        if self.extent is None:
            buf.tensor[:self.n].copy_(self._in_memory())
            return None
        return self._swap(buf, block_bytes, write=False)

    def take(self, buf) -> bool:
        """Loading from memory: copy the new bytes into ``buf`` and every in-memory copy; whether they go to disk
        (:meth:`write`)."""
        data = buf.tensor[:self.n]
        data.copy_(self._in_memory())
        self.refresh(data)
        return self.on_disk

    def write(self, buf, block_bytes: int):
        """Loading: start writing ``buf``'s bytes to the swap space, zeros to the end of the space's last block;
        None where the bytes go to memory only."""
        if self.extent is None:
            return None
        buf.tensor[self.n:round_up(self.n, self.store.space.alignment)].zero_()
        return self._swap(buf, block_bytes, write=True)

    def _in_memory(self) -> torch.Tensor:
        """The bytes where they are in memory (a block with no extent, or one loaded from model.pt, has them)."""
        assert self.memory is not None
        return self.memory[self.start:self.start + self.n]

    def refresh(self, data: torch.Tensor) -> None:
        """Copy the block's new bytes ``data`` into every in-memory copy."""
        for c in self.copies:
            c[self.start:self.start + self.n].copy_(data)

    def _swap(self, buf, block_bytes: int, *, write: bool):
        """As one of the store's own blocks where it is one (``block_bytes`` is the store's), checked against
        (or keeping) its checksum."""
        if self.store.block_bytes == block_bytes:
            move = self.store.write_block if write else self.store.read_block
            return move(self.param, self.start // block_bytes, buf)
        space = self.store.space
        return (space.write if write else space.read)(space.sub(self.extent, self.start, self.n), buf, nbytes=self.n)


def save_blocks(offloaded: Sequence[tuple[str, torch.Tensor, Any]], block_bytes: int) -> list[WeightBlock]:
    """The blocks of ``block_bytes`` of each ``(name, tensor, store)`` to save, from its latest bytes (a resident
    or host-cached copy is newer than its extent). Call inside :func:`held`."""
    blocks = []
    for name, t, store in offloaded:
        nbytes = t.numel() * t.element_size()
        extent, current = store.current_bytes(t)
        for start in range(0, nbytes, block_bytes):
            blocks.append(WeightBlock(name, start, min(block_bytes, nbytes - start), extent, store, current, param=t))
    return blocks


def _targets(t: torch.Tensor, store, after: list) -> tuple[Optional[Extent], list]:
    """Where tensor ``t``'s new bytes go: its extent in ``store`` and its in-memory copies, or (not offloaded)
    its own memory, through a contiguous CPU copy (recorded in ``after``) where it is not that itself."""
    if store is not None:
        return store.load_targets(t)
    with torch._C.DisableTorchFunctionSubclass():
        dest = t.detach()
        if not (dest.is_contiguous() and dest.device.type == "cpu"):
            tmp = torch.empty(dest.shape, dtype=dest.dtype)
            after.append((dest, tmp))
            dest = tmp
    return None, [flat_bytes(dest)]


def load_blocks(jobs: Sequence[tuple[str, torch.Tensor, Any, Optional[torch.Tensor]]],
                block_bytes: int) -> tuple[list, list, list]:
    """A load's work, per ``(name, tensor, saved entry, source in memory or None)``: the :class:`WeightBlock` of
    each ``block_bytes`` of a tensor filled on a swap space or through a buffer (from the data file at the entry,
    or from the source), ``(tensor, source)`` copied memory to memory, and ``(tensor, copy)`` of tensors filled
    through a contiguous copy. Call inside :func:`held`; the stores are told their bytes are rewritten."""
    blocks: list = []
    direct: list = []
    after: list = []
    for name, t, e, src in jobs:
        store = store_of(t)
        if store is None and src is not None:
            direct.append((t, src))  # memory to memory
            continue
        nbytes = t.numel() * t.element_size()
        extent, copies = _targets(t, store, after)
        memory = flat_bytes(src.contiguous()) if src is not None else None
        for start in range(0, nbytes, block_bytes):
            blocks.append(WeightBlock(name, start, min(block_bytes, nbytes - start), extent, store, memory,
                                      tuple(copies), entry=e if src is None else None, param=t))
    for store in {id(b.store): b.store for b in blocks if b.store is not None}.values():
        store.rewriting([b.param for b in blocks if b.store is store])
    return blocks, direct, after
