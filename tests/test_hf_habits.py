"""A Hugging Face user's first hour: from_pretrained with their habits (hub ids from the local cache, torch_dtype,
device_map refused), host memory that follows the model, exports transformers reads as written, and the fp32
masters by name (what DeepSpeed's zero_to_fp32 gives)."""

from __future__ import annotations

import os

import psutil
import pytest
import torch

from offload.params import materialized, offloaded

transformers = pytest.importorskip("transformers")

MiB = 1 << 20


def tiny_gpt2(seed: int = 0):
    """About 0.54M parameters: a GPT-2 of 2 layers, width 128, a vocabulary of 1000."""
    cfg = transformers.GPT2Config(n_layer=2, n_embd=128, n_head=2, vocab_size=1000, n_positions=128,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(cfg)


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "tiny-gpt2"
    tiny_gpt2().save_pretrained(path)
    return path


@pytest.mark.parametrize("kw", [{}, {"max_in_cpu": 0, "max_grad_in_cpu": 0}], ids=["defaults", "all-on-nvme"])
def test_from_pretrained_of_a_half_million_parameter_model_grows_rss_by_under_300_mib(gpt2_dir, nvme, closing, kw):
    """Host memory follows the model: loading a 0.54M-parameter model grows RSS by well under 300 MiB, with the
    defaults (no weight on NVMe: no pool) and with every weight on NVMe (a pool of 1 MiB buffers); it used to
    grow by about 2 GiB, the pool of 5 x 1e8 elements."""
    from offload.integrations.transformers import from_pretrained

    before = psutil.Process().memory_info().rss
    model = closing(from_pretrained(gpt2_dir, nvme_path=nvme, **kw))
    grown = psutil.Process().memory_info().rss - before
    assert sum(p.numel() for p in model.parameters()) > 500_000
    assert grown < 300 * MiB, f"RSS grew by {grown / MiB:.0f} MiB"
    assert offloaded(model).store.pool.nbytes <= 5 * MiB


def _config_dtype(directory) -> str:
    import json

    with open(directory / "config.json") as f:
        return json.load(f)["dtype"]


def test_exports_write_the_weights_dtype_into_config_json(gpt2_dir, nvme, closing, tmp_path):
    """bf16 weights loaded from an fp32 checkpoint are exported with ``dtype: bfloat16`` in config.json, by
    save_pretrained and by offload-ckpt export --hf --config (whose config says float32), so transformers loads
    them as bf16, equal to ours; the rest of the config is kept."""
    from offload import save_parameters
    from offload.integrations.transformers import from_pretrained
    from offload.pretrained import save_pretrained
    from offload.tools.ckpt_cli import main as ckpt_main

    assert _config_dtype(gpt2_dir) == "float32"
    model = closing(from_pretrained(gpt2_dir, nvme_path=nvme, dtype=torch.bfloat16, max_in_cpu=0))
    save_pretrained(model, tmp_path / "saved")
    save_parameters(model, tmp_path / "ckpt")
    assert ckpt_main(["export", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "exported"), "--config",
                      str(gpt2_dir)]) == 0
    for out in ("saved", "exported"):
        assert _config_dtype(tmp_path / out) == "bfloat16", out
        back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / out)
        assert back.dtype == torch.bfloat16 and back.config.n_embd == 128, out


def test_the_fp32_export_holds_the_masters_by_name_and_loads_with_transformers(gpt2_dir, nvme, closing, tmp_path,
                                                                                capsys):
    """offload-ckpt export --fp32 of a checkpoint of a bf16 model trained two steps (weights and state on NVMe,
    small parameters' state in memory) writes every parameter as float32 under its state_dict name: each equal to
    the optimizer's fp32 master (masters differ from the bf16 weights in their low bits), loadable by
    transformers' from_pretrained with a float32 config."""
    from offload import OffloadedAdamW
    from offload.integrations.transformers import from_pretrained
    from offload.tools.ckpt_cli import main as ckpt_main

    model = closing(from_pretrained(gpt2_dir, nvme_path=nvme + "-w", dtype=torch.bfloat16, max_in_cpu=0,
                                    max_grad_in_cpu=0))
    model.train()
    opt = closing(OffloadedAdamW(model.parameters(), lr=1e-3, nvme_path=nvme, small_param_threshold=1000))
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    opt.save_checkpoint(tmp_path / "ckpt", model=model)
    masters = opt.state_dict()["state"]
    names = {id(p): n for n, p in model.named_parameters()}
    by_name = {names[id(p)]: masters[i]["master"] for i, p in enumerate(opt.param_groups[0]["params"])}
    assert ckpt_main(["export", str(tmp_path / "ckpt"), "--fp32", str(tmp_path / "fp32"), "--config",
                      str(gpt2_dir)]) == 0
    assert f"wrote {tmp_path / 'fp32'}" in capsys.readouterr().out
    from safetensors.torch import load_file

    got = load_file(tmp_path / "fp32" / "model.safetensors")
    assert set(by_name) <= set(got) and all(t.dtype == torch.float32 for t in got.values())
    for name, master in by_name.items():
        assert torch.equal(got[name], master.reshape(got[name].shape)), name
    with materialized(model):
        for name, p in model.named_parameters():  # the bf16 weights are their masters rounded
            assert torch.equal(by_name[name].reshape(p.shape).to(torch.bfloat16), p.detach()), name
    assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in by_name.values())  # more than bf16 holds
    assert _config_dtype(tmp_path / "fp32") == "float32"
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fp32")
    assert back.dtype == torch.float32
    for name, value in back.state_dict().items():
        if name in by_name:
            assert torch.equal(value, by_name[name].reshape(value.shape)), name


def test_the_fp32_export_refuses_a_checkpoint_without_names_or_masters(nvme, closing, tmp_path, capsys):
    """A checkpoint saved without model= (no names) or of weights alone (no masters) is refused with what to do;
    nothing is written."""
    from offload import OffloadedAdamW, save_parameters
    from offload.tools.ckpt_cli import main as ckpt_main

    model = torch.nn.Linear(64, 64)
    opt = closing(OffloadedAdamW(model.parameters(), nvme_path=nvme))
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    opt.save_checkpoint(tmp_path / "no-model")
    save_parameters(model, tmp_path / "weights")
    assert ckpt_main(["export", str(tmp_path / "no-model"), "--fp32", str(tmp_path / "a")]) == 1
    assert "save with opt.save_checkpoint(dir, model=model)" in capsys.readouterr().err.lower()
    assert ckpt_main(["export", str(tmp_path / "weights"), "--fp32", str(tmp_path / "b")]) == 1
    assert "no optimizer state" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_loads_saves_and_exports_show_progress_where_asked(gpt2_dir, nvme, closing, tmp_path, capsys, monkeypatch):
    """With OFFLOAD_PROGRESS=1 (as into a log; on a terminal it is the default) from_pretrained draws a bar of the
    bytes it loads, save_pretrained and offload-ckpt export one of the bytes they write, each to its end."""
    from offload import save_parameters
    from offload.integrations.transformers import from_pretrained
    from offload.pretrained import save_pretrained
    from offload.tools.ckpt_cli import main as ckpt_main

    monkeypatch.setenv("OFFLOAD_PROGRESS", "1")
    model = closing(from_pretrained(gpt2_dir, nvme_path=nvme, max_in_cpu=0))
    err = capsys.readouterr().err
    assert "loading tiny-gpt2" in err and "100%" in err
    save_pretrained(model, tmp_path / "saved")
    err = capsys.readouterr().err
    assert "saving saved" in err and "100%" in err
    save_parameters(model, tmp_path / "ckpt")
    capsys.readouterr()
    assert ckpt_main(["export", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "out"), "--config", str(gpt2_dir)]) == 0
    err = capsys.readouterr().err
    assert "saving out" in err and "100%" in err


@pytest.fixture
def hub_cache(gpt2_dir, tmp_path, monkeypatch):
    """A local Hugging Face hub cache holding "acme/tiny-gpt2" (refs/main -> a snapshot of gpt2_dir), set as
    huggingface_hub's cache; HF_HUB_OFFLINE unset."""
    import shutil

    from huggingface_hub import constants

    cache = tmp_path / "hub"
    repo = cache / "models--acme--tiny-gpt2"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123abcd")
    shutil.copytree(gpt2_dir, repo / "snapshots" / "0123abcd")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return cache


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to reach the network fails the test at once."""
    import socket

    def refuse(*args, **kwargs):
        raise AssertionError(f"the network was used: {args[:2]}")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)


def test_a_hub_id_in_the_local_cache_loads_with_no_network(gpt2_dir, hub_cache, no_network, nvme, closing):
    """from_pretrained("org/name") resolves the id through huggingface_hub's local cache and loads the cached
    snapshot without touching the network (HF_HUB_OFFLINE unset): the weights equal those of its directory."""
    from offload.integrations.transformers import from_pretrained

    model = closing(from_pretrained("acme/tiny-gpt2", nvme_path=nvme, torch_dtype=torch.bfloat16))
    ref = transformers.AutoModelForCausalLM.from_pretrained(gpt2_dir, dtype=torch.bfloat16)
    with materialized(model):
        got = model.state_dict()
        for name, value in ref.state_dict().items():
            assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], value), name


def test_a_hub_id_not_cached_is_a_clear_error_offline_and_one_download_attempt_online(hub_cache, nvme, monkeypatch):
    """Not in the cache: with HF_HUB_OFFLINE set, an error at once naming the id, the cache and how to fetch it;
    online, exactly one download attempt (no retries), its failure one error naming the id. No swap file either
    way."""
    import time

    import huggingface_hub
    from huggingface_hub import constants

    from offload import CheckpointError
    from offload.integrations.transformers import from_pretrained

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    t = time.monotonic()
    with pytest.raises(CheckpointError, match=r"acme/absent is neither a directory here nor in the local Hugging "
                                              r"Face cache .*HF_HUB_OFFLINE is set.*hf download acme/absent"):
        from_pretrained("acme/absent", nvme_path=nvme)
    assert time.monotonic() - t < 5
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    calls = []
    real = huggingface_hub.snapshot_download

    def download(repo, **kw):
        calls.append(kw.get("local_files_only", False))
        if kw.get("local_files_only"):
            return real(repo, **kw)
        raise ConnectionError("Failed to resolve 'huggingface.co'")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    with pytest.raises(CheckpointError, match=r"could not be downloaded \(ConnectionError: Failed to resolve"):
        from_pretrained("acme/absent", nvme_path=nvme)
    assert calls == [True, False]  # the cache, then one attempt
    assert not os.path.exists(nvme)


@pytest.mark.parametrize("given, message", [
    ("/no/such/model", r"no such directory: /no/such/model; give the directory holding config.json"),
    ("./no-such-model", r"no such directory: ./no-such-model"),
])
def test_a_missing_directory_is_named_before_transformers_is_asked(given, message, nvme):
    """A path that does not exist is "no such directory", not transformers' "Repo id must be in the form"."""
    from offload import CheckpointError
    from offload.integrations.transformers import from_pretrained

    with pytest.raises(CheckpointError, match=message):
        from_pretrained(given, nvme_path=nvme)


def test_a_directory_without_config_json_is_refused(tmp_path, nvme):
    """A directory that holds no config.json is refused, naming it."""
    from offload import CheckpointError
    from offload.integrations.transformers import from_pretrained

    (tmp_path / "weights").mkdir()
    with pytest.raises(CheckpointError, match=r"weights has no config.json"):
        from_pretrained(tmp_path / "weights", nvme_path=nvme)


@pytest.mark.parametrize("kw, message", [
    ({"device_map": "auto"}, r"device_map=\.\.\.\) is not supported here: .*pass device=\"cuda:0\""),
    ({"max_memory": {0: "10GiB"}}, r"max_memory.*set max_in_cpu="),
    ({"load_in_8bit": True}, r"quantized weights are not supported"),
    ({"offload_folder": "/x"}, r"pass nvme_path= instead"),
    ({"low_cpu_mem_usage": False}, r"one tensor at a time"),
    ({"max_in_cpus": 0}, r"from_pretrained\(\) got an unexpected keyword argument 'max_in_cpus'; .*max_in_cpu"),
    ({"dtype": torch.float16, "torch_dtype": torch.bfloat16}, r"the same setting .*give one"),
    ({"dtype": "int8"}, r"not a floating-point torch dtype"),
])
def test_transformers_keywords_with_no_meaning_here_are_refused_saying_what_to_do(gpt2_dir, nvme, kw, message):
    """device_map, max_memory, quantization and the like are refused with a sentence naming what to use instead;
    an unknown keyword names from_pretrained, not a function the user did not call; no swap file is made."""
    from offload.integrations.transformers import from_pretrained

    with pytest.raises(TypeError, match=message):
        from_pretrained(gpt2_dir, nvme_path=nvme, **kw)
    assert not os.path.exists(nvme)


@pytest.mark.parametrize("kw, expected", [({"torch_dtype": torch.bfloat16}, torch.bfloat16),
                                          ({"dtype": "float16"}, torch.float16), ({"dtype": "auto"}, torch.float32),
                                          ({"low_cpu_mem_usage": True}, torch.float32)])
def test_dtype_torch_dtype_auto_and_harmless_keywords_are_taken(gpt2_dir, nvme, closing, kw, expected):
    """torch_dtype (transformers' older name), a dtype by name, "auto" (config.json's) and low_cpu_mem_usage=True
    load as transformers would."""
    from offload.integrations.transformers import from_pretrained

    model = closing(from_pretrained(gpt2_dir, nvme_path=nvme, **kw))
    assert {p.dtype for p in model.parameters()} == {expected}
