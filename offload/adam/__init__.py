"""OffloadedAdam and OffloadedAdamW: torch's Adam/AdamW with their state on NVMe."""

from .optimizer import OffloadedAdam, OffloadedAdamW

__all__ = ["OffloadedAdam", "OffloadedAdamW"]
