"""Checkpoints of a torch.distributed job (gloo, 2 ranks on CPU, each rank a process of
tests/dist_ckpt_worker.py): every rank's shard plus one job manifest, committed for the whole job."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from helpers import python_env

from offload import OffloadedAdamW
from offload.checkpoint import (
    CheckpointError,
    Retention,
    inspect_checkpoint,
    load_checkpoint,
    read_manifest,
    verify_checkpoint,
)
from offload.checkpoint.verify import read_job_manifest
from offload.ckpt_cli import main as ckpt_main

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_ckpt_worker.py")
WORLD = 2


@dataclasses.dataclass
class Job:
    root: str
    returncodes: list
    logs: list  # per rank: what each action did
    output: list

    def dump(self, rank: int, tag: str) -> dict:
        return torch.load(os.path.join(self.root, "out", f"rank{rank}-{tag}.pt"), weights_only=True)

    def explain(self) -> str:
        return "\n".join(f"--- rank {r} (exit {c}): {json.dumps(log)}\n{o[-3000:]}" for r, (c, log, o) in
                         enumerate(zip(self.returncodes, self.logs, self.output)))


def run_job(tmp_path, name: str, actions: list, *, seed: int = 0, timeout: float = 90) -> Job:
    """Run the worker on WORLD ranks (a gloo group over a file store) and collect what each did."""
    root = os.path.join(tmp_path, name)
    os.makedirs(root)
    spec = json.dumps({"init": f"file://{root}/store", "root": root, "actions": actions, "seed": seed,
                       "timeout": 30})
    procs = [subprocess.Popen([sys.executable, WORKER, spec], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=python_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(WORLD)))
             for r in range(WORLD)]
    output = []
    try:
        for p in procs:
            output.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    logs = []
    for r in range(WORLD):
        path = os.path.join(root, "out", f"rank{r}.json")
        logs.append(json.load(open(path)) if os.path.exists(path) else [])
    return Job(root, [p.returncode for p in procs], logs, output)


def assert_same(a, b, where: str = "") -> None:
    """Two nested structures of tensors and numbers are equal bit for bit."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif torch.is_tensor(a):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{where} differs"
    else:
        assert a == b, where


def assert_ok(job: Job) -> None:
    assert job.returncodes == [0] * WORLD and all(e["ok"] for log in job.logs for e in log), job.explain()


def step_dir(base: str, step: int) -> str:
    return os.path.join(base, f"step-{step:010d}")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A job that trains 2 steps, saves them to a shared directory, to node-local ones and through
    Retention, then trains 2 more (the uninterrupted run)."""
    tmp = str(tmp_path_factory.mktemp("dist-ckpt"))
    shared, local = os.path.join(tmp, "ckpt"), os.path.join(tmp, "node{rank}")
    keep = os.path.join(tmp, "keep")
    job = run_job(tmp, "first", [
        {"do": "train", "steps": 2},
        {"do": "save", "dir": step_dir(shared, 2)},
        {"do": "save", "dir": step_dir(local, 2)},
        {"do": "keep_save", "root": keep, "keep_last": 1},
        {"do": "dump", "tag": "s2"},
        {"do": "train", "steps": 2},
        {"do": "keep_save", "root": keep, "keep_last": 1},
        {"do": "dump", "tag": "s4"},
    ])
    assert_ok(job)
    return tmp, job


def test_job_save_then_load_restores_bit_for_bit_and_training_goes_on_as_uninterrupted(saved):
    """A job's checkpoint (shared directory, node-local directories, Retention) loads on every rank into
    fresh optimizers and models bit for bit, and training from it equals the run that went on."""
    tmp, first = saved
    job = run_job(tmp, "resume", [
        {"do": "keep_load", "root": os.path.join(tmp, "keep")},
        {"do": "dump", "tag": "kept"},
        {"do": "load", "dir": step_dir(os.path.join(tmp, "node{rank}"), 2)},
        {"do": "dump", "tag": "local"},
        {"do": "load", "dir": step_dir(os.path.join(tmp, "ckpt"), 2)},
        {"do": "dump", "tag": "shared"},
        {"do": "train", "steps": 2},
        {"do": "dump", "tag": "continued"},
    ], seed=1)
    assert_ok(job)
    for r in range(WORLD):
        assert_same(job.dump(r, "kept"), first.dump(r, "s4"), f"rank {r} Retention")
        assert_same(job.dump(r, "local"), first.dump(r, "s2"), f"rank {r} node-local")
        assert_same(job.dump(r, "shared"), first.dump(r, "s2"), f"rank {r} shared")
        assert_same(job.dump(r, "continued"), first.dump(r, "s4"), f"rank {r} continued")
    # The ranks' own parameters differ: each rank restored its own shard.
    assert not torch.equal(first.dump(0, "s2")["model"]["own"], first.dump(1, "s2")["model"]["own"])


def test_job_checkpoint_layout_has_one_manifest_listing_every_shard(saved):
    """A shared directory holds every rank's shard and the job manifest; node-local ones each hold
    their rank's shard and the same job manifest; Retention kept only the newest."""
    tmp, _ = saved
    shared = step_dir(os.path.join(tmp, "ckpt"), 2)
    job = read_job_manifest(shared)
    assert job["world_size"] == WORLD and [s["name"] for s in job["shards"]] == ["rank-00000", "rank-00001"]
    assert sorted(os.listdir(shared)) == ["manifest.json", "rank-00000", "rank-00001"]
    for s in job["shards"]:
        assert read_manifest(os.path.join(shared, s["name"]))["manifest_xxh3_64"] == s["manifest_xxh3_64"]
    for r in range(WORLD):
        local = step_dir(os.path.join(tmp, f"node{r}"), 2)
        assert sorted(os.listdir(local)) == ["manifest.json", f"rank-{r:05d}"]
        assert read_job_manifest(local)["job"] != job["job"]  # another save, the same shards' names
    assert Retention(os.path.join(tmp, "keep")).checkpoints() == [step_dir(os.path.join(tmp, "keep"), 4)]
    assert verify_checkpoint(shared)["world_size"] == WORLD
    assert not [n for n in os.listdir(os.path.join(tmp, "ckpt")) if ".tmp" in n]


def test_rank_raising_during_save_commits_nothing_and_previous_loads_everywhere(tmp_path):
    """A rank whose shard fails mid-write makes every rank raise; the checkpoint it would have replaced is
    untouched and loads on all ranks, a new directory is not created, and nothing staged is left."""
    ckpt = os.path.join(tmp_path, "ckpt")
    fault = {"rank": 1, "after_units": 2, "kind": "raise"}
    job = run_job(tmp_path, "raise", [
        {"do": "train", "steps": 1},
        {"do": "save", "dir": os.path.join(ckpt, "a")},
        {"do": "dump", "tag": "s1"},
        {"do": "train", "steps": 1},
        {"do": "save", "dir": os.path.join(ckpt, "a"), "fault": fault},
        {"do": "save", "dir": os.path.join(ckpt, "b"), "fault": fault},
        {"do": "load", "dir": os.path.join(ckpt, "a")},
        {"do": "dump", "tag": "loaded"},
    ])
    assert job.returncodes == [0, 0], job.explain()
    for r, log in enumerate(job.logs):
        assert [e["ok"] for e in log] == [True, True, True, True, False, False, True, True], job.explain()
        for failed in (log[4], log[5]):
            if r == 1:
                assert failed["type"] == "OSError" and "injected fault" in failed["error"]
            else:
                assert failed["type"] == "CheckpointError" and "failed on rank 1" in failed["error"]
                assert "nothing was committed on any rank" in failed["error"]
        assert_same(job.dump(r, "loaded"), job.dump(r, "s1"), f"rank {r}")
    assert sorted(os.listdir(ckpt)) == ["a"]
    assert read_job_manifest(os.path.join(ckpt, "a"))["step"] == 1
    verify_checkpoint(os.path.join(ckpt, "a"))


def test_rank_killed_mid_save_leaves_previous_checkpoint_loadable_on_all_ranks(tmp_path):
    """A rank SIGKILLed while its shard's state is half written: the other rank's save raises instead of
    hanging, the previous checkpoint still verifies and loads on every rank of a new job, and that job's
    next save clears what the killed one left staged."""
    ckpt = os.path.join(tmp_path, "ckpt", "a")
    job = run_job(tmp_path, "killed", [
        {"do": "train", "steps": 1},
        {"do": "save", "dir": ckpt},
        {"do": "dump", "tag": "s1"},
        {"do": "train", "steps": 1},
        {"do": "save", "dir": ckpt, "fault": {"rank": 1, "after_units": 2, "kind": "kill"}},
    ])
    assert job.returncodes[1] == -signal.SIGKILL, job.explain()
    survivor = job.logs[0]
    assert [e["ok"] for e in survivor] == [True, True, True, True, False], job.explain()
    assert survivor[4]["type"] == "CheckpointError" and "not every rank of the job answered" in survivor[4]["error"]
    assert read_job_manifest(ckpt)["step"] == 1
    verify_checkpoint(ckpt)
    assert [n for n in os.listdir(os.path.dirname(ckpt)) if ".tmp-job-" in n]  # the killed rank's half shard

    again = run_job(tmp_path, "after", [
        {"do": "load", "dir": ckpt},
        {"do": "dump", "tag": "loaded"},
        {"do": "save", "dir": ckpt},
    ], seed=1)
    assert_ok(again)
    for r in range(WORLD):
        assert_same(again.dump(r, "loaded"), job.dump(r, "s1"), f"rank {r}")
    assert os.listdir(os.path.dirname(ckpt)) == ["a"]


def _worker_module():
    spec = importlib.util.spec_from_file_location("dist_ckpt_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_job_checkpoint_into_another_world_size_is_refused_with_how_to_convert(saved, tmp_path):
    """A process that is not a rank of a 2-rank job cannot load the job's checkpoint: the error says the
    sizes and how to convert (one shard on every rank for DDP's replicated state, DCP for sharded), and
    the DDP way it names works."""
    tmp, first = saved
    ckpt = step_dir(os.path.join(tmp, "ckpt"), 2)
    holder = _worker_module().Holder(0, 1)
    opt = OffloadedAdamW([{"params": list(holder.net.parameters())}, {"params": [holder.own], "lr": 2e-2}],
                         lr=1e-2, nvme_path=str(tmp_path / "nvme"), buffer_size=16 * 1024, buffer_count=3,
                         small_param_threshold=64)
    try:
        with pytest.raises(CheckpointError) as info:
            load_checkpoint(opt, ckpt, model=holder)
        message = str(info.value)
        assert "a job of 2 ranks" in message and "this process runs alone" in message
        assert "get_optimizer_state_dict" in message and "rank-00000" in message
        load_checkpoint(opt, os.path.join(ckpt, "rank-00000"), model=holder)
        saved_state = first.dump(0, "s2")
        assert_same({"model": holder.state_dict(), "opt": opt.state_dict()},
                    {"model": saved_state["model"], "opt": saved_state["opt"]})
    finally:
        opt.close()


def test_verify_names_the_shard_missing_here(saved, capsys):
    """offload-ckpt verify fails a node-local job directory that lacks a rank's shard, naming it, and
    passes it with --local; inspect and list show the job and what is here."""
    tmp, _ = saved
    local = step_dir(os.path.join(tmp, "node0"), 2)
    assert ckpt_main(["verify", local]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and "rank-00001" in out and "rank-00000" not in out.split("FAILED")[1]
    with pytest.raises(CheckpointError, match="rank-00001"):
        verify_checkpoint(local)
    assert ckpt_main(["verify", "--local", local]) == 0
    assert "OK" in capsys.readouterr().out
    assert "missing here: rank-00001" in inspect_checkpoint(local)
    assert ckpt_main(["list", os.path.join(tmp, "node0")]) == 0
    out = capsys.readouterr().out
    assert "step-0000000002" in out and "job of 2 ranks" in out and "1 of 2 shards here" in out
