"""The code blocks of README.md and docs/*.md, and what runs them (``python docs_blocks.py TMP OUT`` runs every
Python block, writing one JSON line per block to OUT).

A Python block runs for real, on the CPU, at its own sizes, after a prelude of the names its page leaves to the
reader (``model``, ``loader``, ``opt``, ...: tiny ones), with every absolute path it names (``/mnt/...``,
``/ckpt``, ``/data/...``, ``/tmp/...``) moved under TMP. The blocks of a walk-through page share one namespace,
in order (a later block uses what an earlier one built); the others each get a fresh one. A whole script meant
for torchrun runs as two forked gloo ranks, its training loop (``for step in range(N):``) cut to its first
STEPS_OF_RANKS steps: each step is like the one before, and one costs each rank about a second on the CPU; the
SIGTERM script runs as a process and is sent SIGTERM.
"""

from __future__ import annotations

import json
import os
import re
import sys
import textwrap
import time
import traceback
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(f"docs/{n}" for n in os.listdir(os.path.join(REPO, "docs")) if n.endswith(".md"))
# Pages whose Python blocks are one walk-through: they share a namespace, in order.
WALKTHROUGHS = {"docs/big-models.md"}
LANGUAGES = ("python", "sh", "text")
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
_PATHS = re.compile(r"""(["'])/(mnt|ckpt|data|tmp)\b""")
_TRAINING_LOOP = re.compile(r"^for step in range\((\d+)\):", re.M)
STEPS_OF_RANKS = 2


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    language: str
    code: str

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def blocks() -> list[Block]:
    """Every fenced block of the pages, in order."""
    out = []
    for page in PAGES:
        with open(os.path.join(REPO, page), encoding="utf-8") as f:
            text = f.read()
        for m in _FENCE.finditer(text):
            out.append(Block(page, text.count("\n", 0, m.start()) + 1, m.group(1), m.group(2)))
    return out


def moved(code: str, tmp: str) -> str:
    """``code`` with its absolute paths under ``tmp``."""
    return _PATHS.sub(lambda m: f"{m.group(1)}{tmp}/{m.group(2)}", code)


# -- what each page leaves to the reader ----------------------------------------------------------------------

COMMON = """
import contextlib, os, signal, sys, warnings
import torch
from torch import nn
import offload
from offload import *
from offload.checkpoint import Retention, load_checkpoint
warnings.simplefilter("ignore")  # the pages' own messages are not what is checked here
for d in ("mnt/nvme0", "mnt/nvme1", "mnt/nvme", "mnt/remote", "data", "tmp", "ckpt"):
    os.makedirs(os.path.join(TMP, d), exist_ok=True)
os.chdir(TMP)
torch.manual_seed(0)

class Out:
    def __init__(self, loss):
        self.loss = loss

class TinyLM(nn.Module):
    '''A model whose call returns an object with .loss, as Hugging Face models do.'''
    def __init__(self, d=32):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
    def forward(self, batch):
        return Out(self.net(batch).float().pow(2).mean())

def build_model():
    return TinyLM()

model = TinyLM()
loader = [torch.randn(4, 32) for _ in range(2)]
micro_batches = loader
device = torch.device("cpu")
step = 0
path = os.path.join(TMP, "mnt", "nvme0", "offload")
"""

DS_CONFIG = """
import json
with open("ds_config.json", "w") as f:
    json.dump({"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
               "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}},
               "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
               "zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": "mnt/nvme0/ds"}}}, f)
"""

HF = """
import transformers
from transformers import TrainingArguments
torch.manual_seed(0)
_cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2)
transformers.LlamaForCausalLM(_cfg).save_pretrained(os.path.join(TMP, "data", "Llama-3-8B"))
_ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(0))
loader = [{"input_ids": _ids, "labels": _ids}]

class MyModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(config["d"], config["d"]), nn.Linear(config["d"], 8))
config = {"d": 32}
"""

TRAINER = HF + """
model = transformers.LlamaForCausalLM(_cfg)
ds = [{"input_ids": _ids[0], "labels": _ids[0]} for _ in range(4)]
"""

LIGHTNING = """
import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(32, 1)
    def training_step(self, batch, i):
        return self.net(batch).pow(2).mean()
    def configure_optimizers(self):
        return OffloadedAdamW(self.parameters(), lr=1e-3, nvme_path=os.path.join(TMP, "mnt", "nvme0", "lightning"))

module = Module()
loader = torch.utils.data.DataLoader(torch.randn(8, 32), batch_size=4)
"""

ACCELERATE = """
from accelerate import Accelerator
accelerator = Accelerator(cpu=True)
model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 1))
loader = torch.utils.data.DataLoader(torch.randn(8, 32), batch_size=4)
"""

ONE_RANK = """
import torch.distributed as dist
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=str(29600 + os.getpid() % 1000))
"""
DISTRIBUTED = ONE_RANK + """
if not dist.is_initialized():
    dist.init_process_group("gloo")
"""

FSDP = DISTRIBUTED + """
from torch.distributed.fsdp import fully_shard
model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
for layer in model:
    fully_shard(layer)
fully_shard(model)
opt = OffloadedAdamW(model.parameters(), lr=1e-3, nvme_path=os.path.join(TMP, "mnt", "nvme0", "fsdp"))
model(torch.randn(4, 32)).sum().backward()
opt.step()
"""

CHECKPOINT = """
model = nn.Linear(64, 64)
opt = OffloadedAdamW(model.parameters(), lr=1e-3, nvme_path=os.path.join(TMP, "mnt", "nvme0", "ckpt-opt"))
model(torch.randn(4, 64)).sum().backward()
opt.step()
"""

# (page, a text the block holds) -> what runs before it; the first match wins, then the page's default.
PRELUDES = [
    ("README.md", "ds_config.json", DS_CONFIG),
    ("docs/big-models.md", "", HF),
    ("docs/checkpoint.md", "init_process_group", ONE_RANK),
    ("docs/checkpoint.md", "", CHECKPOINT),
    ("docs/distributed.md", "dcp.save", FSDP),
    ("docs/distributed.md", "ZeroRedundancyOptimizer", DISTRIBUTED),
    ("docs/integrations.md", "OffloadTrainer", TRAINER),
    ("docs/integrations.md", "OffloadCheckpoint", LIGHTNING),
    ("docs/integrations.md", "integrations.accelerate", ACCELERATE),
    ("docs/integrations.md", "integrations import dcp", CHECKPOINT + "sched = torch.optim.lr_scheduler.LinearLR(opt)"),
    ("docs/overlap.md", "no_step", "opt = OffloadedAdamW(model.parameters(), nvme_path=path, overlap_backward=True)\n"),
]


def prelude(block: Block) -> str:
    for page, marker, code in PRELUDES:
        if page == block.page and marker in block.code:
            return code
    return ""


def how(block: Block) -> str:
    """How a Python block runs: "ranks" (a torchrun script), "sigterm" (a script stopped by SIGTERM), "here"."""
    if "torchrun --nproc-per-node" in block.code.splitlines()[0]:
        return "ranks"
    if "signal.SIGTERM" in block.code:
        return "sigterm"
    return "here"


# -- running them -------------------------------------------------------------------------------------------

def _cleanup(namespace: dict) -> None:
    """Close every optimizer and restore every offloaded model a block left, and end a process group."""
    from offload import OffloadedAdam, restore_parameters
    from offload.params import offloaded

    for value in list(namespace.values()):
        inner = getattr(value, "optim", value)  # ZeroRedundancyOptimizer's own
        if isinstance(inner, OffloadedAdam):
            inner.close()
        if hasattr(value, "close") and type(value).__name__ == "OffloadEngine":
            value.close()
    for value in list(namespace.values()):
        module = getattr(value, "module", value)
        if isinstance(module, __import__("torch").nn.Module):
            for m in module.modules():
                if offloaded(m) is not None:
                    restore_parameters(m)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def fewer_steps(code: str) -> str:
    """``code`` with each top-level ``for step in range(N):`` running at most STEPS_OF_RANKS steps."""
    return _TRAINING_LOOP.sub(lambda m: f"for step in range({min(int(m.group(1)), STEPS_OF_RANKS)}):", code)


def _run_ranks(code: str, tmp: str) -> None:
    """A torchrun script as two forked gloo ranks of this process, its training loop cut short (fewer_steps)."""
    sys.path.insert(0, os.path.dirname(__file__))
    from ranks import fork_ranks

    code = fewer_steps(code)

    port = str(29700 + os.getpid() % 1000)

    def rank_main(rank: int) -> None:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        os.chdir(tmp)
        exec(compile(code, "<block>", "exec"), {"__name__": "__main__"})

    codes = fork_ranks(2, rank_main, timeout=240)
    if codes != [0, 0]:
        raise RuntimeError(f"the ranks exited with {codes}")


def _run_sigterm(code: str, tmp: str) -> None:
    """A script that trains until SIGTERM, saves and exits: run, stopped by SIGTERM after its first save point is
    passed, then run again (it resumes) and stopped again."""
    import subprocess

    script = os.path.join(tmp, "sigterm_script.py")
    with open(script, "w") as f:
        f.write(code)
    def swap_files() -> list:
        return [os.path.join(d, f) for d, _, files in os.walk(tmp) for f in files if f.endswith(".swap")]

    said = []
    for _ in range(2):
        proc = subprocess.Popen([sys.executable, script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, cwd=tmp, env=os.environ)
        deadline = time.monotonic() + 60
        while not swap_files() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)  # its optimizer exists: the handler is set, training starts
        time.sleep(0.2)  # a step or more (one at least comes before the flag is read, whenever it lands)
        proc.send_signal(15)
        out, _ = proc.communicate(timeout=120)
        if proc.returncode != 0 or "after SIGTERM; exiting" not in out:
            raise RuntimeError(f"exit {proc.returncode}: {out[-2000:]}")
        said.append(int(re.search(r"saved step (\d+) after SIGTERM", out).group(1)))
    if not said[1] > said[0]:
        raise RuntimeError(f"the second run did not resume from the first's save: steps {said}")


def _run_one(block: Block, tmp: str, shared: dict) -> dict:
    """Run one Python block; its result."""
    code = moved(block.code, tmp)
    started = time.monotonic()
    try:
        kind = how(block)
        if kind == "ranks":
            _run_ranks(code, tmp)
        elif kind == "sigterm":
            root = os.path.join(tmp, "sigterm")  # its own: the swap file it makes is watched for
            os.makedirs(os.path.join(root, "tmp"), exist_ok=True)
            _run_sigterm(moved(block.code, root), root)
        else:
            walkthrough = block.page in WALKTHROUGHS
            if walkthrough and block.page in shared:
                namespace = shared[block.page]
            else:
                namespace = {"__name__": "__docs__", "TMP": tmp}
                exec(compile(COMMON, "<prelude>", "exec"), namespace)
                if walkthrough:
                    shared[block.page] = namespace
            try:
                exec(compile(textwrap.dedent(prelude(block)), "<prelude>", "exec"), namespace)
                exec(compile(code, f"{block.page}:{block.line}", "exec"), namespace)
            finally:
                if not walkthrough:
                    _cleanup(namespace)
        return {"id": block.id, "ok": True, "seconds": round(time.monotonic() - started, 1)}
    except BaseException:  # reported per block
        return {"id": block.id, "ok": False, "error": traceback.format_exc()[-4000:]}
    finally:
        os.chdir(tmp)


def main(tmp: str, out_path: str) -> None:
    import threading

    for d in ("mnt/nvme0", "mnt/nvme1", "mnt/nvme", "mnt/remote", "data", "tmp", "ckpt"):
        os.makedirs(os.path.join(tmp, d), exist_ok=True)
    python = [b for b in blocks() if b.language == "python"]
    shared: dict = {}
    # Ranks first, forked before any optimizer of the other blocks has I/O threads for a fork to copy; the scripts
    # stopped by SIGTERM run as processes beside the blocks run here.
    results = [_run_one(b, tmp, shared) for b in python if how(b) == "ranks"]
    beside: list = []
    threads = [threading.Thread(target=lambda b=b: beside.append(_run_one(b, tmp, shared)))
               for b in python if how(b) == "sigterm"]
    for t in threads:
        t.start()
    results += [_run_one(b, tmp, shared) for b in python if how(b) == "here"]
    for t in threads:
        t.join()
    for namespace in shared.values():
        _cleanup(namespace)
    with open(out_path, "w") as f:
        for r in results + beside:
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
