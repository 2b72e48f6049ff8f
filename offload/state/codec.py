"""A chunk's state as values: 8-bit moments decoded to fp32 and encoded back, in torch's layout.

What leaves or enters the optimizer's units by key (``state_dict()``, ``load_state_dict()``, checkpoints that
change the layout) goes through here, so only here does a moment's storage (fp32, bf16, or 8-bit codes with an
absmax per block) matter.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import codes
from .layout import Chunk, ParamSlot

__all__ = ["chunk_values", "exported_keys", "set_chunk_values"]


def exported_keys(slot: ParamSlot) -> tuple[str, ...]:
    """The keys of ``slot``'s state in torch's layout: its moments (and master), not the absmax of codes."""
    return tuple(k for k in slot.keys if not k.endswith(codes.ABSMAX))


def chunk_values(c: Chunk, buf, key: str) -> torch.Tensor:
    """The values of state ``key`` of chunk ``c`` in ``buf``: as stored, or fp32 for 8-bit codes."""
    view = c.slice(buf, key)
    if view.dtype != torch.uint8:
        return view
    return codes.dequantize(view, c.slice(buf, key + codes.ABSMAX), signed=codes.signed_for(key))


def set_chunk_values(c: Chunk, buf, key: str, values: Optional[torch.Tensor]) -> None:
    """Make state ``key`` of chunk ``c`` in ``buf`` hold ``values`` (``numel`` of them; None: zeros), converted
    to its storage: 8-bit codes are encoded (:func:`offload.codes.encode`, so dequantized codes come back)."""
    view = c.slice(buf, key)
    if view.dtype != torch.uint8:
        if values is None:
            view.zero_()
        else:
            view.copy_(values)
        return
    absmax = c.slice(buf, key + codes.ABSMAX)
    if values is None:
        view.zero_()
        absmax.zero_()
        return
    q, scale = codes.encode(values.to(torch.float32), signed=codes.signed_for(key))
    view.copy_(q)
    absmax.copy_(scale)
