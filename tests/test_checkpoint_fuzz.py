"""A real checkpoint, changed at random as a sender could change it (any field of its manifest replaced by any
JSON value or removed, the manifest's own checksum recomputed; a data file cut, overwritten, or replaced by a
link to /dev/zero or a FIFO), in the plain form and with its units' checksums in the engine's pieces (a clone
save's): verify_checkpoint and load_checkpoint (with and without the model) either refuse
it with a CheckpointError or load it, never another exception and never a hang, and verify never accepts what a
load refuses."""

from __future__ import annotations

import json
import os
import shutil
import stat
import threading

import pytest
import torch
from helpers import SMALL, make_params, rewrite_in_pieces, saved_checkpoint
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from offload import CheckpointError, OffloadedAdamW
from offload import checkpoint as ckpt
from offload.checkpoint.manifest import digest

HANG_S = 20  # a FIFO opened for reading blocks until someone writes: after this, the test opens it itself


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint with state on disk and in memory and a model's weights, and a fresh optimizer and model
    to load it into."""
    root = tmp_path_factory.mktemp("fuzz")
    saved_checkpoint(root, "good")
    shutil.copytree(root / "good", root / "pieces")
    rewrite_in_pieces(str(root / "pieces"), 2 * 4096)
    fresh = OffloadedAdamW(make_params(seed=1), lr=1e-2, nvme_path=root / "nvme2", **SMALL)
    yield root, fresh, torch.nn.Linear(8, 4)
    fresh.close()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 63, 2 ** 64) | st.floats()
    | st.sampled_from(["", "../x", "/etc/passwd", "state.bin", "rank-0", "float32", "nope", "a/b", "..", "\x00"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6)


def _paths(value, prefix=()):
    """Every path to a value inside a JSON tree."""
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, prefix + (i,))


@st.composite
def manifest_changes(draw):
    """(path in the manifest, the new value or None to remove it)."""
    return draw(st.integers(0, 10 ** 6)), draw(st.booleans()), draw(json_values)


def _change_manifest(directory: str, pick: int, remove: bool, value) -> None:
    path = os.path.join(directory, "manifest.json")
    with open(path) as f:
        manifest = json.load(f)
    paths = [p for p in _paths(manifest) if p and p[-1] != "manifest_xxh3_64"]
    where = paths[pick % len(paths)]
    parent = manifest
    for k in where[:-1]:
        parent = parent[k]
    if remove and isinstance(parent, dict):
        del parent[where[-1]]
    else:
        parent[where[-1]] = value
    manifest["manifest_xxh3_64"] = digest(manifest)
    with open(path, "w") as f:
        json.dump(manifest, f)


def _change_file(directory: str, kind: str, pick: int, data: bytes) -> None:
    names = sorted(n for n in os.listdir(directory) if n != "manifest.json")
    path = os.path.join(directory, names[pick % len(names)])
    size = os.path.getsize(path)
    if kind == "cut":
        os.truncate(path, pick % (size + 1))
    elif kind == "overwrite":
        with open(path, "r+b") as f:
            f.seek(pick % max(1, size))
            f.write(data)
    elif kind == "zero-link":
        os.unlink(path)
        os.symlink("/dev/zero", path)
    else:
        os.unlink(path)
        os.mkfifo(path)


def _outcome(call):
    """None if ``call()`` returned, the CheckpointError it raised; anything else fails the test."""
    try:
        call()
    except CheckpointError as err:
        return err
    return None


def _judge(directory: str, opt, model) -> None:
    fifos = [os.path.join(directory, n) for n in os.listdir(directory)
             if stat.S_ISFIFO(os.lstat(os.path.join(directory, n)).st_mode)]
    hung = threading.Event()

    def unblock():  # a reader still waiting on a FIFO is a hang: let it go, and fail the test
        for fifo in fifos:
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # succeeds only while someone reads
            except OSError:
                continue
            hung.set()

    timer = threading.Timer(HANG_S, unblock)
    timer.start()
    try:
        verified = _outcome(lambda: ckpt.verify_checkpoint(directory))
        loaded = _outcome(lambda: ckpt.load_checkpoint(opt, directory))
        with_model = _outcome(lambda: ckpt.load_checkpoint(opt, directory, model=model))
    finally:
        timer.cancel()
    assert not hung.is_set(), "a FIFO in the checkpoint was opened for reading and blocked"
    # verify reads every file, a load only those it needs: verify never accepts what a load refuses, short of
    # what the caller asks of a valid checkpoint (weights of one that holds none, optimizer state of one that
    # holds only weights, a layout other than the one a part of unknown place was saved from).
    if verified is None:
        for outcome in (loaded, with_model):
            assert outcome is None or any(why in str(outcome) for why in _CALLERS), \
                f"verify accepted what load refused: {outcome!r}"


_CALLERS = ("holds no model weights", "holds model weights only", "loads only into the layout that saved it")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                                  HealthCheck.function_scoped_fixture])
@given(change=manifest_changes(), form=st.sampled_from(["good", "pieces"]))
def test_a_manifest_changed_anywhere_is_refused_or_loads_and_verify_agrees(saved, change, form):
    """``form`` "pieces": the units' checksums in the engine's pieces and state.bin without its own (a clone)."""
    root, opt, model = saved
    directory = str(root / "case")
    shutil.rmtree(directory, ignore_errors=True)
    shutil.copytree(root / form, directory)
    _change_manifest(directory, *change)
    _judge(directory, opt, model)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(["cut", "overwrite", "zero-link", "fifo"]), pick=st.integers(0, 10 ** 7),
       data=st.binary(min_size=1, max_size=64), form=st.sampled_from(["good", "pieces"]))
def test_a_data_file_cut_overwritten_or_replaced_is_refused_never_read_past(saved, kind, pick, data, form):
    root, opt, model = saved
    directory = str(root / "case")
    shutil.rmtree(directory, ignore_errors=True)
    shutil.copytree(root / form, directory)
    _change_file(directory, kind, pick, data)
    _judge(directory, opt, model)


def test_the_pieces_form_of_the_fuzzed_checkpoint_is_valid(saved):
    """The "pieces" starting point is a checkpoint that verifies and loads (what the fuzz changes is valid)."""
    root, opt, model = saved
    assert _outcome(lambda: ckpt.verify_checkpoint(root / "pieces")) is None
    assert _outcome(lambda: ckpt.load_checkpoint(opt, root / "pieces", model=model)) is None
