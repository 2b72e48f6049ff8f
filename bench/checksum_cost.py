"""What the per-unit checksums cost a training iteration: one model and OffloadedAdamW, checksums on and off in turn.

Usage: ``PYTHONPATH=. python bench/checksum_cost.py --params 64M --iterations 96 [--host-cache 256MiB]
[--path DIR]``.

The model is the one ``offload-bench compare`` trains beside DeepSpeed (a stack of ``Linear(2048, 2048)``,
batch 4, fp32, Adam state on NVMe); each iteration is timed whole: forward, backward, step, zero_grad. One
optimizer, one swap file: the byte store's checksums are switched on and off from iteration to iteration (on,
off, off, on, ...), because two optimizers on two files measure where the files lie on the disk more than the
checksums. An iteration with checksums on computes the digests of everything it writes and checks everything
it reads (on the engine's threads); one with them off computes none. Only the iterations "on" that follow one
"on" are timed with checksums (after one without, there are no digests to check the reads against). The figure
is the median iteration with over the median iteration without, and the same for the step alone.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from offload import OffloadedAdamW
from offload.sizes import parse_count, parse_size
from offload.tools.peer import BATCH, WIDTH, linear_stack


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="64M")
    ap.add_argument("--iterations", type=int, default=96)
    ap.add_argument("--host-cache", default="0")
    ap.add_argument("--path", help="directory for the swap files (default: a scratch directory, removed after)")
    args = ap.parse_args(argv)
    model = linear_stack(parse_count(args.params), torch.float32)
    layers = len(model)
    x = torch.randn(BATCH, WIDTH)
    with tempfile.TemporaryDirectory(dir=args.path) as scratch:
        opt = OffloadedAdamW(model.parameters(), lr=1e-3, nvme_path=scratch, host_cache=parse_size(args.host_cache))
        times: dict = {(on, what): [] for on in (True, False) for what in ("iteration", "step")}
        try:
            for i in range(-2, args.iterations):  # two iterations first: the first reads nothing
                on = i < 0 or i % 4 in (0, 3)
                opt.state_store.bytes.checksum = on  # the byte store's switch, per iteration for this measurement
                t0 = time.perf_counter()
                model(x).pow(2).mean().backward()
                t1 = time.perf_counter()
                opt.step()
                opt.zero_grad()
                t2 = time.perf_counter()
                # One after an iteration without checksums has no digests to check its reads against: not timed.
                if i >= 0 and (not on or i % 4 == 0):
                    times[on, "iteration"].append(t2 - t0)
                    times[on, "step"].append(t2 - t1)
        finally:
            opt.close()
    print(f"{layers} x Linear({WIDTH}, {WIDTH}) fp32 ({layers * WIDTH * WIDTH / 1e6:.0f}M parameters), batch {BATCH}, "
          f"host cache {args.host_cache}, {args.iterations} iterations, checksums on and off in turn")
    for what in ("iteration", "step"):
        on, off = times[True, what], times[False, what]
        mon, moff = statistics.median(on), statistics.median(off)
        print(f"{what:9s} with checksums {mon:.3f} s, without {moff:.3f} s: cost {100 * (mon / moff - 1):+.1f}% "
              f"(spread on {min(on):.3f}..{max(on):.3f} s, off {min(off):.3f}..{max(off):.3f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
