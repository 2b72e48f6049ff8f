"""Adapters that make training frameworks checkpoint through nvme-offload's streaming save and load.

One module per framework (``transformers``, ``lightning``, ``accelerate``, ``dcp``); each imports its
framework only when used, so ``import offload.integrations.<framework>`` works without it installed.
See ``docs/integrations.md``.
"""

OFFLOAD_DIR = "offload"  # the streamed checkpoint's directory inside a framework's checkpoint

__all__ = ["OFFLOAD_DIR"]
