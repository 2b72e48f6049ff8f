"""Shared fixtures: the engine backends, a scratch directory on a disk that takes O_DIRECT, a swap
directory checked for leftovers (``nvme``), ``closing`` for what a test opens, and small mounts.

A backend the kernel (or the build) refuses is skipped, not failed: io_uring may be disabled by
sysctl ``kernel.io_uring_disabled``, refused by seccomp (ENOSYS/EPERM), or not compiled in.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import subprocess

import pytest
import torch

# Two test workers (make test) share the cores: one torch thread each, in them and in what they start, instead of
# two each spinning against the other's.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)

from offload import copies, restore_parameters
from offload._native import HAVE_IO_URING
from offload.aio import Engine
from offload.params import offloaded


@pytest.fixture(autouse=True)
def _ctrl_c_as_python_starts():
    """Every test starts with SIGINT raising KeyboardInterrupt, as in a fresh interpreter, whatever handler the
    process running it (a test worker) or an earlier test left; the handler found is put back after."""
    before = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before if before is not None else signal.default_int_handler)


def _io_uring_refusal() -> str | None:
    """Why the io_uring backend cannot run here, or None if it can."""
    if not HAVE_IO_URING:
        return "built without liburing"
    try:
        Engine(backend="io_uring").close()
    except OSError as err:
        if err.errno in (errno.ENOSYS, errno.EPERM, errno.EACCES):
            return f"the kernel refuses io_uring: {err}"
        raise
    return None


IO_URING_REFUSAL = _io_uring_refusal()
BACKENDS = ["threads"] + ([] if IO_URING_REFUSAL else ["io_uring"])


@pytest.fixture
def backends() -> list[str]:
    """The backends that run on this machine ("threads" always)."""
    return list(BACKENDS)


@pytest.fixture(params=["io_uring", "threads"])
def backend(request) -> str:
    """Each backend in turn; io_uring is skipped where it cannot run."""
    if request.param == "io_uring" and IO_URING_REFUSAL:
        pytest.skip(IO_URING_REFUSAL)
    return request.param


@pytest.fixture
def scratch(tmp_path):
    """A directory on a real disk (O_DIRECT works there), removed after the test."""
    probe = tmp_path / ".odirect"
    try:
        os.close(os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600))
    except OSError as err:
        pytest.skip(f"{tmp_path} refuses O_DIRECT ({err}); point --basetemp at a real disk")
    probe.unlink()
    yield str(tmp_path)
    # The engine tests write hundreds of MiB; do not leave them for pytest's retention to hold.
    shutil.rmtree(tmp_path, ignore_errors=True)


# The longest test files (about 15 to 60 s each on the 2-core development machine), longest first. Under make test
# (--dist loadfile) each file runs whole in one of the workers, which take the files in collection order; with
# these first, the short files fill in at the end and the two workers end together, instead of one of them
# running a long file alone after the other has finished. Any file may be missing or misplaced here: it only
# runs later or earlier.
LONGEST_FIRST = ("test_examples.py", "test_docs.py", "test_bench_cli.py", "test_lint.py",
                 "test_distributed_checkpoint.py",
                 "test_integrations.py", "test_pretrained_saves.py", "test_tiers.py", "test_distributed.py",
                 "test_fork.py", "test_power_loss.py", "test_space.py", "test_overlap.py", "test_interrupts.py",
                 "test_mirror.py", "test_engine.py", "test_plan.py", "test_faults.py", "test_combinations.py",
                 "test_async_checkpoint.py", "test_params_tools.py")


def pytest_configure(config):
    # pytest-xdist would order the files by their number of tests; LONGEST_FIRST orders them by time.
    if getattr(config.option, "loadscopereorder", None) is not None:
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    first = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: a file's tests keep their order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # the marker, not a test id that reads "gpu"
            item.add_marker(skip)


@pytest.fixture
def nvme(tmp_path):
    """A swap directory (created by what uses it) that must hold no swap file once the test is done."""
    path = tmp_path / "nvme"
    yield str(path)
    leftovers = [f for f in os.listdir(path) if f.endswith(".swap")] if path.exists() else []
    assert not leftovers, f"swap files left behind: {leftovers}"


@pytest.fixture
def closing(nvme):
    """``closing(thing)`` returns ``thing`` and closes it when the test ends, passed or failed: an
    optimizer (anything with ``close()``) is closed, a model given to offload_parameters is restored
    unless the test restored it. It runs before ``nvme`` looks for swap files left behind, so a failed
    test reports its failure, not a second error about the files it could not remove."""

    def close(thing) -> None:
        if isinstance(thing, torch.nn.Module):
            if offloaded(thing) is not None:
                restore_parameters(thing)
        else:
            thing.close()

    with contextlib.ExitStack() as stack:

        def track(thing):
            stack.callback(close, thing)
            return thing

        yield track


@pytest.fixture
def copy_emulator():
    """The emulator of asynchronous host-device copies (``offload.copies.emulated``) installed for the test:
    CPU tensors take the GPU code paths, each copy performed late on a thread; an ordering rule broken during
    the test fails it at its end."""
    with copies.emulated(delay=0.002) as emu:
        yield emu
        emu.check()


@pytest.fixture
def tmpfs(tmp_path):
    """``mount(size, kind="tmpfs")``: a fresh tmpfs of ``size`` (e.g. "1m": a small disk that fills) or
    a ramfs (``kind="ramfs"``: no O_DIRECT), unmounted after. Skips where mounting is refused."""
    mounts = []

    def mount(size: str = "1m", kind: str = "tmpfs"):
        if os.geteuid() != 0:
            pytest.skip(f"mounting a small {kind} needs root")
        where = tmp_path / f"{kind}{len(mounts)}"
        where.mkdir()
        options = ["-o", f"size={size}"] if kind == "tmpfs" else []
        try:
            r = subprocess.run(["mount", "-t", kind, *options, kind, str(where)], capture_output=True, text=True,
                               timeout=30)
        except FileNotFoundError:
            pytest.skip(f"no mount command to make a {kind} with")
        if r.returncode != 0:
            pytest.skip(f"cannot mount a {kind}: {r.stderr.strip()}")
        mounts.append(where)
        return where

    yield mount
    for where in mounts:
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)
