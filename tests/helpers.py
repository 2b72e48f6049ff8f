"""Assertions, models and small utilities shared by the test modules (which never import each other)."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from offload.params import materialized

# The checkout under test: subprocesses import offload from here, whatever else is installed.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def snapshot(params):
    """Copies of the parameters' values."""
    return [p.detach().clone() for p in params]


def restore(params, values):
    """Put values taken by :func:`snapshot` back into the parameters."""
    with torch.no_grad():
        for p, v in zip(params, values):
            p.copy_(v)


def assert_same(a, b):
    """Two sequences of tensors are equal bit for bit."""
    for i, (p, q) in enumerate(zip(a, b, strict=True)):
        assert torch.equal(p, q), f"parameter {i} differs (max abs diff {(p - q).abs().max().item()})"


def assert_same_state(a: dict, b: dict):
    """Two optimizer state_dicts hold the same state and hyperparameters, bit for bit."""
    assert sorted(a["state"]) == sorted(b["state"])
    for i in a["state"]:
        assert sorted(a["state"][i]) == sorted(b["state"][i]), f"parameter {i}: different state keys"
        for k, v in a["state"][i].items():
            w = b["state"][i][k]
            assert torch.equal(torch.as_tensor(v).cpu().float(), torch.as_tensor(w).cpu().float()), \
                f"parameter {i}: state {k!r} differs"
    for ga, gb in zip(a["param_groups"], b["param_groups"], strict=True):
        assert {k: v for k, v in ga.items() if k != "params"} == {k: v for k, v in gb.items() if k != "params"}


def assert_same_weights(a, b):
    """Two models' parameters (offloaded ones fetched for the comparison) are equal bit for bit."""
    with materialized(a), materialized(b):
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            assert torch.equal(p, q), f"{name} differs"


def first_os_error(*calls) -> OSError:
    """The OSError that the first of ``calls`` to fail raises. A write a step leaves landing fails that
    step or, when it lands after the step returned, the next call: tests of write errors accept both."""
    for call in calls:
        try:
            call()
        except OSError as err:
            return err
    raise AssertionError("no call failed")


def flip_bit(path, offset: int, mask: int = 0x01) -> None:
    """Corrupt one byte of a file in place: XOR the byte at ``offset`` with ``mask``."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


# -- subprocesses ---------------------------------------------------------------------------------


def python_env(path: str = REPO, **extra: str) -> dict:
    """``os.environ`` with ``path`` first on PYTHONPATH (and ``extra`` variables set)."""
    rest = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": path + (os.pathsep + rest if rest else ""), **extra}


def run_python(*args: str, pythonpath: str = REPO, env: dict | None = None, timeout: float = 120,
               **kw) -> subprocess.CompletedProcess:
    """``python ARGS...`` with this checkout importable; output captured as text."""
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                          env=python_env(pythonpath, **(env or {})), **kw)


def run_code(code: str, *argv: str, **kw) -> subprocess.CompletedProcess:
    """``python -c CODE ARGV...`` (code dedented), as :func:`run_python`."""
    return run_python("-c", textwrap.dedent(code), *argv, **kw)


# ``python -c HOLD DIR``: takes checkpoint directory DIR's lock exclusively (as a save holds it), prints
# "locked", and holds it until a line arrives on stdin (or the process is killed).
HOLD = """
import fcntl, os, sys
fd = os.open(os.path.join(sys.argv[1], ".nvme-offload.lock"), os.O_RDONLY | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
sys.stdin.readline()
"""


# -- parameters for the optimizer tests ------------------------------------------------------------

# Small buffers (256 KiB) and a low small-parameter threshold: with them even these small tensors are
# split across several units and pool buffers, and the 10-element one keeps its state in memory.
SMALL = dict(buffer_size=256 * 1024, buffer_count=3, small_param_threshold=64)
# 70_000 and 300_001 hold more than one buffer's worth of state (8 bytes a weight): split across units.
SIZES = (10, 100, 5000, 70_000, 300_001)
FOUR_SIZES = (10, 5000, 70_000, 300_001)  # SIZES without 100
THREE_SIZES = (10, 5000, 70_000)  # SIZES without 100 and 300_001


def make_params(sizes=SIZES, dtype=torch.float32, seed=0):
    """One random parameter per size (the same values for the same seed)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=g).to(dtype)) for n in sizes]


def train(opt, params, steps, skip=()):
    """One step per seed in ``steps``, every parameter given a random grad drawn from that seed (the
    parameters at the indices in ``skip`` none)."""
    for s in steps:
        g = torch.Generator().manual_seed(s)
        for i, p in enumerate(params):
            grad = torch.randn(p.shape, generator=g).to(p.dtype)
            p.grad = None if i in skip else grad
        opt.step()


# -- a small model for the offloaded-parameter tests ----------------------------------------------

# Weights and gradients all on disk (no host cache), in a pool of 3 buffers of 2048 elements.
TINY = dict(max_in_cpu=0, max_grad_in_cpu=0, buffer_count=3, buffer_size=2048)
OPT = dict(lr=1e-2, buffer_size=256 * 1024, buffer_count=3, small_param_threshold=64)


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(x + self.down(torch.relu(self.up(x))))


class Net(nn.Module):
    """Blocks plus a head with an 8-element bias (below the optimizer's small-parameter threshold)."""

    def __init__(self, d=32, h=128, layers=4, ckpt=False):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, h) for _ in range(layers))
        self.head = nn.Linear(d, 8)
        self.register_buffer("scale", torch.full((8,), 0.5))
        self.ckpt = ckpt
        self.order = None

    def forward(self, x):
        order = self.order or range(len(self.blocks))
        for i in order:
            b = self.blocks[i]
            x = checkpoint(b, x, use_reentrant=False) if self.ckpt else b(x)
        return self.head(x) * self.scale


def batch(step, dtype=torch.float32):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(16, 32, generator=g).to(dtype), torch.randn(16, 8, generator=g).to(dtype)


def loss_of(model, step, dtype=torch.float32):
    x, y = batch(step, dtype)
    return (model(x) - y).float().square().mean()


def sigkill_then_resume_equals_uninterrupted(tmp_path, options: dict, *, kill_step: int = 3,
                                             kill_units: int = 2) -> None:
    """Run tests/killed_run.py with ``options`` three times: killed in ``kill_step`` after ``kill_units`` units
    began to change (in a process of its own, SIGKILLed), then resumed from its last checkpoint and never killed
    (both in this process: a Python process started costs seconds, torch's import); the resumed and the
    uninterrupted runs must end with the same weights and optimizer state, bit for bit."""
    import killed_run

    script = os.path.join(REPO, "tests", "killed_run.py")
    killed = run_python(script, str(tmp_path / "run"), str(tmp_path / "nvme-1"), str(kill_step), str(kill_units),
                        str(tmp_path / "killed.pt"), json.dumps(options))
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not (tmp_path / "killed.pt").exists()
    with torch.random.fork_rng(devices=[]):  # the runs seed torch's generator: the caller's stays as it was
        killed_run.run(str(tmp_path / "run"), str(tmp_path / "nvme-2"), -1, kill_units, str(tmp_path / "resumed.pt"),
                       options)
        killed_run.run(str(tmp_path / "ref"), str(tmp_path / "nvme-3"), -1, kill_units, str(tmp_path / "ref.pt"),
                       options)
    a, b = torch.load(tmp_path / "resumed.pt"), torch.load(tmp_path / "ref.pt")
    for k in b["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert_same_state(a["opt"], b["opt"])


def ckpt_file(directory, name: str) -> str:
    """The path of the file ``name`` of the format (``state.bin``, ``memory.pt``, ...) in checkpoint
    ``directory``: saves write it under their generation's name, which the manifest records."""
    import json

    if name == "manifest.json":
        return os.path.join(directory, name)
    with open(os.path.join(directory, "manifest.json")) as f:
        entry = json.load(f)["files"][name]
    return os.path.join(directory, entry.get("file", name))


def rewrite_in_pieces(directory, piece: int) -> None:
    """Rewrite checkpoint ``directory``'s manifest as a clone save that took the store's checksums writes it:
    every unit's checksum in the engine's form (``piece``-byte pieces of its padded bytes), state.bin without
    one of its own, format version 2, and the manifest's own checksum made valid again."""
    import json

    from offload.aio import PieceDigest
    from offload.checkpoint.manifest import digest

    with open(ckpt_file(directory, "state.bin"), "rb") as f:
        data = f.read()
    path = os.path.join(directory, "manifest.json")
    with open(path) as f:
        manifest = json.load(f)
    for u in manifest["units"]:
        d = PieceDigest(piece)
        d.update(data[u["offset"]:u["offset"] + u["length"]])
        u.update(pieces=piece, xxh3_64=d.hexdigest())
    manifest["files"]["state.bin"]["xxh3_64"] = None
    manifest["version"] = 2
    manifest["manifest_xxh3_64"] = digest(manifest)
    with open(path, "w") as f:
        json.dump(manifest, f)


def proc_status(key: str) -> int:
    """A byte count of this process from /proc/self/status (``VmRSS``, ``VmHWM``, ...)."""
    from offload._proc import status_bytes

    return status_bytes(key)


def reset_peak_rss() -> int:
    """Start a peak-RSS window: free what can be freed, reset VmHWM to the current RSS, return that RSS.
    Skips the test where the kernel or libc cannot do it."""
    import ctypes
    import gc

    import pytest

    from offload._proc import reset_peak_rss

    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
        reset_peak_rss()
    except (AttributeError, OSError) as err:
        pytest.skip(f"cannot reset the peak RSS here: {err}")
    return proc_status("VmRSS")


def saved_checkpoint(root, name: str = "c"):
    """``root/name``: a checkpoint of an OffloadedAdamW (SMALL settings, SIZES, two steps) with state on disk and
    in memory, and a Linear(8, 4) model's weights in model.pt."""
    from offload import OffloadedAdamW
    from offload import checkpoint as ckpt

    root = pathlib.Path(root)
    params = make_params()
    model = torch.nn.Linear(8, 4)
    opt = OffloadedAdamW(params, lr=1e-2, nvme_path=root / f"nvme-{name}", **SMALL)
    try:
        train(opt, params, range(2))
        ckpt.save_checkpoint(opt, root / name, model=model)
    finally:
        opt.close()
    return root / name


def locks_held(path) -> list[str]:
    """The lines of /proc/locks for locks this process holds on ``path``'s file system (a failed save must let
    its directory's lock go, or the next reader of it waits for ever)."""
    dev = os.stat(path).st_dev
    where = f" {os.getpid()} {os.major(dev):02x}:{os.minor(dev):02x}:"
    with open("/proc/locks") as f:
        return [line.strip() for line in f if where in line]


# -- a process that dies between two changes of names ---------------------------------------------------


class Died(BaseException):
    """The process died here (raised where the simulated death happens)."""


@contextlib.contextmanager
def dies_at(k: int, counter: list):
    """The process dies at its ``k``-th change of a name (rename, replace, link, unlink, mkdir, rmdir; k from 1):
    that call and every later one change nothing, as after a SIGKILL, and Died unwinds the stack. ``counter``
    gets the number of changes made (all of them where k is never reached)."""
    names = ("rename", "replace", "link", "unlink", "mkdir", "rmdir")
    real = {n: getattr(os, n) for n in names}
    dead = [False]

    def wrap(name):
        def call(*args, **kwargs):
            if dead[0]:
                return None
            counter[0] += 1
            if counter[0] == k:
                dead[0] = True
                raise Died(f"died at change {k}: os.{name}{args}")
            return real[name](*args, **kwargs)
        return call

    for n in names:
        setattr(os, n, wrap(n))
    try:
        yield
    finally:
        for n in names:
            setattr(os, n, real[n])


@contextlib.contextmanager
def interrupted_after(k: int, counter: list, exc: type = KeyboardInterrupt):
    """``exc`` (a Ctrl-C) raised right after the ``k``-th change of a name (rename, replace, link, unlink, mkdir,
    rmdir; k from 1), that change made: unlike :func:`dies_at` the process lives on, and every later change is
    made (the unwinding code's own). ``counter`` gets the number of changes made."""
    names = ("rename", "replace", "link", "unlink", "mkdir", "rmdir")
    real = {n: getattr(os, n) for n in names}

    def wrap(name):
        def call(*args, **kwargs):
            result = real[name](*args, **kwargs)
            counter[0] += 1
            if counter[0] == k:
                raise exc(f"interrupted after change {k}: os.{name}{args}")
            return result
        return call

    for n in names:
        setattr(os, n, wrap(n))
    try:
        yield
    finally:
        for n in names:
            setattr(os, n, real[n])
