"""Checkpoints of offloaded models: weights streamed to params.bin and back, with and without an optimizer.

Pools are tiny (3 buffers of 2048 elements) so that every weight is larger than one buffer and the
model is several times the pool: a save or load that materialised the weights could not hide it.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from helpers import OPT, TINY, Net, assert_same_state, assert_same_weights, ckpt_file, flip_bit, loss_of

from offload import OffloadedAdamW, StateError, offload_parameters, restore_parameters
from offload import checkpoint as ckpt
from offload.aio import Engine
from offload.checkpoint import load_parameters, save_parameters
from offload.params import materialized, offloaded, store_of
from offload.tools.ckpt_cli import main as ckpt_main

DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="fp32")]


@pytest.fixture
def build(nvme, closing):
    """``build(seed, dtype=torch.float32, optimizer=True, offload=True, **net_kw)``: a Net (4 blocks, a
    head, a buffer) seeded with ``seed``, its weights offloaded, and an OffloadedAdamW over it (or None);
    both closed when the test ends, whatever happens to it."""

    def make(seed, dtype=torch.float32, optimizer=True, offload=True, **kw):
        torch.manual_seed(seed)
        model = closing(Net(**kw).to(dtype))
        if offload:
            offload_parameters(model, nvme, **TINY)
        opt = closing(OffloadedAdamW(model.parameters(), nvme_path=nvme, **OPT)) if optimizer else None
        return model, opt

    return make


def train(model, opt, steps, dtype):
    losses = []
    for step in steps:
        loss = loss_of(model, step, dtype)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
    return losses


def weights(model):
    """Copies of every state_dict entry (materialises: for comparisons only)."""
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_same_tensors(a: dict, b: dict):
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"{k} differs"


def count_fetches(monkeypatch, store) -> list:
    calls = []
    fetch = store.fetch

    def spy(p, **kw):
        calls.append(p)
        return fetch(p, **kw)

    monkeypatch.setattr(store, "fetch", spy)
    return calls


# -- resuming -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_resume_with_model_weights_is_bit_identical(tmp_path, build, dtype):
    """A fresh offloaded model and optimizer loaded from save_checkpoint(model=) continue with the
    same losses, weights and optimizer state, bit for bit, as the run that saved; stored grads of
    the loading model are cleared."""
    model, opt = build(1, dtype)
    train(model, opt, range(3), dtype)
    opt.save_checkpoint(tmp_path / "c", model=model, extra={"step": 3})
    ours = train(model, opt, range(3, 6), dtype)

    other, opt2 = build(2, dtype)
    loss_of(other, 0, dtype).backward()  # grads in the grad store, of weights about to be replaced
    assert opt2.load_checkpoint(tmp_path / "c", model=other) == {"step": 3}
    assert all(p.grad is None for p in other.parameters())
    theirs = train(other, opt2, range(3, 6), dtype)
    assert [x.item() for x in ours] == [x.item() for x in theirs]
    assert_same_tensors(weights(model), weights(other))
    assert_same_state(opt.state_dict(), opt2.state_dict())


@pytest.mark.parametrize("dtype", DTYPES)
def test_save_and_load_keep_resident_weights_bounded_by_the_pool(tmp_path, build, monkeypatch, dtype):
    """Saving and loading never fetch a weight: the store's peak resident bytes stay within pool +
    largest parameter, far below the model's size."""
    model, opt = build(3, dtype)
    train(model, opt, range(2), dtype)
    store = offloaded(model).store
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    bound = store.pool.nbytes + largest
    assert sum(p.numel() * p.element_size() for p in model.parameters()) > 3 * bound

    fetched = count_fetches(monkeypatch, store)
    store.reset_peak()
    opt.save_checkpoint(tmp_path / "c", model=model)
    assert store.resident_bytes_max <= bound and not fetched

    other, opt2 = build(4, dtype)
    store2 = offloaded(other).store
    fetched2 = count_fetches(monkeypatch, store2)
    store2.reset_peak()
    opt2.load_checkpoint(tmp_path / "c", model=other)
    load_parameters(other, tmp_path / "c")
    assert store2.resident_bytes_max <= bound and not fetched2


def assert_masters_are_the_weights(model, opt):
    """Every bf16 parameter's fp32 master (offloaded or, for a small one, in memory) equals its weight,
    widened: the bits a master seeded from the weights must have (zeros, or stale values, would still train
    without error)."""
    masters = opt.state_dict()["state"]
    with materialized(model):
        params = list(model.parameters())
        seeded = [i for i, p in enumerate(params) if "master" in masters.get(i, {})]
        assert seeded and len(seeded) == len(masters)
        for i in seeded:
            assert torch.equal(masters[i]["master"], params[i].detach().float()), f"parameter {i}: master"


def test_checkpoint_of_adamw_over_offloaded_bf16_model_resumes_bit_for_bit(tmp_path, build):
    """save_checkpoint/load_checkpoint of OffloadedAdamW over an offloaded bf16 model resumes exactly,
    and a checkpoint without fp32 masters seeds them from the offloaded weights (fetched for it)."""
    bf16 = torch.bfloat16
    model, opt = build(26, bf16)
    train(model, opt, range(3), bf16)
    ckpt.save_checkpoint(opt, tmp_path / "c", extra={"model": model.state_dict()})
    train(model, opt, range(3, 5), bf16)

    other, opt2 = build(27, bf16)
    other.load_state_dict(ckpt.load_checkpoint(opt2, tmp_path / "c")["model"])
    train(other, opt2, range(3, 5), bf16)
    assert_same_weights(model, other)

    # Without masters in the checkpoint, load seeds them from the (offloaded) bf16 weights.
    sd = ckpt.export_state_dict(tmp_path / "c", include_master=False)
    ckpt.import_state_dict(sd, tmp_path / "nomaster", like=tmp_path / "c")
    third, opt3 = build(28, bf16)
    ref, opt_ref = build(28, bf16)
    state = ckpt.load_checkpoint(opt2, tmp_path / "c")["model"]
    for m in (third, ref):
        m.load_state_dict(state)
    ckpt.load_checkpoint(opt3, tmp_path / "nomaster")
    assert offloaded(third).store.resident_bytes == 0
    assert_masters_are_the_weights(third, opt3)
    # load_state_dict of the same master-less state seeds them from the offloaded weights as well.
    fourth, opt4 = build(28, bf16)
    fourth.load_state_dict(state)
    opt4.load_state_dict(sd)
    assert_masters_are_the_weights(fourth, opt4)
    restore_parameters(ref)  # the same, with weights in memory
    ckpt.load_checkpoint(opt_ref, tmp_path / "nomaster")
    train(third, opt3, range(3, 5), bf16)
    train(ref, opt_ref, range(3, 5), bf16)
    assert_same_weights(ref, third)


# -- refusals and faults --------------------------------------------------------------------------


def test_flipped_bit_in_params_bin_is_named_and_nothing_changes(tmp_path, build):
    """A flipped bit in one parameter's bytes is reported with its name and byte range, before the
    model or the optimizer changes; both go on training as before; verify finds it too."""
    model, opt = build(5)
    train(model, opt, range(2), torch.float32)
    opt.save_checkpoint(tmp_path / "c", model=model)
    entry = next(e for e in ckpt.read_manifest(tmp_path / "c")["model"]["tensors"]
                 if e["name"] == "blocks.1.up.weight")
    flip_bit(ckpt_file(tmp_path / "c", "params.bin"), entry["offset"] + 100, 0x04)

    other, opt2 = build(6)
    train(other, opt2, range(1), torch.float32)
    before, state = weights(other), copy.deepcopy(opt2.state_dict())  # in-memory state comes back live
    with pytest.raises(ckpt.ChecksumError, match=r"params\.[0-9a-f]{16}\.bin: parameter 'blocks.1.up.weight' \(bytes "
                                                 rf"\[{entry['offset']}, {entry['offset'] + entry['length']}\)\)"):
        opt2.load_checkpoint(tmp_path / "c", model=other)
    assert_same_tensors(before, weights(other))
    assert_same_state(state, opt2.state_dict())
    train(other, opt2, range(1, 2), torch.float32)  # no StateError: nothing was touched
    with pytest.raises(ckpt.ChecksumError, match="blocks.1.up.weight"):
        ckpt.verify_checkpoint(tmp_path / "c")


def test_a_different_model_is_refused_before_anything_changes(tmp_path, build):
    """A model with other shapes, or with a tensor the checkpoint lacks, is refused with the first
    mismatch named (name, checkpoint's and model's shape) and keeps its weights."""
    model, _ = build(7, optimizer=False)
    save_parameters(model, tmp_path / "c")

    wider, _ = build(8, optimizer=False, h=64)
    before = weights(wider)
    with pytest.raises(ckpt.CheckpointError, match=r"'blocks.0.up.weight' has shape \(128, 32\) in the "
                                                   r"checkpoint, \(64, 32\) in this model"):
        load_parameters(wider, tmp_path / "c")
    assert_same_tensors(before, weights(wider))

    # Its first four blocks match the checkpoint: a load that wrote them before finding blocks.4
    # missing would change them.
    deeper, _ = build(9, optimizer=False, layers=5)
    before = weights(deeper)
    with pytest.raises(ckpt.CheckpointError, match=r"has no param 'blocks.4.up.weight', which this model has"):
        load_parameters(deeper, tmp_path / "c")
    assert_same_tensors(before, weights(deeper))
    halfprec, _ = build(9, optimizer=False, dtype=torch.bfloat16)
    before = weights(halfprec)
    with pytest.raises(ckpt.CheckpointError, match=r"dtype float32 in the checkpoint, bfloat16 in this model"):
        load_parameters(halfprec, tmp_path / "c")
    assert_same_tensors(before, weights(halfprec))


def test_write_fault_while_saving_weights_leaves_the_previous_checkpoint_loadable(tmp_path, nvme, build, monkeypatch):
    """An EIO writing params.bin fails the save with an OSError naming params.bin; the previous
    checkpoint at that directory is untouched and loads its own weights; nothing temporary is left."""
    model, opt = build(10)
    train(model, opt, range(2), torch.float32)
    opt.save_checkpoint(tmp_path / "c", model=model)
    saved = weights(model)
    train(model, opt, range(2, 3), torch.float32)

    class SecondEngineFails(ckpt.Storage):
        engines = 0

        def engine(self, aio):
            engine = Engine(aio)
            self.engines += 1
            if self.engines == 2:  # the first writes state.bin, the second params.bin
                engine.inject_fault("error", op="write", skip=1)
            return engine

    with pytest.raises(OSError, match=r"params\.[0-9a-f]{16}\.bin") as info:
        ckpt.save_checkpoint(opt, tmp_path / "c", model=model, storage=SecondEngineFails())
    assert info.value.errno == 5
    assert sorted(os.listdir(tmp_path)) == ["c", "nvme"]

    other, opt2 = build(11)
    opt2.load_checkpoint(tmp_path / "c", model=other)
    assert_same_tensors(saved, weights(other))


# -- without an optimizer, resident copies, export ------------------------------------------------


def test_save_parameters_and_load_parameters_round_trip_without_an_optimizer(tmp_path, nvme, build):
    """Weights (offloaded, kept in the host cache, tied) and buffers saved by save_parameters load
    back into an offloaded model, a model offloaded with another host cache, and a plain one."""
    model, _ = build(12, optimizer=False, offload=False)
    model.blocks[1].norm.weight = model.blocks[0].norm.weight
    offload_parameters(model, nvme, **{**TINY, "max_in_cpu": 40})  # the two smallest stay in memory
    with torch.no_grad(), materialized(model, modified=True):
        for p in model.parameters():
            p.add_(0.25)
    model.scale.fill_(3.0)
    save_parameters(model, tmp_path / "p")
    manifest = ckpt.read_manifest(tmp_path / "p")
    tensors = {e["name"]: e for e in manifest["model"]["tensors"]}
    assert manifest["optimizer"] is None and "state.bin" not in manifest["files"]
    assert tensors["blocks.1.norm.weight"] == {"name": "blocks.1.norm.weight", "same_as": "blocks.0.norm.weight"}
    assert tensors["blocks.0.up.weight"]["where"] == "params.bin"
    assert tensors["head.bias"]["where"] == "model.pt" and tensors["scale"]["where"] == "model.pt"
    expected = weights(model)

    for offload in (True, False):
        other, _ = build(13, optimizer=False, offload=False)
        other.blocks[1].norm.weight = other.blocks[0].norm.weight
        if offload:
            offload_parameters(other, nvme, **TINY)  # everything on disk this time
        load_parameters(other, tmp_path / "p")
        assert_same_tensors(expected, weights(other))
    ckpt.verify_checkpoint(tmp_path / "p")


def test_resident_weights_are_saved_from_and_loaded_into_their_current_copy(tmp_path, build):
    """Inside materialized(), a weight changed in place (not yet written back) is saved as changed,
    and a load overwrites the resident copy as well as the disk, so neither goes stale."""
    model, _ = build(14, optimizer=False)
    with torch.no_grad(), materialized(model, modified=True):
        model.head.weight.fill_(7.0)
        save_parameters(model, tmp_path / "p")
    assert torch.equal(ckpt.export_model_state_dict(tmp_path / "p")["head.weight"], torch.full((8, 32), 7.0))

    other, _ = build(15, optimizer=False)
    with torch.no_grad(), materialized(other):
        load_parameters(other, tmp_path / "p")
        assert torch.equal(other.head.weight, torch.full((8, 32), 7.0))
    assert_same_tensors(weights(model), weights(other))


def test_checkpoint_without_a_model_loads_as_before_and_refuses_a_model(tmp_path, build):
    """A checkpoint saved without model= has the optimizer's files only and loads as before; asking
    it for a model, or a weights-only checkpoint for an optimizer, is refused with nothing changed."""
    model, opt = build(16)
    train(model, opt, range(2), torch.float32)
    opt.save_checkpoint(tmp_path / "c")
    assert sorted(ckpt.read_manifest(tmp_path / "c")["files"]) == ["memory.pt", "state.bin"]
    assert len(os.listdir(tmp_path / "c")) == 3
    opt.load_checkpoint(tmp_path / "c")
    before = weights(model)
    with pytest.raises(ckpt.CheckpointError, match="holds no model weights"):
        opt.load_checkpoint(tmp_path / "c", model=model)
    with pytest.raises(ckpt.CheckpointError, match="holds no model weights"):
        load_parameters(model, tmp_path / "c")
    assert_same_tensors(before, weights(model))
    train(model, opt, range(2, 3), torch.float32)

    save_parameters(model, tmp_path / "p")
    with pytest.raises(ckpt.CheckpointError, match="model weights only"):
        opt.load_checkpoint(tmp_path / "p")
    opt.save_checkpoint(tmp_path / "c", model=model)
    opt.load_checkpoint(tmp_path / "c")  # the model section is optional to read


def test_export_model_out_writes_the_models_state_dict(tmp_path, build, capsys):
    """`offload-ckpt export CKPT --model-out` writes exactly model.state_dict() (names, order, values),
    which a plain model loads strictly; inspect summarises the model; no output file is a usage error."""
    model, opt = build(17, dtype=torch.bfloat16)
    train(model, opt, range(2), torch.bfloat16)
    opt.save_checkpoint(tmp_path / "c", model=model)
    assert ckpt_main(["export", str(tmp_path / "c"), str(tmp_path / "opt.pt"),
                      "--model-out", str(tmp_path / "model.pt")]) == 0
    exported = torch.load(tmp_path / "model.pt", weights_only=True)
    assert_same_tensors(weights(model), exported)
    plain = Net().to(torch.bfloat16)
    plain.load_state_dict(exported, strict=True)
    assert "state" in torch.load(tmp_path / "opt.pt", weights_only=True)

    assert ckpt_main(["inspect", str(tmp_path / "c")]) == 0
    assert "offloaded parameters in params.bin" in capsys.readouterr().out
    assert json.loads((tmp_path / "c" / "manifest.json").read_text())["model"]["offloaded_bytes"] > 0
    assert ckpt_main(["export", str(tmp_path / "c")]) == 2


def test_failed_load_blocks_fetches_until_a_load_succeeds(tmp_path, build, monkeypatch):
    """A read error while streaming weights in leaves them half loaded: fetching them (a forward, a
    step, a save) raises StateError until a load succeeds, after which training resumes."""
    model, opt = build(18)
    train(model, opt, range(2), torch.float32)
    opt.save_checkpoint(tmp_path / "c", model=model)

    other, opt2 = build(19)
    # Let the verification pass (one read per buffer-sized unit) through, fail in the streaming pass.
    unit = offloaded(other).store.pool.buffer_size
    checked = sum(-(-e["length"] // unit) for e in ckpt.read_manifest(tmp_path / "c")["model"]["tensors"]
                  if e.get("where") == "params.bin")

    class ReadFails(ckpt.Storage):
        def engine(self, aio):
            engine = Engine(aio)
            engine.inject_fault("error", op="read", skip=checked + 5)
            return engine

    with pytest.raises(OSError, match=r"params\.[0-9a-f]{16}\.bin"):
        ckpt.load_checkpoint(opt2, tmp_path / "c", model=other, storage=ReadFails())
    with pytest.raises(StateError, match="failed part-way"):
        loss_of(other, 0)
    with pytest.raises(StateError):
        opt2.save_checkpoint(tmp_path / "d", model=other)
    assert store_of(other.head.weight).error is not None
    opt2.load_checkpoint(tmp_path / "c", model=other)
    assert_same_tensors(weights(model), weights(other))
    train(other, opt2, range(2, 3), torch.float32)


# -- CUDA -----------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_model_weights_round_trip_through_disk_and_host_cache(tmp_path, nvme, closing):
    """On a GPU, weights on NVMe and in the (pinned) host cache save and load through the pool, into
    another GPU model offloaded differently and into a plain GPU model, bit for bit."""
    torch.manual_seed(20)
    model = closing(Net().cuda())
    offload_parameters(model, nvme, max_in_cpu=2000, buffer_count=3, buffer_size=2048, pin_memory=True)
    assert offloaded(model).store.host_cache_bytes > 0
    save_parameters(model, tmp_path / "p")
    expected = weights(model)
    for offload in (True, False):
        torch.manual_seed(21)
        other = closing(Net().cuda())
        if offload:
            offload_parameters(other, nvme, **TINY)
        load_parameters(other, tmp_path / "p")
        assert_same_tensors(expected, weights(other))
