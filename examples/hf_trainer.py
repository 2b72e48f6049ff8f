"""Hugging Face Trainer with weights, gradients and Adam state on NVMe; save_steps and resume_from_checkpoint.

    python examples/hf_trainer.py [DIR]      # DIR: where swap files and checkpoints go (default: a temp dir)

OffloadTrainer is Trainer plus two things: checkpoints stream through the pools (checkpoint-N/offload
holds the optimizer's state and the offloaded weights), and the gradient norm Trainer clips and logs
is computed from the gradients on NVMe.
"""

import os
import shutil
import sys
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

from offload import OffloadedAdamW, offload_parameters, restore_parameters
from offload.integrations.transformers import OffloadTrainer
from offload.params import materialized

root = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="offload-example-")
swap, out = os.path.join(root, "swap"), os.path.join(root, "out")
os.makedirs(swap, exist_ok=True)


class Tokens(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.randint(0, 128, (32, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def fit(output_dir, resume=None):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    offload_parameters(model, nvme_path=swap, max_in_cpu=0, buffer_count=3, buffer_size=1 << 16)
    opt = OffloadedAdamW(model.parameters(), lr=1e-3, nvme_path=swap, buffer_count=3, buffer_size="1MiB")
    args = TrainingArguments(output_dir=output_dir, max_steps=4, save_steps=2, per_device_train_batch_size=4,
                             max_grad_norm=1.0, logging_steps=1, report_to=[], use_cpu=True, disable_tqdm=True)
    trainer = OffloadTrainer(model=model, args=args, train_dataset=Tokens(), optimizers=(opt, None))
    trainer.train(resume_from_checkpoint=resume)
    with materialized(model):
        weights = [p.detach().clone() for p in model.parameters()]
    opt.close()
    restore_parameters(model)
    return weights


straight = fit(out)
print("checkpoint-2 holds", sorted(os.listdir(os.path.join(out, "checkpoint-2"))))
resumed = fit(os.path.join(root, "resumed"), resume=os.path.join(out, "checkpoint-2"))
same = all(torch.equal(a, b) for a, b in zip(straight, resumed))
if len(sys.argv) == 1:
    shutil.rmtree(root)
print(f"resumed from checkpoint-2: {'bit for bit the same weights' if same else 'DIFFERENT weights'}")
sys.exit(0 if same else 1)
