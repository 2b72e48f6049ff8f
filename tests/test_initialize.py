"""offload.initialize: a DeepSpeed config sets up training as DeepSpeed would, checked against DeepSpeed's semantics
written out by hand with torch (its schedules' formulas, its clipping, its loss scaling, its accumulation); the
keys nothing reads are named in one warning; what cannot be honoured is refused, saying what to do."""

from __future__ import annotations

import copy
import json
import math
import os
import warnings

import pytest
import torch
from helpers import REPO

import offload
from offload import ConfigError, ConfigWarning, OffloadedAdam, OffloadedAdamW
from offload.params import materialized, offloaded
from offload.schedulers import WarmupCosineLR, WarmupDecayLR, WarmupLR

D = 32


def tiny_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(D, 4 * D), torch.nn.GELU(), torch.nn.Linear(4 * D, D),
                               torch.nn.LayerNorm(D))


def batch(i: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(4, D, generator=torch.Generator().manual_seed(100 + i)).to(dtype)


def loss_fn(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


# -- DeepSpeed's schedules, written out from deepspeed/runtime/lr_schedules.py, as the lr each optimizer step uses.
# Step s (from 0) runs at the rate the schedule set after step s - 1, i.e. at last_batch_iteration k = s - 1
# (k = -1: the rate set at construction).

def _gamma_warmup(k: int, n: int, kind: str) -> float:
    n = max(2, n)
    return (1.0 / math.log(n)) * math.log(k + 1) if kind == "log" else k / n


def ds_warmup_lr(k, *, warmup_min_lr=0.0, warmup_max_lr=0.001, warmup_num_steps=1000, warmup_type="log"):
    if k < 0:
        return warmup_min_lr
    n = max(2, warmup_num_steps)
    gamma = _gamma_warmup(k, n, warmup_type) if k < n else 1.0
    return warmup_min_lr + (warmup_max_lr - warmup_min_lr) * gamma


def ds_warmup_decay_lr(k, *, total_num_steps, warmup_min_lr=0.0, warmup_max_lr=0.001, warmup_num_steps=1000,
                       warmup_type="log"):
    if k < 0:
        return warmup_min_lr
    n = max(2, warmup_num_steps)
    gamma = _gamma_warmup(k, n, warmup_type) if k < n else \
        max(0.0, float(total_num_steps - k) / float(max(1.0, total_num_steps - n)))
    return warmup_min_lr + (warmup_max_lr - warmup_min_lr) * gamma


def ds_warmup_cosine_lr(k, *, lr, total_num_steps, warmup_min_ratio=0.0, warmup_num_steps=1000, cos_min_ratio=0.0001,
                        warmup_type="log"):
    if k < 0:
        return 0.0
    n = max(2, warmup_num_steps)
    if k < n:
        ratio = warmup_min_ratio + _gamma_warmup(k, n, warmup_type) * (1. - warmup_min_ratio)
    else:
        ratio = (1 + math.cos(math.pi * (k - n + 1) / (total_num_steps - n))) / 2
        ratio = max(0.0, cos_min_ratio + (1. - cos_min_ratio) * ratio)
    return lr * ratio


SCHEDULES = {
    "WarmupLR": ({"warmup_min_lr": 1e-4, "warmup_max_lr": 2e-3, "warmup_num_steps": 3, "warmup_type": "log"},
                 lambda k, p, lr: ds_warmup_lr(k, **p)),
    "WarmupDecayLR": ({"warmup_min_lr": 0.0, "warmup_max_lr": 2e-3, "warmup_num_steps": 2, "total_num_steps": 5,
                       "warmup_type": "linear"}, lambda k, p, lr: ds_warmup_decay_lr(k, **p)),
    "WarmupCosineLR": ({"total_num_steps": 6, "warmup_num_steps": 2, "warmup_min_ratio": 0.1, "cos_min_ratio": 0.05},
                       lambda k, p, lr: ds_warmup_cosine_lr(k, lr=lr, **p)),
}


def ds_config(tmp_path, schedule: str, *, accumulation: int = 2, clip: float = 0.05) -> dict:
    params, _ = SCHEDULES[schedule]
    return {
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": accumulation,
        "gradient_clipping": clip,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
        "scheduler": {"type": schedule, "params": params},
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "nvme"), "buffer_count": 3,
                                  "buffer_size": "64KiB"},
            "offload_param": {"device": "nvme", "nvme_path": str(tmp_path / "nvme"), "buffer_count": 3,
                              "buffer_size": 4096, "max_in_cpu": 0, "max_grad_in_cpu": 0},
        },
        "aio": {"block_size": 65536, "queue_depth": 4, "thread_count": 1},
        "steps_per_print": 10,
    }


def by_hand(model: torch.nn.Module, cfg: dict, micro_steps: int) -> tuple[list, list]:
    """DeepSpeed's training as torch does it: bf16 weights with fp32 masters, each loss scaled by 1/accumulation in
    fp32 before backward, at each boundary torch's clip_grad_norm_ on the grads, AdamW (decoupled) on the masters at
    the schedule's rate, weights rounded from the masters, grads zeroed. Returns the losses and the weights."""
    gas, clip = cfg["gradient_accumulation_steps"], cfg["gradient_clipping"]
    p = cfg["optimizer"]["params"]
    params, rate = SCHEDULES[cfg["scheduler"]["type"]]
    model = model.to(torch.bfloat16)
    masters = [torch.nn.Parameter(w.detach().float()) for w in model.parameters()]
    opt = torch.optim.AdamW(masters, lr=p["lr"], betas=tuple(p["betas"]), eps=p["eps"], weight_decay=p["weight_decay"],
                            fused=True)
    losses, step = [], 0
    for i in range(micro_steps):
        loss = loss_fn(model(batch(i, torch.bfloat16)))
        losses.append(loss.item())
        (loss.float() / gas if gas > 1 else loss).backward()
        if (i + 1) % gas == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            for w, m in zip(model.parameters(), masters):
                m.grad = w.grad.float()
            opt.param_groups[0]["lr"] = rate(step - 1, params, p["lr"])
            opt.step()
            with torch.no_grad():
                for w, m in zip(model.parameters(), masters):
                    w.copy_(m)
            model.zero_grad(set_to_none=True)
            opt.zero_grad(set_to_none=True)
            step += 1
    return losses, [w.detach().clone() for w in model.parameters()]


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_a_deepspeed_config_trains_like_deepspeed_s_semantics_by_hand(tmp_path, schedule):
    """optimizer (AdamW, betas, eps, weight_decay), scheduler, gradient_clipping, bf16, gradient accumulation,
    offload_optimizer, offload_param and aio in one ds_config.json: through offload.initialize and the engine's
    backward/step, every loss and the final weights equal DeepSpeed's semantics done by hand with torch, bit for
    bit, over steps that clip and cross the schedule's warmup; the rates equal DeepSpeed's formulas at every step."""
    cfg = ds_config(tmp_path, schedule)
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(cfg))
    model = tiny_model()
    reference = copy.deepcopy(model)
    with pytest.warns(ConfigWarning, match=r"steps_per_print.*zero_optimization.stage"):
        engine, opt, loader, sched = offload.initialize(model, config=str(path))
    try:
        assert isinstance(opt, OffloadedAdamW) and loader is None and opt.max_grad_norm == 0.05
        assert offloaded(model) is not None and offloaded(model).store.swap_bytes > 0  # weights on NVMe
        assert opt.offloaded_state_bytes > 0 and opt.config.aio.queue_depth == 4
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
        params, rate = SCHEDULES[schedule]
        micro = 2 * 6
        losses, rates, clipped = [], [], []
        for i in range(micro):
            if engine.is_gradient_accumulation_boundary():
                rates.append(engine.get_lr()[0])
            loss = loss_fn(engine(batch(i, torch.bfloat16)))
            losses.append(loss.item())
            engine.backward(loss)
            engine.step()
            if (i + 1) % 2 == 0:
                clipped.append(engine.get_global_grad_norm() > 0.05)
        assert engine.global_steps == 6 and engine.micro_steps == micro
        assert rates == [rate(s - 1, params, 2e-3) for s in range(6)]
        assert all(clipped), "the clipping must bite for the test to mean something"
        want_losses, want = by_hand(reference, cfg, micro)
        assert losses == want_losses
        with materialized(model):
            for got, expected in zip(model.parameters(), want):
                assert torch.equal(got.detach(), expected)
    finally:
        engine.close()
    assert offloaded(model) is None


def test_the_schedules_are_deepspeed_s_numbers(tmp_path):
    """Rates set at construction and after each step, against DeepSpeed's formulas written out, for log and linear
    warmups, past the decay's end, and the cosine's first group at 0 before its first step (a second group keeps
    its rate then, as DeepSpeed's zip leaves it)."""
    for cls, kw, fn in ((WarmupLR, dict(warmup_min_lr=0.01, warmup_max_lr=0.1, warmup_num_steps=5), ds_warmup_lr),
                        (WarmupLR, dict(warmup_num_steps=4, warmup_type="linear"), ds_warmup_lr),
                        (WarmupDecayLR, dict(total_num_steps=7, warmup_num_steps=3, warmup_max_lr=0.5),
                         ds_warmup_decay_lr)):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        sched = cls(opt, **kw)
        for k in range(-1, 10):
            assert opt.param_groups[0]["lr"] == fn(k, **kw), (cls.__name__, kw, k)
            assert sched.get_last_lr() == [opt.param_groups[0]["lr"]]
            opt.step()
            sched.step()
    opt = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))]},
                           {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.3}], lr=0.2)
    sched = WarmupCosineLR(opt, total_num_steps=9, warmup_num_steps=3, warmup_type="linear")
    assert [g["lr"] for g in opt.param_groups] == [0.0, 0.3]
    for k in range(0, 12):
        opt.step()
        sched.step()
        assert [g["lr"] for g in opt.param_groups] == [
            ds_warmup_cosine_lr(k, lr=lr, total_num_steps=9, warmup_num_steps=3, warmup_type="linear")
            for lr in (0.2, 0.3)], k
    # state_dict round trip: a new schedule resumes at the same rates.
    state = sched.state_dict()
    opt2 = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))]},
                            {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.3}], lr=0.2)
    again = WarmupCosineLR(opt2, total_num_steps=9, warmup_num_steps=3, warmup_type="linear")
    again.load_state_dict(state)
    assert again.last_batch_iteration == sched.last_batch_iteration == 11
    with pytest.raises(ValueError, match="total_num_steps \\(3\\) must be more than warmup_num_steps"):
        WarmupCosineLR(opt, total_num_steps=3, warmup_num_steps=3)


def test_adam_is_adamw_unless_adam_w_mode_is_false_as_in_deepspeed(tmp_path):
    """DeepSpeed's "Adam" is decoupled (AdamW) unless adam_w_mode is false; then it is Adam with L2 decay."""
    for params, cls in (({}, OffloadedAdamW), ({"adam_w_mode": False}, OffloadedAdam),
                        ({"adam_w_mode": True}, OffloadedAdamW)):
        with pytest.warns(ConfigWarning, match="No offload_optimizer block: the optimizer state is kept in host"):
            engine, opt, _, _ = offload.initialize(tiny_model(), config={"optimizer": {"type": "Adam",
                                                                                          "params": params}})
        try:
            assert type(opt) is cls and opt.defaults["decoupled_weight_decay"] is (cls is OffloadedAdamW)
            assert opt.config.offload_optimizer.device == "cpu"  # no offload_optimizer block: host memory
        finally:
            engine.close()


@pytest.mark.parametrize("name", ["ds_config_70b.json", "deepspeed_example.json"])
def test_the_seed_s_deepspeed_configs_set_up_training(tmp_path, name, recwarn):
    """The shipped DeepSpeed configs load through initialize with only the NVMe path given: their optimizer, schedule,
    clipping and bf16 are in place, one ConfigWarning names what is not used, and training runs."""
    model = tiny_model()
    engine, opt, _, sched = offload.initialize(model, config=os.path.join(REPO, "configs", name),
                                               nvme_path=str(tmp_path / "nvme"))
    try:
        doc = json.loads(open(os.path.join(REPO, "configs", name)).read())
        assert opt.defaults["lr"] == doc["optimizer"]["params"]["lr"] and opt.max_grad_norm == doc["gradient_clipping"]
        assert type(sched).__name__ == doc["scheduler"]["type"] and next(model.parameters()).dtype == torch.bfloat16
        said = [w for w in recwarn if issubclass(w.category, ConfigWarning)]
        assert len(said) == 1 and "zero_optimization.stage" in str(said[0].message)
        for i in range(engine.gradient_accumulation_steps):
            engine.backward(loss_fn(engine(batch(i, torch.bfloat16))))
            engine.step()
        assert engine.global_steps == 1
    finally:
        engine.close()


def test_gradient_accumulation_steps_the_optimizer_once_per_boundary(tmp_path):
    """With gradient_accumulation_steps 3, step() counts micro-steps and steps the optimizer (and the schedule) at
    every third; the grads in between accumulate."""
    cfg = {"gradient_accumulation_steps": 3, "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
           "zero_optimization": {"offload_optimizer": {"device": "cpu"}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}
    engine, opt, _, sched = offload.initialize(tiny_model(), config=cfg)
    try:
        for i in range(7):
            engine.backward(loss_fn(engine(batch(i))))
            engine.step()
        assert (engine.micro_steps, engine.global_steps, sched.last_batch_iteration) == (7, 2, 1)
        assert opt.state_store is not None and all(p.grad is not None for p in engine.module.parameters())
    finally:
        engine.close()


def test_fp16_skips_overflowing_steps_and_scales_as_deepspeed_s_dynamic_loss_scaler():
    """fp16 with a huge initial scale: the first backward overflows, the step is skipped (weights and schedule
    untouched) and the scale halves after hysteresis; then steps happen with the grads unscaled. The scaler's
    sequence over overflows and clean steps is DeepSpeed's (hysteresis 2, window 3)."""
    from offload.initialize import LossScale

    scale = LossScale(initial_scale_power=4, loss_scale_window=3, hysteresis=2, min_loss_scale=1)
    seen = []
    for overflow in (True, True, False, False, False, True, False, False, False):
        scale.update(overflow)
        seen.append(scale.cur_scale)
    # 16: overflow spends hysteresis (16), overflow halves (8); clean steps 1, 2 since the overflow at iter 1 keep 8,
    # the third (iter 4: 4 - 1 = 3) doubles (16); overflow at 5 spends hysteresis (refilled at the doubling): 16;
    # clean 6, 7 keep it, 8 (8 - 5 = 3) doubles: 32.
    assert seen == [16, 8, 8, 8, 16, 16, 16, 16, 32]
    cfg = {"fp16": {"enabled": True, "initial_scale_power": 120, "hysteresis": 1},
           "zero_optimization": {"offload_optimizer": {"device": "cpu"}},
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_min_lr": 0.001}}}
    model = tiny_model()
    engine, opt, _, sched = offload.initialize(model, config=cfg)
    try:
        before = [p.detach().clone() for p in model.parameters()]
        engine.backward(loss_fn(engine(batch(0, torch.float16))))
        engine.step()
        assert engine.skipped_steps == 1 and sched.last_batch_iteration == -1
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert engine.loss_scale.cur_scale == 2.0 ** 119
        while engine.skipped_steps == engine.global_steps:  # until the scale is low enough for fp16 grads
            engine.backward(loss_fn(engine(batch(engine.global_steps, torch.float16))))
            engine.step()
        assert sched.last_batch_iteration == 0 and engine.loss_scale.cur_scale == 2.0 ** (120 - engine.skipped_steps)
        assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert all(torch.isfinite(p).all() for p in model.parameters())
    finally:
        engine.close()


def test_offloaded_adamw_given_a_deepspeed_config_names_each_key_it_does_not_use(tmp_path):
    """OffloadedAdamW(config=ds.json) warns once, naming every key it ignores (each with what to do: lr= for the
    optimizer block, max_grad_norm= for clipping, offload_parameters for offload_param) and pointing at
    offload.initialize; a config of its own blocks only says nothing; offload_parameters names its own."""
    cfg = ds_config(tmp_path, "WarmupLR")
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    params = list(tiny_model().parameters())
    with pytest.warns(ConfigWarning) as caught:
        opt = OffloadedAdamW(params, config=str(path))
    opt.close()
    assert len([w for w in caught if issubclass(w.category, ConfigWarning)]) == 1
    message = str(caught[0].message)
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "steps_per_print",
                "zero_optimization.stage", "optimizer (pass lr=, betas=, eps=, weight_decay=",
                "scheduler (build a scheduler", "gradient_clipping (pass max_grad_norm=)",
                "bf16 (cast the model", "zero_optimization.offload_param (offload_parameters(model, config=...)"):
        assert key in message, key
    assert "offload_optimizer" not in message.replace("zero_optimization.offload_param", "")
    assert "offload.initialize(model, config=...)" in message and str(path) in message
    assert caught[0].filename == __file__  # it points at the user's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        OffloadedAdamW(params, config={"offload_optimizer": cfg["zero_optimization"]["offload_optimizer"],
                                       "aio": cfg["aio"]}).close()
    with pytest.warns(ConfigWarning, match=r"offload_parameters does not use .*zero_optimization.offload_optimizer "
                                           r"\(OffloadedAdamW\(params, config=...\) reads it\)"):
        model = offload.offload_parameters(tiny_model(), config=str(path))
    offload.restore_parameters(model)


@pytest.mark.parametrize("cfg, message", [
    ({"optimizer": {"type": "Lamb"}}, r'optimizer.type: must be "Adam" or "AdamW"'),
    ({"optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1.0}}}, r"gradient_clipping"),
    ({"optimizer": {"type": "AdamW", "params": {"bias_correction": False}}}, r"always corrects"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, r'"auto" is filled in by the Hugging Face'),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "momentum": 0.9}}}, r"unknown parameter of Adam"),
    ({"optimizer": {"type": "AdamW"}, "scheduler": {"type": "OneCycle", "params": {}}},
     r"'OneCycle' is not mapped to a torch scheduler here; supported: WarmupLR, WarmupDecayLR, WarmupCosineLR"),
    ({"optimizer": {"type": "AdamW"}, "scheduler": {"type": "WarmupDecayLR", "params": {}}},
     r"scheduler.params.total_num_steps: is required by WarmupDecayLR"),
    ({"optimizer": {"type": "AdamW"}, "scheduler": {"type": "WarmupLR", "params": {"warmup_typ": "log"}}},
     r'did you mean "warmup_type"'),
    ({"optimizer": {"type": "AdamW"}, "bf16": {"enabled": True}, "fp16": {"enabled": True}}, r"both enabled"),
    ({"optimizer": {"type": "AdamW"}, "gradient_clipping": -1}, r"gradient_clipping: must be a number, at least 0"),
    ({"optimizer": {"type": "AdamW"}, "train_batch_size": 10, "train_micro_batch_size_per_gpu": 4},
     r"10 is not a multiple of train_micro_batch_size_per_gpu"),
    ({"zero_optimization": {"stage": 3}}, r'no optimizer: .*add \{"optimizer"'),
])
def test_what_cannot_be_honoured_is_refused_saying_what_to_do(cfg, message):
    """An optimizer or schedule that is not mapped, a DeepSpeed mistake DeepSpeed refuses too, or a missing optimizer:
    a ConfigError naming the JSON path and what to do, before anything is built."""
    model = tiny_model()
    with pytest.raises(ConfigError, match=message):
        offload.initialize(model, config=cfg)
    assert next(model.parameters()).dtype == torch.float32 and offloaded(model) is None


def test_engine_checkpoints_resume_weights_state_schedule_and_client_state(tmp_path):
    """engine.save_checkpoint writes a tag and DeepSpeed's "latest" file; load_checkpoint of the directory resumes a
    fresh engine where the first was: the same next losses and rates, and client_state back."""
    cfg = ds_config(tmp_path, "WarmupCosineLR", accumulation=1)
    cfg2 = json.loads(json.dumps(cfg).replace(str(tmp_path / "nvme"), str(tmp_path / "nvme2")))
    with pytest.warns(ConfigWarning):
        first, opt, _, _ = offload.initialize(tiny_model(), config=cfg)
        second, _, _, _ = offload.initialize(tiny_model(seed=5), config=cfg2)
    try:
        for i in range(3):
            first.backward(loss_fn(first(batch(i, torch.bfloat16))))
            first.step()
        path = first.save_checkpoint(tmp_path / "ckpt", client_state={"epoch": 7})
        assert path.endswith("global_step3") and (tmp_path / "ckpt" / "latest").read_text() == "global_step3"
        loaded, client = second.load_checkpoint(tmp_path / "ckpt")
        assert loaded == path and client == {"epoch": 7} and second.global_steps == 3
        for i in range(3, 5):
            a = loss_fn(first(batch(i, torch.bfloat16)))
            b = loss_fn(second(batch(i, torch.bfloat16)))
            assert torch.equal(a, b) and first.get_lr() == second.get_lr()
            first.backward(a)
            first.step()
            second.backward(b)
            second.step()
        assert second.load_checkpoint(tmp_path / "elsewhere") == (None, {})
    finally:
        first.close()
        second.close()


def test_a_failure_after_the_cast_leaves_the_model_as_it_came(tmp_path):
    """A setup that fails once the model is cast (here: a file where the swap directory should be) closes what it
    built and gives the model back in its own dtype, its weights in memory."""
    (tmp_path / "not-a-dir").write_text("x")
    cfg = ds_config(tmp_path, "WarmupLR")
    cfg["zero_optimization"]["offload_optimizer"]["nvme_path"] = str(tmp_path / "not-a-dir")
    cfg.pop("steps_per_print")
    cfg["zero_optimization"].pop("stage")
    model = tiny_model()
    with pytest.raises(NotADirectoryError):
        offload.initialize(model, config=cfg)
    assert {p.dtype for p in model.parameters()} == {torch.float32} and offloaded(model) is None


def test_engine_latest_file_never_writes_through_a_planted_link(tmp_path):
    """A link planted at ``save_dir/latest`` (or at the old fixed temporary name beside it) is never followed: the
    user's file it points at keeps its bytes, and the save says what is in the way."""
    cfg = ds_config(tmp_path, "WarmupCosineLR", accumulation=1)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "latest.tmp").symlink_to(victim)
    with pytest.warns(ConfigWarning):
        engine, _, _, _ = offload.initialize(tiny_model(), config=cfg)
    try:
        engine.backward(loss_fn(engine(batch(0, torch.bfloat16))))
        engine.step()
        engine.save_checkpoint(ckpt)
        assert (ckpt / "latest").read_text() == "global_step1" and victim.read_text() == "precious"
        os.unlink(ckpt / "latest")
        (ckpt / "latest").symlink_to(victim)
        with pytest.raises(FileExistsError, match="symbolic link"):
            engine.save_checkpoint(ckpt)
        assert victim.read_text() == "precious" and os.path.islink(ckpt / "latest")
    finally:
        engine.close()
