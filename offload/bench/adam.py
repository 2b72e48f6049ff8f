"""``offload-bench adam``: OffloadedAdamW steps next to torch's fused AdamW and the disk's bound."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import time
from typing import Any

import torch

from ..adam import OffloadedAdamW
from ..units import GIB, format_size
from . import report
from .cli import BenchFailure, add_config_option, add_path_option, bench_paths, count_arg, positive_int_arg
from .fio import write_read_gib_s
from .workload import TENSOR_ELEMENTS, synthetic_params


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """Add the ``adam`` subcommand."""
    p = sub.add_parser(
        "adam", parents=[common], help="OffloadedAdamW step time and memory vs torch AdamW and the disk's bound",
        description="Build a model-sized set of parameters with random grads, time OffloadedAdamW steps and, "
                    "in the same run, torch.optim.AdamW(fused=True) on the same tensors and fio on the same path.",
    )
    p.add_argument("--params", type=count_arg, default=64_000_000, metavar="N",
                   help="number of parameters, e.g. 64M, 1.5G (default 64M)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                   help="parameter dtype; bf16 keeps an fp32 master copy on disk (default fp32)")
    p.add_argument("--steps", type=positive_int_arg(2), default=5, metavar="N",
                   help="optimizer steps to time; the first (no state to read) is reported apart (default 5)")
    add_path_option(p)
    add_config_option(p)
    p.add_argument("--no-torch", action="store_true", help="skip the torch AdamW comparison")
    p.add_argument("--no-fio", action="store_true", help="skip the fio bound")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    p.set_defaults(run=run_adam)




def _rss_now() -> int:
    return _status_field("VmRSS")


def _rss_peak() -> int:
    return _status_field("VmHWM")


def _status_field(name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(name + ":"):
                return int(line.split()[1]) * 1024
    raise BenchFailure(f"/proc/self/status has no {name}; peak memory cannot be measured here")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS




def _time_steps(opt, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t)
    return times


# NOTE: the figure that matters is the step time against the disk's lower bound for the bytes the
# step must move (bytes read / fio read GiB/s + bytes written / fio write GiB/s), with fio run on the
# same path, block size and queue depth in the same run. Memory is measured as peak RSS above the
# parameters and grads (the kernel's VmHWM, reset through /proc/self/clear_refs before each phase),
# to show that host memory for state is the pool, not the model.
def run_adam(args: argparse.Namespace) -> int:
    """``offload-bench adam``."""
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    cfg = args.config
    with bench_paths(args.paths) as paths:
        cfg = cfg.replace(offload_optimizer=cfg.offload_optimizer.replace(nvme_path=tuple(paths)))
        oc, aio = cfg.offload_optimizer, cfg.aio
        machine = report.machine_info(paths)
        report.print_header("adam", machine, [
            ("params", f"{args.params:,} {args.dtype} in tensors of {TENSOR_ELEMENTS:,}"),
            ("steps", str(args.steps)),
            ("pool", f"{oc.buffer_count} x {format_size(oc.buffer_size)}"),
            ("aio", f"block size {format_size(aio.block_size)}, queue depth {aio.queue_depth}, "
                    f"{aio.thread_count} thread(s), backend {aio.backend}"),
        ])

        params = synthetic_params(args.params, dtype)
        # Building any torch optimizer imports torch._dynamo once (about 70 MiB here): pay that before
        # the baseline so the peak measures optimizer state, for ours and torch's alike.
        torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
        gc.collect()
        base_rss = _rss_now()
        _reset_peak()
        opt = OffloadedAdamW(params, lr=1e-3, config=cfg)
        try:
            first = _time_steps(opt, 1)[0]
            r0, w0 = opt.io_bytes()
            times = _time_steps(opt, args.steps - 1)
            r1, w1 = opt.io_bytes()
            peak = _rss_peak()
            pool_bytes = opt.host_pool_bytes
            state_bytes = opt.offloaded_state_bytes
            backend = opt.swap_space.backend
        finally:
            opt.close()
        del opt
        gc.collect()
        steady = len(times)
        read_per_step = (r1 - r0) // steady
        written_per_step = (w1 - w0) // steady
        step_med = statistics.median(times)

        fio_read = fio_write = None
        if not args.no_fio:
            fio_write, fio_read = write_read_gib_s(paths, min(state_bytes, 1 << 30), aio.block_size,
                                                   aio.queue_depth, aio.thread_count)

        torch_med = torch_peak = None
        if not args.no_torch:
            gc.collect()
            _reset_peak()
            ref = torch.optim.AdamW(params, lr=1e-3, fused=True)
            torch_times = _time_steps(ref, args.steps)
            torch_peak = _rss_peak()
            torch_med = statistics.median(torch_times[1:])
            del ref
            gc.collect()

    bound = None
    if fio_read and fio_write:
        bound = read_per_step / GIB / fio_read + written_per_step / GIB / fio_write
    over = peak - base_rss
    result: dict[str, Any] = {
        "params": args.params,
        "dtype": args.dtype,
        "step_s_median": step_med,
        "step_s_runs": times,
        "first_step_s": first,
        "bytes_read_per_step": read_per_step,
        "bytes_written_per_step": written_per_step,
        "peak_rss_bytes": peak,
        "base_rss_bytes": base_rss,
        "rss_over_base_bytes": over,
        "host_pool_bytes": pool_bytes,
        "offloaded_state_bytes": state_bytes,
        "torch_step_s_median": torch_med,
        "torch_peak_rss_bytes": torch_peak,
        "fio_read_gib_s": fio_read,
        "fio_write_gib_s": fio_write,
        "disk_bound_s": bound,
        "ratio_to_bound": step_med / bound if bound else None,
        "backend": backend,
        "config": {"aio": dataclasses.asdict(aio),
                   "buffer_count": oc.buffer_count, "buffer_size": oc.buffer_size},
        "machine": machine,
    }
    print(report.table(["", "value"], [
        ["step (median of steady steps)", f"{step_med:.3f} s"],
        ["first step (nothing to read)", f"{first:.3f} s"],
        ["read / written per step", f"{format_size(read_per_step)} / {format_size(written_per_step)}"],
        ["fio read / write", f"{report.fmt_gib(fio_read)} / {report.fmt_gib(fio_write)} GiB/s"],
        ["disk bound (fio)", f"{bound:.3f} s" if bound else "n/a"],
        ["step / disk bound", f"{step_med / bound:.2f}x" if bound else "n/a"],
        ["torch AdamW(fused) step", f"{torch_med:.3f} s" if torch_med else "n/a"],
        ["host pool", format_size(pool_bytes)],
        ["peak RSS above params+grads", f"{format_size(over)} ({over / pool_bytes:.2f}x pool)"],
        ["torch peak RSS above params+grads",
         format_size(torch_peak - base_rss) if torch_peak else "n/a"],
    ]))
    if args.json:
        report.write_json(args.json, result)
        print(f"wrote {args.json}")
    return 0
