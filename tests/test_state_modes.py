"""Leaner state: 8-bit moments (state_dtype "int8") equal torchao's AdamW8bit bit for bit, bf16 weights without
an fp32 master (master_weights=False) resume bit for bit, and both survive state dicts and checkpoints."""

from __future__ import annotations

import copy
import math
import time

import pytest
import torch
from helpers import assert_same, assert_same_state
from torch import nn

from offload import OffloadedAdam, OffloadedAdamW, codes
from offload.checkpoint import export_state_dict


def make_model(dtype=torch.float32, seed=0):
    """Weights in and out of 8-bit eligibility: whole blocks of >= 4096 elements, 4800 not in whole blocks
    (offloaded with fp32 moments, as torchao keeps them), small biases (state in memory)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 96), nn.ReLU(), nn.Linear(96, 50, bias=False))
    return model.to(dtype)


def train(model, opt, steps, *, seed=1, dtype=None, skip=None):
    torch.manual_seed(seed)
    dtype = dtype or next(model.parameters()).dtype
    for i in range(steps):
        x = torch.randn(16, 64, dtype=dtype)
        model(x).float().pow(2).mean().backward()
        if skip is not None and i == 1:
            skip.grad = None  # a parameter without a grad in one step keeps its state
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("cls", [OffloadedAdamW, OffloadedAdam], ids=["AdamW", "Adam"])
def test_int8_state_trains_as_torchaos_8bit_adam_bit_for_bit(monkeypatch, closing, nvme, cls):
    """Weights and dequantized moments after steps equal torchao's AdamW8bit/Adam8bit (eager), with units
    split across a small pool, two groups, a parameter out of blocks (fp32 moments) and in-memory biases."""
    torchao_optim = pytest.importorskip("torchao.optim")
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    ours_model, ref_model = make_model(), make_model()
    groups = lambda m: [{"params": list(m[0].parameters())},  # noqa: E731
                        {"params": list(m[2].parameters()) + list(m[4].parameters()), "lr": 3e-3}]
    opt = closing(cls(groups(ours_model), lr=1e-3, weight_decay=0.05, nvme_path=nvme, state_dtype="int8",
                      buffer_size=16384))
    ref_cls = torchao_optim.AdamW8bit if cls is OffloadedAdamW else torchao_optim.Adam8bit
    ref = ref_cls(groups(ref_model), lr=1e-3, weight_decay=0.05)
    assert len(opt.state_store.layout.units) > 3  # the 256x64 weight spans units
    slots = opt.state_store.layout.slots
    assert not slots[ours_model[4].weight].quantized and slots[ours_model[0].weight].quantized
    train(ours_model, opt, 4, skip=ours_model[2].weight)
    train(ref_model, ref, 4, skip=ref_model[2].weight)
    assert_same(list(ours_model.parameters()), list(ref_model.parameters()))
    sd = opt.state_dict()
    for i, p in enumerate(ref_model.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            theirs = ref.state[p][key]
            theirs = theirs.dequantize() if hasattr(theirs, "codes") else theirs
            assert torch.equal(sd["state"][i][key], theirs), (i, key)


class _SlowBackward(torch.autograd.Function):
    """The identity, whose backward waits: the update inside backward, on its worker, runs ahead of the grads."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(0.05)
        return grad


class _Slow(nn.Module):
    def forward(self, x):
        return _SlowBackward.apply(x)


@pytest.mark.parametrize("mode", [{"state_dtype": "int8"}, {"state_dtype": "int8", "master_weights": False}],
                         ids=["int8", "int8 no master"])
def test_the_update_inside_backward_waits_for_every_chunk_of_a_unit_with_int8_state(closing, nvme, mode):
    """With overlap_backward the worker updates a unit only once every parameter with a chunk in it has its final
    grad, though with int8 state a parameter split at a unit's edge has several chunks there (the absmax of its
    blocks makes its bytes per element uneven). Here the last parameter of two units is such a one, so its grad,
    final first in backward, must not open the unit alone; a backward slowed between layers lets the worker run
    ahead, and the weights and state still equal the plain step's."""
    dtype = torch.float32 if mode.get("master_weights", True) else torch.bfloat16
    runs = []
    for overlap in (False, True):
        torch.manual_seed(0)
        layers = [nn.Linear(128, 128, bias=False) for _ in range(4)]
        model = nn.Sequential(layers[0], _Slow(), layers[1], _Slow(), layers[2], _Slow(), layers[3]).to(dtype)
        opt = closing(OffloadedAdamW(model.parameters(), lr=1e-3, nvme_path=nvme, buffer_size=65536,
                                     overlap_backward=overlap, **mode))
        order = {id(p): i for i, p in enumerate(model.parameters())}
        split_last = [ps for u in opt.state_store.layout.units
                      for ps in [[order[id(c.slot.param)] for c in u.chunks]]
                      if len(set(ps)) > 1 and ps.count(max(ps)) > 1]
        assert len(split_last) == 2, split_last
        torch.manual_seed(1)
        for _ in range(4):
            model(torch.randn(8, 128, dtype=dtype)).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        runs.append(([p.detach().clone() for p in model.parameters()], opt.state_dict()))
        opt.close()
    assert_same(runs[1][0], runs[0][0])
    assert_same_state(runs[1][1], runs[0][1])


def test_bf16_weights_with_int8_state_keep_masters_as_torchao_updates_fp32_weights(monkeypatch, closing, nvme):
    """With bf16 weights and fp32 masters, the masters are torchao's AdamW8bit run on fp32 copies of the
    weights with the bf16 grads, and the weights their rounding."""
    torchao_optim = pytest.importorskip("torchao.optim")
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    model = make_model(torch.bfloat16)
    masters = [nn.Parameter(p.detach().float()) for p in model.parameters()]
    opt = closing(OffloadedAdamW(model.parameters(), lr=1e-3, nvme_path=nvme, state_dtype="int8"))
    ref = torchao_optim.AdamW8bit(masters, lr=1e-3)
    torch.manual_seed(1)
    for _ in range(3):
        model(torch.randn(16, 64, dtype=torch.bfloat16)).float().pow(2).mean().backward()
        for m, p in zip(masters, model.parameters()):
            m.grad = p.grad.float()
        opt.step()
        ref.step()
        opt.zero_grad()
    sd = opt.state_dict()
    assert_same([sd["state"][i]["master"] for i in range(len(masters))], [m.detach() for m in masters])
    assert_same(list(model.parameters()), [m.detach().bfloat16() for m in masters])


def test_int8_state_is_two_bytes_and_a_block_scale_per_element(closing, nvme):
    """A unit holds 1 byte per element per moment and 4 bytes per 256 elements for each moment's absmax
    (each slice 64-byte aligned), and 4 more per element for a bf16 parameter's master."""
    w = nn.Parameter(torch.zeros(64 * 1024, dtype=torch.bfloat16))
    for master, per in ((True, 6), (False, 2)):
        opt = closing(OffloadedAdamW([w], nvme_path=nvme, state_dtype="int8", master_weights=master))
        expected = 2 * w.numel() + 2 * 4 * (w.numel() // 256) + (4 * w.numel() if master else 0)
        assert opt.offloaded_state_bytes == expected
        assert per <= opt.offloaded_state_bytes / w.numel() < per + 0.04
        opt.close()


@pytest.mark.parametrize("mode", [{"state_dtype": "int8"}, {"master_weights": False},
                                  {"state_dtype": "int8", "master_weights": False},
                                  {"state_dtype": "bf16", "master_weights": False}],
                         ids=["int8", "no master", "int8 no master", "bf16 no master"])
def test_a_run_resumed_from_a_state_dict_or_a_checkpoint_equals_the_uninterrupted_run(closing, nvme, tmp_path, mode):
    """Saved after 3 steps and loaded into new optimizers (a state dict; a checkpoint read into another
    buffer size, so re-chunked), 3 more steps give the uninterrupted run's weights and state bit for bit: the
    8-bit codes come back from the dequantized state dict, and the rounding draws the same stream."""
    def build(buffer_size=32768):
        model = make_model(torch.bfloat16)
        return model, closing(OffloadedAdamW(model.parameters(), lr=1e-3, nvme_path=nvme, buffer_size=buffer_size,
                                             seed=11, **mode))
    model, opt = build()
    train(model, opt, 3, seed=1)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    sd = copy.deepcopy(opt.state_dict())  # torch's state_dict shares the in-memory state's tensors
    opt.save_checkpoint(tmp_path / "ck", model=model)
    train(model, opt, 3, seed=2)
    for how in ("state dict", "checkpoint"):
        again, opt2 = build(buffer_size=16384 if how == "checkpoint" else 32768)
        if how == "state dict":
            again.load_state_dict(weights)
            opt2.load_state_dict(sd)
            assert_same_state(opt2.state_dict(), sd)
        else:
            opt2.load_checkpoint(tmp_path / "ck", model=again)
        train(again, opt2, 3, seed=2)
        assert_same(list(again.parameters()), list(model.parameters()))
        assert_same_state(opt2.state_dict(), opt.state_dict())
        opt2.close()


def test_without_a_master_the_weights_are_rounded_stochastically_by_the_seed(closing, nvme):
    """bf16 weights without a master: a second run with the same seed gives the same bits, another seed other
    bits; the state holds no master."""
    runs = {}
    for seed in (5, 5, 6):
        model = make_model(torch.bfloat16)
        opt = closing(OffloadedAdamW(model.parameters(), lr=1e-3, nvme_path=nvme, master_weights=False, seed=seed))
        train(model, opt, 3)
        assert all("master" not in st for st in opt.state_dict()["state"].values())
        runs.setdefault(seed, []).append([p.detach().clone() for p in model.parameters()])
        opt.close()
    assert_same(runs[5][0], runs[5][1])
    assert any(not torch.equal(a, b) for a, b in zip(runs[5][0], runs[6][0]))


def test_master_weights_off_refuses_fp16_parameters_and_a_bad_seed(nvme):
    """fp16 weights keep their master: asking otherwise is a ValueError naming the parameter and what to do;
    a seed that is not a non-negative int is refused."""
    with pytest.raises(ValueError, match="bf16.*master_weights=True"):
        OffloadedAdamW(make_model(torch.float16).parameters(), nvme_path=nvme, master_weights=False)
    with pytest.raises(ValueError, match="seed"):
        OffloadedAdamW(make_model().parameters(), nvme_path=nvme, seed=-1)


def test_a_grad_scaler_unscales_grads_itself_for_int8_state(closing, nvme):
    """torchao's formula takes no scale: a GradScaler unscales the grads before step(), as for any
    optimizer whose kernel does not, and the step equals one on unscaled grads."""
    a, b = make_model(), make_model()
    oa = closing(OffloadedAdamW(a.parameters(), nvme_path=nvme, state_dtype="int8"))
    ob = closing(OffloadedAdamW(b.parameters(), nvme_path=nvme, state_dtype="int8"))
    assert not oa._step_supports_amp_scaling
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    torch.manual_seed(1)
    x = torch.randn(16, 64)
    scaler.scale(a(x).pow(2).mean()).backward()
    scaler.step(oa)
    b(x).pow(2).mean().backward()
    ob.step()
    assert_same(list(a.parameters()), list(b.parameters()))


def test_a_loss_scale_handed_to_step_is_unscaled_first_with_int8_state(closing, nvme):
    """The GradScaler protocol that offload.initialize drives for fp16 (grad_scale and found_inf set on the
    optimizer): torchao's formula takes no scale, so the grads are unscaled first, and the step equals the
    one on unscaled grads (a scale left in would make the moments 65536 times too large)."""
    a, b = make_model(), make_model()
    oa = closing(OffloadedAdamW(a.parameters(), nvme_path=nvme, state_dtype="int8"))
    ob = closing(OffloadedAdamW(b.parameters(), nvme_path=nvme, state_dtype="int8"))
    assert oa.takes_grad_scale and not oa._step_supports_amp_scaling
    torch.manual_seed(1)
    for _ in range(2):
        x = torch.randn(16, 64)
        (a(x).pow(2).mean() * 65536).backward()
        oa.grad_scale, oa.found_inf = torch.tensor(65536.0), torch.zeros(())
        oa.step()
        del oa.grad_scale, oa.found_inf
        b(x).pow(2).mean().backward()
        ob.step()
        oa.zero_grad()
        ob.zero_grad()
    assert_same(list(a.parameters()), list(b.parameters()))


def test_int8_state_refuses_fp64_parameters_and_says_what_stays_in_memory(nvme, closing):
    """fp64 weights cannot take torchao's fp32 formula: refused with what to do; parameters that 8-bit state
    would quantize but small_param_threshold keeps in memory (fp32 moments) are named in a warning."""
    with pytest.raises(ValueError, match="fp64"):
        OffloadedAdamW([nn.Parameter(torch.zeros(8192, dtype=torch.float64))], nvme_path=nvme, state_dtype="int8")
    with pytest.warns(UserWarning, match="small_param_threshold"):
        closing(OffloadedAdamW([nn.Parameter(torch.zeros(8192))], nvme_path=nvme, state_dtype="int8",
                               small_param_threshold=10000))


def test_an_int8_checkpoint_exports_the_state_dict_dequantized(closing, nvme, tmp_path):
    """offload-ckpt's export of an int8 checkpoint is the optimizer's state_dict: fp32 moments in torch's
    layout, no absmax keys."""
    model = make_model(torch.bfloat16)
    opt = closing(OffloadedAdamW(model.parameters(), nvme_path=nvme, state_dtype="int8"))
    train(model, opt, 2)
    opt.save_checkpoint(tmp_path / "ck")
    exported = export_state_dict(tmp_path / "ck")
    assert_same_state(exported, opt.state_dict())
    assert not any(k.endswith(codes.ABSMAX) for st in exported["state"].values() for k in st)


@pytest.mark.parametrize("saved, loaded", [("fp32", "int8"), ("fp32", "bf16"), ("int8", "fp32")])
def test_state_saved_in_one_dtype_loads_into_another_as_its_state_dict_would(closing, nvme, tmp_path, saved, loaded):
    """A checkpoint of fp32 state loaded into an int8 or bf16 optimizer, and one of int8 state into an fp32 one,
    holds what loading its state dict there gives: the values converted, not refused."""
    model = make_model(torch.bfloat16)
    opt = closing(OffloadedAdamW(model.parameters(), nvme_path=nvme, state_dtype=saved))
    train(model, opt, 2)
    opt.save_checkpoint(tmp_path / "ck")
    for kind in (loaded,):
        via_ck = closing(OffloadedAdamW(make_model(torch.bfloat16).parameters(), nvme_path=nvme, state_dtype=kind,
                                        buffer_size=16384))
        via_ck.load_checkpoint(tmp_path / "ck")
        via_sd = closing(OffloadedAdamW(make_model(torch.bfloat16).parameters(), nvme_path=nvme, state_dtype=kind))
        via_sd.load_state_dict(opt.state_dict())
        assert_same_state(via_ck.state_dict(), via_sd.state_dict())
        assert math.isclose(via_ck.state_dict()["state"][0]["exp_avg"].abs().sum().item(),
                            opt.state_dict()["state"][0]["exp_avg"].abs().sum().item(), rel_tol=0.05)


def test_rounding_without_a_master_draws_afresh_each_step_so_small_updates_add_up(closing, nvme):
    """An update of a tenth of a bf16 step, 50 times: each element moves down by about 5 steps on average
    (Binomial(50, 0.1)), none by far more; a stream that repeated itself each step would move an element
    every time or never (50 steps or none)."""
    w = nn.Parameter(torch.full((8192,), 1.5, dtype=torch.bfloat16))
    ulp = 2.0 ** -7  # bf16's step in [1, 2)
    opt = closing(OffloadedAdamW([w], lr=ulp / 10, betas=(0.9, 0.999), eps=1e-12, weight_decay=0.0, nvme_path=nvme,
                                 master_weights=False))
    for _ in range(50):
        w.grad = torch.ones_like(w)
        opt.step()
    moved = (1.5 - w.detach().float()) / ulp
    assert abs(moved.mean().item() - 5.0) < 0.3
    assert moved.max().item() <= 16 and moved.min().item() >= 0
