"""``offload-bench quality``: what the leaner state modes cost in training quality, on real text.

A small Llama-style decoder (transformers' ``LlamaForCausalLM``, byte-level, 10-30M parameters) learns the text
of the installed Python standard library (its ``.py`` files, nobody here wrote them), one training run per mode,
for the same budget of steps, from the same initial weights: torch's AdamW (the reference: fp32 weights, bf16
autocast), then ``OffloadedAdamW`` with bf16 weights and its state on NVMe, by default (fp32 moments and masters),
with bf16 moments, with 8-bit moments, without fp32 masters, and with 8-bit moments and no masters. A second
reference run with another data order gives the reference's own spread. Files are split by a hash of their path:
one in ten is held out, and the held-out loss (mean over fixed windows) is what the modes are judged by. Writes a
table and, with matplotlib, a PNG of the loss curves.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sysconfig
import time
import zlib

import torch

from ..sizes import format_size
from . import report
from .cli import EXIT_OK, BenchError, UsageError, add_path_option, bench_paths, positive_int_arg

__all__ = ["MODES", "corpus", "register", "run_quality"]

# key -> (label, weights' dtype, OffloadedAdamW keywords, or None for torch's AdamW)
MODES = {
    "torch": ("torch AdamW", "fp32", None),
    "default": ("ours (fp32 state, masters)", "bf16", {}),
    "bf16": ("ours, bf16 state", "bf16", {"state_dtype": "bf16"}),
    "int8": ("ours, int8 state", "bf16", {"state_dtype": "int8"}),
    "no-master": ("ours, no master", "bf16", {"master_weights": False}),
    "int8-no-master": ("ours, int8 state, no master", "bf16", {"state_dtype": "int8", "master_weights": False}),
}
REFERENCE = "torch"
REFERENCE_AGAIN = "torch-again"  # the reference with another data order: its own spread
VOCAB = 256  # bytes


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """Add the ``quality`` subcommand."""
    p = sub.add_parser("quality", parents=[common], help="held-out loss per state mode on real text",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=positive_int_arg(10, 100_000), default=300, metavar="N",
                   help="training steps per mode (default 300)")
    p.add_argument("--batch", type=positive_int_arg(1, 4096), default=16, metavar="N", help="sequences per step")
    p.add_argument("--seq", type=positive_int_arg(16, 8192), default=128, metavar="N", help="bytes per sequence")
    p.add_argument("--hidden", type=positive_int_arg(64, 8192), default=384, metavar="N", help="model width")
    p.add_argument("--layers", type=positive_int_arg(1, 64), default=6, metavar="N", help="decoder layers")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (linear warmup, cosine decay)")
    p.add_argument("--eval-every", type=positive_int_arg(1), default=25, metavar="N", help="steps between held-out "
                   "evaluations")
    p.add_argument("--modes", metavar="KEYS", help="a comma-separated subset of: " + ", ".join(
        f"{key} ({label})" for key, (label, _, _) in MODES.items()) + "; the reference (torch) always runs")
    p.add_argument("--corpus", metavar="DIR", help="a directory of text files instead of the standard library's")
    p.add_argument("--png", metavar="FILE", help="draw the loss curves here (needs matplotlib)")
    p.add_argument("--json", metavar="FILE", help="write every curve and the table as JSON")
    add_path_option(p)
    p.set_defaults(run=run_quality)


def stdlib_dir() -> str:
    """The installed standard library's directory."""
    return sysconfig.get_paths()["stdlib"]


def corpus(root: str, *, held_out_every: int = 10) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The bytes of every ``.py`` file under ``root`` (``site-packages`` left out: not the standard library), in
    path order, split by file: a file whose path's CRC-32 is divisible by ``held_out_every`` is held out.

    Returns:
        ``(train bytes, held-out bytes, files)`` as uint8 tensors.
    """
    train, held, files = [], [], 0
    for base, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "dist-packages", "__pycache__"))
        for name in sorted(names):
            if not name.endswith(".py"):
                continue
            path = os.path.join(base, name)
            try:
                with open(path, "rb") as f:
                    data = f.read(4 << 20)
            except OSError:
                continue
            rel = os.path.relpath(path, root).encode()
            (held if zlib.crc32(rel) % held_out_every == 0 else train).append(data + b"\n\n")
            files += 1
    if not train or not held:
        raise UsageError(f"{root}: no Python files to learn from (give --corpus with a directory of .py files)")
    as_tensor = lambda parts: torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8)  # noqa: E731
    return as_tensor(train), as_tensor(held), files


def _model(args, dtype: torch.dtype):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                                   num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
                                   max_position_embeddings=args.seq, tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(dtype)


def _windows(data: torch.Tensor, seq: int, count: int, generator: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, data.numel() - seq - 1, (count,), generator=generator)
    return torch.stack([data[s:s + seq + 1] for s in starts.tolist()]).long()


def _loss(model, batch: torch.Tensor, autocast: bool) -> torch.Tensor:
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with ctx:
        logits = model(input_ids=batch[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), batch[:, 1:].reshape(-1))


def _train(args, name: str, data: tuple, paths: list, order: int) -> dict:
    """One mode's run: the held-out loss every ``eval_every`` steps and the training loss of every step."""
    from .. import OffloadedAdamW

    label, dtype_name, kwargs = MODES[REFERENCE if name == REFERENCE_AGAIN else name]
    dtype = torch.float32 if dtype_name == "fp32" else torch.bfloat16
    model = _model(args, dtype)
    params = sum(p.numel() for p in model.parameters())
    if kwargs is None:
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95), fused=True)
    else:
        opt = OffloadedAdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95),
                             nvme_path=list(paths), **kwargs)
    warmup = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (
        1 + math.cos(math.pi * min(1.0, s / args.steps))))
    train, held = data
    gen = torch.Generator().manual_seed(1000 + order)
    evals = _windows(held, args.seq, 64, torch.Generator().manual_seed(7))
    curve, held_curve = [], []
    t0 = time.perf_counter()
    try:
        for step in range(args.steps + 1):
            if step % args.eval_every == 0 or step == args.steps:
                with torch.no_grad():
                    held_curve.append((step, float(torch.stack([_loss(model, evals[i:i + 16], kwargs is None)
                                                                for i in range(0, 64, 16)]).mean())))
            if step == args.steps:
                break
            loss = _loss(model, _windows(train, args.seq, args.batch, gen), kwargs is None)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            sched.step()
            curve.append(float(loss.detach()))
    finally:
        if kwargs is not None:
            opt.close()
    elapsed = time.perf_counter() - t0
    label = label + (", other data order" if name == REFERENCE_AGAIN else "")
    print(f"  {label}: held-out loss {held_curve[-1][1]:.4f} after {args.steps} steps ({elapsed:.0f} s)", flush=True)
    return {"label": label, "params": params, "train": curve, "held_out": held_curve, "seconds": elapsed}


def run_quality(args: argparse.Namespace) -> int:
    """``offload-bench quality``."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise BenchError("offload-bench quality trains transformers' LlamaForCausalLM: pip install transformers") \
            from None
    names = list(MODES) if not args.modes else [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in names if m not in MODES]
    if unknown:
        raise UsageError(f"--modes: unknown {unknown}; choose from: " + ", ".join(MODES))
    names = list(dict.fromkeys(names))
    if REFERENCE not in names:
        names.insert(0, REFERENCE)
    root = args.corpus or stdlib_dir()
    train, held, files = corpus(root)
    print(f"quality: {files} Python files from {root}: {format_size(train.numel())} to train on, "
          f"{format_size(held.numel())} held out (a file in ten, by a hash of its path)")
    print(f"model: Llama-style, {args.layers} layers, hidden {args.hidden}, byte-level; {args.steps} steps of "
          f"{args.batch} x {args.seq} bytes, lr {args.lr} (warmup, cosine), clipped at 1.0")
    runs = {}
    with bench_paths(args.paths) as paths:
        for name in names + [REFERENCE_AGAIN]:
            runs[name] = _train(args, name, (train, held), paths, order=1 if name == REFERENCE_AGAIN else 0)
    doc = _summary(runs)
    print(report.table(["mode", "held-out loss", "vs torch AdamW", "train loss (last 10%)", "time"], doc["rows"]))
    print(f"the reference's own spread between two data orders: {doc['reference_spread']:.2%}")
    if args.json:
        report.write_json(args.json, {"args": {k: v for k, v in vars(args).items() if k != "run"
                                               and isinstance(v, (int, float, str, type(None), list))},
                                      "runs": runs, **doc})
    if args.png:
        _plot(runs, args.png)
        print(f"wrote {args.png}")
    return EXIT_OK


def _summary(runs: dict) -> dict:
    ref = runs[REFERENCE]["held_out"][-1][1]
    spread = abs(runs[REFERENCE_AGAIN]["held_out"][-1][1] - ref) / ref
    rows, table = [], {}
    for name, run in runs.items():
        final = run["held_out"][-1][1]
        tail = run["train"][-max(1, len(run["train"]) // 10):]
        table[name] = {"held_out": final, "vs_reference": final / ref - 1, "train_tail": sum(tail) / len(tail)}
        rows.append([run["label"], f"{final:.4f}", f"{final / ref - 1:+.2%}" if name != REFERENCE else "-",
                     f"{sum(tail) / len(tail):.4f}", f"{run['seconds']:.0f} s"])
    return {"rows": rows, "table": table, "reference_spread": spread}


def _plot(runs: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BenchError("--png needs matplotlib (pip install matplotlib)") from None
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(16, 4.5))
    ref = dict(runs[REFERENCE]["held_out"])
    for run in runs.values():
        train = run["train"]
        k = max(1, len(train) // 30)
        smooth = [sum(train[max(0, i - k):i + 1]) / len(train[max(0, i - k):i + 1]) for i in range(len(train))]
        left.plot(range(1, len(train) + 1), smooth, label=run["label"], linewidth=1)
        steps, losses = zip(*run["held_out"])
        middle.plot(steps, losses, marker=".", label=run["label"], linewidth=1)
        right.plot(steps, [100 * (loss / ref[s] - 1) for s, loss in run["held_out"]], marker=".",
                   label=run["label"], linewidth=1)
    left.set(title="training loss (moving mean)", xlabel="step", ylabel="cross-entropy (nats per byte)", yscale="log")
    middle.set(title="held-out loss", xlabel="step", yscale="log")
    right.set(title="held-out loss vs torch AdamW (%)", xlabel="step")
    for ax in (left, middle, right):
        ax.grid(alpha=0.3)
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
