"""``python -m offload.tools.demo``: train a small transformer with OffloadedAdamW next to torch's AdamW.

It shows the library's promise on any machine in under a minute: the optimizer state goes to the
swap files under ``--path`` (removed afterwards), host memory for it is the pool alone, and the
losses and weights equal torch's ``AdamW(fused=True)`` bit for bit.
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import sys
import tempfile
import time

import torch

from .. import OffloadedAdamW
from ..sizes import format_size


class TinyLM(torch.nn.Module):
    """A small causal transformer language model."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, context: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Parameter(torch.zeros(context, dim))
        layer = torch.nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(dim, vocab)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(context))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """The logits of the next token at each position of ``tokens`` (batch, positions), attending causally."""
        n = tokens.shape[1]
        x = self.embed(tokens) + self.pos[:n]
        return self.head(self.blocks(x, mask=self.mask[:n, :n], is_causal=True))


def _batches(steps: int, batch: int, context: int, vocab: int):
    # A learnable toy language: each token is the previous one plus one, modulo the vocabulary.
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        start = torch.randint(0, vocab, (batch, 1), generator=g)
        seq = (start + torch.arange(context + 1)) % vocab
        yield seq[:, :-1], seq[:, 1:]


def main(argv=None) -> int:
    """Train the demo model beside torch's AdamW and print both losses; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m offload.tools.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--path", help="directory for the swap files (default: a scratch directory, removed after)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args(argv)

    made = args.path is None or not os.path.exists(args.path)
    path = args.path or tempfile.mkdtemp(prefix="nvme-offload-demo-")
    torch.manual_seed(0)
    vocab, context = 512, 64
    model = TinyLM(vocab, args.dim, args.layers, heads=4, context=context)
    reference = copy.deepcopy(model)
    nparams = sum(p.numel() for p in model.parameters())
    print(f"nvme-offload demo: a {nparams / 1e6:.1f}M-parameter transformer, {args.steps} steps")
    print(f"swap files under {path}{' (removed after)' if made else ''}")

    try:
        opt = OffloadedAdamW(model.parameters(), lr=3e-3, nvme_path=path, buffer_size="4MiB", buffer_count=4)
        ref = torch.optim.AdamW(reference.parameters(), lr=3e-3, fused=True)
        print(f"state on disk: {format_size(opt.offloaded_state_bytes)} in {opt.swap_space.files}")
        print(f"host pool for state: {format_size(opt.host_pool_bytes)}; engine backend: {opt.swap_space.backend}")
        print(f"{'step':>5} {'loss (ours)':>12} {'loss (torch)':>13} {'our step':>10}")
        t_ours = t_ref = 0.0
        same = True
        for step, (x, y) in enumerate(_batches(args.steps, 16, context, vocab)):
            losses = []
            for m, o in ((model, opt), (reference, ref)):
                o.zero_grad()
                loss = torch.nn.functional.cross_entropy(m(x).flatten(0, 1), y.flatten())
                loss.backward()
                t = time.perf_counter()
                o.step()
                dt = time.perf_counter() - t
                if o is opt:
                    t_ours += dt
                    ours_dt = dt
                else:
                    t_ref += dt
                losses.append(loss.item())
            same &= losses[0] == losses[1]
            if step % 5 == 0 or step == args.steps - 1:
                print(f"{step:>5} {losses[0]:>12.4f} {losses[1]:>13.4f} {ours_dt * 1e3:>8.1f}ms")
        weights_equal = all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
        read, written = opt.io_bytes()
        opt.close()
    finally:
        if made:
            shutil.rmtree(path, ignore_errors=True)
    print(f"optimizer time: ours {t_ours:.2f} s, torch AdamW(fused) {t_ref:.2f} s; "
          f"moved {format_size(read)} read, {format_size(written)} written")
    print(f"losses identical to torch: {same}; final weights identical: {weights_equal}")
    return 0 if same and weights_equal else 1


if __name__ == "__main__":
    sys.exit(main())
