"""A training run for the SIGKILL tests, with a checkpoint after every step.

Usage: killed_run.py ROOT NVME KILL_STEP KILL_UNITS OUT OPTIONS_JSON. The run resumes from ROOT's latest
checkpoint, and kills itself (SIGKILL) in step KILL_STEP once KILL_UNITS units of state have started to
change (during backward with overlap_backward), or runs to the end and saves its weights and state to OUT.
OPTIONS_JSON: optimizer keyword arguments, plus "offload_parameters": true to keep the weights on NVMe.

The run that is killed needs a process of its own; the runs that end (resumed, uninterrupted) may call
:func:`run` in the test's process, with KILL_STEP -1.
"""

import json
import os
import signal
import sys

import torch

from offload import OffloadedAdamW, offload_parameters, restore_parameters
from offload.checkpoint import Retention

STEPS = 6


def run(root: str, nvme: str, kill_step: int, kill_units: int, out: str, options: dict) -> None:
    """One run, as the command line describes (``options`` is not changed)."""
    options = dict(options)
    weights_offloaded = options.pop("offload_parameters", False)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.Tanh(),
                                                      torch.nn.Linear(128, 32)) for _ in range(4)))
    if weights_offloaded:
        offload_parameters(model, nvme_path=nvme + "-p", max_in_cpu=0, max_grad_in_cpu=0, buffer_count=3,
                           buffer_size=2048)
    opt = OffloadedAdamW(model.parameters(), lr=1e-2, nvme_path=nvme, buffer_size=64 * 1024, buffer_count=3,
                         small_param_threshold=64, **options)
    keep = Retention(root, keep_last=2)
    start = 0
    if keep.latest() is not None:
        start = opt.load_checkpoint(keep.latest(), model=model)["step"]
    now = {"step": -1, "changed": 0}

    def guard(unit, buf) -> None:
        if now["step"] == kill_step:
            now["changed"] += 1
            if now["changed"] >= kill_units:
                os.kill(os.getpid(), signal.SIGKILL)

    opt.state_store.add_change_guard(guard)
    for step in range(start, STEPS):
        now["step"] = step
        g = torch.Generator().manual_seed(step)
        x = torch.randn(8, 32, generator=g)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        keep.save(opt, step + 1, model=model, extra={"step": step + 1})
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, out)
    opt.close()
    if weights_offloaded:
        restore_parameters(model)


def main() -> None:
    root, nvme, kill_step, kill_units, out, options = sys.argv[1:7]
    run(root, nvme, int(kill_step), int(kill_units), out, json.loads(options))


if __name__ == "__main__":
    main()
