"""The native engine alone against fio on the same file, same block size, queue depth and thread count.

    python bench/engine_vs_fio.py [--path DIR] [--size 1GiB] [--rounds 6] [--json FILE]

Below the swap space (``offload-bench io`` measures through it): one Engine writes and reads one file
with requests of a pool buffer each (all buffers in flight, registered as fixed buffers), and fio
runs ``--rw=write|read --bs=1M --iodepth=32 --ioengine=io_uring --direct=1`` on the same file. The
two alternate, and which goes first alternates each round, because this kind of disk is noisy and
tends to favour whoever runs second. One untimed write pass first: the first write into freshly
preallocated space converts unwritten extents and would penalise whoever did it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from offload.aio import Engine
from offload.buffers import BufferPool
from offload.pipeline import Pipeline
from offload.sizes import GIB, parse_size


def ours(engine, pool, f, op: str, size: int) -> float:
    """GiB/s of ``op`` over ``size`` bytes of ``f``, one request per buffer, every buffer in flight."""
    chunk = pool.buffer_size
    io = lambda i, buf: (engine.write_async if op == "write" else engine.read_async)(f, buf, i * chunk)  # noqa: E731
    start = time.perf_counter()
    if op == "write":
        Pipeline(list(pool)).run(range(size // chunk), process=lambda i, buf: True, write=io)
    else:
        Pipeline(list(pool)).run(range(size // chunk), read=io, process=lambda i, buf: False)
    return size / (time.perf_counter() - start) / GIB


def fio(path: str, op: str, size: int, block_size: int, queue_depth: int) -> float:
    out = subprocess.run(
        ["fio", "--output-format=json", "--name=job", f"--filename={path}", f"--rw={op}", f"--bs={block_size}",
         f"--iodepth={queue_depth}", "--ioengine=io_uring", "--direct=1", f"--size={size}"],
        capture_output=True, text=True, check=True,
    ).stdout
    job = json.loads(out)["jobs"][0][op]
    return job["io_bytes"] / (job["runtime"] / 1000) / GIB


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--path", help="directory for the test file (default: a scratch directory, removed after)")
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--block-size", default="1MiB")
    ap.add_argument("--queue-depth", type=int, default=32)
    ap.add_argument("--chunk", default="64MiB", help="bytes per engine request (one pool buffer)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--json", help="write the figures as JSON")
    args = ap.parse_args(argv)
    if shutil.which("fio") is None:
        print("fio is not installed: apt-get install fio", file=sys.stderr)
        return 1
    size, bs, chunk = parse_size(args.size), parse_size(args.block_size), parse_size(args.chunk)
    if size % chunk:
        ap.error(f"--size must be a multiple of --chunk ({chunk} bytes)")
    directory = args.path or tempfile.mkdtemp(prefix="engine-vs-fio-")
    path = os.path.join(directory, f"engine-vs-fio-{os.getpid()}")
    runs: dict[str, list[float]] = {k: [] for k in ("ours_write", "fio_write", "ours_read", "fio_read")}
    try:
        with Engine(block_size=bs, queue_depth=args.queue_depth, thread_count=1) as engine, \
                BufferPool(4, chunk) as pool:
            engine.register_buffers(pool)
            print(f"engine backend {engine.backend}, fixed buffers {engine.stats()['fixed_buffers']}, "
                  f"{args.size} at {args.block_size}, queue depth {args.queue_depth}, one thread, O_DIRECT")
            with engine.open(path, "w+") as f:
                os.posix_fallocate(f.fd, 0, size)
                ours(engine, pool, f, "write", size)
                for r in range(args.rounds):
                    for op in ("write", "read"):
                        pair = [("ours", lambda op=op: ours(engine, pool, f, op, size)),
                                ("fio", lambda op=op: fio(path, op, size, bs, args.queue_depth))]
                        for name, run in pair if r % 2 == 0 else pair[::-1]:
                            runs[f"{name}_{op}"].append(run())
    finally:
        if os.path.exists(path):
            os.remove(path)
        if not args.path:
            shutil.rmtree(directory, ignore_errors=True)
    result = {}
    for op in ("write", "read"):
        a, b = statistics.median(runs[f"ours_{op}"]), statistics.median(runs[f"fio_{op}"])
        by_run = [x / y for x, y in zip(runs[f"ours_{op}"], runs[f"fio_{op}"])]
        result[op] = {"ours_gib_s": a, "fio_gib_s": b, "ratio": a / b, "ratio_runs": by_run,
                      "ours_runs": runs[f"ours_{op}"], "fio_runs": runs[f"fio_{op}"]}
        print(f"{op:5s} ours {a:.2f} GiB/s, fio {b:.2f} GiB/s: {a / b:.2f}x "
              f"(run by run {', '.join(f'{x:.2f}' for x in by_run)})")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
