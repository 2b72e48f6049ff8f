"""Bytes and peak memory of FSDP2 with weights and state on NVMe, per rank, beside one process's ledger.

``python tests/fsdp2_ledger.py DIR [LAYERS] [ITERATIONS]`` trains ``LAYERS`` Linear(1024, 1024) layers (each
``fully_shard``-ed, bf16 mixed precision) on 2 gloo ranks, once with the local shards on NVMe
(``offload_parameters``) and once with them in memory, ``OffloadedAdamW``'s state on NVMe both times, swap files
under DIR; then the same model in one process with its weights on NVMe. It prints each rank's bytes per local
parameter per iteration (the stores' counters, kind by kind, and ``/proc/self/io``), the one process's per
parameter (what the single-rank ledger predicts for a rank's shard), and each rank's peak resident memory over
the measured iterations (VmHWM, reset after a first iteration and ``malloc_trim``) beside its pools and shards. The
ranks build the model on the meta device and materialise only their shards (``to_empty``), as for a model larger
than a rank's memory. Nothing is asserted: it measures.
"""

from __future__ import annotations

import ctypes
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist
from ranks import fork_ranks
from torch import nn

from offload import OffloadedAdamW, offload_parameters, restore_parameters
from offload.distributed import local
from offload.params import offloaded
from offload.tools.ledger import Meter, counters_of

WIDTH = 1024


def build(layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(layers)])


def vm(field: str) -> int:
    """A /proc/self/status figure, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return -1


def run(model: nn.Module, path: str, iterations: int, weights: bool) -> dict:
    """Train ``iterations`` + 1 iterations; the ledger and peak memory of the last ``iterations``."""
    os.makedirs(path, exist_ok=True)
    if weights:
        offload_parameters(model, nvme_path=os.path.join(path, "weights"), max_in_cpu=0, offload_grads=False)
    store = offloaded(model).store if weights else None
    # A pool far smaller than the state (16 MiB), so the state is read and written each step as for a large model.
    opt = OffloadedAdamW(model.parameters(), lr=1e-3, nvme_path=os.path.join(path, "state"), buffer_count=4,
                         buffer_size=1 << 20)
    local_params = sum(local(p).numel() for p in model.parameters())
    meter = Meter(local_params, counters_of(opt, store))
    try:
        for it in range(iterations + 1):
            if it == 1:
                if store is not None:
                    store.reset_peak()  # the most shard bytes resident at once, over the measured iterations
                ctypes.CDLL("libc.so.6").malloc_trim(0)  # what the build freed goes back to the system, in both modes
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # VmHWM from here: the measured iterations only
            torch.manual_seed(it)
            x = torch.randn(16, WIDTH)
            if it:
                meter.start()
            loss = model(x).float().square().mean()
            if it:
                meter.phase("forward")
            loss.backward()
            if it:
                meter.phase("backward")
            opt.step()
            opt.zero_grad()
            if it:
                meter.phase("step")
                meter.end()
        ledger = meter.ledger()
        return {"local_params": local_params, "kinds": {k: round(v, 3) for k, v in ledger.kinds.items() if v},
                "total": round(ledger.total, 3), "disk": None if ledger.disk is None else round(ledger.disk, 3),
                "peak_rss": vm("VmHWM"), "rss": vm("VmRSS"),
                "shard_bytes": sum(local(p).numel() * local(p).element_size() for p in model.parameters()),
                "param_pool": store.pool.nbytes if store is not None else 0,
                "shards_resident_max": store.resident_bytes_max if store is not None else None,
                "state_pool": opt.host_pool_bytes}
    finally:
        opt.close()
        if weights:
            restore_parameters(model)


def rank_main(out: str, layers: int, iterations: int, weights: bool, rank: int) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
    mode = "nvme" if weights else "memory"
    dist.init_process_group("gloo", init_method=f"file://{out}/rendezvous-{mode}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=300))
    try:
        with torch.device("meta"):  # as a model larger than a rank's memory is built: only the shards get memory
            model = build(layers)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        for layer in model:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        for layer in model:
            layer.reset_parameters()
        result = run(model, os.path.join(out, f"r{rank}"), iterations, weights)
        with open(os.path.join(out, f"{mode}.rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def main() -> int:
    out = os.path.abspath(sys.argv[1])
    layers = int(sys.argv[2]) if len(sys.argv) > 2 else 16
    iterations = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    os.makedirs(out, exist_ok=True)
    for weights in (True, False):  # each job forked from this process, which has trained nothing
        if any(fork_ranks(2, lambda rank, w=weights: rank_main(out, layers, iterations, w, rank), timeout=1200)):
            return 1
    params = layers * (WIDTH * WIDTH + WIDTH)
    print(f"{layers} x Linear({WIDTH}, {WIDTH}): {params / 1e6:.1f} M parameters, {params * 4 / 2**20:.0f} MiB fp32")
    for r in range(2):
        for mode in ("nvme", "memory"):
            with open(os.path.join(out, f"{mode}.rank{r}.json")) as f:
                print(f"rank {r}, shards in {mode}: {f.read()}")
    one = run(build(layers), os.path.join(out, "one"), iterations, True)
    print(f"one process, weights + state on NVMe: {json.dumps(one)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
