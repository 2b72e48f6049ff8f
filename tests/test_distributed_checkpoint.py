"""Checkpoints of a torch.distributed job (gloo, 2 ranks on CPU, each rank a process of
tests/dist_ckpt_worker.py): every rank's shard plus one job manifest, committed for the whole job; and
FSDP2 jobs' checkpoints resumed on another number of ranks (4 and 2), equal to torch's DCP round trip."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import math
import os
import random
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
from offload.distributed import Box
from offload.tools.ckpt_cli import main as ckpt_main

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_ckpt_worker.py")
WORLD = 2


@dataclasses.dataclass
class Job:
    root: str
    returncodes: list
    logs: list  # per rank: what each action did
    output: str
    world: int = WORLD

    def dump(self, rank: int, tag: str) -> dict:
        return torch.load(os.path.join(self.root, "out", f"rank{rank}-{tag}.pt"), weights_only=True)

    def explain(self) -> str:
        return "\n".join(f"--- rank {r} (exit {c}): {json.dumps(log)}" for r, (c, log) in
                          enumerate(zip(self.returncodes, self.logs))) + "\n--- output:\n" + self.output[-5000:]


def run_jobs(tmp: str, jobs: dict, *, timeout: float = 240, **spec) -> dict:
    """Run jobs of gloo ranks one after the other (``{name: (actions, seed)}``, or ``(actions, seed, world)``
    for a job of other than WORLD ranks; ``spec``: more of every job's spec, see dist_ckpt_worker.py); what
    each rank of each did, by name. One process imports torch once and forks every job's ranks."""
    specs = []
    for name, (actions, seed, *world) in jobs.items():
        root = os.path.join(tmp, name)
        os.makedirs(root)
        specs.append({"init": f"file://{root}/store", "root": root, "actions": actions, "seed": seed,
                      "timeout": 30, "world": world[0] if world else WORLD, **spec})
    done = subprocess.run([sys.executable, WORKER, json.dumps({"world": WORLD, "timeout": 90, "jobs": specs})],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=python_env(),
                          timeout=timeout)
    def read(root, name, default):
        path = os.path.join(root, "out", name)
        return json.load(open(path)) if os.path.exists(path) else default

    return {name: Job(spec["root"], read(spec["root"], "returncodes.json", None),
                      [read(spec["root"], f"rank{r}.json", []) for r in range(spec["world"])], done.stdout,
                      spec["world"])
            for name, spec in zip(jobs, specs)}


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


def assert_ok(job: Job, actions: int | None = None) -> None:
    """Every rank of ``job`` exited well, and its first ``actions`` actions (default all) succeeded."""
    assert job.returncodes == [0] * job.world, job.explain()
    assert all(len(log) >= (actions or 1) and all(e["ok"] for e in log[:actions]) for log in job.logs), job.explain()


def step_dir(base: str, step: int) -> str:
    return os.path.join(base, f"step-{step:010d}")


RAISE = {"rank": 1, "after_units": 2, "kind": "raise"}
INTERRUPT = {"rank": 1, "after_units": 2, "kind": "interrupt"}
KILL = {"rank": 1, "after_units": 2, "kind": "kill"}
LATE = {"rank": 1, "kind": "late"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three jobs, one after the other. "first" trains 2 steps, saves them to a shared directory, to
    node-local ones (one per rank) and through Retention, trains 2 more (the uninterrupted run), then saves
    to a new directory, fails two saves with rank 1 raising mid-shard, and one with rank 1's node-local
    directory failing to commit after rank 0's has. "killed" saves, trains, and has
    rank 1 SIGKILLed mid-shard in the next save of the same directory. "resume", from other initial
    weights, loads all of these, trains on, saves where the killed save was cut off, tries a load that
    rank 1 cannot do, and has rank 0 save alone a checkpoint that both ranks load."""
    tmp = str(tmp_path_factory.mktemp("dist-ckpt"))
    shared, local, keep = (os.path.join(tmp, n) for n in ("ckpt", "node{rank}", "keep"))
    raised, killed = os.path.join(tmp, "ckpt-raised"), os.path.join(tmp, "ckpt-killed", "a")
    late, alone = os.path.join(tmp, "ckpt-late", "a"), os.path.join(tmp, "ckpt-alone")
    back = os.path.join(tmp, "ckpt-back{rank}", "a")
    same = os.path.join(tmp, "ckpt-same", "a")
    blind = os.path.join(tmp, "ckpt-blind")
    jobs = run_jobs(tmp, {
        "first": ([
            {"do": "train", "steps": 2},
            {"do": "save", "dir": step_dir(shared, 2)},
            {"do": "save", "dir": step_dir(local, 2)},
            {"do": "keep_save", "root": keep, "keep_last": 1},
            {"do": "dump", "tag": "s2"},
            {"do": "train", "steps": 2},
            {"do": "keep_save", "root": keep, "keep_last": 1},
            {"do": "dump", "tag": "s4"},
            {"do": "save", "dir": os.path.join(raised, "a")},
            {"do": "train", "steps": 1},
            {"do": "save", "dir": os.path.join(raised, "a"), "fault": RAISE},
            {"do": "save", "dir": os.path.join(raised, "b"), "fault": INTERRUPT},
            {"do": "listdir", "dir": raised},
            {"do": "load", "dir": os.path.join(raised, "a")},
            {"do": "dump", "tag": "raised"},
            {"do": "save", "dir": late, "fault": LATE},
            {"do": "save", "dir": late, "fault": LATE},
            {"do": "save", "dir": late, "blocking": False},
            {"do": "save", "dir": back},
            {"do": "dump", "tag": "back"},
            {"do": "train", "steps": 1},
            {"do": "save", "dir": back, "fault": {"rank": 1, "kind": "commit"}},
            {"do": "load", "dir": back},
            {"do": "dump", "tag": "back-loaded"},
            {"do": "save", "dir": os.path.join(blind, "a")},
            {"do": "dump", "tag": "blind-before"},
            {"do": "train", "steps": 1},
            {"do": "save", "dir": os.path.join(blind, "a"), "fault": {"rank": 0, "kind": "blind"}},
            {"do": "barrier"},  # each rank removes its own shard: list once both have
            {"do": "listdir", "dir": blind},
            {"do": "load", "dir": os.path.join(blind, "a")},
            {"do": "dump", "tag": "blind-loaded"},
            {"do": "train", "steps": 1},
            {"do": "save", "dir": os.path.join(blind, "a"), "fault": {"rank": 0, "kind": "after_rename"}},
            {"do": "barrier"},
            {"do": "listdir", "dir": os.path.join(blind, "a")},
            {"do": "load", "dir": os.path.join(blind, "a")},
            {"do": "dump", "tag": "exchanged-loaded"},
            {"do": "mkdir", "dir": os.path.join(blind, "empty")},
            {"do": "save", "dir": os.path.join(blind, "empty"), "fault": {"rank": 0, "kind": "after_rename"}},
            {"do": "barrier"},
            {"do": "listdir", "dir": blind},
            {"do": "listdir", "dir": os.path.join(blind, "empty")},
        ], 0),
        "identical": ([
            {"do": "train", "steps": 1},
            {"do": "save", "dir": same, "fixed_clock": True},
            {"do": "save", "dir": same, "fixed_clock": True, "fault": LATE, "extra": {"0": {"mark": 1}}},
        ], 0),
        "killed": ([
            {"do": "train", "steps": 1},
            {"do": "save", "dir": killed},
            {"do": "dump", "tag": "s1"},
            {"do": "train", "steps": 1},
            {"do": "save", "dir": killed, "fault": KILL},
        ], 0),
        "resume": ([
            {"do": "keep_load", "root": keep},
            {"do": "dump", "tag": "kept"},
            {"do": "load", "dir": step_dir(local, 2)},
            {"do": "dump", "tag": "local"},
            {"do": "load", "dir": step_dir(shared, 2)},
            {"do": "dump", "tag": "shared"},
            {"do": "train", "steps": 2},
            {"do": "dump", "tag": "continued"},
            {"do": "listdir", "dir": os.path.dirname(killed)},
            {"do": "load", "dir": killed},
            {"do": "dump", "tag": "after-kill"},
            {"do": "save", "dir": killed},
            {"do": "listdir", "dir": os.path.dirname(killed)},
            {"do": "load", "dir": step_dir(os.path.join(tmp, "node0"), 2)},
            {"do": "dump", "tag": "after-refused"},
            {"do": "save", "dir": alone, "alone": True, "ranks": [0]},
            {"do": "barrier"},
            {"do": "load", "dir": alone},
            {"do": "dump", "tag": "from-rank-0"},
        ], 1),
    })
    return tmp, jobs


def test_job_save_then_load_restores_bit_for_bit_and_training_goes_on_as_uninterrupted(runs):
    """A job's checkpoint (shared directory, node-local directories, Retention) loads on every rank into
    fresh optimizers and models bit for bit, and training from it equals the run that went on."""
    _, jobs = runs
    first, job = jobs["first"], jobs["resume"]
    assert_ok(first, 8)
    assert_ok(job, 13)
    for r in range(WORLD):
        assert_same(job.dump(r, "kept"), first.dump(r, "s4"), f"rank {r} Retention")
        assert_same(job.dump(r, "local"), first.dump(r, "s2"), f"rank {r} node-local")
        assert_same(job.dump(r, "shared"), first.dump(r, "s2"), f"rank {r} shared")
        assert_same(job.dump(r, "continued"), first.dump(r, "s4"), f"rank {r} continued")
    # The ranks' own parameters differ: each rank restored its own shard.
    assert not torch.equal(first.dump(0, "s2")["model"]["own"], first.dump(1, "s2")["model"]["own"])


def test_job_checkpoint_layout_has_one_manifest_listing_every_shard(runs):
    """A shared directory holds every rank's shard and the job manifest; node-local ones each hold
    their rank's shard and the same job manifest; Retention kept only the newest."""
    tmp, jobs = runs
    assert_ok(jobs["first"], 8)
    shared = step_dir(os.path.join(tmp, "ckpt"), 2)
    job = read_job_manifest(shared)
    assert job["world_size"] == WORLD and [s["name"] for s in job["shards"]] == ["rank-00000", "rank-00001"]
    assert sorted(os.listdir(shared)) == ["manifest.json", "rank-00000", "rank-00001"]
    for s in job["shards"]:
        assert read_manifest(os.path.join(shared, s["name"]))["manifest_xxh3_64"] == s["manifest_xxh3_64"]
    local = [read_job_manifest(step_dir(os.path.join(tmp, f"node{r}"), 2)) for r in range(WORLD)]
    for r in range(WORLD):
        assert sorted(os.listdir(step_dir(os.path.join(tmp, f"node{r}"), 2))) == ["manifest.json", f"rank-{r:05d}"]
    assert local[0] == local[1] and local[0]["job"] != job["job"]  # one manifest for the job, in each directory
    assert Retention(os.path.join(tmp, "keep")).checkpoints() == [step_dir(os.path.join(tmp, "keep"), 4)]
    assert verify_checkpoint(shared)["world_size"] == WORLD
    assert not [n for n in os.listdir(os.path.join(tmp, "ckpt")) if ".tmp" in n]


def test_rank_raising_during_save_commits_nothing_and_previous_loads_everywhere(runs):
    """A rank whose shard fails mid-write (an error, or a Ctrl-C) makes every rank raise, none left waiting;
    the checkpoint it would have replaced is untouched and loads on all ranks, a new directory is not created,
    and nothing staged is left."""
    tmp, jobs = runs
    job = jobs["first"]
    assert job.returncodes == [0, 0], job.explain()
    for r, log in enumerate(job.logs):
        assert [e["ok"] for e in log[8:15]] == [True, True, False, False, True, True, True], job.explain()
        for failed, kind in ((log[10], "OSError"), (log[11], "KeyboardInterrupt")):
            if r == 1:
                assert failed["type"] == kind and (kind != "OSError" or "injected fault" in failed["error"])
            else:
                assert failed["type"] == "CheckpointError" and "failed on rank 1" in failed["error"]
                assert "nothing was committed on any rank" in failed["error"]
        assert "b" not in log[12]["result"]  # (the staging directory goes with the last rank's shard)
        assert_same(job.dump(r, "raised"), job.dump(r, "s4"), f"rank {r}")
    assert os.listdir(os.path.join(tmp, "ckpt-raised")) == ["a"]
    raised = os.path.join(tmp, "ckpt-raised", "a")
    assert read_job_manifest(raised)["step"] == 4
    verify_checkpoint(raised)


def test_rank_killed_mid_save_leaves_previous_checkpoint_loadable_on_all_ranks(runs):
    """A rank SIGKILLed while its shard's state is half written: the other rank's save raises instead of
    hanging, the previous checkpoint still verifies and loads on every rank of a new job, and that job's
    next save deletes what the killed one left in the shard directories."""
    tmp, jobs = runs
    job, after = jobs["killed"], jobs["resume"]
    assert job.returncodes == [0, -signal.SIGKILL], job.explain()
    survivor = job.logs[0]
    assert [e["ok"] for e in survivor] == [True, True, True, True, False], job.explain()
    assert survivor[4]["type"] == "CheckpointError" and "not every rank of the job answered" in survivor[4]["error"]
    assert len(job.logs[1]) == 4  # killed in its fifth action
    assert_ok(after, 13)
    for r in range(WORLD):
        assert after.logs[r][8]["result"] == ["a"]  # nothing beside the checkpoint
        assert_same(after.dump(r, "after-kill"), job.dump(r, "s1"), f"rank {r}")
    assert after.logs[0][12]["result"] == ["a"]
    killed = os.path.join(tmp, "ckpt-killed", "a")
    manifest = read_job_manifest(killed)
    assert sorted(os.listdir(killed)) == ["manifest.json", "rank-00000", "rank-00001"]
    for s in manifest["shards"]:
        named = {e["file"] for e in s["files"].values()} | {s["manifest"]}
        assert sorted(os.listdir(os.path.join(killed, s["name"]))) == sorted(named), s["name"]


def test_rank_that_looks_for_its_directory_late_still_commits_once(runs):
    """A rank held back after the shards are written finds its shard already committed by the rank that
    shares its directory, instead of committing again (and waiting on that rank's lock): both saves, the
    second replacing the first, succeed on every rank and the checkpoint verifies."""
    tmp, jobs = runs
    job = jobs["first"]
    for log in job.logs:
        assert [e["ok"] for e in log[15:17]] == [True, True], job.explain()
    verify_checkpoint(os.path.join(tmp, "ckpt-late", "a"))
    assert os.listdir(os.path.join(tmp, "ckpt-late")) == ["a"]


def test_directory_that_cannot_commit_fails_the_save_everywhere_and_a_load_refuses_the_mix(runs):
    """Node-local directories: rank 1's commit fails after rank 0's directory has committed. Every rank's
    save raises (rank 0's saying which rank could not commit), and a load of the directory, which now
    holds different saves on the two nodes, is refused on every rank with nothing changed."""
    tmp, jobs = runs
    job = jobs["first"]
    for r, log in enumerate(job.logs):
        assert [e["ok"] for e in log[18:23]] == [True, True, True, False, False], job.explain()
        if r == 1:
            assert log[21]["type"] == "OSError" and "injected fault in the commit" in log[21]["error"]
        else:
            assert "could not be committed on rank 1" in log[21]["error"]
        assert "different saves" in log[22]["error"] or "cannot load" in log[22]["error"], job.explain()
        assert os.listdir(os.path.join(tmp, f"ckpt-back{r}")) == ["a"]
    assert read_job_manifest(os.path.join(tmp, "ckpt-back0", "a"))["job"] != \
        read_job_manifest(os.path.join(tmp, "ckpt-back1", "a"))["job"]


def test_asynchronous_save_of_a_job_is_refused_on_every_rank(runs):
    """save_checkpoint(blocking=False) in a job raises on every rank, saying to save with blocking=True."""
    _, jobs = runs
    for log in jobs["first"].logs:
        assert log[17]["ok"] is False and log[17]["type"] == "CheckpointError"
        assert "blocking=True" in log[17]["error"]


def test_load_that_one_rank_cannot_do_changes_no_rank(runs):
    """A node-local checkpoint loaded on both ranks from rank 0's directory: rank 1 has no shard there, so
    every rank raises before any changes state (rank 0 says which rank could not), and both hold what
    they held."""
    _, jobs = runs
    job = jobs["resume"]
    assert job.returncodes == [0, 0], job.explain()
    failed = [log[13] for log in job.logs]
    assert not failed[0]["ok"] and not failed[1]["ok"], job.explain()
    assert failed[1]["type"] == "CheckpointError" and "no shard of rank 1 here" in failed[1]["error"]
    assert "rank 1 cannot load" in failed[0]["error"] and "nothing was loaded on any rank" in failed[0]["error"]
    for r in range(WORLD):
        assert_same(job.dump(r, "after-refused"), job.dump(r, "after-kill"), f"rank {r}")


def test_rank_saving_alone_in_a_job_writes_a_process_checkpoint_that_every_rank_loads(runs):
    """save_checkpoint(alone=True) on rank 0 only (DDP's way) does not wait for the other ranks; it writes
    an ordinary checkpoint, which a load on every rank of the job loads whole on each."""
    tmp, jobs = runs
    job = jobs["resume"]
    assert [len(log) for log in job.logs] == [19, 18], job.explain()
    assert all(e["ok"] for log in job.logs for e in log[15:]), job.explain()
    assert "world_size" not in read_manifest(os.path.join(tmp, "ckpt-alone"))
    saved = job.dump(0, "after-refused")
    for r in range(WORLD):
        assert_same(job.dump(r, "from-rank-0")["opt"], saved["opt"], f"rank {r}")
        assert_same(job.dump(r, "from-rank-0")["model"], saved["model"], f"rank {r}")


def _worker_module():
    spec = importlib.util.spec_from_file_location("dist_ckpt_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_job_checkpoint_of_ddp_loads_whole_into_a_process_alone(runs, tmp_path):
    """A process that is not a rank of the 2-rank DDP job loads the job's checkpoint: its tensors, none a
    DTensor, are taken to be replicated and come whole from the lowest-ranked shard, bit for bit what
    rank 0 held, with rank 0's extra; a tool that reads it as one process's checkpoint is told to read a
    rank's shard, and loading that shard itself gives the same."""
    tmp, jobs = runs
    first = jobs["first"]
    ckpt = step_dir(os.path.join(tmp, "ckpt"), 2)
    holder = _worker_module().Holder(0, 1)
    opt = OffloadedAdamW([{"params": list(holder.net.parameters())}, {"params": [holder.own], "lr": 2e-2}],
                         lr=1e-2, nvme_path=str(tmp_path / "nvme"), buffer_size=16 * 1024, buffer_count=3,
                         small_param_threshold=64)
    saved = first.dump(0, "s2")
    try:
        assert load_checkpoint(opt, ckpt, model=holder) == {"step": 2}
        assert_same({"model": holder.state_dict(), "opt": opt.state_dict()}, {"model": saved["model"],
                                                                              "opt": saved["opt"]})
        with pytest.raises(CheckpointError, match="rank-00000"):
            read_manifest(ckpt)
        load_checkpoint(opt, os.path.join(ckpt, "rank-00000"), model=holder)
        assert_same({"model": holder.state_dict(), "opt": opt.state_dict()}, {"model": saved["model"],
                                                                              "opt": saved["opt"]})
    finally:
        opt.close()


def test_verify_names_the_shard_missing_here(runs, capsys):
    """offload-ckpt verify fails a node-local job directory that lacks a rank's shard, naming it, and
    passes it with --local; inspect and list show the job and what is here."""
    tmp, _ = runs
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


def test_late_rank_whose_shard_is_unchanged_does_not_put_the_old_checkpoint_back(runs):
    """Two saves of a directory where only rank 0's shard changes and rank 1's is byte for byte the one it
    replaces: rank 1, late, finds its shard committed by rank 0, so the new checkpoint stays and verifies."""
    tmp, jobs = runs
    job = jobs["identical"]
    assert_ok(job)
    same = os.path.join(tmp, "ckpt-same", "a")
    shard = os.path.join(same, "rank-00000")
    extra = torch.load(os.path.join(shard, read_manifest(shard)["files"]["extra.pt"]["file"]), weights_only=True)
    assert extra.get("mark") == 1, job.explain()
    verify_checkpoint(same)
    assert os.listdir(os.path.join(tmp, "ckpt-same")) == ["a"]


def test_save_that_no_rank_commits_fails_everywhere_and_keeps_the_previous_checkpoint(runs):
    """Rank 0, the one to commit the shared directory, cannot see the shards there (not even its own), so
    nobody commits: every rank's save fails saying so (it never reports success with the old checkpoint in
    place), nothing of it is left, and the checkpoint that was there loads on every rank."""
    tmp, jobs = runs
    job = jobs["first"]
    for r, log in enumerate(job.logs):
        assert [e["ok"] for e in log[24:32]] == [True, True, True, False, True, True, True, True], job.explain()
        assert "could not be committed on rank" in log[27]["error"] or r == 0, job.explain()
        assert log[29]["result"] == ["a"], job.explain()
        assert_same(job.dump(r, "blind-loaded"), job.dump(r, "blind-before"), f"rank {r}")


def test_commit_that_fails_after_its_rename_fails_everywhere_and_the_new_checkpoint_loads(runs):
    """Rank 0 commits the shared directory (one rename of the job manifest) and then fails: every rank's
    save raises, and the checkpoint that the rename committed loads on both ranks with every shard."""
    tmp, jobs = runs
    job = jobs["first"]
    for r, log in enumerate(job.logs):
        assert [e["ok"] for e in log[32:38]] == [True, False, True, True, True, True], job.explain()
        assert "injected fault after the commit" in log[33]["error"] or "on rank 0" in log[33]["error"], job.explain()
        assert log[35]["result"] == ["manifest.json", "rank-00000", "rank-00001"], job.explain()
        with pytest.raises(AssertionError):  # a step later than the checkpoint before
            assert_same(job.dump(r, "exchanged-loaded"), job.dump(r, "blind-before"))


def test_commit_into_an_empty_directory_that_fails_after_its_rename_leaves_the_checkpoint_there(runs):
    """The target is an empty directory of the user's: rank 0's commit renames the job manifest into it
    and fails; both ranks report the failure, and the directory holds the committed checkpoint, nothing
    else beside it."""
    _, jobs = runs
    job = jobs["first"]
    for log in job.logs:
        assert [e["ok"] for e in log[38:43]] == [True, False, True, True, True], job.explain()
        assert "injected fault after the commit" in log[39]["error"] or "on rank 0" in log[39]["error"], job.explain()
        assert log[41]["result"] == ["a", "empty"], job.explain()
        assert log[42]["result"] == ["manifest.json", "rank-00000", "rank-00001"], job.explain()


# -- resuming on another number of ranks -------------------------------------------------------------


@pytest.fixture(scope="module")
def resharded(tmp_path_factory):
    """FSDP2 jobs (dist_ckpt_worker.py's model, 8-bit state) saved on 4 ranks and on 2, each through
    save_checkpoint and through DCP, each loaded on the other number of ranks both ways, dumped, and
    trained one step more. "four" trains 2 steps and saves (also a copy whose rank-00003 shard is then
    deleted); "two" loads those into fresh optimizers, trains a run of its own and saves it, then tries
    the copy; "four-again" loads that run."""
    tmp = str(tmp_path_factory.mktemp("reshard"))

    def resumed(ours: str, theirs: str) -> list:
        return [{"do": "load", "dir": ours}, {"do": "dump", "tag": "ours"}, {"do": "train", "steps": 1},
                {"do": "dump", "tag": "ours-next"}, {"do": "fresh"}, {"do": "dcp_load", "dir": theirs, "step": 2},
                {"do": "dump", "tag": "dcp"}, {"do": "train", "steps": 1}, {"do": "dump", "tag": "dcp-next"}]

    c = functools.partial(os.path.join, tmp)
    jobs = run_jobs(tmp, {
        "four": ([{"do": "train", "steps": 2}, {"do": "save", "dir": c("ours4")}, {"do": "dcp_save", "dir": c("dcp4")},
                  {"do": "save", "dir": c("lost")}, {"do": "barrier"},
                  {"do": "rmtree", "dir": c("lost", "rank-00003"), "ranks": [0]}], 0, 4),
        "two": ([*resumed(c("ours4"), c("dcp4")),
                 {"do": "fresh"}, {"do": "train", "steps": 2}, {"do": "save", "dir": c("ours2")},
                 {"do": "dcp_save", "dir": c("dcp2")},
                 {"do": "load", "dir": c("ours4")}, {"do": "dump", "tag": "before-lost"},
                 {"do": "load", "dir": c("lost")}, {"do": "dump", "tag": "after-lost"}], 1, 2),
        "four-again": (resumed(c("ours2"), c("dcp2")), 1, 4),
    }, model="fsdp2", state_dtype="int8")
    return tmp, jobs


def test_fsdp2_checkpoint_of_4_ranks_resumes_on_2_as_through_dcp(resharded):
    """A 4-rank FSDP2 job's checkpoint loaded on 2 ranks gives every rank the weights and optimizer state
    (moments, 8-bit codes, fp32 masters, steps) that the same state saved and loaded through DCP gives,
    bit for bit, and one more step stays equal."""
    _, jobs = resharded
    job = jobs["two"]
    assert_ok(job, 15)
    for r in range(2):
        assert_same(job.dump(r, "ours"), job.dump(r, "dcp"), f"rank {r}")
        assert_same(job.dump(r, "ours-next"), job.dump(r, "dcp-next"), f"rank {r}, a step later")


def test_fsdp2_checkpoint_of_2_ranks_resumes_on_4_as_through_dcp(resharded):
    """The same from 2 ranks to 4: each new rank reads its rows from the shard(s) holding them."""
    _, jobs = resharded
    job = jobs["four-again"]
    assert_ok(job)
    for r in range(4):
        assert_same(job.dump(r, "ours"), job.dump(r, "dcp"), f"rank {r}")
        assert_same(job.dump(r, "ours-next"), job.dump(r, "dcp-next"), f"rank {r}, a step later")


def test_resharded_checkpoints_hold_every_case_of_the_model(resharded):
    """What the model is built to exercise holds in the checkpoints: on 2 ranks, the first layer's 8-bit
    state (whole blocks), the second layer's fp32 on rank 0 and 8-bit on rank 1 (whose rows start inside a
    block of the 4-rank layout), its bias offloaded; on 4 ranks, fp32 moments throughout and that bias in
    memory; bf16 weights with fp32 masters on both; and a last layer none of whose rows is on the fourth of
    4 ranks."""
    tmp, _ = resharded
    two = [read_manifest(os.path.join(tmp, "ours2", f"rank-{r:05d}"))["params"] for r in range(2)]
    four = [read_manifest(os.path.join(tmp, "ours4", f"rank-{r:05d}"))["params"] for r in range(4)]
    moments = lambda p: (p.get("key_dtypes") or [p["state_dtype"]])[0]  # noqa: E731
    assert [moments(ps[0]) for ps in two] == ["uint8", "uint8"]
    assert [moments(ps[2]) for ps in two] == ["float32", "uint8"]
    assert [ps[2]["local"] for ps in two] == [{"shape": [17, 320], "offsets": [0, 0]},
                                              {"shape": [16, 320], "offsets": [17, 0]}]
    assert {moments(p) for ps in four for p in ps if p["where"] == "swap"} == {"float32"}
    assert [ps[3]["where"] for ps in two] == ["swap", "swap"] and {ps[3]["where"] for ps in four} == {"memory"}
    assert all("master" in ps[4]["keys"] for ps in two + four)
    assert [ps[6]["local"]["shape"] for ps in four] == [[1, 64], [1, 64], [1, 64], [0, 64]]


def test_shards_that_do_not_cover_a_parameter_are_refused_naming_the_range(resharded):
    """A 4-rank checkpoint whose rank-00003 shard is gone, loaded on 2 ranks: rank 1, which holds rows 160
    to 320 of the first layer, finds the last 80 of them in no shard and says which elements, in the full
    tensor's flat order, and which shard is missing; every rank raises, and none changed its state (nothing
    loaded as zeros)."""
    _, jobs = resharded
    job = jobs["two"]
    assert job.returncodes == [0, 0], job.explain()
    for r, log in enumerate(job.logs):
        failed = log[15]
        assert failed["do"] == "load" and not failed["ok"] and failed["type"] == "CheckpointError", job.explain()
        assert "elements [7680, 10240) of parameter 0 (shape [320, 32])" in failed["error"], job.explain()
        assert "the shard(s) rank-00003 of the job are not here" in failed["error"], job.explain()
        if r == 0:
            assert "rank 1 cannot load" in failed["error"] and "nothing was loaded on any rank" in failed["error"]
        assert_same(job.dump(r, "after-lost"), job.dump(r, "before-lost"), f"rank {r}")


def test_fsdp2_checkpoint_loads_whole_into_one_process_as_through_dcp(resharded, tmp_path):
    """The 2-rank job's checkpoint loaded by a process alone into the model unsharded: every tensor whole,
    gathered from both shards, as DCP's checkpoint of the same state loads into it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    tmp, _ = resharded
    worker = _worker_module()
    dumps = []
    for name, load in (("ours", lambda m, o: load_checkpoint(o, os.path.join(tmp, "ours2"), model=m)),
                       ("dcp", None)):
        model = worker.Sharded(1, shard=False)
        opt = worker.sharded_optimizer(model, str(tmp_path / name), "int8")
        try:
            if load is not None:
                load(model, opt)
            else:
                state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
                dcp.load(state, checkpoint_id=os.path.join(tmp, "dcp2"), no_dist=True)
                set_model_state_dict(model, state["model"])
                set_optimizer_state_dict(model, opt, state["optim"])
            dumps.append({"model": model.state_dict(), "opt": opt.state_dict()})
        finally:
            opt.close()
    assert_same(dumps[0], dumps[1])


def test_box_runs_copy_the_elements_two_parts_share_as_indexing_does():
    """Random parts of random tensors of up to 3 dimensions (split along any dimension, as tensor parallelism
    splits them, not only rows): the runs of an intersection copy, from one part's flat elements into the
    other's, exactly the elements both hold, and its flat ranges are its elements' indices in the full tensor."""
    rng = random.Random(0)

    def part(shape):
        spans = [sorted(rng.randint(0, n) for _ in range(2)) for n in shape]
        return Box(tuple(a for a, _ in spans), tuple(b - a for a, b in spans))

    def held(full, box):
        return full[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.shape))]

    for _ in range(500):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(0, 3)))
        full = torch.arange(math.prod(shape)).reshape(shape)
        a, b = part(shape), part(shape)
        src, dst = held(full, a).reshape(-1), torch.full((b.numel,), -1)
        both = a.intersect(b)
        for old, new, n in (both.runs(a, b) if both is not None else ()):
            dst[new:new + n] = src[old:old + n]
        shared = set(src.tolist())
        assert dst.tolist() == [x if x in shared else -1 for x in held(full, b).reshape(-1).tolist()], (shape, a, b)
        if both is not None:
            flat = [x for lo, hi in both.flat_ranges(shape) for x in range(lo, hi)]
            assert flat == held(full, both).reshape(-1).tolist(), (shape, both)


# -- checkpoints saved before the parts each rank held were recorded ---------------------------------


def _without_parts(directory: str) -> None:
    """Rewrite checkpoint ``directory`` as a version that did not record ``local`` wrote it: the field gone from
    every parameter and model tensor of its manifest (of each shard's, for a job's), every checksum made valid."""
    from offload.checkpoint.manifest import digest

    def strip(path: str) -> str:
        with open(path) as f:
            manifest = json.load(f)
        for entry in manifest["params"] + manifest.get("model", {}).get("tensors", []):
            entry.pop("local", None)
        manifest["manifest_xxh3_64"] = digest(manifest)
        with open(path, "w") as f:
            json.dump(manifest, f)
        return manifest["manifest_xxh3_64"]

    path = os.path.join(directory, "manifest.json")
    with open(path) as f:
        top = json.load(f)
    if "shards" not in top:
        strip(path)
        return
    for shard in top["shards"]:
        name = shard.get("manifest", "manifest.json")
        shard["manifest_xxh3_64"] = strip(os.path.join(directory, shard["name"], name))
    top["manifest_xxh3_64"] = digest(top)
    with open(path, "w") as f:
        json.dump(top, f)


def test_checkpoints_without_recorded_parts_load_under_fsdp2_as_through_dcp_or_are_refused(resharded, tmp_path):
    """Checkpoints of a version that did not record each rank's part: a process's (whole tensors) loaded by a
    2-rank FSDP2 job gives every rank its own rows of the optimizer's state (with and without the model's
    weights), as DCP's checkpoint of the same state does; the 2-rank job's own loads on 2 ranks as before;
    loaded where the parts differ (a process alone), it is refused with what to do, never read as whole."""
    from offload.checkpoint import save_checkpoint

    tmp, _ = resharded
    worker = _worker_module()
    model = worker.Sharded(1, shard=False)
    opt = worker.sharded_optimizer(model, str(tmp_path / "nvme"), "int8")
    process, job_copy = str(tmp_path / "process"), str(tmp_path / "job")
    try:
        load_checkpoint(opt, os.path.join(tmp, "ours2"), model=model)
        save_checkpoint(opt, process, model=model, extra={"step": 2})
    finally:
        opt.close()
    import shutil

    shutil.copytree(os.path.join(tmp, "ours2"), job_copy)
    _without_parts(process)
    _without_parts(job_copy)
    assert not any("local" in p for p in read_manifest(process)["params"])

    model = worker.Sharded(1, shard=False)
    opt = worker.sharded_optimizer(model, str(tmp_path / "nvme-alone"), "int8")
    try:
        with pytest.raises(CheckpointError, match="does not record which part of .* save it again with this version"):
            load_checkpoint(opt, job_copy, model=model)
    finally:
        opt.close()

    job = run_jobs(str(tmp_path), {"old": (
        [{"do": "load", "dir": process, "weights": False}, {"do": "dump", "tag": "state"}, {"do": "fresh"},
         {"do": "load", "dir": process}, {"do": "dump", "tag": "process"}, {"do": "fresh"},
         {"do": "load", "dir": job_copy}, {"do": "dump", "tag": "job"}, {"do": "fresh"},
         {"do": "dcp_load", "dir": os.path.join(tmp, "dcp2"), "step": 2}, {"do": "dump", "tag": "dcp"}], 1)},
        model="fsdp2", state_dtype="int8")["old"]
    assert_ok(job, 2)
    for r in range(WORLD):
        assert_same(job.dump(r, "state")["opt"], job.dump(r, "dcp")["opt"], f"rank {r}, the process's state alone")
    assert_ok(job)
    for r in range(WORLD):
        assert_same(job.dump(r, "process"), job.dump(r, "dcp"), f"rank {r}, the process's checkpoint")
        assert_same(job.dump(r, "job"), job.dump(r, "dcp"), f"rank {r}, the job's")
