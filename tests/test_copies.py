"""Host<->device copies and their ordering, on a CPU: the emulator of asynchronous copies
(``offload.copies.emulated``) sends CPU tensors down the path device tensors take, performs every copy late on
a thread, and reports a broken ordering rule. Every GPU code path trains bit for bit as without it, and each
ordering rule has a test that fails when the rule is broken."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch
from helpers import assert_same
from torch import nn

from offload import OffloadedAdamW, copies, offload_parameters, restore_parameters
from offload.params import materialized, store_of

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


def train(tmp_path, name: str, *, steps: int = 3, dtype=torch.float32, offload=None, prepare=None, hook=None,
          ckpt: bool = False, micro: int = 1, **options):
    """Weights and state after ``steps`` iterations of a small model (``offload``: offload_parameters'
    arguments; ``prepare(model)``: called first; ``hook(model, step)``: a context for each backward;
    ``ckpt``: save after the first step, load it back after the second, and train on; ``micro``: backward
    passes accumulated per step)."""
    model = Model(dtype)
    if prepare is not None:
        prepare(model)
    if offload is not None:
        offload_parameters(model, nvme_path=str(tmp_path / f"{name}-w"), **offload)
    opt = OffloadedAdamW(model.parameters(), nvme_path=str(tmp_path / name), **{**OPT, **options})
    try:
        for step in range(steps):
            for m in range(micro):
                loss = model(batch(step * micro + m)).float().square().mean()
                with hook(model, step) if hook is not None else contextlib.nullcontext():
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
    with copies.emulated(delay=0.3) as emu:
        src, dst = torch.ones(4), torch.zeros(4)
        ticket = copies.to_host(dst, src)
        seen_poison = False
        while not ticket.done():  # watched until it lands, however late the copy's thread starts
            seen_poison = seen_poison or bool(torch.isnan(dst).all())
            time.sleep(0.001)
        assert seen_poison, "the destination never showed the copy in flight"
        assert torch.equal(dst, src)
        emu.check()


def test_copies_to_and_from_a_device_run_on_two_streams():
    """A copy to the device does not queue behind a copy back (two copy streams per device): with a slow
    copy back in flight, the next copy to the device completes first."""
    with copies.emulated(delay=0.002) as emu:
        emu.delay = 0.5
        back = copies.to_host(torch.zeros(4), torch.ones(4))
        emu.delay = 0.002
        _, there = copies.to_device(torch.ones(4), torch.ones(4))
        there.wait()
        assert not back.done()
        back.wait()
        emu.check()


def test_copies_go_on_the_streams_of_the_tensors_device_not_the_current_one(tmp_path):
    """Parameters on (emulated) device 1 while the current device is 0, as in the overlap worker's thread:
    every copy and completion is on device 1's streams, and the step equals the same run without emulation."""
    want = train(tmp_path, "plain")
    with copies.emulated(delay=0.002) as emu:
        got = train(tmp_path, "placed", prepare=lambda model: emu.place(model.parameters(), 1))
        emu.check()
        kinds = {kind for kind, _ in emu.log}
        assert {"h2d", "d2h"} <= kinds
        assert {dev for kind, dev in emu.log if kind in ("h2d", "d2h")} == {1}
    assert_same(got[0], want[0])
    assert_same(got[1], want[1])


# -- every GPU code path, on the CPU, bit for bit as without the emulator ------------------------

PATHS = [
    pytest.param({}, id="pool"),
    pytest.param(dict(buffer_count=8), id="pool-as-cache"),
    pytest.param(dict(host_cache=2 * 16384), id="host-cache"),
    pytest.param(dict(device="cpu"), id="device-cpu"),
    pytest.param(dict(overlap_backward=True), id="overlap"),
    pytest.param(dict(max_grad_norm=0.5), id="clipping"),
    pytest.param(dict(dtype=torch.bfloat16), id="bf16-masters"),
    pytest.param(dict(state_dtype="bf16", dtype=torch.bfloat16), id="bf16-state"),
    pytest.param(dict(offload=dict(max_in_cpu=0, max_grad_in_cpu=0, buffer_size=1024)), id="weights-grads-nvme"),
    pytest.param(dict(offload=dict(max_in_cpu=0, max_grad_in_cpu=10**6, buffer_size=1024)), id="grads-in-host"),
    pytest.param(dict(offload=dict(max_in_cpu=10**6, max_grad_in_cpu=0, buffer_size=1024)), id="weights-in-host"),
    pytest.param(dict(micro=2, max_grad_norm=0.5, offload=dict(max_in_cpu=0, max_grad_in_cpu=0, buffer_size=1024)),
                 id="accumulated-clipped-grads-nvme"),
    pytest.param(dict(micro=2, max_grad_norm=0.5, offload=dict(max_in_cpu=0, max_grad_in_cpu=10**6, buffer_size=1024)),
                 id="accumulated-clipped-grads-in-host"),
    pytest.param(dict(offload=dict(max_in_cpu=0, max_grad_in_cpu=0, buffer_size=1024), overlap_backward=True),
                 id="weights-nvme-overlap"),
    pytest.param(dict(device="cpu", offload=dict(max_in_cpu=0, max_grad_in_cpu=0, buffer_size=1024)),
                 id="device-cpu-weights-nvme"),
    pytest.param(dict(ckpt=True, host_cache=16384), id="checkpoint"),
    pytest.param(dict(ckpt=True, offload=dict(max_in_cpu=0, max_grad_in_cpu=0, buffer_size=1024)),
                 id="checkpoint-weights-nvme"),
    # Weights and grads all in host memory: the parameter store has no pool; a checkpoint makes its own buffers.
    pytest.param(dict(ckpt=True, offload=dict(max_in_cpu=10**6, max_grad_in_cpu=10**6)),
                 id="checkpoint-weights-in-host-no-pool"),
]


@pytest.mark.parametrize("options", PATHS)
def test_every_device_path_trains_bit_for_bit_through_the_emulator(tmp_path, options):
    """Through the emulator (copies performed late, ordering checked) a path trains to the same bits as the
    same run without it (which equals torch's AdamW: the rest of the suite); no ordering rule is broken."""
    want = train(tmp_path, "plain", **options)
    with copies.emulated(delay=0.002) as emu:
        got = train(tmp_path, "emulated", **options)
        emu.check()
        assert any(kind == "d2h" for kind, _ in emu.log)
    assert_same(got[0], want[0])
    assert_same(got[1], want[1])


def test_fp32_training_through_the_emulator_equals_torch_adamw(tmp_path, copy_emulator):
    """The emulated device path against torch's fused AdamW itself."""
    got = train(tmp_path, "emulated")
    model = Model()
    ref = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    for step in range(3):
        model(batch(step)).square().mean().backward()
        ref.step()
        ref.zero_grad()
    assert_same(got[0], [p.detach() for p in model.parameters()])


# -- each ordering rule, with a test that fails when it is broken ---------------------------------


def test_a_grad_buffer_is_refilled_only_after_the_copy_reading_it_completed(tmp_path):
    """Offloaded grads are read from NVMe into one buffer per pass and copied to the device per unit. With
    the state resident (``device: "cpu"``: no unit is written, so nothing else waits for the copies), the
    next unit's grads must not land in the buffer while the last unit's copy to the device still reads it."""
    options = dict(device="cpu", offload=dict(max_in_cpu=0, max_grad_in_cpu=0, buffer_size=1024), steps=2)
    want = train(tmp_path, "plain", **options)
    with copies.emulated(delay=0.03) as emu:
        got = train(tmp_path, "emulated", **options)
        emu.check()
    assert_same(got[0], want[0])
    assert_same(got[1], want[1])


def test_the_overlapped_update_waits_for_the_stream_that_produced_the_grads(tmp_path):
    """Backward on a side stream whose kernels finish late: the update that backward starts on the worker
    thread (which runs on other streams) must wait for that stream before it reads the grads (here the
    grads of weights on NVMe that the update takes as backward leaves them)."""
    options = dict(overlap_backward=True, offload=dict(max_in_cpu=0, max_grad_in_cpu=0, buffer_size=1024))
    want = train(tmp_path, "plain", **options)
    with copies.emulated(delay=0.002) as emu:
        side = emu.new_stream()

        def late_grads(p):
            # The grad's last kernel is still queued on the side stream: its values arrive late.
            true = p.grad.detach().clone()
            p.grad.detach().zero_()
            grad = p.grad
            emu.later(lambda: grad.detach().copy_(true), delay=0.03)

        def prepare(model):
            for p in model.parameters():  # before offload_parameters and the optimizer: runs first
                p.register_post_accumulate_grad_hook(late_grads)

        got = train(tmp_path, "emulated", prepare=prepare, hook=lambda model, step: emu.stream(side), **options)
        emu.check()
    assert_same(got[0], want[0])
    assert_same(got[1], want[1])


def test_a_failed_update_leaves_no_copy_in_flight_into_the_buffer_it_hands_back(tmp_path, monkeypatch):
    """Two groups share a unit; the update fails on the second after the first group's state went back to the
    host: by the time the error reaches the caller (and the pipeline has handed the buffer back), no copy
    into or out of it is in flight."""
    import offload.adam.update as update

    model = Model()
    groups = [{"params": [model.a.bias]}, {"params": [model.c.bias]}]
    with copies.emulated(delay=0.05) as emu:
        opt = OffloadedAdamW(groups, nvme_path=str(tmp_path / "s"), **OPT)
        try:
            model(batch(0)).square().mean().backward()
            calls = []
            real = update.GradScaling.apply

            def failing(self, grad):
                calls.append(1)
                if len(calls) == 2:
                    raise RuntimeError("kernel failed")
                return real(self, grad)

            monkeypatch.setattr(update.GradScaling, "apply", failing)
            with pytest.raises(RuntimeError, match="kernel failed"):
                opt.step()
            assert len(calls) == 2
            assert emu.pending() == 0
        finally:
            opt.close()
        emu.check()


def test_device_grads_kept_in_host_memory_land_late_in_one_page_aligned_block(tmp_path):
    """Gradients of device weights kept in host memory (``max_grad_in_cpu``) go there by an asynchronous copy
    (backward's thread does not wait for it) into one page-aligned block, not torch's pinned allocator, which
    rounds each up to a power of two; whoever reads them waits for the copy (the training equals the run
    without the emulator)."""
    options = dict(offload=dict(max_in_cpu=0, max_grad_in_cpu=10**6, buffer_size=1024))
    want = train(tmp_path, "plain", steps=2, **options)
    with copies.emulated(delay=0.1) as emu:
        model = Model()
        offload_parameters(model, nvme_path=str(tmp_path / "w"), **options["offload"])
        try:
            store = store_of(model.a.weight)
            model(batch(0)).square().mean().backward()
            block = store.grads._block
            assert block is not None and block.address % 4096 == 0
            kept = [g.host for g in store.grads.grads.values() if g.host is not None]
            assert len(kept) == 6
            for t in kept:
                assert block.address <= t.data_ptr() < block.address + block.nbytes
            assert emu.pending() > 0  # backward returned with the copies in flight
        finally:
            restore_parameters(model)
        got = train(tmp_path, "emulated", steps=2, **options)
        emu.check()
    assert_same(got[0], want[0])
    assert_same(got[1], want[1])


def test_with_state_in_host_memory_the_next_units_copy_goes_out_while_the_last_comes_back(tmp_path):
    """``device: "cpu"``: nothing waits for a unit's state to come back before the next unit's state goes to
    the device (the two directions have a stream each), so the copies of a step overlap; they are all back
    when the step returns."""
    with copies.emulated(delay=0.1) as emu:
        got = train(tmp_path, "emulated", steps=1, device="cpu")
        emu.check()
        assert emu.overlapped > 0
    want = train(tmp_path, "plain", steps=1, device="cpu")
    assert_same(got[0], want[0])
    assert_same(got[1], want[1])  # the state that came back late is the state, bit for bit


def test_the_overlapped_update_does_not_queue_behind_backward_on_the_default_stream(tmp_path):
    """The worker's copies and updates run on a stream of its own: on the default stream, which every thread
    shares, each would wait for all the work issued there so far (on a GPU the host runs far ahead), so
    nothing would overlap. Here backward runs on a side stream while the default stream holds work that
    finishes only once one of the worker's copies back to the host has completed (or after 1 s): from the
    second step on (the first updates late, once step() opens every gate, after the caller's work), the
    worker must not wait for it."""
    import threading

    options = dict(overlap_backward=True, steps=4)
    want = train(tmp_path, "plain", **options)
    with copies.emulated(delay=0.002) as emu:
        side = emu.new_stream()
        worker_copies, waited = [], []
        d2h = emu.d2h

        def recorded_d2h(dst, src, device):
            ticket = d2h(dst, src, device)
            if threading.current_thread().name == "offload-overlap":
                worker_copies.append(ticket)
            return ticket

        emu.d2h = recorded_d2h

        def until_a_worker_copy_completed():
            deadline = time.monotonic() + 1
            while not any(t.done() for t in list(worker_copies)) and time.monotonic() < deadline:
                time.sleep(0.005)
            waited.append(any(t.done() for t in list(worker_copies)))

        @contextlib.contextmanager
        def backward_on_a_side_stream(model, step):
            worker_copies.clear()
            emu.later(until_a_worker_copy_completed, delay=0)  # on the default stream, from this thread
            with emu.stream(side):
                yield

        got = train(tmp_path, "emulated", hook=backward_on_a_side_stream, **options)
        emu.check()
    assert len(waited) == 4 and all(waited[1:]), \
        f"the overlapped update waited for other work on the default stream ({waited})"
    assert_same(got[0], want[0])
    assert_same(got[1], want[1])
