"""The commit rule: a save writes its files under fresh names, its manifest last, and one rename commits
it. A crash or an error between any two file-system operations of a save leaves the old or the new
checkpoint loadable, a user's files untouched, and nothing of ours that the next save does not clean."""

from __future__ import annotations

import copy
import errno
import json
import os

import pytest
from helpers import FOUR_SIZES, SMALL, assert_same_state, make_params, train

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
