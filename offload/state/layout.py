"""Where each parameter's offloaded state lives: chunks packed into units of one pool buffer each."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import torch

from ..distributed import local
from ..store import Stored
from ..units import round_up

SLICE_ALIGN = 64
GRAIN = 1024

HALF_DTYPES = (torch.float16, torch.bfloat16)
STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def state_dtype_for(param: torch.Tensor, state_dtype: str = "fp32") -> torch.dtype:
    """The dtype of a parameter's moments: fp64 for fp64 parameters, else ``state_dtype`` (fp32 or bf16)."""
    return torch.float64 if param.dtype == torch.float64 else STATE_DTYPES[state_dtype]


def master_dtype_for(param: torch.Tensor) -> torch.dtype:
    """The dtype of a half-precision parameter's master copy: always fp32."""
    return torch.float32


def state_keys_for(param: torch.Tensor, amsgrad: bool) -> tuple[str, ...]:
    """Names of the state tensors stored for a parameter, in slice order."""
    keys = ["exp_avg", "exp_avg_sq"]
    if amsgrad:
        keys.append("max_exp_avg_sq")
    if param.dtype in HALF_DTYPES:
        keys.append("master")
    return tuple(keys)


@dataclass(eq=False)
class Chunk:
    """Elements ``[start, start + numel)`` of one parameter's flattened state, inside a unit.

    Its slices (one per state key, in the slot's key order) lie back to back from ``offset``, each
    starting on a 64-byte boundary: slice ``i`` at ``offset + slices[i]``.
    """

    slot: ParamSlot
    start: int
    numel: int
    offset: int = 0  # byte offset of the first slice within the unit
    slices: tuple = ()  # byte offset of each key's slice from ``offset``
    nbytes: int = 0

    def slice(self, buffer, key: str) -> torch.Tensor:
        """The state tensor ``key`` of this chunk, as a view into ``buffer`` (a HostBuffer)."""
        i = self.slot.keys.index(key)
        return buffer.view(self.slot.dtypes[i], self.offset + self.slices[i], self.numel)

    @property
    def stride(self) -> int:
        """Bytes from one slice to the next when all keys have one dtype (as checkpoints record), else 0."""
        if len(set(self.slot.dtypes)) > 1:
            return 0
        return self.slices[1] - self.slices[0] if len(self.slices) > 1 else self.nbytes


@dataclass(eq=False)
class Unit(Stored):
    """Chunks that travel together: one extent on disk (``extent``: None with state in host memory only),
    one pool buffer in memory. Its bytes are one block of its store (see :class:`offload.store.Stored`)."""

    chunks: list[Chunk] = field(default_factory=list)

    @property
    def digest(self):
        """The checksum of the bytes last written to the extent (or that write's future), or None."""
        return self.digests[0] if self.digests else None


@dataclass(eq=False)
class ParamSlot:
    """One offloaded parameter: its state keys and their dtypes, its chunks, whether its state exists yet."""

    param: torch.Tensor
    group: dict
    keys: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    chunks: list[Chunk] = field(default_factory=list)
    initialized: bool = False

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the moments (what a checkpoint records as the state dtype)."""
        return self.dtypes[0]

    def dtype_of(self, key: str) -> torch.dtype:
        return self.dtypes[self.keys.index(key)]

    @property
    def has_master(self) -> bool:
        """Whether an fp32 master copy of the parameter exists in its state (the weights are then its rounding)."""
        return "master" in self.keys and self.initialized


def _slice_offsets(numel: int, dtypes: tuple) -> tuple[tuple[int, ...], int]:
    offsets, pos = [], 0
    for dtype in dtypes:
        offsets.append(pos)
        pos += round_up(numel * dtype.itemsize, SLICE_ALIGN)
    return tuple(offsets), pos


# NOTE: a unit is one pool buffer's worth of state, stored as ONE contiguous extent, so it moves with
# one read and one write at full request size. A parameter larger than a buffer is split into chunks
# across several units; small parameters share a unit. Within a unit each chunk holds one slice per
# state tensor (exp_avg, exp_avg_sq, then max_exp_avg_sq with amsgrad, then the fp32 master copy of an
# fp16/bf16 parameter), each slice starting on a 64-byte boundary so vectorised kernels see aligned
# data. Chunks are cut on multiples of GRAIN elements (except a parameter's last chunk) so that a
# chunked update goes through the same kernel paths as a whole-tensor one.
class Layout:
    """Packs parameters' state into units of at most ``unit_bytes`` bytes, in order.

    Every unit but the last one opened is filled as far as chunk boundaries allow, so the number of
    units (and I/O requests) per step is close to total state bytes / unit_bytes. :meth:`plan` packs
    without recording anything, :meth:`commit` records, so a caller can reserve disk for the new units
    in between and leave the layout as it was if that fails.

    Args:
        unit_bytes: the size of a unit (a pool buffer).
        state_dtype: ``"fp32"`` or ``"bf16"``, the dtype of the moments of non-fp64 parameters.
    """

    def __init__(self, unit_bytes: int, state_dtype: str = "fp32"):
        self.unit_bytes = unit_bytes
        self.state_dtype = state_dtype
        self.units: list[Unit] = []
        self.slots: dict[torch.Tensor, ParamSlot] = {}

    def plan(self, params: Iterable[tuple[torch.Tensor, dict, bool]]) -> list[Unit]:
        """Pack parameters ``(param, group, amsgrad)`` not laid out yet into new units; records nothing.

        Raises:
            ValueError: a unit cannot hold even one grain of a parameter's state.
        """
        new_units: list[Unit] = []
        planned: set = set()
        unit = None
        for param, group, amsgrad in params:
            if param in self.slots or param in planned:
                continue
            planned.add(param)
            keys = state_keys_for(param, amsgrad)
            moments = state_dtype_for(param, self.state_dtype)
            dtypes = tuple(master_dtype_for(param) if k == "master" else moments for k in keys)
            need = _slice_offsets(GRAIN, dtypes)[1]
            if need > self.unit_bytes:
                raise ValueError(
                    f"buffer_size {self.unit_bytes} bytes is too small for one chunk of state "
                    f"({need} bytes); set buffer_size to at least {need}"
                )
            slot = ParamSlot(param, group, keys, dtypes)
            per_element = sum(d.itemsize for d in dtypes)
            start, n = 0, local(param).numel()  # a DTensor's state is its local shard's
            while start < n:
                if unit is None:
                    unit = Unit()
                    new_units.append(unit)
                free = self.unit_bytes - unit.nbytes
                take = n - start
                if _slice_offsets(take, dtypes)[1] > free:
                    # A part of the parameter: a whole number of grains, as many as fit.
                    take = free // per_element // GRAIN * GRAIN
                    while take > 0 and _slice_offsets(take, dtypes)[1] > free:
                        take -= GRAIN
                if take <= 0:
                    unit = None
                    continue
                slices, nbytes = _slice_offsets(take, dtypes)
                chunk = Chunk(slot, start, take, unit.nbytes, slices, nbytes)
                unit.chunks.append(chunk)
                unit.nbytes += nbytes
                slot.chunks.append(chunk)
                start += take
        return new_units

    def commit(self, units: list[Unit]) -> None:
        """Record units made by :meth:`plan` (their extents allocated) and their parameters' slots."""
        for unit in units:
            for c in unit.chunks:
                self.slots.setdefault(c.slot.param, c.slot)
        self.units.extend(units)

    @property
    def state_bytes(self) -> int:
        return sum(u.nbytes for u in self.units)
