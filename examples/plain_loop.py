"""A plain PyTorch loop with weights, gradients and Adam state on NVMe; save, resume, and the counters.

    python examples/plain_loop.py [DIR]      # DIR: where swap files and checkpoints go (default: a temp dir)
"""

import os
import shutil
import sys
import tempfile

import torch
from torch import nn

from offload import OffloadedAdamW, offload_parameters, restore_parameters
from offload.params import clip_grad_norm_, materialized, offloaded
from offload.sizes import format_size

root = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="offload-example-")
swap, ckpt = os.path.join(root, "swap"), os.path.join(root, "ckpt", "step-3")
os.makedirs(swap, exist_ok=True)


def build():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256), nn.GELU(), nn.Linear(256, 1))
    # Every weight and gradient on NVMe (max_in_cpu=0), moving through 3 buffers of 256 Ki elements;
    # the optimizer's state through 3 buffers of 1 MiB. Real models: larger buffers (the defaults).
    offload_parameters(model, nvme_path=swap, max_in_cpu=0, max_grad_in_cpu=0, buffer_count=3, buffer_size=1 << 18)
    opt = OffloadedAdamW(model.parameters(), lr=1e-3, nvme_path=swap, buffer_count=3, buffer_size="1MiB")
    return model, opt


def train(model, opt, steps):
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(32, 256, generator=g), torch.randn(32, 1, generator=g)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        clip_grad_norm_(model, 1.0)  # offload.params', not torch's: the grads are on NVMe
        opt.step()
        opt.zero_grad()
    return loss.item()


def weights(model):
    with materialized(model):
        return [p.detach().clone() for p in model.parameters()]


model, opt = build()
train(model, opt, range(0, 3))
opt.save_checkpoint(ckpt, model=model, extra={"step": 3})  # streams; memory stays the pools
loss = train(model, opt, range(3, 6))
straight = weights(model)
read, written = opt.io_bytes()
store = offloaded(model).store
print(f"loss {loss:.4f}; optimizer pool {format_size(opt.host_pool_bytes)}, state on NVMe "
      f"{format_size(opt.offloaded_state_bytes)}, moved {format_size(read)} read / {format_size(written)} written; "
      f"parameter pool {format_size(store.pool.nbytes)}, weights read {format_size(store.bytes_read)}")
opt.close()
restore_parameters(model)

model, opt = build()  # a new process would do the same
step = opt.load_checkpoint(ckpt, model=model)["step"]
train(model, opt, range(step, 6))
same = all(torch.equal(a, b) for a, b in zip(straight, weights(model)))
opt.close()
restore_parameters(model)
if len(sys.argv) == 1:
    shutil.rmtree(root)
print(f"resumed from step {step}: {'bit for bit the same weights' if same else 'DIFFERENT weights'}")
sys.exit(0 if same else 1)
