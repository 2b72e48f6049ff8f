"""nvme-offload: optimizer state and weights on NVMe, streamed through a small host buffer pool.

What users touch is here; the layers underneath (``offload.aio.Engine``, ``offload.space.SwapSpace``,
``offload.buffers.BufferPool``, ``offload.pipeline.Pipeline``) are public for tools from their modules.
"""

from ._version import __version__
from .adam import OffloadedAdam, OffloadedAdamW
from .checkpoint import load_checkpoint, load_parameters, save_checkpoint, save_parameters
from .config import AioConfig, Config, load_config
from .errors import (
    CheckpointError,
    ChecksumError,
    ConfigError,
    ConfigWarning,
    OffloadError,
    PoolTooSmallError,
    StateError,
)
from .initialize import OffloadEngine, initialize
from .params import clip_grad_norm_, materialized, offload_parameters, offloaded, restore_parameters

__all__ = [
    "AioConfig",
    "CheckpointError",
    "ChecksumError",
    "Config",
    "ConfigError",
    "ConfigWarning",
    "OffloadEngine",
    "OffloadError",
    "OffloadedAdam",
    "OffloadedAdamW",
    "PoolTooSmallError",
    "StateError",
    "__version__",
    "clip_grad_norm_",
    "initialize",
    "load_checkpoint",
    "load_config",
    "load_parameters",
    "materialized",
    "offload_parameters",
    "offloaded",
    "restore_parameters",
    "save_checkpoint",
    "save_parameters",
]
