"""Lightning with weights and Adam state on NVMe; ModelCheckpoint and ckpt_path= stream through the pools.

    python examples/lightning_fit.py [DIR]   # DIR: where swap files and checkpoints go (default: a temp dir)

OffloadCheckpoint puts an OffloadedAdam's state and the offloaded weights in a directory beside each
.ckpt (epoch=1-step=2.ckpt.offload); the .ckpt keeps the rest.
"""

import os
import shutil
import sys
import tempfile

import lightning
import torch
from torch import nn

from offload import OffloadedAdamW, offload_parameters, restore_parameters
from offload.integrations.lightning import OffloadCheckpoint
from offload.params import materialized

root = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="offload-example-")
swap = os.path.join(root, "swap")
os.makedirs(swap, exist_ok=True)


class Regression(lightning.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 1))
        offload_parameters(self.net, nvme_path=swap, max_in_cpu=0, buffer_count=3, buffer_size=1 << 16)

    def training_step(self, batch, index):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        self.opt = OffloadedAdamW(self.parameters(), lr=1e-3, nvme_path=swap, buffer_count=3, buffer_size="1MiB")
        return self.opt


def fit(output_dir, resume=None):
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 64, generator=g), torch.randn(32, 1, generator=g))
    module = Regression()
    trainer = lightning.Trainer(max_epochs=3, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                                enable_model_summary=False,
                                callbacks=[lightning.pytorch.callbacks.ModelCheckpoint(dirpath=output_dir,
                                                                                       save_top_k=-1),
                                           OffloadCheckpoint()])
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=16), ckpt_path=resume)
    with materialized(module.net):
        weights = [p.detach().clone() for p in module.net.parameters()]
    module.opt.close()
    restore_parameters(module.net)
    return weights


out = os.path.join(root, "out")
straight = fit(out)
print("checkpoints:", sorted(os.listdir(out)))
resumed = fit(os.path.join(root, "resumed"), resume=os.path.join(out, "epoch=0-step=2.ckpt"))
same = all(torch.equal(a, b) for a, b in zip(straight, resumed))
if len(sys.argv) == 1:
    shutil.rmtree(root)
print(f"resumed from epoch=0-step=2.ckpt: {'bit for bit the same weights' if same else 'DIFFERENT weights'}")
sys.exit(0 if same else 1)
