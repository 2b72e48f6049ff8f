"""Every combination of the optimizer's and the parameter store's options trains as torch does.

One property-based test draws a configuration (where the state lives: NVMe with the pool's buffers as a
cache, a part or all of it in a ``host_cache``, or ``device="cpu"``; ``overlap_backward``; weights on NVMe
with ``offload_parameters``, their grads on NVMe, in host memory or ordinary tensors; ``max_in_cpu``;
fp32/bf16/fp16 parameters; ``max_grad_norm``; a ``GradScaler``; Adam or AdamW, fused or not; one or two
param groups; a frozen layer; ``state_dtype="bf16"``; checksums) and a program (iterations over micro-batches
with ``no_step()`` where blocks of the model go unused, checkpoints saved blocking or not and loaded back,
``state_dict()``/``load_state_dict()`` round trips, and ``add_param_group``), runs it, and runs the same
program through torch's own ``Adam``/``AdamW`` on a plain copy of the model. For fp16/bf16 parameters the
reference is torch's optimizer on fp32 copies (the library's fp32 masters), whose values are rounded to the
half dtype for the model; with ``max_grad_norm`` it is ``clip_grad_norm_`` (after ``scaler.unscale_`` with a
scaler); with ``state_dtype="bf16"`` the reference's offloaded moments are rounded to bf16 after each step,
which is what the narrow state stores (tests/test_tiers.py), so that case is compared bit for bit as well.
Weights are compared after every step, the optimizer's state (moments, masters, step counts) after the steps
the program says and at its end, all bit for bit.

Combinations the library refuses by design (a GradScaler with ``overlap_backward`` or with grads held by the
parameter store) are run too: the refusal must be the documented error, and it must either leave every
weight and every moment as it was, or leave the optimizer refusing to step until a checkpoint restores it.

Hypothesis profiles: the default ("combinations") is derandomized (the same examples every run, so a
failure reproduces; hypothesis prints the blob to replay it) and kept to about a minute on a 2-core machine.
``OFFLOAD_HYPOTHESIS_PROFILE=soak`` runs many more random examples with longer programs::

    OFFLOAD_HYPOTHESIS_PROFILE=soak python -m pytest -q tests/test_combinations.py
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
from dataclasses import dataclass
from typing import Optional

import pytest
import torch
from helpers import Block
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from torch import nn

from offload import OffloadedAdam, OffloadedAdamW, StateError, offload_parameters, restore_parameters
from offload.params import materialized, offloaded

settings.register_profile(
    "combinations", max_examples=80, deadline=None, derandomize=True, print_blob=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile(
    "soak", max_examples=600, deadline=None, derandomize=False, print_blob=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large])
PROFILE = os.environ.get("OFFLOAD_HYPOTHESIS_PROFILE", "combinations")
SOAK = PROFILE == "soak"

D, H, LAYERS, BATCH = 32, 128, 3, 4
UNIT = 64 * 1024  # optimizer pool buffers of 64 KiB: the state is 4-6 units, more than the pool's 3 buffers
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TIERS = {"nvme": dict(host_cache=0), "part": dict(host_cache=2 * UNIT), "all": dict(host_cache=64 * UNIT),
         "cpu": dict(device="cpu")}
# Where offload_parameters keeps grads: max_grad_in_cpu=0, a large max_grad_in_cpu, or offload_grads=False.
GRADS = ("nvme", "host", "tensor")


# -- the configuration ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    adamw: bool
    fused: bool
    dtype: str
    tier: str
    overlap: bool
    params: Optional[str]  # None: weights in memory; else where offloaded weights' grads live (GRADS)
    max_in_cpu: int
    clip: Optional[float]
    scale: Optional[float]  # a GradScaler's init_scale
    unscale_first: bool  # scaler.unscale_(opt) before scaler.step(opt)
    narrow: bool  # state_dtype="bf16"
    checksum: bool
    small: int  # small_param_threshold
    groups: int
    frozen: bool

    def refused(self) -> bool:
        """A GradScaler with the update inside backward, or with grads the parameter store holds (torch's
        GradScaler cannot read them: weights on NVMe, max_in_cpu below the model), is refused by design."""
        held = self.params in ("nvme", "host") and self.max_in_cpu < 10 ** 9
        return self.scale is not None and (self.overlap or held)


@st.composite
def configs(draw) -> Config:
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    scale = draw(st.sampled_from([None, None, None, 2.0 ** 12, 1000.0]))
    # With a scaler, half weights take the fused kernel (which unscales their grads in fp32, against the master):
    # the for-loop kernel has GradScaler unscale the half grads in place, which torch refuses for fp16, and in
    # bf16 rounds otherwise than an fp32 master's reference would.
    fused = draw(st.booleans()) if scale is None or dtype == "fp32" else True
    return Config(
        adamw=draw(st.booleans()), fused=fused, dtype=dtype, tier=draw(st.sampled_from(sorted(TIERS))),
        overlap=draw(st.booleans()), params=draw(st.sampled_from([None, *GRADS])),
        max_in_cpu=draw(st.sampled_from([0, 200, 10 ** 9])), clip=draw(st.sampled_from([None, 0.05, 1e3])),
        scale=scale, unscale_first=dtype == "fp32" and fused and draw(st.booleans()),
        narrow=draw(st.booleans()), checksum=draw(st.booleans()), small=draw(st.sampled_from([0, 64])),
        groups=draw(st.integers(1, 2)), frozen=draw(st.booleans()))


# -- the program --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Iteration:
    micro: int  # micro-batches, all but the last under no_step()
    used: tuple  # the blocks the forward runs, in order (the others get no grad)
    overflow: bool  # the last micro-batch's loss is inf: a GradScaler skips the step
    set_to_none: bool
    check_state: bool  # compare the optimizer's state too (it goes through the pool)


@dataclass(frozen=True)
class Save:
    how: str  # "checkpoint" (blocking), "async" (blocking=False) or "state_dict"


@dataclass(frozen=True)
class Restore:
    pass


@dataclass(frozen=True)
class AddGroup:
    pass


# The blocks an iteration runs: all of them (in order or not) or some, so that trained blocks go unused.
USED = [(0, 1, 2), (2, 0, 1), (0, 1), (0, 2), (1, 2), (0,), (2,)]
iterations = st.builds(
    Iteration, micro=st.integers(1, 3), used=st.sampled_from(USED),
    overflow=st.sampled_from([False, False, False, True]), set_to_none=st.sampled_from([True, True, False]),
    check_state=st.booleans())
saves = st.builds(Save, st.sampled_from(["checkpoint", "async", "state_dict"]))
ops = st.one_of(iterations, iterations, iterations, saves, st.just(Restore()), st.just(AddGroup()))
# A first iteration trains every block (later ones may leave some unused), then the drawn operations.
programs = st.tuples(st.builds(Iteration, micro=st.integers(1, 2), used=st.just(USED[0]), overflow=st.just(False),
                               set_to_none=st.sampled_from([True, True, False]), check_state=st.booleans()),
                     st.lists(ops, min_size=2, max_size=14 if SOAK else 7)).map(lambda t: [t[0], *t[1]])


# -- the model ------------------------------------------------------------------------------------------


class Model(nn.Module):
    """Blocks run in the order (and subset) an iteration says, a head, and a layer that joins the forward
    once it is added to the optimizer as a new group."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block(D, H) for _ in range(LAYERS))
        self.head = nn.Linear(D, 8)
        self.extra = nn.Linear(D, D)
        self.used = tuple(range(LAYERS))
        self.extra_on = False

    def forward(self, x):
        for i in self.used:
            x = self.blocks[i](x)
        if self.extra_on:
            x = x + self.extra(x)
        return self.head(x)


def data(seed: int, dtype):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, D, generator=g).to(dtype), torch.randn(BATCH, 8, generator=g)


def loss_of(model, seed: int, dtype, overflow: bool):
    x, y = data(seed, dtype)
    loss = (model(x).float() - y).square().mean()
    return loss * float("inf") if overflow else loss


def groups_of(model: Model, cfg: Config, params=None) -> list:
    """The model's trainable parameters except ``extra`` (added later), in one group or two (the blocks with
    their own lr and weight decay). ``params`` maps each to the tensor the optimizer should hold."""
    pick = (lambda p: p) if params is None else params.__getitem__
    blocks = [p for p in model.blocks.parameters()]
    rest = [p for p in model.head.parameters()]
    if cfg.groups == 1:
        return [{"params": [pick(p) for p in blocks + rest]}]
    return [{"params": [pick(p) for p in blocks], "lr": 3e-3, "weight_decay": 0.05},
            {"params": [pick(p) for p in rest]}]


# -- the reference: torch's optimizer on a plain copy (on fp32 copies for fp16/bf16 weights) ------------


class Reference:
    """torch's Adam/AdamW over a plain copy of the model; for fp16/bf16 weights over fp32 masters whose values,
    rounded, are the model's. Steps as torch users write them: GradScaler's unscale_, clip_grad_norm_, step."""

    def __init__(self, model: Model, cfg: Config):
        self.cfg = cfg
        self.model = model
        self.dtype = DTYPES[cfg.dtype]
        half = self.dtype != torch.float32
        self.master = {p: nn.Parameter(p.detach().float().clone()) if half else p for p in model.parameters()}
        cls = torch.optim.AdamW if cfg.adamw else torch.optim.Adam
        self.opt = cls(groups_of(model, cfg, self.master), lr=1e-2, fused=cfg.fused)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=cfg.scale) if cfg.scale else None
        self.narrow: set = set()  # masters whose moments the library keeps in bf16
        self.in_opt = [p for g in groups_of(model, cfg) for p in g["params"]]
        self.norm = None

    def add_group(self) -> None:
        extra = list(self.model.extra.parameters())
        self.opt.add_param_group({"params": [self.master[p] for p in extra], "lr": 5e-3})
        self.in_opt += extra
        self.model.extra_on = True

    def backward(self, seed: int, overflow: bool) -> None:
        loss = loss_of(self.model, seed, self.dtype, overflow)
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self, set_to_none: bool) -> None:
        half = self.dtype != torch.float32
        masters = [self.master[p] for p in self.in_opt]
        self.norm = None
        if half and self.cfg.clip and not self.scaler:  # clip_grad_norm_ on the model's grads, as they are
            self.norm = torch.nn.utils.clip_grad_norm_(self.in_opt, self.cfg.clip)
        if half:
            for p, m in zip(self.in_opt, masters):
                if p.grad is not None:
                    m.grad = p.grad.float()
        if self.scaler:
            if self.cfg.clip or self.cfg.unscale_first:  # as Run.step: unscale_ multiplies, the kernel divides
                self.scaler.unscale_(self.opt)
            if self.cfg.clip:
                self.norm = torch.nn.utils.clip_grad_norm_(masters, self.cfg.clip)
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            if self.cfg.clip and not half:
                self.norm = torch.nn.utils.clip_grad_norm_(masters, self.cfg.clip)
            self.opt.step()
        for m in self.narrow:
            state = self.opt.state.get(m, {})  # not opt.state[m]: a defaultdict would make an empty entry
            for k in ("exp_avg", "exp_avg_sq"):
                if k in state:
                    state[k].copy_(state[k].bfloat16().float())
        if half:
            with torch.no_grad():
                for p, m in zip(self.in_opt, masters):
                    p.copy_(m.to(self.dtype))
        self.opt.zero_grad(set_to_none)
        self.model.zero_grad(set_to_none)

    def snapshot(self) -> dict:
        return {"model": {k: v.clone() for k, v in self.model.state_dict().items()},
                "master": {p: m.detach().clone() for p, m in self.master.items()},
                "opt": copy.deepcopy(self.opt.state_dict()),
                "scaler": None if self.scaler is None else self.scaler.state_dict()}

    def restore(self, snap: dict) -> None:
        self.model.load_state_dict(snap["model"])
        with torch.no_grad():
            for p, m in self.master.items():
                if m is not p:
                    m.copy_(snap["master"][p])
        self.opt.load_state_dict(copy.deepcopy(snap["opt"]))


# -- the run --------------------------------------------------------------------------------------------


class Run:
    """The library's side: the model (offloaded or not), OffloadedAdam/W and its GradScaler."""

    def __init__(self, model: Model, cfg: Config, nvme: str, stack: contextlib.ExitStack):
        self.cfg = cfg
        self.model = model
        self.dtype = DTYPES[cfg.dtype]
        if cfg.params is not None:
            grads = {"nvme": dict(max_grad_in_cpu=0), "host": dict(max_grad_in_cpu=10 ** 9),
                     "tensor": dict(offload_grads=False)}[cfg.params]
            offload_parameters(model, nvme_path=nvme, max_in_cpu=cfg.max_in_cpu, buffer_count=3, buffer_size=2048,
                               **grads)
            stack.callback(lambda: offloaded(model) is not None and restore_parameters(model))
        cls = OffloadedAdamW if cfg.adamw else OffloadedAdam
        self.opt = cls(groups_of(model, cfg), lr=1e-2, fused=cfg.fused, nvme_path=nvme, buffer_size=UNIT,
                       buffer_count=3, small_param_threshold=cfg.small, overlap_backward=cfg.overlap,
                       max_grad_norm=cfg.clip, state_dtype="bf16" if cfg.narrow else "fp32", checksum=cfg.checksum,
                       **TIERS[cfg.tier])
        stack.callback(self.opt.close)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=cfg.scale) if cfg.scale else None

    def add_group(self) -> None:
        self.opt.add_param_group({"params": list(self.model.extra.parameters()), "lr": 5e-3})
        self.model.extra_on = True

    def backward(self, seed: int, overflow: bool, accumulate: bool) -> None:
        loss = loss_of(self.model, seed, self.dtype, overflow)
        with self.opt.no_step() if accumulate else contextlib.nullcontext():
            (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self, set_to_none: bool) -> None:
        if self.scaler:
            if self.cfg.unscale_first:
                self.scaler.unscale_(self.opt)
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()
        self.opt.zero_grad(set_to_none)


def narrow_masters(run: Run, ref: Reference) -> set:
    """The reference's masters whose moments the library keeps as bf16 (state_dtype="bf16"): the
    parameters whose state is offloaded (small ones keep torch's fp32 state in memory)."""
    if not run.cfg.narrow:
        return set()
    ours = [p for g in run.opt.param_groups for p in g["params"]]
    return {ref.master[q] for p, q in zip(ours, ref.in_opt) if not run.opt.state_store.is_small(p)}


def assert_same_weights(run: Run, ref: Reference, when: str) -> None:
    with materialized(run.model):
        for (name, p), q in zip(run.model.named_parameters(), ref.model.parameters(), strict=True):
            assert torch.equal(p.detach(), q.detach()), \
                f"{when}: weight {name} differs (max abs diff {(p.float() - q.float()).abs().max().item()})"


def assert_same_state(run: Run, ref: Reference, when: str) -> None:
    ours, theirs = run.opt.state_dict(), ref.opt.state_dict()
    # torch's fused kernel makes zero state (step 0) for a parameter whose first step a GradScaler skipped; the
    # library makes it at the first step it takes: the same numbers from then on.
    theirs["state"] = {i: e for i, e in theirs["state"].items() if float(e["step"]) > 0 or i in ours["state"]}
    masters = [m for g in ref.opt.param_groups for m in g["params"]]
    assert sorted(ours["state"]) == sorted(theirs["state"]), f"{when}: state kept for other parameters"
    for i, entry in theirs["state"].items():
        for k, v in entry.items():
            assert torch.equal(ours["state"][i][k].float().cpu(), v.float().cpu()), f"{when}: {k} of parameter {i}"
        if DTYPES[run.cfg.dtype] != torch.float32:
            assert torch.equal(ours["state"][i]["master"], masters[i].detach()), f"{when}: master of parameter {i}"


def twins(cfg: Config) -> tuple[Model, Model]:
    torch.manual_seed(0)
    model = Model().to(DTYPES[cfg.dtype])
    if cfg.frozen:
        model.blocks[1].up.requires_grad_(False)
    return model, copy.deepcopy(model)


def refusal(run: Run, ref: Reference, cfg: Config, root) -> None:
    """A GradScaler where the library cannot honour it: the documented error, then either nothing changed
    or the optimizer refuses to step until a checkpoint restores it (then it equals the reference again)."""
    run.opt.save_checkpoint(root / "before", model=run.model)
    run.backward(0, overflow=False, accumulate=False)
    with pytest.raises((StateError, RuntimeError)) as caught:
        run.step(set_to_none=True)
    if isinstance(caught.value, StateError):
        assert "GradScaler" in str(caught.value) or "changed between backward and step" in str(caught.value)
    else:  # torch's GradScaler read a gradient the parameter store holds
        assert "offload_grads" in str(caught.value)
    if not cfg.overlap:  # refused before anything changed
        assert_same_weights(run, ref, "after the refusal")
        assert_same_state(run, ref, "after the refusal")
        return
    # The update ran during backward, on the scaled grads: no step may follow until the state is restored.
    with pytest.raises(StateError):
        run.opt.step()
    run.opt.load_checkpoint(root / "before", model=run.model)
    run.opt.zero_grad()
    assert_same_weights(run, ref, "restored after the refusal")
    assert_same_state(run, ref, "restored after the refusal")


class Program:
    """Runs a program's operations on the library's side and torch's reference side by side, comparing them
    after each."""

    def __init__(self, run: Run, ref: Reference, root):
        self.run, self.ref, self.root = run, ref, root
        self.saved = None  # (how, what, the reference's snapshot) of the last save, while it can be loaded
        self.pending: list = []  # asynchronous saves not waited for yet
        self.seed = 0
        self.saves = 0

    def do(self, op, when: str) -> None:
        if isinstance(op, Iteration):
            self.iteration(op, when)
        elif isinstance(op, Save):
            self.save(op)
        elif isinstance(op, Restore):
            self.restore(when)
        elif isinstance(op, AddGroup):
            self.add_group()

    def iteration(self, op: Iteration, when: str) -> None:
        run, ref, cfg = self.run, self.ref, self.run.cfg
        run.model.used = ref.model.used = op.used
        for m in range(op.micro):
            self.seed += 1
            overflow = op.overflow and m == op.micro - 1 and cfg.scale is not None
            run.backward(self.seed, overflow, accumulate=m < op.micro - 1)
            ref.backward(self.seed, overflow)
        run.step(op.set_to_none)
        ref.step(op.set_to_none)
        assert_same_weights(run, ref, when)
        if cfg.clip and ref.norm is not None and not overflow:
            assert torch.equal(run.opt.last_grad_norm, ref.norm), f"{when}: grad norm"
        if run.scaler:
            assert run.scaler.get_scale() == ref.scaler.get_scale(), f"{when}: scale"
        if op.check_state:
            assert_same_state(run, ref, when)

    def save(self, op: Save) -> None:
        run, mine = self.run, self.run.model
        self.saves += 1
        snap = self.ref.snapshot()
        if op.how == "state_dict":
            with materialized(mine):
                weights = {k: v.clone() for k, v in mine.state_dict().items()}
            # A copy, as with torch: a state_dict holds the live tensors of state kept in memory.
            self.saved = (op.how, (copy.deepcopy(run.opt.state_dict()), weights), snap)
        else:
            where = self.root / f"ckpt-{self.saves}"
            handle = run.opt.save_checkpoint(where, model=mine, blocking=op.how == "checkpoint")
            if op.how == "async":
                self.pending.append(handle)
            self.saved = (op.how, where, snap)

    def restore(self, when: str) -> None:
        if self.saved is None:
            return
        run, ref, mine = self.run, self.ref, self.run.model
        how, what, snap = self.saved
        self.wait_saves()
        if how == "state_dict":
            run.opt.load_state_dict(copy.deepcopy(what[0]))
            mine.load_state_dict(what[1])
        else:
            run.opt.load_checkpoint(what, model=mine)
        ref.restore(snap)
        # Loading weights clears an offloaded model's grads (docs/params.md); drop them on both sides.
        run.opt.zero_grad()
        ref.opt.zero_grad()
        ref.model.zero_grad()
        if run.scaler:  # the scaler's state is the caller's to save; both continue from the saved one
            for scaler in (run.scaler, ref.scaler):
                scaler.load_state_dict(snap["scaler"])
        assert_same_weights(run, ref, when)
        assert_same_state(run, ref, when)

    def add_group(self) -> None:
        if self.run.model.extra_on:
            return
        self.run.add_group()
        self.ref.add_group()
        self.ref.narrow = narrow_masters(self.run, self.ref)
        self.saved = None  # a state saved before has a group less: torch refuses to load it too

    def wait_saves(self) -> None:
        while self.pending:
            self.pending.pop().wait()


@settings(settings.get_profile(PROFILE))
@given(cfg=configs(), program=programs)
def test_every_combination_trains_bit_for_bit_as_torch(nvme, tmp_path, cfg, program):
    """For any drawn configuration and program, the library's weights (and, where compared, its moments,
    masters and step counts) equal torch's Adam/AdamW on a plain copy bit for bit after every step, through
    accumulation, unused blocks, skipped (overflowed) steps, checkpoint and state_dict round trips and an added
    group; a combination refused by design raises its documented error and changes nothing it may not."""
    note(f"{cfg}")
    root = tmp_path / f"run-{len(os.listdir(tmp_path)) if tmp_path.exists() else 0}"
    root.mkdir(parents=True)
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, root, True)
        mine, theirs = twins(cfg)
        ref = Reference(theirs, cfg)
        run = Run(mine, cfg, nvme, stack)
        ref.narrow = narrow_masters(run, ref)
        if cfg.refused():
            refusal(run, ref, cfg, root)
            return
        driven = Program(run, ref, root)
        for n, op in enumerate(program):
            driven.do(op, f"op {n} ({op})")
        driven.wait_saves()
        assert_same_weights(run, ref, "at the end")
        assert_same_state(run, ref, "at the end")
    leftovers = [f for f in os.listdir(nvme) if f.endswith(".swap")] if os.path.exists(nvme) else []
    assert not leftovers, f"swap files left behind: {leftovers}"
