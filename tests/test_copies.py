"""Host<->device copies and their ordering, on a CPU: the emulator of asynchronous copies
(``offload.copies.emulated``) sends CPU tensors down the path device tensors take, performs every copy late on
a thread, and reports a broken ordering rule. Every GPU code path trains bit for bit as without it, and each
ordering rule has a test that fails when the rule is broken."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from offload import OffloadedAdamW, copies, offload_parameters, restore_parameters
from offload.params import materialized

OPT = dict(lr=1e-2, buffer_size=16384, buffer_count=3, small_param_threshold=0)


class Model(nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(24, 64).to(dtype)
        self.b = nn.Linear(64, 64).to(dtype)
        self.c = nn.Linear(64, 8).to(dtype)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x.to(self.a.weight.dtype))))))


def batch(step: int) -> torch.Tensor:
    return torch.randn(5, 24, generator=torch.Generator().manual_seed(step))


def weights(model) -> list:
    with materialized(model):
        return [p.detach().clone() for p in model.parameters()]


def state_tensors(opt) -> list:
    sd = opt.state_dict()
    return [t for _, st in sorted(sd["state"].items()) for _, t in sorted(st.items())]


def train(tmp_path, name: str, *, steps: int = 3, dtype=torch.float32, offload=None, hook=None,
          ckpt: bool = False, **options):
    """Weights and state after ``steps`` iterations of a small model (``offload``: offload_parameters'
    arguments; ``hook(model, step)``: a context for each backward; ``ckpt``: save after the first step,
    load it back after the second, and train on)."""
    model = Model(dtype)
    if offload is not None:
        offload_parameters(model, nvme_path=str(tmp_path / f"{name}-w"), **offload)
    opt = OffloadedAdamW(model.parameters(), nvme_path=str(tmp_path / name), **{**OPT, **options})
    try:
        for step in range(steps):
            loss = model(batch(step)).float().square().mean()
            with hook(model, step) if hook is not None else _nothing():
                loss.backward()
            opt.step()
            opt.zero_grad()
            if ckpt and step == 0:
                opt.save_checkpoint(tmp_path / f"{name}-ckpt", model=model)
            if ckpt and step == 1:
                opt.load_checkpoint(tmp_path / f"{name}-ckpt", model=model)
        return weights(model), state_tensors(opt)
    finally:
        opt.close()
        if offload is not None:
            restore_parameters(model)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.fixture
def emulator():
    """The copy emulator installed for the test; the ordering rules are checked at its end."""
    with copies.emulated(delay=0.002) as emu:
        yield emu
        emu.check()


# -- the emulator itself --------------------------------------------------------------------------


def test_emulator_reports_a_host_source_changed_before_its_copy_completed():
    """A copy to the device reads its source late: changing the source before the ticket is done is reported,
    and after it is not."""
    with copies.emulated(delay=0.02) as emu:
        src = torch.arange(8, dtype=torch.float32)
        dev, ticket = copies.to_device(src, src)
        assert torch.equal(dev, src) and not ticket.done()
        ticket.wait()
        src.add_(1)  # after completion: allowed
        emu.check()
        _, ticket = copies.to_device(src, src)
        src.add_(1)  # before completion: a buffer reused too early
        ticket.wait()
        with pytest.raises(AssertionError, match="changed before the copy completed"):
            emu.check()


def test_emulator_fills_a_host_destination_only_when_its_copy_completes():
    """A copy to the host lands late: once started and until its ticket is done the destination holds NaN."""
    with copies.emulated(delay=0.05) as emu:
        src, dst = torch.ones(4), torch.zeros(4)
        ticket = copies.to_host(dst, src)
        time.sleep(0.02)
        assert torch.isnan(dst).all()
        ticket.wait()
        assert torch.equal(dst, src)
        emu.check()


def test_copies_to_and_from_a_device_run_on_two_streams():
    """A copy to the device does not queue behind a copy back (two copy streams per device): with a slow
    copy back in flight, the next copy to the device completes first."""
    with copies.emulated(delay=0.002) as emu:
        emu.delay = 0.2
        back = copies.to_host(torch.zeros(4), torch.ones(4))
        emu.delay = 0.002
        _, there = copies.to_device(torch.ones(4), torch.ones(4))
        there.wait()
        assert not back.done()
        back.wait()
        emu.check()
