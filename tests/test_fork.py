"""Fork safety: a child forked after an engine, a swap space or an optimizer was built refuses to use
them with a clear error and exits at once, while the parent keeps working and keeps its swap files.

Each test runs a script in a subprocess that builds the objects, forks, and waits for the child with a
deadline, so a regression shows up as "child hung" instead of hanging the test run.
"""

from __future__ import annotations

import os

from helpers import run_code, run_python

# Waits for the forked child with a deadline and prints how it ended; defines `wait_child(pid)`.
_WAIT_CHILD = """
import os, sys, time

def wait_child(pid, seconds=60):
    deadline = time.monotonic() + seconds
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            return "hung"
        time.sleep(0.01)
"""

_SPACE_SCRIPT = _WAIT_CHILD + """
import gc
from offload.aio import Engine
from offload.buffers import HostBuffer
from offload.config import AioConfig
from offload.space import SwapSpace

def trial(path, how, aio):
    engine = Engine(aio)
    space = SwapSpace(path, 1 << 20, aio=aio)
    buf, big = HostBuffer(65536), HostBuffer(8 << 20)
    ext, ext_big = space.alloc(65536), space.alloc(8 << 20)
    buf.numpy()[:] = 42
    space.write(ext, buf).wait()
    files = list(space.files)
    pending = space.write(ext_big, big)  # most likely still in flight at the fork
    parent = os.getpid()

    pid = os.fork()
    if pid == 0:
        results = []
        calls = {
            "space.read": lambda: space.read(ext, buf).wait(),
            "space.write": lambda: space.write(ext, buf),
            "space.alloc": lambda: space.alloc(4096),
            "space.stats": space.stats,
            "engine.stats": engine.stats,
            "pending.wait": pending.wait,
        }
        for name, call in calls.items():
            try:
                call()
                results.append(name + ":no-error")
            except RuntimeError as err:
                clear = f"created in process {parent} before a fork" in str(err) and "in the child" in str(err)
                results.append(name + (":clear" if clear else ":unclear"))
        with Engine(aio) as fresh, fresh.open(os.path.join(path, "child.bin"), "w+") as f:
            results.append("fresh:" + str(fresh.write(f, buf, 0)))
        os.unlink(os.path.join(path, "child.bin"))
        print(how, *results, flush=True)
        if how == "close":
            space.close()
            engine.close()
            space.close()
        elif how == "gc":
            del space, engine, pending
            gc.collect()
        sys.exit(0)  # "exit": everything is left to interpreter exit

    print(how, "child-exit", wait_child(pid))
    print(how, "files-intact", all(os.path.isfile(f) for f in files))
    pending.wait()
    buf.numpy()[:] = 0
    space.read(ext, buf).wait()
    print(how, "parent-data", bool((buf.numpy() == 42).all()), engine.stats()["workers"] > 0)
    space.close()
    engine.close()
    print(how, "removed", not any(os.path.exists(f) for f in files), os.listdir(path), flush=True)

for backend in sys.argv[2:]:
    print("backend", backend, flush=True)
    for how in ("close", "gc", "exit"):
        trial(sys.argv[1], how, AioConfig(block_size=65536, queue_depth=1, backend=backend))
"""


def test_child_refuses_a_parent_swap_space_and_exits_at_once(nvme, backends):
    """In a child forked while a swap space and an engine (with a write in flight) exist, every use
    raises RuntimeError naming the parent process, a new engine works, and closing them explicitly,
    by garbage collection or at interpreter exit returns at once; the parent's files stay intact and
    usable, and the parent removes them on close. Each backend that runs here in turn, in one process."""
    done = run_code(_SPACE_SCRIPT, nvme, *backends, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    uses = ("space.read", "space.write", "space.alloc", "space.stats", "engine.stats", "pending.wait")
    expected = []
    for backend in backends:
        expected.append(f"backend {backend}")
        for how in ("close", "gc", "exit"):
            expected += [" ".join([how, *(f"{u}:clear" for u in uses), "fresh:65536"]), f"{how} child-exit 0",
                         f"{how} files-intact True", f"{how} parent-data True True", f"{how} removed True []"]
    assert done.stdout.splitlines() == expected, done.stdout + done.stderr


_OPTIMIZER_SCRIPT = _WAIT_CHILD + """
import torch
import offload

path = sys.argv[1]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
opt = offload.OffloadedAdamW(model.parameters(), nvme_path=path, lr=1e-2, buffer_size=256 * 1024,
                             buffer_count=3, small_param_threshold=64)

def step():
    loss = model(torch.randn(16, 64)).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()

step()
files = sorted(os.listdir(path))
parent = os.getpid()
pid = os.fork()
if pid == 0:
    # torch's own CPU thread pool does not survive a fork either; DataLoader workers do the same.
    torch.set_num_threads(1)
    try:
        step()
        print("child-step no-error", flush=True)
    except RuntimeError as err:
        print("child-step", f"created in process {parent} before a fork" in str(err), flush=True)
    sys.exit(0)  # the optimizer is left to interpreter exit

print("child-exit", wait_child(pid))
print("files-intact", sorted(os.listdir(path)) == files and len(files) > 0)
before = [p.detach().clone() for p in model.parameters()]
step()
print("parent-steps", any(not torch.equal(a, b) for a, b in zip(before, model.parameters())))
del opt
import gc
gc.collect()
print("removed", os.listdir(path))
"""


def test_child_of_a_process_with_an_offloaded_optimizer_refuses_to_step_and_exits(nvme):
    """A child forked after OffloadedAdamW was built (and stepped) gets the clear RuntimeError from
    step() and exits with status 0; the parent's swap files are intact and it goes on stepping."""
    done = run_code(_OPTIMIZER_SCRIPT, nvme, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines() == [
        "child-step True", "child-exit 0", "files-intact True", "parent-steps True", "removed []"], \
        done.stdout + done.stderr
    assert os.listdir(nvme) == []


_CHILD_MAKES_ITS_OWN = """
import multiprocessing as mp, os, sys
import torch
from offload import OffloadedAdamW, offload_parameters

def child(path):
    torch.set_num_threads(1)  # torch's CPU thread pool does not survive a fork (as for DataLoader workers)
    model = torch.nn.Linear(64, 64)
    offload_parameters(model, os.path.join(path, "weights"), max_in_cpu=0, buffer_count=2, buffer_size=4096)
    opt = OffloadedAdamW(model.parameters(), nvme_path=os.path.join(path, "state"), buffer_size=1 << 16)
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    print("child made", sorted(os.listdir(os.path.join(path, "state"))) != [], flush=True)

if __name__ == "__main__":
    path = sys.argv[1]
    os.makedirs(path)
    for sub in ("weights", "state"):
        os.makedirs(os.path.join(path, sub))
    mine = OffloadedAdamW([torch.nn.Parameter(torch.zeros(100_000))], nvme_path=os.path.join(path, "state"))
    ours = sorted(os.listdir(os.path.join(path, "state")))
    for method in sys.argv[2:]:
        p = mp.get_context(method).Process(target=child, args=(path,))
        p.start()
        p.join(60)
        left = sorted(os.listdir(os.path.join(path, "state"))) + sorted(os.listdir(os.path.join(path, "weights")))
        print(method, p.exitcode, left == ours, flush=True)
    mine.close()
    print("parent removed", os.listdir(os.path.join(path, "state")) == [], flush=True)
"""


def test_a_child_that_builds_its_own_optimizer_removes_its_swap_files_when_it_returns(tmp_path):
    """A multiprocessing child (fork and forkserver children end with os._exit, skipping atexit) that builds its
    own offloaded model and optimizer and returns leaves no swap file behind, and the parent's stay until it
    closes them."""
    import multiprocessing

    methods = [m for m in ("fork", "forkserver", "spawn") if m in multiprocessing.get_all_start_methods()]
    script = tmp_path / "child_makes_its_own.py"
    script.write_text(_CHILD_MAKES_ITS_OWN)
    done = run_python(str(script), str(tmp_path / "swap"), *methods, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert [line for line in lines if not line.startswith("child made")] == \
        [f"{m} 0 True" for m in methods] + ["parent removed True"], done.stdout + done.stderr
    assert lines.count("child made True") == len(methods), done.stdout
