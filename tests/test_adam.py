"""OffloadedAdam / OffloadedAdamW: parity with torch's optimizers, state interchange, errors, faults.

Buffers are kept small (256 KiB) and the small-parameter threshold low, so that even these small
tensors are split across several units and several pool buffers, which is what must not change the
results.
"""

from __future__ import annotations

import copy
import ctypes
import errno
import gc
import io
import os

import pytest
import torch
from helpers import SMALL, assert_same, first_os_error, make_params

from offload import ConfigError, ConfigWarning, OffloadedAdam, OffloadedAdamW, StateError
from offload._proc import reset_peak_rss, status_bytes

MiB = 1 << 20


def set_grads(*param_lists, seed, skip=()):
    g = torch.Generator().manual_seed(seed)
    for i, p in enumerate(param_lists[0]):
        grad = None if i in skip else torch.randn(p.shape, generator=g).to(p.dtype)
        for params in param_lists:
            params[i].grad = None if grad is None else grad.clone()


def step_together(ours, ref, a, b, steps):
    """Give both parameter lists the same grads and step both optimizers, once per seed in ``steps``."""
    for step in steps:
        set_grads(a, b, seed=step)
        ours.step()
        ref.step()


PARITY_CASES = [
    pytest.param(OffloadedAdamW, torch.optim.AdamW, dict(fused=True), id="adamw-fused"),
    pytest.param(OffloadedAdamW, torch.optim.AdamW, dict(fused=False), id="adamw-forloop"),
    pytest.param(OffloadedAdamW, torch.optim.AdamW, dict(foreach=True), id="adamw-foreach"),
    pytest.param(OffloadedAdam, torch.optim.Adam, dict(fused=True), id="adam-fused"),
    pytest.param(OffloadedAdam, torch.optim.Adam, dict(fused=False, weight_decay=0.1), id="adam-l2"),
    pytest.param(OffloadedAdamW, torch.optim.AdamW, dict(fused=True, amsgrad=True), id="adamw-amsgrad"),
    pytest.param(OffloadedAdam, torch.optim.Adam, dict(fused=False, amsgrad=True, maximize=True),
                 id="adam-amsgrad-max"),
    pytest.param(OffloadedAdamW, torch.optim.AdamW, dict(fused=True, maximize=True, weight_decay=0.3,
                                                         betas=(0.8, 0.99), eps=1e-6), id="adamw-hyper"),
]


@pytest.mark.parametrize("ours_cls, torch_cls, kw", PARITY_CASES)
def test_fp32_cpu_steps_are_bitwise_equal_to_torch(nvme, closing, ours_cls, torch_cls, kw):
    """Six steps, one with a parameter lacking a grad, give bit-identical parameters and state."""
    a, b = make_params(), make_params()
    ours = closing(ours_cls(a, lr=1e-2, nvme_path=nvme, **SMALL, **kw))
    ref = torch_cls(b, lr=1e-2, **kw)
    for step in range(6):
        set_grads(a, b, seed=step, skip={2} if step in (1, 4) else ())
        ours.step()
        ref.step()
        assert_same(a, b)
    sd, rsd = ours.state_dict(), ref.state_dict()
    assert sd["state"].keys() == rsd["state"].keys()
    for i, entry in rsd["state"].items():
        for key, value in entry.items():
            assert torch.equal(sd["state"][i][key].to(value.device), value), (i, key)


def test_default_kernel_is_torchs_fused_one(nvme, closing):
    """With fused=None, the result equals torch's fused AdamW bit for bit."""
    a, b = make_params(), make_params()
    ours = closing(OffloadedAdamW(a, lr=3e-3, nvme_path=nvme, **SMALL))
    ref = torch.optim.AdamW(b, lr=3e-3, fused=True)
    step_together(ours, ref, a, b, range(3))
    assert_same(a, b)


def test_param_groups_with_different_hyperparameters_frozen_and_empty_params(nvme, closing):
    """Groups with their own lr/betas/decay, a frozen param, a zero-size param and one never given a grad."""
    def groups(params):
        return [
            {"params": params[:2], "lr": 1e-2, "weight_decay": 0.0},
            {"params": params[2:4], "lr": 5e-3, "betas": (0.5, 0.9), "amsgrad": True},
            {"params": params[4:], "lr": 2e-2, "weight_decay": 0.5},
        ]

    sizes = (100, 0, 5000, 70_000, 300_001, 2048)
    a, b = make_params(sizes), make_params(sizes)
    a[3].requires_grad_(False)
    b[3].requires_grad_(False)
    ours = closing(OffloadedAdamW(groups(a), nvme_path=nvme, fused=True, **SMALL))
    ref = torch.optim.AdamW(groups(b), fused=True)
    for step in range(4):
        set_grads(a, b, seed=step, skip={3, 5})
        ours.step()
        ref.step()
        assert_same(a, b)
    assert len(ours.state_dict()["state"]) == len(ref.state_dict()["state"])


def test_param_frozen_at_construction_and_unfrozen_later_gets_state(nvme, closing):
    """A parameter that had no space at construction (frozen) is laid out when its first grad arrives."""
    a, b = make_params(), make_params()
    for p in (a[3], b[3]):
        p.requires_grad_(False)
    ours = closing(OffloadedAdamW(a, nvme_path=nvme, fused=True, **SMALL))
    ref = torch.optim.AdamW(b, fused=True)
    set_grads(a, b, seed=0, skip={3})
    ours.step()
    ref.step()
    for p in (a[3], b[3]):
        p.requires_grad_(True)
    step_together(ours, ref, a, b, range(1, 3))
    assert_same(a, b)


@pytest.mark.parametrize("schedule", ["onecycle", "cosine", "lambda"])
def test_lr_schedulers_drive_the_offloaded_optimizer_like_torchs(nvme, closing, schedule):
    """LR schedulers see real param_groups: the schedule and the resulting weights match torch's."""
    def scheduler(opt):
        if schedule == "onecycle":
            return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=5)
        if schedule == "cosine":
            return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5)
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)

    a, b = make_params(), make_params()
    ours = closing(OffloadedAdamW(a, lr=1e-2, nvme_path=nvme, fused=True, **SMALL))
    ref = torch.optim.AdamW(b, lr=1e-2, fused=True)
    s1, s2 = scheduler(ours), scheduler(ref)
    for step in range(5):
        set_grads(a, b, seed=step)
        ours.step()
        ref.step()
        s1.step()
        s2.step()
        assert ours.param_groups[0]["lr"] == ref.param_groups[0]["lr"]
    assert_same(a, b)


def test_grad_accumulation_and_clipping_and_closure(nvme, closing):
    """Accumulated grads, clip_grad_norm_ and step(closure) behave as with torch's AdamW."""
    torch.manual_seed(0)
    model_a = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 8))
    model_b = copy.deepcopy(model_a)
    ours = closing(OffloadedAdamW(model_a.parameters(), lr=1e-2, nvme_path=nvme, fused=True, **SMALL))
    ref = torch.optim.AdamW(model_b.parameters(), lr=1e-2, fused=True)
    data = [(torch.randn(16, 64), torch.randn(16, 8)) for _ in range(6)]

    def closure(model, opt, batches):
        """What step() re-evaluates: fresh grads accumulated over micro-batches, clipped; their loss."""
        def run():
            opt.zero_grad()
            total = torch.zeros(())
            for x, y in batches:
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                total += loss.detach()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            return total
        return run

    losses = []
    for start in range(0, 6, 3):
        # Called under no_grad, as a training loop may: step() must enable grad for the closure.
        with torch.no_grad():
            la = ours.step(closure(model_a, ours, data[start:start + 3]))
            lb = ref.step(closure(model_b, ref, data[start:start + 3]))
        assert torch.equal(la, lb), f"closure losses {la.item()} != {lb.item()}"
        losses.append(la.item())
        assert_same(list(model_a.parameters()), list(model_b.parameters()))
    assert losses[1] != losses[0]  # the closures saw the updated weights


def test_grad_scaler_on_cpu_unscales_and_skips_inf_steps_like_torch(nvme, closing):
    """GradScaler: unscale_ then step matches torch, and a step with inf grads is skipped."""
    a, b = make_params(), make_params()
    ours = closing(OffloadedAdamW(a, lr=1e-2, nvme_path=nvme, fused=False, **SMALL))
    ref = torch.optim.AdamW(b, lr=1e-2, fused=False)
    sa = torch.amp.GradScaler("cpu", init_scale=1024.0)
    sb = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        directions = [torch.randn(p.shape, generator=g) for p in a]
        if step == 2:
            directions[3][0] = float("inf")
        before = [p.detach().clone() for p in a]
        for scaler, opt, params in ((sa, ours, a), (sb, ref, b)):
            opt.zero_grad()
            loss = sum((p * d).sum() for p, d in zip(params, directions))
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        if step == 2:
            assert_same(a, before)
        assert_same(a, b)
    assert sa.get_scale() == sb.get_scale()


@pytest.mark.parametrize("unscale_first", [False, True], ids=["scale-to-step", "unscale_-first"])
@pytest.mark.parametrize("init_scale", [1024.0, 1000.0])
def test_grad_scaler_with_max_grad_norm_clips_the_unscaled_grads_like_torch(nvme, closing, unscale_first,
                                                                            init_scale):
    """A GradScaler with max_grad_norm equals torch's unscale_, clip_grad_norm_, step, bit for bit: the norm
    is the unscaled grads' (last_grad_norm as clip_grad_norm_ returns it), the weights and the state torch's,
    a step with an inf grad skipped. The scale reaches step() (fused kernels) or the user unscales first;
    a scale that is not a power of two is unscaled as GradScaler does it (times its reciprocal)."""
    a, b = make_params(), make_params()
    ours = closing(OffloadedAdamW(a, lr=1e-2, nvme_path=nvme, fused=True, max_grad_norm=0.5, **SMALL))
    ref = torch.optim.AdamW(b, lr=1e-2, fused=True)
    assert ours._step_supports_amp_scaling
    sa = torch.amp.GradScaler("cpu", init_scale=init_scale)
    sb = torch.amp.GradScaler("cpu", init_scale=init_scale)
    for step in range(5):
        g = torch.Generator().manual_seed(step)
        directions = [torch.randn(p.shape, generator=g) for p in a]
        if step == 2:
            directions[3][0] = float("inf")
        before = [p.detach().clone() for p in a]
        for scaler, opt, params in ((sa, ours, a), (sb, ref, b)):
            opt.zero_grad()
            loss = sum((p * d).sum() for p, d in zip(params, directions))
            scaler.scale(loss).backward()
            if opt is ref or unscale_first:
                scaler.unscale_(opt)
            if opt is ref:
                norm = torch.nn.utils.clip_grad_norm_(b, 0.5)
            scaler.step(opt)
            scaler.update()
        if step == 2:
            assert_same(a, before)
        else:
            assert torch.equal(ours.last_grad_norm, norm) and float(norm) > 0.5
        assert_same(a, b)
    assert sa.get_scale() == sb.get_scale()
    sd, ref_sd = ours.state_dict(), ref.state_dict()
    for i in ref_sd["state"]:
        assert_same([sd["state"][i][k] for k in ("exp_avg", "exp_avg_sq")],
                    [ref_sd["state"][i][k] for k in ("exp_avg", "exp_avg_sq")])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_params_keep_an_fp32_master_and_track_torch_on_fp32(nvme, closing, dtype):
    """Every bf16/fp16 param, offloaded or small and kept in memory, is updated from an fp32 master with fp32
    moments: equal to torch's fp32 AdamW on the same values, rounded (a small param's updates do not round
    away, and it does not drift from the large ones)."""
    a = make_params(dtype=dtype)
    b = [torch.nn.Parameter(p.detach().float()) for p in a]
    ours = closing(OffloadedAdamW(a, lr=1e-2, nvme_path=nvme, fused=True, **SMALL))
    ref32 = torch.optim.AdamW(b, lr=1e-2, fused=True)
    for step in range(6):
        set_grads(a, seed=step)
        for p, q in zip(a, b):
            q.grad = p.grad.float()
        ours.step()
        ref32.step()
    small = [i for i, p in enumerate(a) if p.numel() < SMALL["small_param_threshold"]]
    assert small and len(small) < len(a)
    sd, ref_sd = ours.state_dict(), ref32.state_dict()
    for i, (p, q) in enumerate(zip(a, b)):
        assert p.dtype == dtype
        assert torch.equal(p, q.detach().to(dtype)), f"parameter {i} ({'small' if i in small else 'offloaded'})"
        assert sd["state"][i]["master"].dtype == torch.float32
        assert torch.equal(sd["state"][i]["master"], q.detach())
        assert torch.equal(sd["state"][i]["exp_avg"].float(), ref_sd["state"][i]["exp_avg"])


def test_fp16_params_with_a_grad_scaler_match_torch_fused_on_the_fp32_master(nvme, closing):
    """fp16 parameters with a GradScaler (fused kernels): the scale reaches the kernel, which unscales the fp16
    grads against the fp32 master, and a step with an inf grad is skipped whole; the result equals torch's
    fused AdamW on fp32 copies with the same scaler, rounded, over steps that include a skipped one."""
    a = make_params(dtype=torch.float16)
    b = [torch.nn.Parameter(p.detach().float()) for p in a]
    ours = closing(OffloadedAdamW(a, lr=1e-2, nvme_path=nvme, **SMALL))  # fused by default on CPU
    ref = torch.optim.AdamW(b, lr=1e-2, fused=True)
    assert ours._step_supports_amp_scaling
    sa = torch.amp.GradScaler("cpu", init_scale=256.0)
    sb = torch.amp.GradScaler("cpu", init_scale=256.0)
    for step in range(5):
        g = torch.Generator().manual_seed(step)
        directions = [torch.randn(p.shape, generator=g).half() for p in a]
        if step == 2:
            directions[3][0] = float("inf")
        before = [p.detach().clone() for p in a]
        for scaler, opt, params in ((sa, ours, a), (sb, ref, b)):
            opt.zero_grad()
            loss = sum((p * d.to(p.dtype)).float().sum() for p, d in zip(params, directions))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        if step == 2:
            assert_same(a, before)
        assert_same(a, [q.detach().half() for q in b])
    assert sa.get_scale() == sb.get_scale() < 256.0
    sd = ours.state_dict()
    assert all(float(st["step"]) == 4 for st in sd["state"].values())


def test_an_optimizer_refuses_to_be_pickled_or_deep_copied(nvme, closing):
    """copy.deepcopy and pickle of an optimizer raise a clear TypeError instead of a broken copy."""
    import pickle

    ours = closing(OffloadedAdamW(make_params(), nvme_path=nvme, **SMALL))
    for attempt in (lambda: copy.deepcopy(ours), lambda: pickle.dumps(ours)):
        with pytest.raises(TypeError, match="save_checkpoint"):
            attempt()


def test_state_dict_loads_into_torch_and_torch_state_loads_into_ours(nvme, closing):
    """A state_dict moves both ways between OffloadedAdamW and torch.optim.AdamW, and training goes on equal."""
    a, b, c = make_params(), make_params(), make_params()
    ours = closing(OffloadedAdamW(a, lr=1e-2, nvme_path=nvme, fused=True, **SMALL))
    ref = torch.optim.AdamW(b, lr=1e-2, fused=True)
    step_together(ours, ref, a, b, range(3))
    # ours -> torch
    other = torch.optim.AdamW(c, lr=1e-2, fused=True)
    for p, q in zip(c, a):
        p.data.copy_(q.data)
    other.load_state_dict(copy.deepcopy(ours.state_dict()))  # torch aliases same-device tensors
    # torch -> ours
    d = make_params()
    for p, q in zip(d, b):
        p.data.copy_(q.data)
    ours2 = closing(OffloadedAdamW(d, lr=1e-2, nvme_path=nvme, fused=True, **SMALL))
    ours2.load_state_dict(copy.deepcopy(ref.state_dict()))
    for step in range(3, 6):
        set_grads(a, b, c, d, seed=step)
        for opt in (ours, ref, other, ours2):
            opt.step()
    assert_same(a, b)
    assert_same(c, b)
    assert_same(d, b)


def test_torch_save_and_load_of_state_dict_resumes_identically(nvme, closing):
    """state_dict through torch.save/torch.load into a fresh optimizer resumes the same trajectory."""
    a, b = make_params(), make_params()
    ours = closing(OffloadedAdam(a, lr=1e-2, nvme_path=nvme, amsgrad=True, fused=True, **SMALL))
    ref = torch.optim.Adam(b, lr=1e-2, amsgrad=True, fused=True)
    step_together(ours, ref, a, b, range(2))
    blob = io.BytesIO()
    torch.save(ours.state_dict(), blob)
    ours.close()
    resumed = closing(OffloadedAdam(a, lr=1e-2, nvme_path=nvme, amsgrad=True, fused=True, **SMALL))
    blob.seek(0)
    resumed.load_state_dict(torch.load(blob))
    for step in range(2, 5):
        set_grads(a, b, seed=step)
        resumed.step()
        ref.step()
    assert_same(a, b)


def test_load_state_dict_rejects_mismatches_without_changing_anything(nvme, closing):
    """Wrong group count, parameter count or shapes are refused and the optimizer is unchanged."""
    a = make_params()
    ours = closing(OffloadedAdamW(a, lr=1e-2, nvme_path=nvme, **SMALL))
    set_grads(a, seed=0)
    ours.step()
    good = copy.deepcopy(ours.state_dict())  # in-memory state comes back live: "unchanged" needs a copy
    bad_groups = copy.deepcopy(good)
    bad_groups["param_groups"].append(copy.deepcopy(bad_groups["param_groups"][0]))
    bad_count = copy.deepcopy(good)
    bad_count["param_groups"][0]["params"] = bad_count["param_groups"][0]["params"][:-1]
    bad_shape = copy.deepcopy(good)
    bad_shape["state"][4]["exp_avg"] = torch.zeros(7)
    bad_shape["param_groups"][0]["lr"] = 123.0
    for sd, pattern in ((bad_groups, "parameter groups"), (bad_count, "has 4 parameters, this optimizer.s has 5"),
                        (bad_shape, r"shape \(7,\)")):
        with pytest.raises(ValueError, match=pattern):
            ours.load_state_dict(sd)
    assert ours.param_groups[0]["lr"] == 1e-2
    after = ours.state_dict()
    for i in good["state"]:
        for k in good["state"][i]:
            assert torch.equal(after["state"][i][k], good["state"][i][k])


def _peak_rss() -> int:
    """The process's resident-set high-water mark (VmHWM), in bytes."""
    return status_bytes("VmHWM")


def _reset_peak_rss() -> None:
    """Make VmHWM start again from the current RSS (Linux's clear_refs, value 5), after giving freed
    heap memory back (glibc's malloc_trim), so that reusing it cannot hide an allocation."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):
        pass  # not glibc: the measurement is only less strict
    reset_peak_rss()


@pytest.mark.parametrize("numel", [4_200_000, 8_400_000], ids=["64MiB-state", "128MiB-state"])
def test_host_memory_is_the_pool_whatever_the_model_size(nvme, numel):
    """The pool is buffer_count x buffer_size and state many times larger lives on disk: a step's
    peak host memory grows by about the pool, not by the state, whatever the model size."""
    try:
        _reset_peak_rss()
    except OSError as err:
        pytest.skip(f"cannot reset the peak RSS here (/proc/self/clear_refs: {err})")
    a = make_params(sizes=(numel, numel))
    state_bytes = 2 * 2 * numel * 4  # exp_avg and exp_avg_sq of two fp32 parameters
    assert state_bytes >= 64 * MiB
    ours = OffloadedAdamW(a, nvme_path=nvme, **SMALL)
    try:
        assert ours.host_pool_bytes == 3 * 256 * 1024
        assert ours.offloaded_state_bytes >= state_bytes
        set_grads(a, seed=0)
        ours.step()
        read, written = ours.io_bytes()
        assert written >= state_bytes and read == 0  # the first step has nothing to read
        set_grads(a, seed=1)
        # Measured on the second step (the first may import or set up things once), after
        # everything this test allocates for it exists.
        _reset_peak_rss()
        base = _peak_rss()
        ours.step()
        growth = _peak_rss() - base
        read2, _ = ours.io_bytes()
        # All of it read back, but for the units still in the pool's buffers from the first step's writes.
        assert read2 >= state_bytes - ours.host_pool_bytes
        assert growth < 16 * MiB, f"a step over {state_bytes / MiB:.0f} MiB of state grew the peak RSS by " \
                                  f"{growth / MiB:.1f} MiB"
    finally:
        ours.close()


@pytest.mark.parametrize("pipeline_read, pipeline_write, count", [(False, False, 2), (True, False, 3), (True, True, 5)])
def test_pipeline_settings_do_not_change_results(nvme, closing, pipeline_read, pipeline_write, count):
    """Serial, half-pipelined and deeply pipelined swapping give the same bits."""
    a, b = make_params(), make_params()
    ours = closing(OffloadedAdamW(a, nvme_path=nvme, fused=True, pipeline_read=pipeline_read,
                                  pipeline_write=pipeline_write, **{**SMALL, "buffer_count": count}))
    ref = torch.optim.AdamW(b, fused=True)
    pipeline = ours.state_store.moves.pipeline
    assert pipeline.write_behind == pipeline_write
    assert pipeline.lookahead == (max(1, count - 1) if pipeline_read else 0)
    step_together(ours, ref, a, b, range(3))
    assert_same(a, b)


def test_config_from_deepspeed_file_and_keyword_overrides(nvme, closing, tmp_path):
    """A DeepSpeed config drives the optimizer (a .hjson one with comments, as DeepSpeed reads them); keyword
    arguments override it; the keys the optimizer does not use are named in a ConfigWarning."""
    cfg = tmp_path / "ds_config.hjson"
    cfg.write_text("""{
      // DeepSpeed reads comments
      "train_batch_size": 8,
      "aio": {"block_size": 262144, "queue_depth": 8, "thread_count": 1},
      "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "NVME",
                            "buffer_count": 5, "pin_memory": false}}
    }""".replace("NVME", nvme))
    with pytest.warns(ConfigWarning, match=r"train_batch_size; zero_optimization.stage"):
        ours = closing(OffloadedAdamW(make_params(), config=str(cfg), buffer_count=3, buffer_size=256 * 1024))
    assert ours.config.aio.block_size == 262144
    assert ours.config.offload_optimizer.buffer_count == 3
    assert ours.host_pool_bytes == 3 * 256 * 1024


BAD_ARGUMENTS = [
    (dict(lr=-1.0), ValueError, "Invalid learning rate"),
    (dict(betas=(1.0, 0.9)), ValueError, "Invalid beta parameter at index 0"),
    (dict(eps=-1e-8), ValueError, "Invalid epsilon"),
    (dict(weight_decay=-0.1), ValueError, "Invalid weight_decay"),
    (dict(nvme_path=None), ConfigError, "nvme_path is required"),
    (dict(buffer_count=1), ConfigError, "buffer_count"),
    (dict(buffer_size=1000), ConfigError, "buffer_size"),
    (dict(config={"offload_optimizer": {"device": "none"}}), ConfigError, "keeps state on \"nvme\" or \"cpu\""),
    (dict(config={"aio": {"queue_depht": 8}}), ConfigError, "did you mean"),
    (dict(capturable=True), ValueError, "capturable"),
]


@pytest.mark.parametrize("kwargs, exc, pattern", BAD_ARGUMENTS, ids=[p for _, _, p in BAD_ARGUMENTS])
def test_bad_arguments_are_refused_with_a_clear_message(nvme, kwargs, exc, pattern):
    """Each bad argument raises the documented exception naming the problem."""
    kwargs = {"nvme_path": nvme, **kwargs}
    with pytest.raises(exc, match=pattern):
        OffloadedAdam(make_params(), **kwargs)


def test_sparse_and_complex_are_refused(nvme, closing):
    """Sparse grads fail at step and complex params at construction, with a message saying so."""
    with pytest.raises(ValueError, match="complex"):
        OffloadedAdam([torch.nn.Parameter(torch.randn(4, dtype=torch.complex64))], nvme_path=nvme)
    p = torch.nn.Parameter(torch.randn(100, 10))
    opt = closing(OffloadedAdam([p], nvme_path=nvme, **SMALL))
    p.grad = torch.randn(100, 10).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()


@pytest.mark.parametrize("skip", [1, 4], ids=["mid-step", "tail-write"])
def test_io_failure_mid_step_names_the_file_and_blocks_further_steps(nvme, closing, skip):
    """An EIO during a step, or in one of the writes a step leaves landing, surfaces (at the latest at
    the next call) with the swap file's path; step() then refuses until state is restored."""
    a = make_params()
    opt = closing(OffloadedAdamW(a, nvme_path=nvme, fused=True, **SMALL))
    set_grads(a, seed=0)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())  # a snapshot, not the live in-memory state the step changes
    params_saved = [p.detach().clone() for p in a]
    opt.swap_space.inject_fault("error", op="write", skip=skip, count=1, errno=errno.EIO)
    set_grads(a, seed=1)
    err = first_os_error(opt.step, opt.step)
    assert err.errno == errno.EIO
    assert err.filename in opt.swap_space.files
    with pytest.raises(StateError, match="load_state_dict"):
        opt.step()
    with pytest.raises(StateError, match="half written"):
        opt.state_dict()
    # Restoring state (and the weights, which the failed step partly updated) makes it usable again,
    # and it then follows the same trajectory as an optimizer that never failed.
    for p, q in zip(a, params_saved):
        p.data.copy_(q)
    opt.load_state_dict(saved)
    b = [torch.nn.Parameter(q.clone()) for q in params_saved]
    ref = closing(OffloadedAdamW(b, nvme_path=nvme, fused=True, **SMALL))
    ref.load_state_dict(saved)
    set_grads(a, b, seed=1)
    opt.step()
    ref.step()
    assert_same(a, b)


def test_a_failed_read_is_reported_too(nvme, closing):
    """An EIO while reading state is an OSError, and the optimizer is marked failed."""
    a = make_params()
    opt = closing(OffloadedAdamW(a, nvme_path=nvme, **SMALL))
    set_grads(a, seed=0)
    opt.step()
    opt.swap_space.inject_fault("error", op="read", count=1)
    set_grads(a, seed=1)
    with pytest.raises(OSError, match="read"):
        opt.step()
    with pytest.raises(StateError):
        opt.step()


def test_add_param_group_after_construction_gets_swap_space(nvme, closing):
    """add_param_group lays out the new parameters on disk and they train like torch's."""
    a, b = make_params(), make_params()
    extra_a, extra_b = make_params((50_000,), seed=9), make_params((50_000,), seed=9)
    ours = closing(OffloadedAdamW(a, nvme_path=nvme, fused=True, **SMALL))
    ref = torch.optim.AdamW(b, fused=True)
    before = ours.offloaded_state_bytes
    ours.add_param_group({"params": extra_a, "lr": 0.05})
    ref.add_param_group({"params": extra_b, "lr": 0.05})
    assert ours.offloaded_state_bytes > before
    for step in range(3):
        set_grads(a + extra_a, b + extra_b, seed=step)
        ours.step()
        ref.step()
    assert_same(a + extra_a, b + extra_b)


def test_closed_optimizer_refuses_to_step_and_leaves_no_files(nvme):
    """close() deletes the swap files; later use is a clear error."""
    a = make_params()
    opt = OffloadedAdamW(a, nvme_path=nvme, **SMALL)
    files = list(opt.swap_space.files)
    opt.close()
    assert not any(os.path.exists(f) for f in files)
    set_grads(a, seed=0)
    with pytest.raises(ValueError, match="closed"):
        opt.step()


class TinyTransformer(torch.nn.Module):
    def __init__(self, vocab=128, dim=64, heads=4, layers=2):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        layer = torch.nn.TransformerEncoderLayer(dim, heads, dim_feedforward=4 * dim, dropout=0.0, batch_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, tokens):
        return self.head(self.blocks(self.embed(tokens)))


def test_small_transformer_trains_to_the_same_losses_as_torch_adamw(nvme, closing):
    """End to end: a small transformer's loss curve and final weights equal torch AdamW's exactly."""
    torch.manual_seed(0)
    model_a = TinyTransformer()
    model_b = copy.deepcopy(model_a)
    ours = closing(OffloadedAdamW(model_a.parameters(), lr=3e-3, nvme_path=nvme, fused=True, **SMALL))
    ref = torch.optim.AdamW(model_b.parameters(), lr=3e-3, fused=True)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 128, (4, 16), generator=g)
    target = torch.roll(tokens, 1, dims=1)
    losses_a, losses_b = [], []
    for _ in range(8):
        for model, opt, losses in ((model_a, ours, losses_a), (model_b, ref, losses_b)):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), target.flatten())
            loss.backward()
            opt.step()
            losses.append(loss.item())
    assert losses_a == losses_b
    assert losses_a[-1] < losses_a[0]
    assert_same(list(model_a.parameters()), list(model_b.parameters()))


def test_a_load_that_fails_while_writing_state_blocks_steps_until_a_good_load(nvme, closing):
    """load_state_dict failing part-way leaves half-written state: step() refuses instead of training on it."""
    a, b = make_params(), make_params()
    ours = closing(OffloadedAdamW(a, nvme_path=nvme, fused=True, **SMALL))
    ref = torch.optim.AdamW(b, fused=True)
    step_together(ours, ref, a, b, range(3))
    saved = copy.deepcopy(ours.state_dict())
    ours.swap_space.inject_fault("error", op="write", count=1)
    with pytest.raises(OSError):
        ours.load_state_dict(saved)
    set_grads(a, seed=3)
    with pytest.raises(StateError):
        ours.step()
    ours.load_state_dict(saved)
    step_together(ours, ref, a, b, range(3, 5))
    assert_same(a, b)


# -- refusals that keep the optimizer whole --------------------------------------------------------


def test_a_parameter_listed_twice_is_refused(nvme, closing):
    """[p, p] would update the state once and count the step twice: refused when built, and an added
    group repeating a parameter is refused with the optimizer unchanged and still stepping like torch."""
    a, b = make_params(), make_params()
    with pytest.raises(ValueError, match="listed twice"):
        OffloadedAdamW([a[3], a[3]], nvme_path=nvme, **SMALL)
    ours = closing(OffloadedAdamW(a[:4], lr=1e-2, nvme_path=nvme, **SMALL))
    ref = torch.optim.AdamW(b[:4], lr=1e-2, fused=True)
    with pytest.raises(ValueError):
        ours.add_param_group({"params": [a[4], a[4]]})
    with pytest.raises(ValueError):
        ours.add_param_group({"params": [a[2]]})
    assert len(ours.param_groups) == 1
    step_together(ours, ref, a[:4], b[:4], range(2))
    assert_same(a[:4], b[:4])


def test_meta_parameters_are_refused_before_any_disk_is_reserved(nvme):
    """A parameter on the meta device has no data: refused at construction, with no swap file made."""
    p = torch.nn.Parameter(torch.empty(10_000, device="meta"))
    with pytest.raises(ValueError, match="meta device"):
        OffloadedAdamW([p], nvme_path=nvme, **SMALL)
    assert not os.path.exists(nvme) or not os.listdir(nvme)


def test_a_full_disk_in_add_param_group_leaves_the_optimizer_usable(tmpfs):
    """ENOSPC while adding a group: an OSError giving the bytes the new state needs, the group is not
    added, and the optimizer keeps stepping its old parameters like torch."""
    disk = tmpfs("2m")
    a, b = make_params(sizes=(10, 5000, 70_000)), make_params(sizes=(10, 5000, 70_000))
    ours = OffloadedAdamW(a, lr=1e-2, nvme_path=str(disk), **SMALL)
    ref = torch.optim.AdamW(b, lr=1e-2, fused=True)
    step_together(ours, ref, a, b, range(2))
    big = torch.nn.Parameter(torch.zeros(1_000_000))  # 8 MB of state on a 2 MiB disk
    with pytest.raises(OSError) as info:
        ours.add_param_group({"params": [big]})
    assert info.value.errno == errno.ENOSPC
    assert "8" in str(info.value) and "free" in str(info.value)
    assert len(ours.param_groups) == 1 and ours.state_store.slot(big) is None
    step_together(ours, ref, a, b, range(2, 4))
    assert_same(a, b)
    ours.close()


def test_a_full_disk_for_a_late_parameter_leaves_the_optimizer_usable(tmpfs):
    """ENOSPC when a parameter frozen at construction first gets a grad: the step raises OSError, and the
    next step without that parameter's grad works and equals torch's."""
    disk = tmpfs("2m")
    sizes = (10, 5000, 70_000, 1_000_000)
    a, b = make_params(sizes=sizes), make_params(sizes=sizes)
    a[3].requires_grad_(False)
    ours = OffloadedAdamW(a, lr=1e-2, nvme_path=str(disk), **SMALL)
    ref = torch.optim.AdamW(b[:3], lr=1e-2, fused=True)
    a[3].requires_grad_(True)
    a[3].grad = torch.ones_like(a[3])
    with pytest.raises(OSError) as info:
        ours.step()
    assert info.value.errno == errno.ENOSPC
    a[3].grad = None
    step_together(ours, ref, a[:3], b[:3], range(2))
    assert_same(a[:3], b[:3])
    ours.close()


def test_the_default_pool_is_sized_down_to_a_small_state(nvme, closing):
    """With the default buffer_size and less state than the default pool (4 x 64 MiB), the pool holds
    about the state (whole MiB per buffer), and training still equals torch's; an explicit buffer_size is
    kept as given."""
    a, b = make_params(), make_params()
    ours = closing(OffloadedAdamW(a, lr=1e-2, nvme_path=nvme, small_param_threshold=64))
    ref = torch.optim.AdamW(b, lr=1e-2, fused=True)
    assert ours.host_pool_bytes <= max(4 * MiB, 2 * ours.offloaded_state_bytes)
    step_together(ours, ref, a, b, range(3))
    assert_same(a, b)
    given = closing(OffloadedAdamW(make_params(), nvme_path=nvme + "-2", buffer_size="8MiB", buffer_count=3))
    assert given.host_pool_bytes == 3 * 8 * MiB


def _wear_said(ours, params, caplog, *, seconds_per_step: float, steps: int, once) -> list:
    """The wear messages of ``steps`` steps of ``ours`` one ``seconds_per_step`` apart (on a fake clock)."""
    import logging

    ticks = iter(float(t) * seconds_per_step for t in range(1000))
    ours._wear.clock, ours._wear.once = ticks.__next__, once
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="offload"):
        for step in range(steps):
            set_grads(params, seed=step)
            ours.step()
    return [r for r in caplog.records if "TB of optimizer state per day" in r.getMessage()]


def test_the_drive_writes_per_day_are_said_once_after_a_minute_warned_past_a_drive_write_a_day(nvme, closing,
                                                                                                caplog):
    """After a minute of steps, logger "offload" says once how many TB per day the optimizer writes at the rate
    seen over that minute: a WARNING naming the endurance rating from one drive write per day of the swap files'
    drives, else INFO; later steps, and other optimizers of the process, say nothing."""
    import logging

    from offload.adam.wear import _Once, drive_bytes

    a = make_params()
    ours = closing(OffloadedAdamW(a, lr=1e-2, nvme_path=nvme, **SMALL))
    assert ours._wear.threshold == drive_bytes([nvme]) > 0  # one drive write per day of the swap file's drive
    for threshold, level in ((10**18, logging.INFO), (1, logging.WARNING)):
        ours._wear.threshold, ours._wear._start, ours._wear._steps = threshold, None, 0
        before = ours.state_store.bytes_written
        said = _wear_said(ours, a, caplog, seconds_per_step=10, steps=12, once=_Once())
        assert len(said) == 1 and said[0].levelno == level
        per_step = (ours.state_store.bytes_written - before) // 12  # every step writes every unit
        assert f"{per_step * 86400 / 10 / 1e12:.1f} TB of optimizer state per day" in said[0].getMessage()
        assert "its last 60 s" in said[0].getMessage()
        assert ("endurance" in said[0].getMessage()) is (level == logging.WARNING)
    once = _Once()
    first, second = (closing(OffloadedAdamW(make_params(), lr=1e-2, nvme_path=nvme + f"-{i}", **SMALL)) for i in (1, 2))
    assert len(_wear_said(first, first.param_groups[0]["params"], caplog, seconds_per_step=10, steps=12,
                          once=once)) == 1
    assert _wear_said(second, second.param_groups[0]["params"], caplog, seconds_per_step=10, steps=12,
                      once=once) == []  # once per process


def test_a_short_run_says_nothing_of_wear_however_fast_it_writes(nvme, closing, caplog):
    """A toy run (100 steps of 10 ms, writing at a rate of many TB per day) ends before the minute the rate is
    measured over: nothing is said, not even at INFO."""
    from offload.adam.wear import _Once

    a = make_params()
    ours = closing(OffloadedAdamW(a, lr=1e-2, nvme_path=nvme, **SMALL))
    ours._wear.threshold = 1
    assert _wear_said(ours, a, caplog, seconds_per_step=0.01, steps=100, once=_Once()) == []


def test_max_grad_norm_over_small_and_offloaded_params_in_any_order_is_torch_s_norm(nvme, closing):
    """Small parameters (state in memory) listed after offloaded ones: the norms are stacked in parameter order,
    as torch's clip_grad_norm_ does, so last_grad_norm and the weights equal torch's bit for bit."""
    sizes = (5000, 10, 70_000, 100, 300_001, 7)
    a, b = make_params(sizes), make_params(sizes)
    ours = closing(OffloadedAdamW(a, lr=1e-2, nvme_path=nvme, fused=False, max_grad_norm=1.0, **SMALL))
    ref = torch.optim.AdamW(b, lr=1e-2, fused=False)
    for step in range(3):
        set_grads(a, b, seed=step)
        norm = torch.nn.utils.clip_grad_norm_(b, 1.0)
        ours.step()
        ref.step()
        assert torch.equal(ours.last_grad_norm, norm)
        assert_same(a, b)
