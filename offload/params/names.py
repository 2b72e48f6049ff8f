"""The tensors a model's ``state_dict`` lists, by name: what checkpoints and pretrained files are keyed by."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["named_tensors"]


def named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor, str]]:
    """``(name, tensor, "param" | "buffer")`` for every entry ``model.state_dict()`` would have, in
    its order (a module's parameters, its persistent buffers, then its children; tied or shared
    tensors under each of their names)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    out = []
    for prefix, module in model.named_modules(remove_duplicate=False):
        dot = prefix + "." if prefix else ""
        for name, p in module._parameters.items():
            if p is not None:
                out.append((dot + name, p, "param"))
        for name, b in module._buffers.items():
            if b is not None and name not in module._non_persistent_buffers_set:
                out.append((dot + name, b, "buffer"))
    return out
