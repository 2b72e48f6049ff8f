"""``offload-bench checkpoint``: streaming checkpoint save/load against fio and torch.save/torch.load, and with
``--async`` a training loop's iteration time while a save runs in the background."""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch

from .. import checkpoint as ckpt
from ..adam import OffloadedAdamW
from ..progress import tracked
from ..sizes import GIB, format_size
from . import report
from .cli import (
    UsageError,
    add_config_option,
    add_path_option,
    bench_paths,
    check_free_space,
    count_arg,
    positive_int_arg,
)
from .fio import write_read_gib_s
from .workload import TENSOR_ELEMENTS, synthetic_params

# The keys of the JSON results (tests check them).
JSON_KEYS = ("state_bytes", "save_gib_s", "load_gib_s", "torch_save_gib_s", "torch_load_gib_s",
             "fio_write_gib_s", "fio_read_gib_s")
ASYNC_JSON_KEYS = ("state_bytes", "iteration_s", "iteration_async_save_s", "iteration_blocking_save_s",
                   "async_vs_none", "blocking_vs_none", "snapshot_s", "snapshot_method", "iteration_window_s",
                   "window_vs_none", "async_save_alone_s")


def add_parser(sub: argparse._SubParsersAction,
               common: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Add the ``checkpoint`` subcommand; its ``run`` is :func:`run`."""
    p = sub.add_parser(
        "checkpoint", parents=[common] if common is not None else [],
        help="checkpoint save/load GiB/s vs fio and torch.save/torch.load",
        description="Build a model-sized OffloadedAdamW state, then time save_checkpoint and load_checkpoint "
                    "next to fio write/read on the checkpoint path and torch.save/torch.load of the same state.",
    )
    p.add_argument("--params", type=count_arg, default=256_000_000, metavar="N",
                   help="number of fp32 parameters, e.g. 64M, 1G (default 256M; state is 8 bytes each)")
    add_path_option(p)
    p.add_argument("--ckpt-dir", metavar="DIR",
                   help="where checkpoints are written (default: the first --path); a scratch "
                        "subdirectory is made there and removed afterwards (and DIR too, if this made it)")
    p.add_argument("--repeat", type=positive_int_arg(1, 20), default=2, metavar="N",
                   help="saves and loads to time; the median is reported (default 2)")
    add_config_option(p)
    p.add_argument("--no-torch", action="store_true", help="skip the torch.save/torch.load comparison")
    p.add_argument("--no-fio", action="store_true", help="skip fio")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    p.add_argument("--async", dest="asynchronous", action="store_true",
                   help="time a training loop instead: iterations without saves, while an asynchronous save "
                        "runs, and with a blocking save, in one run; and the snapshot's time")
    p.add_argument("--iterations", type=positive_int_arg(2, 1000), default=4, metavar="N",
                   help="--async: iterations per save (a save starts every N iterations; default 4)")
    p.add_argument("--compute-ms", type=positive_int_arg(0, 100_000), default=500, metavar="MS",
                   help="--async: the forward and backward pass each iteration stands in for, as matrix "
                        "products on the CPU lasting about this long (default 500)")
    p.set_defaults(run=run)
    return p


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """Add the ``checkpoint`` subcommand (the hook ``offload.tools.cli`` calls)."""
    add_parser(sub, common)






def _drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


# NOTE: the figures are GiB of optimizer state per second. Save moves state from the swap space to
# the checkpoint directory (a read and a write per byte), load the other way, so where both live on
# one drive the drive's bound is 1 / (1/read + 1/write) GiB/s, not fio's write or read alone; both
# are reported. torch.save/torch.load write and read the same state materialised in memory (what
# ``state_dict()`` gives), fsynced like ours, and the file's pages are dropped from the page cache
# before torch.load so it reads the disk as ours does.
def run(args: argparse.Namespace) -> int:
    """``offload-bench checkpoint``; returns the exit code."""
    cfg = args.config
    made = None
    if args.ckpt_dir is not None:
        ckpt_dir = os.path.abspath(args.ckpt_dir)
        if os.path.exists(ckpt_dir) and not os.path.isdir(ckpt_dir):
            raise UsageError(f"--ckpt-dir {args.ckpt_dir} is not a directory")
        if not os.path.exists(ckpt_dir):
            if not os.path.isdir(os.path.dirname(ckpt_dir)):
                raise UsageError(f"--ckpt-dir {args.ckpt_dir}: directory {os.path.dirname(ckpt_dir)} does not exist")
            os.mkdir(ckpt_dir)
            made = ckpt_dir
    try:
        with bench_paths(args.paths) as paths:
            cfg = cfg.replace(offload_optimizer=cfg.offload_optimizer.replace(nvme_path=tuple(paths)))
            scratch = tempfile.mkdtemp(prefix="offload-bench-ckpt-", dir=args.ckpt_dir or paths[0])
            try:
                return (_run_loop if args.asynchronous else _run)(args, cfg, paths, scratch)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
    finally:
        if made is not None:
            try:
                os.rmdir(made)  # only if still empty: anything else in it is not ours
            except OSError:
                pass


def _run(args, cfg, paths, scratch) -> int:
    oc, aio = cfg.offload_optimizer, cfg.aio
    machine = report.machine_info(sorted({*paths, scratch}))
    report.print_header("checkpoint", machine, [
        ("params", f"{args.params:,} fp32 in tensors of {TENSOR_ELEMENTS:,}"),
        ("swap path(s)", ", ".join(paths)),
        ("checkpoint dir", scratch),
        ("pool", f"{oc.buffer_count} x {format_size(oc.buffer_size)}"),
        ("aio", f"block size {format_size(aio.block_size)}, queue depth {aio.queue_depth}, "
                f"{aio.thread_count} thread(s), backend {aio.backend}"),
        ("repeat", str(args.repeat)),
    ])
    state_estimate = args.params * 8
    check_free_space([scratch], 2 * state_estimate + (state_estimate if not args.no_torch else 0),
                     "two checkpoints (and torch.save's copy)")

    params = synthetic_params(args.params)
    opt = OffloadedAdamW(params, lr=1e-3, config=cfg)
    target = os.path.join(scratch, "ckpt")
    try:
        opt.step()  # creates the state
        for p in params:
            p.grad = None
        gc.collect()
        saves, loads = [], []
        for _ in tracked(range(args.repeat), "checkpoint: saves"):
            t = time.perf_counter()
            ckpt.save_checkpoint(opt, target)
            saves.append(time.perf_counter() - t)
        manifest = ckpt.read_manifest(target)
        state_bytes = sum(f["bytes"] for f in manifest["files"].values())
        for _ in tracked(range(args.repeat), "checkpoint: loads"):
            t = time.perf_counter()
            ckpt.load_checkpoint(opt, target)
            loads.append(time.perf_counter() - t)
        backend = opt.swap_space.backend
        sd = None if args.no_torch else opt.state_dict()
    finally:
        opt.close()
    del opt, params
    gc.collect()

    torch_save = torch_load = None
    if sd is not None:
        path = os.path.join(scratch, "torch.pt")

        def save():
            with open(path, "wb") as f:
                torch.save(sd, f)
                f.flush()
                os.fsync(f.fileno())  # as durable as our checkpoint

        torch_save = _timed(save)
        del sd
        gc.collect()
        _drop_cache(path)
        torch_load = _timed(lambda: torch.load(path, weights_only=True))
        os.unlink(path)
        gc.collect()
    shutil.rmtree(target, ignore_errors=True)

    fio_write = fio_read = None
    if not args.no_fio:
        fio_write, fio_read = write_read_gib_s([scratch], min(state_bytes, 4 << 30), aio.block_size,
                                               aio.queue_depth, aio.thread_count)

    def rate(seconds):
        return state_bytes / seconds / GIB if seconds else None

    save_med, load_med = statistics.median(saves), statistics.median(loads)
    same_drive = len({os.stat(p).st_dev for p in (*paths, scratch)}) == 1
    copy_bound = 1 / (1 / fio_read + 1 / fio_write) if fio_read and fio_write else None
    result: dict[str, Any] = {
        "state_bytes": state_bytes,
        "save_gib_s": rate(save_med),
        "load_gib_s": rate(load_med),
        "torch_save_gib_s": rate(torch_save),
        "torch_load_gib_s": rate(torch_load),
        "fio_write_gib_s": fio_write,
        "fio_read_gib_s": fio_read,
        "params": args.params,
        "save_s_runs": saves,
        "load_s_runs": loads,
        "torch_save_s": torch_save,
        "torch_load_s": torch_load,
        "save_vs_fio_write": rate(save_med) / fio_write if fio_write else None,
        "load_vs_fio_read": rate(load_med) / fio_read if fio_read else None,
        "swap_and_checkpoint_on_one_drive": same_drive,
        "copy_bound_gib_s": copy_bound if same_drive else None,
        "backend": backend,
        "config": {"buffer_count": oc.buffer_count, "buffer_size": oc.buffer_size,
                   "block_size": aio.block_size, "queue_depth": aio.queue_depth},
        "machine": machine,
    }
    rows = [
        ["state", format_size(state_bytes), ""],
        ["save_checkpoint", f"{report.fmt_gib(result['save_gib_s'])} GiB/s",
         f"{result['save_vs_fio_write']:.2f}x fio write" if fio_write else ""],
        ["load_checkpoint", f"{report.fmt_gib(result['load_gib_s'])} GiB/s",
         f"{result['load_vs_fio_read']:.2f}x fio read" if fio_read else ""],
        ["torch.save (+fsync)", f"{report.fmt_gib(result['torch_save_gib_s'])} GiB/s", "state in memory"],
        ["torch.load (cold)", f"{report.fmt_gib(result['torch_load_gib_s'])} GiB/s", "state in memory"],
        ["fio write / read", f"{report.fmt_gib(fio_write)} / {report.fmt_gib(fio_read)} GiB/s", ""],
    ]
    if same_drive and copy_bound:
        rows.append(["copy bound, one drive", f"{report.fmt_gib(copy_bound)} GiB/s",
                     f"save {result['save_gib_s'] / copy_bound:.2f}x, load {result['load_gib_s'] / copy_bound:.2f}x"])
    print(report.table(["", "rate", "note"], rows))
    if args.json:
        report.write_json(args.json, result)
        print(f"wrote {args.json}")
    return 0


# -- --async: a training loop ------------------------------------------------------------------------


def _calibrated_compute(ms: int):
    """A stand-in for forward and backward: matrix products on the CPU lasting about ``ms`` milliseconds."""
    if ms <= 0:
        return lambda: None
    a = torch.randn(512, 512)
    t = time.perf_counter()
    for _ in range(4):
        a @ a
    per = (time.perf_counter() - t) / 4
    reps = max(1, round(ms / 1000 / per))
    return lambda: [a @ a for _ in range(reps)]


# NOTE: one run, three phases on the same optimizer, so the figures compare: iterations with no save,
# iterations while an asynchronous save started every --iterations iterations is in flight (the one
# that starts it included: the call's snapshot is part of it), and iterations that do a blocking save.
# "In flight" counts only the iterations that start before the save commits, so a save that ends sooner
# is judged on fewer, costlier iterations (the first step after a clone overwrites every shared block);
# the window (the call's iteration and the --iterations - 1 after it, whatever the save does) compares
# saves that end at different times, and the save alone (call to commit, no training) is its own time.
# An iteration is the compute stand-in then optimizer.step() over the whole state (every parameter
# has a grad). The snapshot time is the asynchronous call's own: a clone of the extents where the
# checkpoint directory is on the swap files' XFS or btrfs, else the copy of what is in memory.
def _run_loop(args, cfg, paths, scratch) -> int:
    oc = cfg.offload_optimizer
    compute = _calibrated_compute(args.compute_ms)
    machine = report.machine_info(sorted({*paths, scratch}))
    report.print_header("checkpoint --async", machine, [
        ("params", f"{args.params:,} fp32 in tensors of {TENSOR_ELEMENTS:,}"),
        ("swap path(s)", ", ".join(paths)),
        ("checkpoint dir", scratch),
        ("pool", f"{oc.buffer_count} x {format_size(oc.buffer_size)}"),
        ("iteration", f"about {args.compute_ms} ms of CPU matrix products, then the optimizer step"),
        ("saves", f"every {args.iterations} iterations, {args.repeat} of each kind"),
    ])
    check_free_space([scratch], 3 * args.params * 8, "three checkpoints")
    params = synthetic_params(args.params)
    opt = OffloadedAdamW(params, lr=1e-3, config=cfg)
    n = args.iterations

    def iteration() -> float:
        t = time.perf_counter()
        compute()
        opt.step()
        return time.perf_counter() - t

    try:
        iteration()  # creates the state
        plain = [iteration() for _ in tracked(range(n * args.repeat), "checkpoint: iterations without a save")]
        during, window, snapshots, method = [], [], [], None
        for k in tracked(range(args.repeat), "checkpoint: iterations with an asynchronous save"):
            t = time.perf_counter()
            compute()
            opt.step()
            c = time.perf_counter()
            handle = ckpt.save_checkpoint(opt, os.path.join(scratch, f"async-{k % 2}"), blocking=False)
            snapshots.append(time.perf_counter() - c)
            during.append(time.perf_counter() - t)
            window.append(during[-1])
            for _ in range(n - 1):
                busy = not handle.done()
                took = iteration()
                window.append(took)
                if busy:
                    during.append(took)
            handle.wait()
            method = ckpt.read_manifest(handle.directory)["snapshot"]["method"]
        alone = []  # the save from the call to its commit, with no training beside it
        for k in tracked(range(args.repeat), "checkpoint: asynchronous saves alone"):
            c = time.perf_counter()
            ckpt.save_checkpoint(opt, os.path.join(scratch, f"async-{k % 2}"), blocking=False).wait()
            alone.append(time.perf_counter() - c)
        blocking = []
        for k in tracked(range(args.repeat), "checkpoint: iterations with a blocking save"):
            t = time.perf_counter()
            compute()
            opt.step()
            ckpt.save_checkpoint(opt, os.path.join(scratch, f"blocking-{k % 2}"))
            blocking.append(time.perf_counter() - t)
            for _ in range(n - 1):
                iteration()
        state_bytes = opt.state_store.state_bytes
    finally:
        opt.close()
    base = statistics.median(plain)
    result: dict[str, Any] = {
        "state_bytes": state_bytes,
        "iteration_s": base,
        "iteration_async_save_s": statistics.mean(during),
        "iteration_blocking_save_s": statistics.mean(blocking),
        "async_vs_none": statistics.mean(during) / base,
        "blocking_vs_none": statistics.mean(blocking) / base,
        "snapshot_s": statistics.median(snapshots),
        "snapshot_method": method,
        "iteration_window_s": statistics.mean(window),
        "window_vs_none": statistics.mean(window) / base,
        "async_save_alone_s": statistics.median(alone),
        "iteration_window_s_runs": window,
        "async_save_alone_s_runs": alone,
        "iterations_during_async_saves": len(during),
        "iteration_s_runs": plain,
        "iteration_async_save_s_runs": during,
        "iteration_blocking_save_s_runs": blocking,
        "compute_ms": args.compute_ms,
        "params": args.params,
        "machine": machine,
    }
    print(report.table(["", "iteration", "vs no save"], [
        ["no save", f"{base:.3f} s", "1.00x"],
        ["async save in flight", f"{result['iteration_async_save_s']:.3f} s", f"{result['async_vs_none']:.2f}x"],
        ["the call and the next ones", f"{result['iteration_window_s']:.3f} s", f"{result['window_vs_none']:.2f}x"],
        ["blocking save", f"{result['iteration_blocking_save_s']:.3f} s", f"{result['blocking_vs_none']:.2f}x"],
        ["snapshot (the call)", f"{result['snapshot_s']:.3f} s", f"state.bin by {method}"],
        ["async save alone, call to commit", f"{result['async_save_alone_s']:.3f} s", "no training beside it"],
    ]))
    if args.json:
        report.write_json(args.json, result)
        print(f"wrote {args.json}")
    return 0
