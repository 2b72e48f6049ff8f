"""``offload-bench gpu``: copies between the host pool and the GPU, pinned against pageable, and the CUDA
helpers the other benchmarks share (the device check, synchronisation, memory peaks, the pool's pinning)."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Iterable

import torch

from .. import copies
from ..buffers import BufferPool
from ..progress import tracked
from . import report
from .cli import BenchError, add_config_option, check_output_file, positive_int_arg, short_size, size_arg

GB = 1e9  # copy rates in GB/s (10^9 bytes), as CUDA's bandwidth tests give them


# -- shared with adam and params ---------------------------------------------------------------------


def require_cuda(device: torch.device | str, what: str = "--device cuda") -> None:
    """Raise :class:`BenchError` when ``device`` is a CUDA device and torch sees none."""
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a build without CUDA"
        raise BenchError(f"{what} needs a CUDA device, and torch sees none (torch {torch.__version__}, {build})")


def synchronize(device: torch.device) -> None:
    """Wait for the GPU's queued work (its kernels and copies return before they finish)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_gpu_peak(device: torch.device) -> None:
    """Restart ``torch.cuda.max_memory_allocated`` of ``device`` (nothing off the GPU)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def gpu_peak(device: torch.device) -> int | None:
    """``torch.cuda.max_memory_allocated`` since the last :func:`reset_gpu_peak`; None off the GPU."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def pool_pinned(pools: Iterable[BufferPool | None]) -> bool | None:
    """Whether every buffer of the given pools is registered with CUDA; None when there is no pool."""
    buffers = [b for pool in pools if pool is not None for b in pool]
    return all(b.pinned for b in buffers) if buffers else None


def pinned_text(pinned: bool | None, setting: Any) -> str:
    """``yes``/``no``/``no pool``, with the ``pin_memory`` setting that gave it."""
    word = "no pool" if pinned is None else "yes" if pinned else "no"
    return f"{word} (pin_memory {setting})"


def fmt_gb(x: float | None) -> str:
    """GB with one decimal, or ``n/a``."""
    return "n/a" if x is None else f"{x:.1f}"


# -- the gpu subcommand ------------------------------------------------------------------------------


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """Add the ``gpu`` subcommand."""
    p = sub.add_parser(
        "gpu", parents=[common], help="host pool <-> GPU copy GB/s, pinned against pageable",
        description="Copy --size bytes between the host buffer pool and GPU memory, host to device, device to "
                    "host, and both at once on two CUDA streams; from the pool pinned with cudaHostRegister "
                    "and from the same pool unpinned (pageable), in turn within every round.",
    )
    p.add_argument("--size", type=size_arg, default=1 << 30, metavar="SIZE",
                   help="bytes copied each way per measurement (default 1GiB)")
    p.add_argument("--buffer-size", type=size_arg, default=None, metavar="SIZE",
                   help="bytes per pool buffer and per copy (default: offload_optimizer.buffer_size of --config)")
    p.add_argument("--buffers", type=positive_int_arg(2), default=None, metavar="N",
                   help="pool buffers (default: offload_optimizer.buffer_count of --config)")
    p.add_argument("--rounds", type=positive_int_arg(1), default=5, metavar="N", help="rounds (default 5)")
    add_config_option(p)
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    p.set_defaults(run=run_gpu)


# Measurements in the order of the table: (name, direction, pinned).
MEASURES = [(f"{d}, {'pinned' if pin else 'pageable'}", d, pin)
            for d in ("host to device", "device to host", "both at once") for pin in (True, False)]


# NOTE: a copy moves one pool buffer to (or from) its own slice of one GPU tensor through offload.copies,
# as the optimizer's update does (its copy streams, one per direction); a measurement is the wall time from
# the first copy queued to the GPU idle again. "Both at once" alternates the host-to-device copies of half
# the buffers with the device-to-host copies of the other half, and counts the bytes of both directions.
# Pinned and pageable are two pools of the same kind and size (page-aligned mmap), one registered with CUDA,
# so only the pinning differs; they alternate within a round so that a change of clock or a neighbour weighs
# on both. From pageable memory a copy blocks the host until it is done, so "both at once, pageable" runs
# the two directions one after the other: it is the figure a pageable pool gets, not a concurrent one.
def run_gpu(args: argparse.Namespace) -> int:
    """``offload-bench gpu``."""
    require_cuda("cuda", "offload-bench gpu")
    check_output_file("--json", args.json)
    oc = args.config.offload_optimizer
    size = args.buffer_size or oc.buffer_size
    count = args.buffers or max(2, oc.buffer_count)
    device = torch.device("cuda", torch.cuda.current_device())
    machine = report.machine_info([])
    machine["gpu"] = torch.cuda.get_device_name(device)
    report.print_header("gpu", machine, [
        ("gpu", f"{machine['gpu']}, torch {torch.__version__}, CUDA {torch.version.cuda}"),
        ("pool", f"{count} x {short_size(size)} page-aligned buffers (mmap), pinned with cudaHostRegister "
                 "against the same unpinned"),
        ("copies", f"{short_size(args.size)} each way per measurement, one buffer per copy, "
                   f"{args.rounds} round(s)"),
    ])
    pinned = BufferPool(count, size, pin_memory=True)
    pageable = BufferPool(count, size, pin_memory=False)
    try:
        if not all(b.pinned for b in pinned):
            raise BenchError("cudaHostRegister refused the pool (see the warning above); nothing pinned "
                             "to measure")
        gpu = torch.empty(count * pinned.buffer_size, dtype=torch.uint8, device=device)
        _check_round_trip(pinned, gpu)
        ncopies = max(1, -(-args.size // pinned.buffer_size))
        runs: dict[str, list[float]] = {name: [] for name, _, _ in MEASURES}
        for _ in tracked(range(args.rounds), "gpu: rounds of copies"):
            for name, direction, pin in MEASURES:
                pool = pinned if pin else pageable
                moved, seconds = _copies(pool, gpu, direction, ncopies)
                runs[name].append(moved / seconds / GB)
    finally:
        pinned.close()
        pageable.close()

    med = {name: statistics.median(r) for name, r in runs.items()}
    rows = []
    for name, _, pin in MEASURES:
        r = runs[name]
        ratio = "" if not pin else f"{med[name] / med[name.replace('pinned', 'pageable')]:.1f}x"
        rows.append([name, fmt_gb(med[name]), fmt_gb(min(r)), fmt_gb(max(r)), ratio])
    print("GB/s (10^9 bytes per second); both at once counts the bytes of both directions")
    print(report.table(["copy", "median", "min", "max", "pinned/pageable"], rows))
    result = {
        "gpu": machine["gpu"], "bytes_per_direction": ncopies * pinned.buffer_size,
        "buffer_size": pinned.buffer_size, "buffer_count": count, "rounds": args.rounds,
        "gb_s_median": {name: med[name] for name, _, _ in MEASURES},
        "gb_s_runs": runs, "machine": machine,
    }
    if args.json:
        report.write_json(args.json, result)
        print(f"wrote {args.json}")
    return 0


def _copies(pool: BufferPool, gpu: torch.Tensor, direction: str, ncopies: int) -> tuple[int, float]:
    """Queue ``ncopies`` buffer-sized copies in ``direction`` and wait for them; (bytes moved, seconds)."""
    n = pool.buffer_size
    bufs = list(pool)
    slices = [gpu[i * n:(i + 1) * n] for i in range(len(bufs))]
    torch.cuda.synchronize()
    t = time.perf_counter()
    tickets = []
    if direction == "both at once":
        half = len(bufs) // 2
        for i in range(ncopies):
            k = i % half
            tickets.append(copies.into_device(slices[k], bufs[k].tensor))
            k = half + i % (len(bufs) - half)
            tickets.append(copies.to_host(bufs[k].tensor, slices[k]))
        moved = 2 * ncopies * n
    else:
        for i in range(ncopies):
            k = i % len(bufs)
            if direction == "host to device":
                tickets.append(copies.into_device(slices[k], bufs[k].tensor))
            else:
                tickets.append(copies.to_host(bufs[k].tensor, slices[k]))
        moved = ncopies * n
    copies.waited(tickets)
    torch.cuda.synchronize()
    return moved, time.perf_counter() - t


def _check_round_trip(pool: BufferPool, gpu: torch.Tensor) -> None:
    """One buffer of random bytes to the GPU and back into another: the copies move the right bytes."""
    a, b = pool[0].tensor, pool[1].tensor
    a.copy_(torch.randint(0, 256, a.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(0)))
    n = pool.buffer_size
    sent = copies.into_device(gpu[:n], a)
    copies.waited([sent, copies.to_host(b, gpu[:n])])
    if not torch.equal(a, b):
        raise BenchError("a buffer copied to the GPU and back differs from what was sent")


__all__ = ["GB", "fmt_gb", "gpu_peak", "pinned_text", "pool_pinned", "register", "require_cuda",
           "reset_gpu_peak", "run_gpu", "synchronize"]
