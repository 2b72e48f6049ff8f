"""A second level: committed checkpoints copied atomically and verified, loads that fall back to the copy,
retention per level that never deletes the last good copy nor one in use, and SIGKILL mid-save and mid-copy."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import SMALL, assert_same_state, ckpt_file, flip_bit, make_params, python_env, train

from offload import OffloadedAdamW
from offload import checkpoint as ckpt
from offload.errors import ChecksumError
from offload.tools.ckpt_cli import main as ckpt_main


def make_opt(params, nvme, **kw):
    return OffloadedAdamW(params, lr=1e-2, nvme_path=nvme, **{**SMALL, **kw})


def test_retention_with_a_mirror_copies_it_verified_and_a_corrupt_local_copy_loads_from_the_mirror(
        tmp_path, nvme, closing):
    """Retention(mirror=) leaves a verified byte-for-byte copy of an asynchronous save on the second level;
    when the local checkpoint is corrupt or gone, load_latest loads the copy, with a warning."""
    params = make_params()
    opt = closing(make_opt(params, nvme))
    train(opt, params, range(2))
    expected = copy.deepcopy(opt.state_dict())
    keep = ckpt.Retention(tmp_path / "local", mirror=tmp_path / "remote")
    handle = keep.save(opt, 2, blocking=False)
    train(opt, params, range(2, 4))
    handle.wait()
    ckpt.wait_for_saves(opt)  # and the copy to the mirror
    local, remote = keep.path_for(2), keep.mirror.path_for(2)
    for name in ckpt.read_manifest(local)["files"]:
        assert open(ckpt_file(local, name), "rb").read() == open(ckpt_file(remote, name), "rb").read()
    flip_bit(ckpt_file(local, "state.bin"), 100)
    with pytest.warns(RuntimeWarning, match="trying the mirror's copy"):
        assert keep.load_latest(opt)[0] == remote
    assert_same_state(copy.deepcopy(opt.state_dict()), expected)
    os.rename(local, tmp_path / "gone")
    assert keep.load_latest(opt)[0] == remote
    assert_same_state(copy.deepcopy(opt.state_dict()), expected)


def test_save_and_load_take_no_mirror_of_their_own(tmp_path, nvme, closing):
    """A second copy is Retention's (mirror=): save_checkpoint and load_checkpoint refuse the arguments
    that used to ask for one, as any unknown argument."""
    params = make_params()
    opt = closing(make_opt(params, nvme))
    with pytest.raises(TypeError, match="mirror_to"):
        ckpt.save_checkpoint(opt, tmp_path / "c", mirror_to=tmp_path / "remote")
    with pytest.raises(TypeError, match="mirror"):
        ckpt.load_checkpoint(opt, tmp_path / "c", mirror=tmp_path / "remote")
    assert sorted(os.listdir(tmp_path)) == ["nvme"]


def test_a_mirror_whose_copy_reads_back_wrong_is_not_committed(tmp_path, nvme, closing):
    """A copy that differs from the manifest when read back (a drive that corrupts writes) fails with
    ChecksumError, and the destination keeps what it had."""
    params = make_params()
    opt = closing(make_opt(params, nvme))
    train(opt, params, range(1))
    ckpt.save_checkpoint(opt, tmp_path / "c")

    class Corrupting(ckpt.Storage):
        def copy_file(self, src, dst, bar):
            super().copy_file(src, dst, bar)
            if os.path.basename(dst).startswith("state."):
                flip_bit(dst, 4096)

    with pytest.raises(ChecksumError):
        ckpt.mirror_checkpoint(tmp_path / "c", tmp_path / "remote" / "c", storage=Corrupting())
    assert not os.path.exists(tmp_path / "remote" / "c") and os.listdir(tmp_path / "remote") == []


def test_cli_mirror_copies_and_refuses_a_directory_that_is_not_ours(tmp_path, nvme, closing, capsys):
    """`offload-ckpt mirror SRC DST` writes a verified copy; a DST that is someone else's directory is
    refused (exit 1) and left alone."""
    params = make_params()
    opt = closing(make_opt(params, nvme))
    train(opt, params, range(1))
    ckpt.save_checkpoint(opt, tmp_path / "c")
    assert ckpt_main(["mirror", str(tmp_path / "c"), str(tmp_path / "copy")]) == 0
    assert ckpt.verify_checkpoint(tmp_path / "copy")
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "notes.txt").write_text("keep me")
    assert ckpt_main(["mirror", str(tmp_path / "c"), str(tmp_path / "theirs")]) == 1
    assert (tmp_path / "theirs" / "notes.txt").read_text() == "keep me"
    assert "not an nvme-offload checkpoint" in capsys.readouterr().err


def test_retention_keeps_per_level_and_never_deletes_one_held_open_by_another_process(tmp_path, nvme, closing):
    """Each level keeps its own last N; a checkpoint whose file another process holds open is not deleted
    (until it is closed); the newest is always verified first."""
    params = make_params()
    opt = closing(make_opt(params, nvme))
    keep = ckpt.Retention(tmp_path / "local", keep_last=1, mirror=ckpt.Retention(tmp_path / "remote", keep_last=2))
    train(opt, params, range(1))
    keep.save(opt, 1)
    holder = subprocess.Popen([sys.executable, "-c", "import sys; f = open(sys.argv[1], 'rb'); print('open', "
                               "flush=True); sys.stdin.readline()", ckpt_file(keep.path_for(1), "state.bin")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        for step in (2, 3):
            train(opt, params, range(step, step + 1))
            keep.save(opt, step, blocking=False).wait()
        ckpt.wait_for_saves(opt)
        assert [os.path.basename(p) for p in keep.checkpoints()] == ["step-0000000001", "step-0000000003"]
        assert [os.path.basename(p) for p in keep.mirror.checkpoints()] == ["step-0000000002", "step-0000000003"]
    finally:
        holder.stdin.close()
        holder.wait(10)
    keep.prune()
    assert [os.path.basename(p) for p in keep.checkpoints()] == ["step-0000000003"]
    path, _ = keep.load_latest(opt)
    assert path == keep.path_for(3)


KILLED = """
import sys, torch
sys.path.insert(0, sys.argv[3])
from helpers import SMALL, make_params, train
from offload import OffloadedAdamW
from offload.checkpoint import Retention
params = make_params()
opt = OffloadedAdamW(params, lr=1e-2, nvme_path=sys.argv[2], **SMALL)
keep = Retention(sys.argv[1] + "/local", keep_last=2, mirror=sys.argv[1] + "/remote")
for step in range(1, 1000):
    train(opt, params, range(step, step + 1))
    keep.save(opt, step, blocking=False)
    print(step, flush=True)
"""


def test_sigkill_during_async_saves_and_mirroring_leaves_each_level_a_good_checkpoint(tmp_path):
    """A loop saving asynchronously with a mirror, killed with SIGKILL at random moments: at each level
    every checkpoint that exists verifies and loads (none verifies and is wrong)."""
    import random

    rng = random.Random(7)
    tests = os.path.dirname(os.path.abspath(__file__))
    for trial in range(2):
        root = tmp_path / f"t{trial}"
        proc = subprocess.Popen([sys.executable, "-c", KILLED, str(root), str(tmp_path / f"nvme{trial}"), tests],
                                stdout=subprocess.PIPE, text=True, env=python_env())
        try:
            for _ in range(3 + trial):
                proc.stdout.readline()
            time.sleep(rng.uniform(0, 0.3))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        for level in ("local", "remote"):
            found = ckpt.Retention(root / level).checkpoints()
            for path in found:
                ckpt.verify_checkpoint(path)
        assert ckpt.Retention(root / "local").checkpoints(), "no local checkpoint survived"
        params = make_params(seed=2)
        opt = make_opt(params, str(tmp_path / f"nvme-load{trial}"))
        try:
            keep = ckpt.Retention(root / "local", mirror=root / "remote")
            path, _ = keep.load_latest(opt)
            assert path is not None
        finally:
            opt.close()


def test_pruning_keeps_the_newest_checkpoint_that_verifies_when_newer_ones_are_corrupt(tmp_path, nvme, closing):
    """With the newest checkpoint corrupt, pruning to keep_last=1 keeps it (it may be repaired or
    inspected) and also the newest one that verifies; only older ones go."""
    params = make_params()
    opt = closing(make_opt(params, nvme))
    writer = ckpt.Retention(tmp_path, keep_last=5)
    for step in (1, 2, 3):
        train(opt, params, range(step, step + 1))
        writer.save(opt, step)
    flip_bit(ckpt_file(writer.path_for(3), "state.bin"), 10)
    with pytest.warns(RuntimeWarning, match="does not verify"):
        removed = ckpt.Retention(tmp_path, keep_last=1).prune()
    assert removed == [writer.path_for(1)]
    assert writer.checkpoints() == [writer.path_for(2), writer.path_for(3)]
