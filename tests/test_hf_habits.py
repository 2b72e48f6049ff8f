"""A Hugging Face user's first hour: from_pretrained with their habits (hub ids from the local cache, torch_dtype,
device_map refused), host memory that follows the model, exports transformers reads as written, and the fp32
masters by name (what DeepSpeed's zero_to_fp32 gives)."""

from __future__ import annotations

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
    from offload.ckpt_cli import main as ckpt_main
    from offload.integrations.transformers import from_pretrained
    from offload.pretrained import save_pretrained

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
    from offload.ckpt_cli import main as ckpt_main
    from offload.integrations.transformers import from_pretrained

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
    from offload.ckpt_cli import main as ckpt_main

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
    from offload.ckpt_cli import main as ckpt_main
    from offload.integrations.transformers import from_pretrained
    from offload.pretrained import save_pretrained

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
