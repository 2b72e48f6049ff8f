"""Crash consistency, proven on a file system that loses power: checkpoints written onto tests/powerloss.py
(which keeps only what fsync made durable when the power goes) are cut after every sync of a save, a mirror
and a Retention save-and-prune; after each cut the newest committed checkpoint or the previous one loads bit
for bit, no half-written one is taken as valid, and a user's file beside them is still there."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import warnings

import pytest
from helpers import REPO, SMALL, THREE_SIZES, assert_same_state, make_params, train

from offload import OffloadedAdamW
from offload import checkpoint as ckpt


def _refusal() -> str | None:
    if importlib.util.find_spec("mfusepy") is None:
        return "mfusepy is not installed (make install)"
    try:
        import mfusepy  # noqa: F401 - it looks for libfuse when imported
    except (OSError, ImportError) as err:
        return f"libfuse is missing ({err}); make install installs fuse3"
    if not os.access("/dev/fuse", os.R_OK | os.W_OK) or shutil.which("fusermount3") is None:
        return "needs /dev/fuse and fusermount3 (root)"
    return None


pytestmark = pytest.mark.skipif(_refusal() is not None, reason=str(_refusal()))


class Disk:
    """The mounted file system and its control file."""

    def __init__(self, mountpoint: str):
        self.root = mountpoint
        self.control = os.path.join(mountpoint, ".powerloss")

    def status(self) -> dict:
        with open(self.control) as f:
            return json.loads(f.read())

    def arm(self, syncs: int) -> None:
        """Lose power right after the ``syncs``-th sync from now (0: now)."""
        with open(self.control, "w") as f:
            f.write(f"arm {syncs}")

    def crash(self) -> None:
        """Keep only what was durable, and serve again."""
        with open(self.control, "w") as f:
            f.write("crash")

    def path(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    def locks_held(self) -> list[str]:
        """The flocks this process holds on the file system (a failed save must let its directory's go, or
        the next reader of it waits for ever)."""
        dev = os.stat(self.root).st_dev
        where = f"{os.major(dev):02x}:{os.minor(dev):02x}:"
        with open("/proc/locks") as f:
            return [line for line in f if f" {os.getpid()} {where}" in line]


@pytest.fixture
def disk(tmp_path):
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    server = subprocess.Popen([sys.executable, os.path.join(REPO, "tests", "powerloss.py"), str(mountpoint)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    d = Disk(str(mountpoint))
    deadline = time.monotonic() + 20
    while not os.path.exists(d.control):
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            pytest.fail(f"the file system did not mount: {server.communicate()[0].decode()[-2000:]}")
        time.sleep(0.05)
    try:
        yield d
    finally:
        subprocess.run(["fusermount3", "-u", str(mountpoint)], check=False, capture_output=True)
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            subprocess.run(["fusermount3", "-uz", str(mountpoint)], check=False, capture_output=True)


def durable_file(path: str, data: bytes) -> None:
    """A user's file, written and made durable (bytes and name)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(os.path.dirname(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def state_of(path: str, nvme: str) -> dict:
    """The state a fresh optimizer has after loading checkpoint ``path``."""
    opt = OffloadedAdamW(make_params(THREE_SIZES, seed=1), lr=1e-2, nvme_path=nvme, **SMALL)
    try:
        ckpt.load_checkpoint(opt, path)
        return copy.deepcopy(opt.state_dict())
    finally:
        opt.close()


def matches(state: dict, candidates: dict) -> list:
    """The names of the ``candidates`` that ``state`` equals bit for bit."""
    out = []
    for name, want in candidates.items():
        try:
            assert_same_state(state, want)
        except AssertionError:
            continue
        out.append(name)
    return out


def cut_at_every_sync(disk: Disk, write, check) -> int:
    """Run ``write()`` with the power lost after its k-th sync, for k = 0, 1, ... until it completes with
    the power on; after each loss ``check(completed)`` judges what is left. Returns the syncs it made."""
    for k in range(200):
        disk.arm(k)
        completed = False
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                write()
            completed = not disk.status()["stopped"]
        except OSError:
            pass
        assert not disk.locks_held(), f"after the power was lost at sync {k}, a lock is still held"
        disk.crash()
        check(completed)
        if completed:
            return k
    raise AssertionError("the write never completed")


@pytest.fixture
def trained(tmp_path):
    """An optimizer, and the state it has after each of three steps (``"s1"``, ``"s2"``, ``"s3"``)."""
    params = make_params(THREE_SIZES)
    opt = OffloadedAdamW(params, lr=1e-2, nvme_path=str(tmp_path / "swap"), **SMALL)
    states = {}

    def step(n):
        train(opt, params, range(n - 1, n))
        states[f"s{n}"] = copy.deepcopy(opt.state_dict())

    yield opt, step, states
    opt.close()


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "async"])
def test_a_save_cut_at_every_sync_leaves_the_previous_or_the_new_checkpoint(disk, trained, tmp_path, blocking):
    """A save over a committed checkpoint, the power lost after each of its syncs: the directory loads to the
    state of the previous save or of this one (that one once the save returned), and verifies; a user's
    file beside it is intact."""
    opt, step, states = trained
    target = disk.path("ckpt")
    step(1)
    ckpt.save_checkpoint(opt, target)
    durable_file(disk.path("notes.txt"), b"mine\n")
    step(2)
    seen = set()

    def write():
        handle = ckpt.save_checkpoint(opt, target, blocking=blocking)
        if not blocking:
            handle.wait()

    def check(completed):
        assert ckpt.verify_checkpoint(target)
        found = matches(state_of(target, str(tmp_path / "load")), states)
        assert found in (["s1"], ["s2"]), found
        assert not completed or found == ["s2"]
        seen.add(found[0])
        with open(disk.path("notes.txt"), "rb") as f:
            assert f.read() == b"mine\n"

    syncs = cut_at_every_sync(disk, write, check)
    assert syncs >= 3 and seen == {"s1", "s2"}


def test_a_mirror_cut_at_every_sync_leaves_the_previous_or_the_new_copy(disk, trained, tmp_path):
    """mirror_checkpoint onto a disk that loses power after each of its syncs: the copy there is the one
    mirrored before, or the new one, whole and verified."""
    opt, step, states = trained
    copy_to = disk.path("mirror")
    step(1)
    ckpt.save_checkpoint(opt, tmp_path / "c1")
    ckpt.mirror_checkpoint(tmp_path / "c1", copy_to)
    step(2)
    ckpt.save_checkpoint(opt, tmp_path / "c2")

    def check(completed):
        assert ckpt.verify_checkpoint(copy_to)
        found = matches(state_of(copy_to, str(tmp_path / "load")), states)
        assert found in (["s1"], ["s2"]) and (not completed or found == ["s2"]), found

    cut_at_every_sync(disk, lambda: ckpt.mirror_checkpoint(tmp_path / "c2", copy_to), check)


def test_retention_cut_at_every_sync_of_a_save_and_prune_keeps_a_loadable_latest(disk, trained, tmp_path):
    """Retention(keep_last=1) saving step 3 and pruning step 2, the power lost after each sync: the latest
    checkpoint it finds loads bit for bit to step 2's or step 3's state (step 3's once the save returned),
    a milestone is never lost, and nothing else under the root is."""
    opt, step, states = trained
    root = disk.path("root")
    keep = ckpt.Retention(root, keep_last=1)
    step(1)
    keep.save(opt, 1, milestone=True)
    step(2)
    keep.save(opt, 2)
    durable_file(os.path.join(root, "README"), b"runs of the model\n")
    step(3)

    def check(completed):
        reader = ckpt.Retention(root, keep_last=1)
        latest = reader.latest()
        assert latest is not None
        found = matches(state_of(latest, str(tmp_path / "load")), states)
        want = ["s3"] if completed else None
        assert found in (["s2"], ["s3"]) and (want is None or found == want), (latest, found)
        assert matches(state_of(keep.path_for(1), str(tmp_path / "load")), states) == ["s1"]
        with open(os.path.join(root, "README"), "rb") as f:
            assert f.read() == b"runs of the model\n"

    cut_at_every_sync(disk, lambda: keep.save(opt, 3), check)
