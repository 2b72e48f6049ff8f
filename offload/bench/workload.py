"""Synthetic workloads shared by the benchmarks: a model-sized set of parameters with grads."""

from __future__ import annotations

import torch

# Split the model into 4M-element tensors, like a stack of layers.
TENSOR_ELEMENTS = 4 << 20


def synthetic_params(n: int, dtype: torch.dtype = torch.float32, *, tensor_elements: int = TENSOR_ELEMENTS,
                     device: torch.device | str = "cpu") -> list[torch.nn.Parameter]:
    """``n`` parameters in tensors of ``tensor_elements`` on ``device``, each with a random grad (seeded)."""
    g = torch.Generator().manual_seed(0)
    sizes = [tensor_elements] * (n // tensor_elements) + ([n % tensor_elements] if n % tensor_elements else [])
    params = []
    for s in sizes:
        p = torch.nn.Parameter(torch.randn(s, generator=g).to(device, dtype))
        p.grad = torch.randn(s, generator=g).to(device, dtype)
        params.append(p)
    return params
