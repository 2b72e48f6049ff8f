"""Hugging Face saves touch only what a save of ours wrote: save_into and overwrite=True delete or replace only
the files a previous save recorded (never a user's file named like a shard, never a directory), a save into a
directory commits as a whole, and a process that dies between any two of its file-system changes leaves the
previous save or the new one, never a mix that loads; the next save clears what it left."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
from helpers import Died, dies_at, interrupted_after
from torch import nn

from offload import CheckpointError
from offload.pretrained import SafetensorsCheckpoint, save_pretrained
from offload.pretrained.save import STAGING, save_into

STAGE_PREFIX = STAGING


class _Config:
    """A config object as Hugging Face models carry one: its save_pretrained writes config.json."""

    def __init__(self, version: int):
        self.version = version

    def save_pretrained(self, directory) -> None:
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump({"model_type": "toy", "version": self.version}, f)


def model_of(seed: int, layers: int = 3, config: int | None = None) -> nn.Module:
    torch.manual_seed(seed)
    m = nn.Sequential(*[nn.Linear(32, 32) for _ in range(layers)])
    if config is not None:
        m.config = _Config(config)
    return m


def weights_in(directory) -> dict:
    with SafetensorsCheckpoint(directory) as ckpt:
        return {name: ckpt.read(name).clone() for name in ckpt.entries}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def user_files(d) -> None:
    """A user's files in ``d`` that Hugging Face saves once matched by name: a file and a directory named like
    shards, and a note."""
    (d / "model-final.safetensors").write_bytes(b"the user's own weights")
    (d / "model-notes.safetensors").mkdir()
    (d / "model-notes.safetensors" / "todo.txt").write_text("keep me")
    (d / "notes.txt").write_text("mine")


def assert_user_files(d) -> None:
    assert (d / "model-final.safetensors").read_bytes() == b"the user's own weights"
    assert (d / "model-notes.safetensors" / "todo.txt").read_text() == "keep me"
    assert (d / "notes.txt").read_text() == "mine"


def state(m) -> dict:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def test_save_into_replaces_and_deletes_only_what_a_save_of_ours_recorded(tmp_path):
    """save_into a run's directory holding a user's model-final.safetensors, a directory named
    model-notes.safetensors and a note, three times (sharded, sharded differently, one file): each save loads
    bit for bit, the files of the save it replaced are gone (no stale shard), and the user's files and
    directory are untouched (they were deleted as stale shards before)."""
    d = tmp_path / "run"
    d.mkdir()
    user_files(d)
    for seed, shard in ((1, "3KB"), (2, "6KB"), (3, "5GB")):
        m = model_of(seed, config=seed)
        save_into(m, d, max_shard_size=shard)
        assert same(weights_in(d), state(m))
        assert_user_files(d)
        ours = [n for n in os.listdir(d) if n.endswith(".safetensors") and n not in ("model-final.safetensors",
                                                                                     "model-notes.safetensors")]
        index = d / "model.safetensors.index.json"
        expected = {"model.safetensors"} if not index.exists() else set(json.loads(index.read_text())["weight_map"]
                                                                           .values())
        assert set(ours) == expected, (ours, expected)
        assert json.loads((d / "config.json").read_text())["version"] == seed
        assert not [n for n in os.listdir(d) if n.startswith(STAGE_PREFIX) or n.startswith(".nvme-offload")]


def test_overwrite_replaces_only_a_save_of_ours_never_a_directory_or_a_file_it_did_not_write(tmp_path):
    """overwrite=True over a directory holding a save of ours and a user's directory named like a shard (or a
    config.json of someone else's) is refused naming them, and deletes nothing; over a save of ours alone it
    replaces it."""
    out = tmp_path / "out"
    save_pretrained(model_of(1), out, max_shard_size="3KB")
    (out / "model-notes.safetensors").mkdir()
    (out / "model-notes.safetensors" / "todo.txt").write_text("keep me")
    before = sorted(os.listdir(out))
    with pytest.raises(CheckpointError, match=r"model-notes\.safetensors.*no save of this library wrote"):
        save_pretrained(model_of(2), out, overwrite=True)
    assert sorted(os.listdir(out)) == before
    assert (out / "model-notes.safetensors" / "todo.txt").read_text() == "keep me"
    other = tmp_path / "downloaded"
    model_of(3).to(torch.float32)
    other.mkdir()
    (other / "config.json").write_text('{"from": "the hub"}')
    with pytest.raises(CheckpointError, match=r"config\.json.*no save of this library wrote"):
        save_into(model_of(3, config=1), other)
    assert (other / "config.json").read_text() == '{"from": "the hub"}'
    (out / "model-notes.safetensors" / "todo.txt").unlink()
    (out / "model-notes.safetensors").rmdir()
    m = model_of(4)
    save_pretrained(m, out, overwrite=True)
    assert same(weights_in(out), state(m)) and sorted(os.listdir(out)) == ["model.safetensors"]


@pytest.mark.parametrize("before, after", [("3KB", "6KB"), ("6KB", "6KB"), ("5GB", "3KB"), ("3KB", "5GB"),
                                           (None, "3KB"), (None, "5GB")],
                         ids=["shards-to-shards", "same-count", "single-to-shards", "shards-to-single",
                              "first-sharded", "first-single"])
def test_a_save_into_killed_between_any_two_changes_leaves_the_old_or_the_new_never_a_mix(tmp_path, before, after):
    """save_into over a previous save (or into a run's directory with none yet), the process dying at each of its
    file-system changes in turn (renames included, every one): what loads afterwards is the previous save or
    the new one, whole (the load settles what the dead save left: never config.json of one save beside the
    weights of the other); with no save before, nothing loads until one completes. The user's files are untouched, and
    the next save clears what the dead one left (no staging directory stays)."""
    old, new = model_of(1, config=1), model_of(2, config=2)
    total = [0]
    probe = tmp_path / "probe"
    probe.mkdir()
    if before is not None:
        save_into(old, probe, max_shard_size=before)
    with dies_at(10**9, total):
        save_into(new, probe, max_shard_size=after)
    outcomes = set()
    for k in range(1, total[0] + 1):
        d = tmp_path / f"run{k}"
        d.mkdir()
        user_files(d)
        if before is not None:
            save_into(old, d, max_shard_size=before)
        with pytest.raises(Died), dies_at(k, [0]):
            save_into(new, d, max_shard_size=after)
        try:
            found = weights_in(d)
        except CheckpointError as err:
            assert before is None and "holds neither" in str(err), err
            outcomes.add("refused")
        else:
            assert same(found, state(old)) or same(found, state(new)), f"a mix after dying at change {k}"
            outcomes.add("old" if same(found, state(old)) else "new")
        assert_user_files(d)
        save_into(new, d, max_shard_size=after)  # the next save clears what is left
        assert same(weights_in(d), state(new))
        assert not [n for n in os.listdir(d) if n.startswith(STAGE_PREFIX) or n == ".nvme-offload.lock"]
        assert_user_files(d)
    assert "new" in outcomes and ("old" in outcomes or before is None), outcomes


@pytest.mark.parametrize("before, after", [("3KB", "6KB"), ("5GB", "3KB"), ("3KB", "5GB"), ("5GB", "5GB"),
                                           (None, "3KB")],
                         ids=["shards-to-shards", "single-to-shards", "shards-to-single", "single-to-single",
                              "first-sharded"])
def test_a_save_into_interrupted_after_any_change_leaves_the_old_or_the_new(tmp_path, before, after):
    """save_into over a previous save, a KeyboardInterrupt raised right after each of its file-system changes in
    turn (the commit's rename among them), the process living on: the save raises it, and what loads is the
    previous save or the new one, whole, never nothing (an interrupt right after the commit once undid the new
    save whose rename had already replaced the old one). No staging directory is left unless the next save
    sweeps it, and the user's files are untouched."""
    old, new = model_of(1, config=1), model_of(2, config=2)
    total = [0]
    probe = tmp_path / "probe"
    probe.mkdir()
    if before is not None:
        save_into(old, probe, max_shard_size=before)
    with interrupted_after(10**9, total):
        save_into(new, probe, max_shard_size=after)
    outcomes = set()
    for k in range(1, total[0] + 1):
        d = tmp_path / f"run{k}"
        d.mkdir()
        user_files(d)
        if before is not None:
            save_into(old, d, max_shard_size=before)
        with pytest.raises(KeyboardInterrupt), interrupted_after(k, [0]):
            save_into(new, d, max_shard_size=after)
        try:
            found = weights_in(d)
        except CheckpointError as err:
            assert before is None and "holds neither" in str(err), f"after change {k}: {err}"
            outcomes.add("none")
        else:
            assert same(found, state(old)) or same(found, state(new)), f"a mix after change {k}"
            outcomes.add("old" if same(found, state(old)) else "new")
        assert_user_files(d)
        save_into(new, d, max_shard_size=after)  # the next save clears what is left
        assert same(weights_in(d), state(new))
        assert not [n for n in os.listdir(d) if n.startswith(STAGE_PREFIX)]
        assert_user_files(d)
    assert "new" in outcomes and ("old" in outcomes or before is None), outcomes


def test_a_ctrl_c_while_a_save_moves_in_is_delivered_after_its_commit(tmp_path, monkeypatch):
    """A SIGINT arriving as the first shard moves into the directory is held off until the save has committed:
    the new save loads whole, its staging directory is gone, and KeyboardInterrupt is raised after."""
    d = tmp_path / "run"
    d.mkdir()
    save_into(model_of(1, config=1), d, max_shard_size="3KB")
    new = model_of(2, config=2)
    real = os.rename
    sent = []

    def rename(src, dst, *args, **kwargs):
        real(src, dst, *args, **kwargs)
        if not sent and os.path.dirname(os.fspath(dst)) == str(d) and os.fspath(dst).endswith(".safetensors"):
            sent.append(dst)
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(KeyboardInterrupt):
        save_into(new, d, max_shard_size="6KB")
    monkeypatch.undo()
    assert sent
    assert same(weights_in(d), state(new))
    assert not [n for n in os.listdir(d) if n.startswith(STAGE_PREFIX)]


def test_save_into_refuses_a_model_safetensors_no_save_of_ours_wrote(tmp_path):
    """save_into a directory holding a user's own model.safetensors (and a tokenizer.json), sharded: the index
    it commits would make the user's file obsolete, so it is refused before anything is written, naming the
    file; nothing in the directory changes. Once moved away, the save goes through."""
    from safetensors.torch import save_file

    d = tmp_path / "run"
    d.mkdir()
    save_file({"w": torch.ones(4)}, str(d / "model.safetensors"))
    (d / "tokenizer.json").write_text("{}")
    before = {n: (d / n).read_bytes() for n in os.listdir(d)}
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*no save of this library wrote"):
        save_into(model_of(1, config=1), d, max_shard_size="3KB")
    assert {n: (d / n).read_bytes() for n in os.listdir(d) if n != ".nvme-offload.lock"} == before
    os.rename(d / "model.safetensors", tmp_path / "mine.safetensors")
    m = model_of(1, config=1)
    save_into(m, d, max_shard_size="3KB")
    assert same(weights_in(d), state(m)) and (d / "tokenizer.json").read_text() == "{}"


def test_a_config_edited_after_the_save_loads_with_a_warning(tmp_path):
    """config.json edited by hand after a save (use_cache, say) is not taken for a save cut short: with no staging
    directory left, the weights load and a warning names the file; beside a staging directory the load cannot
    settle, it is refused."""
    d = tmp_path / "m"
    save_pretrained(model_of(1, config=1), d)
    saved = weights_in(d)
    doc = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**doc, "use_cache": False}))
    with pytest.warns(RuntimeWarning, match="edited since"):
        assert same(weights_in(d), saved)
    # A staging directory the load cannot settle (not provably a save's: no marker, a file of someone's in it) may
    # be a save cut short between its config and its weights: refused.
    (d / (STAGE_PREFIX + "0123")).mkdir()
    (d / (STAGE_PREFIX + "0123") / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="parts of two saves"):
        weights_in(d)


def test_a_load_beside_a_save_in_progress_does_not_wait_for_its_lock(tmp_path):
    """Settling a cut-short save before a load takes the directory's lock without waiting: where a save holds it
    (in this very process, a save whose tensors this load feeds, which would deadlock), the load reads what is
    there and the staging directory is left to that save."""
    from offload.locks import lock_directory
    from offload.pretrained.files import settle_cut_short

    d = tmp_path / "run"
    d.mkdir()
    save_into(model_of(1, config=1), d, max_shard_size="3KB")
    stage = d / f"{STAGE_PREFIX}in-progress"
    stage.mkdir()
    held = lock_directory(str(d), exclusive=True)

    def hung(signum, frame):
        raise AssertionError("settle_cut_short waits for the lock a save holds: it would wait for ever")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(30)
    try:
        settle_cut_short(str(d))
        assert stage.exists()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
        held.release()
