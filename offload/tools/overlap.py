"""``offload-bench adam|params --overlap``: training iterations with the step inside backward, against the
same iteration without it, compute alone and I/O alone, in one run."""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Any, Callable

import torch

from ..adam import OffloadedAdamW
from ..params import offload_parameters, offloaded, restore_parameters
from ..progress import tracked
from ..sizes import format_size
from . import report
from .cli import config_given, positive_int_arg
from .gpu import pool_pinned, synchronize
from .workload import block_model, compute_beside_io, io_only

CALIBRATION_BATCH = 8


def add_options(p: argparse.ArgumentParser) -> None:
    """``--overlap``, ``--rounds`` and ``--batch`` (rows, or ``auto``: compute about equal to I/O)."""
    p.add_argument("--overlap", action="store_true",
                   help="time training iterations with overlap_backward against the same without it, compute "
                        "alone (torch AdamW in memory) and the same bytes moved without compute")
    p.add_argument("--rounds", type=positive_int_arg(1), default=3, metavar="N",
                   help="with --overlap: rounds, each timing every variant over --steps iterations (default 3)")
    p.add_argument("--hidden", type=positive_int_arg(8), default=None, metavar="H",
                   help="hidden size of the blocks; each has 8*H*H weights")
    p.add_argument("--batch", type=_batch_arg, default=None, metavar="N|auto",
                   help="rows per batch; auto (the default with --overlap) picks compute about equal to I/O")


def _batch_arg(text: str):
    if text == "auto":
        return text
    return positive_int_arg(1)(text)


# NOTE: a round times `steps` consecutive iterations (forward, backward, step, zero_grad) of each
# variant in turn: ours without overlap_backward (its tail writes still land during the next forward),
# ours with it, the same model in memory with torch's fused AdamW (compute alone), and ours with nothing
# overlapped (every step's writes drained before the next forward: compute + I/O). A variant's last
# writes land inside its own time. Variants alternate within a round, so a disk that changes speed
# weighs on all of them alike; each figure is the median over rounds of (round time / steps). I/O
# alone, measured in each round too: with weights in memory, the step alone (the state's I/O and the
# update, what overlap_backward hides); with weights on NVMe, the time the swap space takes to read and
# write the bytes one overlapped iteration moved. "auto" batch: the batch whose compute alone takes
# about as long as that I/O (batches doubled, then a line through the last two). Compute alone is also
# timed with I/O running beside it without pause: where compute and I/O share the cores and the memory
# bandwidth (a VM with 2 cores: 1.7x slower), max(compute, I/O) is out of any overlap's reach. On a GPU, a variant's
# memory peak is torch.cuda.max_memory_allocated above what was allocated as it began (the models of
# the other variants stay resident meanwhile).
def run_overlap(args: argparse.Namespace, paths: list[str], *, layers: int, hidden: int, dtype: torch.dtype,
                device: torch.device, weights_offloaded: bool) -> dict:
    """Measure and print the comparison; returns the results (also written to ``args.json`` if given)."""
    cfg = args.config.replace(offload_optimizer={"nvme_path": list(paths)})
    if weights_offloaded:
        pc: dict[str, Any] = {"nvme_path": list(paths), "max_in_cpu": 0, "max_grad_in_cpu": 0}
        if not config_given(args):
            pc.update(buffer_size=4 * hidden * hidden, buffer_count=5)
        cfg = cfg.replace(offload_param=pc)
    machine = report.machine_info(paths)
    n_params = layers * (8 * hidden * hidden + 7 * hidden)
    where = "weights and state on NVMe" if weights_offloaded else "state on NVMe, weights in memory"
    report.print_header("overlap", machine, [
        ("model", f"{layers} blocks, hidden {hidden}, {n_params:,} {str(dtype).split('.')[-1]} parameters on "
                  f"{device.type}; {where}"),
        ("rounds", f"{args.rounds} x {args.steps} iterations per variant"),
    ])

    runs = _Runs(args, cfg, paths, layers, hidden, dtype, device, weights_offloaded)
    try:
        times, moved, batch, gpu_peaks, pinned = runs.measure()
    finally:
        runs.close()
    med = {name: statistics.median(t) for name, t in times.items()}
    bound = max(med["compute"], med["io"])
    result: dict[str, Any] = {
        "params": n_params, "layers": layers, "hidden": hidden, "batch": batch, "device": device.type,
        "weights_offloaded": weights_offloaded,
        "iteration_s_median": {"overlap": med["overlap"], "plain": med["plain"], "serial": med["serial"],
                               "compute_only": med["compute"]},
        "iteration_s_runs": times, "io_only_s": med["io"],
        "bytes_per_iteration": moved,
        "overlap_to_bound": med["overlap"] / bound,
        "compute_beside_io_s": med["beside"],
        "plain_to_overlap": med["plain"] / med["overlap"],
        "serial_to_overlap": med["serial"] / med["overlap"],
        "gpu_peak_bytes": gpu_peaks or None,
        "pools_pinned": pinned,
        "machine": machine,
    }
    weight_bytes = n_params * torch.tensor([], dtype=dtype).element_size()
    print(report.table(["", "value"], _rows(result, weight_bytes, auto=args.batch in (None, "auto"))))
    if args.json:
        report.write_json(args.json, result)
        print(f"wrote {args.json}")
    return result


class _Runs:
    """The variants of one comparison (ours without and with overlap_backward, torch in memory) and their timing."""

    def __init__(self, args, cfg, paths, layers: int, hidden: int, dtype, device, weights_offloaded: bool):
        self.args, self.cfg, self.paths = args, cfg, paths
        self.layers, self.hidden, self.dtype, self.device = layers, hidden, dtype, device
        self.weights_offloaded = weights_offloaded
        self.runs: dict[str, Any] = {}

    def build(self, overlap: bool):
        model = block_model(self.layers, self.hidden, self.dtype, self.device)
        if self.weights_offloaded:
            offload_parameters(model, config=self.cfg, prefetch=2)
        opt = OffloadedAdamW(model.parameters(), lr=1e-4, config=self.cfg, overlap_backward=overlap)
        return model, opt

    def inputs(self, batch: int) -> torch.Tensor:
        return torch.randn(batch, self.hidden, generator=torch.Generator().manual_seed(1)).to(self.device, self.dtype)

    def measure(self) -> tuple:
        """(times per variant over the rounds, bytes per iteration, batch, GPU peaks, whether pools are pinned)."""
        args, runs = self.args, self.runs
        runs["plain"] = self.build(False)
        runs["overlap"] = self.build(True)
        ref = block_model(self.layers, self.hidden, self.dtype, self.device)
        runs["compute"] = (ref, torch.optim.AdamW(ref.parameters(), lr=1e-4, fused=True))
        # Bytes one overlapped iteration moves (after a first one that creates state), then the batch.
        x = self.inputs(CALIBRATION_BATCH if args.batch in (None, "auto") else args.batch)
        for name in ("plain", "overlap", "compute"):
            _iterate(*runs[name], x, 1)
        moved = {name: _bytes(*runs[name], x, self.weights_offloaded) for name in ("plain", "overlap")}

        def io_alone() -> float:
            if self.weights_offloaded:
                return io_only(self.paths, self.cfg.aio, moved["overlap"]["read"], moved["overlap"]["write"])
            return _step_alone(*runs["plain"], x)

        batch = args.batch
        if batch in (None, "auto"):
            io_s = io_alone()
            batch = _calibrate(lambda b: statistics.median(_iterate(*runs["compute"], self.inputs(b), 1)
                                                           for _ in range(2)), io_s)
        else:
            io_alone()  # as when calibrating: the first I/O alone warms what the rounds measure
        x = self.inputs(batch)
        times: dict[str, list] = {name: [] for name in (*runs, "serial", "io", "beside")}
        pool = runs["plain"][1].state_store.pool  # None with device "cpu": then I/O as io_only moves it
        beside_shape = {"buffers": len(pool), "piece": pool.buffer_size} if pool is not None else {}
        gpu_peaks: dict[str, int] = {}
        for _ in tracked(range(args.rounds), "overlap: rounds"):
            for name in runs:
                before = _gpu_mark(self.device)
                times[name].append(_iterate(*runs[name], x, args.steps) / args.steps)
                if before is not None:
                    gpu_peaks[name] = max(gpu_peaks.get(name, 0),
                                          torch.cuda.max_memory_allocated(self.device) - before)
            times["serial"].append(_iterate(*runs["plain"], x, args.steps, drain_each=True) / args.steps)
            times["io"].append(io_alone())
            times["beside"].append(compute_beside_io(
                self.paths, self.cfg.aio, lambda: _iterate(*runs["compute"], x, args.steps) / args.steps,
                **beside_shape))
        pinned = pool_pinned([pool] + ([offloaded(runs["plain"][0]).store.pool] if self.weights_offloaded else []))
        return times, moved, batch, gpu_peaks, pinned

    def close(self) -> None:
        for name in ("plain", "overlap"):
            if name in self.runs:
                model, opt = self.runs[name]
                opt.close()
                if self.weights_offloaded:
                    restore_parameters(model)
        self.runs.clear()
        gc.collect()


def _rows(r: dict, weight_bytes: int, *, auto: bool) -> list:
    """The table, from the JSON result."""
    med, io_s, beside = r["iteration_s_median"], r["io_only_s"], r["compute_beside_io_s"]
    weights_offloaded = r["weights_offloaded"]
    rows = [
        ["iteration, overlap_backward", f"{med['overlap']:.3f} s"],
        ["iteration, without overlap_backward (tail writes overlap)", f"{med['plain']:.3f} s"],
        ["iteration, nothing overlapped (writes drained in step)", f"{med['serial']:.3f} s"],
        ["compute alone (torch AdamW in memory)", f"{med['compute_only']:.3f} s"],
        ["I/O alone (the bytes an overlapped iteration moves, no compute)" if weights_offloaded else
         "step alone (the state's I/O and the update, no forward/backward)", f"{io_s:.3f} s"],
        ["compute alone, with I/O running beside it (how much they contend here)",
         f"{beside:.3f} s ({beside / med['compute_only']:.2f}x compute alone)"],
        ["overlap / max(compute, I/O)", f"{r['overlap_to_bound']:.2f}x (bar 1.15x)"],
        ["nothing overlapped / overlap", f"{r['serial_to_overlap']:.2f}x (bar 1.6x)"],
        ["without overlap_backward / overlap", f"{r['plain_to_overlap']:.2f}x"],
    ]
    for name, label in (("overlap", "overlap"), ("plain", "without overlap")):
        m = r["bytes_per_iteration"][name]
        rows.append([f"moved per iteration, {label}",
                     f"read {format_size(m['read'])}, written {format_size(m['write'])}"
                     + (f" (grads {format_size(m['grad_read'])} / {format_size(m['grad_write'])})"
                        if weights_offloaded else "")])
        if weights_offloaded:
            # Forward and backward need each weight read once each and the step writes it once; fp32 weights
            # have no master, so a step that runs after backward (not during it) reads them a third time.
            rows.append([f"weights read / written per iteration, {label}",
                         f"{m['weights_read'] / weight_bytes:.2f}x / {m['weights_written'] / weight_bytes:.2f}x "
                         "the weights (2x / 1x needed)"])
    rows.append(["batch", f"{r['batch']} rows" + (" (auto: compute about equal to I/O)" if auto else "")])
    labels = {"overlap": "overlap_backward", "plain": "without overlap_backward", "compute": "compute alone"}
    for name, peak in (r["gpu_peak_bytes"] or {}).items():
        rows.append([f"GPU memory peak above the models, {labels[name]}", format_size(peak)])
    pinned = r["pools_pinned"]
    rows.append(["pools pinned", "no pool" if pinned is None else "yes" if pinned else "no"])
    return rows


def _gpu_mark(device: torch.device) -> int | None:
    """On a GPU: reset the peak and return the memory allocated now (what the peak is measured above)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def _calibrate(seconds: Callable[[int], float], target: float) -> int:
    """The batch whose compute takes about ``target`` seconds: batches doubled from ``CALIBRATION_BATCH`` until
    one takes at least ``target``, then a line through the last two (an iteration has a fixed part, the
    optimizer's step). A batch that already takes ``target`` gives itself; times that do not grow with the
    batch (noise) never send the guess beyond the last batch doubled."""
    lo, t_lo = CALIBRATION_BATCH, seconds(CALIBRATION_BATCH)
    if t_lo >= target:
        return lo
    hi, t_hi = lo, t_lo
    while t_hi < target and hi < 1 << 16:
        lo, t_lo = hi, t_hi
        hi = 2 * hi
        t_hi = seconds(hi)
    if t_hi <= t_lo:
        return hi
    return max(lo, min(hi, round(lo + (target - t_lo) * (hi - lo) / (t_hi - t_lo))))


def _iterate(model, opt, x, steps: int, *, drain_each: bool = False) -> float:
    """Seconds for ``steps`` training iterations, the last writes landed (``drain_each``: after every step,
    so that none overlaps the next forward)."""
    # The clock starts with the GPU idle: work queued before (calibration, the last iteration) is not ours.
    synchronize(x.device)
    t = time.perf_counter()
    for i in range(steps):
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if isinstance(opt, OffloadedAdamW) and (drain_each or i == steps - 1):
            opt.state_store.drain()
    synchronize(x.device)
    return time.perf_counter() - t


def _step_alone(model, opt, x) -> float:
    """Seconds of one step with its writes landed, grads in place and nothing else running: the state's I/O
    and the update, which overlap_backward hides behind backward."""
    model(x).float().square().mean().backward()
    synchronize(x.device)  # backward's kernels are not the step's
    t = time.perf_counter()
    opt.step()
    opt.state_store.drain()
    synchronize(x.device)
    seconds = time.perf_counter() - t
    opt.zero_grad(set_to_none=True)
    return seconds


def _bytes(model, opt, x, weights_offloaded: bool) -> dict:
    """Bytes one iteration reads and writes (state, and weights and grads when they are offloaded)."""
    def counts():
        r, w = opt.io_bytes()
        out = {"read": r, "write": w, "grad_read": 0, "grad_write": 0, "weights_read": 0, "weights_written": 0}
        if weights_offloaded:
            s = offloaded(model).store
            out["read"] += s.bytes_read + s.grad_bytes_read
            out["write"] += s.bytes_written + s.grad_bytes_written
            out["grad_read"], out["grad_write"] = s.grad_bytes_read, s.grad_bytes_written
            out["weights_read"], out["weights_written"] = s.bytes_read, s.bytes_written
        return out

    before = counts()
    _iterate(model, opt, x, 1)
    after = counts()
    return {k: after[k] - before[k] for k in after}
