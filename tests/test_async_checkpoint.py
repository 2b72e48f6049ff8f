"""Asynchronous saves: the checkpoint holds the state at the call while training goes on, bit for bit as a
blocking save at the same step; one save at a time; errors on the handle and at the next save; close."""

from __future__ import annotations

import copy
import filecmp
import os
import threading

import pytest
import torch
from helpers import SMALL, assert_same_state, ckpt_file, make_params, run_code, train

from offload import OffloadedAdamW
from offload import checkpoint as ckpt
from offload.checkpoint import snapshot as snapshot_module
from offload.checkpoint import stream as stream_module
from offload.errors import CheckpointError
from offload.state.moves import UnitStream


@pytest.fixture
def held_save(monkeypatch) -> threading.Event:
    """Asynchronous saves wait (up to 30 s) for the returned event before they read any unit themselves, so
    that steps and loads meet the units first."""
    go = threading.Event()
    real_run = snapshot_module.StateCopy.run

    def held_run(self, buffers, bar):
        go.wait(30)
        return real_run(self, buffers, bar)

    monkeypatch.setattr(snapshot_module.StateCopy, "run", held_run)
    return go


def make_opt(params, nvme, **kw):
    return OffloadedAdamW(params, lr=1e-2, nvme_path=nvme, **{**SMALL, **kw})


def loaded_state(path, nvme, **kw) -> dict:
    """The state_dict of a fresh optimizer loaded from ``path``."""
    opt = make_opt(make_params(seed=1), nvme, **kw)
    try:
        ckpt.load_checkpoint(opt, path)
        return copy.deepcopy(opt.state_dict())
    finally:
        opt.close()


@pytest.mark.parametrize("kw", [
    pytest.param({}, id="nvme"),
    pytest.param(dict(host_cache=512 * 1024), id="host-cache"),
    pytest.param(dict(device="cpu"), id="device-cpu"),
])
def test_an_async_save_equals_a_blocking_one_taken_at_the_same_step(tmp_path, nvme, closing, kw):
    """While training goes on for several steps, an asynchronous save still writes the state of the call:
    its state.bin and memory.pt are byte for byte those of a blocking save at the same step, and it loads
    to the same state (units on NVMe, in a host cache, or all in memory)."""
    params = make_params()
    opt = closing(make_opt(params, nvme, **kw))
    train(opt, params, range(3))
    ckpt.save_checkpoint(opt, tmp_path / "blocking")
    expected = copy.deepcopy(opt.state_dict())
    handle = ckpt.save_checkpoint(opt, tmp_path / "async", blocking=False, extra={"step": 3})
    train(opt, params, range(3, 7))
    assert handle.wait() == str(tmp_path / "async") and handle.done() and handle.exception() is None
    for name in ("state.bin", "memory.pt"):
        assert filecmp.cmp(ckpt_file(tmp_path / "blocking", name), ckpt_file(tmp_path / "async", name),
                           shallow=False), name
    assert ckpt.verify_checkpoint(tmp_path / "async")["snapshot"]["asynchronous"] is True
    assert_same_state(loaded_state(tmp_path / "async", str(tmp_path / "nvme2"), **kw), expected)


def test_units_a_step_changes_before_the_save_reaches_them_are_copied_by_the_guard(tmp_path, nvme, closing,
                                                                                     monkeypatch, held_save):
    """With the save's own reads held back, the next step meets every unit first: the change guard copies
    each from the step's buffer (and load_state_dict's, which reads none) and the checkpoint is still the
    state of the call."""
    params = make_params()
    opt = closing(make_opt(params, nvme))
    train(opt, params, range(2))
    expected = copy.deepcopy(opt.state_dict())
    go = held_save
    captured = []
    real_capture = snapshot_module.StateCopy._capture

    def counted(self, i, unit, buf):
        captured.append(i)
        return real_capture(self, i, unit, buf)

    monkeypatch.setattr(snapshot_module.StateCopy, "_capture", counted)
    handle = ckpt.save_checkpoint(opt, tmp_path / "c", blocking=False)
    train(opt, params, range(2, 3))
    opt.load_state_dict(copy.deepcopy(expected))  # changes every unit again, reading none of them
    train(opt, params, range(3, 5))
    go.set()
    handle.wait()
    n_units = len(ckpt.read_manifest(tmp_path / "c")["units"])
    assert sorted(captured) == list(range(n_units))  # each unit once, by the first step
    assert_same_state(loaded_state(tmp_path / "c", str(tmp_path / "nvme2")), expected)


def test_a_second_save_waits_for_the_first_and_loads_wait_too(tmp_path, nvme, closing):
    """Two saves in a row: the second starts only once the first is committed; a load waits for it too."""
    params = make_params()
    opt = closing(make_opt(params, nvme))
    train(opt, params, range(2))
    first = ckpt.save_checkpoint(opt, tmp_path / "a", blocking=False)
    second = ckpt.save_checkpoint(opt, tmp_path / "b", blocking=False)
    assert first.done()
    ckpt.load_checkpoint(opt, tmp_path / "a")
    assert second.done()
    assert ckpt.verify_checkpoint(tmp_path / "a") and ckpt.verify_checkpoint(tmp_path / "b")


def test_an_async_failure_is_raised_by_the_handle_and_once_by_the_next_save(tmp_path, nvme, closing, monkeypatch):
    """A write error in the background leaves no checkpoint (the previous one stays), is raised by
    wait(), and if nobody looked, by the next save, once; the save after that works."""
    params = make_params()
    opt = closing(make_opt(params, nvme))
    train(opt, params, range(2))
    ckpt.save_checkpoint(opt, tmp_path / "c")
    before = ckpt.read_manifest(tmp_path / "c")["manifest_xxh3_64"]

    class RenameFails(ckpt.Storage):
        def rename(self, src, dst):
            raise OSError(5, "injected EIO", dst)

    handle = ckpt.save_checkpoint(opt, tmp_path / "c", blocking=False, storage=RenameFails())
    with pytest.raises(OSError, match="injected EIO"):
        handle.wait()
    handle = ckpt.save_checkpoint(opt, tmp_path / "c", blocking=False, storage=RenameFails())
    train(opt, params, range(2, 3))
    with pytest.raises(CheckpointError, match="previous asynchronous save .* failed") as info:
        ckpt.save_checkpoint(opt, tmp_path / "d")
    assert isinstance(info.value.__cause__, OSError)
    assert ckpt.read_manifest(tmp_path / "c")["manifest_xxh3_64"] == before
    assert sorted(os.listdir(tmp_path / "c")) == sorted(
        ["manifest.json", *(e["file"] for e in ckpt.read_manifest(tmp_path / "c")["files"].values())])
    ckpt.save_checkpoint(opt, tmp_path / "d")
    assert ckpt.verify_checkpoint(tmp_path / "d")


def test_closing_the_optimizer_during_an_async_save_finishes_the_save_first(tmp_path, nvme, monkeypatch, held_save):
    """close() while the save is still reading units waits for it: the checkpoint commits whole and holds
    the state at the call, and only then are the swap files deleted."""
    params = make_params()
    opt = make_opt(params, nvme)
    train(opt, params, range(2))
    expected = copy.deepcopy(opt.state_dict())
    go = held_save
    handle = ckpt.save_checkpoint(opt, tmp_path / "c", blocking=False)
    threading.Timer(0.2, go.set).start()
    opt.close()
    assert handle.done() and handle.exception(0) is None
    monkeypatch.undo()
    assert_same_state(loaded_state(tmp_path / "c", nvme + "-2"), expected)


def test_bad_arguments_are_refused_before_anything_is_written(tmp_path, nvme, closing):
    """An unknown snapshot kind is refused with ValueError, a clone where none can be made with
    CheckpointError; nothing is written."""
    params = make_params()
    opt = closing(make_opt(params, nvme))
    train(opt, params, range(1))
    with pytest.raises(ValueError, match="snapshot must be one of"):
        ckpt.save_checkpoint(opt, tmp_path / "c", snapshot="copy")
    with pytest.raises(CheckpointError, match="cannot clone"):
        ckpt.save_checkpoint(opt, tmp_path / "c", snapshot="reflink")  # tmp_path is not on the swap's XFS
    assert sorted(os.listdir(tmp_path)) == ["nvme"]


def test_progress_bars_show_on_a_terminal_only_when_asked_or_long(tmp_path, nvme, closing, capsys):
    """A save with progress=True draws a bar on stderr once it has lasted a second; by default (stderr is
    not a terminal here) it draws nothing."""
    params = make_params()
    opt = closing(make_opt(params, nvme))
    train(opt, params, range(1))
    ckpt.save_checkpoint(opt, tmp_path / "quiet")
    ckpt.load_checkpoint(opt, tmp_path / "quiet")
    assert capsys.readouterr().err == ""
    bar = stream_module.progress_bar(100, "save", True, delay=0)  # as a save that has lasted a second
    bar.update(50)
    bar.close()
    assert "save" in capsys.readouterr().err


def test_an_async_save_whose_first_change_is_a_load_state_dict_holds_the_state_at_the_call(tmp_path, nvme,
                                                                                           closing, held_save):
    """A load_state_dict right after an asynchronous save (it changes every unit and reads none) leaves the
    checkpoint with the state at the call: the guard copies each unit not yet captured from the store."""
    params = make_params()
    opt = closing(make_opt(params, nvme))
    train(opt, params, range(2))
    expected = copy.deepcopy(opt.state_dict())
    train(opt, params, range(2, 3))
    other = copy.deepcopy(opt.state_dict())
    opt.load_state_dict(copy.deepcopy(expected))
    go = held_save
    handle = ckpt.save_checkpoint(opt, tmp_path / "c", blocking=False)
    opt.load_state_dict(copy.deepcopy(other))
    go.set()
    handle.wait()
    assert_same_state(loaded_state(tmp_path / "c", str(tmp_path / "nvme2")), expected)


class _LateRead:
    """A read of a unit whose bytes arrive only once ``go`` is set: it is issued then, whoever waits first."""

    def __init__(self, issue, go: threading.Event):
        self.issue, self.go, self.mu, self.fut = issue, go, threading.Lock(), None

    def wait(self):
        self.go.wait(30)
        with self.mu:
            if self.fut is None:
                self.fut = self.issue()
        return self.fut.wait()


def test_a_step_that_meets_a_unit_the_save_is_reading_waits_for_that_read(tmp_path, nvme, closing, monkeypatch):
    """A step that reaches a unit while the asynchronous save's read of it is still in flight waits for that
    read before changing the unit: the checkpoint holds the state at the call."""
    for name in ("RIDE_MIN_S", "RIDE_MAX_S", "RIDE_FIRST_S"):
        monkeypatch.setattr(snapshot_module, name, 0.0)  # the save reads at once, without waiting for a step
    params = make_params()
    opt = closing(make_opt(params, nvme))
    train(opt, params, range(2))
    expected = copy.deepcopy(opt.state_dict())
    store = opt.state_store
    real_read = store.read_unit
    reading, go, late = threading.Event(), threading.Event(), []

    def read_unit(unit, buf):
        if threading.current_thread().name == "offload-checkpoint-save" and not late:
            late.append(_LateRead(lambda: real_read(unit, buf), go))  # the save's first read: held back
            reading.set()
            return late[0]
        return real_read(unit, buf)

    monkeypatch.setattr(store, "read_unit", read_unit)
    handle = ckpt.save_checkpoint(opt, tmp_path / "c", blocking=False)
    assert reading.wait(30)
    stepper = threading.Thread(target=train, args=(opt, params, range(2, 3)))
    stepper.start()
    stepper.join(2)  # a step that does not wait for the read finishes here and changes the unit first
    waited = stepper.is_alive()
    go.set()
    stepper.join()
    handle.wait()
    monkeypatch.undo()
    assert waited, "the step changed the unit while the save's read of it was in flight"
    assert_same_state(loaded_state(tmp_path / "c", str(tmp_path / "nvme2")), expected)


# -- saves that ride on the steps ----------------------------------------------------------------------


@pytest.fixture
def patient(monkeypatch) -> None:
    """Asynchronous saves wait an hour for the steps to hand them their units, unless something else ends it."""
    for name in ("RIDE_MIN_S", "RIDE_MAX_S", "RIDE_FIRST_S"):
        monkeypatch.setattr(snapshot_module, name, 3600.0)


def save_reads(store, monkeypatch) -> list:
    """The units the asynchronous save's own thread reads from the store, as it reads them."""
    reads = []
    real = store.read_unit

    def read_unit(unit, buf):
        if threading.current_thread().name == "offload-checkpoint-save":
            reads.append(unit)
        return real(unit, buf)

    monkeypatch.setattr(store, "read_unit", read_unit)
    return reads


def ends_without_a_step(action, seconds: float = 60) -> bool:
    """Whether ``action()``, run in a thread, ends within ``seconds`` with no step coming. If it does not, the
    saves are let go (so that the test fails rather than hangs) and False is returned."""
    worker = threading.Thread(target=action)
    worker.start()
    worker.join(seconds)
    if not worker.is_alive():
        return True
    for state in gc_objects(snapshot_module.StateCopy):
        state.hurry()
    worker.join(seconds)
    return False


def trained(nvme, closing, **kw) -> tuple:
    """An optimizer over ``make_params()`` after two steps, and its parameters."""
    params = make_params()
    opt = closing(make_opt(params, nvme, **kw))
    train(opt, params, range(2))
    return opt, params


def riding_save(opt, directory, monkeypatch) -> tuple:
    """Start a streamed asynchronous save of ``opt`` to ``directory``; returns the state at the call, the list
    of units the save's thread will read from the store itself (see :func:`save_reads`), and the handle."""
    expected = copy.deepcopy(opt.state_dict())
    reads = save_reads(opt.state_store, monkeypatch)
    return expected, reads, ckpt.save_checkpoint(opt, directory, blocking=False, snapshot="stream")


def commits_unwaited(handle, seconds: float = 60) -> bool:
    """Whether the save commits within ``seconds`` with nobody waiting on it (waiting would hurry it)."""
    deadline = threading.Event()
    for _ in range(int(seconds * 20)):
        if handle.done():
            return True
        deadline.wait(0.05)
    return False


def test_an_async_save_rides_on_the_next_step_and_reads_nothing_itself(tmp_path, nvme, closing, monkeypatch,
                                                                        patient):
    """The step after an asynchronous save hands it every unit (the guard copies each from the step's own
    buffer): the save reads none from the store, so it adds only its writes; it commits without anybody
    waiting; state.bin is byte for byte a blocking save's at the call, and the units' checksums, taken of the
    bytes the guard wrote, cover it (state.bin has none of its own)."""
    params = make_params()
    opt = closing(make_opt(params, nvme))
    train(opt, params, range(2))
    ckpt.save_checkpoint(opt, tmp_path / "blocking")
    expected = copy.deepcopy(opt.state_dict())
    reads = save_reads(opt.state_store, monkeypatch)
    waiting = threading.Event()
    real_await = snapshot_module.StateCopy._await_capture

    def await_capture(self, i):
        waiting.set()
        return real_await(self, i)

    monkeypatch.setattr(snapshot_module.StateCopy, "_await_capture", await_capture)
    handle = ckpt.save_checkpoint(opt, tmp_path / "async", blocking=False, snapshot="stream")
    assert waiting.wait(30)  # the save's thread has reached the units before the step does
    train(opt, params, range(2, 3))
    assert commits_unwaited(handle), "the save did not commit after a step had handed it every unit"
    handle.wait()
    assert reads == []
    assert filecmp.cmp(ckpt_file(tmp_path / "blocking", "state.bin"), ckpt_file(tmp_path / "async", "state.bin"),
                       shallow=False)
    assert ckpt.read_manifest(tmp_path / "async")["files"]["state.bin"]["xxh3_64"] is None
    ckpt.verify_checkpoint(tmp_path / "async")
    assert_same_state(loaded_state(tmp_path / "async", str(tmp_path / "nvme2")), expected)


def test_units_a_whole_step_left_alone_are_read_by_the_save_itself(tmp_path, nvme, closing, monkeypatch, patient):
    """Units the step after the save does not change (a parameter without a grad) are not waited for past
    that step: the save reads them itself and commits, with nobody waiting on it."""
    opt, params = trained(nvme, closing)
    expected, reads, handle = riding_save(opt, tmp_path / "c", monkeypatch)
    train(opt, params, range(2, 3), skip={4})  # the largest parameter, in units of its own, gets no grad
    assert commits_unwaited(handle), "the save went on waiting for units the step had left alone"
    n_units = len(ckpt.read_manifest(tmp_path / "c")["units"])
    assert 0 < len(reads) < n_units
    assert_same_state(loaded_state(tmp_path / "c", str(tmp_path / "nvme2")), expected)


def test_waiting_for_an_async_save_without_a_step_makes_it_read_the_units_itself(tmp_path, nvme, closing,
                                                                                  monkeypatch, patient):
    """With no step after the call, the handle's wait() does not wait for one: the save reads every unit
    from the store and commits the state of the call."""
    opt, params = trained(nvme, closing)
    expected, reads, handle = riding_save(opt, tmp_path / "c", monkeypatch)
    assert ends_without_a_step(handle.wait), "wait() waited for a step"
    assert len(reads) == len(ckpt.read_manifest(tmp_path / "c")["units"])
    assert_same_state(loaded_state(tmp_path / "c", str(tmp_path / "nvme2")), expected)


EXIT_SCRIPT = r"""
import sys
import torch
from offload import OffloadedAdamW
from offload import checkpoint as ckpt
from offload.checkpoint import snapshot
snapshot.RIDE_MIN_S = snapshot.RIDE_MAX_S = snapshot.RIDE_FIRST_S = 3600.0
params = [torch.nn.Parameter(torch.randn(70_000)) for _ in range(3)]
opt = OffloadedAdamW(params, lr=1e-2, nvme_path=sys.argv[1], buffer_size=256 * 1024, buffer_count=3)
for p in params:
    p.grad = torch.randn_like(p)
opt.step()
ckpt.save_checkpoint(opt, sys.argv[2], blocking=False, snapshot="stream")
print("saving")
"""


def test_a_script_that_ends_during_an_async_save_exits_with_the_save_committed(tmp_path, nvme):
    """A script ending right after an asynchronous save (no step, nobody waiting) does not hang at exit
    waiting for a step: the save reads the units itself, commits, and the checkpoint verifies."""
    proc = run_code(EXIT_SCRIPT, nvme, str(tmp_path / "c"), timeout=60)
    assert proc.returncode == 0 and "saving" in proc.stdout, proc.stdout + proc.stderr
    ckpt.verify_checkpoint(tmp_path / "c")


@pytest.mark.parametrize("then", ["save", "load", "close"])
def test_the_next_save_a_load_or_close_end_a_riding_saves_wait_for_a_step(tmp_path, nvme, patient, then):
    """With no step after an asynchronous save, what has to wait for it (the next save, a load, close()) ends
    its wait for a step at once: it reads the units itself and commits the state of the call."""
    params = make_params()
    opt = make_opt(params, nvme)
    try:
        train(opt, params, range(2))
        expected = copy.deepcopy(opt.state_dict())
        ckpt.save_checkpoint(opt, tmp_path / "earlier")
        handle = ckpt.save_checkpoint(opt, tmp_path / "c", blocking=False, snapshot="stream")
        action = {"save": lambda: ckpt.save_checkpoint(opt, tmp_path / "d"),
                  "load": lambda: ckpt.load_checkpoint(opt, tmp_path / "earlier"), "close": opt.close}[then]
        assert ends_without_a_step(action), f"{then} waited for a step"
        assert handle.done() and handle.exception(0) is None
    finally:
        opt.close()
    assert_same_state(loaded_state(tmp_path / "c", str(tmp_path / "nvme2")), expected)


def test_an_overlapped_step_hands_the_units_over_from_its_worker(tmp_path, nvme, closing, monkeypatch, patient):
    """With overlap_backward the units are updated by a worker thread during backward: the guard takes them
    there, the save reads none itself, and the checkpoint is the state of the call."""
    params = make_params()
    opt = closing(make_opt(params, nvme, overlap_backward=True))

    def iteration(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        sum((p * torch.randn(p.shape, generator=g)).sum() for p in params).backward()
        opt.step()
        opt.zero_grad()

    for seed in range(2):
        iteration(seed)
    expected = copy.deepcopy(opt.state_dict())
    reads = save_reads(opt.state_store, monkeypatch)
    threads = set()
    real_guard = snapshot_module.StateCopy._guard

    def guard(self, unit, buf):
        threads.add(threading.current_thread().name)
        return real_guard(self, unit, buf)

    monkeypatch.setattr(snapshot_module.StateCopy, "_guard", guard)
    handle = ckpt.save_checkpoint(opt, tmp_path / "c", blocking=False, snapshot="stream")
    iteration(2)
    assert commits_unwaited(handle)
    assert reads == [] and threads == {"offload-overlap"}, threads
    assert_same_state(loaded_state(tmp_path / "c", str(tmp_path / "nvme2")), expected)


def test_a_write_failing_in_the_guard_fails_the_save_not_the_step(tmp_path, nvme, closing, monkeypatch, patient):
    """A write of a unit the guard captured failing (a full or failing checkpoint drive) fails the save, raised
    by its handle; the step that handed the unit over goes on, and training stays bit for bit as without."""
    params, twin = make_params(), make_params()
    opt, ref = closing(make_opt(params, nvme)), closing(make_opt(twin, str(tmp_path / "nvme-ref")))
    train(opt, params, range(2))
    train(ref, twin, range(2))
    handle = ckpt.save_checkpoint(opt, tmp_path / "c", blocking=False, snapshot="stream")
    state = next(o for o in gc_objects(snapshot_module.StateCopy) if o.path.startswith(str(tmp_path / "c")))

    def failing_write(*args, **kwargs):
        raise OSError(28, "injected ENOSPC", state.path)

    monkeypatch.setattr(state.engine, "write_async", failing_write)
    train(opt, params, range(2, 4))
    train(ref, twin, range(2, 4))
    with pytest.raises(OSError, match="injected ENOSPC"):
        handle.wait()
    assert not os.path.exists(tmp_path / "c" / "manifest.json")
    assert_same_state(copy.deepcopy(opt.state_dict()), copy.deepcopy(ref.state_dict()))


def gc_objects(cls) -> list:
    """The live objects of class ``cls``."""
    import gc

    return [o for o in gc.get_objects() if type(o) is cls]


def test_a_step_longer_than_the_wait_still_hands_over_every_unit(tmp_path, nvme, closing, monkeypatch):
    """The wait for a step bounds only how long the save waits for one to start: a step that started in time
    and takes longer than the wait (a large model's) still hands the save every unit, which reads none."""
    for name in ("RIDE_MIN_S", "RIDE_MAX_S", "RIDE_FIRST_S"):
        monkeypatch.setattr(snapshot_module, name, 0.5)
    opt, params = trained(nvme, closing)
    real_start = UnitStream._start

    def slow_start(self):  # started at once (counted), lasting well past the save's wait
        started = real_start(self)
        if self.counts_step:
            threading.Event().wait(1.5)
        return started

    monkeypatch.setattr(UnitStream, "_start", slow_start)
    expected, reads, handle = riding_save(opt, tmp_path / "c", monkeypatch)
    train(opt, params, range(2, 3))
    assert commits_unwaited(handle)
    assert reads == []
    assert_same_state(loaded_state(tmp_path / "c", str(tmp_path / "nvme2")), expected)


def test_a_step_is_counted_once_entered_and_done_however_it_ends(nvme, closing, monkeypatch):
    """An asynchronous save rides on the next step by its counts: a step's stream counts as started once entered
    (not when made), and as done when it ends, by an error in its body or in its start as well as normally."""
    opt, _ = trained(nvme, closing)
    moves, units = opt.state_store.moves, opt.state_store.layout.units
    counts = lambda: (moves.steps_started, moves.steps_done)  # noqa: E731
    before = counts()
    moves.step(units)  # never entered: not a step
    assert counts() == before
    with pytest.raises(RuntimeError, match="in the body"), moves.step(units):
        raise RuntimeError("in the body")
    assert counts() == (before[0] + 1, before[1] + 1)

    def failing_start(self):
        raise OSError(5, "in the start")

    monkeypatch.setattr(UnitStream, "_start", failing_start)
    with pytest.raises(OSError, match="in the start"), moves.step(units):
        pass
    assert counts() == (before[0] + 2, before[1] + 2)


def test_units_in_host_memory_are_not_waited_for(tmp_path, nvme, closing, patient):
    """With the whole state in a host cache nothing is read from disk, so the save does not wait for a step to
    hand the units over: its thread copies them and commits, with no step and nobody waiting."""
    params = make_params()
    opt = closing(make_opt(params, nvme, host_cache=64 * 1024 * 1024))
    train(opt, params, range(2))
    expected = copy.deepcopy(opt.state_dict())
    handle = ckpt.save_checkpoint(opt, tmp_path / "c", blocking=False, snapshot="stream")
    assert commits_unwaited(handle, seconds=30), "the save waited for a step to hand over units in host memory"
    assert_same_state(loaded_state(tmp_path / "c", str(tmp_path / "nvme2"), host_cache=64 * 1024 * 1024), expected)
