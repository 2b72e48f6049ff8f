"""Parameter offload: a model's weights on NVMe, fetched per submodule ahead of compute, released after.

Layers: :mod:`.store` (bytes on the swap space, the pool, the host cache), :mod:`.hooks` (module
hooks, backward hooks, execution-order recording and prefetch), :mod:`.api` (what users call).
"""

from .api import ParamOffload, materialized, offload_parameters, offloaded, restore_parameters
from .store import ParamStore, store_of

__all__ = [
    "ParamOffload",
    "ParamStore",
    "materialized",
    "offload_parameters",
    "offloaded",
    "restore_parameters",
    "store_of",
]
