"""Parameter offload: a model's weights on NVMe, fetched per submodule ahead of compute, released after.

Layers: :mod:`.store` (bytes on the swap space, the pool, the host cache, the grad store),
:mod:`.guard` (the guarded classes of released parameters and offloaded gradients), :mod:`.hooks`
(module hooks, backward hooks, execution-order recording and prefetch), :mod:`.api` and
:mod:`.grads` (what users call; ``save_parameters``/``load_parameters`` stream weights to and from a
checkpoint directory through :mod:`offload.checkpoint`).
"""

from .access import ParamAccess
from .api import (
    ParamOffload,
    materialized,
    offload_parameters,
    offloaded,
    register_external_parameter,
    restore_parameters,
)
from .grads import clip_grad_norm_, load_grad
from .guard import OffloadedGrad, OffloadedParameter
from .registry import store_of
from .store import ParamStore, resident

__all__ = [
    "OffloadedGrad",
    "OffloadedParameter",
    "ParamAccess",
    "ParamOffload",
    "ParamStore",
    "clip_grad_norm_",
    "load_grad",
    "materialized",
    "offload_parameters",
    "offloaded",
    "register_external_parameter",
    "resident",
    "restore_parameters",
    "store_of",
]
