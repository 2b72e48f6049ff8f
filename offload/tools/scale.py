"""``offload-bench scale``: a Llama-style model from a Hugging Face checkpoint to a fine-tuned one, weights, grads
and optimizer state on NVMe, with host memory measured against the pools."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import psutil
import torch

from .._proc import reset_peak_rss
from ..adam import OffloadedAdamW
from ..params import empty_parameters, offload_parameters, offloaded, resident
from ..pretrained import SafetensorsCheckpoint, offload_pretrained, save_pretrained
from ..progress import tracked
from ..sizes import GIB, format_size
from . import report
from .cli import BenchError, add_path_option, bench_paths, count_arg, positive_int_arg
from .fio import write_read_gib_s

VOCAB = 32000


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """Add the ``scale`` subcommand."""
    p = sub.add_parser(
        "scale", parents=[common], help="a Llama-style model built on meta, loaded from safetensors, trained on "
                                        "NVMe and exported, with peak RSS against the pools",
        description="Write a Hugging Face checkpoint of a Llama-style model of about --params parameters (built "
                    "on meta, initialised one module at a time), load it as "
                    "offload.integrations.transformers.from_pretrained does (weights and grads on NVMe), train --steps "
                    "steps with OffloadedAdamW (state on NVMe), export it with save_pretrained and check the "
                    "export against the offloaded weights. Needs transformers. Every file is removed afterwards.",
    )
    p.add_argument("--params", type=count_arg, default=300_000_000, metavar="N",
                   help="parameters, about (default 300M; 2.7B is the size the docs describe)")
    p.add_argument("--hidden", type=positive_int_arg(64), default=1024, metavar="H",
                   help="hidden size (default 1024); layers follow from --params")
    p.add_argument("--steps", type=positive_int_arg(1), default=2, metavar="N", help="training steps (default 2)")
    p.add_argument("--vocab", type=positive_int_arg(2), default=VOCAB, metavar="V",
                   help=f"vocabulary size (default {VOCAB})")
    p.add_argument("--seq", type=positive_int_arg(1), default=64, metavar="T", help="tokens per sample (default 64)")
    p.add_argument("--no-fio", action="store_true", help="skip the fio bound")
    add_path_option(p)
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    p.set_defaults(run=run_scale)


def _shape(params: int, hidden: int, vocab: int) -> tuple[int, int, int]:
    """(layers, intermediate, heads) of a Llama-style model of about ``params`` parameters."""
    inter = max(256, round(hidden * 8 / 3 / 256) * 256)
    per_layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
    layers = max(1, round((params - 2 * vocab * hidden) / per_layer))
    return layers, inter, max(1, hidden // 128)


class _Timer:
    """Each phase's time, and the peak RSS growth (over ``base`` bytes) reached by its end."""

    def __init__(self, base: int):
        self.times: dict[str, float] = {}
        self.peaks: dict[str, int] = {}
        self.base = base

    @contextlib.contextmanager
    def __call__(self, name: str):
        t = time.perf_counter()
        yield
        self.times[name] = time.perf_counter() - t
        self.peaks[name] = report.memory_bytes("VmHWM") - self.base


# Every weight and grad on NVMe, through a pool of 5 x 8 MiB (the default, 5 x 1e8 elements, is 1 GB).
PARAM_OFFLOAD = dict(max_in_cpu=0, max_grad_in_cpu=0, buffer_count=5, buffer_size=8 << 20)


def close_offloaded(model) -> None:
    """Drop an offloaded model's swap file without bringing its weights back into memory."""
    state = offloaded(model)
    state.scheduler.remove()
    state.store.close()


# NOTE: peak RSS is measured from just before the model is built (after torch and transformers are
# imported) to the end: construction, loading, training and export included. What it is compared with is
# the pools this run holds: the parameter store's pool, the optimizer's pool and its grad buffers. The
# step is compared with the disk bound of its bytes (fio's read and write rates on the same path); loading
# and exporting with the bound of copying the weights' bytes once each way. fio runs four times (before the
# checkpoint is written, after it is loaded, before and after the export), and each phase is compared with
# the mean of the bounds just before and just after it: the disk's speed drifts up to 2x within one run.
# When fio runs (the names its runs have in the report).
WRITE_BEFORE, LOADED = "before writing the checkpoint", "after loading"
EXPORT_BEFORE, EXPORT_AFTER = "before exporting", "after exporting"


def run_scale(args: argparse.Namespace) -> int:
    """``offload-bench scale``."""
    try:
        import transformers
    except ImportError as err:
        raise BenchError("offload-bench scale needs transformers: pip install 'nvme-offload[integrations]'") from err
    layers, inter, heads = _shape(args.params, args.hidden, args.vocab)
    hf_config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, tie_word_embeddings=False, dtype="bfloat16")
    with bench_paths(args.paths) as paths:
        work = tempfile.mkdtemp(prefix="scale-", dir=paths[0])  # ours alone: removed whole at the end
        try:
            return _run(args, transformers, paths, work, hf_config, layers, inter)
        finally:
            shutil.rmtree(work, ignore_errors=True)


def _run(args, transformers, paths: list, work: str, hf_config, layers: int, inter: int) -> int:
    """The run, its files in ``work``."""
    swap = os.path.join(work, "swap")
    source, export = os.path.join(work, "pretrained"), os.path.join(work, "finetuned")
    machine = report.machine_info(paths)
    base_rss = report.memory_bytes("VmRSS")
    reset_peak_rss()
    timer = _Timer(base_rss)

    # A pretrained checkpoint to start from, written without the model ever in memory.
    with timer("build"):
        with empty_parameters():
            model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
        n_params = sum(p.numel() for p in model.parameters())
        report.print_header("scale", machine, [
            ("model", f"Llama-style, {layers} layers, hidden {args.hidden}, intermediate {inter}, "
                      f"vocab {args.vocab}: {n_params:,} bf16 parameters ({format_size(2 * n_params)})"),
            ("training", f"{args.steps} steps, 1 x {args.seq} tokens; weights, grads and state on NVMe"),
        ])
        offload_parameters(model, swap, init=model._init_weights, **PARAM_OFFLOAD)
    weight_bytes = 2 * n_params
    fio = _Fio(args, paths, weight_bytes)
    fio(WRITE_BEFORE)
    with timer("write_checkpoint"):
        save_pretrained(model, source, max_shard_size="1GB")
    close_offloaded(model)
    del model

    with timer("load"):
        build = transformers.AutoModelForCausalLM.from_config
        model = offload_pretrained(lambda: build(hf_config, dtype=torch.bfloat16), source, swap, **PARAM_OFFLOAD)
    fio(LOADED)
    model.train()
    store = offloaded(model).store
    opt = OffloadedAdamW(model.parameters(), lr=1e-5, nvme_path=swap)
    try:
        g = torch.Generator().manual_seed(0)
        times, moved = [], []
        with timer("train"):
            _train(model, opt, store, args, g, times, moved)
        pools = store.pool.nbytes + opt.host_pool_bytes + opt.grad_pool_bytes
        state_bytes = opt.state_store.state_bytes
        swap_bytes = store.swap_bytes + store.grad_swap_bytes + state_bytes
        fio(EXPORT_BEFORE)
        with timer("export"):
            save_pretrained(model, export, max_shard_size="1GB")
        peak = report.memory_bytes("VmHWM") - base_rss
        with timer("verify"):
            checked = _check_export(model, export, transformers, weight_bytes)
    finally:
        opt.close()
        close_offloaded(model)
    fio(EXPORT_AFTER)

    step = statistics.median(times[1:] if len(times) > 1 else times)
    read, written = moved[-1]

    copy_bound = fio.bound(weight_bytes, weight_bytes, WRITE_BEFORE, LOADED)  # writing the checkpoint, loading it
    export_bound = fio.bound(weight_bytes, weight_bytes, EXPORT_BEFORE, EXPORT_AFTER)
    step_bound = fio.bound(read, written, LOADED, EXPORT_BEFORE)
    fio_read, fio_write = fio.median()
    t = timer.times
    result: dict[str, Any] = {
        "params": n_params, "layers": layers, "hidden": args.hidden, "intermediate": inter,
        "weight_bytes": weight_bytes, "optimizer_state_bytes": state_bytes, "nvme_bytes": swap_bytes,
        "pool_bytes": pools, "peak_rss_growth_bytes": peak,
        "peak_rss_growth_by_phase": timer.peaks, "peak_rss_minus_pools_bytes": peak - pools,
        "build_and_init_s": t["build"], "write_checkpoint_s": t["write_checkpoint"], "load_s": t["load"],
        "export_s": t["export"], "verify_s": t["verify"], "export_checked": checked, "step_s": times,
        "step_s_median": step,
        "read_bytes_per_step": read, "write_bytes_per_step": written, "step_disk_bound_s": step_bound,
        "copy_bound_s": copy_bound, "export_copy_bound_s": export_bound, "fio_read_gib_s": fio_read,
        "fio_write_gib_s": fio_write, "fio_runs": fio.runs,
        "drive_writes_per_day": report.drive_writes(written, step)[0], "machine": machine,
    }

    def vs(s: float, b: float | None) -> str:
        return f"{s:.1f} s" + (f" (bound {b:.1f} s: {b / s:.2f}x of it)" if b else "")

    rows = [
        ["weights / optimizer state / on NVMe in all", f"{format_size(weight_bytes)} / {format_size(state_bytes)} / "
                                                       f"{format_size(swap_bytes)}"],
        ["build on meta + init to NVMe", f"{t['build']:.1f} s"],
        ["write the pretrained checkpoint", vs(t["write_checkpoint"], copy_bound)],
        ["load the checkpoint to NVMe (offload_pretrained)", vs(t["load"], copy_bound)],
        ["step (median)", vs(step, step_bound) + f", runs {', '.join(f'{x:.1f}' for x in times)}"],
        ["read / written per step", f"{format_size(read)} / {format_size(written)}"],
        ["drive writes at this step rate", report.drive_writes(written, step)[1]],
        ["export (save_pretrained)", vs(t["export"], export_bound)],
        ["export checked against the offloaded weights", f"equal, {checked} ({t['verify']:.1f} s)"],
        ["pools (weights, optimizer, grads)", format_size(pools)],
        ["peak RSS growth (build to export)", f"{format_size(peak)} (pools + {format_size(peak - pools)})"],
        ["  reached by the end of", ", ".join(f"{k.split('_')[0]} {format_size(v)}"
                                               for k, v in timer.peaks.items() if k != "verify")],
    ] + [[f"fio read / write, {r['when']}", f"{report.fmt_gib(r['read_gib_s'])} / "
                                              f"{report.fmt_gib(r['write_gib_s'])} GiB/s"] for r in fio.runs]
    print(report.table(["", "value"], rows))
    if args.json:
        report.write_json(args.json, result)
        print(f"wrote {args.json}")
    return 0


class _Fio:
    """fio's read and write rates on the run's paths, measured at named moments of the run (none with
    ``--no-fio``, or after fio failed once: it says why)."""

    def __init__(self, args, paths: list, weight_bytes: int):
        self.paths, self.size, self.off = paths, min(weight_bytes, GIB), args.no_fio
        self.runs: list[dict] = []

    def __call__(self, when: str) -> None:
        if self.off:
            return
        write, read = write_read_gib_s(self.paths, self.size, 1 << 20, 32, 1)
        if read is None or write is None:
            self.off = True
            return
        self.runs.append({"when": when, "read_gib_s": read, "write_gib_s": write})

    def bound(self, read: int, written: int, before: str, after: str) -> float | None:
        """The disk bound of ``read`` and ``written`` bytes: the mean of the bounds at the runs named ``before``
        and ``after`` (None where either is missing)."""
        runs = {r["when"]: r for r in self.runs}
        if before not in runs or after not in runs:
            return None
        return statistics.mean(report.disk_bound(read, written, runs[w]["read_gib_s"], runs[w]["write_gib_s"])
                               for w in (before, after))

    def median(self) -> tuple[float | None, float | None]:
        if not self.runs:
            return None, None
        return (statistics.median(r["read_gib_s"] for r in self.runs),
                statistics.median(r["write_gib_s"] for r in self.runs))


def _train(model, opt, store, args, g, times: list, moved: list) -> None:
    """``args.steps`` steps; each one's time and (bytes read, bytes written) go to ``times`` and ``moved``."""
    for _ in tracked(range(args.steps), "scale: steps"):
        ids = torch.randint(0, args.vocab, (1, args.seq), generator=g)
        before = (store.bytes_read + store.grad_bytes_read + opt.io_bytes()[0],
                  store.bytes_written + store.grad_bytes_written + opt.io_bytes()[1])
        t = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t)
        moved.append((store.bytes_read + store.grad_bytes_read + opt.io_bytes()[0] - before[0],
                       store.bytes_written + store.grad_bytes_written + opt.io_bytes()[1] - before[1]))


def _check_export(model, directory: str, transformers, weight_bytes: int) -> str:
    """Every tensor of the export equals the offloaded model's: loaded by ``from_pretrained`` where the memory
    available holds the model twice over (after the peak RSS was taken), else read tensor by tensor. Returns
    how it was checked."""
    if psutil.virtual_memory().available > 2 * weight_bytes + GIB:
        back = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
        loaded = dict(back.named_parameters())
        differs = missing = None
        for name, p in model.named_parameters():
            if name not in loaded:
                missing = name
                break
            with resident([p]):
                if not torch.equal(loaded[name], p.detach()):
                    differs = name
                    break
        del back, loaded  # the whole model: gone before anything else runs
        if missing is not None:
            raise BenchError(f"the export, loaded by from_pretrained, has no {missing!r}")
        if differs is not None:
            raise BenchError(f"the export's {differs!r}, loaded by from_pretrained, differs from the offloaded "
                             "weight")
        return "loaded by from_pretrained"
    with SafetensorsCheckpoint(directory) as ckpt:
        for name, p in model.named_parameters():
            if name not in ckpt.entries:
                continue  # a tied name
            with resident([p]):
                if not torch.equal(ckpt.read(name), p.detach()):
                    raise BenchError(f"the export's {name!r} differs from the offloaded weight")
    return "read tensor by tensor (too little memory for from_pretrained)"
