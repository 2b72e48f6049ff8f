"""Offloaded parameters inside the tools training loops use: ``model.to()``, ``torch.compile`` and
Hugging Face's Trainer (its device placement, its gradient norm, its save and resume)."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from helpers import OPT, TINY, Net, assert_same_weights, ckpt_file, loss_of, snapshot
from torch import nn

from offload import OffloadedAdamW, offload_parameters
from offload.params import materialized, offloaded
from offload.params.api import compile_offloaded


def make_pair(seed=0):
    torch.manual_seed(seed)
    ref = Net()
    return ref, copy.deepcopy(ref)


def train_pair(ref, off, nvme, closing, steps=3, between=None):
    """Both models, the same steps (``between(step)`` runs after each backward, while the gradients wait in the grad
    store for step(): the update stays there, not inside backward); bit for bit at the end."""
    opts = [closing(OffloadedAdamW(m.parameters(), nvme_path=nvme, overlap_backward=False, **OPT)) for m in (ref, off)]
    for step in range(steps):
        for model, opt in zip((ref, off), opts):
            loss_of(model, step).backward()
            if between is not None and model is off:
                between(step)
            opt.step()
            opt.zero_grad()
    assert_same_weights(ref, off)


# -- model.to() -------------------------------------------------------------------------------------


def test_to_where_the_weights_already_are_changes_nothing(nvme, closing):
    """model.to(its device), .to(its dtype), .cpu(), .float() and .type(its dtype) are no-ops on an offloaded
    model, also while gradients wait in the grad store: it then trains exactly like the plain model."""
    ref, off = make_pair()
    closing(offload_parameters(off, nvme, **TINY))
    moves = [lambda: off.to("cpu"), lambda: off.to(torch.float32), lambda: off.to(torch.device("cpu")),
             lambda: off.to(device="cpu", dtype=torch.float32), lambda: off.cpu(), lambda: off.float(),
             lambda: off.type(torch.float32)]

    def move_all(step):
        for move in moves:
            assert move() is off
        assert type(off.blocks[0].up.weight.grad).__name__ == "OffloadedGrad"  # the placeholder survived

    for move in moves:
        move()
    train_pair(ref, off, nvme, closing, between=move_all)
    assert offloaded(off).store.resident_bytes == 0


@pytest.mark.parametrize("move", ["float64", "half", "meta", "cuda", "bfloat16"])
def test_a_real_move_is_refused_and_changes_no_weight(nvme, closing, move):
    """A move to another device or dtype raises, saying to move the model before offload_parameters; every
    weight keeps its value, device and dtype."""
    torch.manual_seed(0)
    off = closing(offload_parameters(Net(), nvme, **TINY))
    with materialized(off):
        before = snapshot(off.parameters())
    call = {"float64": lambda: off.to(torch.float64), "half": off.half, "meta": lambda: off.to("meta"),
            "cuda": lambda: off.cuda(), "bfloat16": lambda: off.to("cpu", torch.bfloat16)}[move]
    with pytest.raises(RuntimeError, match="Move or convert the model before offload_parameters"):
        call()
    for p, q in zip(off.parameters(), before):
        assert (p.device, p.dtype) == (q.device, q.dtype)
    with materialized(off):
        for p, q in zip(off.parameters(), before):
            assert torch.equal(p, q)


def test_converting_a_resident_weight_gives_a_copy_and_leaves_the_weight(nvme, closing):
    """Inside a forward (resident), ``weight.to(other dtype)`` is an ordinary converted copy, as in torch."""

    class CastLinear(nn.Linear):
        def forward(self, x):
            return nn.functional.linear(x.double(), self.weight.to(torch.float64), self.bias.double())

    torch.manual_seed(0)
    ref = nn.Sequential(CastLinear(8, 8), CastLinear(8, 8))
    off = closing(offload_parameters(copy.deepcopy(ref), nvme, **dict(TINY, buffer_size=64)))
    x = torch.randn(4, 8)
    assert torch.equal(ref(x), off(x))
    assert off[0].weight.dtype == torch.float32 and offloaded(off).store.resident_bytes == 0


def test_assigning_data_of_an_offloaded_parameter_is_refused(nvme, closing):
    """``p.data = other`` would detach the parameter from its store: refused, resident or not."""
    torch.manual_seed(0)
    off = closing(offload_parameters(Net(), nvme, **TINY))
    p = off.blocks[0].up.weight
    with pytest.raises(RuntimeError, match="take it away from its store"):
        p.data = torch.zeros(p.shape)
    with materialized(off), pytest.raises(RuntimeError, match="take it away from its store"):
        p.data = torch.zeros(p.shape)


# -- torch.compile ---------------------------------------------------------------------------------


@pytest.fixture
def dynamo():
    """Dynamo's caches emptied after the test (compiled code holds on to the modules it traced)."""
    yield
    torch._dynamo.reset()


def test_compiling_the_whole_offloaded_model_is_refused_saying_what_works(nvme, closing, dynamo):
    """torch.compile(model) of an offloaded model fails at its compilation with a message naming
    compile_offloaded, not the advice for reading weights outside a forward."""
    torch.manual_seed(0)
    off = closing(offload_parameters(Net(), nvme, **TINY))
    with pytest.raises(RuntimeError, match="compile_offloaded") as info:
        torch.compile(off, backend="eager")(torch.randn(16, 32))
    assert "materialized" not in str(info.value)


def test_compile_offloaded_trains_like_the_plain_model_compiled_the_same_way(nvme, closing, dynamo):
    """compile_offloaded (hooks outside the graphs) trains to the same weights, bit for bit, as the same
    submodules compiled in a plain model."""
    ref, off = make_pair()
    closing(offload_parameters(off, nvme, **TINY))
    compile_offloaded(off, backend="aot_eager")
    compile_offloaded(ref, backend="aot_eager")
    assert off.blocks[0].up.forward is not type(off.blocks[0].up).forward
    assert "forward" not in off.blocks[0].__dict__  # its children have hooks: it stays eager
    assert "forward" in ref.__dict__  # nothing offloaded: the whole model is one graph
    train_pair(ref, off, nvme, closing, steps=2)


# -- Hugging Face Trainer ----------------------------------------------------------------------------


class _Regression(nn.Module):
    """A model as Trainer takes it: keyword inputs, a dict with the loss."""

    def __init__(self, d=32, layers=3):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.head = nn.Linear(d, 1)

    def forward(self, x, labels=None):
        for layer in self.layers:
            x = torch.relu(layer(x))
        out = self.head(x).squeeze(-1)
        return {"loss": (out - labels).square().mean(), "logits": out}


class _Data(torch.utils.data.Dataset):
    def __init__(self, n=48, d=32):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, d, generator=g), torch.randn(n, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


def _fit(trainer_cls, model, opt, out, steps, resume=None, max_grad_norm=0.5):
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(out), max_steps=steps, per_device_train_batch_size=8, save_steps=2,
                             logging_steps=1, report_to=[], use_cpu=True, seed=0, max_grad_norm=max_grad_norm,
                             disable_tqdm=True)
    trainer = trainer_cls(model=model, args=args, train_dataset=_Data(), optimizers=(opt, None))
    trainer.train(resume_from_checkpoint=resume)
    return [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]


def test_offload_trainer_logging_the_norm_keeps_auto_overlap_off(nvme, closing, tmp_path):
    """Without clipping (max_grad_norm=0) OffloadTrainer still reads the offloaded grads after each backward, to
    log their norm: overlap_backward="auto" (the default) never switches on, and every norm is logged."""
    pytest.importorskip("transformers")
    from offload.integrations.transformers import OffloadTrainer

    torch.manual_seed(0)
    model = closing(offload_parameters(_Regression(), nvme, **TINY))
    opt = closing(OffloadedAdamW(model.parameters(), nvme_path=nvme, **OPT))
    assert opt.config.offload_optimizer.overlap_backward == "auto"
    norms = _fit(OffloadTrainer, model, opt, tmp_path / "out", 5, max_grad_norm=0)
    assert len(norms) == 5 and all(n > 0 for n in norms)
    assert not opt._overlap.armed


def test_plain_trainer_on_offloaded_grads_points_to_offload_trainer(nvme, closing, tmp_path):
    """Trainer's own gradient norm (torch's) cannot read offloaded gradients; the error names OffloadTrainer."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = closing(offload_parameters(_Regression(), nvme, **TINY))
    opt = closing(OffloadedAdamW(model.parameters(), nvme_path=nvme, **OPT))
    with pytest.raises(RuntimeError, match="OffloadTrainer"):
        _fit(transformers.Trainer, model, opt, tmp_path / "out", 2)


def test_offload_trainer_with_offloaded_model_trains_and_resumes_like_plain_trainer(nvme, closing, tmp_path):
    """OffloadTrainer + offload_parameters + OffloadedAdamW: Trainer's device placement, clipped gradient norms
    (logged and applied) and weights equal a plain Trainer with torch's AdamW, bit for bit; resuming from its
    step-2 checkpoint (weights and state streamed) ends at the same weights."""
    transformers = pytest.importorskip("transformers")
    from offload.integrations import OFFLOAD_DIR
    from offload.integrations.transformers import OffloadTrainer

    torch.manual_seed(0)
    ref = _Regression()
    start = copy.deepcopy(ref)
    ref_norms = _fit(transformers.Trainer, ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True),
                     tmp_path / "ref", 6)

    def offloaded_run(out, steps, resume=None):
        model = closing(offload_parameters(copy.deepcopy(start), nvme, **TINY))
        opt = closing(OffloadedAdamW(model.parameters(), nvme_path=nvme, **OPT))
        norms = _fit(OffloadTrainer, model, opt, out, steps, resume)
        # Trainer clips after every backward, reading the grads: overlap_backward="auto" never switches on.
        assert not opt._overlap.armed
        return model, norms

    off, norms = offloaded_run(tmp_path / "off", 6)
    assert norms == ref_norms and max(norms) > 0.5  # clipping happened
    assert_same_weights(ref, off)
    checkpoint = tmp_path / "off" / "checkpoint-2"
    assert os.path.exists(ckpt_file(checkpoint / OFFLOAD_DIR, "params.bin"))
    assert not (checkpoint / "optimizer.pt").exists() and not (checkpoint / "model.safetensors").exists()

    resumed, norms = offloaded_run(tmp_path / "resumed", 6, resume=str(checkpoint))
    assert norms == ref_norms  # the first two come from the checkpoint's trainer_state.json
    assert_same_weights(ref, resumed)
