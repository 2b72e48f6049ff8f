"""Crash consistency, proven on a file system that loses power: checkpoints written onto tests/powerloss.py
(which keeps only what fsync made durable when the power goes) are cut after every sync of a save, a mirror,
a Retention save-and-prune and a job's save (gloo ranks of tests/dist_ckpt_worker.py); after each cut the
newest committed checkpoint or the previous one loads bit for bit, no half-written one is taken as valid,
and a user's file beside them is still there."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
import warnings

import pytest
import torch
from helpers import REPO, SMALL, THREE_SIZES, assert_same_state, locks_held, make_params, python_env, train

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
        """The flocks this process holds on the file system."""
        return locks_held(self.root)


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


@pytest.mark.parametrize("milestone", [False, True], ids=["save-and-prune", "milestone"])
def test_retention_cut_at_every_sync_of_a_save_and_prune_keeps_a_loadable_latest(disk, trained, tmp_path, milestone):
    """Retention(keep_last=1) saving step 3 (marked a milestone, or not) and pruning step 2, the power lost after
    each sync: the latest checkpoint it finds loads bit for bit to step 2's or step 3's state (step 3's once the
    save returned), a milestone is never lost (a marked one is there whole), and nothing else under the root
    is."""
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
        if os.path.exists(keep.path_for(3) + ".keep"):  # marked: the checkpoint is there, whole
            assert matches(state_of(keep.path_for(3), str(tmp_path / "load")), states) == ["s3"]
        with open(os.path.join(root, "README"), "rb") as f:
            assert f.read() == b"runs of the model\n"

    cut_at_every_sync(disk, lambda: keep.save(opt, 3, milestone=milestone), check)


def same(a, b) -> bool:
    """Two nested structures of tensors and numbers are equal bit for bit."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def run_job(root: str, actions: list, world: int) -> tuple[list | None, list, str]:
    """Run ``actions`` on ``world`` gloo ranks of tests/dist_ckpt_worker.py (state and logs under ``root``);
    returns the ranks' exit codes, their logs and a report for failed assertions."""
    spec = {"init": f"file://{root}/store", "root": root, "actions": actions, "seed": 0, "timeout": 30}
    worker = os.path.join(REPO, "tests", "dist_ckpt_worker.py")
    done = subprocess.run([sys.executable, worker, json.dumps({"world": world, "timeout": 120, "jobs": [spec]})],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=python_env(),
                          timeout=180)

    def read(name, default):
        path = os.path.join(root, "out", name)
        return json.load(open(path)) if os.path.exists(path) else default

    codes, logs = read("returncodes.json", None), [read(f"rank{r}.json", []) for r in range(world)]
    explain = "\n".join(f"--- rank {r}: {json.dumps(log)}" for r, log in enumerate(logs)) + \
        f"\n--- exit codes {codes}, output:\n{done.stdout[-5000:]}"
    return codes, logs, explain


def cut_rounds(disk: Disk, save: dict, after: list) -> list:
    """A job's actions for the worker's "repeat": the power lost after the k-th sync of ``save`` (rank 0
    arms and crashes the disk, between barriers), then ``after``, until a save completes with the power on."""
    return [{"do": "barrier"},
            {"do": "powerloss", "control": disk.control, "cmd": "arm {k}", "ranks": [0]},
            {"do": "barrier"},
            save,
            {"do": "barrier"},
            {"do": "powerloss", "control": disk.control, "cmd": "crash", "ranks": [0]},
            {"do": "no_locks", "dir": disk.root, "required": True},  # a failed save let its locks go
            {"do": "barrier"},
            *after]


GENERATION_FILE = re.compile(r"^(?:state|memory|extra|params|model|manifest)\.[0-9a-f]{16}\.(?:bin|pt|json)$")


def test_a_job_save_cut_at_every_sync_leaves_the_previous_or_the_new_checkpoint(disk, tmp_path):
    """Two gloo ranks save a job's checkpoint into a directory on the disk, the power lost after each sync of
    the save (of either rank): over the checkpoint they saved a step before, and into a new directory. No
    rank hangs; after the power comes back the directory verifies and loads on both ranks bit for bit to
    the previous save's state or to this one's (this one's once the save returned with the power on), the
    same on both, or, where there was none before, is no checkpoint at all or the new one; what a dead
    save left is only files of its generation, and a user's file beside it is intact. The ranks' swap
    spaces are not on the disk."""
    world, target, notes = 2, disk.path("job"), disk.path("notes.txt")
    durable_file(notes, b"mine\n")
    root = str(tmp_path / "run")
    os.makedirs(root)
    good = str(tmp_path / "good")  # step 2's checkpoint, off the disk: each round of "job" starts from it
    over = cut_rounds(disk, {"do": "save", "dir": target},
                      [{"do": "listdir", "dir": disk.root}, {"do": "listdir", "dir": target},
                       {"do": "verify", "dir": target}, {"do": "load", "dir": target}, {"do": "dump", "tag": "k{k}"},
                       {"do": "cat", "file": notes}, {"do": "load", "dir": good}])
    fresh = disk.path("new-{k}")  # a new directory each round
    new = cut_rounds(disk, {"do": "save", "dir": fresh},
                     [{"do": "verify", "dir": fresh}, {"do": "load", "dir": fresh}, {"do": "dump", "tag": "n{k}"},
                      {"do": "cat", "file": notes}, {"do": "load", "dir": good}])
    codes, logs, explain = run_job(root, [
        {"do": "train", "steps": 1},
        {"do": "save", "dir": target},
        {"do": "dump", "tag": "s1"},
        {"do": "train", "steps": 1},
        {"do": "save", "dir": good},
        {"do": "dump", "tag": "s2"},
        {"do": "repeat", "max": 100, "actions": over},
        {"do": "repeat", "max": 100, "actions": new},
        {"do": "verify", "dir": target},
        {"do": "listdir", "dir": disk.root},
    ], world)
    assert codes == [0] * world, explain  # no rank hung (the worker kills one past its timeout) or held a lock
    assert all(len(log) > 6 and all(e["ok"] for e in log[:6]) for log in logs), explain
    repeats = [[e for e in log if e["do"] == "repeat" and "round" not in e] for log in logs]
    assert all(len(r) == 2 and r[0]["ok"] and r[1]["ok"] for r in repeats), explain
    assert repeats[0] == repeats[1] and max(r["result"] for r in repeats[0]) < 100, explain

    def dump(rank, tag):
        return torch.load(os.path.join(root, "out", f"rank{rank}-{tag}.pt"), weights_only=True)

    states = [{"s1": dump(r, "s1"), "s2": dump(r, "s2")} for r in range(world)]
    assert not same(states[0]["s1"], states[0]["s2"])

    seen, new_seen = [], []
    over_n, new_n = (r["result"] for r in repeats[0])
    ends = [next(i for i, e in enumerate(log) if e["do"] == "repeat" and "round" not in e) for log in logs]
    for phase, n in (("over", over_n), ("new", new_n)):
        for k in range(n):
            of_phase = [log[:end] if phase == "over" else log[end + 1:] for log, end in zip(logs, ends)]
            by_rank = [[e for e in entries if e.get("round") == k] for entries in of_phase]
            where = f"{phase}: power lost after sync {k} of the save: {json.dumps(by_rank)}"
            statuses = [e["result"] for e in by_rank[0] if e["do"] == "powerloss"]
            saved = [next(e for e in entries if e["do"] == "save") for entries in by_rank]
            completed = all(e["ok"] for e in saved) and not statuses[-1]["stopped"]
            found = []
            for r, entries in enumerate(by_rank):
                named = {e["do"]: e for e in entries if e["do"] != "load"}
                assert all(e["ok"] for e in entries if e["do"] in ("powerloss", "barrier", "listdir", "cat")), where
                assert named["cat"]["result"] == "mine\n", where
                loads = [e for e in entries if e["do"] == "load"]
                if phase == "new" and not named["verify"]["ok"]:  # no checkpoint there: refused, not loaded
                    assert not completed, where
                    assert named["verify"]["type"] in ("CheckpointError", "FileNotFoundError"), where
                    assert not loads[0]["ok"] and loads[1]["ok"], where
                    found.append(None)
                    continue
                assert all(e["ok"] for e in entries if e["do"] != "save"), where
                state = dump(r, f"{'n' if phase == 'new' else 'k'}{k}")
                match = [name for name, want in states[r].items() if same(state, want)]
                assert match in ((["s2"],) if phase == "new" else (["s1"], ["s2"])), where
                assert named["verify"]["result"] == int(match[0][1:]), where  # its job manifest's step
                assert not completed or match == ["s2"], where
                found.append(match[0])
                if phase == "over":
                    listings = [e["result"] for e in entries if e["do"] == "listdir"]
                    assert listings[0] == [".powerloss", "job", "notes.txt"], where
                    rest = set(listings[1]) - {"manifest.json", "rank-00000", "rank-00001"}
                    assert len(rest) == len(listings[1]) - 3 and all(GENERATION_FILE.match(n) for n in rest), where
            assert found[0] == found[1], f"the ranks hold different saves: {where}"
            (seen if phase == "over" else new_seen).append(found[0])
        assert completed, f"{phase}: the last save did not complete with the power on: {where}"
    assert set(seen) == {"s1", "s2"} and set(new_seen) == {None, "s2"}, (seen, new_seen)
    # Over a checkpoint, a cut after the commit's rename was durable (not only the final round, whose save
    # completed) leaves the new one: the test must have cut there.
    assert "s2" in seen[:-1], seen
    # "job" is still step 2's checkpoint after the power losses of the saves into new directories
    assert all(log[-2]["ok"] and log[-2]["result"] == 2 for log in logs), explain
    made = {f"new-{k}" for k in range(new_n)}
    assert all({".powerloss", "job", "notes.txt"} <= set(log[-1]["result"]) <= made | {".powerloss", "job", "notes.txt"}
               for log in logs), explain
    assert over_n - 1 >= 10 and new_n - 1 >= 10, f"the saves made only {over_n - 1} and {new_n - 1} syncs"


# -- the other save paths: weights alone, import, Hugging Face saves --------------------------------------


def test_save_parameters_and_import_cut_at_every_sync_leave_the_previous_or_the_new(disk, trained, tmp_path):
    """save_parameters (weights alone) and import_state_dict, each over what it wrote before on the disk, the power
    lost after each sync: the weights load to the previous or the new values (the new once it returned), the
    imported state to the previous or the new state, and a user's file beside them is intact."""
    opt, step, states = trained
    durable_file(disk.path("notes.txt"), b"mine\n")
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    old = {k: v.clone() for k, v in model.state_dict().items()}
    ckpt.save_parameters(model, disk.path("weights"))
    with torch.no_grad():
        model.weight.add_(1)
    new = {k: v.clone() for k, v in model.state_dict().items()}

    def check_weights(completed):
        back = torch.nn.Linear(16, 16)
        ckpt.load_parameters(back, disk.path("weights"))
        got = back.state_dict()
        found = [name for name, want in (("old", old), ("new", new)) if all(torch.equal(got[k], want[k]) for k in want)]
        assert found in (["old"], ["new"]) and (not completed or found == ["new"]), found
        assert open(disk.path("notes.txt"), "rb").read() == b"mine\n"

    assert cut_at_every_sync(disk, lambda: ckpt.save_parameters(model, disk.path("weights")), check_weights) >= 3

    step(1)
    ckpt.save_checkpoint(opt, tmp_path / "c1")
    ckpt.export_checkpoint(tmp_path / "c1", tmp_path / "s1.pt")
    step(2)
    ckpt.save_checkpoint(opt, tmp_path / "c2")
    ckpt.export_checkpoint(tmp_path / "c2", tmp_path / "s2.pt")
    ckpt.import_state_dict(tmp_path / "s1.pt", disk.path("imported"), like=tmp_path / "c1")

    def check_import(completed):
        found = matches(state_of(disk.path("imported"), str(tmp_path / "load")), states)
        assert found in (["s1"], ["s2"]) and (not completed or found == ["s2"]), found
        assert open(disk.path("notes.txt"), "rb").read() == b"mine\n"

    cut_at_every_sync(disk, lambda: ckpt.import_state_dict(tmp_path / "s2.pt", disk.path("imported"),
                                                            like=tmp_path / "c1"), check_import)


def test_hugging_face_saves_cut_at_every_sync_leave_the_previous_or_the_new(disk):
    """save_into (over a save of ours, in a run's directory holding a user's file) and save_pretrained into a
    new directory, the power lost after each sync: the previous save or the new one loads whole (the new one once
    it returned; the load settles what the cut save left, so never config.json of one save beside the weights
    of the other), a new directory holds no save or the whole one, the user's file is intact, and the next save
    leaves nothing of the dead ones."""
    import json as _json

    from offload.pretrained import SafetensorsCheckpoint, save_pretrained
    from offload.pretrained.save import STAGING, save_into

    class Config:
        def __init__(self, version):
            self.version = version

        def save_pretrained(self, directory):
            with open(os.path.join(directory, "config.json"), "w") as f:
                _json.dump({"version": self.version}, f)

    def model_of(seed):
        torch.manual_seed(seed)
        m = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(3)])
        m.config = Config(seed)
        return m

    def weights(d):
        with SafetensorsCheckpoint(d) as c:
            return {n: c.read(n).clone() for n in c.entries}

    def same(a, b):
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    old, new = model_of(1), model_of(2)
    run = disk.path("run")
    os.makedirs(run)
    durable_file(os.path.join(run, "notes.txt"), b"mine\n")
    fd = os.open(disk.root, os.O_RDONLY)  # the run's directory itself, durable as a user's would be
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    save_into(old, run, max_shard_size="3KB")

    def check(completed, d, before):
        try:
            found = weights(d)
        except ckpt.CheckpointError as err:
            assert before is None and ("holds neither" in str(err) or "no such file" in str(err)), err
            assert not completed
            return
        assert any(same(found, m.state_dict()) for m in ([new] if before is None else [old, new]))
        assert not completed or same(found, new.state_dict())

    syncs = cut_at_every_sync(disk, lambda: save_into(new, run, max_shard_size="6KB"), lambda c: check(c, run, old))
    assert syncs >= 8, syncs
    assert open(os.path.join(run, "notes.txt"), "rb").read() == b"mine\n"
    assert not [n for n in os.listdir(run) if n.startswith(STAGING)]
    export = disk.path("export")
    cut_at_every_sync(disk, lambda: save_pretrained(new, export, max_shard_size="3KB", overwrite=True),
                      lambda c: check(c, export, None))
    assert not [n for n in os.listdir(export) if n.startswith(STAGING)]


def test_single_file_outputs_cut_at_every_sync_leave_the_previous_or_the_new(disk, trained, tmp_path):
    """A ``.pt`` export (export_checkpoint) and a Lightning ``.ckpt`` (written whole by the integration), each
    over the one written before, the power lost after each sync: the file loads to the previous or the new
    contents (the new once the write returned), never a torn file; a user's file beside them is intact, and no
    staged name of ours is left once a write completes."""
    from offload.integrations.lightning import _write_whole

    opt, step, states = trained
    durable_file(disk.path("notes.txt"), b"mine\n")
    step(1)
    ckpt.save_checkpoint(opt, tmp_path / "c1")
    step(2)
    ckpt.save_checkpoint(opt, tmp_path / "c2")
    out = disk.path("state.pt")
    ckpt.export_checkpoint(tmp_path / "c1", out)
    first = torch.load(out, weights_only=True)
    ckpt.export_checkpoint(tmp_path / "c2", tmp_path / "s2.pt")
    second = torch.load(tmp_path / "s2.pt", weights_only=True)

    def same(a, b):
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else
                                            (same(a[k], b[k]) if isinstance(a[k], dict) else a[k] == b[k]) for k in a)

    def check(path, old, new):
        def judge(completed):
            got = torch.load(path, weights_only=True)
            found = [name for name, want in (("old", old), ("new", new)) if same(got, want)]
            assert found in (["old"], ["new"]) and (not completed or found == ["new"]), found
            assert open(disk.path("notes.txt"), "rb").read() == b"mine\n"
        return judge

    assert cut_at_every_sync(disk, lambda: ckpt.export_checkpoint(tmp_path / "c2", out), check(out, first, second)) >= 2
    assert sorted(os.listdir(disk.root)) == [".powerloss", "notes.txt", "state.pt"]

    ckpt_path = disk.path("run", "last.ckpt")
    old, new = {"epoch": 1, "w": torch.arange(8.0)}, {"epoch": 2, "w": torch.arange(8.0) * 2}
    _write_whole(old, ckpt_path)  # its directory made too, durably
    assert cut_at_every_sync(disk, lambda: _write_whole(new, ckpt_path), check(ckpt_path, old, new)) >= 2
    assert os.listdir(disk.path("run")) == ["last.ckpt"]
