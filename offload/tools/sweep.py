"""``offload-bench sweep``: measure a grid of aio settings through the swap space and pick the best."""

from __future__ import annotations

import argparse
import itertools
import json
from typing import Any, Sequence

from ..buffers import BufferPool
from ..config import AioConfig, config_to_dict
from ..progress import progress
from ..sizes import MIB
from . import report
from .cli import bench_paths, block_size_arg, list_arg, positive_int_arg, short_size
from .io import (
    Data,
    Point,
    PointResult,
    add_pass_options,
    check_pass_args,
    config_doc,
    measure,
    passes,
    plot_title,
    setup_run,
)


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """Add the ``sweep`` subcommand."""
    sweep = sub.add_parser(
        "sweep", parents=[common], help="measure a grid of aio settings and pick the best",
        description="Measure every combination of block size, queue depth and threads; print them sorted "
                    "by the mean of read and write GiB/s, and the best point.",
    )
    add_pass_options(sweep)
    sweep.add_argument("--block-sizes", type=list_arg(block_size_arg), default=[128 << 10, MIB, 4 * MIB],
                       metavar="LIST", help="comma-separated block sizes (default 128KiB,1MiB,4MiB)")
    sweep.add_argument("--queue-depths", type=list_arg(positive_int_arg(1, 4096)), default=[8, 32, 128],
                       metavar="LIST", help="comma-separated queue depths (default 8,32,128)")
    sweep.add_argument("--threads", type=list_arg(positive_int_arg(1, 64)), default=[1, 2, 4],
                       metavar="LIST", help="comma-separated worker thread counts (default 1,2,4)")
    sweep.add_argument("--runs", type=positive_int_arg(1), default=2, metavar="N",
                       help="runs per point (default 2)")
    sweep.add_argument("--emit-config", metavar="FILE",
                       help='write the best point as an {"aio": {...}} JSON config block')
    sweep.set_defaults(run=run_sweep)


def run_sweep(args: argparse.Namespace) -> int:
    """``offload-bench sweep``."""
    grid = itertools.product(args.block_sizes, args.queue_depths, args.threads)
    points = [Point(b, q, t) for b, q, t in grid]
    fio = check_pass_args(args, args.block_sizes)
    with bench_paths(args.paths) as paths:
        plan_, machine, params = setup_run(args, paths, points, fio)
        params[1:1] = [("grid", f"block sizes {','.join(short_size(b) for b in args.block_sizes)}; "
                                f"queue depths {','.join(map(str, args.queue_depths))}; "
                                f"threads {','.join(map(str, args.threads))} ({len(points)} points)")]
        report.print_header("sweep", machine, params)
        done: list[PointResult] = []
        with BufferPool(plan_.buffer_count, plan_.chunk) as pool, \
                progress(len(points) * passes(args.runs, fio), "sweep: passes over the grid", delay=0) as bar:
            data = Data(pool, plan_.chunk)
            for point in points:
                bar.set_postfix_str(point.label(), refresh=False)
                done.append(measure(paths, point, plan_, pool, data, runs=args.runs, backend=args.backend,
                                    verify=args.verify, fio=fio, bar=bar))
    ranked = sorted(done, key=lambda r: r.mean, reverse=True)
    best = ranked[0]
    _print_sweep(ranked)
    best_doc = {"block_size": best.point.block_size, "queue_depth": best.point.queue_depth,
                "threads": best.point.threads, "write_gib_s": best.write.median,
                "read_gib_s": best.read.median, "mean_gib_s": best.mean}
    print(f"best: {best.point.label()}: write {best.write.median:.3f}, read {best.read.median:.3f}, "
          f"mean {best.mean:.3f} GiB/s")
    if args.emit_config:
        block = aio_block(best.point, args.backend)
        report.write_json(args.emit_config, {"aio": block})
        print(f"wrote {args.emit_config}: {json.dumps({'aio': block})}")
    results = [r.to_json(pr.point) for pr in done for r in (pr.write, pr.read)]
    config = config_doc(args, paths, plan_, {"block_sizes": list(args.block_sizes),
                                              "queue_depths": list(args.queue_depths),
                                              "threads": list(args.threads)})
    config.update(backend_used=done[0].backend, stripe_unit="block_size")
    if args.json:
        doc = {"config": config, "machine": machine, "results": results, "best": best_doc}
        report.write_json(args.json, doc)
        print(f"wrote {args.json}")
    if args.plot:
        report.plot_sweep(args.plot, results, plot_title(machine, paths, None))
        print(f"wrote {args.plot}")
    return 0


def aio_block(point: Point, backend: str = "auto") -> dict[str, Any]:
    """The ``aio`` config block for a point, as the config loader writes it (and reads it back unchanged)."""
    aio = AioConfig(block_size=point.block_size, queue_depth=point.queue_depth, thread_count=point.threads,
                    backend=backend)
    return config_to_dict(aio)["aio"]


def _print_sweep(ranked: Sequence[PointResult]) -> None:
    has_fio = bool(ranked[0].write.fio_runs)
    headers = ["block size", "queue depth", "threads", "write", "read", "mean"]
    if has_fio:
        headers += ["write/fio", "read/fio"]
    rows = []
    for r in ranked:
        row = [short_size(r.point.block_size), str(r.point.queue_depth), str(r.point.threads),
               report.fmt_gib(r.write.median), report.fmt_gib(r.read.median), report.fmt_gib(r.mean)]
        if has_fio:
            row += [report.fmt_ratio(r.write.ratio), report.fmt_ratio(r.read.ratio)]
        rows.append(row)
    print("GiB/s, median of runs, sorted by the mean of write and read")
    print(report.table(headers, rows))
    print()


__all__ = ["aio_block", "register", "run_sweep"]
