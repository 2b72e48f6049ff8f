"""What the per-unit checksums cost: one OffloadedAdamW's steps with checksums on and off, in turn.

Usage: ``PYTHONPATH=. python bench/checksum_cost.py --params 64M --steps 24 [--host-cache 256MiB] [--path DIR]``.

One optimizer, one swap file: the byte store's checksums are switched on and off from step to step (on, off,
off, on, ...), because two optimizers on two files measure where the files lie on the disk more than the
checksums. A step with checksums on computes the digests of everything it writes and checks everything it reads
(on the engine's threads); one with them off computes none. Only the steps "on" that follow a step "on" are
timed with checksums (after a step without, there are no digests to check the reads against). The figure is
the median step with over the median step without.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from offload import OffloadedAdamW
from offload.bench.workload import synthetic_params
from offload.units import parse_count, parse_size


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="64M")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--host-cache", default="0")
    ap.add_argument("--path", help="directory for the swap files (default: a scratch directory, removed after)")
    args = ap.parse_args(argv)
    params = synthetic_params(parse_count(args.params))
    with tempfile.TemporaryDirectory(dir=args.path) as scratch:
        opt = OffloadedAdamW(params, lr=1e-3, nvme_path=scratch, host_cache=parse_size(args.host_cache))
        try:
            opt.step()
            opt.step()  # the first steps read nothing, then warm the cache
            times: dict = {True: [], False: []}
            for i in range(args.steps):
                on = i % 4 in (0, 3)
                opt.state_store.bytes.checksum = on  # the byte store's switch, per step for this measurement
                t = time.perf_counter()
                opt.step()
                # A step after one without checksums has no digests to check its reads against: not timed.
                if not on or i % 4 == 0:
                    times[on].append(time.perf_counter() - t)
        finally:
            opt.close()
    on, off = statistics.median(times[True]), statistics.median(times[False])
    print(f"{args.params} fp32 parameters, host cache {args.host_cache}, {args.steps} steps, "
          "checksums on and off in turn")
    print(f"step with checksums {on:.3f} s, without {off:.3f} s: cost {100 * (on / off - 1):+.1f}% "
          f"(spread on {min(times[True]):.3f}..{max(times[True]):.3f} s, off {min(times[False]):.3f}.."
          f"{max(times[False]):.3f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
