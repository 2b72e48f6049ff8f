"""overlap_backward: state read and updated during backward, bit for bit what the same optimizer computes
without it; accumulation with no_step(), clipping with max_grad_norm, refusals, and I/O errors in hooks."""

from __future__ import annotations

import errno
import time

import pytest
import torch
from helpers import TINY, Net, assert_same, first_os_error, loss_of
from torch.utils.checkpoint import checkpoint

from offload import OffloadedAdamW, StateError, offload_parameters

UNIT = 64 * 1024
OPT = dict(lr=1e-2, buffer_size=UNIT, buffer_count=3, small_param_threshold=64)


class _Slow(torch.autograd.Function):
    """Identity whose backward pauses: the worker then has time to update any unit released too early."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        time.sleep(0.01)
        return g


class Tied(torch.nn.Module):
    """Blocks with activation checkpointing, a parameter used twice in one forward, and a head tied to the
    embedding; backward pauses between blocks (as a real model's compute does)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(50, 32)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(),
                                                              torch.nn.Linear(128, 32)) for _ in range(3))
        self.twice = torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, 50, bias=False)
        self.head.weight = self.embed.weight
        self.frozen = torch.nn.Linear(32, 32)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        h = _Slow.apply(self.embed(x))
        for b in self.blocks:
            h = _Slow.apply(h + checkpoint(b, h, use_reentrant=False))
        h = self.twice(torch.tanh(self.twice(h)))  # one parameter, two uses
        return self.head(self.frozen(h))


def batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 50, (4, 8), generator=g), torch.randint(0, 50, (4, 8), generator=g)


def train(model, opt, steps, *, micro=1, no_step=True):
    losses = []
    for s in steps:
        for m in range(micro):
            x, y = batch(100 * s + m)
            loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, 50), y.reshape(-1))
            if m < micro - 1 and no_step:
                with opt.no_step():
                    loss.backward()
            else:
                loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def pair(nvme, **kw):
    a, b = Tied(), Tied()
    ours = OffloadedAdamW(a.parameters(), nvme_path=nvme + "-a", overlap_backward=True, **{**OPT, **kw})
    ref = OffloadedAdamW(b.parameters(), nvme_path=nvme + "-b", **{**OPT, **kw})
    return a, b, ours, ref


@pytest.mark.parametrize("micro", [1, 3])
@pytest.mark.parametrize("clip", [None, 0.5])
def test_overlap_equals_the_same_optimizer_without_it_bit_for_bit(nvme, closing, micro, clip):
    """Overlapped and not: the same losses, weights and state over steps with accumulation (no_step),
    clipping (max_grad_norm), tied weights, a parameter used twice, activation checkpointing and a frozen
    layer; the clipped run's norms equal torch's clip_grad_norm_."""
    a, b, ours, ref = pair(nvme, max_grad_norm=clip)
    closing(ours)
    closing(ref)
    la = train(a, ours, range(4), micro=micro)
    lb = train(b, ref, range(4), micro=micro)
    assert la == lb
    assert_same(list(a.parameters()), list(b.parameters()))
    sa, sb = ours.state_dict(), ref.state_dict()
    for i in sb["state"]:
        for k in sb["state"][i]:
            assert torch.equal(sa["state"][i][k], sb["state"][i][k]), (i, k)
    if clip is not None:
        assert torch.equal(ours.last_grad_norm, ref.last_grad_norm)


def test_max_grad_norm_equals_torch_clip_grad_norm_then_adamw(nvme, closing):
    """max_grad_norm on the optimizer equals torch.nn.utils.clip_grad_norm_ followed by torch's AdamW, bit
    for bit (norm and weights)."""
    a, b = Tied(), Tied()
    ours = closing(OffloadedAdamW(a.parameters(), nvme_path=nvme, max_grad_norm=0.3, overlap_backward=True, **OPT))
    ref = torch.optim.AdamW(b.parameters(), lr=OPT["lr"], fused=True)
    for s in range(3):
        for model, opt in ((a, ours), (b, ref)):
            x, y = batch(s)
            torch.nn.functional.cross_entropy(model(x).reshape(-1, 50), y.reshape(-1)).backward()
            if opt is ref:
                norm = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.3)
            opt.step()
            opt.zero_grad()
        assert torch.equal(ours.last_grad_norm, norm)
        assert_same(list(a.parameters()), list(b.parameters()))


def test_the_update_runs_during_backward(nvme, closing):
    """With overlap_backward, by the time backward returns the step has already read and updated state
    (bytes moved before step() is called); step() finishes what is left."""
    a = Tied()
    ours = closing(OffloadedAdamW(a.parameters(), nvme_path=nvme, overlap_backward=True, **OPT))
    train(a, ours, range(2))
    before = ours.io_bytes()
    x, y = batch(7)
    torch.nn.functional.cross_entropy(a(x).reshape(-1, 50), y.reshape(-1)).backward()
    import time

    deadline = time.time() + 10
    while ours.io_bytes() == before and time.time() < deadline:
        time.sleep(0.01)
    assert ours.io_bytes()[0] > before[0], "nothing was read during backward"
    ours.step()


def test_a_second_backward_without_no_step_is_refused_clearly(nvme, closing):
    """Two backward passes before step() without no_step(): the second is refused with a StateError saying
    to use no_step(), and the optimizer refuses to step until state is restored."""
    a = Tied()
    ours = closing(OffloadedAdamW(a.parameters(), nvme_path=nvme, overlap_backward=True, **OPT))
    train(a, ours, range(1))
    for s in range(2):
        x, y = batch(s)
        loss = torch.nn.functional.cross_entropy(a(x).reshape(-1, 50), y.reshape(-1))
        if s == 0:
            loss.backward()
        else:
            with pytest.raises(StateError, match="no_step"):
                loss.backward()
    with pytest.raises(StateError):
        ours.step()


def test_a_closure_and_a_grad_scaler_are_refused(nvme, closing):
    """step(closure) is refused with a ValueError before anything runs; a GradScaler is refused when step()
    first sees it, and the optimizer then refuses to step until state is restored."""
    a = Tied()
    ours = closing(OffloadedAdamW(a.parameters(), nvme_path=nvme, overlap_backward=True, **OPT))
    with pytest.raises(ValueError, match="closure"):
        ours.step(lambda: torch.tensor(0.0))
    scaler = torch.amp.GradScaler("cpu")
    x, y = batch(0)
    scaler.scale(torch.nn.functional.cross_entropy(a(x).reshape(-1, 50), y.reshape(-1))).backward()
    with pytest.raises(StateError, match="GradScaler"):
        scaler.step(ours)
    with pytest.raises(StateError):
        ours.step()


def test_an_io_error_during_backward_is_reported_and_blocks_steps(nvme, closing):
    """An EIO in a read or write the step issues during backward is raised (by backward or by step(), naming
    the swap file), and the optimizer refuses to step after it."""
    a = Tied()
    ours = closing(OffloadedAdamW(a.parameters(), nvme_path=nvme, overlap_backward=True, **OPT))
    train(a, ours, range(2))
    ours.state_store.drain()
    ours.swap_space.inject_fault("error", op="read", count=1, errno=errno.EIO)
    x, y = batch(9)
    loss = torch.nn.functional.cross_entropy(a(x).reshape(-1, 50), y.reshape(-1))
    err = first_os_error(loss.backward, ours.step)
    assert err.errno == errno.EIO and err.filename in ours.swap_space.files
    with pytest.raises(StateError):
        ours.step()


def test_overlap_with_offloaded_parameters_trains_like_without(nvme, closing):
    """overlap_backward over a model whose weights and grads live on NVMe (offload_parameters) trains bit for
    bit like the same without overlap."""
    torch.manual_seed(0)
    a, b = Net(), Net()
    b.load_state_dict(a.state_dict())
    for m, path in ((a, "-pa"), (b, "-pb")):
        closing(offload_parameters(m, nvme_path=nvme + path, **TINY))
    oa = closing(OffloadedAdamW(a.parameters(), nvme_path=nvme + "-a", overlap_backward=True, **OPT))
    ob = closing(OffloadedAdamW(b.parameters(), nvme_path=nvme + "-b", **OPT))
    for s in range(3):
        for m, o in ((a, oa), (b, ob)):
            loss_of(m, s).backward()
            o.step()
            o.zero_grad()
    from offload import materialized

    with materialized(a), materialized(b):
        assert_same(list(a.parameters()), list(b.parameters()))
