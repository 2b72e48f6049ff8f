"""One run of a side-by-side comparison, in a process of its own (so its peak RSS is its own): nvme-offload or
DeepSpeed ZeRO-3 training the same stack of ``Linear(width, width)`` layers on the same disk, with optimizer state
(and with ``--params-nvme`` the weights) on NVMe, or the same model trained in memory by torch's AdamW (``torch``:
the compute alone, no I/O). Prints one JSON line, with each iteration's forward, backward, step and zero_grad
timed apart (on a GPU, each phase until the device has finished it). Run by ``offload-bench compare``;
DeepSpeed's run needs a Python where ``import deepspeed`` works (``--peer-python``), and is never a dependency.

Each run also counts what every iteration moves (:mod:`offload.tools.ledger`): by kind from our stores' counters,
and for every system the process's disk bytes.

Usage: ``python -m offload.tools.peer {ours,deepspeed,torch} NVME_DIR PARAMS [--params-nvme] [--bf16]
[--host-cache BYTES] [--state-dtype fp32|bf16|int8] [--no-master] [--max-grad-norm X] [--iterations N]
[--checksum on|off] [--overlap] [--device cpu|cuda]``
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time

from .ledger import Meter, counters_of

WIDTH = 2048
BATCH = 4


def linear_stack(params: int, dtype):
    """The compared model: ``params // 2048**2`` (at least one) ``Linear(2048, 2048)`` without bias, seeded."""
    import torch

    layers = max(1, params // (WIDTH * WIDTH))
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)]).to(dtype)


def _ours(args, dtype) -> dict:
    from offload import OffloadedAdamW, offload_parameters
    from offload.params import offloaded

    model = linear_stack(args.params, dtype).to(args.device)
    if args.params_nvme:
        offload_parameters(model, nvme_path=os.path.join(args.nvme, "w"), max_in_cpu=0, max_grad_in_cpu=0,
                           config={"checksum": args.checksum == "on"})
    opt = OffloadedAdamW(model.parameters(), lr=1e-3, nvme_path=os.path.join(args.nvme, "s"),
                         host_cache=args.host_cache, state_dtype=args.state_dtype, checksum=args.checksum == "on",
                         overlap_backward=args.overlap, master_weights=not args.no_master,
                         max_grad_norm=args.max_grad_norm)
    counters = counters_of(opt, offloaded(model).store if args.params_nvme else None)
    try:
        result = _loop(_steps(model, lambda loss: loss.backward(), opt.step, opt.zero_grad), dtype,
                       args.iterations, counters, args.device, _count(args))
    finally:
        opt.close()
    return dict(result, system="nvme-offload")


def _count(args) -> int:
    """Parameters of the compared model: whole ``Linear(WIDTH, WIDTH)`` layers."""
    return max(1, args.params // (WIDTH * WIDTH)) * WIDTH * WIDTH


def _torch(args, dtype) -> dict:
    """The same model and optimizer in memory (torch's fused AdamW): the compute alone."""
    import torch

    model = linear_stack(args.params, dtype).to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    return dict(_loop(_steps(model, lambda loss: loss.backward(), opt.step, opt.zero_grad), dtype, args.iterations,
                      dict, args.device, _count(args)), system="torch (in memory)")


def _steps(forward, backward, step, zero_grad):
    """One iteration's phases: ``forward(x)``, ``backward(loss)``, ``step()``, ``zero_grad()``."""
    return [("forward", lambda x: forward(x).float().pow(2).mean()), ("backward", backward),
            ("step", lambda _: step()), ("zero_grad", lambda _: zero_grad())]


def _deepspeed(args, dtype) -> dict:
    import torch

    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29531"), ("RANK", "0"), ("WORLD_SIZE", "1"),
                 ("LOCAL_RANK", "0")):
        os.environ.setdefault(k, v)
    import deepspeed

    model = linear_stack(args.params, torch.float32)
    # DeepSpeed stops with "Not enough buffers" for weights on NVMe with fewer than about 20 buffers here.
    # On a GPU its buffers are pinned, as ours are there ("auto"), and without --params-nvme the weights stay on
    # the GPU, as ours do; on the CPU accelerator the weights are the host's either way.
    pin = args.device == "cuda"
    if args.params_nvme:
        param = {"device": "nvme", "nvme_path": args.nvme, "buffer_count": 20, "buffer_size": 1e8, "max_in_cpu": 0,
                 "pin_memory": pin}
    else:
        param = {"device": "none"} if pin else {"device": "cpu"}
    cfg = {
        "train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "nvme", "nvme_path": args.nvme, "buffer_count": 4, "pin_memory": pin},
            "offload_param": param},
        "aio": {"block_size": 1 << 20, "queue_depth": 32, "thread_count": 1, "single_submit": False,
                "overlap_events": True},
    }
    if dtype == torch.bfloat16:
        cfg["bf16"] = {"enabled": True}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)

    # engine.step() zeroes the grads itself: its zero_grad phase is empty.
    return dict(_loop(_steps(engine, engine.backward, engine.step, lambda: None), dtype, args.iterations, dict,
                      args.device, _count(args)), system="deepspeed", version=deepspeed.__version__)


def _loop(phases, dtype, n: int, counters, device: str, params: int) -> dict:
    """Time ``n`` iterations (forward, backward, step, zero_grad, each apart, on a GPU each until the device
    has finished it); the first (no state to read) is left out of the medians and of the ledger, which
    ``counters()`` (our stores' counters; ``dict`` for none) and the process's disk bytes give. ``step_s`` is
    step() with zero_grad (what follows backward)."""
    import torch

    x = torch.randn(BATCH, WIDTH, dtype=dtype).to(device)
    done = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times: dict = {name: [] for name, _ in phases}
    iters, per_iter = [], []
    meter = Meter(params, counters)
    for i in range(n):
        counted = i > 0
        before = sum(counters().values())
        if counted:
            meter.start()
        value = x
        t0 = last = time.perf_counter()
        for name, run in phases:
            value = run(value)
            done()
            now = time.perf_counter()
            times[name].append(now - last)
            last = now
            if counted and name in ("forward", "backward", "zero_grad"):
                meter.phase("step" if name == "zero_grad" else name)
        if counted:
            meter.end()
        iters.append(last - t0)
        per_iter.append(sum(counters().values()) - before)
    steps = [a + b for a, b in zip(times["step"], times["zero_grad"])]
    return {"iteration_s": iters[1:], "step_s": steps[1:], "iteration_s_median": statistics.median(iters[1:]),
            "step_s_median": statistics.median(steps[1:]),
            "phases_s_median": {name: statistics.median(t[1:]) for name, t in times.items()},
            "bytes_per_iteration": per_iter[-1] if counters is not dict else None,
            "ledger": meter.ledger().to_dict(),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def main(argv=None) -> int:
    """Run one system's measurement (see the module) and print its JSON line; returns the exit code."""
    p = argparse.ArgumentParser(prog="python -m offload.tools.peer", description=__doc__.splitlines()[0])
    p.add_argument("system", choices=("ours", "deepspeed", "torch"))
    p.add_argument("nvme")
    p.add_argument("params", type=int)
    p.add_argument("--params-nvme", action="store_true")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--host-cache", type=int, default=0)
    p.add_argument("--state-dtype", choices=("fp32", "bf16", "int8"), default="fp32")
    p.add_argument("--no-master", action="store_true", help="ours: master_weights=False")
    p.add_argument("--max-grad-norm", type=float, default=None, help="ours: clipping by the optimizer")
    p.add_argument("--iterations", type=int, default=6)
    p.add_argument("--checksum", choices=("on", "off"), default="on", help="ours: checksums of swapped state")
    p.add_argument("--overlap", action="store_true", help="ours: overlap_backward=True")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the model computes")
    args = p.parse_args(argv)
    import torch

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    n = _count(args)
    result = {"ours": _ours, "deepspeed": _deepspeed, "torch": _torch}[args.system](args, dtype)
    print(json.dumps(dict(result, params=n, params_on_nvme=args.params_nvme, bf16=args.bf16,
                          host_cache=args.host_cache, state_dtype=args.state_dtype, checksum=args.checksum,
                          overlap_backward=args.overlap, master_weights=not args.no_master, device=args.device)),
          flush=True)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
