"""Hugging Face checkpoints in and out of offloaded models: safetensors loaded one tensor at a time (sharded, tied,
converted), models saved as directories from_pretrained reads, bit for bit, and the errors for bad checkpoints."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from helpers import TINY, Net, proc_status, reset_peak_rss
from torch import nn

from offload import CheckpointError, offload_parameters, restore_parameters, save_parameters
from offload.params import load_grad, materialized, offloaded
from offload.pretrained import load_safetensors, save_pretrained
from offload.tools.ckpt_cli import main as ckpt_main

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

MiB = 1 << 20


def tiny_llama(tie=True, seed=0):
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A sharded fp32 checkpoint of a tiny Llama with tied embeddings, written by save_pretrained."""
    path = tmp_path_factory.mktemp("hf") / "src"
    tiny_llama().save_pretrained(path, max_shard_size="30KB")
    assert os.path.isfile(path / "model.safetensors.index.json") and len(os.listdir(path)) > 4
    return path


def state_of(model) -> dict:
    with materialized(model):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_from_pretrained_loads_a_sharded_tied_checkpoint_converted_to_bf16(hf_dir, nvme, closing):
    """One call builds the model on meta and loads the fp32 shards as bf16 straight into the swap space: every
    weight equals the source's converted, the embedding and head stay one parameter, and logits equal those of
    transformers' own from_pretrained in bf16."""
    from offload.integrations.transformers import from_pretrained

    model = closing(from_pretrained(hf_dir, nvme_path=nvme, dtype=torch.bfloat16, **TINY))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert offloaded(model).store.resident_bytes == 0
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16)
    got = state_of(model)
    for name, value in ref.state_dict().items():
        assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], value), name
    x = torch.randint(0, 96, (2, 7))
    with torch.no_grad():
        assert torch.equal(model(x).logits, ref(x).logits)


def test_load_safetensors_into_an_offloaded_model(nvme, closing, tmp_path):
    """A single safetensors file loads into a model already offloaded (and training): weights equal the file's,
    at most one parameter resident meanwhile, and the stored grads of the old weights dropped."""
    torch.manual_seed(3)
    src = Net(d=32, h=64, layers=2)
    safetensors_torch.save_file(src.state_dict(), tmp_path / "w.safetensors")
    model = closing(offload_parameters(Net(d=32, h=64, layers=2), nvme_path=nvme, **TINY))
    model(torch.randn(4, 32)).sum().backward()
    store = offloaded(model).store
    store.reset_peak()
    plan = load_safetensors(model, tmp_path / "w.safetensors")
    assert not plan.missing and not plan.unexpected
    assert store.resident_bytes_max <= max(p.numel() * 4 for p in src.parameters())
    assert all(load_grad(p) is None for p in model.parameters())
    got = state_of(model)
    for name, value in src.state_dict().items():
        assert torch.equal(got[name], value), name


def _corrupt_header(path):
    with open(path, "r+b") as f:
        f.write(b"\xff" * 8)  # a header length far past the file's end


@pytest.mark.parametrize("fault, expected", [
    ("missing_key", r"1 of the model's tensors are missing from it \('head.bias'\).*strict=False"),
    ("unexpected_key", r"holds 1 the model lacks \('extra'\)"),
    ("shape", r"'head.weight' has shape \(4, 32\), the model's 'head.weight' has \(8, 32\)"),
    ("missing_shard", r"lists 2 shards, 1 missing .*model-00002-of-00002.safetensors; copy or download"),
    ("corrupt_header", r"model-00001-of-00002.safetensors: not a readable safetensors file.*save the checkpoint"),
    ("shard_outside", r"names shards that are not files beside it \(\['\.\./outside.safetensors'\]\)"),
])
def test_bad_checkpoints_are_refused_naming_the_file_and_nothing_changes(nvme, closing, tmp_path, fault, expected):
    """Missing and unexpected names, a shape mismatch, a missing shard, a corrupt header and an index naming a
    shard outside the checkpoint each raise CheckpointError saying what and where, before any weight changed
    (and nothing outside is read)."""
    torch.manual_seed(4)
    src = Net(d=32, h=64, layers=2).state_dict()
    if fault == "missing_key":
        del src["head.bias"]
    elif fault == "unexpected_key":
        src["extra"] = torch.zeros(3)
    elif fault == "shape":
        src["head.weight"] = torch.zeros(4, 32)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    names = list(src)
    halves = {"model-00001-of-00002.safetensors": names[:6], "model-00002-of-00002.safetensors": names[6:]}
    for shard, keys in halves.items():
        safetensors_torch.save_file({k: src[k].contiguous() for k in keys}, ckpt / shard, metadata={"format": "pt"})
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: s for s, keys in halves.items() for k in keys}}))
    if fault == "missing_shard":
        os.unlink(ckpt / "model-00002-of-00002.safetensors")
    elif fault == "corrupt_header":
        _corrupt_header(ckpt / "model-00001-of-00002.safetensors")
    elif fault == "shard_outside":
        os.rename(ckpt / "model-00002-of-00002.safetensors", tmp_path / "outside.safetensors")
        index = json.loads((ckpt / "model.safetensors.index.json").read_text())
        index["weight_map"] = {k: "../outside.safetensors" if s.startswith("model-00002") else s
                               for k, s in index["weight_map"].items()}
        (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    model = closing(offload_parameters(Net(d=32, h=64, layers=2), nvme_path=nvme, **TINY))
    before = state_of(model)
    with pytest.raises(CheckpointError, match=expected):
        load_safetensors(model, ckpt)
    after = state_of(model)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_from_pretrained_refuses_a_mismatched_checkpoint_before_making_a_swap_file(hf_dir, nvme, tmp_path):
    """A config that does not fit the weights is refused before any swap file exists."""
    from offload.integrations.transformers import from_pretrained

    bad = tmp_path / "bad"
    bad.mkdir()
    for name in os.listdir(hf_dir):
        os.symlink(hf_dir / name, bad / name)
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg["intermediate_size"] = 48
    (bad / "config.json").unlink()
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"mlp.*has shape .*config.json"):
        from_pretrained(bad, nvme_path=nvme, **TINY)
    assert not os.path.exists(nvme) or not os.listdir(nvme)


SIDE, LAYERS = 1448, 12  # 8 MiB of fp32 each, 96 MiB in all


def _weight(i: int) -> torch.Tensor:
    return torch.randn(SIDE, SIDE, generator=torch.Generator().manual_seed(i))


def test_loading_holds_one_tensor_in_memory(nvme, closing, tmp_path):
    """Loading a 96 MiB sharded checkpoint into a meta-built offloaded model raises peak RSS by about one
    8 MiB tensor and the pool, not by the model (each read's mapping of the file is dropped after it)."""
    for half in range(2):
        safetensors_torch.save_file({f"{i}.weight": _weight(i) for i in range(half * 6, half * 6 + 6)},
                                    tmp_path / f"{half}.safetensors")
    weight_map = {f"{i}.weight": f"{i // 6}.safetensors" for i in range(LAYERS)}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(SIDE, SIDE, bias=False) for _ in range(LAYERS)])
    closing(offload_parameters(model, nvme_path=nvme, init=False, max_in_cpu=0, max_grad_in_cpu=0,
                               buffer_count=3, buffer_size=1 << 20))
    pool = offloaded(model).store.pool.nbytes
    before = reset_peak_rss()
    load_safetensors(model, tmp_path)
    growth = proc_status("VmHWM") - before
    assert growth < 2 * 8 * MiB + pool + 16 * MiB, f"peak RSS grew {growth / MiB:.1f} MiB"
    with materialized(model):
        assert torch.equal(model[5].weight, _weight(5))


def cached_pages(path, start: int = 0, stop: int | None = None) -> tuple[int, int]:
    """(pages of ``path`` in the page cache, pages of the file), by mincore(2) over a mapping of it; with
    ``start``/``stop``, only the pages wholly inside those bytes counted cached."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    size = os.path.getsize(path)
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            vec = (ctypes.c_ubyte * pages)()
            assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) == 0
            first = -(-start // mmap.PAGESIZE)
            last = pages if stop is None else stop // mmap.PAGESIZE
            return sum(vec[i] & 1 for i in range(first, last)), pages
        finally:
            libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(size))
    finally:
        os.close(fd)


@pytest.mark.parametrize("how", ["alone", "torchrun-2-here", "asked-to-keep", "torchrun-1-here-of-2", "unreadable"])
def test_a_load_drops_the_pages_it_read_from_the_page_cache_alone_not_beside_other_ranks(nvme, closing, tmp_path,
                                                                                        monkeypatch, how):
    """What a load read of the checkpoint leaves the page cache as it goes (a load larger than memory does not
    push everything else out), tensors read in several slices too (a fault reads pages behind it again); where
    other ranks of the job run on this machine (torchrun's LOCAL_WORLD_SIZE), which may read the same shards,
    or when asked, its pages stay."""
    env = {"torchrun-2-here": {"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2"},
           "torchrun-1-here-of-2": {"LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": "2"},
           "unreadable": {"LOCAL_WORLD_SIZE": "two"}}.get(how, {})  # counts as several, never raises
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr("offload.pretrained.load.READ_BYTES", 1 << 20)  # each 8 MiB tensor in 8 slices
    path = tmp_path / "model.safetensors"
    safetensors_torch.save_file({f"{i}.weight": _weight(i) for i in range(4)}, path)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # as if written long ago: nothing cached
    os.close(fd)
    if cached_pages(path)[0] > 1:
        pytest.skip("this file system keeps the file's pages in memory (tmpfs?)")
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(SIDE, SIDE, bias=False) for _ in range(4)])
    closing(offload_parameters(model, nvme_path=nvme, init=False, max_in_cpu=0, max_grad_in_cpu=0,
                               buffer_count=3, buffer_size=1 << 20))
    load_safetensors(model, path, **({"drop_behind": False} if how == "asked-to-keep" else {}))
    cached, pages = cached_pages(path)
    if how in ("alone", "torchrun-1-here-of-2"):
        # Pages the kernel was still reading ahead when they were dropped may stay: a few MiB, whatever the size.
        assert cached <= pages // 4, f"{cached} of {pages} pages still cached"
    else:
        assert cached > pages // 2, f"only {cached} of {pages} pages cached"
    with materialized(model):
        assert torch.equal(model[3].weight, _weight(3))


def _cached_file(tmp_path, tensors: dict):
    """A safetensors file of ``tensors`` with every page in the page cache (written, synced, read), or a skip
    where the file system does not cache them."""
    from offload.pretrained import SafetensorsCheckpoint

    path = tmp_path / "model.safetensors"
    safetensors_torch.save_file(tensors, path)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)  # clean pages: only those can be dropped
    os.close(fd)
    with open(path, "rb") as f:
        f.read()
    if cached_pages(path)[0] < cached_pages(path)[1] - 1:
        pytest.skip("this file system does not keep the file's pages cached")
    return path, SafetensorsCheckpoint(path, drop_behind=True)


def test_reading_an_empty_tensor_drops_nothing(tmp_path):
    """A tensor of no bytes read drops nothing (a zero length to posix_fadvise would mean to the end of the
    file), even read last."""
    path, ckpt = _cached_file(tmp_path, {"a": _weight(0), "a_empty": torch.zeros(5, 0), "b": _weight(1)})
    assert ckpt.entries["a"].offset < ckpt.entries["a_empty"].offset <= ckpt.entries["b"].offset  # before b
    before = cached_pages(path)[0]
    ckpt.read_into("a_empty", torch.empty(5, 0))
    assert cached_pages(path)[0] == before


def test_each_tensor_read_leaves_the_page_cache_before_the_file_is_done_and_no_other_tensor_does(tmp_path):
    """Pages go as they are read, not only once the whole file was: after three of four tensors (read in slices),
    the first three's pages are gone while the fourth's, not read yet, stay; a tensor read alone leaves the
    pages of the one before it."""
    path, ckpt = _cached_file(tmp_path, {f"{i}.weight": _weight(i) for i in range(4)})
    for i in range(3):
        e = ckpt.entries[f"{i}.weight"]
        dest = torch.empty(e.shape, dtype=e.dtype)
        for start in range(0, e.shape[0], 200):
            ckpt.read_into(e.name, dest[start:start + 200], start, min(e.shape[0], start + 200))
        assert torch.equal(dest, _weight(i))
    for i in range(3):
        e = ckpt.entries[f"{i}.weight"]
        assert cached_pages(path, e.offset, e.offset + e.nbytes)[0] == 0, f"tensor {i} still cached"
    last = ckpt.entries["3.weight"]
    inside, pages = cached_pages(path, last.offset, last.offset + last.nbytes)
    assert inside >= last.nbytes // 4096 - 1, "the unread tensor's pages were dropped"
    ckpt.read_into("3.weight", torch.empty(last.shape, dtype=last.dtype))
    assert cached_pages(path)[0] == 0  # the file done: all of it
    with open(path, "rb") as f:
        f.read()  # all cached again; a tensor read alone leaves the one before it, unread, cached
    ckpt = type(ckpt)(path, drop_behind=True)
    ckpt.read_into("2.weight", torch.empty(last.shape, dtype=last.dtype))
    before = ckpt.entries["1.weight"]
    assert cached_pages(path, before.offset, before.offset + before.nbytes)[0] >= before.nbytes // 4096 - 1


def test_save_pretrained_of_offloaded_model_loads_with_from_pretrained_bit_for_bit(hf_dir, nvme, closing, tmp_path):
    """An offloaded model saved as sharded safetensors (tied head saved once) loads with transformers'
    from_pretrained equal bit for bit, its shards within max_shard_size, its files the owner's alone (0600 in a
    0700 directory, as our checkpoints), and nothing is left beside it."""
    from offload.integrations.transformers import from_pretrained

    model = closing(from_pretrained(hf_dir, nvme_path=nvme, dtype=torch.bfloat16, **TINY))
    out = tmp_path / "export"
    save_pretrained(model, out, max_shard_size="20000")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and "lm_head.weight" not in index["weight_map"]
    for shard in shards:
        tensors = safetensors_torch.load_file(out / shard)
        assert len(tensors) == 1 or sum(t.numel() * t.element_size() for t in tensors.values()) <= 20000
    assert sorted(os.listdir(tmp_path)) == ["export", "nvme"]
    assert os.stat(out).st_mode & 0o777 == 0o700
    assert {n: os.stat(out / n).st_mode & 0o777 for n in os.listdir(out)} == {n: 0o600 for n in os.listdir(out)}
    back = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert back.dtype == torch.bfloat16 and back.lm_head.weight is back.model.embed_tokens.weight
    got = back.state_dict()
    for name, value in state_of(model).items():
        assert torch.equal(got[name], value), name


def test_save_pretrained_never_replaces_a_directory_with_other_files(tmp_path):
    """A non-empty target is refused; with overwrite, only a Hugging Face save is replaced, and a file of the
    user's beside it stops the replacement."""
    model = nn.Linear(4, 4)
    out = tmp_path / "out"
    save_pretrained(model, out)
    with pytest.raises(CheckpointError, match="not empty.*overwrite=True"):
        save_pretrained(model, out)
    save_pretrained(model, out, overwrite=True)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match=r"notes\.txt.*not replacing"):
        save_pretrained(model, out, overwrite=True)
    assert (out / "notes.txt").read_text() == "mine"
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_offload_trainer_save_model_writes_a_hugging_face_checkpoint(hf_dir, nvme, closing, tmp_path):
    """trainer.save_model(dir) of an offloaded model writes config and safetensors from_pretrained loads, equal
    to the offloaded weights, beside the files already in dir."""
    from transformers import TrainingArguments

    from offload.integrations.transformers import OffloadTrainer, from_pretrained

    model = closing(from_pretrained(hf_dir, nvme_path=nvme, **TINY))
    out = tmp_path / "run"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    targs = TrainingArguments(output_dir=str(out), use_cpu=True, report_to=[], max_steps=1)
    trainer = OffloadTrainer(model=model, args=targs, train_dataset=[{"input_ids": torch.zeros(4, dtype=torch.long)}])
    trainer.save_model(str(out))
    assert (out / "keep.txt").read_text() == "x" and (out / "training_args.bin").is_file()
    back = transformers.AutoModelForCausalLM.from_pretrained(out)
    got = back.state_dict()
    for name, value in state_of(model).items():
        assert torch.equal(got[name], value), name


def test_offload_ckpt_export_hf(nvme, closing, tmp_path, hf_dir, capsys):
    """offload-ckpt export --hf turns a checkpoint of offloaded weights into a directory from_pretrained loads,
    bit for bit."""
    from offload.integrations.transformers import from_pretrained

    model = closing(from_pretrained(hf_dir, nvme_path=nvme, **TINY))
    save_parameters(model, tmp_path / "ckpt")
    code = ckpt_main(["export", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "hf"), "--config", str(hf_dir),
                      "--max-shard-size", "20000"])
    assert code == 0, capsys.readouterr().err
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    got = back.state_dict()
    for name, value in state_of(model).items():
        assert torch.equal(got[name], value), name
    restore_parameters(model)


def test_saving_holds_one_tensor_in_memory(nvme, closing, tmp_path):
    """Saving a 96 MiB offloaded model as Hugging Face shards raises peak RSS by the pools (the parameters' and
    the writer's three 8 MiB buffers), not by the model: each weight streams from its extent through them. The
    shards hold its weights."""
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(SIDE, SIDE, bias=False) for _ in range(LAYERS)])
    closing(offload_parameters(model, nvme_path=nvme, max_in_cpu=0, max_grad_in_cpu=0, buffer_count=3,
                               buffer_size=1 << 20))
    pool = offloaded(model).store.pool.nbytes
    before = reset_peak_rss()
    save_pretrained(model, tmp_path / "out", max_shard_size="40MiB")
    growth = proc_status("VmHWM") - before
    assert growth < pool + 3 * 8 * MiB + 16 * MiB, f"peak RSS grew {growth / MiB:.1f} MiB"
    assert len(os.listdir(tmp_path / "out")) == 4  # 3 shards and the index
    with materialized(model):
        assert torch.equal(safetensors_torch.load_file(tmp_path / "out" / "model-00002-of-00003.safetensors")
                           ["5.weight"], model[5].weight)


def test_save_pretrained_refuses_weights_changed_on_disk_and_leaves_nothing(nvme, tmp_path):
    """A weight whose bytes changed in the swap file behind our back is named (StateError) when the export
    streams it, and no directory is left, neither the target nor the one beside it."""
    from helpers import flip_bit

    from offload import StateError

    torch.manual_seed(0)
    model = offload_parameters(Net(), nvme_path=nvme, **TINY)
    try:
        store = offloaded(model).store
        flip_bit(store.space.files[0], store.records[model.blocks[1].up.weight].extent.offset + 64)
        with pytest.raises(StateError, match=r"blocks\.1\.up\.weight"):
            save_pretrained(model, tmp_path / "out")
        assert sorted(os.listdir(tmp_path)) == ["nvme"]
    finally:
        offloaded(model).scheduler.remove()
        store.close()


def test_from_pretrained_not_strict_initialises_what_the_checkpoint_lacks(hf_dir, nvme, closing, tmp_path):
    """strict=False loads what the checkpoint has and gives the rest the model's own _init_weights (a norm
    weight of ones), instead of refusing."""
    from offload.integrations.transformers import from_pretrained

    src = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).state_dict()
    del src["model.norm.weight"], src["lm_head.weight"]  # the head is tied: saved as the embedding
    part = tmp_path / "part"
    part.mkdir()
    safetensors_torch.save_file(src, part / "model.safetensors", metadata={"format": "pt"})
    (part / "config.json").write_text((hf_dir / "config.json").read_text())
    with pytest.raises(CheckpointError, match="model.norm.weight"):
        from_pretrained(part, nvme_path=nvme, **TINY)
    model = closing(from_pretrained(part, nvme_path=nvme, strict=False, **TINY))
    got = state_of(model)
    assert torch.equal(got["model.norm.weight"], torch.ones(32))
    assert all(torch.equal(got[k], v) for k, v in src.items())


def test_weights_loaded_after_the_first_step_are_not_silently_undone_by_the_masters(nvme, closing, tmp_path):
    """bf16 weights keep an fp32 master in the optimizer. Loaded before the first step, the master is made from
    the loaded weights and training goes on; loaded after it, the next step would write the master's old weights
    back over them: it is refused with a StateError saying what to do, and a load of the optimizer's own
    checkpoint (weights and masters together) makes it step again."""
    from offload import OffloadedAdamW, StateError

    torch.manual_seed(7)
    src = {k: v.to(torch.bfloat16) for k, v in Net(d=32, h=64, layers=2).state_dict().items()}
    safetensors_torch.save_file(src, tmp_path / "model.safetensors")
    model = closing(offload_parameters(Net(d=32, h=64, layers=2).to(torch.bfloat16), nvme_path=nvme, **TINY))
    opt = closing(OffloadedAdamW(model.parameters(), lr=1e-3, nvme_path=str(tmp_path / "state")))

    def step():
        model(torch.randn(4, 32, dtype=torch.bfloat16)).float().square().mean().backward()
        opt.step()
        opt.zero_grad()

    load_safetensors(model, tmp_path / "model.safetensors")  # before any master: fine
    step()
    opt.save_checkpoint(tmp_path / "ckpt", model=model)
    load_safetensors(model, tmp_path / "model.safetensors")
    with pytest.raises(StateError, match=r"replaced \(load_parameters, load_safetensors\) after this optimizer "
                                         r"made its fp32 master.*load_checkpoint with model="):
        step()
    with materialized(model):
        assert all(torch.equal(p, src[n]) for n, p in model.named_parameters())  # the loaded weights stay
    opt.zero_grad()
    opt.load_checkpoint(tmp_path / "ckpt", model=model)
    step()


class Odd(nn.Module):
    """Tensors whose bytes start at odd offsets in the file, a scalar, an empty one, and one read in several
    slices."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.flags = nn.Parameter(torch.zeros(3, dtype=torch.uint8), requires_grad=False)
        self.scale = nn.Parameter(torch.zeros((), dtype=dtype))
        self.empty = nn.Parameter(torch.zeros(0, 7, dtype=dtype))
        self.w = nn.Parameter(torch.zeros(300, 1001, dtype=dtype))
        self.b = nn.Parameter(torch.zeros(5, dtype=dtype))
        self.register_buffer("steps", torch.zeros(2, dtype=torch.int64))


def _save_in_order(tensors: dict, path) -> None:
    """A safetensors file with the tensors back to back in the order given (``safetensors.torch.save_file``
    sorts them by alignment; a writer keeping the model's order, as ours, need not)."""
    from offload.pretrained.files import dtype_name

    header, offset = {}, 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for t in tensors.values():
            f.write(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())


def _odd_file(path, dtype=torch.float32, seed=0):
    """A safetensors file of Odd's tensors in random values (``dtype`` for the floating ones), the uint8
    flags first so every tensor after them starts at an odd offset."""
    g = torch.Generator().manual_seed(seed)
    src = {"flags": torch.tensor([1, 2, 3], dtype=torch.uint8), "scale": torch.randn((), generator=g).to(dtype),
           "empty": torch.zeros(0, 7, dtype=dtype), "w": torch.randn(300, 1001, generator=g).to(dtype),
           "b": torch.randn(5, generator=g).to(dtype), "steps": torch.tensor([7, -1])}
    _save_in_order(src, path)
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        assert json.loads(f.read(n))["scale"]["data_offsets"][0] == 3  # odd, as meant
    return src


@pytest.mark.parametrize("dtype, model_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                                (torch.bfloat16, torch.float32)])
def test_odd_offsets_scalars_and_empty_tensors_load_bit_for_bit(nvme, closing, tmp_path, monkeypatch, dtype,
                                                                 model_dtype):
    """Tensors at unaligned offsets, a 0-d and a 0-element one, and one read in several slices of rows load into
    an offloaded model equal to the file's values converted to the model's dtype, the integer ones as they are."""
    from offload.pretrained import load

    src = _odd_file(tmp_path / "model.safetensors", dtype)
    monkeypatch.setattr(load, "READ_BYTES", 64 * 1024)
    model = closing(offload_parameters(Odd(model_dtype), nvme_path=nvme, **TINY))
    load_safetensors(model, tmp_path / "model.safetensors")
    got = state_of(model)
    for name, value in src.items():
        want = value.to(model_dtype) if value.is_floating_point() else value
        assert got[name].dtype == want.dtype and torch.equal(got[name], want), name


def test_offload_pretrained_loads_odd_offsets_and_buffers_bit_for_bit(nvme, closing, tmp_path, monkeypatch):
    """offload_pretrained of a checkpoint with odd offsets fills the weights from the meta device, converted to
    bf16, and copies the buffers, equal to the file's values."""
    from offload.pretrained import load, offload_pretrained

    src = _odd_file(tmp_path / "model.safetensors")
    monkeypatch.setattr(load, "READ_BYTES", 64 * 1024)
    model = closing(offload_pretrained(lambda: Odd(torch.bfloat16), tmp_path, nvme, **TINY))
    got = state_of(model)
    for name, value in src.items():
        want = value.to(torch.bfloat16) if value.is_floating_point() else value
        assert torch.equal(got[name], want), name


def test_a_header_pointing_past_the_end_of_its_file_is_refused(tmp_path):
    """A header whose offsets point past the file's end is refused naming the file, before anything is read."""
    from offload.pretrained import SafetensorsCheckpoint

    header = json.dumps({"w": {"dtype": "F32", "shape": [1 << 30], "data_offsets": [0, 4 << 30]}}).encode()
    (tmp_path / "big.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 64)
    with pytest.raises(CheckpointError, match=r"big\.safetensors: not a readable safetensors file"):
        SafetensorsCheckpoint(tmp_path / "big.safetensors")


def test_shards_linked_to_blobs_load(nvme, closing, tmp_path):
    """A checkpoint laid out as the Hugging Face hub's cache (its files links to blobs elsewhere) loads: links to
    regular files are followed."""
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshot"
    blobs.mkdir()
    snapshot.mkdir()
    src = _odd_file(blobs / "0123abcd")
    os.symlink(blobs / "0123abcd", snapshot / "model.safetensors")
    model = closing(offload_parameters(Odd(), nvme_path=nvme, **TINY))
    load_safetensors(model, snapshot)
    got = state_of(model)
    assert all(torch.equal(got[n], v) for n, v in src.items())
