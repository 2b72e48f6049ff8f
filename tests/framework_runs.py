"""Training runs inside frameworks with the offload adapters, for tests/test_integrations.py (in a subprocess).

``python tests/framework_runs.py ROOT FRAMEWORK[@STATE_DTYPE]...`` trains, for each framework, an offloaded model whose
Adam state is several times the host pools, saves through the framework after steps 1 and 2, resumes
from step 1 in fresh objects, trains step 2 again, and prints one JSON line: the peak RSS growth of
the framework's save and of its load (VmHWM after ``clear_refs`` = 5, around each), the pools, the
state's size, whether the resumed run ended bit for bit where the first did, and for comparison the
growth of ``torch.save(opt.state_dict())``. The frameworks are imported before anything is measured
(an import's memory is not a save's). Run it with ``MALLOC_MMAP_THRESHOLD_`` set, so that freed tensors
leave RSS at once and each window sees only its own. ``FRAMEWORK@int8`` (or another state dtype) runs the
framework with OffloadedAdamW(state_dtype=...), its line's "framework" being the whole argument.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import shutil
import sys

import torch
from torch import nn

from offload import OffloadedAdamW, offload_parameters, restore_parameters
from offload._proc import reset_peak_rss, status_bytes
from offload.params import materialized, offloaded
from offload.sizes import MIB

LAYERS, WIDTH, BATCH, STEPS = 4, 1024, 4, 2  # 4.2 M fp32 parameters: 16 MiB of weights, 32 MiB of state
OPT = dict(lr=1e-3, buffer_count=2, buffer_size=2 * MIB)  # the optimizer's pool: 4 MiB
PARAMS = dict(max_in_cpu=0, max_grad_in_cpu=0, buffer_count=2, buffer_size=WIDTH * WIDTH // 2)  # 2 x 2 MiB

growth = {"save": 0, "load": 0}


_status = status_bytes


@contextlib.contextmanager
def window(kind: str):
    """Record in ``growth[kind]`` how far RSS rose above its level at the start, at its peak."""
    reset_peak_rss()  # VmHWM := VmRSS
    before = _status("VmRSS")
    try:
        yield
    finally:
        growth[kind] = max(growth.get(kind, 0), _status("VmHWM") - before)


class Stack(nn.Module):
    """Linear layers and a regression loss; forward takes keyword inputs and returns a dict, as Trainer wants."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])

    def forward(self, x, labels=None):
        out = self.layers(x)
        return {"loss": (out - labels).square().mean()}


def batches(n: int = STEPS):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)) for _ in range(n)]


class Dataset(torch.utils.data.Dataset):
    """The batches one sample at a time, in order (no shuffling: a resumed run sees the same ones)."""

    def __init__(self, n: int = STEPS):
        self.items = [(x[i], y[i]) for x, y in batches(n) for i in range(BATCH)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return {"x": self.items[i][0], "labels": self.items[i][1]}


def offloaded_stack(root: str) -> nn.Module:
    return offload_parameters(Stack(), os.path.join(root, "swap"), **PARAMS)


def new_optimizer(params, root: str) -> OffloadedAdamW:
    return OffloadedAdamW(params, nvme_path=os.path.join(root, "swap"), **OPT)


def weights(model: nn.Module) -> list:
    with materialized(model):
        return [p.detach().clone() for p in model.parameters()]


def report(model: nn.Module, opt: OffloadedAdamW, root: str, first: list, resumed: list) -> dict:
    """The JSON line; the comparison's torch.save(opt.state_dict()) is measured last."""
    pool = opt.host_pool_bytes + offloaded(model).store.pool.nbytes
    with window("state_dict"):
        torch.save(opt.state_dict(), os.path.join(root, "state_dict.pt"))
    return {"pool": pool, "state": opt.offloaded_state_bytes, "weights": sum(p.numel() * 4 for p in model.parameters()),
            "same": all(torch.equal(a, b) for a, b in zip(first, resumed)), **growth}


def close(model: nn.Module, opt) -> None:
    opt.close()
    restore_parameters(model)


# -- the frameworks -------------------------------------------------------------------------------


def run_transformers(root: str) -> dict:
    from transformers import TrainingArguments

    from offload.integrations.transformers import OffloadTrainer

    class Measured(OffloadTrainer):
        def _save_checkpoint(self, model, trial):
            with window("save"):
                super()._save_checkpoint(model, trial)

        def _load_from_checkpoint(self, checkpoint, model=None):
            with window("load"):
                super()._load_from_checkpoint(checkpoint, model)

        def _load_optimizer_and_scheduler(self, checkpoint):
            with window("load"):
                super()._load_optimizer_and_scheduler(checkpoint)

    def fit(resume=None):
        model = offloaded_stack(root)
        opt = new_optimizer(model.parameters(), root)
        args = TrainingArguments(output_dir=os.path.join(root, "out"), max_steps=STEPS, save_steps=1,
                                 per_device_train_batch_size=BATCH, report_to=[], use_cpu=True, seed=0,
                                 max_grad_norm=1.0, disable_tqdm=True, logging_steps=1)
        trainer = Measured(model=model, args=args, train_dataset=Dataset(), optimizers=(opt, None))
        trainer.train(resume_from_checkpoint=resume)
        return model, opt

    model, opt = fit()
    first = weights(model)
    close(model, opt)
    model, opt = fit(resume=os.path.join(root, "out", "checkpoint-1"))
    return report(model, opt, root, first, weights(model))


def run_lightning(root: str) -> dict:
    import lightning

    from offload.integrations.lightning import OffloadCheckpoint

    class Module(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = offloaded_stack(root)

        def training_step(self, batch, i):
            return self.net(**batch)["loss"]

        def configure_optimizers(self):
            self.opt = new_optimizer(self.parameters(), root)
            return self.opt

    class Measure(lightning.Callback):
        """After OffloadCheckpoint's setup (it comes later in the list): windows around the load steps."""

        def setup(self, trainer, pl_module, stage):
            s = trainer.strategy
            for name in ("load_checkpoint", "load_model_state_dict", "load_optimizer_state_dict"):
                setattr(s, name, measured(getattr(s, name), "load"))

    def measured(fn, kind):
        def call(*args, **kwargs):
            with window(kind):
                return fn(*args, **kwargs)
        return call

    class Trainer(lightning.Trainer):
        def save_checkpoint(self, *args, **kwargs):
            with window("save"):
                super().save_checkpoint(*args, **kwargs)

    def fit(resume=None):
        module = Module()
        every = lightning.pytorch.callbacks.ModelCheckpoint(dirpath=os.path.join(root, "out"),
                                                            every_n_train_steps=1, save_top_k=-1)
        trainer = Trainer(max_steps=STEPS, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                          enable_model_summary=False, callbacks=[every, OffloadCheckpoint(), Measure()])
        # One batch an epoch: Lightning resumes a run cut mid-epoch at the epoch's start (the loader keeps
        # no position), so a checkpoint at every step is at an epoch's end.
        loader = torch.utils.data.DataLoader(Dataset(1), batch_size=BATCH)
        trainer.fit(module, loader, ckpt_path=resume)
        return trainer, module, module.opt

    _, module, opt = fit()
    first = weights(module.net)
    close(module.net, opt)
    trainer, module, opt = fit(resume=os.path.join(root, "out", "epoch=0-step=1.ckpt"))
    result = report(module.net, opt, root, first, weights(module.net))

    # A .ckpt beside another save's directory (a crash between the two writes) is refused on reading.
    step1, step2 = (os.path.join(root, "out", f"epoch={e}-step={e + 1}.ckpt") for e in (0, 1))
    os.rename(step1 + ".offload", step1 + ".saved")
    shutil.copytree(step2 + ".offload", step1 + ".offload")
    try:
        trainer.strategy.load_checkpoint(step1)
        result["mismatch"] = "loaded"
    except Exception as err:  # reported to the test as is
        result["mismatch"] = f"{type(err).__name__}: {err}"
    # Lightning's removal of a .ckpt (save_top_k) takes its directory along.
    trainer.strategy.remove_checkpoint(step2)
    result["removed"] = not os.path.exists(step2) and not os.path.exists(step2 + ".offload")
    result.update(lightning_attacks(trainer, root, step1))
    return result


def lightning_attacks(trainer, root: str, ckpt: str) -> dict:
    """What a .ckpt from elsewhere or files planted beside one do: each outcome, for the test to judge."""
    import warnings

    from offload.integrations.lightning import KEY

    out = {}
    # A received .ckpt naming a directory outside it (its fingerprint recomputed, as any sender can).
    elsewhere = os.path.join(root, "elsewhere.offload")
    shutil.copytree(ckpt + ".saved", elsewhere)
    data = torch.load(ckpt, weights_only=False)
    for name in ("../elsewhere.offload", elsewhere):
        data[KEY]["dirs"] = [name]
        evil = os.path.join(root, "out", "evil.ckpt")
        torch.save(data, evil)
        try:
            trainer.strategy.load_checkpoint(evil)
            out.setdefault("confined", []).append("loaded")
        except Exception as err:  # reported to the test as is
            out.setdefault("confined", []).append(f"{type(err).__name__}: {err}")
    # A user's notes inside the directory and a user's backup beside it survive the .ckpt's removal.
    with open(ckpt + ".offload/NOTES.txt", "w") as f:
        f.write("mine")
    backup = ckpt + ".offload-1-backup"
    shutil.copytree(ckpt + ".saved", backup)
    theirs = sorted(os.listdir(backup))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.strategy.remove_checkpoint(ckpt)
    out["kept_foreign"] = (os.listdir(ckpt + ".offload") == ["NOTES.txt"] and sorted(os.listdir(backup)) == theirs
                           and not os.path.exists(ckpt))
    # A link planted where the .ckpt's temporary file would have been named before.
    victim = os.path.join(root, "victim")
    with open(victim, "w") as f:
        f.write("precious")
    target = os.path.join(root, "out", "planted.ckpt")
    os.symlink(victim, f"{target}.tmp-{os.getpid()}")
    trainer.save_checkpoint(target)
    with open(victim) as f:
        out["victim"] = f.read()
    return out


def run_accelerate(root: str) -> dict:
    from accelerate import Accelerator

    from offload.integrations.accelerate import register
    from offload.params import clip_grad_norm_

    def setup():
        accelerator = Accelerator(cpu=True)
        model = offloaded_stack(root)  # offloaded: kept out of prepare, given to register
        opt = accelerator.prepare(new_optimizer(model.parameters(), root))
        register(accelerator, opt, model=model)
        return accelerator, model, opt

    def train(accelerator, model, opt, todo):
        for x, y in todo:
            accelerator.backward(model(x, y)["loss"])
            clip_grad_norm_(model, 1.0)
            opt.step()
            opt.zero_grad()

    accelerator, model, opt = setup()
    data = batches()
    train(accelerator, model, opt, data[:1])
    with window("save"):
        accelerator.save_state(os.path.join(root, "step-1"))
    train(accelerator, model, opt, data[1:])
    first = weights(model)
    close(model, opt.optimizer)
    accelerator, model, opt = setup()
    with window("load"):
        accelerator.load_state(os.path.join(root, "step-1"))
    train(accelerator, model, opt, data[1:])
    return report(model, opt.optimizer, root, first, weights(model))


def run_dcp(root: str) -> dict:
    from offload.integrations import dcp

    def setup():
        model = offloaded_stack(root)
        opt = new_optimizer(model.parameters(), root)
        return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))

    def train(model, opt, sched, todo):
        for x, y in todo:
            model(x, y)["loss"].backward()
            opt.step()
            opt.zero_grad()
            sched.step()

    model, opt, sched = setup()
    data = batches()
    train(model, opt, sched, data[:1])
    with window("save"):
        dcp.save({"scheduler": sched.state_dict()}, os.path.join(root, "step-1"), optimizer=opt, model=model)
    train(model, opt, sched, data[1:])
    first = weights(model)
    close(model, opt)
    model, opt, sched = setup()
    state = {"scheduler": sched.state_dict()}
    with window("load"):
        dcp.load(state, os.path.join(root, "step-1"), optimizer=opt, model=model)
    sched.load_state_dict(state["scheduler"])
    train(model, opt, sched, data[1:])
    return report(model, opt, root, first, weights(model))


IMPORTS = {"transformers": ["transformers", "accelerate"], "lightning": ["lightning"], "accelerate": ["accelerate"],
           "dcp": ["torch.distributed.checkpoint"]}

if __name__ == "__main__":
    root, runs = sys.argv[1], sys.argv[2:]
    for run in runs:
        for module in IMPORTS[run.partition("@")[0]]:
            importlib.import_module(module)
    defaults = dict(OPT)
    for run in runs:
        framework, _, state_dtype = run.partition("@")
        OPT.clear()
        OPT.update(defaults, **({"state_dtype": state_dtype} if state_dtype else {}))
        where = os.path.join(root, run)
        os.makedirs(os.path.join(where, "swap"))
        growth.clear()
        growth.update(save=0, load=0)
        result = globals()[f"run_{framework}"](where)
        print(json.dumps({"framework": run, **result}), flush=True)
