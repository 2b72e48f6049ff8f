"""Parameter offload: a model's weights on NVMe, fetched per submodule ahead of compute, released after.

What users call is in :mod:`.api` and :mod:`.grads`; an optimizer reaches offloaded weights and
gradients through :class:`ParamAccess` alone.
"""

from .access import ParamAccess
from .api import (
    ParamOffload,
    compile_offloaded,
    materialized,
    offload_parameters,
    offloaded,
    register_external_parameter,
    restore_parameters,
    shards_held,
)
from .checkpointing import weight_loads
from .grads import clip_grad_norm_, grad_reads, load_grad
from .guard import OffloadedGrad, OffloadedParameter, OffloadedView
from .holds import resident
from .meta import empty_parameters
from .names import named_tensors
from .placement import smallest_within
from .registry import store_of
from .shards import UPDATES_SHARDS
from .store import ParamStore

__all__ = [
    "smallest_within",
    "OffloadedGrad",
    "OffloadedParameter",
    "OffloadedView",
    "ParamAccess",
    "ParamOffload",
    "ParamStore",
    "UPDATES_SHARDS",
    "clip_grad_norm_",
    "compile_offloaded",
    "empty_parameters",
    "grad_reads",
    "load_grad",
    "materialized",
    "offload_parameters",
    "offloaded",
    "register_external_parameter",
    "resident",
    "restore_parameters",
    "shards_held",
    "named_tensors",
    "store_of",
    "weight_loads",
]
