"""``offload-bench io --gds``: the same file region read and written straight between the drive and GPU memory
by kvikio (GPUDirect Storage), beside our engine through the pinned pool with a copy to the GPU."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import statistics
import time
from typing import Any

import torch

from ..aio import gds_status
from ..buffers import BufferPool
from ..config import AioConfig
from ..progress import tracked
from ..sizes import GIB
from ..space import SwapSpace
from . import report
from .cli import BenchError, UsageError, bench_paths, short_size
from .io import Point, VerifyError, _pipeline, check_pass_args, config_doc, setup_run

OURS, KVIKIO = "engine + pinned pool + GPU copy", "kvikio CuFile"


def load_kvikio() -> tuple[Any, bool, str]:
    """``(kvikio module, GDS usable, reason)``; raises :class:`BenchError` where kvikio cannot run at all.

    kvikio runs where it imports and a GPU is present; whether its transfers are GPUDirect (and why not)
    is :func:`offload.aio.gds_status`'s answer.
    """
    ok, reason = gds_status()
    if importlib.util.find_spec("kvikio") is None or not torch.cuda.is_available():
        raise BenchError(f"--gds: GPUDirect Storage cannot be measured here: {reason}. "
                         "Run without --gds to measure the engine alone")
    try:
        kvikio = importlib.import_module("kvikio")
    except Exception as err:  # a wheel for another CUDA, a missing libcufile
        raise BenchError(f"--gds: kvikio cannot be imported ({type(err).__name__}: {err}); "
                         "run without --gds to measure the engine alone") from err
    return kvikio, ok, reason


# NOTE: both paths move the same bytes between one GPU tensor and the same extents of one swap space
# (file_ranges gives the files and offsets kvikio reads and writes). Ours: the engine through the
# pinned pool, each buffer copied from (or to) the GPU before its write (after its read), the copy
# waited for before the buffer is reused, every buffer in flight. kvikio: one pwrite (pread) per
# chunk straight from (into) GPU memory, all submitted at once and waited for. Where kvikio runs in
# compatibility mode (no cuFile driver with GDS) its figures are labelled so: POSIX I/O through its
# own bounce buffers, not GPUDirect. Every read is checked against the bytes written, on the GPU.
def run_gds(args: argparse.Namespace) -> int:
    """``offload-bench io --gds``."""
    if args.fio or args.plot:
        raise UsageError("--gds compares two paths to GPU memory; leave out --fio and --plot")
    kvikio, ok, reason = load_kvikio()
    args.verify = True  # every read is checked on the GPU
    point = Point(args.block_size, args.queue_depth, args.threads)
    check_pass_args(args, [point.block_size])
    device = torch.device("cuda", torch.cuda.current_device())
    kv_label = KVIKIO + (" (GDS)" if ok else " (compatibility mode, not GDS)")
    with bench_paths(args.paths) as paths:
        plan_, machine, params = setup_run(args, paths, [point], None)
        machine["gpu"] = torch.cuda.get_device_name(device)
        machine["gds"] = {"available": ok, "status": reason}
        params[1:1] = [("aio", f"block size {short_size(point.block_size)}, queue depth {point.queue_depth}, "
                               f"{point.threads} thread(s) per path")]
        params += [("gpu", machine["gpu"]),
                   ("gds", f"{'available' if ok else 'NOT available'}: {reason}"),
                   ("compared", f"{OURS} against {kv_label}, the same file region and GPU memory")]
        report.print_header("io --gds", machine, params)
        aio = AioConfig(block_size=point.block_size, queue_depth=point.queue_depth, thread_count=point.threads,
                        backend=args.backend)
        results = {(path, op): [] for path in (OURS, KVIKIO) for op in ("write", "read")}
        with BufferPool(plan_.buffer_count, plan_.chunk, pin_memory=True) as pool, \
                SwapSpace(paths, plan_.size, aio=aio, buffers=pool, name="bench-gds") as space:
            pinned = all(b.pinned for b in pool)
            lengths = plan_.lengths
            extents = [space.alloc(n) for n in lengths]
            starts = [sum(lengths[:i]) for i in range(len(lengths))]
            src = torch.randint(0, 256, (plan_.size,), dtype=torch.uint8, device=device,
                                generator=torch.Generator(device).manual_seed(0))
            dst = torch.empty_like(src)
            passes = {OURS: _OursPasses(space, pool, extents, lengths, starts, src, dst),
                      KVIKIO: _KvikioPasses(kvikio, space, extents, lengths, starts, src, dst)}
            try:
                # kvikio as fast as it goes: as many requests in flight as ours, its GPU buffers registered
                # (undone by close, also when this fails part-way).
                machine["kvikio"] = tune_kvikio(kvikio, point.queue_depth * point.threads * len(paths), [src, dst],
                                                passes[KVIKIO].undo)
                print(f"kvikio: {machine['kvikio']}")
                for r in tracked(range(args.runs), "io --gds: runs"):
                    for path in ((OURS, KVIKIO) if r % 2 == 0 else (KVIKIO, OURS)):
                        for op in ("write", "read"):
                            seconds = getattr(passes[path], op)()
                            results[(path, op)].append(plan_.size / seconds / GIB)
            finally:
                passes[KVIKIO].close()
    return _report(args, paths, plan_, machine, results, kv_label, pinned, point)


class _OursPasses:
    """Write and read passes through the engine and the pinned pool, copying to and from the GPU."""

    def __init__(self, space, pool, extents, lengths, starts, src, dst):
        self.space, self.pool, self.extents, self.lengths = space, pool, extents, lengths
        self.starts, self.src, self.dst = starts, src, dst

    def write(self) -> float:
        def fill(i, buf, n):
            buf.tensor[:n].copy_(self.src[self.starts[i]:self.starts[i] + n])  # waits for the copy

        torch.cuda.synchronize()
        return _pipeline(self.space.write, self.extents, self.lengths, self.pool, before=fill)

    def read(self) -> float:
        def drain(i, buf, n):
            self.dst[self.starts[i]:self.starts[i] + n].copy_(buf.tensor[:n])  # waits: the buffer is reused

        self.dst.zero_()
        torch.cuda.synchronize()
        seconds = _pipeline(self.space.read, self.extents, self.lengths, self.pool, after=drain)
        _check(self.src, self.dst, OURS)
        return seconds


class _KvikioPasses:
    """Write and read passes with kvikio's CuFile, one request per swap-file range, all in flight at once."""

    def __init__(self, kvikio, space, extents, lengths, starts, src, dst):
        self.src, self.dst = src, dst
        self.size = sum(lengths)
        # (swap file, offset in it, offset in the tensors, length) for every piece of every chunk.
        self.ranges = [(path, file_off, start + ext_off, n)
                       for ext, length, start in zip(extents, lengths, starts)
                       for path, file_off, ext_off, n in space.file_ranges(ext, length)]
        self.files = {}
        self.undo = []  # what tune_kvikio changed
        try:
            for path in dict.fromkeys(r[0] for r in self.ranges):
                self.files[path] = kvikio.CuFile(path, "r+")
        except BaseException:
            self.close()
            raise

    def _run(self, op: str, tensor: torch.Tensor) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        futures = [getattr(self.files[path], op)(tensor[at:at + n], n, file_off)
                   for path, file_off, at, n in self.ranges]
        done = sum(f.get() for f in futures)
        if op == "pwrite":
            self._sync()  # on the drive, as our engine's O_DIRECT writes are, not in the page cache
        seconds = time.perf_counter() - t
        if done != self.size:
            raise BenchError(f"kvikio {op[1:]} moved {done} bytes of {self.size}")
        return seconds

    def write(self) -> float:
        return self._run("pwrite", self.src)

    def _sync(self) -> None:
        for path in dict.fromkeys(r[0] for r in self.ranges):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def _drop_cache(self) -> None:
        """Out of the page cache, so that a read in kvikio's compatibility mode (POSIX) comes from the drive."""
        for path, file_off, _, n in self.ranges:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, file_off, n, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    def read(self) -> float:
        self.dst.zero_()
        self._drop_cache()
        seconds = self._run("pread", self.dst)
        _check(self.src, self.dst, KVIKIO)
        return seconds

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        self.files = {}
        for undo in reversed(self.undo):
            undo()
        self.undo = []


def tune_kvikio(kvikio, threads: int, buffers: list, undo: list) -> str:
    """Give kvikio ``threads`` threads and register ``buffers`` (GPU tensors) with cuFile, through whichever
    interface this kvikio has; appends to ``undo`` what puts it back. Returns what was done, for the report
    (kvikio's defaults are one thread and unregistered buffers, which understate it against a deep queue)."""
    done = []
    defaults = getattr(kvikio, "defaults", None)
    if defaults is not None and callable(getattr(defaults, "set", None)) and callable(getattr(defaults, "get", None)):
        before = defaults.get("num_threads")  # kvikio 25.04 on
        defaults.set("num_threads", threads)
        undo.append(lambda: defaults.set("num_threads", before))
        done.append(f"{threads} threads")
    elif defaults is not None and hasattr(defaults, "num_threads_reset"):
        before = defaults.get_num_threads() if hasattr(defaults, "get_num_threads") else 1
        defaults.num_threads_reset(threads)
        undo.append(lambda: defaults.num_threads_reset(before))
        done.append(f"{threads} threads")
    else:
        done.append("its default threads (no interface to set them)")
    register = getattr(getattr(kvikio, "buffer", None), "memory_register", None) or \
        getattr(kvikio, "memory_register", None)
    deregister = getattr(getattr(kvikio, "buffer", None), "memory_deregister", None) or \
        getattr(kvikio, "memory_deregister", None)
    if register is not None and deregister is not None:
        for b in buffers:
            register(b)
            undo.append(lambda b=b: deregister(b))
        done.append("buffers registered with cuFile")
    else:
        done.append("buffers not registered (no interface)")
    return ", ".join(done)


def _check(src: torch.Tensor, dst: torch.Tensor, path: str) -> None:
    if not torch.equal(src, dst):
        k = int(torch.nonzero(src != dst)[0])
        raise VerifyError(f"verification failed ({path}): the byte at offset {k} read back differs from the one "
                          "written")


def _report(args, paths, plan_, machine, results, kv_label, pinned, point) -> int:
    n = args.runs
    headers = ["op", "path"] + [f"run {i + 1}" for i in range(n)] + ["median", "kvikio/ours"]
    rows, doc = [], []
    for op in ("write", "read"):
        ours_med = statistics.median(results[(OURS, op)])
        for path in (OURS, KVIKIO):
            runs = results[(path, op)]
            med = statistics.median(runs)
            label = kv_label if path == KVIKIO else OURS + ("" if pinned else " (pool NOT pinned)")
            rows.append([op, label] + [report.fmt_gib(x) for x in runs] + [report.fmt_gib(med)]
                        + [report.fmt_ratio(med / ours_med) if path == KVIKIO else ""])
            doc.append({"op": op, "path": "kvikio" if path == KVIKIO else "ours", "gib_s": med, "gib_s_runs": runs})
    print("GiB/s (1 GiB = 2^30 bytes) between GPU memory and the drive; every read checked against the write")
    print(report.table(headers, rows))
    if not machine["gds"]["available"]:
        print(f"GDS was not measured: {machine['gds']['status']}")
    if args.json:
        config = config_doc(args, paths, plan_, {"block_size": point.block_size, "queue_depth": point.queue_depth,
                                                 "threads": point.threads, "gds": True, "pool_pinned": pinned})
        report.write_json(args.json, {"config": config, "machine": machine, "results": doc})
        print(f"wrote {args.json}")
    return 0


__all__ = ["load_kvikio", "run_gds", "tune_kvikio"]
