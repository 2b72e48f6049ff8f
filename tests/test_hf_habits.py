"""A Hugging Face user's first hour: from_pretrained with their habits (hub ids from the local cache, torch_dtype,
device_map refused), host memory that follows the model, exports transformers reads as written, and the fp32
masters by name (what DeepSpeed's zero_to_fp32 gives)."""

from __future__ import annotations

import psutil
import pytest
import torch

from offload.params import offloaded

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
