"""Resume after a kill: a run killed with SIGKILL resumes from its last checkpoint and ends bit for bit
where an uninterrupted run ends.

    python examples/resume_after_kill.py [DIR]    # DIR: where swap files and checkpoints go (default: a temp dir)

``train`` is the loop to copy: it keeps the last two checkpoints (Retention) and, on start, resumes
from the newest. This script runs it to the end once, then in a child process that it kills with
SIGKILL (no clean-up at all) after the child's second checkpoint, removes the swap files the killed
run left (``offload-swap clean``), and runs it again: it resumes and finishes.
"""

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import torch
from torch import nn

from offload import OffloadedAdamW, offload_parameters, restore_parameters
from offload.checkpoint import Retention
from offload.params import materialized

STEPS, EVERY = 8, 2


def train(root: str, log=print) -> str:
    """Train to STEPS, resuming from the newest checkpoint under ``root``; returns the weights' digest."""
    swap = os.path.join(root, "swap")
    os.makedirs(swap, exist_ok=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 1))
    offload_parameters(model, nvme_path=swap, max_in_cpu=0, buffer_count=3, buffer_size=1 << 16)
    opt = OffloadedAdamW(model.parameters(), lr=1e-3, nvme_path=swap, buffer_count=3, buffer_size="1MiB")
    keep = Retention(os.path.join(root, "ckpt"), keep_last=2)
    step = 0
    if keep.latest() is not None:
        step = opt.load_checkpoint(keep.latest(), model=model)["step"]
        log(f"resumed at step {step}", flush=True)
    while step < STEPS:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 64, generator=g), torch.randn(16, 1, generator=g)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        step += 1
        if step % EVERY == 0:
            keep.save(opt, step, model=model, extra={"step": step})
            log(f"saved step {step}", flush=True)
    with materialized(model):
        digest = hashlib.sha256(b"".join(p.detach().clone().numpy().tobytes() for p in model.parameters()))
    opt.close()
    restore_parameters(model)
    return digest.hexdigest()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--train"]:
        print(f"digest {train(sys.argv[2])}", flush=True)
        sys.exit(0)
    root = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="offload-example-")
    straight = train(os.path.join(root, "straight"), log=lambda *args, **kwargs: None)

    run = os.path.join(root, "killed")
    child = subprocess.Popen([sys.executable, __file__, "--train", run], stdout=subprocess.PIPE, text=True)
    for line in child.stdout:
        if line.strip() == f"saved step {2 * EVERY}":
            child.send_signal(signal.SIGKILL)
            break
    child.wait()
    print(f"killed the run after its checkpoint of step {2 * EVERY} (exit status {child.returncode})")
    # The killed run's swap files are still there; no live process holds them, so they are stale.
    subprocess.run([sys.executable, "-m", "offload.tools.swap_cli", "clean", os.path.join(run, "swap")], check=True)

    resumed = train(run, log=lambda text, **kwargs: print(text) if text.startswith("resumed") else None)
    same = child.returncode == -signal.SIGKILL and resumed == straight
    if len(sys.argv) == 1:
        shutil.rmtree(root)
    print(f"killed and resumed: {'bit for bit the same weights' if same else 'DIFFERENT weights'} as the "
          "uninterrupted run")
    sys.exit(0 if same else 1)
