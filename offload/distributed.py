"""torch.distributed for the rest of the library: this process's rank, ``nvme_path`` placeholders, and
DTensor parameters seen through their local shards."""

from __future__ import annotations

import itertools
import math
import os
import re
import sys
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

__all__ = [
    "PLACEHOLDERS",
    "Box",
    "RankInfo",
    "built_by_zero_redundancy",
    "check_grad_layout",
    "expand_placeholders",
    "is_dtensor",
    "like",
    "local",
    "local_box",
    "rank_info",
    "shard_like",
]

PLACEHOLDERS = ("rank", "local_rank", "world_size")
_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")

# NOTE: torch.distributed.tensor takes about a second to import, which every process importing offload paid. No
# tensor is a DTensor before that module is imported (by FSDP2, tensor parallelism or DCP), so it is looked up
# where it already is, never imported here.
def _dtensor_class():
    """DTensor, where torch.distributed.tensor is imported already; else None (then nothing is one)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


@dataclass(frozen=True)
class RankInfo:
    """Where this process stands in a job: its global rank, its rank on its node, and the job's size."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def distributed(self) -> bool:
        """Whether this process is one of several ranks."""
        return self.world_size > 1


def rank_info() -> RankInfo:
    """This process's rank, local rank and world size.

    From ``torch.distributed`` once its process group is initialised (the local rank from ``LOCAL_RANK``,
    as torchrun sets it, else the global rank), else from torchrun's environment variables (``RANK``,
    ``LOCAL_RANK``, ``WORLD_SIZE``), else a single process: rank 0 of 1.
    """
    env = os.environ
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    else:
        rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", rank) if "LOCAL_RANK" in env else rank
    return RankInfo(rank, local_rank, world)


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not a number; torchrun sets it to this "
                         "process's rank (unset it, or set it to an integer)") from None


def expand_placeholders(path: str, info: Optional[RankInfo] = None) -> str:
    """``path`` with ``{rank}``, ``{local_rank}`` and ``{world_size}`` replaced by this process's values.

    ``"/mnt/nvme{local_rank}/offload"`` puts each rank of a node on its own drive. Text in braces that is
    not a name (``{a,b}``) is left as it is.

    Raises:
        ValueError: a placeholder names something else (a typo such as ``{localrank}``).
    """
    if "{" not in path:
        return path
    info = info or rank_info()
    values = {"rank": info.rank, "local_rank": info.local_rank, "world_size": info.world_size}

    def sub(m: re.Match) -> str:
        name = m.group(1)
        if name not in values:
            raise ValueError(f"nvme_path {path!r} names the placeholder {{{name}}}; the placeholders are "
                             + ", ".join("{" + p + "}" for p in PLACEHOLDERS))
        return str(values[name])

    return _PLACEHOLDER.sub(sub, path)


# -- DTensor parameters (FSDP2, tensor parallelism) --------------------------------------------


def is_dtensor(t) -> bool:
    """Whether ``t`` is a DTensor (a parameter sharded by FSDP2's ``fully_shard`` or tensor parallelism)."""
    cls = _dtensor_class()
    return cls is not None and isinstance(t, cls)


# NOTE: a DTensor's local shard (``_local_tensor``) is the tensor that holds this rank's elements; FSDP2
# keeps it as a view into its sharded storage and may replace it (``reset_sharded_param``), so it is
# looked up at each use, never cached. Updating it in place updates the parameter. ``to_local()`` would
# make an autograd node for a parameter that requires grad; the attribute is the same storage.
def local(t):
    """``t``'s local shard if it is a DTensor (the same storage, detached), else ``t`` itself."""
    if t is None or not is_dtensor(t):
        return t
    shard = t._local_tensor
    return shard.detach() if shard.requires_grad else shard


# NOTE: the update of a DTensor parameter runs on its local shard with its gradient's local shard, which is
# right only when the gradient is laid out as the parameter. FSDP2's reduce-scatter and tensor parallelism's
# sharded layers leave it so; a replicated parameter used on sharded activations (SequenceParallel's norms)
# gets a partial sum instead, each rank holding only its addend: updated from that, the replicas would drift
# apart. Refused, never silently wrong.
def check_grad_layout(p) -> None:
    """``p``'s gradient, when both are DTensors, is laid out as ``p`` (same mesh, same placements).

    Raises:
        RuntimeError: it is laid out otherwise, naming both layouts and what to do.
    """
    g = p.grad
    if not (is_dtensor(p) and is_dtensor(g)):
        return
    same_mesh = g.device_mesh is p.device_mesh or g.device_mesh == p.device_mesh
    if same_mesh and tuple(g.placements) == tuple(p.placements):
        return
    raise RuntimeError(
        f"a DTensor parameter of shape {tuple(p.shape)} is laid out as {tuple(p.placements)} but its gradient as "
        f"{tuple(g.placements)} (a partial sum: SequenceParallel leaves its norms' gradients so). The optimizer "
        "updates each rank's local shard with its gradient's local shard, so the gradient must be laid out as the "
        "parameter: reduce it first (p.grad = p.grad.redistribute(p.device_mesh, p.placements), before step(), "
        "without overlap_backward), or keep such parameters in a torch optimizer.")


def detached(t) -> torch.Tensor:
    """``local(t).detach()`` as a plain tensor: the library's own alias of a parameter's memory, which no
    tensor subclass's ``__torch_function__`` (an offloaded parameter's guard) sees again on its uses."""
    with torch._C.DisableTorchFunctionSubclass():
        return local(t).detach()


def like(shard: torch.Tensor, ref) -> torch.Tensor:
    """``shard`` (a rank's local part) as a DTensor laid out as ``ref`` (same mesh, placements, global
    shape); ``shard`` itself when ``ref`` is not a DTensor."""
    if not is_dtensor(ref):
        return shard
    return type(ref).from_local(shard, ref.device_mesh, ref.placements, run_check=False, shape=ref.shape,
                               stride=ref.stride())


def shard_like(value, ref):
    """``value`` laid out as the DTensor ``ref``: a DTensor redistributed to ``ref``'s placements (a
    collective: every rank calls it), or a plain tensor of ``ref``'s global shape cut to this rank's part
    (no communication). Anything else is returned as it is (the caller's shape checks name it)."""
    if not is_dtensor(ref) or not torch.is_tensor(value):
        return value
    if is_dtensor(value):
        if value.device_mesh == ref.device_mesh and tuple(value.placements) == tuple(ref.placements):
            return value
        return value.redistribute(ref.device_mesh, ref.placements)
    if tuple(value.shape) != tuple(ref.shape):
        return value
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(value.to(local(ref).device), ref.device_mesh, ref.placements, src_data_rank=None)


def built_by_zero_redundancy() -> bool:
    """Whether the optimizer being built is one that ``torch.distributed.optim.ZeroRedundancyOptimizer`` makes for
    this rank's partition of the parameters (it builds ``optimizer_class(partition, **defaults)`` itself)."""
    try:
        from torch.distributed.optim import ZeroRedundancyOptimizer
    except ImportError:  # pragma: no cover - every build this project supports has it
        return False
    frame = sys._getframe(1)
    while frame is not None:
        if isinstance(frame.f_locals.get("self"), ZeroRedundancyOptimizer):
            return True
        frame = frame.f_back
    return False


# -- where a rank's part of a tensor lies in the whole ------------------------------------------


@dataclass(frozen=True)
class Box:
    """A rank's local shard as a part of the full tensor: ``shape`` elements along each dimension from
    ``offsets`` (what DTensor's ``Shard`` and ``Replicate`` placements make, and a plain tensor whole).
    Its elements, in the local tensor's flat order, are the full tensor's in row-major order."""

    offsets: tuple
    shape: tuple

    @classmethod
    def whole(cls, shape) -> Box:
        """The whole tensor of ``shape``."""
        return cls((0,) * len(shape), tuple(shape))

    @property
    def numel(self) -> int:
        """Elements in the box."""
        return math.prod(self.shape)

    def within(self, shape) -> bool:
        """Whether this box lies inside a tensor of ``shape``."""
        return len(self.offsets) == len(self.shape) == len(shape) and all(
            o + n <= s for o, n, s in zip(self.offsets, self.shape, shape))

    def intersect(self, other: Box) -> Optional[Box]:
        """The elements both boxes hold, or None where they share none."""
        lo = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets))
        hi = tuple(min(a + n, b + m) for a, n, b, m in zip(self.offsets, self.shape, other.offsets, other.shape))
        if any(h <= low for low, h in zip(lo, hi)):
            return None
        return Box(lo, tuple(h - low for low, h in zip(lo, hi)))

    def runs(self, src: Box, dst: Box) -> Iterator[tuple[int, int, int]]:
        """This box (inside both ``src`` and ``dst``) as runs of elements contiguous in both local tensors:
        ``(first element in src's flat order, first in dst's, count)``, in row-major order."""
        if self.numel == 0:
            return
        if not self.shape:
            yield 0, 0, 1
            return
        d = len(self.shape) - 1  # the dimensions after d are whole in src and dst: one run covers them
        while d > 0 and self.shape[d] == src.shape[d] == dst.shape[d]:
            d -= 1
        run = math.prod(self.shape[d:])
        strides = [_strides(src.shape), _strides(dst.shape)]
        for index in itertools.product(*(range(n) for n in self.shape[:d])):
            at = tuple(self.offsets[j] + i for j, i in enumerate(index)) + (self.offsets[d],)
            yield tuple(sum((a - b.offsets[j]) * st[j] for j, a in enumerate(at))
                        for b, st in zip((src, dst), strides)) + (run,)

    def flat_ranges(self, shape) -> list[tuple[int, int]]:
        """This box's elements as ranges ``[start, stop)`` of the flat order of the full tensor of ``shape``."""
        full = Box.whole(shape)
        return [(a, a + n) for a, _, n in self.runs(full, full)]


def _strides(shape) -> list[int]:
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= n
    return out[::-1]


def local_box(t) -> Optional[Box]:
    """Where ``t``'s local shard lies in the full tensor: the whole of a plain tensor; a DTensor's part
    under ``Shard`` and ``Replicate`` placements (FSDP2, tensor parallelism: each rank's elements are a
    box); None for other layouts (``_StridedShard``, ``Partial``), whose elements are not one box."""
    if not is_dtensor(t):
        return Box.whole(t.shape)
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not all(type(p) in (Shard, Replicate) for p in t.placements):
        return None
    shape, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    if tuple(shape) != tuple(local(t).shape):
        return None
    return Box(tuple(offsets), tuple(shape))
