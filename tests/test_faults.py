"""Faults: I/O errors during steps, saves and loads; corrupt checkpoint files; crashes in the middle
of a save; SIGKILL at random points of a training loop with periodic checkpoints.

What must hold every time: a clear error (file, offset, errno), no half checkpoint that loads, the
previous checkpoint intact, and an optimizer that refuses to step on state it could not read or
write fully until a checkpoint is loaded.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import importlib.util
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from helpers import (
    FOUR_SIZES,
    REPO,
    SMALL,
    assert_same,
    assert_same_state,
    ckpt_file,
    first_os_error,
    flip_bit,
    make_params,
    python_env,
    restore,
    snapshot,
    train,
)

from offload import OffloadedAdamW, StateError
from offload import checkpoint as ckpt
from offload.aio import Engine


@pytest.fixture
def opt_and_params(nvme):
    params = make_params(FOUR_SIZES)
    opt = OffloadedAdamW(params, lr=1e-2, nvme_path=nvme, **SMALL)
    yield opt, params
    opt.close()


class FaultyStorage(ckpt.Storage):
    """A checkpoint ``Storage`` whose engines arm a fault as they are created; ``final_stats`` gets
    each engine's stats() as it is closed, to tell whether the fault fired."""

    def __init__(self, kind, **kw):
        self.kind, self.kw, self.final_stats = kind, kw, []

    def engine(self, aio):
        stats = self.final_stats

        class Faulty(Engine):
            def close(self):
                if not self.closed:
                    stats.append(self.stats())
                super().close()

        engine = Faulty(aio)
        engine.inject_fault(self.kind, **self.kw)
        return engine


# -- faults during a step -------------------------------------------------------------------------


def test_write_error_in_a_step_blocks_steps_and_saves_until_a_checkpoint_is_loaded(tmp_path, nvme, closing,
                                                                                   opt_and_params):
    """An EIO while a step writes state names the swap file, offset and errno; the optimizer then
    refuses to step or save, and loading the last checkpoint makes it continue exactly as a run
    without the fault."""
    opt, params = opt_and_params
    train(opt, params, range(2))
    ckpt.save_checkpoint(opt, tmp_path / "c", extra=snapshot(params))
    ref = make_params(FOUR_SIZES)
    ref_opt = closing(OffloadedAdamW(ref, lr=1e-2, nvme_path=nvme, **SMALL))
    restore(ref, snapshot(params))
    ckpt.load_checkpoint(ref_opt, tmp_path / "c")

    opt.swap_space.inject_fault("error", op="write", skip=1, count=1, errno=errno.EIO)
    # The failed write may be one the step leaves landing: then the next call reports it.
    err = first_os_error(lambda: train(opt, params, [2]), lambda: train(opt, params, [2]))
    assert err.errno == errno.EIO
    assert err.filename.endswith(".swap") and "offset" in str(err)
    with pytest.raises(StateError, match="load_checkpoint"):
        train(opt, params, [2])
    with pytest.raises(StateError, match="cannot save a checkpoint"):
        ckpt.save_checkpoint(opt, tmp_path / "c")

    restore(params, ckpt.load_checkpoint(opt, tmp_path / "c"))
    train(opt, params, range(2, 4))
    train(ref_opt, ref, range(2, 4))
    assert_same(params, ref)
    assert_same_state(opt.state_dict(), ref_opt.state_dict())


# -- faults while saving --------------------------------------------------------------------------


@pytest.mark.parametrize("err", [errno.EIO, errno.ENOSPC])
def test_write_error_while_saving_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch,
                                                                      opt_and_params, err):
    """EIO or ENOSPC on the checkpoint's data file: an OSError naming state.bin, the offset and the
    errno; the previous checkpoint still loads with its own contents and nothing temporary is left."""
    opt, params = opt_and_params
    train(opt, params, range(1))
    ckpt.save_checkpoint(opt, tmp_path / "c")
    before = ckpt.read_manifest(tmp_path / "c")
    train(opt, params, range(1, 3))
    faulty = FaultyStorage("error", op="write", skip=3, count=1, errno=err)
    with pytest.raises(OSError) as info:
        ckpt.save_checkpoint(opt, tmp_path / "c", storage=faulty)
    assert info.value.errno == err
    assert re.fullmatch(r"state\.[0-9a-f]{16}\.bin", os.path.basename(info.value.filename))
    assert "write at offset" in str(info.value)
    assert sorted(os.listdir(tmp_path)) == ["c", "nvme"]
    assert ckpt.verify_checkpoint(tmp_path / "c")["files"] == before["files"]
    # The failed save did not disturb the optimizer: a later save works.
    train(opt, params, range(3, 4))
    ckpt.save_checkpoint(opt, tmp_path / "c")
    assert ckpt.read_manifest(tmp_path / "c")["step"] == 4


def test_short_writes_while_saving_are_completed(tmp_path, nvme, monkeypatch, opt_and_params):
    """Writes that come back short are resubmitted for the rest: the checkpoint is whole and loads."""
    opt, params = opt_and_params
    train(opt, params, range(2))
    faulty = FaultyStorage("short", op="write", count=-1)
    ckpt.save_checkpoint(opt, tmp_path / "c", storage=faulty)
    engines = faulty.final_stats
    assert engines and sum(s["resubmits"] for s in engines) > 0, f"no short write happened: {engines}"
    ckpt.verify_checkpoint(tmp_path / "c")
    # Loaded into a fresh optimizer (one loaded into itself would keep its state whatever was read).
    fresh = make_params(FOUR_SIZES, seed=1)
    opt2 = OffloadedAdamW(fresh, lr=1e-2, nvme_path=nvme, **SMALL)
    try:
        ckpt.load_checkpoint(opt2, tmp_path / "c")
        assert_same_state(opt.state_dict(), opt2.state_dict())
    finally:
        opt2.close()


def test_read_error_while_loading_blocks_steps_until_a_good_load(tmp_path, monkeypatch, opt_and_params):
    """An EIO reading the checkpoint mid-load is reported with the file; the optimizer, whose state
    is now partly overwritten, refuses to step until a load succeeds."""
    opt, params = opt_and_params
    train(opt, params, range(2))
    ckpt.save_checkpoint(opt, tmp_path / "c")
    with pytest.raises(OSError) as info:
        ckpt.load_checkpoint(opt, tmp_path / "c", storage=FaultyStorage("error", op="read", skip=2, count=1))
    assert info.value.filename == ckpt_file(tmp_path / "c", "state.bin") and info.value.errno == errno.EIO
    with pytest.raises(StateError):
        train(opt, params, [2])
    ckpt.load_checkpoint(opt, tmp_path / "c")
    train(opt, params, [2])


# -- corrupt files --------------------------------------------------------------------------------


def test_a_flipped_bit_in_the_data_is_found_and_named(tmp_path, opt_and_params):
    """One flipped bit in state.bin fails the load with the file, byte range and parameters it holds;
    the optimizer then refuses to step until a good checkpoint is loaded."""
    opt, params = opt_and_params
    train(opt, params, range(2))
    ckpt.save_checkpoint(opt, tmp_path / "good")
    ckpt.save_checkpoint(opt, tmp_path / "bad")
    m = ckpt.read_manifest(tmp_path / "bad")
    unit = m["units"][3]
    flip_bit(ckpt_file(tmp_path / "bad", "state.bin"), unit["offset"] + 1234)
    end = unit["offset"] + unit["length"]
    where = rf"state\.[0-9a-f]{{16}}\.bin: bytes \[{unit['offset']}, {end}\) \(unit 3, state of parameter\(s\) 3\)"
    with pytest.raises(ckpt.ChecksumError, match=where):
        ckpt.load_checkpoint(opt, tmp_path / "bad")
    with pytest.raises(StateError):
        train(opt, params, [2])
    with pytest.raises(ckpt.ChecksumError, match="unit 3"):
        ckpt.verify_checkpoint(tmp_path / "bad")
    ckpt.load_checkpoint(opt, tmp_path / "good")
    train(opt, params, [2])


@pytest.mark.parametrize("name", ["memory.pt", "extra.pt", "manifest.json"])
def test_a_flipped_bit_in_a_small_file_is_found_before_anything_changes(tmp_path, opt_and_params, name):
    """Corruption of the manifest, the in-memory state or the extra file is caught before the
    optimizer is touched: it keeps its state and keeps stepping."""
    opt, params = opt_and_params
    train(opt, params, range(2))
    ckpt.save_checkpoint(opt, tmp_path / "c", extra={"params": snapshot(params)})
    path = ckpt_file(tmp_path / "c", name)
    flip_bit(path, os.path.getsize(path) // 2)
    before = copy.deepcopy(opt.state_dict())  # in-memory state comes back live: copy it
    with pytest.raises(ckpt.CheckpointError, match=re.escape(os.path.basename(path))):
        ckpt.load_checkpoint(opt, tmp_path / "c")
    assert_same_state(before, opt.state_dict())
    train(opt, params, [2])


def test_a_truncated_data_file_is_found(tmp_path, opt_and_params):
    """A data file shorter than the manifest says (a lost tail) is refused with both sizes."""
    opt, params = opt_and_params
    train(opt, params, range(1))
    ckpt.save_checkpoint(opt, tmp_path / "c")
    size = os.path.getsize(ckpt_file(tmp_path / "c", "state.bin"))
    os.truncate(ckpt_file(tmp_path / "c", "state.bin"), size - 4096)
    with pytest.raises(ckpt.ChecksumError, match=f"{size - 4096} bytes, the manifest says {size}"):
        ckpt.load_checkpoint(opt, tmp_path / "c")
    train(opt, params, [1])


# -- crashes in the middle of a save ---------------------------------------------------------------


# -- SIGKILL during training with periodic checkpoints ---------------------------------------------

LOOP = textwrap.dedent('''
    """A small training loop with a checkpoint after every step, resumable from the latest."""
    import torch

    from offload import OffloadedAdamW
    from offload.checkpoint import Retention, load_checkpoint

    STEPS = 12

    def run(root, nvme, stop=STEPS):
        torch.set_num_threads(1)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 64))
        opt = OffloadedAdamW(model.parameters(), lr=1e-2, nvme_path=nvme, buffer_size=256 * 1024,
                             buffer_count=3, small_param_threshold=300)
        keep = Retention(root, keep_last=2) if root else None
        start = 0
        if keep is not None and keep.latest() is not None:
            extra = load_checkpoint(opt, keep.latest())
            model.load_state_dict(extra["model"])
            start = extra["step"]
        for step in range(start, stop):
            g = torch.Generator().manual_seed(1000 + step)
            x, y = torch.randn(32, 64, generator=g), torch.randn(32, 64, generator=g)
            loss = ((model(x) - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if keep is not None:
                keep.save(opt, step + 1, extra={"model": model.state_dict(), "step": step + 1})
        return model, opt
''')

ZYGOTE = textwrap.dedent('''
    # Imports torch and warms up once, then forks one training run per request, so that each trial
    # starts training at once and the kill lands somewhere in the loop.
    import os, shutil, sys, time
    sys.path.insert(0, sys.argv[1])
    import loop
    warm = os.path.join(sys.argv[1], "warm")
    loop.run(warm, warm + "-nvme")[1].close()
    shutil.rmtree(warm)
    t0 = time.monotonic()
    loop.run(warm, warm + "-nvme")[1].close()
    print("ready", time.monotonic() - t0, flush=True)
    for line in sys.stdin:
        root, nvme = line.split()
        pid = os.fork()
        if pid == 0:
            try:
                loop.run(root, nvme)
            finally:
                os._exit(0)
        print(pid, flush=True)
        sys.stdin.readline()  # reap only when told, so the pid cannot be reused before the kill
        os.waitpid(pid, 0)
        print("reaped", flush=True)
''')


def test_sigkill_at_random_points_then_resume_equals_the_uninterrupted_run(tmp_path):
    """Training killed with SIGKILL at random moments (mid-step, mid-save, mid-commit) and resumed from
    the latest checkpoint ends with the same parameters and optimizer state, bit for bit, as a run
    that was never interrupted."""
    (tmp_path / "loop.py").write_text(LOOP)
    (tmp_path / "zygote.py").write_text(ZYGOTE)
    spec = importlib.util.spec_from_file_location("ckpt_test_loop", tmp_path / "loop.py")
    loop = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loop)

    threads = torch.get_num_threads()
    zygote = subprocess.Popen([sys.executable, str(tmp_path / "zygote.py"), str(tmp_path)], cwd=REPO,
                              env=python_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              start_new_session=True)  # its group: what a failed test leaves is killed with it
    try:
        # The reference run, while the zygote imports torch.
        ref_model, ref_opt = loop.run(None, str(tmp_path / "nvme-ref"))
        word, seconds = zygote.stdout.readline().split()
        assert word == "ready"
        step_s = float(seconds) / loop.STEPS  # one step with its checkpoint, as the warm run took it
        rng = random.Random(1234)
        resumed_from = []
        # Resuming from the middle is the property, so kills are placed by progress, not by the clock:
        # once checkpoint k (1 <= k < STEPS - 1) is seen on disk, the kill comes at a random moment of the
        # next step and its save (mid-step, mid-save, mid-commit), whatever the machine's speed.
        for trial in range(6):
            root = tmp_path / f"trial{trial}"
            k = rng.randint(1, loop.STEPS - 2)
            zygote.stdin.write(f"{root} {tmp_path / f'nvme-kill{trial}'}\n")
            zygote.stdin.flush()
            pid = int(zygote.stdout.readline())
            _wait_for_checkpoint(ckpt.Retention(root), k, pid)
            time.sleep(rng.uniform(0.0, 1.5 * step_s))
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            zygote.stdin.write("reap\n")
            zygote.stdin.flush()
            assert zygote.stdout.readline().strip() == "reaped"
            latest = ckpt.Retention(root).latest()
            assert latest is not None, f"trial {trial}: checkpoint {k} was seen, then none was left"
            resumed_from.append(os.path.basename(latest))
            model, opt = loop.run(str(root), str(tmp_path / f"nvme-resume{trial}"))
            for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
                assert torch.equal(p, q), f"trial {trial} (resumed from {latest}): {name} differs"
            assert_same_state(opt.state_dict(), ref_opt.state_dict())
            opt.close()
        print("resumed from:", resumed_from)
        final = os.path.basename(ckpt.Retention(tmp_path).path_for(loop.STEPS))
        assert [r for r in resumed_from if r != final], f"no trial resumed mid-run: {resumed_from}"
        ref_opt.close()
    finally:
        torch.set_num_threads(threads)
        zygote.stdin.close()
        try:
            zygote.wait(timeout=30)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(zygote.pid, signal.SIGKILL)  # a run the zygote forked and nobody reaped (a failed test)


def _wait_for_checkpoint(keep, step: int, pid: int, timeout: float = 120.0) -> None:
    """Return once ``keep`` holds a complete checkpoint of ``step`` or later; fail if the run ``pid`` ends
    first or nothing comes within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        latest = keep.latest()
        if latest is not None and int(os.path.basename(latest).split("-")[1]) >= step:
            return
        if _exited(pid):
            raise AssertionError(f"the training run ended before checkpoint {step} appeared in {keep.root}")
        time.sleep(0.002)
    raise AssertionError(f"no checkpoint {step} in {keep.root} after {timeout:.0f} s")


def _exited(pid: int) -> bool:
    """Whether process ``pid`` (not yet reaped by its parent) has ended."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


# -- a file system without O_DIRECT ---------------------------------------------------------------


def test_a_file_system_without_o_direct_works_for_optimizer_weights_and_checkpoints(tmpfs, monkeypatch):
    """o_direct "auto" on ramfs (which refuses O_DIRECT): the optimizer, offload_parameters and a checkpoint
    all fall back to buffered I/O with one warning for the file system, train like torch bit for bit,
    resume from the checkpoint, and leave no file behind."""
    import warnings

    from helpers import TINY, Net, loss_of

    from offload import offload_parameters, restore_parameters
    from offload.aio import files as aio_files

    disk = tmpfs(kind="ramfs")
    monkeypatch.setattr(aio_files, "_warned", set())  # as if no warning had been given yet
    torch.manual_seed(0)
    ref, model = Net(), Net()
    model.load_state_dict(ref.state_dict())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        offload_parameters(model, nvme_path=str(disk / "params"), **TINY)
        opt = OffloadedAdamW(model.parameters(), lr=1e-2, nvme_path=str(disk / "opt"), **SMALL)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
        try:
            for step in range(3):
                for m, o in ((model, opt), (ref, ref_opt)):
                    loss_of(m, step).backward()
                    o.step()
                    o.zero_grad()
            opt.save_checkpoint(disk / "ckpt", model=model)
            opt.load_checkpoint(disk / "ckpt", model=model)
            for m, o in ((model, opt), (ref, ref_opt)):
                loss_of(m, 3).backward()
                o.step()
        finally:
            opt.close()
            restore_parameters(model)
    assert_same(list(model.parameters()), list(ref.parameters()))
    refusals = [w for w in caught if "O_DIRECT" in str(w.message)]
    assert len(refusals) == 1, [str(w.message) for w in caught]
    left = sorted(str(p.relative_to(disk)) for p in disk.rglob("*") if p.is_file())
    assert all(p.startswith("ckpt/") for p in left), left
