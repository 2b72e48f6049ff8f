"""``offload-bench params``: training steps of a block stack whose weights live on NVMe."""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Any, Optional

import torch

from .._proc import reset_peak_rss
from ..adam import OffloadedAdamW
from ..params import offload_parameters, offloaded, restore_parameters
from ..progress import tracked
from ..sizes import format_size
from ..state import resolve_pin
from . import overlap, report
from .cli import BenchError, add_config_option, add_path_option, bench_paths, config_given, positive_int_arg
from .fio import write_read_gib_s
from .gpu import gpu_peak, pinned_text, pool_pinned, require_cuda, reset_gpu_peak, synchronize
from .ledger import Meter, counters_of, render
from .workload import block_model, io_only


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """Add the ``params`` subcommand."""
    p = sub.add_parser(
        "params", parents=[common], help="training steps with weights on NVMe vs I/O alone and compute alone",
        description="Train a stack of transformer-like blocks (Linear h->4h, GELU, Linear 4h->h, LayerNorm) "
                    "with offload_parameters and OffloadedAdamW; compare the step with the same bytes moved "
                    "without compute and the same model stepped in memory by torch AdamW(fused).",
    )
    p.add_argument("--layers", type=positive_int_arg(1), default=24, metavar="N", help="blocks (default 24)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                   help="weight dtype; bf16 keeps an fp32 master copy with the optimizer state (default bf16)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the model computes; cuda needs a GPU (default cpu)")
    p.add_argument("--steps", type=positive_int_arg(2), default=5, metavar="N",
                   help="training steps; the first (records the order, creates state) is reported apart")
    p.add_argument("--prefetch", type=positive_int_arg(0), default=2, metavar="N",
                   help="submodules read ahead (default 2)")
    p.add_argument("--no-grad-offload", dest="offload_grads", action="store_false",
                   help="keep ordinary full-size grads in memory (offload_grads=False)")
    p.add_argument("--no-fio", action="store_true", help="skip the fio bound")
    add_path_option(p)
    add_config_option(p)
    overlap.add_options(p)
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    p.set_defaults(run=run_params)


def _train_step(model, opt, x, meter: Optional[Meter] = None) -> float:
    """One iteration, timed; ``meter`` counts what each of its phases moves."""
    phase = meter.phase if meter is not None else (lambda name: None)
    if meter is not None:
        meter.start()
    t = time.perf_counter()
    loss = model(x).float().square().mean()
    phase("forward")
    loss.backward()
    phase("backward")
    opt.step()
    opt.zero_grad(set_to_none=True)
    synchronize(x.device)  # the GPU's kernels return before they finish
    elapsed = time.perf_counter() - t
    if meter is not None:
        phase("step")
        meter.end()
    return elapsed


# NOTE: a step here is forward + backward + OffloadedAdamW step with offload_parameters on the model.
# Two references are measured in the same run: ``io_only_s``, the time the same swap space takes to
# read and write the bytes one step moved (weights and optimizer state, reads and writes overlapped,
# no compute), and ``compute_only_s``, the same model fully resident (on --device) stepped by torch's
# fused AdamW. A step cannot be faster than the larger of the two; the target is within 1.2x of it. The
# grads' own traffic (written in backward, read by the optimizer) counts in ``io_only_s``; fio on the
# same path gives the disk's bound for the same bytes (``disk_bound_s``). Memory:
# ``resident_param_bytes_max`` and ``grad_bytes_resident_max`` are the store's counts of weight and
# gradient bytes materialised at once, which must stay near one block's, not the model's; on a GPU,
# ``gpu_peak_bytes`` (torch.cuda.max_memory_allocated over the steady steps) against the resident
# model's ``torch_gpu_peak_bytes``.
def run_params(args: argparse.Namespace) -> int:
    """``offload-bench params``."""
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    device = torch.device(args.device)
    require_cuda(device)
    cfg = args.config
    h = args.hidden or 2048
    if args.overlap:
        with bench_paths(args.paths) as paths:
            overlap.run_overlap(args, paths, layers=args.layers, hidden=h, dtype=dtype, device=device,
                                weights_offloaded=True)
        return 0
    if args.batch == "auto":
        raise BenchError("--batch auto goes with --overlap")
    args.batch = args.batch or 16
    with bench_paths(args.paths) as paths:
        # Every weight goes through the disk, and with grad offload every grad (max_grad_in_cpu 0: else
        # the default keeps up to 1e9 elements of grads in host memory); buffers of one H x 4H matrix unless
        # the config says otherwise.
        pc = {"nvme_path": list(paths), "max_in_cpu": 0, "max_grad_in_cpu": 0}
        if not config_given(args):
            pc.update(buffer_size=4 * h * h, buffer_count=5)
        cfg = cfg.replace(offload_param=pc, offload_optimizer={"nvme_path": list(paths)})
        machine = report.machine_info(paths)
        model = block_model(args.layers, h, dtype, device)
        n_params = sum(p.numel() for p in model.parameters())
        pc_, oc_ = cfg.offload_param, cfg.offload_optimizer
        on_gpu = [torch.empty(0, device=device)]
        report.print_header("params", machine, [
            ("model", f"{args.layers} blocks, hidden {h}, {n_params:,} {args.dtype} parameters on {device.type} "
                      f"({format_size(n_params * model[0].up.weight.element_size())})"),
            ("steps", f"{args.steps}, batch {args.batch}, prefetch {args.prefetch}, "
                      f"grads {'on NVMe' if args.offload_grads else 'in memory'}"),
            ("param pool", f"{pc_.buffer_count} x {pc_.buffer_size:,} elements, pinned: "
                           f"{pinned_text(resolve_pin(pc_.pin_memory, on_gpu), pc_.pin_memory)}"),
            ("optimizer pool", f"{oc_.buffer_count} x {format_size(oc_.buffer_size)}, pinned: "
                               f"{pinned_text(resolve_pin(oc_.pin_memory, on_gpu), oc_.pin_memory)}"),
        ])
        x = torch.randn(args.batch, h, generator=torch.Generator().manual_seed(1)).to(device, dtype)

        # Compute alone: the same model resident, torch's fused AdamW.
        ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        _train_step(model, ref_opt, x)
        reset_gpu_peak(device)
        compute = [_train_step(model, ref_opt, x)
                   for _ in tracked(range(args.steps - 1), "params: steps in memory (torch AdamW)")]
        compute_s = statistics.median(compute)
        torch_gpu_peak = gpu_peak(device)
        del ref_opt, model
        gc.collect()
        model = block_model(args.layers, h, dtype, device)
        gc.collect()

        offload_parameters(model, config=cfg, prefetch=args.prefetch, offload_grads=args.offload_grads)
        store = offloaded(model).store
        opt = OffloadedAdamW(model.parameters(), lr=1e-4, config=cfg)
        try:
            first = _train_step(model, opt, x)  # records the order, creates the state
            r0, w0 = store.bytes_read, store.bytes_written
            gr0, gw0 = store.grad_bytes_read, store.grad_bytes_written
            or0, ow0 = opt.io_bytes()
            store.reset_peak()
            store.reset_grad_peak()
            reset_peak_rss()
            reset_gpu_peak(device)
            meter = Meter(sum(p.numel() for p in model.parameters()), counters_of(opt, store))
            times = [_train_step(model, opt, x, meter)
                     for _ in tracked(range(args.steps - 1), "params: offloaded steps")]
            ledger = meter.ledger()
            peak = report.memory_bytes("VmHWM")
            our_gpu_peak = gpu_peak(device)
            steady = len(times)
            fetch = (store.bytes_read - r0) // steady
            write = (store.bytes_written - w0) // steady
            grad_read = (store.grad_bytes_read - gr0) // steady
            grad_write = (store.grad_bytes_written - gw0) // steady
            or1, ow1 = opt.io_bytes()
            opt_read, opt_write = (or1 - or0) // steady, (ow1 - ow0) // steady
            resident_max = store.resident_bytes_max
            # Without grad offload every trainable parameter's grad is resident at the step.
            grad_max = (store.grad_resident_bytes_max if args.offload_grads else
                        sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad))
            grad_pool = opt.grad_pool_bytes
            pool_bytes = store.pool.nbytes
            param_pinned = pool_pinned([store.pool])
            opt_pinned = pool_pinned([opt.state_store.pool])
            hits, dropped = store.prefetch_hits, store.prefetches_dropped
        finally:
            opt.close()
            restore_parameters(model)
        step_med = statistics.median(times)
        read_total, write_total = fetch + opt_read + grad_read, write + opt_write + grad_write
        io_s = io_only(paths, cfg.aio, read_total, write_total)
        fio_write = fio_read = None
        if not args.no_fio:
            aio = cfg.aio
            fio_write, fio_read = write_read_gib_s(paths, min(max(read_total, write_total), 1 << 30),
                                                   aio.block_size, aio.queue_depth, aio.thread_count)

    largest = max(sum(p.numel() * p.element_size() for p in m.parameters(recurse=False)) for m in model.modules())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bound = max(io_s, compute_s)
    disk_bound = report.disk_bound(read_total, write_total, fio_read, fio_write)
    result: dict[str, Any] = {
        "params": n_params,
        "device": device.type,
        "step_s_median": step_med,
        "fetch_bytes_per_step": fetch,
        "weight_bytes": weight_bytes,
        "fetch_vs_weights": fetch / weight_bytes,
        "drive_writes_per_day": report.drive_writes(write + opt_write + grad_write, step_med)[0],
        "write_bytes_per_step": write,
        "io_only_s": io_s,
        "compute_only_s": compute_s,
        "fio_read_gib_s": fio_read,
        "fio_write_gib_s": fio_write,
        "disk_bound_s": disk_bound,
        "peak_rss_bytes": peak,
        "gpu_peak_bytes": our_gpu_peak,
        "torch_gpu_peak_bytes": torch_gpu_peak,
        "param_pool_pinned": param_pinned,
        "optimizer_pool_pinned": opt_pinned,
        "resident_param_bytes_max": resident_max,
        "grad_bytes_resident_max": grad_max,
        "grad_read_bytes_per_step": grad_read,
        "grad_write_bytes_per_step": grad_write,
        "grad_pool_bytes": grad_pool,
        "offload_grads": args.offload_grads,
        "dtype": args.dtype,
        "layers": args.layers,
        "hidden": h,
        "step_s_runs": times,
        "first_step_s": first,
        "optimizer_read_bytes_per_step": opt_read,
        "optimizer_write_bytes_per_step": opt_write,
        "ratio_to_bound": step_med / bound,
        "param_pool_bytes": pool_bytes,
        "largest_module_param_bytes": largest,
        "prefetch_hits": hits,
        "prefetches_dropped": dropped,
        "ledger": ledger.to_dict(),
        "machine": machine,
    }
    resident = "GPU" if device.type == "cuda" else "memory"
    rows = [
        ["step (median of steady steps)", f"{step_med:.3f} s"],
        ["first step (records order, creates state)", f"{first:.3f} s"],
        ["weights read / written per step", f"{format_size(fetch)} / {format_size(write)} ({fetch / weight_bytes:.2f}x"
         f" / {write / weight_bytes:.2f}x the weights; forward and backward need 2x / 1x)"],
        ["drive writes at this step rate", report.drive_writes(write + opt_write + grad_write, step_med)[1]],
        ["optimizer state read / written per step", f"{format_size(opt_read)} / {format_size(opt_write)}"],
        ["grads read / written per step", f"{format_size(grad_read)} / {format_size(grad_write)}"],
        ["same bytes, I/O only", f"{io_s:.3f} s"],
        ["fio read / write", f"{report.fmt_gib(fio_read)} / {report.fmt_gib(fio_write)} GiB/s"],
        ["disk bound (fio, same bytes)", f"{disk_bound:.3f} s ({step_med / disk_bound:.2f}x)" if disk_bound
         else "n/a"],
        [f"same model resident in {resident}, torch AdamW(fused)", f"{compute_s:.3f} s"],
        ["step / max(I/O, compute)", f"{step_med / bound:.2f}x"],
        ["resident weights, peak", f"{format_size(resident_max)} (largest module {format_size(largest)}, "
                                   f"param pool {format_size(pool_bytes)})"],
        ["resident grads, peak", f"{format_size(grad_max)} (optimizer's grad buffers {format_size(grad_pool)})"],
        ["peak RSS", format_size(peak)],
    ]
    rows += [[f"bytes per parameter per iteration: {kind}", value] for kind, value in render([("", ledger)])]
    if our_gpu_peak is not None:
        rows += [["GPU memory peak", format_size(our_gpu_peak)],
                 ["GPU memory peak, model resident (torch)", format_size(torch_gpu_peak)]]
    rows.append(["pools pinned (param / optimizer)", f"{_yes(param_pinned)} / {_yes(opt_pinned)}"])
    print(report.table(["", "value"], rows))
    if args.json:
        report.write_json(args.json, result)
        print(f"wrote {args.json}")
    return 0


def _yes(pinned: bool | None) -> str:
    return "no pool" if pinned is None else "yes" if pinned else "no"
