"""``offload-bench io``: swap-space write and read throughput, beside fio if asked, and the measuring
machinery ``offload-bench sweep`` shares."""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from ..aio import Engine, open_file
from ..buffers import BufferPool, HostBuffer
from ..config import AioConfig
from ..pipeline import Pipeline
from ..progress import progress
from ..sizes import ALIGNMENT, GIB, MIB, round_up
from ..space import Extent, SwapSpace
from . import report
from .cli import (
    BenchError,
    UsageError,
    add_path_option,
    bench_paths,
    block_size_arg,
    check_free_space,
    check_output_file,
    positive_int_arg,
    short_size,
    size_arg,
)
from .fio import Fio, FioError, find_fio, fio_version, pick_engine

CHUNK = 64 * MIB  # bytes per request: large enough that Python's per-request cost vanishes
MIN_IN_FLIGHT = 256 * MIB
MAX_POOL = 2 << 30  # host memory the benchmark may take for its pool
STAMP_EVERY = ALIGNMENT  # one stamp per 4 KiB block: the smallest unit a misplaced write can move
_STAMP_STRIDE = STAMP_EVERY // 8  # in int64 elements


class VerifyError(BenchError):
    """Bytes read back differ from the bytes written."""


# -- the plan: points, chunks and the pool -------------------------------------------------------


@dataclass(frozen=True)
class Point:
    """One aio setting to measure."""

    block_size: int
    queue_depth: int
    threads: int

    def label(self) -> str:
        """The point as the report names it: block size, queue depth, threads."""
        return f"bs {short_size(self.block_size)} qd {self.queue_depth} threads {self.threads}"


@dataclass(frozen=True)
class Plan:
    """How ``size`` bytes are cut into requests, and the pool that carries them."""

    size: int
    chunk: int  # bytes per request (the last one may be shorter)
    buffer_count: int  # requests in flight, one per buffer

    @property
    def lengths(self) -> list[int]:
        """The requests' lengths: ``chunk`` bytes each, the last one shorter where ``size`` is not a multiple."""
        n, last = divmod(self.size, self.chunk)
        return [self.chunk] * n + ([last] if last else [])

    @property
    def pool_bytes(self) -> int:
        """Host memory of the pool."""
        return self.chunk * self.buffer_count


def plan(size: int, points: Sequence[Point], npaths: int) -> Plan:
    """Choose the request size and the number of buffers for every point of a run.

    The pool must hold at least twice the bytes the engines keep in flight, so the benchmark, not
    a Python refill, never limits the queue; at least four requests, so a pass is a pipeline even
    for small sizes; never more buffers than requests, nor more than ``MAX_POOL`` bytes.
    """
    max_bs = max(p.block_size for p in points)
    chunk = min(CHUNK, round_up(-(-size // 4), max_bs))
    chunk = round_up(max(chunk, max_bs), ALIGNMENT)
    nchunks = -(-size // chunk)
    in_flight = max(p.block_size * p.queue_depth * p.threads for p in points) * npaths
    want = -(-max(MIN_IN_FLIGHT, 2 * in_flight) // chunk)
    count = max(1, min(nchunks, max(4, want), max(4, MAX_POOL // chunk)))
    return Plan(size, chunk, count)


# -- the data ----------------------------------------------------------------------------------------


class Data:
    """Random reference bytes, the pool's buffers as arrays, and the stamps that make chunks distinct."""

    def __init__(self, pool: BufferPool, chunk: int, seed: int = 0x0FF10AD):
        rng = np.random.default_rng(seed)
        self.reference = np.frombuffer(rng.bytes(chunk), dtype=np.uint8)
        self.reference64 = self.reference.view(np.int64)
        self.chunk = chunk
        self.arrays = [b.numpy() for b in pool]
        self.arrays64 = [a.view(np.int64) for a in self.arrays]
        self.tag = 0  # changes every write pass, so data left by an earlier pass fails verification

    def fill(self) -> None:
        """Copy the reference into every buffer (before a write pass; reads overwrite them)."""
        for a in self.arrays:
            np.copyto(a[: self.chunk], self.reference)

    def new_pass(self) -> None:
        """Start a write pass: its stamps differ from every earlier pass's."""
        self.tag += 1

    def _stamps(self, index: int, nbytes: int) -> np.ndarray:
        first = index * (self.chunk // STAMP_EVERY)
        base = (self.tag << 40) + first
        return np.arange(base, base + nbytes // STAMP_EVERY, dtype=np.int64)

    def stamp(self, index: int, buffer: HostBuffer, nbytes: int) -> None:
        """Mark chunk ``index`` in ``buffer``: the first 8 bytes of each 4 KiB block get (pass, block)."""
        self.arrays64[buffer.index][: nbytes // 8 : _STAMP_STRIDE] = self._stamps(index, nbytes)

    def check(self, index: int, buffer: HostBuffer, nbytes: int) -> None:
        """Raise :class:`VerifyError` unless ``buffer`` holds chunk ``index`` exactly as written."""
        a64 = self.arrays64[buffer.index][: nbytes // 8]
        expected = self._stamps(index, nbytes)
        got = a64[::_STAMP_STRIDE]
        if not np.array_equal(got, expected):
            k = int(np.flatnonzero(got != expected)[0])
            offset = index * self.chunk + k * STAMP_EVERY
            found = int(got[k])
            what = (f"block {found & ((1 << 40) - 1)} of pass {found >> 40}"
                    if 0 < found >> 40 <= self.tag else "bytes that were never written")
            want = int(expected[k]) & ((1 << 40) - 1)
            raise VerifyError(f"verification failed: the 4 KiB block at swap offset {offset} "
                              f"(chunk {index}) holds {what} instead of block {want} of pass {self.tag}")
        a64[::_STAMP_STRIDE] = self.reference64[: nbytes // 8 : _STAMP_STRIDE]
        if not np.array_equal(a64, self.reference64[: nbytes // 8]):
            k = int(np.flatnonzero(a64 != self.reference64[: nbytes // 8])[0]) * 8
            raise VerifyError(f"verification failed: bytes at swap offset {index * self.chunk + k} "
                              f"(chunk {index}) differ from what was written")


# -- passes ----------------------------------------------------------------------------------------------


def _pipeline(submit: Callable, extents: Sequence[Extent], lengths: Sequence[int], pool: BufferPool,
              before: Callable | None = None, after: Callable | None = None) -> float:
    """Move every extent through the pool with all buffers in flight; returns the seconds taken.

    Writes when ``before`` is given: ``before(i, buffer, n)`` fills chunk i's buffer (timed), then it is
    written. Reads otherwise: chunk i is read, then ``after(i, buffer, n)`` checks it (timed too).
    """
    items = list(range(len(extents)))
    io = lambda i, buf: submit(extents[i], buf, nbytes=lengths[i])  # noqa: E731

    def process(i, buf) -> bool:
        if before is not None:
            before(i, buf, lengths[i])
            return True
        if after is not None:
            after(i, buf, lengths[i])
        return False

    t0 = time.perf_counter()
    if before is not None:
        Pipeline(list(pool)).run(items, process=process, write=io)
    else:
        Pipeline(list(pool)).run(items, read=io, process=process)
    return time.perf_counter() - t0


@dataclass
class OpResult:
    """Every run of one operation at one point, ours and fio's, in GiB/s."""

    op: str
    runs: list[float] = field(default_factory=list)
    fio_runs: list[float] = field(default_factory=list)
    verified: bool = False

    @property
    def median(self) -> float:
        return statistics.median(self.runs)

    @property
    def fio_median(self) -> float | None:
        return statistics.median(self.fio_runs) if self.fio_runs else None

    @property
    def ratio(self) -> float | None:
        """Our median over fio's median."""
        f = self.fio_median
        return self.median / f if f else None

    @property
    def paired_ratios(self) -> list[float]:
        """Ours over fio's, run by run (each pair measured back to back)."""
        return [a / b for a, b in zip(self.runs, self.fio_runs)]

    def to_json(self, point: Point | None = None) -> dict[str, Any]:
        doc: dict[str, Any] = {}
        if point is not None:
            doc.update(block_size=point.block_size, queue_depth=point.queue_depth, threads=point.threads)
        doc.update(op=self.op, gib_s=self.median, gib_s_runs=list(self.runs), fio_gib_s=self.fio_median,
                   fio_gib_s_runs=list(self.fio_runs), ratio_to_fio=self.ratio,
                   ratio_to_fio_runs=self.paired_ratios or None, verified=self.verified)
        return doc


@dataclass
class PointResult:
    """What one point measured (its write and read results) and the engine's settings it ran with."""
    point: Point
    write: OpResult
    read: OpResult
    backend: str
    o_direct: bool
    stripe_unit: int
    fixed_buffers: bool

    @property
    def mean(self) -> float:
        """The mean of the write and read medians, in GiB/s."""
        return (self.write.median + self.read.median) / 2


def passes(runs: int, fio: str | None) -> int:
    """How many passes :func:`measure` makes at one point (each a write or a read, ours or fio's)."""
    return runs * 2 * (2 if fio else 1)


def measure(paths: Sequence[str], point: Point, plan_: Plan, pool: BufferPool, data: Data, *, runs: int,
            backend: str, verify: bool, fio: str | None, bar=None) -> PointResult:
    """Write then read ``plan_.size`` bytes ``runs`` times at one point, and fio alongside if asked; ``bar`` (a
    progress bar) advances by one per pass (:func:`passes`).

    Ours and fio take turns operation by operation (our write, fio's write, our read, fio's read),
    and swap who goes first from run to run, so a drift in the drive's speed (the host's cache
    filling, a neighbour's load) favours neither. Each run's two figures are paired for the ratio.
    """
    aio = AioConfig(block_size=point.block_size, queue_depth=point.queue_depth, thread_count=point.threads,
                    backend=backend)
    write, read = OpResult("write"), OpResult("read")
    lengths = plan_.lengths
    size = plan_.size
    with SwapSpace(paths, size, aio=aio, buffers=pool, name="bench") as space:
        extents = [space.alloc(n) for n in lengths]
        runner = None
        if fio:
            runner = Fio(paths, size, point.block_size, point.queue_depth, point.threads, fio=fio)

        def our_write():
            data.fill()
            data.new_pass()
            write.runs.append(size / _pipeline(space.write, extents, lengths, pool, before=data.stamp) / GIB)

        def our_read():
            after = data.check if verify else None
            read.runs.append(size / _pipeline(space.read, extents, lengths, pool, after=after) / GIB)

        try:
            for r in range(runs):
                for ours, result in ((our_write, write), (our_read, read)):
                    steps = [ours]
                    if runner is not None:
                        steps.append(lambda result=result: result.fio_runs.append(_fio(runner, result.op)))
                    for step in steps if r % 2 == 0 else reversed(steps):
                        step()
                        if bar is not None:
                            bar.update(1)
        finally:
            if runner is not None:
                runner.cleanup()
        stats = space.stats()
        result = PointResult(point, write, read, space.backend, space.o_direct, space.stripe_unit,
                             bool(stats.get("fixed_buffers")))
    write.verified = read.verified = verify
    return result


def _fio(runner: Fio, op: str) -> float:
    try:
        return runner.run(op).gib_s
    except FioError as err:
        raise BenchError(str(err)) from err


# -- command line ----------------------------------------------------------------------------------------


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """Add the ``io`` subcommand."""
    io = sub.add_parser(
        "io", parents=[common], help="write then read through the swap space; GiB/s per run and median",
        description="Write then read --size bytes through the swap space (O_DIRECT; the write figure is "
                    "without fsync, as fio's default) and report GiB/s per run and the median.",
    )
    add_pass_options(io)
    io.add_argument("--block-size", type=block_size_arg, default=MIB, metavar="SIZE",
                    help="bytes per request piece, a multiple of 4KiB (default 1MiB)")
    io.add_argument("--queue-depth", type=positive_int_arg(1, 4096), default=32, metavar="N",
                    help="pieces in flight per worker (default 32)")
    io.add_argument("--threads", type=positive_int_arg(1, 64), default=1, metavar="N",
                    help="worker threads (io_uring rings) per path (default 1)")
    io.add_argument("--runs", type=positive_int_arg(1), default=3, metavar="N", help="runs (default 3)")
    io.add_argument("--gds", action="store_true",
                    help="between GPU memory and the drive: kvikio's CuFile (GPUDirect Storage where available) "
                         "beside the engine through the pinned pool with a copy to the GPU; needs kvikio and a GPU")
    io.set_defaults(run=run_io)


def add_pass_options(p: argparse.ArgumentParser) -> None:
    """The options of a pass through the swap space, shared by ``io`` and ``sweep``."""
    add_path_option(p)
    p.add_argument("--size", type=size_arg, default=1 << 30, metavar="SIZE",
                   help="bytes written then read per run, e.g. 512MiB (default 1GiB)")
    p.add_argument("--backend", choices=("auto", "io_uring", "threads"), default="auto",
                   help="engine backend (default auto: io_uring, else threads)")
    p.add_argument("--verify", action="store_true", help="check the bytes read equal the bytes written")
    p.add_argument("--fio", action="store_true",
                   help="run fio with the same settings in the same run and print our/fio ratios")
    p.add_argument("--json", metavar="FILE", help="write the configuration, machine and results as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="draw the results (needs matplotlib)")


def check_pass_args(args: argparse.Namespace, block_sizes: Sequence[int]) -> str | None:
    """Validate what argparse cannot; returns the fio executable when --fio is given."""
    if args.size % ALIGNMENT:
        raise UsageError(f"--size {args.size} is not a multiple of {ALIGNMENT} bytes; "
                         f"try {round_up(args.size, ALIGNMENT)}")
    biggest = max(block_sizes)
    if args.size < biggest:
        raise UsageError(f"--size {short_size(args.size)} is smaller than the block size "
                         f"{short_size(biggest)}; make --size at least one block")
    check_output_file("--json", args.json)
    check_output_file("--plot", args.plot, (".png", ".svg", ".pdf"))
    check_output_file("--emit-config", getattr(args, "emit_config", None))
    if args.plot:
        report.require_matplotlib()
    if args.fio:
        try:
            return find_fio()
        except FioError as err:
            raise BenchError(str(err)) from None
    return None


def _probe(paths: Sequence[str], backend: str) -> tuple[str, dict[str, bool]]:
    """The backend the engine will run, and whether each path takes O_DIRECT (without warnings)."""
    with Engine(AioConfig(backend=backend)) as engine:
        used = engine.backend
    direct = {}
    for p in paths:
        fd, name = tempfile.mkstemp(prefix=".offload-bench-probe-", dir=p)
        os.close(fd)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with open_file(name, "r+", o_direct="auto") as f:
                    direct[p] = f.o_direct
        finally:
            os.unlink(name)
    return used, direct


def setup_run(args, paths: Sequence[str], points: Sequence[Point], fio: str | None):
    """Check space, probe the machine, plan the pool; returns (plan, machine, params for the header)."""
    per_path = -(-args.size // len(paths)) + max(p.block_size for p in points) * 2
    check_free_space(paths, per_path * (2 if fio else 1),
                     "the swap file" + (" and fio's files" if fio else ""))
    backend, direct = _probe(paths, args.backend)
    machine = report.machine_info(paths)
    machine["backend"] = backend
    machine["o_direct"] = direct
    p = plan(args.size, points, len(paths))
    params = [
        ("size", f"{short_size(args.size)} written then read per run, {args.runs} run(s)"),
        ("backend", f"{backend} (asked: {args.backend})"),
        ("o_direct", ", ".join("yes" if d else "NO (buffered: page-cache figures)" for d in direct.values())
         + "; writes without fsync, as fio's default"),
        ("pool", f"{p.buffer_count} x {short_size(p.chunk)} buffers, one request each in flight "
                 f"({short_size(p.pool_bytes)})"),
        ("striping", f"over {len(paths)} paths, stripe unit = block size" if len(paths) > 1
         else "no (one path)"),
        ("verify", "yes" if args.verify else "no"),
    ]
    if fio:
        machine["fio"] = fio_version(fio)
        params.append(("fio", f"{machine['fio']}, ioengine={pick_engine(fio)}, direct=1, one job per path, "
                              "numjobs = threads, same bs, iodepth and total size"))
    return p, machine, params


def config_doc(args, paths, plan_: Plan, extra: dict[str, Any]) -> dict[str, Any]:
    """The ``config`` part of the JSON report: the command's arguments and the pool, with ``extra``."""
    return {
        "command": args.command, "paths": list(paths), "scratch": not args.paths, "size": args.size,
        **extra, "backend": args.backend, "runs": args.runs, "verify": args.verify, "fio": args.fio,
        "buffer_count": plan_.buffer_count, "buffer_size": plan_.chunk, "o_direct": "auto",
        "fsync": False,
    }


# NOTE: a pass writes (or reads) ``--size`` bytes through a SwapSpace as a pipeline over a small
# pool of page-aligned buffers: one request per buffer-sized chunk, every buffer's request in flight
# at once, and each buffer resubmitted as soon as its request completes. The pool holds at least
# twice what the engines keep in flight (queue depth x block size x threads x paths), so their queues
# never run dry while Python refills. Writes are O_DIRECT without fsync, as fio's default; what is
# timed is the first submit to the last completion. Every 4 KiB block written carries a stamp (run,
# block number) so ``--verify`` catches a block read from the wrong place or never written, not only
# corrupted bytes.
def run_io(args: argparse.Namespace) -> int:
    """``offload-bench io``."""
    if args.gds:
        from .gds import run_gds  # it builds on this module

        return run_gds(args)
    point = Point(args.block_size, args.queue_depth, args.threads)
    fio = check_pass_args(args, [point.block_size])
    with bench_paths(args.paths) as paths:
        plan_, machine, params = setup_run(args, paths, [point], fio)
        params[1:1] = [("aio", f"block size {short_size(point.block_size)}, queue depth {point.queue_depth}, "
                               f"{point.threads} thread(s) per path")]
        report.print_header("io", machine, params)
        with BufferPool(plan_.buffer_count, plan_.chunk) as pool, \
                progress(passes(args.runs, fio), "io: write and read passes") as bar:
            data = Data(pool, plan_.chunk)
            res = measure(paths, point, plan_, pool, data, runs=args.runs, backend=args.backend,
                          verify=args.verify, fio=fio, bar=bar)
    _print_io(res, args.verify)
    results = [res.write.to_json(), res.read.to_json()]
    config = config_doc(args, paths, plan_, {"block_size": point.block_size, "queue_depth": point.queue_depth,
                                              "threads": point.threads})
    config.update(backend_used=res.backend, stripe_unit=res.stripe_unit, fixed_buffers=res.fixed_buffers)
    if args.json:
        report.write_json(args.json, {"config": config, "machine": machine, "results": results})
        print(f"wrote {args.json}")
    if args.plot:
        report.plot_io(args.plot, results, plot_title(machine, paths, point))
        print(f"wrote {args.plot}")
    return 0


def plot_title(machine, paths, point: Point | None) -> str:
    """A plot's title: the host, the point (if one), the backend and each path's file system."""
    fs = ", ".join(f"{p} ({v['type']})" for p, v in machine["file_systems"].items())
    what = f"{point.label()}, " if point else ""
    return f"offload-bench on {machine['hostname']}: {what}{machine['backend']}, {fs}"


def _print_io(res: PointResult, verify: bool) -> None:
    n = len(res.write.runs)
    headers = ["op"] + [f"run {i + 1}" for i in range(n)] + ["median"]
    has_fio = bool(res.write.fio_runs)
    if has_fio:
        headers.append("ours/fio")
    rows = []
    for r in (res.write, res.read):
        rows.append([r.op] + [report.fmt_gib(x) for x in r.runs] + [report.fmt_gib(r.median)]
                    + ([report.fmt_ratio(r.ratio)] if has_fio else []))
        if has_fio:
            rows.append([f"{r.op} (fio)"] + [report.fmt_gib(x) for x in r.fio_runs]
                        + [report.fmt_gib(r.fio_median), ""])
    print("GiB/s (1 GiB = 2^30 bytes)")
    print(report.table(headers, rows))
    if has_fio:
        for r in (res.write, res.read):
            pairs = " ".join(f"{x:.3f}" for x in r.paired_ratios)
            print(f"{r.op} ours/fio run by run: {pairs} (median {statistics.median(r.paired_ratios):.3f})")
    if verify:
        print("verify: every byte read back equals the byte written")
    print()


__all__ = ["Data", "Plan", "Point", "PointResult", "VerifyError", "add_pass_options", "check_pass_args", "config_doc",
           "measure", "plan", "plot_title", "register", "run_io", "setup_run"]
