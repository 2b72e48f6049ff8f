"""The commit rule: a save writes its files under fresh names, its manifest last, and one rename commits
it. A crash or an error between any two file-system operations of a save leaves the old or the new
checkpoint loadable, a user's files untouched, and nothing of ours that the next save does not clean."""

from __future__ import annotations

import copy
import errno
import json
import os
import pathlib
import re

import pytest
from helpers import FOUR_SIZES, SMALL, assert_same_state, make_params, train

import offload as offload_package
from offload import OffloadedAdamW
from offload import checkpoint as ckpt
from offload.checkpoint import commit
from offload.checkpoint.format import MANIFEST
from offload.checkpoint.manifest import digest


class Crash(BaseException):
    """Stands for the process dying: nothing after it runs, no clean-up either."""


class FailingAt(ckpt.Storage):
    """A checkpoint ``Storage`` whose ``n``-th file-system operation (fsync of a file or a directory,
    rename, unlink; counted from 0) raises ``error()``; ``seen`` gets each operation as it runs."""

    def __init__(self, n: int, error):
        self.n, self.error, self.seen = n, error, []

    def _op(self, name: str) -> None:
        self.seen.append(name)
        if len(self.seen) - 1 == self.n:
            raise self.error()

    def fsync(self, fd, path):
        self._op("fsync")
        super().fsync(fd, path)

    def rename(self, src, dst):
        self._op("rename")
        super().rename(src, dst)

    def unlink(self, path):
        self._op("unlink")
        super().unlink(path)


def ours_only(directory) -> list[str]:
    """What ``directory`` holds besides its manifest, the files it names and the user's ``notes.txt``."""
    manifest = json.loads((directory / MANIFEST).read_text())
    named = {e.get("file", n) for n, e in manifest["files"].items()}
    return sorted(set(os.listdir(directory)) - named - {MANIFEST, "notes.txt"})


@pytest.mark.filterwarnings("ignore:could not delete the previous")
@pytest.mark.parametrize("error", [Crash, lambda: OSError(errno.EIO, "injected")], ids=["crash", "error"])
def test_a_save_that_stops_anywhere_leaves_the_old_or_the_new_checkpoint(tmp_path, nvme, monkeypatch, error):
    """Stopping a save at each of its file-system operations in turn (a crash cleans nothing up; an
    error does, and one while deleting the previous generation is a warning) leaves a checkpoint that
    verifies and loads, either the previous step or the new one, with the user's files inside the
    directory and beside it untouched, and the next save leaves only what its manifest names."""
    params = make_params(FOUR_SIZES)
    opt = OffloadedAdamW(params, lr=1e-2, nvme_path=nvme, **SMALL)
    target = tmp_path / "c"
    train(opt, params, range(1))
    ckpt.save_checkpoint(opt, target, extra={"step": 1})
    (target / "notes.txt").write_text("mine")
    (tmp_path / "c.notes").write_text("mine too")
    if error is Crash:
        monkeypatch.setattr(commit.Staged, "abort", lambda self: None)  # a dead process cleans nothing
    step, n, reached = 1, 0, True
    try:
        while reached:
            train(opt, params, range(step, step + 1))
            step += 1
            expected = opt.state_dict()
            storage = FailingAt(n, error)
            try:
                ckpt.save_checkpoint(opt, target, extra={"step": step}, storage=storage)
            except (Crash, OSError):
                pass
            reached = len(storage.seen) > n  # else the save ran to its end before operation n
            found = ckpt.verify_checkpoint(target)["step"]
            assert found in (step - 1, step), f"stopped before operation {n}: step {found}"
            assert (target / "notes.txt").read_text() == "mine" and (tmp_path / "c.notes").read_text() == "mine too"
            if found == step:
                other = OffloadedAdamW(make_params(FOUR_SIZES), lr=1e-2, nvme_path=tmp_path / "other", **SMALL)
                try:
                    assert ckpt.load_checkpoint(other, target) == {"step": step}
                    assert_same_state(expected, other.state_dict())
                finally:
                    other.close()
            ckpt.save_checkpoint(opt, target, extra={"step": step})  # what a stopped save left goes here
            assert ours_only(target) == []
            n += 1
    finally:
        opt.close()
    assert n > 5  # the save's data, small files, manifest, rename, directory and deletions were each stopped


def first_format(directory) -> None:
    """Rewrite checkpoint ``directory`` as the first format laid it out: each file under its fixed name,
    no generation's names in the manifest."""
    manifest = json.loads((directory / MANIFEST).read_text())
    for name, entry in manifest["files"].items():
        os.rename(directory / entry.pop("file"), directory / name)
    manifest["manifest_xxh3_64"] = digest(manifest)
    (directory / MANIFEST).write_text(json.dumps(manifest))


def test_a_checkpoint_of_the_first_layout_loads_verifies_and_is_replaced_file_by_file(tmp_path, nvme):
    """A checkpoint whose files have fixed names (``state.bin``, ...) still verifies and loads bit for
    bit, and a save into its directory deletes exactly those files once it has committed."""
    params = make_params(FOUR_SIZES)
    opt = OffloadedAdamW(params, lr=1e-2, nvme_path=nvme, **SMALL)
    try:
        train(opt, params, range(2))
        ckpt.save_checkpoint(opt, tmp_path / "c", extra={"step": 2})
        expected = copy.deepcopy(opt.state_dict())
        first_format(tmp_path / "c")
        ckpt.verify_checkpoint(tmp_path / "c")
        train(opt, params, range(2, 3))
        assert ckpt.load_checkpoint(opt, tmp_path / "c") == {"step": 2}
        assert_same_state(expected, opt.state_dict())
        ckpt.save_checkpoint(opt, tmp_path / "c")
        assert not {"state.bin", "memory.pt", "extra.pt"} & set(os.listdir(tmp_path / "c"))
        assert ours_only(tmp_path / "c") == []
    finally:
        opt.close()


def test_a_save_inside_reading_the_same_directory_is_refused_not_deadlocked(tmp_path, nvme):
    """A thread that saves into the checkpoint it is reading would wait for itself: it is told so."""
    params = make_params(FOUR_SIZES)
    opt = OffloadedAdamW(params, lr=1e-2, nvme_path=nvme, **SMALL)
    try:
        train(opt, params, range(1))
        ckpt.save_checkpoint(opt, tmp_path / "c")
        with commit.reading(tmp_path / "c"), pytest.raises(ckpt.CheckpointError, match="reading"):
            ckpt.save_checkpoint(opt, tmp_path / "c")
        with commit.reading(tmp_path / "c"), commit.reading(tmp_path / "c"):
            ckpt.verify_checkpoint(tmp_path / "c")  # readers share the lock, nested too
    finally:
        opt.close()


def _state_after(path, nvme) -> dict:
    opt = OffloadedAdamW(make_params(FOUR_SIZES, seed=1), lr=1e-2, nvme_path=nvme, **SMALL)
    try:
        ckpt.load_checkpoint(opt, path)
        return copy.deepcopy(opt.state_dict())
    finally:
        opt.close()


def _which(state: dict, candidates: dict) -> list:
    found = []
    for name, want in candidates.items():
        try:
            assert_same_state(state, want)
        except AssertionError:
            continue
        found.append(name)
    return found


@pytest.mark.parametrize("path", ["save", "async-save", "import", "mirror", "retention-milestone"])
def test_every_save_path_killed_between_any_two_changes_leaves_the_old_or_the_new(tmp_path, path):
    """A blocking save, an asynchronous one, an import, a mirror and a Retention save (a milestone, pruning the step
    before) over what an earlier one left, the process dying at each of their changes of names in turn (renames,
    unlinks, mkdirs): what loads is the old state or the new one, whole, a user's file is intact, and the next run
    of the same path completes and leaves nothing of the dead one (no file of a generation no manifest names)."""
    from helpers import Died, dies_at

    params = make_params(FOUR_SIZES)
    opt = OffloadedAdamW(params, lr=1e-2, nvme_path=str(tmp_path / "swap"), **SMALL)
    states = {}
    try:
        train(opt, params, range(1))
        ckpt.save_checkpoint(opt, tmp_path / "c1")
        states["old"] = copy.deepcopy(opt.state_dict())
        torch_path = tmp_path / "old.pt"
        ckpt.export_checkpoint(tmp_path / "c1", torch_path)
        train(opt, params, range(1, 2))
        ckpt.save_checkpoint(opt, tmp_path / "c2")
        states["new"] = copy.deepcopy(opt.state_dict())
        ckpt.export_checkpoint(tmp_path / "c2", tmp_path / "new.pt")
    finally:
        opt.close()
    root = tmp_path / "runs"

    def target(k):
        return root / f"k{k}" / ("step-0000000002" if path == "retention-milestone" else "t")

    saver = OffloadedAdamW(make_params(FOUR_SIZES, seed=1), lr=1e-2, nvme_path=str(tmp_path / "s2"), **SMALL)

    def prepare(k):
        os.makedirs(root / f"k{k}", exist_ok=True)
        (root / f"k{k}" / "notes.txt").write_text("mine")
        if path == "import":
            ckpt.import_state_dict(torch_path, target(k), like=tmp_path / "c1")
        elif path == "mirror":
            ckpt.mirror_checkpoint(tmp_path / "c1", target(k))
        elif path.endswith("save"):
            ckpt.load_checkpoint(saver, tmp_path / "c1")
            ckpt.save_checkpoint(saver, target(k))
            ckpt.load_checkpoint(saver, tmp_path / "c2")
        else:
            ckpt.load_checkpoint(saver, tmp_path / "c1")
            ckpt.Retention(root / f"k{k}", keep_last=1).save(saver, 1)
            ckpt.load_checkpoint(saver, tmp_path / "c2")

    def run(k):
        if path == "import":
            ckpt.import_state_dict(tmp_path / "new.pt", target(k), like=tmp_path / "c1")
        elif path == "mirror":
            ckpt.mirror_checkpoint(tmp_path / "c2", target(k))
        elif path == "save":
            ckpt.save_checkpoint(saver, target(k))
        elif path == "async-save":
            ckpt.save_checkpoint(saver, target(k), blocking=False).wait()
        else:
            ckpt.Retention(root / f"k{k}", keep_last=1).save(saver, 2, milestone=True)

    total = [0]
    prepare(0)
    with dies_at(10**9, total):
        run(0)
    seen = set()
    for k in range(1, total[0] + 1):
        prepare(k)
        with pytest.raises(Died), dies_at(k, [0]):
            run(k)
        where = target(k)
        if path == "retention-milestone":
            latest = ckpt.Retention(root / f"k{k}", keep_last=1).latest()
            where = pathlib.Path(latest) if latest is not None else where
        if (where / MANIFEST).exists():
            found = _which(_state_after(where, str(tmp_path / "load")), states)
            assert found in (["old"], ["new"]), (k, found)
            seen.add(found[0])
        else:
            seen.add("none")
        assert (root / f"k{k}" / "notes.txt").read_text() == "mine"
        run(k)  # the next one completes and clears what the dead one left
        done = target(k)
        assert _which(_state_after(done, str(tmp_path / "load")), states) == ["new"]
        assert ours_only(done) == [], (k, ours_only(done))
        if path == "retention-milestone":
            assert (root / f"k{k}" / "step-0000000002.keep").is_file()
            assert sorted(os.listdir(root / f"k{k}")) == ["notes.txt", "step-0000000002", "step-0000000002.keep"]
    saver.close()
    assert "new" in seen, seen


def test_every_rename_of_the_library_is_in_its_commit_module():
    """The one commit shape holds because only offload/commit.py renames: no other module of the package calls
    os.rename, os.replace or renameat (a new writer goes through offload.commit, never around it)."""
    root = pathlib.Path(offload_package.__file__).parent
    found, files = [], sorted(root.rglob("*.py"))
    assert len(files) > 100, root  # the walk reached the package
    for path in files:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if re.search(r"os\.replace\b|os\.rename\b|renameat", line):
                found.append(f"{path.relative_to(root.parent)}:{number}: {line.strip()}")
    assert [f for f in found if not f.startswith("offload/commit.py:")] == []
    assert any("os.rename(src, dst)" in f for f in found)


def test_a_replaced_file_killed_at_every_change_is_the_old_or_the_new_and_the_next_replace_sweeps(tmp_path):
    """offload.commit.replace_file (the .pt export's, the Lightning .ckpt's, a report's commit), the process dying
    at each of its changes of a name in turn: the output holds the old bytes or the new ones, never a part, and the
    next replace leaves nothing staged beside it; with O_TMPFILE refused the same holds for the named stage."""
    from helpers import Died, dies_at

    from offload import commit as one_commit

    for tmpfile in (True, False):
        total = [0]
        probe = tmp_path / f"probe{tmpfile}"
        probe.mkdir()
        one_commit.replace_file(probe / "out.pt", lambda f: f.write(b"old"))
        with dies_at(10**9, total), _NoTmpfile(not tmpfile):
            one_commit.replace_file(probe / "out.pt", lambda f: f.write(b"new"))
        assert total[0] >= 1
        for k in range(1, total[0] + 1):
            d = tmp_path / f"run{tmpfile}{k}"
            d.mkdir()
            (d / "notes.txt").write_text("mine")
            one_commit.replace_file(d / "out.pt", lambda f: f.write(b"old"))
            with pytest.raises(Died), dies_at(k, [0]), _NoTmpfile(not tmpfile):
                one_commit.replace_file(d / "out.pt", lambda f: f.write(b"new"))
            assert (d / "out.pt").read_bytes() in (b"old", b"new")
            for n in os.listdir(d):  # what the dead commit left, as old as a stale one
                os.utime(d / n, (1e9, 1e9))
            one_commit.replace_file(d / "out.pt", lambda f: f.write(b"newer"))
            assert sorted(os.listdir(d)) == ["notes.txt", "out.pt"] and (d / "out.pt").read_bytes() == b"newer"


def test_a_replace_leaves_a_fresh_staged_file_of_another_writer_alone(tmp_path):
    """A staged file that is not stale may be another process's commit of the same output in progress (ranks
    writing one shared file): the sweep leaves it, and deletes it only once it is older than STALE_S."""
    from offload import commit as one_commit

    other = tmp_path / ".out.pt.0123456789ab.tmp"
    other.write_bytes(b"theirs, still being written")
    one_commit.replace_file(tmp_path / "out.pt", lambda f: f.write(b"mine"))
    assert other.read_bytes() == b"theirs, still being written"
    os.utime(other, (1e9, 1e9))
    one_commit.replace_file(tmp_path / "out.pt", lambda f: f.write(b"mine again"))
    assert sorted(os.listdir(tmp_path)) == ["out.pt"]


class _NoTmpfile:
    """os.open refuses O_TMPFILE (as a file system without it does) inside the block, where ``on``."""

    def __init__(self, on: bool):
        self.on = on

    def __enter__(self):
        self.real = os.open

        def refusing(path, flags, *args, **kwargs):
            if flags & os.O_TMPFILE == os.O_TMPFILE:
                raise OSError(errno.EOPNOTSUPP, "no O_TMPFILE here", path)
            return self.real(path, flags, *args, **kwargs)

        if self.on:
            os.open = refusing

    def __exit__(self, *exc):
        os.open = self.real


@pytest.mark.parametrize("kind", ["link", "directory", "fifo"])
def test_a_commit_renames_only_over_a_regular_file_or_nothing(tmp_path, kind):
    """offload.commit.rename (every rename of the library) refuses a link, a directory or a FIFO where the staged
    file would go, naming it; the staged file and what is there stay as they were."""
    from offload import commit as one_commit

    staged, there, victim = tmp_path / "staged", tmp_path / "out", tmp_path / "victim"
    staged.write_bytes(b"new")
    victim.write_bytes(b"mine")
    if kind == "link":
        there.symlink_to(victim)
    elif kind == "directory":
        there.mkdir()
    else:
        os.mkfifo(there)
    with pytest.raises(FileExistsError, match="only a regular file"):
        one_commit.rename(staged, there)
    assert staged.read_bytes() == b"new" and victim.read_bytes() == b"mine" and os.path.lexists(there)
    there_is_regular = tmp_path / "regular"
    there_is_regular.write_bytes(b"old")
    one_commit.rename(staged, there_is_regular)
    assert there_is_regular.read_bytes() == b"new" and not staged.exists()
