"""The turn from forward into backward: the weights forward used last stay resident for backward, which then does
not read them again; training is unchanged, bit for bit."""

from __future__ import annotations

import pytest
import torch
from helpers import TINY, assert_same

from offload import OffloadedAdamW, materialized, offload_parameters
from offload.params import offloaded
from offload.params.hooks import Scheduler
from offload.sizes import round_up

WIDTH, LAYERS = 32, 6
OPT = dict(lr=1e-2, buffer_size=64 * 1024, buffer_count=3, small_param_threshold=16)


def _stack():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])


def _x(step):
    return torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(step))


def _train(model, opt, steps) -> list:
    """Per iteration: weights read from NVMe in forward and in backward, and the most resident in backward."""
    store = offloaded(model).store
    out = []
    for s in steps:
        at = store.bytes_read
        loss = model(_x(s)).pow(2).mean()
        fwd = store.bytes_read - at
        store.reset_peak()
        loss.backward()
        out.append((fwd, store.bytes_read - at - fwd, store.resident_bytes_max))
        opt.step()
        opt.zero_grad()
    return out


@pytest.mark.parametrize("overlap", [False, True], ids=["step-after-backward", "overlap_backward"])
def test_backward_reads_the_last_module_forward_ran_no_more_and_trains_alike(nvme, closing, monkeypatch, overlap):
    """From the second iteration on (once the order of fetches is recorded), backward does not read again the
    weights of the module forward ran last (it takes them resident): it reads one module's weights less than the
    same model where forward releases them, forward the same; backward holds no more weights at once than without
    (the kept ones are released once their gradient is final), and the weights end bit for bit alike."""
    kept, released = _stack(), _stack()
    for m, path in ((kept, "-k"), (released, "-r")):
        closing(offload_parameters(m, nvme_path=nvme + path, **TINY))
    ok = closing(OffloadedAdamW(kept.parameters(), nvme_path=nvme + "-ok", overlap_backward=overlap, **OPT))
    orr = closing(OffloadedAdamW(released.parameters(), nvme_path=nvme + "-or", overlap_backward=overlap, **OPT))
    with_turn = _train(kept, ok, range(4))
    monkeypatch.setattr(Scheduler, "_backward_next", lambda self, index: False)  # forward releases everything
    without = _train(released, orr, range(4))
    layer = round_up(WIDTH * WIDTH * 4, 4096)  # one module's weights, as stored
    assert with_turn[0] == without[0]  # the first iteration records the order: nothing kept yet
    for (fk, bk, peak_k), (fr, br, peak_r) in zip(with_turn[1:], without[1:]):
        assert fk == fr and bk == br - layer and peak_k == peak_r
    with materialized(kept), materialized(released):
        assert_same(list(kept.parameters()), list(released.parameters()))
    assert offloaded(kept).store.resident_bytes == 0  # nothing stays once backward and the step are done


def test_weights_kept_for_a_backward_that_never_comes_are_released_and_none_under_no_grad(nvme, closing):
    """A forward whose backward never runs (a skipped iteration) leaves the last module's weights kept until the
    next forward, which releases them; a forward under no_grad keeps nothing."""
    model = _stack()
    closing(offload_parameters(model, nvme_path=nvme, **TINY))
    store = offloaded(model).store
    opt = closing(OffloadedAdamW(model.parameters(), nvme_path=nvme + "-o", **OPT))
    _train(model, opt, range(2))
    model(_x(5)).pow(2).mean()  # no backward
    assert store.resident_bytes == WIDTH * WIDTH * 4  # the last module's weights, kept
    with torch.no_grad():
        model(_x(6))
    assert store.resident_bytes == 0
    _train(model, opt, range(2, 4))
    assert store.resident_bytes == 0
