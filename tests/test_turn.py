"""The turn from forward into backward: the weights forward used last stay resident for backward, which then does
not read them again; training is unchanged, bit for bit."""

from __future__ import annotations

import pytest
import torch
from helpers import TINY, assert_same

from offload import OffloadedAdamW, materialized, offload_parameters
from offload.params import offloaded
from offload.params.hooks import Scheduler
from offload.params.turn import Turn
from offload.sizes import round_up

WIDTH, LAYERS = 32, 16  # 16 modules of 4 KiB each; the parameter pool holds 24 KiB (TINY)
OPT = dict(lr=1e-2, buffer_size=64 * 1024, buffer_count=3, small_param_threshold=16)
LAYER = round_up(WIDTH * WIDTH * 4, 4096)  # one module's weights, as stored


def _stack():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])


def _x(step):
    return torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(step))


def _train(model, opt, steps) -> list:
    """Per iteration: weights read from NVMe in forward and in backward, the most resident in forward and in
    backward, the kept holds backward took, and the prefetches dropped (each read again: their buffer was needed
    first, by a gradient's or an update's write, which depends on timing where the update runs beside backward)."""
    store = offloaded(model).store
    turn = offloaded(model).scheduler.turn
    out = []
    for s in steps:
        at, taken, dropped = store.bytes_read, turn.taken, store.prefetches_dropped
        store.reset_peak()
        loss = model(_x(s)).pow(2).mean()
        fwd, fwd_peak = store.bytes_read - at, store.resident_bytes_max
        store.reset_peak()
        loss.backward()
        out.append((fwd, store.bytes_read - at - fwd, fwd_peak, store.resident_bytes_max, turn.taken - taken,
                    store.prefetches_dropped - dropped))
        opt.step()
        opt.zero_grad()
    return out


@pytest.mark.parametrize("overlap", [False, True], ids=["step-after-backward", "overlap_backward"])
def test_backward_reads_the_last_modules_forward_ran_no_more_and_trains_alike(nvme, closing, monkeypatch, overlap):
    """From the second iteration on (once the order of fetches is recorded), backward does not read again the
    weights of the last modules forward ran, as many as the parameter pool's bytes hold (it takes them resident):
    each iteration reads that many modules' weights less than the same model where forward releases them, all of
    it in backward; the weights resident at once stay within the pool's bytes more than without (the kept ones and
    the module in use), and the weights end bit for bit as without offload_parameters."""
    kept, released, plain = _stack(), _stack(), _stack()
    for m, path in ((kept, "-k"), (released, "-r")):
        closing(offload_parameters(m, nvme_path=nvme + path, **TINY))
    ok = closing(OffloadedAdamW(kept.parameters(), nvme_path=nvme + "-ok", overlap_backward=overlap, **OPT))
    op = closing(OffloadedAdamW(plain.parameters(), nvme_path=nvme + "-op", overlap_backward=overlap, **OPT))
    orr = closing(OffloadedAdamW(released.parameters(), nvme_path=nvme + "-or", overlap_backward=overlap, **OPT))
    pool = offloaded(kept).store.pool.nbytes
    room = pool // LAYER  # the modules the pool's bytes hold
    assert 2 <= room < LAYERS
    with_turn = _train(kept, ok, range(4))
    for s in range(4):
        plain(_x(s)).pow(2).mean().backward()
        op.step()
        op.zero_grad()
    monkeypatch.setattr(Scheduler, "_keeps_for_backward", lambda self, pos: {})  # forward releases everything
    without = _train(released, orr, range(4))
    assert with_turn[0][4] == 0 and with_turn[0][0] == without[0][0]  # the first records the order: none kept
    for (fk, bk, fpk, bpk, taken, dk), (fr, br, fpr, bpr, none, dr) in zip(with_turn[1:], without[1:]):
        assert taken == room and none == 0
        # Every module read in forward and in backward, less those kept, plus the prefetches read again.
        assert fk + bk == (2 * LAYERS - room + dk) * LAYER and fr + br == (2 * LAYERS + dr) * LAYER
        assert bk <= (LAYERS - room + dk) * LAYER < br  # the reads saved are backward's
        assert fpr == LAYER and room * LAYER <= fpk <= pool + LAYER  # the kept ones, resident together
        if not overlap:  # (with it, the weights waiting for their update depend on its timing)
            assert bpr == LAYER and room * LAYER <= bpk <= pool + LAYER
    with materialized(kept), materialized(released):
        assert_same(list(kept.parameters()), list(plain.parameters()))
        assert_same(list(kept.parameters()), list(released.parameters()))
    assert offloaded(kept).store.resident_bytes == 0  # nothing stays once backward and the step are done


def test_weights_kept_for_a_backward_that_never_comes_are_released_and_none_under_no_grad(nvme, closing):
    """A forward whose backward never runs (a skipped iteration) leaves the last modules' weights kept until the
    next forward, which releases them; a forward under no_grad (or in eval) keeps nothing."""
    model = _stack()
    closing(offload_parameters(model, nvme_path=nvme, **TINY))
    store = offloaded(model).store
    opt = closing(OffloadedAdamW(model.parameters(), nvme_path=nvme + "-o", **OPT))
    _train(model, opt, range(2))
    model(_x(5)).pow(2).mean()  # no backward
    assert store.resident_bytes == store.pool.nbytes // LAYER * LAYER  # the last modules' weights, kept
    with torch.no_grad():
        model.eval()(_x(6))
    assert store.resident_bytes == 0
    model.train()
    _train(model, opt, range(2, 4))
    assert store.resident_bytes == 0
    model.eval()(_x(7))  # a validation pass with grad enabled, the order followed: nothing kept either
    assert store.resident_bytes == 0


def test_a_backward_that_raises_leaves_nothing_kept_or_held_after_the_next_forward(nvme, closing):
    """A backward that raises half-way (autograd then runs no callback of ours) leaves kept and held weights
    resident; the next forward releases them all (none under no_grad after it), and training goes on, the turn
    keeping again once the order of fetches is recorded again."""
    model = _stack()
    closing(offload_parameters(model, nvme_path=nvme, **TINY))
    store = offloaded(model).store
    turn = offloaded(model).scheduler.turn
    opt = closing(OffloadedAdamW(model.parameters(), nvme_path=nvme + "-o", **OPT))
    _train(model, opt, range(2))

    def boom(grad):
        raise ValueError("boom")

    hook = model[LAYERS - 3].register_forward_hook(lambda m, args, out: out.register_hook(boom) and None)
    taken = turn.taken
    with pytest.raises(ValueError, match="boom"):
        model(_x(7)).pow(2).mean().backward()
    hook.remove()
    assert turn.taken > taken and store.resident_bytes > 0  # kept ones taken, others kept still
    opt.zero_grad()
    with torch.no_grad():
        model(_x(8))
    assert store.resident_bytes == 0 and all(store.users(p) == 0 for p in store.records)
    assert _train(model, opt, range(2, 4))[-1][4] == store.pool.nbytes // LAYER  # the order recorded again
    assert store.resident_bytes == 0


def test_kept_weights_stay_within_the_pool_bytes_whatever_the_plan_keeps(nvme, closing, monkeypatch):
    """Where the run keeps more than the recorded order foresaw (here every forward keeps: an order that changed,
    a parent module keeping after its children), the oldest kept are released as newer ones come: the kept bytes
    never exceed the parameter pool's, nor the resident ones the pool's plus the module in use, backward still
    takes the last ones, and the weights end bit for bit as without offload_parameters."""
    monkeypatch.setattr(Turn, "plan", lambda self, order, params: {pos: dict.fromkeys(params[i]) for pos, (i, _) in
                                                                   enumerate(order)})
    model, plain = _stack(), _stack()
    closing(offload_parameters(model, nvme_path=nvme, **TINY))
    store = offloaded(model).store
    opt = closing(OffloadedAdamW(model.parameters(), nvme_path=nvme + "-o", **OPT))
    op = closing(OffloadedAdamW(plain.parameters(), nvme_path=nvme + "-p", **OPT))
    most = []
    monkeypatch.setattr(Turn, "take", lambda self, p, take=Turn.take: most.append(self.held_bytes) or take(self, p))
    rows = _train(model, opt, range(3))
    for s in range(3):
        plain(_x(s)).pow(2).mean().backward()
        op.step()
        op.zero_grad()
    room = store.pool.nbytes // LAYER
    assert [r[4] for r in rows] == [0, room, room] and max(most) == room * LAYER
    assert all(room * LAYER <= r[2] <= store.pool.nbytes + LAYER for r in rows[1:])
    with materialized(model):
        assert_same(list(model.parameters()), list(plain.parameters()))
    assert store.resident_bytes == 0


def test_keep_for_backward_false_keeps_nothing_and_resident_weights_stay_two_modules(nvme, closing):
    """offload_parameters(keep_for_backward=False): backward reads every module again (no kept hold taken), the
    weights resident at once stay within two modules' (the one running and the one before), and a value that is
    not a bool is refused before anything is offloaded."""
    model = _stack()
    with pytest.raises(TypeError, match="keep_for_backward must be True or False"):
        offload_parameters(model, nvme_path=nvme, keep_for_backward="no", **TINY)
    closing(offload_parameters(model, nvme_path=nvme, keep_for_backward=False, **TINY))
    # The update in step(): inside backward, weights also wait resident for their update (the hand-off).
    opt = closing(OffloadedAdamW(model.parameters(), nvme_path=nvme + "-o", overlap_backward=False, **OPT))
    rows = _train(model, opt, range(4))
    assert offloaded(model).scheduler.turn.taken == 0
    assert all(fwd_peak <= 2 * LAYER and bwd_peak <= 2 * LAYER for _, _, fwd_peak, bwd_peak, _, _ in rows[1:]), rows
    # Every module read in forward and again in backward (forward may prefetch backward's first).
    assert all(fwd + bwd >= 2 * LAYERS * LAYER for fwd, bwd, *_ in rows[1:]), rows
