"""nvme-offload: optimizer state and weights on NVMe, streamed through a small host buffer pool."""

from ._version import __version__

__all__ = ["__version__"]
