"""The optimizer on a GPU: CUDA parameters against torch's fused AdamW on the same device, bit for bit (fp32,
bf16 with fp32 masters, bf16 autocast, state in host memory, overlap_backward) and checkpoints of a CUDA model.

Every test here needs CUDA (conftest skips them without it). Each is the CPU test of the same property with
the tensors moved to ``DEVICE``: set ``DEVICE = "cpu"`` and drop the marker to run them on a CPU.
"""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from helpers import (
    OPT,
    REPO,
    SIZES,
    SMALL,
    Net,
    assert_same,
    assert_same_state,
    batch,
    make_params,
    run_python,
    snapshot,
)

from offload import OffloadedAdamW, materialized, offload_parameters, restore_parameters
from offload.checkpoint import load_checkpoint, save_checkpoint

DEVICE = "cuda"
pytestmark = pytest.mark.gpu


def on_device(params):
    """The parameters as leaves on ``DEVICE``."""
    return [torch.nn.Parameter(p.detach().to(DEVICE)) for p in params]


def set_grads(*param_lists, seed, skip=()):
    """The same random grads (drawn on the CPU, then moved) for every list, none at the indices in ``skip``."""
    g = torch.Generator().manual_seed(seed)
    for i, p in enumerate(param_lists[0]):
        grad = torch.randn(p.shape, generator=g)
        for params in param_lists:
            params[i].grad = None if i in skip else grad.to(DEVICE, params[i].dtype)


def train_model(model, opt, steps, *, autocast=False, micro: int = 1):
    """Training steps on helpers' batches moved to ``DEVICE``, each of ``micro`` backward passes, all but the
    last inside ``opt.no_step()`` (which changes nothing without overlap_backward); returns the losses."""
    losses = []
    dtype = next(model.parameters()).dtype
    for step in steps:
        for m in range(micro):
            x, y = (t.to(DEVICE) for t in batch(step * micro + m, dtype))
            with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
                loss = (model(x) - y).float().square().mean()
            with opt.no_step() if m < micro - 1 else contextlib.nullcontext():
                loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses


def model_pair(seed=0, dtype=torch.float32):
    """Two identical helpers.Net models on ``DEVICE``."""
    torch.manual_seed(seed)
    a = Net().to(DEVICE, dtype)
    b = Net().to(DEVICE, dtype)
    b.load_state_dict(a.state_dict())
    return a, b


def test_cuda_fp32_steps_are_bitwise_equal_to_torch_fused(nvme, closing):
    """fp32 CUDA parameters of every size (kept in memory, one unit, split over units): six steps, two with a
    parameter lacking a grad, give the weights and state of torch's fused AdamW on the GPU, bit for bit."""
    a, b = on_device(make_params()), on_device(make_params())
    ours = closing(OffloadedAdamW(a, lr=1e-2, nvme_path=nvme, fused=True, **SMALL))
    ref = torch.optim.AdamW(b, lr=1e-2, fused=True)
    for step in range(6):
        set_grads(a, b, seed=step, skip={2} if step in (1, 4) else ())
        ours.step()
        ref.step()
        assert_same(a, b)
    assert_same_state(ours.state_dict(), ref.state_dict())


def test_cuda_bf16_params_of_every_size_follow_torch_on_their_fp32_masters(nvme, closing):
    """bf16 CUDA parameters, small ones (state in memory) and large ones (offloaded) alike, are updated from an
    fp32 master: equal to torch's fused fp32 AdamW on the GPU, rounded to bf16, and the master equal to it."""
    a = on_device(make_params(dtype=torch.bfloat16))
    b = [torch.nn.Parameter(p.detach().float()) for p in a]
    ours = closing(OffloadedAdamW(a, lr=1e-2, nvme_path=nvme, fused=True, **SMALL))
    ref32 = torch.optim.AdamW(b, lr=1e-2, fused=True)
    for step in range(6):
        set_grads(a, seed=step)
        for p, q in zip(a, b):
            q.grad = p.grad.float()
        ours.step()
        ref32.step()
    assert min(SIZES) < SMALL["small_param_threshold"] < max(SIZES)
    sd, ref_sd = ours.state_dict(), ref32.state_dict()
    for i, (p, q) in enumerate(zip(a, b)):
        assert p.dtype == torch.bfloat16 and p.device.type == DEVICE
        assert torch.equal(p, q.detach().to(torch.bfloat16)), f"parameter {i} ({p.numel()} elements)"
        assert torch.equal(sd["state"][i]["master"].cpu(), q.detach().cpu()), f"master {i}"
        assert torch.equal(sd["state"][i]["exp_avg"].cpu(), ref_sd["state"][i]["exp_avg"].cpu()), f"exp_avg {i}"


def test_bf16_autocast_training_equals_torch_fused(nvme, closing):
    """A model with fp32 weights trained under bf16 autocast on the GPU: the same losses, weights and state as
    torch's fused AdamW, bit for bit."""
    a, b = model_pair(seed=1)
    ours = closing(OffloadedAdamW(a.parameters(), nvme_path=nvme, fused=True, **OPT))
    ref = torch.optim.AdamW(b.parameters(), lr=OPT["lr"], fused=True)
    la = train_model(a, ours, range(5), autocast=True)
    lb = train_model(b, ref, range(5), autocast=True)
    assert la == lb
    assert la[-1] < la[0]
    assert_same(list(a.parameters()), list(b.parameters()))
    assert_same_state(ours.state_dict(), ref.state_dict())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_checkpoint_of_a_cuda_model_resumes_bit_for_bit(nvme, closing, tmp_path, dtype):
    """A CUDA model and its optimizer saved after three steps, loaded into a fresh model and a fresh optimizer
    (another swap directory), train three more steps exactly as the original does."""
    a, b = model_pair(seed=2, dtype=dtype)
    ours = closing(OffloadedAdamW(a.parameters(), nvme_path=nvme, fused=True, **OPT))
    train_model(a, ours, range(3))
    save_checkpoint(ours, tmp_path / "ckpt", model=a, extra={"step": 3})
    fresh = closing(OffloadedAdamW(b.parameters(), nvme_path=nvme + "-fresh", fused=True, **OPT))
    assert load_checkpoint(fresh, tmp_path / "ckpt", model=b) == {"step": 3}
    assert_same(list(b.parameters()), list(a.parameters()))
    assert all(p.device.type == DEVICE for p in b.parameters())
    la = train_model(a, ours, range(3, 6))
    lb = train_model(b, fresh, range(3, 6))
    assert la == lb
    assert_same(list(a.parameters()), list(b.parameters()))
    assert_same_state(ours.state_dict(), fresh.state_dict())


@pytest.mark.parametrize("tier", [dict(device="cpu"), dict(host_cache=OPT["buffer_size"])],
                         ids=["device-cpu", "host-cache"])
def test_state_in_host_memory_with_cuda_params_equals_torch_fused(nvme, closing, tier):
    """offload_optimizer.device "cpu" (all state in host memory) and a host cache of one unit of two: CUDA
    parameters train like torch's fused AdamW on the GPU, bit for bit."""
    a, b = model_pair(seed=3)
    ours = closing(OffloadedAdamW(a.parameters(), nvme_path=nvme, fused=True, **{**OPT, **tier}))
    ref = torch.optim.AdamW(b.parameters(), lr=OPT["lr"], fused=True)
    la = train_model(a, ours, range(5))
    lb = train_model(b, ref, range(5))
    assert ours.host_cache_bytes > 0
    assert la == lb
    assert_same(list(a.parameters()), list(b.parameters()))
    assert_same_state(ours.state_dict(), ref.state_dict())


def test_overlap_backward_on_cuda_equals_torch_fused(nvme, closing):
    """With overlap_backward (units updated during backward), a CUDA model trains like torch's fused AdamW on
    the GPU: the same losses, weights and state, bit for bit."""
    a, b = model_pair(seed=4)
    before = snapshot(a.parameters())
    ours = closing(OffloadedAdamW(a.parameters(), nvme_path=nvme, fused=True, overlap_backward=True, **OPT))
    ref = torch.optim.AdamW(b.parameters(), lr=OPT["lr"], fused=True)
    la = train_model(a, ours, range(5))
    lb = train_model(b, ref, range(5))
    assert la == lb
    assert not all(torch.equal(p, q) for p, q in zip(a.parameters(), before))
    assert_same(list(a.parameters()), list(b.parameters()))
    assert_same_state(ours.state_dict(), ref.state_dict())


@pytest.mark.parametrize("offload", [None, dict(max_in_cpu=0, max_grad_in_cpu=0, offload_grads=True)],
                         ids=["weights-in-memory", "weights-and-grads-on-nvme"])
@pytest.mark.parametrize("clip", [None, 0.5], ids=["no-clip", "clip"])
def test_overlap_on_cuda_equals_the_same_optimizer_without_it(nvme, closing, offload, clip):
    """overlap_backward on a GPU (the worker's own stream) against the same optimizer without it, bit for bit,
    with accumulation (no_step), with max_grad_norm (the clip factor computed on the caller's stream at
    step(), read by the worker's), and with weights and grads on NVMe (a grad dropped as soon as the update
    that reads it was issued)."""
    a, b = model_pair(seed=11)
    models = []
    try:
        for i, m in enumerate((a, b)):
            if offload is not None:
                offload_parameters(m, nvme_path=f"{nvme}-w{i}", buffer_size=OPT["buffer_size"], **offload)
                models.append(m)
        ours = closing(OffloadedAdamW(a.parameters(), nvme_path=nvme, fused=True, overlap_backward=True,
                                      max_grad_norm=clip, **OPT))
        ref = closing(OffloadedAdamW(b.parameters(), nvme_path=nvme + "-ref", fused=True, max_grad_norm=clip, **OPT))
        assert train_model(a, ours, range(4), micro=2) == train_model(b, ref, range(4), micro=2)
        with contextlib.ExitStack() as stack:
            for m in models:
                stack.enter_context(materialized(m))
            assert_same(list(a.parameters()), list(b.parameters()))
        assert_same_state(ours.state_dict(), ref.state_dict())
        if clip is not None:
            assert torch.equal(ours.last_grad_norm, ref.last_grad_norm)
    finally:
        for m in models:
            restore_parameters(m)


# -- what the CPU emulator of copies cannot show (tests/test_copies.py shows the ordering of copies; the
# -- worker's stream against the caller's work, above and below, needs a GPU) ------------------------


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("tier", [dict(), dict(device="cpu"), dict(overlap_backward=True)],
                         ids=["nvme", "device-cpu", "overlap"])
def test_params_on_the_second_gpu_with_the_current_device_the_first(nvme, closing, tier):
    """Parameters on cuda:1 while the current device is cuda:0 (as in the overlap worker's thread): copies and
    their completion go on cuda:1's streams, so the model trains like torch's fused AdamW there, and no work
    lands on cuda:0."""
    torch.cuda.set_device(0)
    torch.manual_seed(5)
    a = Net().to("cuda:1")
    b = Net().to("cuda:1")
    b.load_state_dict(a.state_dict())
    ours = closing(OffloadedAdamW(a.parameters(), nvme_path=nvme, fused=True, **{**OPT, **tier}))
    ref = torch.optim.AdamW(b.parameters(), lr=OPT["lr"], fused=True)
    before = torch.cuda.memory_allocated(0)
    for model, opt in ((a, ours), (b, ref)):
        for step in range(4):
            x, y = (t.to("cuda:1") for t in batch(step))
            (model(x) - y).square().mean().backward()
            opt.step()
            opt.zero_grad()
    assert torch.cuda.current_device() == 0
    assert torch.cuda.memory_allocated(0) == before
    assert_same(list(a.parameters()), list(b.parameters()))


def test_backward_on_a_side_stream_with_overlap_equals_torch(nvme, closing):
    """Forward and backward under ``torch.cuda.stream(side)``: the update that backward starts waits for the
    side stream before reading the grads, so training equals torch's fused AdamW stepped after a sync."""
    a, b = model_pair(seed=6)
    ours = closing(OffloadedAdamW(a.parameters(), nvme_path=nvme, fused=True, overlap_backward=True, **OPT))
    ref = torch.optim.AdamW(b.parameters(), lr=OPT["lr"], fused=True)
    side = torch.cuda.Stream()
    for model, opt in ((a, ours), (b, ref)):
        for step in range(4):
            x, y = (t.to(DEVICE) for t in batch(step))
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                (model(x) - y).square().mean().backward()
            torch.cuda.current_stream().wait_stream(side)
            opt.step()
            opt.zero_grad()
    assert_same(list(a.parameters()), list(b.parameters()))


def test_grad_scaler_with_fp16_autocast_on_cuda_equals_torch(nvme, closing):
    """A GradScaler with fp16 autocast, scale growth and an overflow step skipped: the same weights and state
    as torch's fused AdamW under the same scaler."""
    a, b = model_pair(seed=7)
    ours = closing(OffloadedAdamW(a.parameters(), nvme_path=nvme, fused=True, **OPT))
    ref = torch.optim.AdamW(b.parameters(), lr=OPT["lr"], fused=True)
    for model, opt in ((a, ours), (b, ref)):
        scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 20, growth_interval=2)
        for step in range(5):
            x, y = (t.to(DEVICE) for t in batch(step))
            with torch.autocast(DEVICE, dtype=torch.float16):
                loss = (model(x) - y).float().square().mean()
            scaler.scale(loss * (1e30 if step == 2 else 1.0)).backward()  # step 2 overflows: skipped
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    assert_same(list(a.parameters()), list(b.parameters()))
    assert_same_state(ours.state_dict(), ref.state_dict())


def test_bf16_state_on_cuda_is_torch_fused_with_its_moments_rounded_to_bf16(nvme, closing):
    """state_dtype "bf16" with bf16 CUDA parameters (fp32 masters): each step is torch's fused AdamW on the fp32
    masters with the offloaded parameters' moments rounded to bf16 (to nearest) after it, bit for bit, weights
    and state. (Against torch with fp32 moments the weights only stay close: where a grad is near zero its
    sign, and so Adam's update of lr, follows the rounding.)"""
    a = on_device(make_params(dtype=torch.bfloat16))
    ours = closing(OffloadedAdamW(a, lr=1e-2, nvme_path=nvme, fused=True, state_dtype="bf16", **SMALL))
    masters = [torch.nn.Parameter(p.detach().float()) for p in a]
    ref = torch.optim.AdamW(masters, lr=1e-2, fused=True)
    narrow = [m for p, m in zip(a, masters) if not ours.state_store.is_small(p)]
    assert narrow and len(narrow) < len(a)
    for step in range(4):
        set_grads(a, seed=step, skip={2} if step == 1 else ())
        for p, m in zip(a, masters):
            m.grad = None if p.grad is None else p.grad.float()
        ours.step()
        ref.step()
        for m in narrow:
            for k in ("exp_avg", "exp_avg_sq"):
                ref.state[m][k].copy_(ref.state[m][k].bfloat16())
        ours.zero_grad()
        ref.zero_grad()
    assert_same(a, [m.detach().bfloat16() for m in masters])
    state = ours.state_dict()["state"]
    for i, m in enumerate(masters):
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[i][k].cpu(), ref.state[m][k].cpu()), (i, k)


def test_state_dict_of_cuda_params_keeps_offloaded_state_on_the_host(nvme, closing):
    """state_dict() with CUDA parameters gives offloaded state as CPU tensors (where it lives: larger than the
    GPU's memory is the case this is for), equal to torch's; no device memory is taken for it."""
    a, b = model_pair(seed=9)
    ours = closing(OffloadedAdamW(a.parameters(), nvme_path=nvme, fused=True, **OPT))
    ref = torch.optim.AdamW(b.parameters(), lr=OPT["lr"], fused=True)
    train_model(a, ours, range(2))
    train_model(b, ref, range(2))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    sd = ours.state_dict()
    assert torch.cuda.memory_allocated() == before
    params = [p for g in ours.param_groups for p in g["params"]]
    for i, entry in sd["state"].items():
        if not ours.state_store.is_small(params[i]):
            assert all(t.device.type == "cpu" for k, t in entry.items() if k != "step")
    assert_same_state(sd, ref.state_dict())


def test_offload_bench_adam_with_state_in_host_memory_on_cuda_runs(tmp_path):
    """``offload-bench adam --device cuda --offload-device cpu`` (state in host memory, CUDA parameters: the
    copies of both directions overlap on two streams) runs and reports a step time."""
    out = tmp_path / "adam.json"
    (tmp_path / "scratch").mkdir()
    proc = run_python("-m", "offload.tools", "adam", "--params", "2M", "--dtype", "bf16", "--device", "cuda",
                      "--offload-device", "cpu", "--steps", "3", "--no-fio", "--no-torch", "--path",
                      str(tmp_path / "scratch"), "--json", str(out), timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text())


def test_int8_state_on_the_gpu_equals_torchaos_8bit_adamw_there(nvme, closing, monkeypatch):
    """CUDA parameters with state_dtype int8: the state crosses to the GPU and torchao's formula runs there as
    torch operations, so weights equal torchao's AdamW8bit on the same device bit for bit."""
    torchao_optim = pytest.importorskip("torchao.optim")
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    torch.manual_seed(0)
    base = [torch.randn(64, 1024), torch.randn(4096 + 256), torch.randn(300)]
    ours, theirs = on_device(base), on_device(base)
    opt = closing(OffloadedAdamW(ours, lr=1e-3, nvme_path=nvme, state_dtype="int8", buffer_size=1 << 16))
    ref = torchao_optim.AdamW8bit(theirs, lr=1e-3)
    for step in range(4):
        set_grads(ours, theirs, seed=step)
        opt.step()
        ref.step()
    assert_same(ours, theirs)


def test_bf16_weights_without_masters_on_the_gpu_resume_bit_for_bit(nvme, closing, tmp_path):
    """master_weights=False with CUDA bf16 weights: the rounding's stream is drawn on the GPU; a run resumed
    from a checkpoint equals the uninterrupted one bit for bit."""
    def build():
        torch.manual_seed(0)
        params = on_device([torch.randn(64, 1024).bfloat16(), torch.randn(8192).bfloat16()])
        return params, closing(OffloadedAdamW(params, lr=1e-3, nvme_path=nvme, master_weights=False,
                                              state_dtype="int8", seed=3))
    a, oa = build()
    for step in range(2):
        set_grads(a, seed=step)
        oa.step()
    save_checkpoint(oa, tmp_path / "ck")
    weights = snapshot(a)
    for step in range(2, 4):
        set_grads(a, seed=step)
        oa.step()
    b, ob = build()
    with torch.no_grad():
        for p, w in zip(b, weights):
            p.copy_(w)
    load_checkpoint(ob, tmp_path / "ck")
    for step in range(2, 4):
        set_grads(b, seed=step)
        ob.step()
    assert_same(a, b)
