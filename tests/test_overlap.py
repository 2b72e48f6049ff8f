"""overlap_backward: state read and updated during backward, bit for bit what the same optimizer computes
without it; accumulation with no_step(), clipping with max_grad_norm, refusals, and I/O errors in hooks."""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import threading
import time
import weakref

import pytest
import torch
from helpers import (
    TINY,
    Net,
    assert_same,
    first_os_error,
    loss_of,
    sigkill_then_resume_equals_uninterrupted,
)
from torch.utils.checkpoint import checkpoint

from offload import OffloadedAdamW, StateError, materialized, offload_parameters
from offload.params import load_grad, offloaded
from offload.sizes import round_up

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


def train(model, opt, steps, *, micro=1, no_step=True, set_to_none=True):
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
        opt.zero_grad(set_to_none=set_to_none)
        losses.append(loss.item())
    return losses


def groups(model):
    """Two groups with their own lr and weight decay: the blocks, and everything else."""
    blocks = list(model.blocks.parameters())
    rest = [p for p in model.parameters() if all(p is not q for q in blocks)]
    return [{"params": blocks, "lr": 3e-3, "weight_decay": 0.05}, {"params": rest}]


def pair(nvme, grouped=False, **kw):
    a, b = Tied(), Tied()
    params = (groups(a), groups(b)) if grouped else (a.parameters(), b.parameters())
    ours = OffloadedAdamW(params[0], nvme_path=nvme + "-a", overlap_backward=True, **{**OPT, **kw})
    ref = OffloadedAdamW(params[1], nvme_path=nvme + "-b", **{**OPT, **kw})
    return a, b, ours, ref


@pytest.mark.parametrize("micro, clip, grouped, set_to_none", [
    (1, None, False, True), (3, None, False, True), (1, 0.5, False, True), (3, 0.5, False, True),
    (1, None, True, False), (3, 0.5, True, False),
], ids=["plain", "accumulate", "clip", "accumulate-clip", "groups-zeroed-grads", "groups-zeroed-accumulate-clip"])
def test_overlap_equals_the_same_optimizer_without_it_bit_for_bit(nvme, closing, micro, clip, grouped, set_to_none):
    """Overlapped and not: the same losses, weights and state over steps with accumulation (no_step),
    clipping (max_grad_norm), two groups with their own hyperparameters, grads zeroed rather than set to None
    (so an update that ran before its grads were final would use zeros), tied weights, a parameter used twice,
    activation checkpointing and a frozen layer; the clipped run's norms equal torch's clip_grad_norm_."""
    a, b, ours, ref = pair(nvme, grouped, max_grad_norm=clip)
    closing(ours)
    closing(ref)
    la = train(a, ours, range(4), micro=micro, set_to_none=set_to_none)
    lb = train(b, ref, range(4), micro=micro, set_to_none=set_to_none)
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
    # Backward pauses between blocks (_Slow): units of the later blocks were read while it ran.
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


@pytest.mark.parametrize("change", ["clip_grad_norm_", "grad_scaler"])
def test_grads_changed_between_backward_and_step_are_refused(nvme, closing, change):
    """torch's clip_grad_norm_ after backward, or a GradScaler with the for-loop kernel (which unscales the
    grads in place), would be silently ignored by updates that already ran during backward: step() refuses
    with a StateError naming max_grad_norm (the scaler: naming the GradScaler, refused as it looks at the
    optimizer, before it unscales anything), and the optimizer refuses to step until state is restored."""
    a = Tied()
    ours = closing(OffloadedAdamW(a.parameters(), nvme_path=nvme, overlap_backward=True, fused=False, **OPT))
    train(a, ours, range(1))
    x, y = batch(1)
    loss = torch.nn.functional.cross_entropy(a(x).reshape(-1, 50), y.reshape(-1))
    expected = "changed between backward and step.*max_grad_norm" if change == "clip_grad_norm_" else \
        "GradScaler cannot be used with overlap_backward"
    with pytest.raises(StateError, match=expected):
        if change == "clip_grad_norm_":
            loss.backward()
            torch.nn.utils.clip_grad_norm_(a.parameters(), 1e-3)
            ours.step()
        else:
            scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
            scaler.scale(loss).backward()
            scaler.step(ours)
    with pytest.raises(StateError):
        ours.step()


@pytest.mark.parametrize("op, tail", [("read", False), ("write", False), ("write", True)],
                         ids=["read-in-backward", "write-in-backward", "tail-write"])
def test_an_io_error_during_backward_is_reported_and_blocks_steps(nvme, closing, op, tail):
    """An EIO in a read or write the step issues during backward, or in the last write a step leaves
    landing, is raised (by backward, by step() or by the next backward, naming the swap file), and the
    optimizer refuses to step after it."""
    a = Tied()
    ours = closing(OffloadedAdamW(a.parameters(), nvme_path=nvme, overlap_backward=True, **OPT))
    train(a, ours, range(2))
    ours.state_store.drain()
    units = ours.state_store.layout.units
    # A step writes every unit but those the pool holds unwritten for the next one: fail its last write.
    skip = len(units) - len(ours.state_store.moves.kept(units)) - 1 if tail else 0
    ours.swap_space.inject_fault("error", op=op, skip=skip, count=1, errno=errno.EIO)
    def backward(s):
        x, y = batch(s)
        torch.nn.functional.cross_entropy(a(x).reshape(-1, 50), y.reshape(-1)).backward()

    err = first_os_error(*(f for s in (9, 10) for f in (lambda s=s: backward(s), ours.step, ours.zero_grad)))
    assert err.errno == errno.EIO and err.filename in ours.swap_space.files
    with pytest.raises(StateError):
        ours.step()


def test_offload_parameters_after_the_optimizer_is_refused_clearly(nvme, closing):
    """offload_parameters on a model whose optimizer (overlap_backward) is already built: the first backward
    raises a StateError saying to offload first."""
    torch.manual_seed(0)
    m = Net()
    closing(OffloadedAdamW(m.parameters(), nvme_path=nvme + "-a", overlap_backward=True, **OPT))
    closing(offload_parameters(m, nvme_path=nvme + "-p", **TINY))
    with pytest.raises(StateError, match="offload_parameters first"):
        loss_of(m, 0).backward()


def _offloaded_pair(nvme, closing, **opt_kw):
    torch.manual_seed(0)
    a, b = Net(), Net()
    b.load_state_dict(a.state_dict())
    for m, path in ((a, "-pa"), (b, "-pb")):
        closing(offload_parameters(m, nvme_path=nvme + path, **TINY))
    oa = closing(OffloadedAdamW(a.parameters(), nvme_path=nvme + "-a", overlap_backward=True, **OPT, **opt_kw))
    ob = closing(OffloadedAdamW(b.parameters(), nvme_path=nvme + "-b", overlap_backward=False, **OPT))
    return a, b, oa, ob


def _moved(model) -> tuple:
    s = offloaded(model).store
    return s.bytes_read, s.bytes_written, s.grad_bytes_read, s.grad_bytes_written


@pytest.mark.parametrize("micro", [1, 2])
def test_overlap_with_offloaded_parameters_trains_like_without_and_skips_the_grads_round_trip(nvme, closing, micro):
    """overlap_backward over a model whose weights and grads live on NVMe (offload_parameters) trains bit for
    bit like the same without overlap, with accumulation too; each parameter is updated while backward holds
    it: no gradient is written to NVMe in the last micro-batch nor read back, the weights are read once less
    and written once per step."""
    a, b, oa, ob = _offloaded_pair(nvme, closing)
    weight_bytes = sum(round_up(p.numel() * p.element_size(), 4096) for p in a.parameters())  # as stored
    per_step = {}
    for s in range(4):
        for m, o in ((a, oa), (b, ob)):
            before = _moved(m)
            for k in range(micro):
                ctx = o.no_step() if k < micro - 1 else contextlib.nullcontext()
                with ctx:
                    loss_of(m, 10 * s + k).backward()
            o.step()
            o.zero_grad()
            per_step[id(m)] = [x - y for x, y in zip(_moved(m), before)]
    with materialized(a), materialized(b):
        assert_same(list(a.parameters()), list(b.parameters()))
    (ra, wa, gra, gwa), (rb, wb, grb, gwb) = per_step[id(a)], per_step[id(b)]
    assert gwb > 0 and grb >= gwb  # without overlap: the grads' round trip
    grads_of_micro = gwb // micro
    assert gwa == gwb - grads_of_micro and gra < grb  # the last micro-batch's grads never go to NVMe
    assert wa == weight_bytes and wb == weight_bytes  # updated weights written once
    assert ra < rb  # no second fetch for the update (how much less depends on which prefetches were dropped)


def test_offloaded_weights_unused_in_an_iteration_keep_their_bits(nvme, closing):
    """bf16 weights on NVMe, every parameter with an fp32 master (small_param_threshold=0): a block that gets
    no gradient in an iteration keeps its weights bit for bit, with overlap_backward as without it, and the
    two optimizers stay equal bit for bit. (Its weights were fetched without a read, as the master allows,
    then written back unchanged: whatever the memory held went to NVMe.)"""
    torch.manual_seed(0)
    a, b = Net().to(torch.bfloat16), Net().to(torch.bfloat16)
    b.load_state_dict(a.state_dict())
    for m, path in ((a, "-pa"), (b, "-pb")):
        closing(offload_parameters(m, nvme_path=nvme + path, **TINY))
    opt = dict(OPT, small_param_threshold=0)
    oa = closing(OffloadedAdamW(a.parameters(), nvme_path=nvme + "-a", overlap_backward=True, **opt))
    ob = closing(OffloadedAdamW(b.parameters(), nvme_path=nvme + "-b", **opt))
    with materialized(a):
        initial = [p.detach().clone() for p in a.blocks[2].parameters()]
    for s in range(4):
        for m, o in ((a, oa), (b, ob)):
            m.order = [0, 1, 3] if s % 2 else None  # block 2 unused in odd iterations
            with materialized(m):
                before = [p.detach().clone() for p in m.blocks[2].parameters()]
            loss_of(m, s, torch.bfloat16).backward()
            o.step()
            o.zero_grad()
            if s % 2:
                with materialized(m):
                    assert_same(list(m.blocks[2].parameters()), before)
    with materialized(a), materialized(b):
        assert_same(list(a.parameters()), list(b.parameters()))
        assert not any(torch.equal(p, q) for p, q in zip(a.blocks[2].parameters(), initial))  # trained when used


def test_a_gradient_consumed_during_backward_refuses_to_be_read(nvme, closing):
    """With overlap_backward and offloaded grads, a gradient the update took during backward is gone:
    reading it raises an error naming overlap_backward; zero_grad() then a new backward work as usual."""
    a, _, oa, _ = _offloaded_pair(nvme, closing)
    loss_of(a, 0).backward()
    oa.step()
    with pytest.raises(RuntimeError, match="overlap_backward"):
        load_grad(a.blocks[0].up.weight)
    oa.zero_grad()
    loss_of(a, 1).backward()
    oa.step()


def test_a_small_hand_off_budget_spills_grads_and_still_trains_alike(nvme, closing):
    """When more weights and grads would wait for their update than the optimizer allows, the rest take the
    round trip through NVMe as without overlap: results stay bit for bit, only fewer bytes are saved."""
    a, b, oa, ob = _offloaded_pair(nvme, closing)
    oa._access.handoff_bytes = 3 * 128 * 32 * 4  # weights and grads of about one Linear
    for s in range(3):
        for m, o in ((a, oa), (b, ob)):
            before = _moved(m)
            loss_of(m, s).backward()
            o.step()
            o.zero_grad()
            if m is a:
                moved = [x - y for x, y in zip(_moved(m), before)]
    assert moved[3] > 0  # some grads spilled
    with materialized(a), materialized(b):
        assert_same(list(a.parameters()), list(b.parameters()))


def test_sigkill_during_backward_then_resume_equals_the_uninterrupted_run(tmp_path):
    """A run killed during a backward whose update has already started to rewrite the offloaded state (weights
    on NVMe too), resumed from its last checkpoint, ends bit for bit where a run never killed ends."""
    sigkill_then_resume_equals_uninterrupted(tmp_path, {"overlap_backward": True, "offload_parameters": True})


@pytest.mark.parametrize("through", ["optimizer", "module", "retention"])
def test_state_reads_between_backward_and_step_are_refused_and_loads_end_the_running_step(nvme, closing, tmp_path,
                                                                                         through):
    """Between a backward and step(), with the update running on the pool: state_dict(), a checkpoint save (the
    optimizer's method, offload.checkpoint's function or a Retention's) and add_param_group() are refused with a
    StateError saying to call step() first, and leave training as it was (bit for bit the same as without them);
    a checkpoint load (the same three ways) ends the running step and restores the state."""
    from offload.checkpoint import Retention, load_checkpoint, save_checkpoint

    ckpt, other = tmp_path / "ckpt", tmp_path / "other"
    save, load = {
        "optimizer": (lambda opt, d, **kw: opt.save_checkpoint(d, **kw),
                      lambda opt, d, **kw: opt.load_checkpoint(d, **kw)),
        "module": (save_checkpoint, load_checkpoint),
        "retention": (lambda opt, d, **kw: Retention(d).save(opt, 1, **kw),
                      lambda opt, d, **kw: Retention(d).load_latest(opt, **kw)),
    }[through]
    a, b, ours, ref = pair(nvme)
    closing(ours)
    closing(ref)
    train(a, ours, range(1))
    train(b, ref, range(1))
    save(ours, ckpt, model=a)
    for model in (a, b):
        x, y = batch(1)
        torch.nn.functional.cross_entropy(model(x).reshape(-1, 50), y.reshape(-1)).backward()
    for call in (ours.state_dict, lambda: save(ours, other),
                 lambda: ours.add_param_group({"params": [torch.nn.Parameter(torch.zeros(8))]})):
        with pytest.raises(StateError, match="between backward and step.*call step\\(\\) first"):
            call()
    assert len(ours.param_groups) == 1
    assert not other.exists() or (through == "retention" and os.listdir(other) == [])  # a Retention makes its root
    for opt in (ours, ref):
        opt.step()
        opt.zero_grad()
    assert_same(list(a.parameters()), list(b.parameters()))
    x, y = batch(2)
    torch.nn.functional.cross_entropy(a(x).reshape(-1, 50), y.reshape(-1)).backward()
    assert ours._overlap.running
    load(ours, ckpt, model=a)
    assert not ours._overlap.running  # ended by the load, not left to race it
    ours.zero_grad()
    train(a, ours, [1])
    ref_model, _, ref2, unused = pair(nvme + "-c")
    closing(ref2)
    closing(unused)
    train(ref_model, ref2, range(2))
    assert_same(list(a.parameters()), list(ref_model.parameters()))


def test_taking_the_norm_with_an_infinite_clip_between_backward_and_step_is_allowed(nvme, closing):
    """clip_grad_norm_(params, inf) after backward (what Trainer does to log the norm) multiplies grads by 1: the
    overlapped step goes on and equals the same optimizer without overlap, bit for bit."""
    a, b, ours, ref = pair(nvme)
    closing(ours)
    closing(ref)
    for s in range(2):
        for model, opt in ((a, ours), (b, ref)):
            x, y = batch(s)
            torch.nn.functional.cross_entropy(model(x).reshape(-1, 50), y.reshape(-1)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
            opt.step()
            opt.zero_grad()
    assert_same(list(a.parameters()), list(b.parameters()))


def test_a_nan_gradient_is_not_taken_for_a_changed_one(nvme, closing):
    """A backward whose loss is NaN leaves NaN grads: step() goes on as without overlap (the NaN reaches the
    weights in both), rather than raising that the gradients were changed after backward."""
    a, b, ours, ref = pair(nvme)
    closing(ours)
    closing(ref)
    for model, opt in ((a, ours), (b, ref)):
        x, y = batch(0)
        (torch.nn.functional.cross_entropy(model(x).reshape(-1, 50), y.reshape(-1)) * float("nan")).backward()
        opt.step()
        opt.zero_grad()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p.isnan(), q.isnan()) and torch.equal(p.nan_to_num(), q.nan_to_num())


# -- combinations found by tests/test_combinations.py ----------------------------------------------------------


def test_max_grad_norm_with_offloaded_grads_trains_like_without_overlap(nvme, closing):
    """max_grad_norm with overlap_backward over weights and grads on NVMe: the norms taken during backward read
    each grad through the parameter store (its p.grad is a placeholder), so backward does not fail, and the
    results and last_grad_norm equal the same optimizer's without overlap bit for bit."""
    a, b, oa, ob = _offloaded_pair(nvme, closing, max_grad_norm=0.05)
    ob.max_grad_norm = 0.05
    for s in range(3):
        for m, o in ((a, oa), (b, ob)):
            loss_of(m, s).backward()
            o.step()
            o.zero_grad()
        assert torch.equal(oa.last_grad_norm, ob.last_grad_norm)
    with materialized(a), materialized(b):
        assert_same(list(a.parameters()), list(b.parameters()))


@pytest.mark.parametrize("unscale_first", [False, True])
def test_a_grad_scaler_over_offloaded_grads_is_refused_and_the_state_failed(nvme, closing, unscale_first):
    """A GradScaler with overlap_backward over weights whose grads the parameter store holds: backward already
    updated on the scaled grads, so scaler.step raises the GradScaler StateError (before it would fail reading a
    placeholder with another error), or scaler.unscale_ the placeholder's RuntimeError; either way the optimizer
    then refuses to step until state is restored."""
    a, _, oa, _ = _offloaded_pair(nvme, closing)
    scaler = torch.amp.GradScaler("cpu", init_scale=4096.0)
    scaler.scale(loss_of(a, 0)).backward()
    if unscale_first:
        with pytest.raises(RuntimeError, match="offloaded to NVMe"):
            scaler.unscale_(oa)
    else:
        with pytest.raises(StateError, match="GradScaler cannot be used with overlap_backward"):
            scaler.step(oa)
    with pytest.raises(StateError, match="failed part-way"):
        oa.step()


def test_torch_clip_grad_norm_on_ordinary_grads_of_offloaded_weights_is_refused(nvme, closing):
    """offload_parameters(offload_grads=False) keeps ordinary grads, which torch's clip_grad_norm_ changes in
    place after an overlapped backward already updated on them: step() refuses (the change is seen) instead of
    going on silently."""
    torch.manual_seed(0)
    model = Net()
    closing(offload_parameters(model, nvme_path=nvme + "-p", offload_grads=False, **TINY))
    opt = closing(OffloadedAdamW(model.parameters(), nvme_path=nvme, overlap_backward=True, **OPT))
    loss_of(model, 0).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-4)
    with pytest.raises(StateError, match="changed between backward and step"):
        opt.step()


def test_parameters_without_a_grad_get_no_state_entry(nvme, closing):
    """With overlap_backward, a parameter that got no grad has no entry in state_dict(), as in torch (an entry
    with only a step count would not load into torch's Adam and step there)."""
    a, b = Tied(), Tied()
    for m in (a, b):
        m.twice.requires_grad_(True)
    ours = closing(OffloadedAdamW(a.parameters(), nvme_path=nvme, overlap_backward=True, **OPT))
    ref = torch.optim.AdamW(b.parameters(), lr=OPT["lr"])
    for m, o in ((a, ours), (b, ref)):
        x, _ = batch(0)
        m.embed(x).sum().backward()  # only the embedding gets a grad
        o.step()
    assert sorted(ours.state_dict()["state"]) == sorted(ref.state_dict()["state"])


class _Stack(torch.nn.Module):
    """Six Linear layers; ``interrupt`` raises KeyboardInterrupt in backward at the first layer's output,
    once ``ready()`` says so (as a Ctrl-C there would)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(6))
        self.interrupt = None

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if i == 0 and self.interrupt is not None:
                x.register_hook(self._raise)
        return x

    def _raise(self, grad):
        deadline = time.monotonic() + 10
        while not self.interrupt() and time.monotonic() < deadline:
            time.sleep(0.001)
        raise KeyboardInterrupt


def _iteration(model, opt, s):
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(s))
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _interrupted(model, opt, s, when):
    model.interrupt = when
    try:
        with pytest.raises(KeyboardInterrupt):
            _iteration(model, opt, s)
    finally:
        model.interrupt = None
    opt.zero_grad()
    assert not [t for t in threading.enumerate() if t.name == "offload-overlap"], "the step's worker outlived it"


def test_a_backward_interrupted_before_any_update_leaves_torchs_results(nvme, closing):
    """Ctrl-C in backward before the step it started updated anything (one unit, its grads not all final): after
    zero_grad() training goes on, bit for bit torch's AdamW over the iterations that completed."""
    a, b = _Stack(), _Stack()
    ours = closing(OffloadedAdamW(a.parameters(), nvme_path=nvme, overlap_backward=True,
                                  **{**OPT, "buffer_size": 1 << 20}))
    ref = torch.optim.AdamW(b.parameters(), lr=OPT["lr"], fused=True)
    for s in range(2):
        _iteration(a, ours, s)
    _interrupted(a, ours, 2, lambda: True)
    for s in range(2, 4):
        _iteration(a, ours, s)
    for s in range(4):
        _iteration(b, ref, s)
    assert_same(list(a.parameters()), list(b.parameters()))


def test_a_backward_interrupted_after_updates_began_fails_the_state_until_restored(nvme, closing, tmp_path):
    """Ctrl-C in backward once the step it started has rewritten some units: zero_grad() ends that step, the
    next step() raises a StateError saying what happened and what to do, and after load_checkpoint() training
    ends bit for bit where it would have without the interrupted iteration."""
    a, b = _Stack(), _Stack()
    ours = closing(OffloadedAdamW(a.parameters(), nvme_path=nvme, overlap_backward=True,
                                  **{**OPT, "small_param_threshold": 0}))
    ref = torch.optim.AdamW(b.parameters(), lr=OPT["lr"], fused=True)
    for s in range(2):
        _iteration(a, ours, s)
    ours.save_checkpoint(tmp_path / "ckpt", model=a)
    written = ours.io_bytes()[1]
    _interrupted(a, ours, 2, lambda: ours.io_bytes()[1] > written)  # an update was written
    with pytest.raises(StateError, match=r"a backward was interrupted.*zero_grad\(\) ended the update it had "
                                         r"started.*Restore it"):
        _iteration(a, ours, 2)
    ours.zero_grad()
    ours.load_checkpoint(tmp_path / "ckpt", model=a)
    for s in range(2, 4):
        _iteration(a, ours, s)
    for s in range(4):
        _iteration(b, ref, s)
    assert_same(list(a.parameters()), list(b.parameters()))


@pytest.mark.parametrize("weights_offloaded", [False, True], ids=["state", "state-and-weights"])
def test_an_optimizer_dropped_without_close_is_collected_with_its_swap_file(tmp_path, weights_offloaded):
    """The hooks overlap_backward puts on the parameters do not keep the optimizer alive: dropped without
    close(), it is collected, its swap file deleted, and no thread of it is left."""
    model = _Stack()
    if weights_offloaded:
        offload_parameters(model, nvme_path=str(tmp_path / "weights"), **TINY)
    os.makedirs(tmp_path / "state")
    opt = OffloadedAdamW(model.parameters(), nvme_path=str(tmp_path / "state"), overlap_backward=True, **OPT)
    _iteration(model, opt, 0)
    gone = weakref.ref(opt)
    del opt
    gc.collect()
    assert gone() is None and os.listdir(tmp_path / "state") == []
    assert not [t for t in threading.enumerate() if t.name == "offload-overlap"]
    model(torch.randn(2, 64)).sum().backward()  # the model goes on without it


def test_no_overlap_answers_every_call_the_optimizer_makes_on_its_overlap():
    """An optimizer without overlap_backward holds a NoOverlap and calls it as it calls a BackwardOverlap: every
    attribute the optimizer uses exists on both (one added to BackwardOverlap alone would fail only in the
    default configuration)."""
    import inspect
    import re

    from offload.adam import optimizer
    from offload.adam.overlap import BackwardOverlap, NoOverlap

    used = set(re.findall(r"self\._overlap\.(\w+)", inspect.getsource(optimizer)))
    assert {"refuse_while_running", "end_for_load", "finish"} <= used
    missing = {cls.__name__: sorted(n for n in used if not hasattr(cls, n)) for cls in (NoOverlap, BackwardOverlap)}
    assert missing == {"NoOverlap": [], "BackwardOverlap": []}


# -- overlap_backward="auto" ---------------------------------------------------------------------------------


def _auto_pair(nvme, closing, **opt_kw):
    """Two equal models with weights on NVMe: one optimizer with overlap_backward="auto", one without overlap."""
    torch.manual_seed(0)
    a, b = Net(), Net()
    b.load_state_dict(a.state_dict())
    for m, path in ((a, "-pa"), (b, "-pb")):
        closing(offload_parameters(m, nvme_path=nvme + path, **TINY))
    oa = closing(OffloadedAdamW(a.parameters(), nvme_path=nvme + "-a", overlap_backward="auto", **OPT, **opt_kw))
    ob = closing(OffloadedAdamW(b.parameters(), nvme_path=nvme + "-b", overlap_backward=False, **OPT, **opt_kw))
    return a, b, oa, ob


def test_auto_updates_inside_backward_after_two_clean_iterations_and_stays_bit_for_bit(nvme, closing):
    """With "auto", weights on NVMe are updated inside backward from the third iteration on: from then no
    gradient goes to NVMe, and the weights equal those of the optimizer that never overlaps, bit for bit."""
    a, b, oa, ob = _auto_pair(nvme, closing)
    grads_out = []
    for s in range(5):
        for m, o in ((a, oa), (b, ob)):
            before = _moved(m)
            loss_of(m, s).backward()
            o.step()
            o.zero_grad()
            if m is a:
                grads_out.append(_moved(m)[3] - before[3])
    assert oa._overlap.armed and not getattr(ob._overlap, "armed", False)
    assert grads_out[0] > 0 and grads_out[1] > 0 and grads_out[2:] == [0, 0, 0]
    with materialized(a), materialized(b):
        assert_same(list(a.parameters()), list(b.parameters()))


@pytest.mark.parametrize("loop", ["accumulation", "load_grad", "our clip", "lr set after backward", "closure",
                                  "no weights on NVMe", "max_grad_norm"])
def test_auto_never_updates_inside_backward_for_a_loop_where_it_would_not_be_exact(nvme, closing, loop):
    """A loop that accumulates, reads or clips offloaded grads, changes the lr between backward and step or
    steps with a closure, a model without weights on NVMe, or max_grad_norm: "auto" never arms, and trains
    bit for bit as without overlap."""
    if loop == "no weights on NVMe":
        torch.manual_seed(0)
        a, b = Net(), Net()
        b.load_state_dict(a.state_dict())
        oa = closing(OffloadedAdamW(a.parameters(), nvme_path=nvme + "-a", overlap_backward="auto", **OPT))
        ob = closing(OffloadedAdamW(b.parameters(), nvme_path=nvme + "-b", overlap_backward=False, **OPT))
    else:
        a, b, oa, ob = _auto_pair(nvme, closing, **({"max_grad_norm": 1.0} if loop == "max_grad_norm" else {}))
    from offload.params import clip_grad_norm_

    for s in range(5):
        for m, o in ((a, oa), (b, ob)):
            if loop == "closure":
                o.step(lambda m=m, s=s: loss_of(m, s).backward())
                o.zero_grad()
                continue
            loss_of(m, s).backward()
            if loop == "accumulation":
                loss_of(m, 100 + s).backward()
            elif loop == "load_grad":
                load_grad(next(iter(m.parameters())))
            elif loop == "our clip":
                clip_grad_norm_(m, 1e9)
            elif loop == "lr set after backward":
                o.param_groups[0]["lr"] = 1e-2 / (s + 1)
            o.step()
            o.zero_grad()
    assert not getattr(oa._overlap, "armed", False)
    with materialized(a), materialized(b):
        assert_same(list(a.parameters()), list(b.parameters()))


def test_once_armed_auto_refuses_accumulation_without_no_step_as_overlap_does(nvme, closing):
    """After "auto" has armed, a second backward before step() is refused with the StateError of
    overlap_backward=True, naming no_step() and saying that "auto" had armed: never a silently wrong update."""
    a, _, oa, _ = _auto_pair(nvme, closing)
    for s in range(3):
        loss_of(a, s).backward()
        oa.step()
        oa.zero_grad()
    assert oa._overlap.armed
    loss_of(a, 3).backward()
    with pytest.raises(StateError, match='no_step') as err:
        loss_of(a, 4).backward()
    assert '"auto" (updating inside backward since step 3)' in str(err.value)


def test_a_learning_rate_changed_between_backward_and_step_is_refused_when_updates_ran_inside(nvme, closing):
    """With overlap_backward=True the updates that ran during backward used the lr they had then: a change
    before step() is refused (state failed), never applied to part of the state only."""
    a, _, oa, _ = _offloaded_pair(nvme, closing)
    loss_of(a, 0).backward()
    oa.step()
    oa.zero_grad()
    loss_of(a, 1).backward()
    oa.param_groups[0]["lr"] = 0.5
    with pytest.raises(StateError, match="hyperparameters"):
        oa.step()
    with pytest.raises(StateError, match="cannot step"):
        oa.step()


def test_auto_never_updates_inside_backward_when_ordinary_grads_change_before_step(nvme, closing):
    """Weights on NVMe with ordinary grad tensors (offload_grads=False, as under DDP, whose all-reduce changes
    them after backward made them final): a loop that changes the grads before step() never arms "auto"."""
    torch.manual_seed(0)
    a, b = Net(), Net()
    b.load_state_dict(a.state_dict())
    for m, path in ((a, "-pa"), (b, "-pb")):
        closing(offload_parameters(m, nvme_path=nvme + path, offload_grads=False, **TINY))
    oa = closing(OffloadedAdamW(a.parameters(), nvme_path=nvme + "-a", overlap_backward="auto", **OPT))
    ob = closing(OffloadedAdamW(b.parameters(), nvme_path=nvme + "-b", overlap_backward=False, **OPT))
    for s in range(5):
        for m, o in ((a, oa), (b, ob)):
            loss_of(m, s).backward()
            for p in m.parameters():
                p.grad.mul_(0.5)  # what an all-reduce of two ranks' grads would do to equal ones
            o.step()
            o.zero_grad()
    assert not oa._overlap.armed
    with materialized(a), materialized(b):
        assert_same(list(a.parameters()), list(b.parameters()))


def _stack(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(64, 64, bias=False) for _ in range(8)])


def _state_moved_per_step(model, opt, steps, between=lambda s: None):
    """The optimizer's state bytes (read, written) in each of ``steps`` iterations (forward, backward, step);
    torch's: (0, 0)."""
    moved = getattr(opt, "io_bytes", lambda: (0, 0))
    out = []
    for s in steps:
        before = moved()
        x = torch.randn(4, 64, generator=torch.Generator().manual_seed(s))
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        after = moved()
        out.append((after[0] - before[0], after[1] - before[1]))
        between(s)
    return out


def _state_read_per_step(model, opt, steps, between=lambda s: None):
    """The optimizer's state bytes read in each of ``steps`` iterations; torch's: 0."""
    return [r for r, _ in _state_moved_per_step(model, opt, steps, between)]


@pytest.mark.parametrize("buffers", [3, 4, 6])
def test_overlap_moves_no_unit_the_pool_holds_for_backward_and_stays_torchs_adamw(nvme, closing, buffers):
    """Eight units of state (one Linear's each), updated inside backward in backward's order: every step after the
    first reads all but the units the pool set aside for it (the first ones backward finishes: all buffers but
    one, which streams the rest), where before it read every unit, and writes all but those too (the next step
    overwrites them); the plain step, in snake order, reads all but the whole pool and writes every unit.
    Counted in bytes, and the weights stay bit for bit torch's fused AdamW's."""
    unit = 64 * 64 * 8  # exp_avg and exp_avg_sq of one 64 x 64 fp32 weight: one unit, one 4096-aligned extent
    kw = dict(lr=1e-2, weight_decay=0.1, buffer_size=unit, buffer_count=buffers, small_param_threshold=64)
    over, plain, ref = _stack(), _stack(), _stack()
    oa = closing(OffloadedAdamW(over.parameters(), nvme_path=nvme + "-a", overlap_backward=True, **kw))
    ob = closing(OffloadedAdamW(plain.parameters(), nvme_path=nvme + "-b", **kw))
    assert len(oa.state_store.layout.units) == 8
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    moved = _state_moved_per_step(over, oa, range(5))
    streamed = (8 - (buffers - 1)) * unit
    assert moved == [(0, streamed)] + [(streamed, streamed)] * 4  # the first step has no state to read
    plain_moved = _state_moved_per_step(plain, ob, range(5))
    assert [w for _, w in plain_moved] == [8 * unit] * 5 and plain_moved[0][0] == 0
    # The snake order's hits depend on which pool buffer a read ahead finds idle first: one of them may go to a
    # unit not held (seen once in a loaded run with 6 buffers), never more.
    assert all((8 - buffers) * unit <= r <= (9 - buffers) * unit for r, _ in plain_moved[1:]), plain_moved
    _state_read_per_step(ref, torch_opt, range(5))
    assert_same(list(over.parameters()), list(ref.parameters()))
    assert_same(list(plain.parameters()), list(ref.parameters()))


def test_units_the_pool_holds_for_backward_survive_saves_and_loads_in_between(nvme, closing, tmp_path):
    """Between overlapped steps a state_dict() (every unit read through the pool), a checkpoint save and a
    load_state_dict() (units overwritten): the buffers set aside for the next backward hold what they should, or
    are let go, and the training stays bit for bit torch's AdamW's."""
    unit = 64 * 64 * 8
    kw = dict(lr=1e-2, buffer_size=unit, buffer_count=4, small_param_threshold=64)
    over, ref = _stack(1), _stack(1)
    oa = closing(OffloadedAdamW(over.parameters(), nvme_path=nvme, overlap_backward=True, **kw))
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)

    def between(s):
        if s == 1:
            oa.save_checkpoint(str(tmp_path / "ck"))
        if s == 2:
            oa.load_state_dict(oa.state_dict())

    reads = _state_read_per_step(over, oa, range(5), between)
    _state_read_per_step(ref, torch_opt, range(5))
    assert_same(list(over.parameters()), list(ref.parameters()))
    assert reads[4] == 5 * unit  # holding again after the load: all but the 3 units held


@pytest.mark.parametrize("snapshot", ["stream", "auto"])
def test_a_checkpoint_taken_while_the_pool_holds_units_unwritten_resumes_bit_for_bit(nvme, closing, tmp_path,
                                                                                      snapshot):
    """The units the pool holds for the next backward are not written back after their update; a checkpoint
    saved then (streamed, or cloned from the swap file where it can be) holds their latest bytes: a model and
    optimizer loaded from it train on bit for bit as torch's AdamW does without a break, and so does the run
    that saved it."""
    unit = 64 * 64 * 8
    kw = dict(lr=1e-2, buffer_size=unit, buffer_count=5, small_param_threshold=64, overlap_backward=True)
    a, b, ref = _stack(2), _stack(3), _stack(2)
    oa = closing(OffloadedAdamW(a.parameters(), nvme_path=nvme + "-a", **kw))
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    _state_moved_per_step(a, oa, range(2))
    assert oa.state_store.moves._unwritten  # what this test is about: units whose extent is older
    oa.save_checkpoint(str(tmp_path / "ck"), model=a, snapshot=snapshot)
    ob = closing(OffloadedAdamW(b.parameters(), nvme_path=nvme + "-b", **kw))
    ob.load_checkpoint(str(tmp_path / "ck"), model=b)
    for model, opt, steps in ((a, oa, range(2, 5)), (b, ob, range(2, 5)), (ref, torch_opt, range(5))):
        _state_moved_per_step(model, opt, steps)
    assert_same(list(b.parameters()), list(ref.parameters()))
    assert_same(list(a.parameters()), list(ref.parameters()))


def test_a_pass_left_by_break_carries_out_the_fate_of_the_unit_in_it(nvme, closing):
    """A loop over units left by break: the unit in the body still meets its fate, so an export that stops
    early writes nothing, and a changing pass that went past a unit without saying so is refused."""
    unit = 64 * 64 * 8
    over = _stack(4)
    oa = closing(OffloadedAdamW(over.parameters(), nvme_path=nvme, buffer_size=unit, buffer_count=4,
                                small_param_threshold=64))
    _state_moved_per_step(over, oa, range(2))
    store = oa.state_store
    store.drain()
    written = store.bytes_written
    with store.moves.export(store.layout.units) as units_in:
        for _unit, _buf in units_in:
            break
    assert store.bytes_written == written
    with pytest.raises(RuntimeError, match="without changing"), store.moves.step(store.layout.units) as units_in:
        for _unit, _buf in units_in:
            pass


def test_a_step_stopped_in_a_unit_held_unwritten_fails_the_state(nvme, closing):
    """A unit the pool held unwritten has its only current copy in that buffer: a step stopped after it began to
    change it leaves the state failed (steps refused until a load), never the extent's older bytes used."""
    unit = 64 * 64 * 8
    over = _stack(5)
    oa = closing(OffloadedAdamW(over.parameters(), nvme_path=nvme, buffer_size=unit, buffer_count=4,
                                small_param_threshold=64, overlap_backward=True))
    _state_moved_per_step(over, oa, range(2))
    store = oa.state_store
    first = next(u for u in store.layout.units if not store.moves.written_back(u))
    with pytest.raises(RuntimeError, match="stopped"), store.moves.step([first], keep_first=True) as units_in:
        for unit, buf in units_in:
            units_in.changing(unit, buf)
            raise RuntimeError("stopped")
    with pytest.raises(StateError):
        _state_moved_per_step(over, oa, [2])
