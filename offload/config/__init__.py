"""Configuration: DeepSpeed's ``aio``, ``offload_optimizer`` and ``offload_param`` blocks, validated once.

Presets live in ``configs/*.json`` (``default.json``, ``deepspeed_example.json``, ``tiny.json``); variants
are made with ``dataclasses.replace`` or the ``replace`` methods.
"""

from .blocks import AioConfig, Config, OptimizerOffloadConfig, ParamOffloadConfig
from .loader import config_to_dict, load_config, offload_config
from .rules import BLOCKS

__all__ = [
    "BLOCKS",
    "AioConfig",
    "Config",
    "OptimizerOffloadConfig",
    "ParamOffloadConfig",
    "config_to_dict",
    "load_config",
    "offload_config",
]
