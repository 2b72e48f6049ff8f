"""Hugging Face checkpoints in and out of offloaded models: safetensors weights loaded one tensor at a time,
and models saved as directories ``from_pretrained`` reads, one tensor at a time.

``transformers`` is not needed here (only ``safetensors``); the one-call ``from_pretrained`` that builds the
model from its config is in :mod:`offload.integrations.transformers`.
"""

from .files import SafetensorsCheckpoint
from .hub import model_directory
from .load import Plan, load_safetensors, offload_pretrained
from .save import save_pretrained, write_checkpoint

__all__ = ["Plan", "SafetensorsCheckpoint", "load_safetensors", "model_directory", "offload_pretrained",
           "save_pretrained", "write_checkpoint"]
