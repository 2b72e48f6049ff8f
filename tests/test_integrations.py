"""The framework adapters (offload.integrations): resume bit for bit and save and load within the pools,
inside Hugging Face's Trainer, Lightning, accelerate and DCP; importable without their frameworks.

The runs themselves are tests/framework_runs.py, in two subprocesses started together (one for
Lightning, one for the rest), so that each measures its own peak memory and the imports overlap; each also runs
its frameworks' 8-bit state resume after the default runs (imports paid once).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from helpers import REPO, python_env, run_code
from torch import nn

from offload import CheckpointError, OffloadedAdamW

FRAMEWORKS = ["transformers", "lightning", "accelerate", "dcp"]
INT8 = ["accelerate@int8", "lightning@int8"]  # resumed with OffloadedAdamW(state_dtype="int8")
GROUPS = [["transformers", "accelerate", "dcp", "accelerate@int8"], ["lightning", "lightning@int8"]]
SLACK = 1.10  # peak RSS growth of a save or a load: at most the pools and 10%


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each framework's result line (see tests/framework_runs.py), or the failed run's output."""
    root = tmp_path_factory.mktemp("frameworks")
    env = python_env(MALLOC_MMAP_THRESHOLD_="65536")  # freed tensors leave RSS at once
    procs = []
    for group in GROUPS:
        missing = [f for f in group if f != "dcp" and _missing(f.partition("@")[0])]
        todo = [f for f in group if f not in missing]
        if todo:
            procs.append(subprocess.Popen([sys.executable, os.path.join(REPO, "tests", "framework_runs.py"), str(root),
                                           *todo], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                          env=env))
    results = {}
    for proc in procs:
        out, _ = proc.communicate(timeout=600)
        lines = [json.loads(line) for line in out.splitlines() if line.startswith('{"framework"')]
        results.update((r["framework"], r) for r in lines)
        if proc.returncode != 0:
            results.setdefault("failed", []).append(out[-4000:])
    yield results
    # The runs' checkpoints and swap files (about 0.6 GB) go with the module, not at the session's end, so they
    # do not add to the disk the later files' tests use.
    shutil.rmtree(root, ignore_errors=True)


def _missing(framework: str) -> bool:
    return importlib.util.find_spec(framework) is None


def _result(runs, framework):
    if _missing(framework) and framework != "dcp":
        pytest.skip(f"{framework} is not installed (pip install 'nvme-offload[integrations]')")
    assert framework in runs, "\n".join(runs.get("failed", ["no result"]))
    return runs[framework]


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_resuming_through_the_framework_is_bit_for_bit(runs, framework):
    """Saved through the framework after step 1 and resumed in new objects (offloaded weights, OffloadedAdamW),
    step 2 ends at the same weights as the run that went on."""
    assert _result(runs, framework)["same"]


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_save_and_load_stay_within_the_pools(runs, framework):
    """The framework's save and its load raise peak RSS by at most the host pools and 10%, with state and
    weights six times the pools; torch.save(opt.state_dict()) in the same process grows by the whole state."""
    r = _result(runs, framework)
    assert r["state"] + r["weights"] >= 4 * r["pool"]
    bound = SLACK * r["pool"]
    assert r["save"] <= bound, f"save grew RSS by {r['save'] / 2**20:.1f} MiB, pools {r['pool'] / 2**20:.1f} MiB"
    assert r["load"] <= bound, f"load grew RSS by {r['load'] / 2**20:.1f} MiB, pools {r['pool'] / 2**20:.1f} MiB"
    assert r["state_dict"] >= 0.9 * r["state"]  # the measurement does see a materialised state


def test_int8_state_resumes_through_the_frameworks_bit_for_bit(runs):
    """The adapters save and load 8-bit state as any: resumed through accelerate and through Lightning, step 2
    ends where the run that went on did."""
    frameworks = [f for f in INT8 if not _missing(f.partition("@")[0])]
    if not frameworks:
        pytest.skip("neither accelerate nor lightning is installed")
    assert set(frameworks) <= set(runs), "\n".join(runs.get("failed", ["no result"]))
    assert all(runs[f]["same"] for f in frameworks)
    assert all(runs[f]["state"] < runs[f.partition("@")[0]]["state"] / 2 for f in frameworks)  # int8 it was


def test_lightning_refuses_a_ckpt_beside_another_saves_directory_and_removes_both(runs):
    """A .ckpt whose directory was replaced by another save's is refused when read, naming both; Lightning's
    removal of a .ckpt (save_top_k) removes its directory too."""
    r = _result(runs, "lightning")
    assert r["mismatch"].startswith("CheckpointError") and "is not the save" in r["mismatch"]
    assert r["removed"]


def test_lightning_confines_a_received_ckpt_and_deletes_or_follows_nothing_of_a_user(runs):
    """A .ckpt naming a directory outside it (``..``, an absolute path; fingerprints recomputed) is refused
    before anything loads; removing a .ckpt leaves a user's file inside its directory and a user's
    ``X.ckpt.offload-1-backup`` beside it; a link planted at the old temporary name is not followed."""
    r = _result(runs, "lightning")
    assert len(r["confined"]) == 2
    for outcome in r["confined"]:
        assert outcome.startswith("CheckpointError") and "not a directory beside it" in outcome, outcome
    assert r["kept_foreign"]
    assert r["victim"] == "precious"


def test_dcp_refuses_a_streamed_part_from_another_save(nvme, closing, tmp_path):
    """offload.integrations.dcp.load checks that <checkpoint>/offload is the save DCP's part was written with,
    before anything is loaded: another save's directory in its place is refused and the state is untouched."""
    from offload.integrations import OFFLOAD_DIR, dcp

    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    opt = closing(OffloadedAdamW(model.parameters(), nvme_path=nvme, small_param_threshold=16))
    for step in range(2):
        model(torch.randn(4, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        dcp.save({"step": step}, tmp_path / f"step-{step}", optimizer=opt)
    before = opt.state_dict()
    os.rename(tmp_path / "step-0" / OFFLOAD_DIR, tmp_path / "saved")
    os.rename(tmp_path / "step-1" / OFFLOAD_DIR, tmp_path / "step-0" / OFFLOAD_DIR)
    state = {"step": -1}
    with pytest.raises(CheckpointError, match="is not the save"):
        dcp.load(state, tmp_path / "step-0", optimizer=opt)
    assert state["step"] == -1
    after = opt.state_dict()
    assert all(torch.equal(a, b) for i in before["state"] for a, b in
               zip(before["state"][i].values(), after["state"][i].values()))


def test_adapters_import_without_their_frameworks():
    """With transformers, lightning and accelerate hidden, every adapter module imports; using one says which
    package to install."""
    result = run_code("""
        import importlib.abc, sys

        class Hide(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("transformers", "lightning", "accelerate", "pytorch_lightning"):
                    raise ImportError(f"{name} is hidden")
                return None

        sys.meta_path.insert(0, Hide())
        import offload.integrations.transformers as t
        import offload.integrations.lightning as l
        import offload.integrations.accelerate as a
        import offload.integrations.dcp
        for use in (lambda: t.OffloadTrainer, lambda: l.OffloadCheckpoint, lambda: a.register(None, None)):
            try:
                use()
            except ImportError as err:
                print("ImportError:", err)
        print("ok", sorted(m for m in sys.modules if m.split(".")[0] in ("transformers", "lightning", "accelerate")))
    """)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[-1] == "ok []"
    assert sum("pip install 'nvme-offload[integrations]'" in line for line in lines) == 3
    assert sum(line.startswith("ImportError:") for line in lines) == 3


def test_an_accelerate_save_that_fails_after_the_hook_leaves_state_dict_answering_the_state(nvme, closing, tmp_path,
                                                                                           monkeypatch):
    """When accelerate's save_state fails after our hook streamed the state (before it asked for state_dict()),
    the optimizer's next state_dict() is the real state, not the one-shot marker meant for that save."""
    pytest.importorskip("accelerate")
    import accelerate.accelerator as acc_module
    from accelerate import Accelerator

    from offload import OffloadedAdamW
    from offload.integrations.accelerate import register

    torch.manual_seed(0)
    model = torch.nn.Linear(128, 64)
    accelerator = Accelerator(cpu=True)
    opt = closing(OffloadedAdamW(model.parameters(), nvme_path=nvme, small_param_threshold=1))
    model, prepared = accelerator.prepare(model, opt)
    register(accelerator, prepared)
    model(torch.randn(4, 128)).sum().backward()
    prepared.step()

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(acc_module, "save_accelerator_state", broken)
    with pytest.raises(OSError, match="No space left"):
        accelerator.save_state(str(tmp_path / "ckpt"))
    state = prepared.state_dict()
    assert "nvme_offload" not in state and set(state["state"]) == {0, 1}


@pytest.mark.parametrize("args, expected", [
    (dict(max_grad_norm=1.0), r"max_grad_norm=1\.0\) clips after backward.*pass max_grad_norm=0"),
    (dict(max_grad_norm=0, gradient_accumulation_steps=4), r"gradient_accumulation_steps=4\).*no_step"),
])
def test_offload_trainer_refuses_what_overlap_backward_cannot_honour_before_training(nvme, closing, tmp_path,
                                                                                    args, expected):
    """OffloadTrainer with an optimizer built with overlap_backward=True refuses Trainer's clipping after
    backward and gradient accumulation before the first step, saying what to use instead; nothing has changed."""
    pytest.importorskip("transformers")
    from transformers import TrainingArguments

    from offload import OffloadedAdamW
    from offload.integrations.transformers import OffloadTrainer

    model = torch.nn.Linear(8, 8)
    before = [p.detach().clone() for p in model.parameters()]
    opt = closing(OffloadedAdamW(model.parameters(), nvme_path=nvme, overlap_backward=True, small_param_threshold=1))
    targs = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], max_steps=1, **args)
    trainer = OffloadTrainer(model=model, args=targs, train_dataset=[{"x": torch.zeros(8)}], optimizers=(opt, None))
    with pytest.raises(ValueError, match=expected):
        trainer.train()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert opt.io_bytes() == (0, 0)
