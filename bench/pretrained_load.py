"""Loading a safetensors checkpoint into offloaded weights, against the disk's copy bound.

    python bench/pretrained_load.py [--path DIR] [--size 2GiB] [--rounds 3] [--other-tree DIR]
                                    [--what offload_pretrained,load_safetensors] [--profile] [--json FILE]

Writes a checkpoint of ``nn.Linear(4096, 4096)`` bf16 layers (``--size`` in all, Hugging Face shards of 1 GB),
then loads it again and again, each load in a fresh process with the page cache dropped first
(``sync; echo 3 > /proc/sys/vm/drop_caches``; needs root, else it says so and goes on with a warm cache):

- ``offload_pretrained``: the model built on meta, each module's weights read and written to a new swap file;
- ``load_safetensors``: into a model offloaded already (its swap file written once before, untimed).

With ``--other-tree`` (another checkout of this project, e.g. ``git worktree add /tmp/old <commit>``) its loads
are timed too, interleaved with this tree's round by round and which goes first alternating (the disk's speed
drifts between runs, and whoever runs second tends to gain). ``--profile`` prints each load's cProfile. The
bound is fio's
read and write rates on the same directory, the weights' bytes copied once each way, as ``offload-bench
scale`` states it; plain ``dd`` reads of a shard and writes of a new file of the same size are shown beside it.
Everything it writes is in a temporary directory under ``--path`` (default: the system's), removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIDE = 4096


def _model(layers: int):
    import torch
    from torch import nn

    from offload.params import empty_parameters

    with empty_parameters():
        return nn.Sequential(*[nn.Linear(SIDE, SIDE, bias=False, dtype=torch.bfloat16) for _ in range(layers)])


def write_checkpoint(directory: str, layers: int) -> None:
    """A checkpoint of ``layers`` random bf16 layers, one tensor in memory at a time."""
    import torch

    from offload.pretrained import write_checkpoint as write
    from offload.pretrained.save import Tensor

    def tensor(i: int) -> Tensor:
        def fill(f):
            g = torch.Generator().manual_seed(i)
            f.write(torch.randn(SIDE, SIDE, generator=g).to(torch.bfloat16).view(torch.uint8).numpy())
        return Tensor(f"{i}.weight", (SIDE, SIDE), torch.bfloat16, fill)

    write(directory, [tensor(i) for i in range(layers)], max_shard_size="1GB")


def child(args: argparse.Namespace) -> None:
    """One load, in this process: prints its seconds."""
    import torch  # noqa: F401 - imported before the clock starts

    from offload import offload_parameters
    from offload.params import offloaded
    from offload.pretrained import load_safetensors, offload_pretrained
    from offload.tools.scale import PARAM_OFFLOAD, close_offloaded

    profile = None
    if args.profile:
        import cProfile
        profile = cProfile.Profile()
        profile.enable()
    layers = args.layers
    if args.what == "load_safetensors":
        model = offload_parameters(_model(layers), nvme_path=args.swap, init=False, **PARAM_OFFLOAD)
        start = time.perf_counter()
        load_safetensors(model, args.ckpt)
    else:
        start = time.perf_counter()
        model = offload_pretrained(lambda: _model(layers), args.ckpt, args.swap, **PARAM_OFFLOAD)
    with offloaded(model).store.exclusive():  # the clock stops once the last weights written have landed
        took = time.perf_counter() - start
    if profile is not None:
        import pstats
        profile.disable()
        pstats.Stats(profile, stream=sys.stderr).sort_stats("tottime").print_stats(14)
    close_offloaded(model)
    print(json.dumps({"seconds": took}))


def drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def run_child(tree: str, what: str, ckpt: str, swap: str, layers: int, args) -> float:
    """Seconds of one load by the checkout ``tree``, in a new process."""
    env = dict(os.environ, PYTHONPATH=tree)
    extra = ["--profile"] if args.profile else []
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--what", what,
                          "--ckpt", ckpt, "--swap", swap, "--layers", str(layers), *extra],
                         env=env, capture_output=True, text=True, cwd=tree)
    if out.returncode:
        raise SystemExit(f"{what} by {tree} failed:\n{out.stderr[-3000:]}")
    if args.profile:
        print(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])["seconds"]


def dd(args: list[str]) -> float:
    """GiB/s of a ``dd`` run: the bytes it reports over the time the process took."""
    start = time.perf_counter()
    out = subprocess.run(["dd", *args], capture_output=True, text=True, check=True)
    took = time.perf_counter() - start
    nbytes = int(out.stderr.strip().splitlines()[-1].split()[0])
    return nbytes / took / (1 << 30)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--path", help="directory to work in (default: the system's temporary directory)")
    ap.add_argument("--size", default="2GiB", help="bytes of weights (default 2GiB)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--what", default="offload_pretrained,load_safetensors")
    ap.add_argument("--other-tree", help="another checkout of this project to time beside this one")
    ap.add_argument("--profile", action="store_true", help="print each load's cProfile, slowest functions first")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--swap", help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args)
        return 0
    sys.path.insert(0, HERE)
    from offload.sizes import GIB, parse_size
    from offload.tools import report
    from offload.tools.fio import write_read_gib_s

    layers = max(1, parse_size(args.size) // (2 * SIDE * SIDE))
    nbytes = layers * 2 * SIDE * SIDE
    whats = args.what.split(",")
    trees = {"this": HERE, **({"other": os.path.abspath(args.other_tree)} if args.other_tree else {})}
    variants = list(trees)
    times: dict[str, list[float]] = {f"{v} {w}": [] for w in whats for v in variants}
    with tempfile.TemporaryDirectory(prefix="pretrained-load-", dir=args.path) as work:
        ckpt = os.path.join(work, "ckpt")
        write_checkpoint(ckpt, layers)
        shards = sorted(n for n in os.listdir(ckpt) if n.endswith(".safetensors"))
        shard = shards[0]
        print(f"{layers} layers of {SIDE}x{SIDE} bf16: {nbytes / GIB:.2f} GiB in {len(shards)} shards "
              f"under {work}; {args.rounds} rounds")
        cold = drop_caches()
        if not cold:
            print("cannot drop the page cache (not root): loads read a warm cache")
        fio_write, fio_read = write_read_gib_s([work], min(nbytes, GIB), 1 << 20, 32, 1)
        for r in range(args.rounds):
            order = variants if r % 2 == 0 else variants[::-1]  # whoever runs second is not always the same
            for what in whats:
                for v in order:
                    swap = os.path.join(work, f"swap-{v}")
                    drop_caches()
                    t = run_child(trees[v], what, ckpt, swap, layers, args)
                    times[f"{v} {what}"].append(t)
                    print(f"round {r}: {v:7s} {what:18s} {t:6.2f} s  {nbytes / t / GIB:5.2f} GiB/s", flush=True)
            drop_caches()
            read = dd([f"if={os.path.join(ckpt, shard)}", "of=/dev/null", "bs=8M", "iflag=direct"])
            plain = os.path.join(work, "plain")
            write = dd(["if=/dev/zero", f"of={plain}", "bs=8M", f"count={max(1, nbytes // (8 << 20))}",
                        "oflag=direct", "conv=fsync"])
            os.unlink(plain)
            print(f"round {r}: dd read of a shard {read:.2f} GiB/s, dd write of a new file {write:.2f} GiB/s")
    bound = report.disk_bound(nbytes, nbytes, fio_read, fio_write)
    print(f"fio: read {fio_read} GiB/s, write {fio_write} GiB/s; copy bound {bound and round(bound, 2)} s")
    rows = {}
    for key, ts in times.items():
        med = statistics.median(ts)
        rows[key] = {"seconds": ts, "median_s": med, "gib_s": nbytes / med / GIB,
                     "of_bound": bound / med if bound else None}
        spread = f"{min(ts):.2f}-{max(ts):.2f} s"
        of = f", {bound / med:.2f}x of the copy bound" if bound else ""
        print(f"{key:28s} median {med:6.2f} s ({spread}), {nbytes / med / GIB:.2f} GiB/s{of}")
    if args.json:
        report.write_json(args.json, {"bytes": nbytes, "fio_read_gib_s": fio_read, "fio_write_gib_s": fio_write,
                                      "copy_bound_s": bound, "cold_cache": cold, "results": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
