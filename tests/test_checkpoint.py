"""Streaming checkpoints: bit-for-bit round trips, re-chunking, atomic replacement, export/import, CLI.

Buffers are small (256 KiB) so that the state of these small tensors is split over many units, and
the small-parameter threshold keeps one parameter's state in memory, so both kinds are checkpointed.
"""

from __future__ import annotations

import copy
import json
import os
import re

import pytest
import torch
from helpers import SMALL, assert_same, assert_same_state, ckpt_file, flip_bit, make_params, restore, snapshot, train

from offload import OffloadedAdam, OffloadedAdamW
from offload import checkpoint as ckpt
from offload.checkpoint.manifest import digest
from offload.tools.ckpt_cli import main as ckpt_main


def make_opt(params, nvme, cls=OffloadedAdamW, **kw):
    return cls(params, lr=1e-2, nvme_path=nvme, **{**SMALL, **kw})


CASES = [
    pytest.param(OffloadedAdamW, {}, torch.float32, id="adamw"),
    pytest.param(OffloadedAdam, dict(amsgrad=True, fused=False, weight_decay=0.1), torch.float32, id="adam-amsgrad"),
    pytest.param(OffloadedAdamW, {}, torch.bfloat16, id="adamw-bf16-master"),
]


@pytest.mark.parametrize("cls, kw, dtype", CASES)
def test_save_then_load_resumes_bit_for_bit(tmp_path, nvme, closing, cls, kw, dtype):
    """A fresh optimizer loaded from a checkpoint continues exactly as the one that saved it."""
    params = make_params(dtype=dtype)
    opt = closing(make_opt(params, nvme, cls, **kw))
    train(opt, params, range(3))
    ckpt.save_checkpoint(opt, tmp_path / "c", extra={"params": snapshot(params)})
    train(opt, params, range(3, 5))

    other = make_params(dtype=dtype, seed=1)
    opt2 = closing(make_opt(other, nvme, cls, **kw))
    extra = ckpt.load_checkpoint(opt2, tmp_path / "c")
    restore(other, extra["params"])
    train(opt2, other, range(3, 5))
    assert_same(params, other)
    assert_same_state(opt.state_dict(), opt2.state_dict())


@pytest.mark.parametrize("buffer_size, threshold", [(512 * 1024, 64), (128 * 1024, 6000), (256 * 1024, 0)])
def test_load_into_other_buffer_size_or_threshold_rechunks_state(tmp_path, nvme, closing, buffer_size, threshold):
    """State saved with one unit packing loads into another (bigger or smaller buffers, state moving
    between memory and disk) and training continues bit for bit."""
    params = make_params()
    opt = closing(make_opt(params, nvme))
    train(opt, params, range(3))
    ckpt.save_checkpoint(opt, tmp_path / "c", extra={"params": snapshot(params)})
    train(opt, params, range(3, 5))

    other = make_params(seed=1)
    opt2 = closing(make_opt(other, nvme, buffer_size=buffer_size, small_param_threshold=threshold))
    restore(other, ckpt.load_checkpoint(opt2, tmp_path / "c")["params"])
    train(opt2, other, range(3, 5))
    assert_same(params, other)
    assert_same_state(opt.state_dict(), opt2.state_dict())


def test_params_without_state_stay_without_state(tmp_path, nvme, closing):
    """A parameter that never had a grad is saved as stateless and starts from zero state after load,
    as it would have without the checkpoint."""
    params = make_params()
    opt = closing(make_opt(params, nvme))
    train(opt, params, range(2), skip={3})
    ckpt.save_checkpoint(opt, tmp_path / "c", extra={"params": snapshot(params)})
    manifest = ckpt.read_manifest(tmp_path / "c")
    assert [e["initialized"] for e in manifest["params"]] == [True, True, True, False, True]
    train(opt, params, range(2, 4))

    other = make_params(seed=1)
    opt2 = closing(make_opt(other, nvme))
    restore(other, ckpt.load_checkpoint(opt2, tmp_path / "c")["params"])
    assert not opt2.state_store.slot(other[3]).initialized
    train(opt2, other, range(2, 4))
    assert_same(params, other)
    assert_same_state(opt.state_dict(), opt2.state_dict())


def test_a_streamed_state_bin_is_reserved_in_one_call_for_its_whole_length(tmp_path, nvme, closing, monkeypatch):
    """The units of state.bin lie back to back: a save reserves them in one fallocate of the file's whole
    length (a full disk then names the bytes the whole file needs), not one per unit."""
    from offload.aio import files

    real = files._fallocate_call()
    calls = []

    def fallocate(fd, mode, offset, length):
        calls.append((offset, length))
        return real[0](fd, mode, offset, length)

    params = make_params()
    opt = closing(make_opt(params, nvme))
    train(opt, params, range(1))
    monkeypatch.setattr(files, "_fallocate", (fallocate, real[1]))
    ckpt.save_checkpoint(opt, tmp_path / "c", snapshot="stream")
    doc = ckpt.read_manifest(tmp_path / "c")
    assert len(doc["units"]) > 1 and (0, doc["files"]["state.bin"]["bytes"]) in calls, calls


@pytest.mark.parametrize("blocking, extra", [(True, b"\x80not a pickle"), (False, b"\x80not a pickle"),
                                             (True, bytearray(b"abc")), (True, {"step": 3, "raw": b"\x00"})])
def test_extra_comes_back_as_it_was_given_bytes_included(tmp_path, nvme, closing, blocking, extra):
    """``extra`` of any type torch.save takes comes back equal from a load, blocking save or not: bytes are an
    object like any other (written as they were, they were read back as a corrupt torch file)."""
    params = make_params()
    opt = closing(make_opt(params, nvme))
    train(opt, params, range(1))
    handle = ckpt.save_checkpoint(opt, tmp_path / "c", extra=extra, blocking=blocking)
    if not blocking:
        handle.wait()
    got = opt.load_checkpoint(tmp_path / "c")
    assert type(got) is type(extra) and got == extra


def test_saving_the_same_directory_again_replaces_it_atomically(tmp_path, nvme, closing):
    """A second save over an existing checkpoint replaces it whole: its files under the new generation's
    names, the previous generation's deleted, nothing beside the directory."""
    params = make_params()
    opt = closing(make_opt(params, nvme))
    train(opt, params, range(1))
    ckpt.save_checkpoint(opt, tmp_path / "c")
    train(opt, params, range(1, 3))
    ckpt.save_checkpoint(opt, tmp_path / "c", extra={"marker": 2})
    assert sorted(os.listdir(tmp_path)) == ["c", "nvme"]
    manifest = ckpt.read_manifest(tmp_path / "c")
    assert manifest["step"] == 3
    assert sorted(manifest["files"]) == ["extra.pt", "memory.pt", "state.bin"]
    named = {e["file"] for e in manifest["files"].values()}
    assert sorted(os.listdir(tmp_path / "c")) == sorted(named | {"manifest.json"})
    ckpt.verify_checkpoint(tmp_path / "c")


def test_manifest_describes_groups_params_config_and_files(tmp_path, nvme, closing):
    """The manifest holds the format version, step, groups with hyperparameters and indices, per
    parameter shape/dtype/keys/chunks, the offload config, and each file's size and checksum."""
    params = make_params()
    opt = closing(OffloadedAdamW([{"params": params[:2], "lr": 0.5}, {"params": params[2:]}], lr=1e-2,
                                 nvme_path=nvme, **SMALL))
    train(opt, params, range(2))
    ckpt.save_checkpoint(opt, tmp_path / "c")
    m = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert m["version"] == ckpt.FORMAT_VERSION and m["step"] == 2
    assert [g["params"] for g in m["param_groups"]] == [[0, 1], [2, 3, 4]]
    assert m["param_groups"][0]["lr"] == 0.5 and m["param_groups"][1]["betas"] == [0.9, 0.999]
    big = m["params"][4]
    assert big["shape"] == [300_001] and big["dtype"] == "float32" and big["keys"] == ["exp_avg", "exp_avg_sq"]
    assert sum(c[2] for c in big["chunks"]) == 300_001 and len(big["chunks"]) > 1
    assert m["params"][0]["where"] == "memory"
    assert m["config"]["offload_optimizer"]["buffer_size"] == 256 * 1024
    for name, f in m["files"].items():
        assert os.path.getsize(ckpt_file(tmp_path / "c", name)) == f["bytes"] and len(f["xxh3_64"]) == 16


def test_mismatched_optimizer_is_refused_naming_the_parameter_and_nothing_changes(tmp_path, nvme, closing):
    """Loading into an optimizer whose parameter shapes differ names the parameter with both shapes,
    and the optimizer keeps its own state and keeps stepping."""
    params = make_params()
    opt = closing(make_opt(params, nvme))
    train(opt, params, range(2))
    ckpt.save_checkpoint(opt, tmp_path / "c")
    other = make_params(sizes=(10, 100, 5000, 70_001, 300_001))
    opt2 = closing(make_opt(other, nvme))
    train(opt2, other, range(1))
    before = copy.deepcopy(opt2.state_dict())  # in-memory state comes back live: "unchanged" needs a copy
    with pytest.raises(ckpt.CheckpointError, match=r"parameter 3 has shape \(70000,\) in the checkpoint, "
                                                   r"\(70001,\) in this optimizer"):
        ckpt.load_checkpoint(opt2, tmp_path / "c")
    assert_same_state(before, opt2.state_dict())
    train(opt2, other, range(1, 2))
    amsgrad = closing(make_opt(make_params(), nvme, amsgrad=True))
    with pytest.raises(ckpt.CheckpointError, match="amsgrad"):
        ckpt.load_checkpoint(amsgrad, tmp_path / "c")


def test_export_loads_into_torch_adamw_which_continues_identically(tmp_path, nvme, closing):
    """An exported checkpoint is a torch state_dict: torch's own AdamW loads it and then steps to the
    same parameters as the offloaded optimizer."""
    params = make_params()
    opt = closing(make_opt(params, nvme, fused=True))
    train(opt, params, range(3))
    ckpt.save_checkpoint(opt, tmp_path / "c")
    assert ckpt_main(["export", str(tmp_path / "c"), str(tmp_path / "out.pt")]) == 0
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in params]
    torch_opt = torch.optim.AdamW(theirs, lr=1e-2, fused=True)
    torch_opt.load_state_dict(torch.load(tmp_path / "out.pt", weights_only=True))
    train(opt, params, range(3, 5))
    train(torch_opt, theirs, range(3, 5))
    assert_same(params, theirs)


@pytest.mark.parametrize("via", ["config", "like", "cli"])
def test_import_of_a_torch_adamw_state_dict_resumes_identically(tmp_path, nvme, closing, via):
    """torch's AdamW state, imported as a checkpoint (API with a config or a reference checkpoint, or
    the CLI), loads into the offloaded optimizer, which then steps exactly as torch's would."""
    theirs = make_params()
    torch_opt = torch.optim.AdamW(theirs, lr=1e-2, fused=True)
    train(torch_opt, theirs, range(3))
    sd = torch_opt.state_dict()
    target = tmp_path / "imported"
    if via == "config":
        ckpt.import_state_dict(sd, target, config={"offload_optimizer": {"buffer_size": 128 * 1024}})
    else:
        ref = closing(make_opt(make_params(), nvme))
        train(ref, ref.param_groups[0]["params"], range(1))
        ckpt.save_checkpoint(ref, tmp_path / "ref")
        ref.close()
        if via == "like":
            ckpt.import_state_dict(sd, target, like=tmp_path / "ref")
        else:
            torch.save(sd, tmp_path / "in.pt")
            assert ckpt_main(["import", str(tmp_path / "in.pt"), str(target), "--like", str(tmp_path / "ref")]) == 0
    ours = [torch.nn.Parameter(p.detach().clone()) for p in theirs]
    opt = closing(make_opt(ours, nvme, fused=True))
    ckpt.load_checkpoint(opt, target)
    train(opt, ours, range(3, 5))
    train(torch_opt, theirs, range(3, 5))
    assert_same(ours, theirs)


def test_cli_inspect_and_verify_report_and_exit_codes(tmp_path, nvme, closing, capsys):
    """`inspect` summarises the manifest, `verify` says OK for a good checkpoint and exits 1 with the
    reason for a corrupt or missing one."""
    params = make_params()
    opt = closing(make_opt(params, nvme))
    train(opt, params, range(2))
    ckpt.save_checkpoint(opt, tmp_path / "c")
    opt.close()
    assert ckpt_main(["inspect", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert "step: 2" in out and "state.bin" in out and "group 0: 5 params" in out
    assert ckpt_main(["inspect", "--json", str(tmp_path / "c")]) == 0
    assert json.loads(capsys.readouterr().out)["version"] == ckpt.FORMAT_VERSION
    assert ckpt_main(["verify", str(tmp_path / "c")]) == 0
    assert "OK" in capsys.readouterr().out
    flip_bit(ckpt_file(tmp_path / "c", "state.bin"), 5000, 0x10)
    assert ckpt_main(["verify", str(tmp_path / "c"), str(tmp_path / "missing")]) == 1
    out = capsys.readouterr().out
    assert re.search(r"state\.[0-9a-f]{16}\.bin: bytes \[0, ", out)
    assert "FAILED" in out and "no checkpoint directory" in out


def test_retention_keeps_the_last_n_and_milestones(tmp_path, nvme, closing):
    """Only the newest keep_last checkpoints survive, plus milestones by rule or by mark; latest()
    names the newest."""
    params = make_params(sizes=(10, 5000))
    opt = closing(make_opt(params, nvme))
    keep = ckpt.Retention(tmp_path / "ckpts", keep_last=2, milestones=lambda step: step % 4 == 0)
    for step in range(1, 8):
        train(opt, params, [step])
        keep.save(opt, step, milestone=(step == 3))
    steps = [int(os.path.basename(p).split("-")[1]) for p in keep.checkpoints()]
    assert steps == [3, 4, 6, 7]
    assert keep.latest() == keep.path_for(7)
    ckpt.save_with_retention(opt, tmp_path / "ckpts", 8, keep_last=1)
    assert [os.path.basename(p) for p in keep.checkpoints()] == ["step-0000000003", "step-0000000008"]
    assert not [n for n in os.listdir(tmp_path / "ckpts") if ".tmp-" in n]


def _reshape(manifest: dict, change: str) -> None:
    """Break ``manifest``'s shape as ``change`` says (its checksum is recomputed after)."""
    swap = next(p for p in manifest["params"] if p["where"] == "swap")
    if change == "files-missing":
        del manifest["files"]
    elif change == "file-bytes-text":
        manifest["files"]["state.bin"]["bytes"] = "many"
    elif change == "chunk-short":
        swap["chunks"][0] = swap["chunks"][0][:4]
    elif change == "chunk-unit-beyond":
        swap["chunks"][0][0] = len(manifest["units"])
    elif change == "unit-offset-negative":
        manifest["units"][0]["offset"] = -4096
    elif change == "where-unknown":
        swap["where"] = "cloud"
    elif change == "params-not-a-list":
        manifest["params"] = {"0": swap}
    elif change == "group-params-text":
        manifest["param_groups"][0]["params"] = "all"


@pytest.mark.parametrize("change, field", [
    ("files-missing", "field files is missing"), ("file-bytes-text", r"field files\['state.bin'\].bytes must be"),
    ("chunk-short", r"field params\[\d\].chunks\[0\] must be a list of 5 numbers"),
    ("chunk-unit-beyond", r"field params\[\d\].chunks\[0\] names unit"),
    ("unit-offset-negative", r"field units\[0\].offset must be"), ("where-unknown", r"field params\[\d\].where must"),
    ("params-not-a-list", "field params must be a list"),
    ("group-params-text", r"field param_groups\[0\].params must be")])
def test_a_manifest_of_the_wrong_shape_is_refused_naming_the_field(tmp_path, nvme, closing, change, field):
    """A manifest whose checksum holds but whose shape is wrong (a field missing, of the wrong type, a
    chunk naming a unit that is not there) is refused by a load, a verify and read_manifest with a
    ValueError naming the field, before anything changes; never a KeyError, TypeError or IndexError."""
    params = make_params()
    opt = closing(make_opt(params, nvme))
    train(opt, params, range(1))
    ckpt.save_checkpoint(opt, tmp_path / "c")
    path = tmp_path / "c" / "manifest.json"
    manifest = json.loads(path.read_text())
    _reshape(manifest, change)
    manifest["manifest_xxh3_64"] = digest(manifest)
    path.write_text(json.dumps(manifest))
    before = copy.deepcopy(opt.state_dict())
    for read in (ckpt.read_manifest, ckpt.verify_checkpoint, lambda d: ckpt.load_checkpoint(opt, d)):
        with pytest.raises(ValueError, match=field):
            read(tmp_path / "c")
    assert_same_state(before, opt.state_dict())
