"""Where each parameter's offloaded state lives: chunks packed into units of one pool buffer each."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import torch

from .. import codes
from ..bytes import Stored
from ..distributed import local
from ..sizes import round_up

SLICE_ALIGN = 64
GRAIN = 1024  # a multiple of codes.BLOCK: a chunk of 8-bit state holds whole blocks

HALF_DTYPES = (torch.float16, torch.bfloat16)
STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.uint8}
MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def state_dtype_for(param: torch.Tensor, state_dtype: str = "fp32") -> torch.dtype:
    """The dtype of a parameter's moments: fp64 for fp64 parameters; uint8 codes for ``"int8"`` where the
    parameter is in whole blocks of at least 4096 elements (:func:`offload.codes.eligible`), else fp32; else
    ``state_dtype`` (fp32 or bf16)."""
    if param.dtype == torch.float64:
        return torch.float64
    if state_dtype == "int8":
        return torch.uint8 if codes.eligible(local(param).numel()) else torch.float32
    return STATE_DTYPES[state_dtype]


def master_dtype_for(param: torch.Tensor) -> torch.dtype:
    """The dtype of a half-precision parameter's master copy: always fp32."""
    return torch.float32


def state_keys_for(param: torch.Tensor, amsgrad: bool, *, quantized: bool = False,
                   master: bool = True) -> tuple[str, ...]:
    """Names of the state tensors stored for a parameter, in slice order: its moments, their absmax when they
    are 8-bit codes (``quantized``), then the fp32 master copy of a half parameter (unless ``master`` is off)."""
    moments = MOMENTS[:3 if amsgrad else 2]
    keys = list(moments)
    if quantized:
        keys += [k + codes.ABSMAX for k in moments]
    if param.dtype in HALF_DTYPES and master:
        keys.append("master")
    return tuple(keys)


def key_dtype(key: str, moments: torch.dtype) -> torch.dtype:
    """The dtype of state ``key`` when the moments are ``moments``: the master and absmax are fp32."""
    return torch.float32 if key == "master" or key.endswith(codes.ABSMAX) else moments


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
        """The state tensor ``key`` of this chunk, as a view into ``buffer`` (a HostBuffer): ``numel`` elements,
        or one per block of them for an absmax."""
        i = self.slot.keys.index(key)
        return buffer.view(self.slot.dtypes[i], self.offset + self.slices[i], codes.elements(key, self.numel))

    @property
    def stride(self) -> int:
        """Bytes from one slice to the next when all keys have one dtype (as checkpoints record), else 0."""
        if len(set(self.slot.dtypes)) > 1:
            return 0
        return self.slices[1] - self.slices[0] if len(self.slices) > 1 else self.nbytes


@dataclass(eq=False)
class Unit(Stored):
    """Chunks that travel together: one extent on disk (``extent``: None with state in host memory only),
    one pool buffer in memory. Its bytes are one block of its store (see :class:`offload.bytes.Stored`)."""

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
        """The dtype of state key ``key``."""
        return self.dtypes[self.keys.index(key)]

    @property
    def has_master(self) -> bool:
        """Whether an fp32 master copy of the parameter exists in its state (the weights are then its rounding)."""
        return "master" in self.keys and self.initialized

    @property
    def quantized(self) -> bool:
        """Whether its moments are 8-bit codes (with an absmax per block)."""
        return self.dtypes[0] == torch.uint8


def slice_offsets(numel: int, keys: tuple, dtypes: tuple) -> tuple[tuple[int, ...], int]:
    """Each key's byte offset within a chunk of ``numel`` elements, each slice 64-byte aligned, and the
    chunk's bytes."""
    offsets, pos = [], 0
    for key, dtype in zip(keys, dtypes):
        offsets.append(pos)
        pos += round_up(codes.elements(key, numel) * dtype.itemsize, SLICE_ALIGN)
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
        state_dtype: ``"fp32"``, ``"bf16"`` or ``"int8"``: the moments of non-fp64 parameters.
        master: whether half parameters keep an fp32 master copy.
    """

    def __init__(self, unit_bytes: int, state_dtype: str = "fp32", *, master: bool = True):
        self.unit_bytes = unit_bytes
        self.state_dtype = state_dtype
        self.master = master
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
            moments = state_dtype_for(param, self.state_dtype)
            keys = state_keys_for(param, amsgrad, quantized=moments == torch.uint8, master=self.master)
            dtypes = tuple(key_dtype(k, moments) for k in keys)
            need = slice_offsets(GRAIN, keys, dtypes)[1]
            if need > self.unit_bytes:
                raise ValueError(
                    f"buffer_size {self.unit_bytes} bytes is too small for one chunk of state "
                    f"({need} bytes); set buffer_size to at least {need}"
                )
            slot = ParamSlot(param, group, keys, dtypes)
            per_element = need / GRAIN
            start, n = 0, local(param).numel()  # a DTensor's state is its local shard's
            while start < n:
                if unit is None:
                    unit = Unit()
                    new_units.append(unit)
                free = self.unit_bytes - unit.nbytes
                take = n - start
                if slice_offsets(take, keys, dtypes)[1] > free:
                    # A part of the parameter: a whole number of grains, as many as fit.
                    take = int(free // per_element) // GRAIN * GRAIN
                    while take > 0 and slice_offsets(take, keys, dtypes)[1] > free:
                        take -= GRAIN
                if take <= 0:
                    unit = None
                    continue
                slices, nbytes = slice_offsets(take, keys, dtypes)
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
        """Bytes of state in all the units together."""
        return sum(u.nbytes for u in self.units)
