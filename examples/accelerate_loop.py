"""accelerate with weights, gradients and Adam state on NVMe; save_state and load_state stream.

    python examples/accelerate_loop.py [DIR]   # DIR: where swap files and checkpoints go (default: a temp dir)

register() makes save_state/load_state put the optimizer's state and the offloaded weights in
<dir>/offload, through the pools. The offloaded model stays out of accelerator.prepare (accelerate
would gather its state_dict, every weight, at each save_state); it is passed to register instead.
"""

import os
import shutil
import sys
import tempfile

import torch
from accelerate import Accelerator
from torch import nn

from offload import OffloadedAdamW, offload_parameters, restore_parameters
from offload.integrations.accelerate import register
from offload.params import clip_grad_norm_, materialized

root = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="offload-example-")
swap, ckpt = os.path.join(root, "swap"), os.path.join(root, "ckpt")
os.makedirs(swap, exist_ok=True)
g = torch.Generator().manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(64, 64, generator=g), torch.randn(64, 1, generator=g))


def build():
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 1))
    offload_parameters(model, nvme_path=swap, max_in_cpu=0, buffer_count=3, buffer_size=1 << 16)
    opt = OffloadedAdamW(model.parameters(), lr=1e-3, nvme_path=swap, buffer_count=3, buffer_size="1MiB")
    sched = torch.optim.lr_scheduler.LinearLR(opt, 1.0, 0.1, total_iters=8)
    opt, sched, loader = accelerator.prepare(opt, sched, torch.utils.data.DataLoader(data, batch_size=16))
    register(accelerator, opt, model=model)
    return accelerator, model, opt, sched, loader


def train_epoch(accelerator, model, opt, sched, loader):
    for x, y in loader:
        accelerator.backward(nn.functional.mse_loss(model(x), y))
        clip_grad_norm_(model, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()


def weights(model, opt):
    with materialized(model):
        out = [p.detach().clone() for p in model.parameters()]
    opt.optimizer.close()
    restore_parameters(model)
    return out


accelerator, model, opt, sched, loader = build()
train_epoch(accelerator, model, opt, sched, loader)
accelerator.save_state(ckpt)
print("save_state wrote", sorted(os.listdir(ckpt)))
train_epoch(accelerator, model, opt, sched, loader)
straight = weights(model, opt)

accelerator, model, opt, sched, loader = build()
accelerator.load_state(ckpt)
train_epoch(accelerator, model, opt, sched, loader)
same = all(torch.equal(a, b) for a, b in zip(straight, weights(model, opt)))
if len(sys.argv) == 1:
    shutil.rmtree(root)
print(f"resumed after load_state: {'bit for bit the same weights' if same else 'DIFFERENT weights'}")
sys.exit(0 if same else 1)
