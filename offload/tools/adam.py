"""``offload-bench adam``: OffloadedAdamW steps next to torch's fused AdamW and the disk's bound."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import time
from typing import Any, Optional

import torch

from .._proc import reset_peak_rss
from ..adam import OffloadedAdamW
from ..progress import progress
from ..sizes import format_size, parse_size
from ..state import resolve_pin
from . import overlap, report
from .cli import (
    BenchError,
    add_config_option,
    add_path_option,
    bench_paths,
    count_arg,
    positive_int_arg,
)
from .fio import write_read_gib_s
from .gpu import gpu_peak, pinned_text, pool_pinned, require_cuda, reset_gpu_peak, synchronize
from .workload import TENSOR_ELEMENTS, synthetic_params


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """Add the ``adam`` subcommand."""
    p = sub.add_parser(
        "adam", parents=[common], help="OffloadedAdamW step time and memory vs torch AdamW and the disk's bound",
        description="Build a model-sized set of parameters with random grads, time OffloadedAdamW steps and, "
                    "in the same run, the same optimizer without a host cache, torch.optim.AdamW(fused=True) "
                    "on the same tensors, and fio on the same path.",
    )
    p.add_argument("--params", type=count_arg, default=64_000_000, metavar="N",
                   help="number of parameters, e.g. 64M, 1.5G (default 64M)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                   help="parameter dtype; bf16 keeps an fp32 master copy (default fp32)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the parameters live; cuda needs a GPU (default cpu)")
    p.add_argument("--offload-device", choices=("nvme", "cpu"), default="nvme",
                   help="offload_optimizer.device: state on NVMe, or all of it in host memory (default nvme)")
    p.add_argument("--host-cache", type=cache_arg, default=0, metavar="SIZE|auto",
                   help="offload_optimizer.host_cache: state kept in host memory between steps (default 0)")
    p.add_argument("--state-dtype", choices=("fp32", "bf16", "int8"), default="fp32",
                   help="offload_optimizer.state_dtype: the moments' dtype (default fp32)")
    p.add_argument("--no-master", action="store_true",
                   help="offload_optimizer.master_weights false: bf16 weights without fp32 masters")
    p.add_argument("--steps", type=positive_int_arg(3), default=5, metavar="N",
                   help="optimizer steps to time: the first (no state to read) is reported apart, the others "
                        "are interleaved with the baseline's; one more, untimed, measures memory (default 5)")
    add_path_option(p)
    add_config_option(p)
    p.add_argument("--checksum-cost", action="store_true",
                   help="switch our checksums off every other steady step (on, off, off, on, ...) and report what "
                        "they cost; the step median is then the median of the steps with checksums")
    p.add_argument("--no-baseline", action="store_true",
                   help="skip the same optimizer without a host cache (state on NVMe, fp32 moments)")
    p.add_argument("--no-torch", action="store_true", help="skip the torch AdamW comparison")
    p.add_argument("--no-fio", action="store_true", help="skip the fio bound")
    overlap.add_options(p)
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    p.set_defaults(run=run_adam)


def cache_arg(text: str):
    """An argparse type: a human size (0 for none) or ``auto``."""
    if text == "auto":
        return text
    try:
        return parse_size(text)
    except (ValueError, TypeError) as err:
        raise argparse.ArgumentTypeError(f"{err}; or write auto") from None


def _time_steps(opt, steps: int, bar=None) -> list[float]:
    times = []
    device = opt.param_groups[0]["params"][0].device
    for _ in range(steps):
        if bar is not None:
            bar.update(1)
        t = time.perf_counter()
        opt.step()
        if isinstance(opt, OffloadedAdamW):
            # A step returns with its last writes landing (in training, during the next forward): here,
            # with nothing to overlap them, they count in the step, and never in the next one measured.
            opt.state_store.drain()
        synchronize(device)  # torch's GPU kernels return before they finish
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
    device = torch.device(args.device)
    require_cuda(device)
    if args.overlap:
        hidden = args.hidden or 1024
        layers = max(1, round(args.params / (8 * hidden * hidden + 7 * hidden)))
        with bench_paths(args.paths) as paths:
            overlap.run_overlap(args, paths, layers=layers, hidden=hidden, dtype=dtype, device=device,
                                weights_offloaded=False)
        return 0
    if args.batch is not None or args.hidden is not None:
        raise BenchError("--batch and --hidden go with --overlap")
    with bench_paths(args.paths) as paths:
        main_cfg = args.config.replace(offload_optimizer={
            "nvme_path": list(paths), "device": args.offload_device, "host_cache": args.host_cache,
            "state_dtype": args.state_dtype, "master_weights": not args.no_master})
        base_cfg = main_cfg.replace(offload_optimizer={"device": "nvme", "host_cache": 0, "state_dtype": "fp32",
                                                       "master_weights": True})
        if args.no_baseline or base_cfg == main_cfg:
            base_cfg = None
        machine = report.machine_info(paths)
        _print_header(args, machine, main_cfg, device, compared=base_cfg is not None)
        params = synthetic_params(args.params, dtype, device=device)
        ours = _measure_ours(args, params, main_cfg, base_cfg, device)
        oc, aio = main_cfg.offload_optimizer, main_cfg.aio
        fio = (None, None)
        if not args.no_fio and oc.device == "nvme":
            fio = write_read_gib_s(paths, min(ours.state_bytes, 1 << 30), aio.block_size, aio.queue_depth,
                                   aio.thread_count)
        torch_run = None if args.no_torch else _measure_torch(params, args.steps, device)
    result = _result(args, main_cfg, device, ours, fio, torch_run, machine)
    print(report.table(["", "value"], _rows(result)))
    if args.json:
        report.write_json(args.json, result)
        print(f"wrote {args.json}")
    return 0


def _print_header(args: argparse.Namespace, machine: dict, cfg, device: torch.device, *, compared: bool) -> None:
    oc, aio = cfg.offload_optimizer, cfg.aio
    report.print_header("adam", machine, [
        ("params", f"{args.params:,} {args.dtype} on {device.type} in tensors of {TENSOR_ELEMENTS:,}"),
        ("steps", str(args.steps)),
        ("state", f"on {oc.device}, host cache {_cache_text(oc.host_cache)}, moments in {oc.state_dtype}, "
                  f"{'fp32 masters' if oc.master_weights else 'no masters'}, "
                  f"checksums {'on' if oc.checksum else 'off'}"),
        ("pool", f"{oc.buffer_count} x {format_size(oc.buffer_size)}, pinned: "
                 f"{pinned_text(resolve_pin(oc.pin_memory, [torch.empty(0, device=device)]), oc.pin_memory)}"),
        ("aio", f"block size {format_size(aio.block_size)}, queue depth {aio.queue_depth}, "
                f"{aio.thread_count} thread(s), backend {aio.backend}"),
        ("compared with", "the same without a host cache (nvme, fp32 moments), interleaved step by step"
         if compared else "nothing of ours"),
    ])


@dataclasses.dataclass
class _Measured:
    """What the timed steps gave: ours (times, bytes moved, memory) and the baseline's beside it, if any."""

    first: float
    times: list = dataclasses.field(default_factory=list)
    moved: list = dataclasses.field(default_factory=list)  # (read, written) per timed step
    unchecked: list = dataclasses.field(default_factory=list)  # steps with checksums off
    base_times: list = dataclasses.field(default_factory=list)
    base_moved: list = dataclasses.field(default_factory=list)
    peak: int = 0
    base_rss: int = 0
    gpu_peak: Optional[int] = None
    pinned: Optional[bool] = None
    pool_bytes: int = 0
    cache_bytes: int = 0
    state_bytes: int = 0
    resident: int = 0
    backend: str = ""


def _measure_ours(args: argparse.Namespace, params: list, cfg, base_cfg, device: torch.device) -> _Measured:
    # Building any torch optimizer imports torch._dynamo once (about 70 MiB here): pay that before
    # the baseline so the peak measures optimizer state, for ours and torch's alike.
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    gc.collect()
    base_rss = report.memory_bytes("VmRSS")
    reset_peak_rss()  # VmHWM := VmRSS
    reset_gpu_peak(device)
    opt = OffloadedAdamW(params, lr=1e-3, config=cfg)
    base = None
    bar = progress(args.steps + 1 + (2 if base_cfg is not None else 0), "adam: our steps")
    try:
        # Memory: ours alone, the first step and one steady step (not timed: it runs alone).
        ours = _Measured(first=_time_steps(opt, 1, bar)[0], base_rss=base_rss)
        bar.update(1)
        _timed_step(opt, [], [])
        ours.peak = report.memory_bytes("VmHWM")
        ours.gpu_peak = gpu_peak(device)
        ours.pinned = pool_pinned([opt.state_store.pool])
        ours.pool_bytes, ours.cache_bytes = opt.host_pool_bytes, opt.host_cache_bytes
        ours.state_bytes, ours.resident = opt.state_store.state_bytes, opt.state_store.resident_bytes
        ours.backend = opt.swap_space.backend if opt.swap_space is not None else "none (state in memory)"
        if base_cfg is not None:
            base = OffloadedAdamW(params, lr=1e-3, config=base_cfg)
            _time_steps(base, 2, bar)
        _interleave(opt, base, ours, args.steps - 1, checksum_cost=args.checksum_cost,
                    checksum=cfg.offload_optimizer.checksum, bar=bar)
    finally:
        bar.close()
        opt.close()
        if base is not None:
            base.close()
    del opt, base
    gc.collect()
    return ours


def _interleave(opt, base, ours: _Measured, steps: int, *, checksum_cost: bool, checksum: bool, bar) -> None:
    """Time ours and the baseline in turn, step by step, so the disk's drift hits both alike, and in the
    order ours-base, base-ours, ... so neither always runs while the other's writes are still being
    flushed below the file system."""
    for i in range(steps):
        bar.update(1)
        # With --checksum-cost: one optimizer, one swap file, checksums on and off in turn (two
        # optimizers on two files would measure where their files lie on the disk).
        # A step "on" right after the two "off" has no digests to check its reads against: not timed.
        off = checksum_cost and i % 4 in (1, 2)
        after_off = checksum_cost and i % 4 == 3
        opt.state_store.bytes.checksum = checksum and not off
        turn = [(opt, ours.unchecked if off else [] if after_off else ours.times,
                 [] if off or after_off else ours.moved)]
        if base is not None:
            turn.append((base, ours.base_times, ours.base_moved))
        for which, into, bytes_into in turn if i % 2 == 0 else reversed(turn):
            _timed_step(which, into, bytes_into)
    opt.state_store.bytes.checksum = checksum


def _measure_torch(params: list, steps: int, device: torch.device) -> dict:
    """torch's fused AdamW on the same tensors: its steady step median and its memory peaks."""
    gc.collect()
    reset_peak_rss()  # VmHWM := VmRSS
    reset_gpu_peak(device)
    ref = torch.optim.AdamW(params, lr=1e-3, fused=True)
    with progress(steps, "adam: torch AdamW steps") as bar:
        times = _time_steps(ref, steps, bar)
    out = {"median": statistics.median(times[1:]), "peak": report.memory_bytes("VmHWM"), "gpu_peak": gpu_peak(device)}
    del ref
    gc.collect()
    return out


def _mean_bytes(moved: list) -> tuple:
    """Mean bytes (read, written) per step, or (None, None) for no steps. Means: with a host cache, which
    units stay resident alternates with the snake order."""
    if not moved:
        return None, None
    return sum(r for r, _ in moved) // len(moved), sum(w for _, w in moved) // len(moved)


def _ratio(a, b):
    return a / b if a is not None and b else None


def _result(args: argparse.Namespace, cfg, device: torch.device, ours: _Measured, fio: tuple,
            torch_run: Optional[dict], machine: dict) -> dict[str, Any]:
    """The JSON result: every figure the table shows, and the runs behind them."""
    oc, aio = cfg.offload_optimizer, cfg.aio
    fio_write, fio_read = fio
    step_med = statistics.median(ours.times)
    unchecked_med = statistics.median(ours.unchecked) if ours.unchecked else None
    read, written = _mean_bytes(ours.moved)
    base_med = statistics.median(ours.base_times) if ours.base_times else None
    base_read, base_written = _mean_bytes(ours.base_moved)
    bound = report.disk_bound(read, written, fio_read, fio_write)
    base_bound = None if base_read is None else report.disk_bound(base_read, base_written, fio_read, fio_write)
    torch_run = torch_run or {}
    result: dict[str, Any] = {
        "params": args.params,
        "dtype": args.dtype,
        "device": device.type,
        "offload_device": oc.device,
        "host_cache": oc.host_cache,
        "state_dtype": oc.state_dtype,
        "master_weights": oc.master_weights,
        "step_s_median": step_med,
        "step_s_runs": ours.times,
        "first_step_s": ours.first,
        "unchecked_step_s_median": unchecked_med,
        "checksum_cost": step_med / unchecked_med - 1 if unchecked_med else None,
        "bytes_read_per_step": read,
        "bytes_written_per_step": written,
        # The ledger (offload.tools.ledger): this benchmark steps on given grads, so only the state moves.
        "ledger": {"bytes_per_param_iteration": {"state read": read / args.params,
                                                 "state written": written / args.params},
                   "total": (read + written) / args.params},
        "baseline_step_s_median": base_med,
        "baseline_step_s_runs": ours.base_times,
        "baseline_bytes_read_per_step": base_read,
        "baseline_bytes_written_per_step": base_written,
        "step_vs_baseline": _ratio(step_med, base_med),
        "bytes_vs_baseline": _ratio(read + written, None if base_read is None else base_read + base_written),
        "peak_rss_bytes": ours.peak,
        "base_rss_bytes": ours.base_rss,
        "rss_over_base_bytes": ours.peak - ours.base_rss,
        "host_pool_bytes": ours.pool_bytes,
        "host_cache_bytes": ours.cache_bytes,
        "resident_state_bytes": ours.resident,
        "offloaded_state_bytes": ours.state_bytes,
        "gpu_peak_bytes": ours.gpu_peak,
        "torch_gpu_peak_bytes": torch_run.get("gpu_peak"),
        "pool_pinned": ours.pinned,
        "torch_step_s_median": torch_run.get("median"),
        "torch_peak_rss_bytes": torch_run.get("peak"),
        "step_vs_torch": _ratio(step_med, torch_run.get("median")),
        "fio_read_gib_s": fio_read,
        "fio_write_gib_s": fio_write,
        "disk_bound_s": bound,
        "ratio_to_bound": _ratio(step_med, bound),
        "baseline_ratio_to_bound": _ratio(base_med, base_bound),
        "backend": ours.backend,
        "config": {"aio": dataclasses.asdict(aio), "buffer_count": oc.buffer_count, "buffer_size": oc.buffer_size},
        "machine": machine,
    }
    result["drive_writes_per_day"] = report.drive_writes(written, step_med)[0]
    return result


def _rows(r: dict) -> list:
    """The table, from the JSON result."""
    step_med, size = r["step_s_median"], format_size
    rows = [
        ["step (median of steady steps)", f"{step_med:.3f} s ({_spread(r['step_s_runs'])})"],
        ["first step (nothing to read)", f"{r['first_step_s']:.3f} s"],
        ["read / written per step", f"{size(r['bytes_read_per_step'])} / {size(r['bytes_written_per_step'])}"],
        ["bytes per parameter per step: state read + written",
         f"{r['ledger']['bytes_per_param_iteration']['state read']:.2f} + "
         f"{r['ledger']['bytes_per_param_iteration']['state written']:.2f} = {r['ledger']['total']:.2f}"],
        ["drive writes at this step rate (optimizer alone)",
         report.drive_writes(r["bytes_written_per_step"], step_med)[1]],
    ]
    if r["unchecked_step_s_median"]:
        rows.append(["without checksums (same optimizer, in turn)",
                     f"{r['unchecked_step_s_median']:.3f} s: checksums cost {100 * r['checksum_cost']:+.1f}%"])
    base_med = r["baseline_step_s_median"]
    if base_med:
        ratio = r["bytes_vs_baseline"]
        rows += [
            ["without host cache: step",
             f"{base_med:.3f} s ({_spread(r['baseline_step_s_runs'])}; ours {r['step_vs_baseline']:.2f}x)"],
            ["without host cache: read / written",
             f"{size(r['baseline_bytes_read_per_step'])} / {size(r['baseline_bytes_written_per_step'])}"
             + (f" ({ratio:.2f}x)" if ratio is not None else "")],
        ]
    bound = r["disk_bound_s"]
    rows += [
        ["fio read / write", f"{report.fmt_gib(r['fio_read_gib_s'])} / {report.fmt_gib(r['fio_write_gib_s'])} GiB/s"],
        ["disk bound (fio)", f"{bound:.3f} s" if bound else "n/a"],
        ["step / disk bound", f"{r['ratio_to_bound']:.2f}x" if bound else "n/a"],
    ]
    if base_med:
        # Below 1x: the disk served reads faster than fio's cold reads (a VM's host caches recent writes).
        base_ratio = r["baseline_ratio_to_bound"]
        rows.append(["without host cache: step / disk bound", f"{base_ratio:.2f}x" if base_ratio else "n/a"])
    over, held = r["rss_over_base_bytes"], r["host_pool_bytes"] + r["host_cache_bytes"]
    torch_med, torch_peak = r["torch_step_s_median"], r["torch_peak_rss_bytes"]
    rows += [
        [f"torch AdamW(fused) step, state resident {'on the GPU' if r['device'] == 'cuda' else 'in memory'}",
         f"{torch_med:.3f} s ({r['step_vs_torch']:.2f}x)" if torch_med else "n/a"],
        ["state / resident in host memory", f"{size(r['offloaded_state_bytes'])} / {size(r['resident_state_bytes'])}"],
        ["host pool + cache", f"{size(r['host_pool_bytes'])} + {size(r['host_cache_bytes'])}"],
        ["peak RSS above params+grads", f"{size(over)} ({over / held:.2f}x pool + cache)" if held else size(over)],
        ["torch peak RSS above params+grads", size(torch_peak - r["base_rss_bytes"]) if torch_peak else "n/a"],
    ]
    if r["gpu_peak_bytes"] is not None:
        torch_gpu = r["torch_gpu_peak_bytes"]
        rows += [["GPU memory peak (params, grads and one unit's update)", size(r["gpu_peak_bytes"])],
                 ["GPU memory peak, torch AdamW(fused)", size(torch_gpu) if torch_gpu else "n/a"]]
    pinned = r["pool_pinned"]
    rows.append(["pool pinned", "no pool" if pinned is None else "yes" if pinned else "no"])
    return rows


def _spread(times: list) -> str:
    return f"{min(times):.3f}-{max(times):.3f} s over {len(times)} steps"


def _cache_text(cache) -> str:
    return cache if cache == "auto" else format_size(cache)


def _timed_step(opt, times: list, moved: list) -> None:
    r0, w0 = opt.io_bytes()
    times.extend(_time_steps(opt, 1))
    r1, w1 = opt.io_bytes()
    moved.append((r1 - r0, w1 - w0))
