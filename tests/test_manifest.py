"""The manifest is parsed and checked once, before anything changes: a hostile manifest (wrong types,
offsets out of range, names outside the checkpoint, links, an unknown version) is refused with an error
that names the field, nothing of the optimizer changes, and nothing outside the checkpoint is opened.
Random state goes through a save and a load bit for bit, and a manifest through to_json and parse."""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys

import pytest
import torch
from helpers import (
    SMALL,
    assert_same_state,
    ckpt_file,
    flip_bit,
    make_params,
    rewrite_in_pieces,
    saved_checkpoint,
    train,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from offload import OffloadedAdamW
from offload import checkpoint as ckpt
from offload.aio import Engine
from offload.buffers import BufferPool
from offload.checkpoint.manifest import Manifest, digest, read
from offload.checkpoint.stream import read_verified, unit_spans

# Paths opened (open, os.open) while ``_OPENED`` is a list: an audit hook cannot be removed, so it is
# installed once and records only while a test asks it to.
_OPENED: list | None = None


def _record_opens(event: str, args: tuple) -> None:
    if _OPENED is not None and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.fsdecode(args[0]))


sys.addaudithook(_record_opens)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of an optimizer with state on disk and in memory, and a model's weights."""
    return saved_checkpoint(tmp_path_factory.mktemp("saved"))


def _edit(directory, change) -> None:
    """Apply ``change(manifest)`` to the manifest of ``directory`` and give it a valid checksum."""
    path = directory / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    manifest["manifest_xxh3_64"] = digest(manifest)
    path.write_text(json.dumps(manifest))


def _swap(m) -> dict:
    return next(p for p in m["params"] if p["where"] == "swap")


def _in_params_bin(offset: int, length: int):
    """Say the model's first tensor (a [4, 8] float32 weight) is in a 4096-byte params.bin at ``offset``."""
    def change(m):
        m["files"]["params.bin"] = {"bytes": 4096, "xxh3_64": "0" * 16}
        m["model"]["tensors"][0].update(where="params.bin", offset=offset, length=length, xxh3_64="0" * 16)
    return change


def _set_file(name: str, value: str):
    return lambda m: m["files"][name].__setitem__("file", value)


def _null_state_digest(also=lambda m: None):
    def change(m):
        m["files"]["state.bin"]["xxh3_64"] = None
        also(m)
    return change


HOSTILE = {
    # wrong types
    "unit-length-text": (lambda m: m["units"][0].__setitem__("length", "4096"), r"units\[0\]\.length must be"),
    "initialized-number": (lambda m: _swap(m).__setitem__("initialized", 1), r"initialized must be true or false"),
    "digest-number": (lambda m: m["files"]["state.bin"].__setitem__("xxh3_64", 5), r"xxh3_64 must be a string"),
    "dtype-unknown": (lambda m: _swap(m).__setitem__("state_dtype", "float99"), r"state_dtype must be the name"),
    "chunk-float": (lambda m: _swap(m)["chunks"][0].__setitem__(2, 1.5), r"chunks\[0\]\[2\] must be"),
    # negative and huge sizes and offsets
    "unit-offset-negative": (lambda m: m["units"][0].__setitem__("offset", -4096), r"units\[0\]\.offset must be"),
    "unit-beyond-file": (lambda m: m["units"][-1].__setitem__("offset", 1 << 60), r"units\[\d+\] must be a range "
                                                                                 r"within state\.bin"),
    "unit-unaligned": (lambda m: m["units"][0].__setitem__("offset", 100), r"aligned to 4096"),
    "chunk-beyond-unit": (lambda m: _swap(m)["chunks"][0].__setitem__(3, 1 << 40), r"slices within unit"),
    "chunk-past-param": (lambda m: _swap(m)["chunks"][0].__setitem__(2, 1 << 40), r"chunks\[0\] must be"),
    "chunk-unit-beyond": (lambda m: _swap(m)["chunks"][0].__setitem__(0, 10 ** 6), r"names unit 1000000"),
    "tensor-beyond-file": (_in_params_bin(1 << 40, 128), r"tensors\[0\] must be a range within params\.bin"),
    "tensor-length-lies": (_in_params_bin(0, 1 << 20), r"tensors\[0\]\.length must be the bytes"),
    "group-index-beyond": (lambda m: m["param_groups"][0]["params"].append(99), r"param_groups\[0\]\.params\[5\]"),
    "param-index-swapped": (lambda m: m["params"][0].__setitem__("index", 1), r"params\[0\]\.index must be 0"),
    "chunk-misaligned": (lambda m: _swap(m)["chunks"][0].__setitem__(4, 1), r"multiples of their dtypes' sizes"),
    "memory-unlisted": (lambda m: m["files"].__delitem__("memory.pt"), r"files lists no memory\.pt"),
    "keys-missing": (lambda m: _swap(m).__setitem__("keys", []), r"keys must be the state of an Adam parameter"),
    # a unit's checksum in pieces: the piece size the engine could have used, with a checksum
    "pieces-negative": (lambda m: m["units"][0].__setitem__("pieces", -4096), r"units\[0\]\.pieces must be a piece"),
    "pieces-zero": (lambda m: m["units"][0].__setitem__("pieces", 0), r"units\[0\]\.pieces must be a piece size"),
    "pieces-huge": (lambda m: m["units"][0].__setitem__("pieces", 1 << 40), r"units\[0\]\.pieces must be a piece"),
    "pieces-unaligned": (lambda m: m["units"][0].__setitem__("pieces", 5000), r"units\[0\]\.pieces must be"),
    "pieces-text": (lambda m: m["units"][0].__setitem__("pieces", "1048576"), r"units\[0\]\.pieces must be"),
    "pieces-bool": (lambda m: m["units"][0].__setitem__("pieces", True), r"units\[0\]\.pieces must be"),
    "pieces-float": (lambda m: m["units"][0].__setitem__("pieces", 4096.0), r"units\[0\]\.pieces must be"),
    "pieces-no-digest": (lambda m: (m["units"][0].__setitem__("pieces", 4096), m["units"][0].pop("xxh3_64")),
                         r"units\[0\]\.xxh3_64 is missing"),
    # a data file without a checksum of its own: only state.bin, and only where its units' cover it
    "digest-null-memory": (lambda m: m["files"]["memory.pt"].__setitem__("xxh3_64", None),
                           r"files\['memory\.pt'\]\.xxh3_64 must be a string \(only state\.bin's may be null\)"),
    "digest-missing": (lambda m: m["files"]["state.bin"].pop("xxh3_64"), r"files\['state\.bin'\]\.xxh3_64 is missing"),
    "digest-null-gap": (_null_state_digest(lambda m: m["units"][1].__setitem__("offset", m["units"][1]["offset"]
                                                                                 + 4096)),
                        r"units\[1\]\.offset must be \d+, where the unit before it ends"),
    "digest-null-tail": (_null_state_digest(lambda m: m["files"]["state.bin"].__setitem__(
        "bytes", m["files"]["state.bin"]["bytes"] + 4096)),
        r"files\['state\.bin'\]\.bytes must be \d+, where its last"),
    "digest-null-unit": (_null_state_digest(lambda m: m["units"][0].pop("xxh3_64")),
                         r"units\[0\]\.xxh3_64 is missing \(files\['state\.bin'\] has no xxh3_64"),
    # names outside the checkpoint directory
    "file-dotdot": (_set_file("state.bin", "../outside/state.bin"), r"file must be a file name inside"),
    "file-absolute": (_set_file("memory.pt", "/etc/passwd"), r"file must be a file name inside"),
    "file-dot": (_set_file("memory.pt", ".."), r"file must be a file name inside"),
    "file-unknown-key": (lambda m: m["files"].__setitem__("../x", {"bytes": 0, "xxh3_64": "0"}),
                         r"must be one of the format's files"),
    # versions
    "version-newer": (lambda m: m.__setitem__("version", 3), r"manifest\.json has format version 3; this library "
                                                            r"reads version 1 or 2\. Load it with"),
    "version-1-in-pieces": (lambda m: (m["units"][0].update(pieces=4096)),
                            r"manifest field version must be 2 \(units checksummed in pieces"),
    "version-text": (lambda m: m.__setitem__("version", "1"), r"format version '1'"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_manifest_is_refused_before_anything_changes_and_nothing_outside_is_read(
        tmp_path, saved, name):
    """A manifest whose checksum holds but whose content is hostile is refused by read_manifest,
    verify_checkpoint, load_checkpoint and load_parameters with a CheckpointError (a ValueError) naming
    the field or the version; the optimizer's state stays as it was and no path outside the checkpoint
    directory (where the hostile names point) is opened."""
    change, message = HOSTILE[name]
    directory = tmp_path / "c"
    shutil.copytree(saved, directory)
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(ckpt_file(saved, "state.bin"), outside / "state.bin")
    _edit(directory, change)
    params = make_params()
    opt = OffloadedAdamW(params, lr=1e-2, nvme_path=tmp_path / "nvme", **SMALL)
    try:
        train(opt, params, range(1))
        before = copy.deepcopy(opt.state_dict())
        global _OPENED
        _OPENED = []
        try:
            for call in (ckpt.read_manifest, ckpt.verify_checkpoint, lambda d: ckpt.load_checkpoint(opt, d),
                         lambda d: ckpt.load_parameters(torch.nn.Linear(8, 4), d)):
                with pytest.raises(ckpt.CheckpointError, match=message):
                    call(directory)
            opened, _OPENED = _OPENED, None
        finally:
            _OPENED = None
        assert_same_state(before, opt.state_dict())
        train(opt, params, range(1, 2))  # it was never marked failed
    finally:
        opt.close()
    inside = os.path.realpath(directory)
    strays = [p for p in opened if os.path.realpath(p).startswith(str(os.path.realpath(tmp_path)) + os.sep)
              and not (os.path.realpath(p) + os.sep).startswith(inside + os.sep)]
    assert strays == []


@pytest.mark.parametrize("name", ["state.bin", "memory.pt", "params.bin"])
def test_a_data_file_that_is_a_symbolic_link_is_refused_and_not_read(tmp_path, saved, name):
    """A checkpoint file replaced by a link to a copy outside the checkpoint (its bytes and checksum
    unchanged) is refused by name: a checkpoint's files are its own, never read through a link."""
    directory = tmp_path / "c"
    shutil.copytree(saved, directory)
    inside = ckpt_file(directory, name)
    outside = tmp_path / f"outside-{name}"
    os.rename(inside, outside)
    os.symlink(outside, inside)
    global _OPENED
    _OPENED = []
    try:
        for call in (ckpt.read_manifest, ckpt.verify_checkpoint, ckpt.export_model_state_dict):
            with pytest.raises(ckpt.CheckpointError, match=rf"its {name} \(.*\) is a symbolic link"):
                call(directory)
        opened = _OPENED
    finally:
        _OPENED = None
    assert str(outside) not in {os.path.realpath(p) for p in opened} and inside not in opened


def test_a_job_manifest_naming_a_shard_outside_is_refused(tmp_path, saved):
    """A job manifest whose shard name or shard manifest name leaves the job's directory is refused."""
    shard = ckpt.read_manifest(saved)
    job = {"format": "nvme-offload-job-checkpoint", "version": 1, "job": "0" * 16, "world_size": 1, "step": 2,
           "shards": [{"rank": 0, "name": "../c", "manifest": "manifest.json", "step": 2,
                       "manifest_xxh3_64": shard["manifest_xxh3_64"], "files": shard["files"]}]}
    (tmp_path / "job").mkdir()
    for name, manifest, message in [("../c", "manifest.json", r"shards\[0\]\.name must be 'rank-00000'"),
                                    ("rank-00000", "../c/manifest.json", r"shards\[0\]\.manifest must be a file")]:
        job["shards"][0].update(name=name, manifest=manifest)
        job["manifest_xxh3_64"] = digest(job)
        (tmp_path / "job" / "manifest.json").write_text(json.dumps(job))
        with pytest.raises(ckpt.CheckpointError, match=message):
            ckpt.verify_checkpoint(tmp_path / "job")


def test_a_save_into_a_hostile_checkpoint_deletes_nothing_outside(tmp_path, saved):
    """A directory whose manifest names a file outside it is not treated as ours: a save into it is
    refused before anything is written, and the file outside stays."""
    directory = tmp_path / "c"
    shutil.copytree(saved, directory)
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"not a checkpoint's")
    _edit(directory, _set_file("state.bin", "../victim.bin"))
    with pytest.raises(FileExistsError, match="file must be a file name inside"):
        ckpt.save_parameters(torch.nn.Linear(8, 4), directory)
    assert victim.read_bytes() == b"not a checkpoint's"


shapes = st.lists(st.integers(1, 40_000), min_size=1, max_size=4)


@settings(max_examples=6, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large])
@given(sizes=shapes, dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       saved_buffer=st.sampled_from([64 * 1024, 256 * 1024]), loaded_buffer=st.sampled_from([64 * 1024, 256 * 1024]),
       threshold=st.sampled_from([1, 64, 5000]), steps=st.integers(1, 3), seed=st.integers(0, 2 ** 16))
def test_random_state_round_trips_through_save_and_load_bit_for_bit(tmp_path_factory, sizes, dtype, saved_buffer,
                                                                    loaded_buffer, threshold, steps, seed):
    """Any model (sizes, dtype), saved with one buffer size and small-parameter threshold and loaded
    into an optimizer with another, comes back bit for bit, and steps on as the original; its manifest
    reads back equal to what to_json wrote."""
    tmp = tmp_path_factory.mktemp("round")
    params = make_params(sizes, dtype=dtype, seed=seed)
    opts = []
    try:
        opt = OffloadedAdamW(params, lr=1e-2, nvme_path=tmp / "a", buffer_size=saved_buffer, buffer_count=3,
                             small_param_threshold=threshold)
        opts.append(opt)
        train(opt, params, range(seed, seed + steps))
        ckpt.save_checkpoint(opt, tmp / "c")
        manifest = read(str(tmp / "c"))
        assert Manifest.parse(manifest.to_json(), "", root=manifest.root) == manifest
        other = make_params(sizes, dtype=dtype, seed=seed + 1)
        opt2 = OffloadedAdamW(other, lr=1e-2, nvme_path=tmp / "b", buffer_size=loaded_buffer, buffer_count=3,
                              small_param_threshold=64)
        opts.append(opt2)
        ckpt.load_checkpoint(opt2, tmp / "c")
        with torch.no_grad():
            for a, b in zip(params, other):
                b.copy_(a)
        assert_same_state(opt.state_dict(), opt2.state_dict())
        train(opt, params, [seed + steps])
        train(opt2, other, [seed + steps])
        assert all(torch.equal(a, b) for a, b in zip(params, other))
        assert_same_state(opt.state_dict(), opt2.state_dict())
    finally:
        for o in opts:
            o.close()
        shutil.rmtree(tmp, ignore_errors=True)


def test_a_memory_file_that_lacks_what_the_manifest_lists_is_refused(tmp_path, saved):
    """memory.pt rewritten without a parameter's step, with its size and checksum recorded anew, is refused
    by a load, an export and a verify naming the parameter, before the optimizer changes."""
    import xxhash

    directory = tmp_path / "c"
    shutil.copytree(saved, directory)
    path = ckpt_file(directory, "memory.pt")
    memory = torch.load(path, weights_only=True)
    index = next(p["index"] for p in ckpt.read_manifest(directory)["params"] if p["where"] == "swap")
    del memory["steps"][index]
    os.unlink(path)
    torch.save(memory, path)
    data = open(path, "rb").read()
    _edit(directory, lambda m: m["files"]["memory.pt"].update(bytes=len(data),
                                                              xxh3_64=xxhash.xxh3_64(data).hexdigest()))
    params = make_params()
    opt = OffloadedAdamW(params, lr=1e-2, nvme_path=tmp_path / "nvme", **SMALL)
    try:
        train(opt, params, range(1))
        before = copy.deepcopy(opt.state_dict())
        for call in (lambda d: ckpt.load_checkpoint(opt, d), ckpt.export_state_dict, ckpt.verify_checkpoint):
            with pytest.raises(ckpt.CheckpointError, match=rf"memory\.pt lacks the step of parameter {index}"):
                call(directory)
        assert_same_state(before, opt.state_dict())
    finally:
        opt.close()


def test_a_tied_tensor_entry_that_also_says_where_is_checked_not_crashed_on(tmp_path, saved):
    """A model tensor marked ``same_as`` another that also claims a place in params.bin (without offset or
    length): read_manifest, verify_checkpoint and load_checkpoint refuse it with a CheckpointError naming the
    field, never a TypeError from the missing ones."""
    directory = tmp_path / "c"
    shutil.copytree(saved, directory)

    def tie(m):
        first = m["model"]["tensors"][0]["name"]
        m["model"]["tensors"][1] = {"name": m["model"]["tensors"][1]["name"], "same_as": first, "where": "params.bin"}
        m["files"].setdefault("params.bin", {"bytes": 4096, "xxh3_64": "0" * 16})
    _edit(directory, tie)
    opt = OffloadedAdamW(make_params(), lr=1e-2, nvme_path=tmp_path / "nvme", **SMALL)
    try:
        for call in (lambda: ckpt.read_manifest(directory), lambda: ckpt.verify_checkpoint(directory),
                     lambda: ckpt.load_checkpoint(opt, directory, model=torch.nn.Linear(8, 4))):
            with pytest.raises(ckpt.CheckpointError, match=r"tensors\[1\]\.where must be absent: a tied tensor"):
                call()
    finally:
        opt.close()


def test_verify_refuses_a_model_tensor_that_model_pt_does_not_hold_as_recorded(tmp_path, saved):
    """A manifest (checksum recomputed) that records a model.pt tensor with another shape than model.pt holds:
    verify_checkpoint refuses it, as a load into the model would."""
    directory = tmp_path / "c"
    shutil.copytree(saved, directory)
    def reshape(m):
        m["model"]["tensors"][0]["shape"] = [2, 16]
        m["model"]["tensors"][0]["local"] = {"shape": [2, 16], "offsets": [0, 0]}  # the part held: all of it
    _edit(directory, reshape)
    with pytest.raises(ckpt.CheckpointError, match=r"model\.pt does not hold 'weight' as the manifest records"):
        ckpt.verify_checkpoint(directory)


def test_units_checksummed_in_pieces_verify_load_and_a_flipped_byte_is_refused(tmp_path, saved):
    """A checkpoint whose units carry the engine's checksum in pieces and whose state.bin has none of its own
    (as a clone save writes it) reads back equal through to_json and parse, verifies and loads bit for bit
    like the same checkpoint with plain checksums; a byte flipped in a unit's state or padding is refused by
    verify and load with a ChecksumError naming state.bin, the unit and the piece size."""
    plain, pieces = tmp_path / "plain", tmp_path / "pieces"
    shutil.copytree(saved, plain)
    shutil.copytree(saved, pieces)
    rewrite_in_pieces(pieces, 3 * 4096)
    manifest = read(str(pieces))
    assert Manifest.parse(manifest.to_json(), "", root=manifest.root) == manifest
    assert manifest.files["state.bin"].xxh3_64 is None and {u.pieces for u in manifest.units} == {3 * 4096}
    ckpt.verify_checkpoint(pieces)
    states = []
    for directory in (plain, pieces):
        params = make_params(seed=7)
        opt = OffloadedAdamW(params, lr=1e-2, nvme_path=tmp_path / f"nvme-{directory.name}", **SMALL)
        try:
            ckpt.load_checkpoint(opt, directory)
            states.append(opt.state_dict())
        finally:
            opt.close()
    assert_same_state(*states)
    units = ckpt.read_manifest(pieces)["units"]
    i = next(k for k, u in enumerate(units) if u["nbytes"] < u["length"])
    for at in (units[i]["offset"] + units[i]["nbytes"] // 2, units[i]["offset"] + units[i]["nbytes"]):
        bad = tmp_path / f"bad-{at}"
        shutil.copytree(pieces, bad)
        flip_bit(ckpt_file(bad, "state.bin"), at, 0x80)
        message = rf"state\.[0-9a-f]+\.bin: bytes \[{units[i]['offset']}, .*unit {i}.*in 12288-byte pieces"
        with pytest.raises(ckpt.ChecksumError, match=message):
            ckpt.verify_checkpoint(bad)
        params = make_params(seed=7)
        opt = OffloadedAdamW(params, lr=1e-2, nvme_path=tmp_path / "nvme-bad", **SMALL)
        try:
            with pytest.raises(ckpt.ChecksumError, match=message):
                ckpt.load_checkpoint(opt, bad)
        finally:
            opt.close()


def test_a_unit_in_pieces_is_checked_whatever_parts_it_is_read_in(tmp_path, saved):
    """read_verified checks the engine's form of a unit read through buffers smaller than the unit, whose parts
    do not line up with its pieces (16 KiB parts, 12 KiB pieces), and of a unit read whole, alike: the intact
    file passes both ways, and one bit flipped where a part and a piece both straddle (16 KiB + 100 of the
    largest unit, in its second piece and second part) is refused both ways."""
    directory = tmp_path / "c"
    shutil.copytree(saved, directory)
    rewrite_in_pieces(directory, 3 * 4096)
    manifest = read(str(directory))
    path = manifest.sized_path("state.bin")
    largest = max(manifest.units, key=lambda u: u.length)
    assert largest.length > 24 * 1024
    sizes = (16 * 1024, largest.length)
    engine = Engine()
    try:
        for size in sizes:
            with BufferPool(3, size) as pool:
                read_verified(engine, path, unit_spans(manifest), list(pool), None)
        flip_bit(path, largest.offset + 16 * 1024 + 100)
        for size in sizes:
            with BufferPool(3, size) as pool, pytest.raises(ckpt.ChecksumError, match="in 12288-byte pieces"):
                read_verified(engine, path, unit_spans(manifest), list(pool), None)
    finally:
        engine.close()
