"""``offload-bench compare``: nvme-offload beside DeepSpeed ZeRO-3 on the same model, sizes, disk and aio settings,
interleaved in one run, per iteration (forward, backward, step, zero_grad).

Each run is a process of its own (``python -m offload.tools.peer``), so its peak RSS is its own. DeepSpeed runs
where a Python that imports it is given (``--peer-python``; the venv ``scripts/deepspeed-venv.sh`` makes is found
at ``~/.peer-venv``) and is never a dependency: without it, or with ``--no-deepspeed``, only our variants are timed,
and the report says so. DeepSpeed's ops are built (JIT, minutes the first time) before the first round, with a
progress bar, in a build directory of ours held by a lock, so that a build killed half way leaves no stale lock of
torch's behind to block the next run.
Ours runs plain, and with its extras, each labelled: a host cache sized so our peak RSS matches DeepSpeed's
(measured in the same run), ``overlap_backward``, bf16 state for bf16 models, and without checksums (in every
round, beside ours: the cost of the default integrity check, as the median of the rounds' on/off ratios). The same
model trained in memory by torch's AdamW (no I/O: the compute alone) is the floor every variant is read against.
A second table splits each variant's iteration into forward, backward, step and zero_grad: where its time goes.
"""

from __future__ import annotations

import argparse
import fcntl
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional

from ..progress import progress
from ..sizes import format_size
from . import report
from .cli import EXIT_OK, BenchError, UsageError, add_path_option, bench_paths, count_arg, positive_int_arg
from .gpu import require_cuda
from .ledger import KINDS, Ledger
from .peer import WIDTH

__all__ = ["register", "run_compare"]

DEEPSPEED = "deepspeed"
_DEFAULT_PEER = os.path.expanduser("~/.peer-venv/bin/python")


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """Add the ``compare`` subcommand."""
    p = sub.add_parser("compare", parents=[common], help="iterations beside DeepSpeed ZeRO-3, interleaved",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=count_arg, default=64_000_000, metavar="N",
                   help="parameters, in Linear(2048, 2048) layers (default 64M)")
    p.add_argument("--bf16", action="store_true", help="bf16 weights (ours keeps fp32 masters, as DeepSpeed)")
    p.add_argument("--params-nvme", action="store_true", help="weights on NVMe too (offload_parameters / "
                   "ZeRO-3 offload_param)")
    p.add_argument("--rounds", type=positive_int_arg(1, 20), default=2, metavar="N",
                   help="rounds, each running every variant once, in alternating order (default 2)")
    p.add_argument("--iterations", type=positive_int_arg(3, 100), default=6, metavar="N",
                   help="iterations per run; the first is left out of the medians (default 6)")
    p.add_argument("--peer-python", metavar="PYTHON", help="a Python that imports deepspeed (default: "
                   "~/.peer-venv/bin/python if present, else this one if it imports deepspeed; "
                   "scripts/deepspeed-venv.sh makes one)")
    p.add_argument("--no-deepspeed", action="store_true", help="leave DeepSpeed out, even where it is installed: "
                   "ours and torch's in-memory AdamW only")
    p.add_argument("--no-extras", action="store_true", help="ours plain only (no host cache, no bf16 state)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the model computes, for every variant; cuda needs a GPU (default cpu)")
    add_path_option(p)
    p.add_argument("--json", metavar="FILE", help="write every run and the medians as JSON")
    p.set_defaults(run=run_compare)


def _peer_python(given: Optional[str]) -> tuple[Optional[str], str]:
    """(a Python that imports deepspeed, or None; why not)."""
    if given and not (os.path.exists(given) or shutil.which(given)):
        raise UsageError(f"--peer-python {given}: no such program")
    candidates = [given] if given else [_DEFAULT_PEER, sys.executable]
    for py in candidates:
        if not (os.path.exists(py) or shutil.which(py)):
            continue
        done = subprocess.run([py, "-c", "import deepspeed; print(deepspeed.__version__)"], capture_output=True,
                              text=True, timeout=300)
        if done.returncode == 0:
            return py, done.stdout.strip().splitlines()[-1]
        if given:
            raise UsageError(f"--peer-python {given} cannot import deepspeed: {done.stderr.strip()[-300:]}")
    return None, ("DeepSpeed is not importable here (give --peer-python, e.g. the venv scripts/deepspeed-venv.sh "
                  "makes)")


UNCHECKED = "ours, checksums off"
OVERLAP = "ours + overlap_backward"
TORCH = "torch AdamW in memory (compute alone)"
INT8 = "ours + int8 state"
PHASES = ("forward", "backward", "step", "zero_grad")


def _run(python: str, system: str, root: str, args, *, host_cache: int = 0, state_dtype: str = "fp32",
         checksum: str = "on", overlap: bool = False, master: bool = True, clip: Optional[float] = None) -> dict:
    directory = tempfile.mkdtemp(prefix=f"compare-{system}-", dir=root)  # a new one: removed after, nothing else
    cmd = [python, "-m", "offload.tools.peer", system, directory, str(args.params), "--iterations",
           str(args.iterations), "--host-cache", str(host_cache), "--state-dtype", state_dtype, "--checksum", checksum]
    cmd += ["--params-nvme"] * args.params_nvme + ["--bf16"] * args.bf16 + ["--overlap"] * overlap
    cmd += ["--no-master"] * (not master) + (["--max-grad-norm", str(clip)] if clip is not None else [])
    cmd += ["--device", args.device]
    env = dict(_peer_env(), PYTHONPATH=os.pathsep.join(filter(None, [_repo_root(), os.environ.get("PYTHONPATH")])))
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    result = _report(done.stdout)
    if result is None:
        raise BenchError(f"the {system} run failed (exit {done.returncode}): {done.stderr.strip()[-800:]}")
    if done.returncode != 0:
        # It measured and reported, then died on the way out (DeepSpeed's aio threads at interpreter exit can
        # abort: "terminate called without an active exception"): its figures stand, the exit is recorded.
        result["exit_after_report"] = done.returncode
        print(f"note: the {system} run exited with {done.returncode} after reporting its figures "
              f"({done.stderr.strip().splitlines()[-1][-200:] if done.stderr.strip() else 'no message'})")
    return result


def _report(stdout: str) -> Optional[dict]:
    """The run's figures: its last line that is a JSON object with the numbers compare uses, else None."""
    for line in reversed(stdout.splitlines()):
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict) and all(isinstance(doc.get(k), (int, float)) and doc[k] == doc[k]
                                          for k in ("iteration_s_median", "step_s_median", "peak_rss_bytes")) \
                and isinstance(doc.get("phases_s_median"), dict):
            return doc
    return None


def _repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_compare(args: argparse.Namespace) -> int:
    """``offload-bench compare``: every variant once per round, in alternating order, then the medians."""
    require_cuda(args.device)
    if args.no_deepspeed:
        peer, why = None, "left out (--no-deepspeed)"
    else:
        peer, why = _peer_python(args.peer_python)
        if peer is not None:
            failed = build_ops(peer)
            if failed:
                print(f"note: DeepSpeed's ops did not build: {failed}\nDeepSpeed is left out of this comparison; "
                      "ours goes on.")
                peer, why = None, f"{why}, but its ops did not build: {failed}"
    with bench_paths(args.paths) as paths:
        root = paths[0]
        n = max(1, args.params // (WIDTH * WIDTH)) * WIDTH * WIDTH  # whole Linear(2048, 2048) layers
        print(f"compare: {format_size(n * (2 if args.bf16 else 4))} of {'bf16' if args.bf16 else 'fp32'} "
              f"weights ({n / 1e6:.1f}M parameters in {n // (WIDTH * WIDTH)} layers), optimizer state on NVMe"
              + (", weights on NVMe" if args.params_nvme else "") + f", computed on {args.device}"
              + f", {args.rounds} round(s), in {root}")
        print(f"DeepSpeed: {why}" if not peer else f"DeepSpeed {why} ({peer})")
        runs, failed = _rounds(args, peer, root)
        if failed:
            why = f"{why}, but its run failed: {failed}"
        doc = {"params": args.params, "bf16": args.bf16, "params_nvme": args.params_nvme, "device": args.device,
               "deepspeed": why,
               "runs": runs, "medians": {name: _medians(results, runs) for name, results in runs.items()}}
        print(report.table(["variant", "iteration (runs)", "step()", "peak RSS", "moved/iter", "vs DeepSpeed",
                            "vs compute alone"],
                           [_row(name, results, doc["medians"][name]) for name, results in runs.items()]))
        print("where an iteration's time goes (medians of the runs' medians; DeepSpeed's step() zeroes the grads)")
        print(report.table(["variant"] + list(PHASES),
                           [[name] + [f"{m['phases_s'][ph]:.3f} s" for ph in PHASES]
                            for name, m in doc["medians"].items()]))
        ledgers = {name: _ledger(results, n) for name, results in runs.items()}
        doc["ledger"] = {name: ledger.to_dict() if ledger else None for name, ledger in ledgers.items()}
        print("bytes per parameter per iteration (our stores' counters by kind; every process's disk bytes, "
              "/proc/<pid>/io)")
        print(report.table(["variant"] + [_SHORT[k] for k, _, _ in KINDS] + ["total", "disk (/proc)"],
                           [[name] + _ledger_row(ledger) for name, ledger in ledgers.items()]))
        if UNCHECKED in runs:
            pairs = [a["iteration_s_median"] / b["iteration_s_median"] - 1
                     for a, b in zip(runs["ours"], runs[UNCHECKED])]
            doc["checksum_cost"] = statistics.median(pairs)
            print(f"checksums (on by default) cost {doc['checksum_cost']:+.1%} of an iteration: median of the rounds' "
                  f"on/off ratios ({', '.join(f'{x:+.1%}' for x in pairs)})")
        if args.json:
            report.write_json(args.json, doc)
    return EXIT_OK


def _rounds(args: argparse.Namespace, peer: Optional[str], root: str) -> tuple[dict[str, list], Optional[str]]:
    """Each variant's results, one per round; the extras join after the first round (they are sized by it).
    A DeepSpeed run that fails (its ops fail to build, say) is reported and left out, with why (the second
    value); ours are still measured."""
    variants = [("ours", {})]
    if not args.no_extras:  # what the default integrity check costs, run beside ours in every round
        variants.append((UNCHECKED, {"checksum": "off"}))
    if peer:
        variants.append((DEEPSPEED, {}))
    if not args.no_extras:
        variants.append((TORCH, {}))
    runs: dict[str, list] = {}
    failed = None
    bar = progress(None, "compare: runs, each a process")  # the extras join after the first round
    for r in range(args.rounds):
        bar.total = bar.n + len(variants) * (args.rounds - r)
        bar.refresh()
        for name, kw in variants if r % 2 == 0 else variants[::-1]:
            bar.set_postfix_str(f"round {r + 1}: {name}")
            system = {DEEPSPEED: DEEPSPEED, TORCH: "torch"}.get(name, "ours")
            try:
                result = _run(peer if system == DEEPSPEED else sys.executable, system, root, args, **kw)
                bar.update(1)
            except BenchError as err:
                if system != DEEPSPEED:
                    raise
                failed = str(err).splitlines()[-1][-300:]
                runs.pop(DEEPSPEED, None)  # the rounds it ran are not a comparison: none of it is reported
                print(f"note: {err}\nDeepSpeed is left out of this comparison; ours goes on.")
                continue
            runs.setdefault(name, []).append(result)
        if failed:
            variants = [v for v in variants if v[0] != DEEPSPEED]
        if r == 0 and not args.no_extras:
            variants += _extras(args, runs)
    bar.close()
    return runs, failed


def _medians(results: list, runs: dict) -> dict:
    """One variant's medians over the rounds, and its ratios to DeepSpeed's and to compute alone."""
    ds = _median(runs.get(DEEPSPEED), "iteration_s_median")
    floor = _median(runs.get(TORCH), "iteration_s_median")
    it = _median(results, "iteration_s_median")
    return {"iteration_s": it, "step_s": _median(results, "step_s_median"),
            "peak_rss_bytes": max(x["peak_rss_bytes"] for x in results),
            "bytes_per_iteration": results[-1].get("bytes_per_iteration"),
            "speedup_vs_deepspeed": ds / it if ds else None, "vs_compute_alone": it / floor if floor else None,
            "phases_s": {ph: statistics.median(x["phases_s_median"][ph] for x in results) for ph in PHASES}}


def _row(name: str, results: list, m: dict) -> list:
    spread = ", ".join(f"{x['iteration_s_median']:.2f}" for x in results)
    moved, ds, floor = m["bytes_per_iteration"], m["speedup_vs_deepspeed"], m["vs_compute_alone"]
    return [name, f"{m['iteration_s']:.3f} s ({spread})", f"{m['step_s']:.3f} s", format_size(m["peak_rss_bytes"]),
            format_size(moved) if moved is not None else "-",
            f"{ds:.2f}x" if ds and name not in (DEEPSPEED, TORCH) else "-",
            f"{floor:.2f}x" if floor and name != TORCH else "-"]


def _extras(args, runs: dict) -> list:
    """Our variants with extras, labelled: a host cache that brings our peak RSS up to DeepSpeed's (when it ran),
    overlap_backward, bf16 state for a bf16 model, and int8 state (with overlap_backward, and for a bf16 model
    without fp32 masters too)."""
    out = []
    if DEEPSPEED in runs:
        room = runs[DEEPSPEED][0]["peak_rss_bytes"] - runs["ours"][0]["peak_rss_bytes"]
        if room > 64 << 20:
            out.append((f"ours + host cache {format_size(room)} (DeepSpeed's RSS)", {"host_cache": room}))
    out.append((OVERLAP, {"overlap": True}))
    if args.bf16:
        out.append(("ours + bf16 state", {"state_dtype": "bf16"}))
    out.append((INT8, {"state_dtype": "int8"}))
    out.append((INT8 + " + overlap_backward", {"state_dtype": "int8", "overlap": True}))
    if args.bf16:
        out.append((INT8 + ", no master + overlap_backward", {"state_dtype": "int8", "overlap": True, "master": False}))
    if args.params_nvme:  # what the updates cost when they wait for the global norm (no grads handed over)
        out.append((INT8 + " + overlap_backward + max_grad_norm", {"state_dtype": "int8", "overlap": True,
                                                                   "clip": 1.0}))
    return out


_SHORT = {"weights read in forward": "w fwd", "weights read in backward": "w bwd",
          "weights read by the step": "w step", "grads written": "g out", "grads read": "g in",
          "state read": "state in", "state written": "state out", "weights written": "w out"}


def _ledger(results: list, params: int) -> Optional[Ledger]:
    """A variant's ledger: its last run's (each run's counts are the same but for the disk's noise)."""
    doc = results[-1].get("ledger") if results else None
    return Ledger.from_dict(doc, params) if doc else None


def _ledger_row(ledger: Optional[Ledger]) -> list:
    if ledger is None:
        return ["-"] * (len(KINDS) + 2)
    counted = bool(ledger.total)  # DeepSpeed and torch in memory: the process's disk bytes alone
    return ([f"{ledger.kinds.get(k, 0):.2f}" if counted else "-" for k, _, _ in KINDS]
            + [f"{ledger.total:.2f}" if counted else "-", f"{ledger.disk:.2f}" if ledger.disk is not None else "-"])


def _median(results, key) -> Optional[float]:
    return statistics.median(x[key] for x in results) if results else None


# -- DeepSpeed's ops, built once, in a directory of ours ----------------------------------------------------

# NOTE: DeepSpeed compiles its CPU Adam and aio ops the first time they load, with torch's cpp_extension, which
# holds a file named "lock" in the op's build directory while it builds and waits forever ("Waiting for lock")
# for one it finds: a build killed half way blocks every later run until the file is removed by hand. The ops are
# built here before the first round, as a step of their own with a progress bar, in TORCH_EXTENSIONS_DIR of our
# own (the runs use the same), under an flock of ours on that directory. Whoever holds the flock is the only
# builder there, so a "lock" file found while holding it was left by a build that died: it is removed, named.
_OPS = ("CPUAdamBuilder", "AsyncIOBuilder")
_BUILD = "from deepspeed.ops.op_builder import {ops}\nfor b in ({ops},):\n    b().load()"


def extensions_dir() -> str:
    """Where DeepSpeed's ops are built for compare (``$XDG_CACHE_HOME`` or ~/.cache, nvme-offload's part)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(cache, "nvme-offload", "torch_extensions")


def _peer_env() -> dict:
    return dict(os.environ, TORCH_EXTENSIONS_DIR=extensions_dir())


def build_ops(python: str, *, timeout: float = 3600) -> Optional[str]:
    """Build DeepSpeed's CPU Adam and aio ops with ``python`` (nothing to do once built), showing progress; the
    last lines of the build's error where it failed, else None."""
    directory = extensions_dir()
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, ".offload-bench.lock"), "a") as held:
        try:
            fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another offload-bench compare building DeepSpeed's ops in {directory} ...", flush=True)
            fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        for stale in glob.glob(os.path.join(directory, "*", "lock")):
            os.unlink(stale)
            print(f"removed {stale}, left by a build of DeepSpeed's ops that did not finish")
        code = _BUILD.format(ops=", ".join(_OPS))
        with tempfile.TemporaryFile("w+") as log, \
                progress(None, "building DeepSpeed's ops (minutes, the first time only)") as bar:
            proc = subprocess.Popen([python, "-c", code], stdout=log, stderr=subprocess.STDOUT, text=True,
                                    env=_peer_env())
            start = time.monotonic()
            try:
                while proc.poll() is None:
                    if time.monotonic() - start > timeout:
                        raise BenchError(f"building DeepSpeed's ops took more than {timeout:.0f} s")
                    time.sleep(0.5)
                    bar.refresh()  # the elapsed time moves
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            log.seek(0)
            output = log.read()
        if proc.returncode == 0:
            return None
        return " / ".join(output.strip().splitlines()[-3:])[-500:] or f"exit status {proc.returncode}"
