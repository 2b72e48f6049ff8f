"""Jobs of gloo ranks for tests/test_distributed_checkpoint.py: each rank trains, saves, loads and dumps as told.

Usage: dist_ckpt_worker.py JOBS_JSON, JOBS: {"world": n, "timeout": seconds, "jobs": [SPEC, ...]}. The jobs
run one after the other; each job's ranks are processes forked from this one (torch is imported once), and
their exit codes go to ROOT/out/returncodes.json (minus the signal for a rank killed by one, as subprocess
says). SPEC: {"init": a file:// store, "root": a directory, "seed": n, "actions": [...]}, and optionally "world"
(this job's number of ranks) and "model": "fsdp2" (the FSDP2 model below instead of the DDP one) with
"state_dtype"; each action is one of
  {"do": "train", "steps": n}                    n steps (data drawn from the step and the rank)
  {"do": "save", "dir": d, "fault": {...}}       save_checkpoint(opt, d, model=..., extra={"step": ...}); "blocking"
                                                 and "alone" as for save_checkpoint; "extra": {rank: {...}} adds
                                                 to that rank's extra; "fixed_clock": shards all say one second
  {"do": "load", "dir": d}                       load_checkpoint(opt, d, model=...), the step from its extra;
                                                 "weights": false loads the optimizer's state only
  {"do": "keep_save", "root": d, "keep_last": n} Retention(d, keep_last=n).save(opt, step, model=..., ...)
  {"do": "keep_load", "root": d}                 Retention(d).load_latest(opt, model=...)
  {"do": "dump", "tag": t}                       weights and optimizer state to ROOT/out/rank<r>-<t>.pt (a
                                                 DTensor as its local shard)
  {"do": "dcp_save", "dir": d}                   torch.distributed.checkpoint.save of the model's and the
                                                 optimizer's state dicts (get_model_state_dict, ...)
  {"do": "dcp_load", "dir": d, "step": n}        what dcp_save saved, loaded (set_optimizer_state_dict, ...)
  {"do": "fresh"}                                a new model and optimizer, as the job started with
  {"do": "rmtree", "dir": d}                     shutil.rmtree(d)
  {"do": "listdir", "dir": d}                    the names in d, sorted (the log's "result"); a checkpoint's lock
                                                 file, there while another rank reads or saves it, left out
  {"do": "mkdir", "dir": d}                      os.makedirs(d, exist_ok=True)
  {"do": "barrier"}                              torch.distributed.barrier()
  {"do": "verify", "dir": d}                     verify_checkpoint(d); the result is its step (the job manifest's)
  {"do": "cat", "file": f}                       the file's text
  {"do": "no_locks", "dir": d}                   fails if this rank holds a flock on d's file system (/proc/locks)
  {"do": "powerloss", "control": f, "cmd": c}    the status of tests/powerloss.py's control file f (JSON), then
                                                 c ("arm N", "crash") written to it, if any
  {"do": "repeat", "max": n, "actions": [...]}   the actions for k = 0, 1, ... ("{k}" in their strings is k, their
                                                 log entries say "round": k) until, in a round, every rank's
                                                 saves succeeded and no "powerloss" status said "stopped" (or
                                                 n rounds); the result is the number of rounds
"{rank}" in a directory is this rank's number (node-local directories: one per rank). An action with "ranks"
runs on those ranks only (its log has no entry on the others); a rank stops (exit code 1) after an action
with "required": true fails (so that the other ranks' collectives fail at once instead of waiting for it).
A fault {"rank": r, "after_units": k, "kind": "raise" | "kill"} makes rank r raise an OSError, or SIGKILL
itself, once k units of its shard's state.bin have been written. What each action did (ok, or the error's
type and message) goes to ROOT/out/rank<r>.json after each action, so a killed rank leaves what it had.
The model: a DDP-wrapped MLP (the same on every rank) and a parameter of the rank's own (different on each
rank), both in one optimizer whose swap space is ROOT/nvme-rank<r>. With "model": "fsdp2", three layers
sharded by FSDP2 (fully_shard), whose parts fall on 2 and 4 ranks so that a checkpoint of one resumed on the
other meets every case: rows split unevenly, 8-bit state (state_dtype "int8") where a rank's part is whole
blocks of at least 4096 elements and fp32 elsewhere, a part whose blocks start inside another's, a bias small
(state in memory) on 4 ranks and offloaded on 2, a bf16 layer with fp32 master weights, and a layer of 3 rows,
none of them on the fourth of 4 ranks.
"""

import datetime
import errno
import json
import os
import shutil
import signal
import sys
import time

import torch
import torch.distributed as dist
from helpers import locks_held
from ranks import fork_ranks
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import offload.checkpoint.job as job_module
import offload.checkpoint.manifest as manifest_module
import offload.checkpoint.snapshot as snapshot_module
from offload import OffloadedAdamW
from offload.checkpoint import Retention, Storage, load_checkpoint, save_checkpoint, verify_checkpoint
from offload.distributed import local


class _FixedDatetime(datetime.datetime):
    @classmethod
    def now(cls, tz=None):
        return datetime.datetime(2026, 1, 1, tzinfo=tz)


class FixedClock:
    """Stands in for the datetime module in offload.checkpoint.manifest: now() is always the same second."""

    timezone = datetime.timezone
    datetime = _FixedDatetime


class Holder(nn.Module):
    def __init__(self, rank: int, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 32))
        self.own = nn.Parameter(torch.randn(3000, generator=torch.Generator().manual_seed(seed * 100 + rank)))


class Sharded(nn.Module):
    """The FSDP2 model (see above): every layer sharded by rows, the third in bf16."""

    def __init__(self, seed: int, shard: bool = True):
        super().__init__()
        torch.manual_seed(seed)
        self.a, self.b = nn.Linear(32, 320), nn.Linear(320, 33)  # 320 x 32 and 33 x 320 (9, 9, 9, 6 rows on 4)
        self.c = nn.Linear(33, 64).to(torch.bfloat16)
        self.d = nn.Linear(64, 3)  # 3 rows: none on the fourth of 4 ranks
        if shard:
            for layer in (self.a, self.b, self.c, self.d):
                fully_shard(layer)
            fully_shard(self)

    def forward(self, x):
        return self.d(self.c(self.b(self.a(x).tanh()).tanh().to(torch.bfloat16)).float())


def sharded_optimizer(model: nn.Module, nvme: str, state_dtype: str) -> OffloadedAdamW:
    """The FSDP2 model's optimizer: units of 16 KiB, state of parts under 12 elements in memory."""
    return OffloadedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, nvme_path=nvme, buffer_size=16 * 1024,
                          buffer_count=3, small_param_threshold=12, state_dtype=state_dtype)


class Job:
    """One rank's model and optimizer, and its training step."""

    def __init__(self, spec: dict, rank: int):
        self.spec, self.rank = spec, rank
        nvme = os.path.join(spec["root"], f"nvme-rank{rank}")
        seed = spec.get("seed", 0)
        if spec.get("model") == "fsdp2":
            self.holder = self.net = Sharded(seed)
            self.opt = sharded_optimizer(self.holder, nvme, spec.get("state_dtype", "fp32"))
            return
        self.holder = Holder(rank, seed)
        self.net = DistributedDataParallel(self.holder.net)
        self.opt = OffloadedAdamW([{"params": list(self.holder.net.parameters())},
                                   {"params": [self.holder.own], "lr": 2e-2}],
                                  lr=1e-2, nvme_path=nvme, buffer_size=16 * 1024, buffer_count=3,
                                  small_param_threshold=64)

    def train(self, step: int) -> None:
        g = torch.Generator().manual_seed(1000 * step + self.rank)
        if self.spec.get("model") == "fsdp2":
            self.net(torch.randn(4, 32, generator=g)).square().mean().backward()
        else:
            x = torch.randn(8, 32, generator=g)
            own = self.holder.own
            (self.net(x).square().mean() + (own * torch.randn(3000, generator=g)).sum().tanh()).backward()
        self.opt.step()
        self.opt.zero_grad()

    def dump(self, step: int) -> dict:
        """Weights and optimizer state, a DTensor as this rank's local shard."""
        state = self.opt.state_dict()
        state["state"] = {i: {k: local(v) for k, v in e.items()} for i, e in state["state"].items()}
        return {"step": step, "model": {k: local(v) for k, v in self.holder.state_dict().items()}, "opt": state}

    def dcp_save(self, directory: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        dcp.save({"model": get_model_state_dict(self.holder), "optim": get_optimizer_state_dict(self.holder, self.opt)},
                 checkpoint_id=directory)

    def dcp_load(self, directory: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        state = {"model": get_model_state_dict(self.holder), "optim": get_optimizer_state_dict(self.holder, self.opt)}
        dcp.load(state, checkpoint_id=directory)
        set_model_state_dict(self.holder, state["model"])
        set_optimizer_state_dict(self.holder, self.opt, state["optim"])


def inject(fault: dict, rank: int):
    """Wrap the checkpoint's streaming loop so that ``fault`` strikes on its rank after its units (a "late"
    fault instead holds its rank back a second before it looks for the ranks that share its directory, a
    "blind" one makes its rank find none there, not even itself; "commit" and "after_rename" faults come
    from the save's Storage instead, see storage_for)."""
    if fault is not None and fault["kind"] in ("commit", "after_rename"):
        return lambda: None  # a Storage of its own (storage_for)
    if fault is not None and fault["kind"] == "blind":
        original = job_module._ranks_here
        if fault["rank"] == rank:
            job_module._ranks_here = lambda *args: []  # as if its own shard's manifest could not be read
        return lambda: setattr(job_module, "_ranks_here", original)
    if fault is not None and fault["kind"] == "late":
        original = job_module._ranks_here

        def late(*args):
            time.sleep(1.0)
            return original(*args)

        if fault["rank"] == rank:
            job_module._ranks_here = late
        return lambda: setattr(job_module, "_ranks_here", original)
    original = snapshot_module.stream

    def faulty(items, buffers, *, read=None, process, write=None):
        done = [0]

        def counted(i, buf):
            if done[0] >= fault["after_units"]:
                if fault["kind"] == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if fault["kind"] == "interrupt":  # a Ctrl-C delivered at the loop's safe point
                    raise KeyboardInterrupt
                raise OSError(errno.EIO, "injected fault in the shard's save", "state.bin")
            done[0] += 1
            return process(i, buf)

        return original(items, buffers, read=read, process=counted, write=write)

    if fault is not None and fault["rank"] == rank:
        snapshot_module.stream = faulty
    return lambda: setattr(snapshot_module, "stream", original)


class FailingCommit(Storage):
    """A checkpoint Storage whose renames (in a job's save, only the job manifest's: its commit) fail,
    before the rename ("commit") or after it ("after_rename")."""

    def __init__(self, after: bool):
        self.after = after

    def rename(self, src, dst):
        if self.after:
            super().rename(src, dst)
            raise OSError(errno.EIO, "injected fault after the commit's rename", dst)
        raise OSError(errno.EIO, "injected fault in the commit", dst)


def storage_for(fault, rank: int):
    """The Storage a save of ``rank`` uses under ``fault``: a failing commit, or the default (None)."""
    if fault is not None and fault["rank"] == rank and fault["kind"] in ("commit", "after_rename"):
        return FailingCommit(after=fault["kind"] == "after_rename")
    return None


class Stopped(BaseException):
    """A "required" action failed: the rank runs nothing more."""


def with_round(value, k: int):
    """``value`` (an action, or what it holds) with "{k}" in its strings replaced by round ``k``."""
    if isinstance(value, str):
        return value.replace("{k}", str(k))
    if isinstance(value, dict):
        return {key: with_round(v, k) for key, v in value.items()}
    if isinstance(value, list):
        return [with_round(v, k) for v in value]
    return value


class Rank:
    """One rank of a job: its model, its optimizer and its step, and the log of the actions it ran (see the
    module's docstring); ``do_<name>`` runs the action named ``name``."""

    def __init__(self, spec: dict, rank: int, world: int):
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
        dist.init_process_group("gloo", init_method=spec["init"], rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=spec.get("timeout", 60)))
        self.rank, self.world = rank, world
        root = spec["root"]
        self.out = os.path.join(root, "out")
        os.makedirs(self.out, exist_ok=True)
        self.spec = spec
        self.job = Job(spec, rank)
        self.step, self.log = 0, []

    @property
    def holder(self) -> nn.Module:
        return self.job.holder

    @property
    def opt(self) -> OffloadedAdamW:
        return self.job.opt

    def run(self, action: dict, k: int | None = None) -> None:
        if k is not None:
            action = with_round(action, k)
        entry = {"do": action["do"], **({} if k is None else {"round": k})}
        if self.rank not in action.get("ranks", range(self.world)):
            return
        for key in ("dir", "root"):
            if key in action:
                action[key] = action[key].format(rank=self.rank)
        try:
            getattr(self, f"do_{action['do']}", lambda action, entry: None)(action, entry)
            entry["ok"] = True
        except (Exception, KeyboardInterrupt) as err:  # recorded for the test to judge
            entry.update(ok=False, type=type(err).__name__, error=str(err))
        self.log.append(entry)
        with open(os.path.join(self.out, f"rank{self.rank}.json"), "w") as f:
            json.dump(self.log, f)
        if not entry["ok"] and action.get("required"):
            raise Stopped(f"{entry}")

    def do_train(self, action: dict, entry: dict) -> None:
        for _ in range(action["steps"]):
            self.job.train(self.step)
            self.step += 1

    def do_save(self, action: dict, entry: dict) -> None:
        undo = inject(action.get("fault"), self.rank)
        extra = {"step": self.step, **action.get("extra", {}).get(str(self.rank), {})}
        if action.get("fixed_clock"):  # every shard manifest says the same second
            manifest_module.datetime = FixedClock
        try:
            entry["result"] = save_checkpoint(self.opt, action["dir"], model=self.holder, extra=extra,
                                              snapshot="stream", blocking=action.get("blocking", True),
                                              alone=action.get("alone", False),
                                              storage=storage_for(action.get("fault"), self.rank))
        finally:
            undo()
            manifest_module.datetime = datetime

    def do_load(self, action: dict, entry: dict) -> None:
        self.step = load_checkpoint(self.opt, action["dir"], model=self.holder if action.get("weights", True) else None,
                                    alone=action.get("alone", False))["step"]

    def do_keep_save(self, action: dict, entry: dict) -> None:
        keep = Retention(action["root"], keep_last=action["keep_last"])
        entry["result"] = keep.save(self.opt, self.step, model=self.holder, extra={"step": self.step})

    def do_keep_load(self, action: dict, entry: dict) -> None:
        entry["result"], extra = Retention(action["root"]).load_latest(self.opt, model=self.holder)
        self.step = extra["step"]

    def do_barrier(self, action: dict, entry: dict) -> None:
        dist.barrier()

    def do_listdir(self, action: dict, entry: dict) -> None:
        entry["result"] = sorted(n for n in os.listdir(action["dir"]) if n != ".nvme-offload.lock")

    def do_mkdir(self, action: dict, entry: dict) -> None:
        os.makedirs(action["dir"], exist_ok=True)

    def do_dump(self, action: dict, entry: dict) -> None:
        torch.save(self.job.dump(self.step), os.path.join(self.out, f"rank{self.rank}-{action['tag']}.pt"))

    def do_dcp_save(self, action: dict, entry: dict) -> None:
        self.job.dcp_save(action["dir"])

    def do_dcp_load(self, action: dict, entry: dict) -> None:
        self.job.dcp_load(action["dir"])
        self.step = action["step"]

    def do_fresh(self, action: dict, entry: dict) -> None:
        self.opt.close()
        self.job = Job(self.spec, self.rank)
        self.step = 0

    def do_rmtree(self, action: dict, entry: dict) -> None:
        shutil.rmtree(action["dir"])

    def do_verify(self, action: dict, entry: dict) -> None:
        entry["result"] = verify_checkpoint(action["dir"]).get("step")

    def do_cat(self, action: dict, entry: dict) -> None:
        with open(action["file"]) as f:
            entry["result"] = f.read()

    def do_no_locks(self, action: dict, entry: dict) -> None:
        held = locks_held(action["dir"])
        if held:
            raise RuntimeError(f"this rank still holds flocks on {action['dir']}'s file system: {held}")

    def do_powerloss(self, action: dict, entry: dict) -> None:
        with open(action["control"]) as f:
            entry["result"] = json.loads(f.read())
        if action.get("cmd"):
            with open(action["control"], "w") as f:
                f.write(action["cmd"])

    def do_repeat(self, action: dict, entry: dict) -> None:
        for r in range(action["max"]):
            first = len(self.log)
            for inner in action["actions"]:
                self.run(inner, r)
            done = [e for e in self.log[first:] if e["do"] in ("save", "powerloss")]
            powered = all(e["ok"] and not (e["do"] == "powerloss" and e["result"]["stopped"]) for e in done)
            everywhere: list = [None] * self.world
            dist.all_gather_object(everywhere, powered)
            if all(everywhere):
                break
        entry["result"] = r + 1


def rank_main(spec: dict, rank: int, world: int) -> None:
    me = Rank(spec, rank, world)
    for action in spec["actions"]:
        me.run(action)
    me.opt.close()


def main() -> None:
    jobs = json.loads(sys.argv[1])
    world = jobs["world"]
    if any(spec.get("model") == "fsdp2" for spec in jobs["jobs"]):
        # What fully_shard and DCP import on first use (2 s), imported once here rather than in every rank.
        import torch._dynamo
        import torch.distributed.checkpoint.state_dict  # noqa: F401
    for spec in jobs["jobs"]:
        n = spec.get("world", world)
        codes = fork_ranks(n, lambda rank, spec=spec, n=n: rank_main(spec, rank, n), jobs.get("timeout", 120))
        os.makedirs(os.path.join(spec["root"], "out"), exist_ok=True)
        with open(os.path.join(spec["root"], "out", "returncodes.json"), "w") as f:
            json.dump(codes, f)


if __name__ == "__main__":
    main()
