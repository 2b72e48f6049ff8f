"""Another local user cannot stop checkpointing: a checkpoint directory's lock is a 0600 file of ours, so a
user who may read the directory (a user-made 0755 one, files shared with ``OFFLOAD_FILE_MODE=0644``) can
neither open nor lock it; a lock file others can open is waited for a bounded time, then refused naming
who holds it. Run as root (the attacker is ``nobody``, made by dropping privileges)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from helpers import SMALL, THREE_SIZES, make_params, train
from test_special_files import deadline

from offload import OffloadedAdamW, locks
from offload import checkpoint as ckpt
from offload.checkpoint import commit
from offload.locks import LOCK_FILE
from offload.tools.ckpt_cli import main as ckpt_main

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to act as another user (nobody)")

NOBODY = 65534

# ``python -c ATTACK DIR MAKE``: opens DIR (as root, standing for any user allowed to list it), becomes nobody,
# flocks DIR itself exclusively (what stopped saves before), then tries to open (or, with MAKE, create and make
# world-readable) the lock file in it and lock that too; prints what it holds, and holds it until a line
# arrives on stdin.
ATTACK = """
import fcntl, os, sys
d = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
os.setgid(65534)
os.setuid(65534)
fcntl.flock(d, fcntl.LOCK_EX)
held = ["directory"]
try:
    flags = os.O_RDONLY | (os.O_CREAT if sys.argv[2] == "make" else 0)
    fd = os.open(".nvme-offload.lock", flags, 0o666, dir_fd=d)
    if sys.argv[2] == "make":
        os.fchmod(fd, 0o666)
    fcntl.flock(fd, fcntl.LOCK_EX)
    held.append("lock file")
except OSError as err:
    held.append(type(err).__name__)
print(" ".join(held), flush=True)
sys.stdin.readline()
"""


def _attacker(directory, make: bool = False) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", ATTACK, str(directory), "make" if make else "open"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip()
    assert line, proc.stderr.read()
    return proc, line


def _saved(tmp_path, monkeypatch):
    """An optimizer and a checkpoint of it in a user-made 0755 directory, files readable by others."""
    monkeypatch.setenv("OFFLOAD_FILE_MODE", "0644")
    target = tmp_path / "ckpt"
    target.mkdir(mode=0o755)
    os.chmod(target, 0o755)
    params = make_params(THREE_SIZES)
    opt = OffloadedAdamW(params, lr=1e-2, nvme_path=str(tmp_path / "swap"), **SMALL)
    train(opt, params, range(1))
    ckpt.save_checkpoint(opt, target, extra={"step": 1})
    return opt, params, target


def test_another_user_locking_the_directory_stops_no_save_load_or_verify(tmp_path, monkeypatch, capsys):
    """While another user holds an exclusive flock on a checkpoint directory they may list, and has tried to
    open its lock file (refused: it is 0600, ours), saves, loads, offload-ckpt verify and Retention go on at
    once instead of waiting for ever."""
    opt, params, target = _saved(tmp_path, monkeypatch)
    proc = None
    try:
        with deadline(60):
            ckpt.verify_checkpoint(target)  # a reader that leaves the lock file behind would let them in
            proc, held = _attacker(target)
            assert held in ("directory PermissionError", "directory FileNotFoundError"), held
            train(opt, params, range(1, 2))
            ckpt.save_checkpoint(opt, target, extra={"step": 2})
            assert ckpt.load_checkpoint(opt, target) == {"step": 2}
            assert ckpt_main(["verify", str(target)]) == 0
            keep = ckpt.Retention(tmp_path / "runs", keep_last=1)
            keep.save(opt, 2)
            assert keep.latest() is not None
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        opt.close()
    capsys.readouterr()


def test_a_lock_file_others_can_open_is_waited_for_a_bounded_time_and_its_holder_named(tmp_path, monkeypatch):
    """In a directory others may write, another user's world-readable lock file (so the lock cannot be
    private) held by them: a save waits the bounded time for it and then raises a CheckpointError naming the
    holding process and its user, instead of waiting for ever; once they let go, the save goes on."""
    monkeypatch.setattr(locks, "SHARED_LOCK_TIMEOUT_S", 0.5)
    params = [torch.nn.Parameter(torch.zeros(100))]
    opt = OffloadedAdamW(params, nvme_path=str(tmp_path / "swap"))
    target = tmp_path / "shared"
    target.mkdir()
    os.chmod(target, 0o777)
    proc = None
    try:
        proc, held = _attacker(target, make=True)
        assert held == "directory lock file", held
        assert os.stat(target / LOCK_FILE).st_uid == NOBODY
        with deadline(30), pytest.raises(ckpt.CheckpointError, match=rf"can be opened by other users, and process "
                                                                     rf"{proc.pid} \(python[^,]*, user nobody\)"):
            ckpt.save_checkpoint(opt, target)
        proc.kill()
        proc.wait()
        proc = None
        with deadline(30):
            ckpt.save_checkpoint(opt, target)
        ckpt.verify_checkpoint(target)
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        opt.close()


def test_the_lock_file_is_private_and_gone_once_nobody_holds_it(tmp_path, monkeypatch):
    """Even with OFFLOAD_FILE_MODE=0644 the lock file is 0600 while a save or a read holds it, and no file of
    the lock is left in the directory once they are done."""
    opt, params, target = _saved(tmp_path, monkeypatch)
    try:
        seen = []
        with commit.reading(target):
            seen.append(oct(os.stat(target / LOCK_FILE).st_mode & 0o777))
            with commit.reading(target):  # nested: the inner one lets go, the outer still holds it
                pass
            assert (target / LOCK_FILE).exists()
        assert seen == ["0o600"] and LOCK_FILE not in os.listdir(target)
        ckpt.load_checkpoint(opt, target)
        assert LOCK_FILE not in os.listdir(target)
    finally:
        opt.close()
