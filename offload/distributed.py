"""torch.distributed for the rest of the library: this process's rank, ``nvme_path`` placeholders, and
DTensor parameters seen through their local shards."""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from typing import Optional

import torch

__all__ = [
    "PLACEHOLDERS",
    "RankInfo",
    "built_by_zero_redundancy",
    "check_grad_layout",
    "expand_placeholders",
    "is_dtensor",
    "like",
    "local",
    "rank_info",
    "shard_like",
]

PLACEHOLDERS = ("rank", "local_rank", "world_size")
_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")

try:  # a build of torch without distributed support has no DTensor
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # pragma: no cover - every build this project supports has it
    _DTensor = None


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
    return _DTensor is not None and isinstance(t, _DTensor)


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
    return _DTensor.from_local(shard, ref.device_mesh, ref.placements, run_check=False, shape=ref.shape,
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
