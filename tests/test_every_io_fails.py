"""Every I/O fails once, in turn: a short training with a save and a load, run again and again with the k-th I/O
request of the whole process failing (EIO) or coming back short, for k over every request the run makes.

What must hold for every k: the run completes with the fault-free run's results bit for bit, or it raises a
clear error (an OSError with errno and file, or a StateError) after which loading the last committed
checkpoint (or, before any, a fresh start) and going on ends bit for bit where the fault-free run ends. No
hang (each run has a deadline), no thread, descriptor or swap file left once the optimizer is closed.

The default run tries a spread of k over every request; ``OFFLOAD_EVERY_IO=all`` tries every one (a soak).
"""

from __future__ import annotations

import errno
import os
import threading
import weakref

import pytest
import torch
from helpers import SMALL, assert_same, assert_same_state

from offload import OffloadedAdamW, StateError
from offload.aio import Engine

STEPS = 4
SAVE_AFTER = 2  # the checkpoint holds the state after this many steps
SAMPLES = 24


class _Model(torch.nn.Module):
    """Parameters over several units of state (some split across units) and one small one kept in memory."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a = torch.nn.Parameter(torch.randn(70_000, generator=g))
        self.b = torch.nn.Parameter(torch.randn(150_001, generator=g))
        self.c = torch.nn.Parameter(torch.randn(10, generator=g))


def _grads(model, step):
    g = torch.Generator().manual_seed(1000 + step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)


class _Faults:
    """Counts every request submitted to the engines made from now on; the k-th one (0-based) gets ``kind``.
    (Engines made before, by earlier tests whose background work may still end, are not the run's.)"""

    def __init__(self, monkeypatch, k: int | None, kind: str):
        self.count, self.k, self.kind, self.fired = 0, k, kind, False
        real, real_init = Engine.submit, Engine.__init__
        lock = threading.Lock()
        ours = weakref.WeakSet()

        def init(engine, *args, **kw):
            real_init(engine, *args, **kw)
            ours.add(engine)

        def submit(engine, op, segments, **kw):
            if engine not in ours:
                return real(engine, op, segments, **kw)
            with lock:
                mine = self.count == self.k
                self.count += 1
            if mine:
                self.fired = True
                engine.inject_fault(self.kind, count=1, errno=errno.EIO)
            return real(engine, op, segments, **kw)

        monkeypatch.setattr(Engine, "__init__", init)
        monkeypatch.setattr(Engine, "submit", submit)


def _program(nvme, root, *, start=None):
    """The run: STEPS steps with a save after SAVE_AFTER, a load of it and the steps after it again; the
    result is the weights and state_dict() (which waits for the last writes). ``start``: a checkpoint to resume
    from, after a failure (None: from the beginning)."""
    model = _Model()
    opt = OffloadedAdamW(model.parameters(), lr=1e-2, nvme_path=nvme, **SMALL)
    first = 0
    if start is not None:
        extra = opt.load_checkpoint(start, model=model)
        first = extra["step"]
    try:
        for step in range(first, STEPS):
            _grads(model, step)
            opt.step()
            opt.zero_grad()
            if step + 1 == SAVE_AFTER:
                opt.save_checkpoint(os.path.join(root, "ckpt"), model=model, extra={"step": step + 1})
        opt.load_checkpoint(os.path.join(root, "ckpt"), model=model)  # a load too: then on to the same end
        for step in range(SAVE_AFTER, STEPS):
            _grads(model, step)
            opt.step()
            opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()], opt.state_dict()
    finally:
        opt.close()


def _within_deadline(fn, *args, seconds: float = 120.0, **kw):
    """``fn(*args, **kw)`` on a thread; a run that does not end in ``seconds`` fails the test (a hang)."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn(*args, **kw)
        except BaseException as err:  # re-raised on the test's thread
            out["error"] = err

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{fn.__name__} did not end within {seconds} s: a hang"
    if "error" in out:
        raise out["error"]
    return out["value"]


def _leftovers(nvme) -> list:
    return [f for f in os.listdir(nvme) if f.endswith(".swap")] if os.path.isdir(nvme) else []


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The fault-free run's results and how many requests it makes."""
    root = tmp_path_factory.mktemp("reference")
    mp = pytest.MonkeyPatch()
    try:
        faults = _Faults(mp, None, "error")
        weights, state = _program(str(root / "nvme"), str(root))
    finally:
        mp.undo()
    return weights, state, faults.count


def _ks(total: int) -> list[int]:
    if os.environ.get("OFFLOAD_EVERY_IO") == "all":
        return list(range(total))
    return sorted({round(i * (total - 1) / (SAMPLES - 1)) for i in range(SAMPLES)})


@pytest.mark.parametrize("kind", ["error", "short"])
def test_every_request_failing_once_ends_in_the_same_results_or_a_clear_restorable_error(
        reference, tmp_path, monkeypatch, kind):
    """For each k (a spread over every request of the run, or all of them with OFFLOAD_EVERY_IO=all): the k-th
    request fails with EIO (or comes back short, which the engine must resubmit): the run either ends with the
    fault-free results bit for bit (always, for a short request), or raises an OSError naming errno and file or
    a StateError; then a restore from the last committed checkpoint (a fresh start before there is one) and the
    rest of the run end bit for bit where the fault-free run ends. No thread, descriptor or swap file is left."""
    weights, state, total = reference
    assert total > 20
    threads, fds = threading.active_count(), len(os.listdir("/proc/self/fd"))
    outcomes = {"same": 0, "restored": 0}
    for k in _ks(total):
        root = tmp_path / f"k{k}"
        root.mkdir()
        nvme = str(root / "nvme")
        with monkeypatch.context() as mp:
            faults = _Faults(mp, k, kind)
            try:
                got_weights, got_state = _within_deadline(_program, nvme, str(root))
                outcomes["same"] += 1
            except (OSError, StateError) as err:
                assert kind == "error", f"request {k} came back short and the run failed: {err!r}"
                if isinstance(err, OSError):
                    assert err.errno == errno.EIO and err.filename, f"request {k}: {err!r} names no file"
                got_weights = None
        assert faults.fired, f"request {k} was never made: the run is not deterministic"
        if got_weights is None:
            assert not _leftovers(nvme), f"request {k}: a failed run left swap files"
            committed = root / "ckpt"
            got_weights, got_state = _within_deadline(_program, nvme, str(root),
                                                      start=str(committed) if committed.exists() else None)
            outcomes["restored"] += 1
        assert_same(got_weights, weights)
        assert_same_state(got_state, state)
        assert not _leftovers(nvme)
    assert threading.active_count() <= threads, "threads outlived their optimizers"
    assert len(os.listdir("/proc/self/fd")) <= fds, "descriptors outlived their optimizers"
    if kind == "error":
        assert outcomes["restored"] > 0  # faults did fail runs: the test is not vacuous
