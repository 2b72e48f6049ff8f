"""Ctrl-C at any moment: a SIGINT sent at random offsets into a step, a backward (weights on NVMe, updates
during backward), a save, a load or close(), and an exception raised at every line of an asynchronous save's
change guard, leave a state from which the next step or a load works and close() returns; no thread of ours
outlives close() or the optimizer's collection."""

from __future__ import annotations

import contextlib
import gc
import linecache
import os
import random
import signal
import sys
import threading
import time
import weakref

import pytest
import torch
from helpers import assert_same_state

from offload import OffloadedAdamW, StateError, offload_parameters
from offload import checkpoint as ckpt
from offload.checkpoint import snapshot

# Trials of each Ctrl-C test at least, and shots that must land inside the work (more trials where they do not).
TRIALS, LANDED = 15, 5
KW = dict(buffer_size=64 * 1024, buffer_count=3, small_param_threshold=64, lr=1e-2)
HIDDEN = 128


def model_of(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(6)])


def backward(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(4, HIDDEN, generator=g)).square().mean().backward()


def iteration(model, opt, seed: int) -> None:
    backward(model, seed)
    opt.step()
    opt.zero_grad()


def ours() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("offload")]


def ctrl_c(delays: list[float], work) -> bool:
    """Run ``work()`` with SIGINT delivered to this (the main) thread at each of ``delays`` seconds from now, as
    Ctrl-C delivers it, only while it runs (before and after, SIGINT is ignored, so a late one cannot hit the
    test's own code). Returns whether a KeyboardInterrupt ended it."""
    main = threading.main_thread().ident
    start = time.perf_counter()
    stop = threading.Event()

    def shoot():
        for d in sorted(delays):
            if stop.wait(max(0.0, d - (time.perf_counter() - start))):
                return
            signal.pthread_kill(main, signal.SIGINT)

    # Ctrl-C's KeyboardInterrupt, raised once at most and only while armed. Everything from arming to disarming
    # sits inside one try of this frame (no context manager's exit in between): a shot landing as work() returns,
    # or in its except or finally clause, is caught here, never a KeyboardInterrupt of the whole run.
    armed = [True]

    def interrupt(signum, frame):
        if armed[0]:
            armed[0] = False
            raise KeyboardInterrupt

    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    shooter = threading.Thread(target=shoot)
    shooter.start()
    interrupted = False
    try:
        try:
            signal.signal(signal.SIGINT, interrupt)
            work()
        finally:
            armed[0] = False
    except KeyboardInterrupt:
        interrupted = True
    finally:
        armed[0] = False
        stop.set()
        shooter.join()
        signal.signal(signal.SIGINT, before)
    return interrupted


def timed(work) -> float:
    t = time.perf_counter()
    work()
    return time.perf_counter() - t


def shots(rng, length: float, n: int) -> list:
    """Every third trial two Ctrl-Cs, else one, at random offsets within ``length`` (and a little after)."""
    return [rng.uniform(0, 1.2 * length) for _ in range(2 if n % 3 == 0 else 1)]


def recover(model, opt, saved, seed: int) -> bool:
    """The next iteration, after a load of ``saved`` where it says the state must be restored; True if it did."""
    opt.zero_grad()
    try:
        iteration(model, opt, seed)
        return False
    except StateError as err:
        assert "load_checkpoint" in str(err) or "load_state_dict" in str(err), err
    opt.zero_grad()
    ckpt.load_checkpoint(opt, saved, model=model)
    iteration(model, opt, seed)
    return True


def steps_of(opt, p) -> int:
    """The steps ``opt`` has taken for ``p`` (0 before its first)."""
    return int(opt.state[p]["step"]) if "step" in opt.state.get(p, {}) else 0


def test_one_ctrl_c_in_a_step_finishes_it_and_the_state_is_torchs(tmp_path):
    """A single SIGINT at a random moment of step() lets the step finish, then raises KeyboardInterrupt (one that
    lands before the step began, in torch's wrappers, leaves it not run, and it is run again): over 15 or more
    such steps (until five were cut) the state equals, bit for bit, the same optimizer's stepped without
    interruption."""
    rng = random.Random(1)
    params = [torch.nn.Parameter(torch.randn(n, generator=torch.Generator().manual_seed(n))) for n in
              (10, 5000, 70_000)]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    mine = OffloadedAdamW(params, nvme_path=str(tmp_path / "a"), **KW)
    ref = OffloadedAdamW(twins, nvme_path=str(tmp_path / "b"), **KW)
    try:
        interrupted = 0
        for k in range(90):  # 15 steps, more where too few shots landed inside one (a loaded machine)
            if k >= TRIALS and interrupted >= LANDED:
                break
            for ps in (params, twins):
                g = torch.Generator().manual_seed(k)
                for p in ps:
                    p.grad = torch.randn(p.shape, generator=g)
            length = timed(ref.step)
            seen = ctrl_c([rng.uniform(0, length)], mine.step)
            interrupted += bool(seen)
            if seen and steps_of(mine, params[0]) == k:  # it came before the step began (torch's wrappers): none ran
                mine.step()
            assert steps_of(mine, params[0]) == k + 1
        assert interrupted >= LANDED
        assert_same_state(mine.state_dict(), ref.state_dict())
    finally:
        mine.close()
        ref.close()


@pytest.mark.parametrize("what", ["step", "backward", "save", "load"])
def test_ctrl_c_at_random_moments_leaves_state_that_a_step_or_a_load_takes_up(tmp_path, what):
    """SIGINTs at random offsets into a step, a backward (weights on NVMe, updates during backward), a blocking
    save or a load, one or two at a time, 15 times or more (until five landed): each time the next iteration runs,
    or says the state must be restored and runs after a load (never an IndexError from a lost pool buffer, a hang
    or a crash); the previous checkpoint still verifies, close() returns and no thread of ours is left."""
    rng = random.Random(2)
    model = model_of()
    offload_parameters(model, str(tmp_path / "w"), max_in_cpu=0, buffer_count=3, buffer_size=8192)
    opt = OffloadedAdamW(model.parameters(), nvme_path=str(tmp_path / "s"), overlap_backward=what == "backward", **KW)
    saved = str(tmp_path / "c")
    try:
        for s in range(2):
            iteration(model, opt, s)
        ckpt.save_checkpoint(opt, saved, model=model)
        work = {"step": lambda: iteration(model, opt, 5), "backward": lambda: backward(model, 5),
                "save": lambda: ckpt.save_checkpoint(opt, tmp_path / "new", model=model),
                "load": lambda: ckpt.load_checkpoint(opt, saved, model=model)}[what]
        length = timed(work)
        opt.zero_grad()
        outcomes = {"interrupted": 0, "restored": 0}
        for n in range(90):  # 15 trials, more where too few shots landed inside one (a loaded machine)
            if n >= TRIALS and outcomes["interrupted"] >= LANDED:
                break
            began = time.perf_counter()
            seen = ctrl_c(shots(rng, length, n), work)
            if not seen:  # the shots came late: aim within the shortest run seen (the first may be a slow one)
                length = min(length, time.perf_counter() - began)
            outcomes["interrupted"] += bool(seen)
            ckpt.wait_for_saves(opt, timeout=30)
            outcomes["restored"] += recover(model, opt, saved, 100 + n)
            ckpt.verify_checkpoint(saved)
        assert outcomes["interrupted"] >= LANDED, outcomes
    finally:
        opt.close()
    assert not ours(), ours()
    assert not [f for f in os.listdir(tmp_path / "s") if f.endswith(".swap")]


def test_ctrl_c_during_close_and_close_again_returns(tmp_path):
    """A SIGINT at a random moment of close() (with a save in flight), 6 times: close() again returns, the swap
    files are gone and no thread of ours is left."""
    rng = random.Random(3)
    for n in range(6):  # with and without overlap_backward, three times each
        model = model_of(n)
        opt = OffloadedAdamW(model.parameters(), nvme_path=str(tmp_path / f"s{n}"), overlap_backward=n % 2 == 0,
                             **KW)
        iteration(model, opt, 0)
        opt.save_checkpoint(tmp_path / f"c{n}", blocking=False)
        backward(model, 1)
        ctrl_c([rng.uniform(0, 0.05)], opt.close)
        opt.close()
        assert not [f for f in os.listdir(tmp_path / f"s{n}") if f.endswith(".swap")]
    assert not ours(), ours()


class _Cut:
    """Raise ``error`` at the ``n``-th line run inside the change guard's functions (StateCopy._guard,
    _capture, _captured), as an exception there can. (Not where a ``with`` block ends: the line event there
    comes before ``__exit__`` is called, where no signal is delivered; raised there, it would skip the exit.)"""

    FUNCS = ("_guard", "_capture", "_captured")

    def __init__(self, n: int, error=KeyboardInterrupt):
        self.n, self.error, self.lines, self.fired = n, error, 0, False

    def __enter__(self):
        def tracer():
            seen = set()

            def local(frame, event, arg):
                if event == "line" and not self.fired:
                    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
                    if line.startswith("with ") and frame.f_lineno in seen:
                        return local  # the block's end
                    seen.add(frame.f_lineno)
                    self.lines += 1
                    if self.lines == self.n:
                        self.fired = True
                        raise self.error(f"cut at {frame.f_code.co_name}:{frame.f_lineno}")
                return local
            return local

        def calls(frame, event, arg):
            if frame.f_code.co_filename == snapshot.__file__ and frame.f_code.co_name in self.FUNCS:
                return tracer()
            return None

        sys.settrace(calls)
        return self

    def __exit__(self, *exc):
        sys.settrace(None)
        return False


def test_an_exception_at_any_line_of_the_change_guard_hangs_nothing(tmp_path):
    """An asynchronous save riding a step, the step cut by a KeyboardInterrupt at each line the change guard
    runs in turn (right after it marked a unit as being captured, inside its clean-up, ...; every line of the
    first calls, then a sample of the later ones): the save then
    ends (whole, or failed with a CheckpointError saying the step was interrupted) instead of waiting for ever,
    the next save and step work (after a load, where the step says so), and close() returns."""
    model = model_of()
    opt = OffloadedAdamW(model.parameters(), nvme_path=str(tmp_path / "s"), **KW)
    saved = str(tmp_path / "c")
    try:
        for s in range(2):
            iteration(model, opt, s)
        ckpt.save_checkpoint(opt, saved, model=model)
        with _Cut(10**9) as probe:
            handle = opt.save_checkpoint(tmp_path / "a", blocking=False)
            iteration(model, opt, 2)
            handle.wait()
        assert probe.lines > 40
        # Every line of the first guard calls (each runs the same lines, or one of two branches), then a sample.
        cuts = [*range(1, 41), *range(41, probe.lines + 1, max(1, (probe.lines - 40) // 10))]
        failed = 0
        for n in cuts:
            handle = opt.save_checkpoint(tmp_path / "a", blocking=False)
            with contextlib.suppress(KeyboardInterrupt), _Cut(n):
                iteration(model, opt, 3)
            start = time.monotonic()
            try:
                ckpt.verify_checkpoint(handle.wait(timeout=20))
            except ckpt.CheckpointError as err:
                assert "interrupted" in str(err) or "cut short" in str(err), err
                failed += 1
            assert time.monotonic() - start < 20
            recover(model, opt, saved, 4)
            ckpt.save_checkpoint(opt, tmp_path / "b", model=model)
        assert failed > 0
    finally:
        opt.close()
    assert not ours(), ours()


@pytest.mark.parametrize("interrupted", [False, True], ids=["after-backward", "interrupted-backward"])
def test_an_optimizer_dropped_during_backward_is_collected_and_its_worker_ends(tmp_path, interrupted):
    """With overlap_backward, an optimizer dropped (no step(), no close()) after a backward started its update,
    whole or cut by Ctrl-C, is collected: the update's worker ends, and the swap files go."""
    rng = random.Random(4)
    model = model_of()
    offload_parameters(model, str(tmp_path / "w"), max_in_cpu=0, buffer_count=3, buffer_size=8192)
    for n in range(5):
        opt = OffloadedAdamW(model.parameters(), nvme_path=str(tmp_path / f"s{n}"), overlap_backward=True, **KW)
        iteration(model, opt, 0)
        length = timed(lambda: backward(model, 1))
        opt.zero_grad()
        ctrl_c([rng.uniform(0, length)] if interrupted else [], lambda: backward(model, 2))
        gone = weakref.ref(opt)
        del opt
        gc.collect()
        deadline = time.monotonic() + 10
        while ours() and time.monotonic() < deadline:
            time.sleep(0.05)
            gc.collect()
        assert gone() is None and not ours(), ours()
        assert not [f for f in os.listdir(tmp_path / f"s{n}") if f.endswith(".swap")]
        for p in model.parameters():
            p.grad = None


def test_a_handler_installed_inside_a_held_block_stays_and_gets_the_held_ctrl_c():
    """SIGINT handlers the user installs while the library holds Ctrl-C off (from a callback, say) are not
    replaced by the one before the block when it ends, and receive the Ctrl-C held in it."""
    from offload.interrupts import deferred

    before = signal.getsignal(signal.SIGINT)
    got = []

    def mine(signum, frame):
        got.append(signum)

    try:
        with deferred():
            signal.signal(signal.SIGINT, mine)
            signal.raise_signal(signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is mine and got == [signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, before)
