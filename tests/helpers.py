"""Assertions and small utilities shared by the optimizer, checkpoint, fault and parameter tests."""

from __future__ import annotations

import torch


def snapshot(params):
    """Copies of the parameters' values."""
    return [p.detach().clone() for p in params]


def restore(params, values):
    """Put values taken by :func:`snapshot` back into the parameters."""
    with torch.no_grad():
        for p, v in zip(params, values):
            p.copy_(v)


def assert_same(a, b):
    """Two sequences of tensors are equal bit for bit."""
    for i, (p, q) in enumerate(zip(a, b, strict=True)):
        assert torch.equal(p, q), f"parameter {i} differs (max abs diff {(p - q).abs().max().item()})"


def assert_same_state(a: dict, b: dict):
    """Two optimizer state_dicts hold the same state and hyperparameters, bit for bit."""
    assert sorted(a["state"]) == sorted(b["state"])
    for i in a["state"]:
        assert sorted(a["state"][i]) == sorted(b["state"][i]), f"parameter {i}: different state keys"
        for k, v in a["state"][i].items():
            w = b["state"][i][k]
            assert torch.equal(torch.as_tensor(v).cpu().float(), torch.as_tensor(w).cpu().float()), \
                f"parameter {i}: state {k!r} differs"
    for ga, gb in zip(a["param_groups"], b["param_groups"], strict=True):
        assert {k: v for k, v in ga.items() if k != "params"} == {k: v for k, v in gb.items() if k != "params"}
