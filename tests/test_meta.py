"""Models built on the meta device: offload_parameters gives their weights bytes in the swap space, one module at a
time, with the values a normal build with the same seed has; such a model trains like a normally built one."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import OPT, TINY, Net, assert_same_weights, loss_of, proc_status, reset_peak_rss
from torch import nn

from offload import OffloadedAdamW, offload_parameters, restore_parameters
from offload.params import materialized, offloaded
from offload.params.meta import empty_parameters

MiB = 1 << 20


def build():
    # MultiheadAttention's initialiser resets a child's bias: it needs its subtree held.
    return nn.Sequential(nn.Embedding(100, 32), nn.Linear(32, 64), nn.ReLU(),
                         nn.MultiheadAttention(64, 4, batch_first=True), nn.LayerNorm(64), nn.Linear(64, 100))


def weights(model) -> dict:
    with materialized(model):
        return {k: v.clone() for k, v in model.state_dict().items()}


def _building(how: str):
    if how == "meta":
        return torch.device("meta")
    if how == "accelerate":
        return pytest.importorskip("accelerate").init_empty_weights()
    return empty_parameters()


@pytest.mark.parametrize("how", ["meta", "empty_parameters", "accelerate"])
def test_meta_built_model_gets_the_weights_of_a_normal_build(nvme, closing, how):
    """With the same seed, every weight of a model built on meta (torch.device, our empty_parameters, accelerate's
    init_empty_weights) and offloaded equals the normal build's, bit for bit (reset_parameters children first, as
    constructors run), and lives on the swap space, not in memory."""
    torch.manual_seed(0)
    ref = build()
    with _building(how):
        model = build()
    assert all(p.is_meta for p in model.parameters())
    torch.manual_seed(0)
    closing(offload_parameters(model, nvme_path=nvme, **TINY))
    store = offloaded(model).store
    assert store.resident_bytes == 0 and store.swap_bytes >= sum(p.nbytes for p in ref.parameters())
    got = weights(model)
    assert list(got) == list(ref.state_dict())
    for name, value in ref.state_dict().items():
        assert torch.equal(got[name], value), name


def test_model_mixing_meta_and_real_parameters(nvme, closing):
    """Real parameters keep their values, meta ones get their initialiser's, ties stay one parameter, and
    with max_in_cpu the meta ones kept in memory get their bytes there."""
    real = nn.Linear(16, 16)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4, bias=False))
    model[0] = real
    model.tie = nn.Linear(4, 16, bias=False)
    model.tie.weight = model[1].weight  # shape (4, 16): one parameter under two names
    before = real.weight.detach().clone()
    closing(offload_parameters(model, nvme_path=nvme, max_in_cpu=16, max_grad_in_cpu=0, buffer_count=3,
                               buffer_size=2048))
    assert model.tie.weight is model[1].weight and not model[1].weight.is_meta
    got = weights(model)
    assert torch.equal(got["0.weight"], before)
    assert got["1.weight"].abs().sum() > 0 and torch.equal(got["1.weight"], got["tie.weight"])
    assert model[1].weight.device.type == "cpu"


def test_weights_without_an_initialiser_are_zeros_until_loaded(nvme, closing):
    """init=False (or a module with no reset_parameters) leaves the weights zeros, whatever the swap file held."""
    with torch.device("meta"):
        model = Net(d=32, h=64, layers=2)
    closing(offload_parameters(model, nvme_path=nvme, init=False, **TINY))
    assert all(v.count_nonzero() == 0 for k, v in weights(model).items() if k != "scale")


def test_a_callable_init_runs_per_module(nvme, closing):
    """init=callable replaces reset_parameters, once per module holding parameters from meta."""
    seen = []

    def init(module):
        seen.append(type(module).__name__)
        for p in module.parameters(recurse=False):
            p.data.fill_(0.25)

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.LayerNorm(8))
    closing(offload_parameters(model, nvme_path=nvme, init=init, **TINY))
    assert seen == ["Linear", "LayerNorm"]
    assert all(torch.all(v == 0.25) for v in weights(model).values())


def test_meta_built_model_trains_like_a_normally_built_one(nvme, closing):
    """A meta-built, offloaded model and a normal one loaded with the same weights train to the same
    weights, bit for bit, with OffloadedAdamW over weights and grads on NVMe."""
    torch.manual_seed(1)
    with torch.device("meta"):
        off = Net(d=32, h=64, layers=2)
    off.scale = torch.full((8,), 0.5)  # a buffer: set it as the constructor does
    closing(offload_parameters(off, nvme_path=nvme, **TINY))
    ref = Net(d=32, h=64, layers=2)
    ref.load_state_dict(weights(off))
    opt_ref = closing(OffloadedAdamW(ref.parameters(), nvme_path=nvme, **OPT))
    opt_off = closing(OffloadedAdamW(off.parameters(), nvme_path=nvme, **OPT))
    for step in range(3):
        la, lb = loss_of(ref, step), loss_of(off, step)
        assert torch.equal(la, lb)
        la.backward()
        lb.backward()
        opt_ref.step()
        opt_off.step()
        opt_ref.zero_grad()
        opt_off.zero_grad()
    restore_parameters(off)
    assert_same_weights(ref, off)


def test_building_from_meta_needs_the_pool_and_one_module(nvme, closing):
    """Offloading a 256 MiB model built on meta keeps one module's weights (8 MiB) resident at a time, and raises
    peak RSS by less than half the model. (glibc keeps a few freed 8 MiB blocks for reuse, so RSS grows by some
    tens of MiB whatever the model's size; a model held whole would add all of it.)"""
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(1448, 1448, bias=False) for _ in range(32)])  # 8 MiB each
    before = reset_peak_rss()
    closing(offload_parameters(model, nvme_path=nvme, max_in_cpu=0, max_grad_in_cpu=0, buffer_count=3,
                               buffer_size=1 << 20))
    growth = proc_status("VmHWM") - before
    store = offloaded(model).store
    assert store.resident_bytes_max <= 1448 * 1448 * 4
    assert growth < 128 * MiB, f"peak RSS grew {growth / MiB:.1f} MiB"
    assert store.swap_bytes >= 32 * 1448 * 1448 * 4


def test_init_failure_leaves_no_swap_file(nvme):
    """An initialiser that raises gives its error, and the store is closed (its swap file removed)."""
    def init(module):
        raise ValueError("bad init")

    with torch.device("meta"):
        model = nn.Linear(64, 64)
    with pytest.raises(ValueError, match="bad init"):
        offload_parameters(model, nvme_path=nvme, init=init, **TINY)
    assert offloaded(model) is None


def test_meta_model_copy_is_independent(nvme, closing):
    """The original meta model is untouched by offloading a deep copy of it (parameters are replaced, not
    changed in place)."""
    with torch.device("meta"):
        model = nn.Linear(8, 8)
    twin = copy.deepcopy(model)
    closing(offload_parameters(twin, nvme_path=nvme, **TINY))
    assert model.weight.is_meta and not twin.weight.is_meta


class _Bare(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.empty(4))  # no initialiser of its own


class _Parent(nn.Module):
    def __init__(self):
        super().__init__()
        self.child = _Bare()
        self.b = nn.Parameter(torch.empty(4))
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.ones_(self.b)
        nn.init.constant_(self.child.w, 2.0)


def test_an_initialiser_that_sets_a_childs_parameter_keeps_its_value(nvme, closing):
    """A parent's reset_parameters that sets the parameter of a child with no initialiser of its own runs with
    its subtree resident, and that value is kept, not replaced by the zeros of uninitialised weights."""
    with torch.device("meta"):
        model = _Parent()
    closing(offload_parameters(model, nvme_path=nvme, **TINY))
    got = weights(model)
    assert torch.equal(got["b"], torch.ones(4)) and torch.equal(got["child.w"], torch.full((4,), 2.0))
