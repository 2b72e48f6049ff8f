"""nvme-offload: optimizer state and weights on NVMe, streamed through a small host buffer pool.

Public API:
    OffloadedAdam, OffloadedAdamW: drop-ins for torch.optim.Adam / AdamW with state on NVMe.
    load_config, Config, AioConfig: the JSON configuration (a whole DeepSpeed ds_config.json works).
    Engine, SwapSpace, BufferPool: the layers underneath, for tools and benchmarks.
"""

from ._version import __version__
from .adam import OffloadedAdam, OffloadedAdamW
from .aio import Engine
from .buffers import BufferPool
from .config import AioConfig, Config, load_config
from .errors import ConfigError, OffloadError, PoolTooSmallError, StateError
from .params import offload_parameters, restore_parameters
from .space import SwapSpace

__all__ = [
    "AioConfig",
    "BufferPool",
    "Config",
    "ConfigError",
    "Engine",
    "OffloadError",
    "OffloadedAdam",
    "OffloadedAdamW",
    "PoolTooSmallError",
    "StateError",
    "SwapSpace",
    "__version__",
    "load_config",
    "offload_parameters",
    "restore_parameters",
]
