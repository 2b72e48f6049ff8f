"""``offload-bench plan``: before a run, where each kind of training state will live, what host memory and NVMe
space it needs, the bytes it moves per step, the step's disk-bound time and the drive writes per day, whether
it fits this machine, and what to change when it does not.

The model is a Hugging Face ``config.json`` (built on the meta device: no memory, exact shapes, tied weights
counted once) or a parameter count and dtype. Sizes come from the library's own layout of optimizer state
(units of one pool buffer, the same packing the optimizer does), so what is printed is what the optimizer
reserves and moves; a test checks it against the optimizer's counters.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
from typing import Optional, Sequence

import psutil
import torch

from ..adam.wear import wear_threshold
from ..bytes import auto_cache_bytes
from ..config import Config, config_to_dict
from ..config.files import read_config_bytes
from ..params import smallest_within
from ..params.placement import pool_buffer_bytes
from ..sizes import ALIGNMENT, format_size, round_up
from ..state import Layout, pool_buffer_size
from . import report
from .cli import EXIT_FAILURE, EXIT_OK, UsageError, add_config_option, count_arg, size_arg

__all__ = ["MODES", "Plan", "model_params", "modes", "plan", "register"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_DAY = 86400
_TENSOR_ELEMENTS = 4 << 20  # a parameter count alone is planned as tensors of this size, like a stack of layers


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a training run will need and move (bytes, seconds); see :func:`plan`."""

    params: int  # parameter elements (trainable ones)
    dtype: str
    unit_bytes: int  # the optimizer's pool buffer, one unit of state
    state_bytes: int  # optimizer state in units (exp_avg, exp_avg_sq, fp32 masters)
    state_in_memory_bytes: int  # state of parameters under small_param_threshold, always in host memory
    host_cache_bytes: int  # state kept resident in host memory between steps
    optimizer_nvme_bytes: int  # swap space the optimizer reserves
    weights_nvme_bytes: int  # offloaded weights (offload_parameters), 0 when they stay in memory
    grads_nvme_bytes: int  # offloaded grads
    host_bytes: dict  # what holds host memory, by name
    gpu_bytes: int  # GPU memory for weights and grads when the model is on a GPU (0 otherwise)
    read_bytes: int  # per step, steady state
    write_bytes: int
    read_gib_s: Optional[float]
    write_gib_s: Optional[float]
    free_nvme_bytes: dict  # per path
    available_host_bytes: int
    wear_threshold_bytes: int = 0  # bytes a day from which the writes matter: one drive write a day of the paths
    pools: dict = dataclasses.field(default_factory=dict)  # "optimizer", "weights" -> (buffers, bytes each)

    @property
    def nvme_bytes(self) -> int:
        """Swap space the run reserves: the optimizer's, the weights' and the grads'."""
        return self.optimizer_nvme_bytes + self.weights_nvme_bytes + self.grads_nvme_bytes

    @property
    def host_total(self) -> int:
        """Host memory the run holds, every entry of ``host_bytes`` together."""
        return sum(self.host_bytes.values())

    @property
    def step_seconds(self) -> Optional[float]:
        """The disk's time for one step's bytes (reads, then writes), or None without bandwidth figures."""
        return report.disk_bound(self.read_bytes, self.write_bytes, self.read_gib_s, self.write_gib_s)

    @property
    def written_per_day(self) -> Optional[int]:
        """Bytes written to the drives per day of training at the disk-bound step time."""
        s = self.step_seconds
        return int(self.write_bytes * _DAY / s) if s else None

    def problems(self) -> list[str]:
        """What does not fit, each with what to change."""
        out = []
        if self.host_total > self.available_host_bytes:
            biggest = max(self.host_bytes, key=self.host_bytes.get)
            out.append(f"host memory: needs {format_size(self.host_total)}, {format_size(self.available_host_bytes)} "
                       f"is available; the most is {biggest} ({format_size(self.host_bytes[biggest])}): "
                       + _HOST_ADVICE.get(biggest, "reduce it"))
        paths = list(self.free_nvme_bytes)
        if paths:
            share = -(-self.nvme_bytes // len(paths))
            for path, free in self.free_nvme_bytes.items():
                if share > free:
                    out.append(f"NVMe space: {path} must hold {format_size(share)}, it has {format_size(free)} free: "
                               "free space, add a drive to nvme_path (state is striped), or set state_dtype "
                               '"bf16" (a third less for bf16 models)')
        return out

    def to_dict(self) -> dict:
        """The plan as ``--json`` writes it, with the figures derived from it and its problems."""
        doc = dataclasses.asdict(self)
        doc.update(nvme_bytes=self.nvme_bytes, host_total=self.host_total, step_seconds=self.step_seconds,
                   written_per_day=self.written_per_day, problems=self.problems())
        return doc


_HOST_ADVICE = {
    "optimizer pool": "lower offload_optimizer.buffer_count or buffer_size",
    "host cache": "lower offload_optimizer.host_cache",
    "optimizer state (device cpu)": 'set offload_optimizer.device to "nvme"',
    "weights and grads": "offload them (offload_parameters, --offload-params)",
    "parameter pool": "lower offload_param.buffer_count or buffer_size",
    "weights kept in memory": "lower offload_param.max_in_cpu",
    "grads kept in memory": "lower offload_param.max_grad_in_cpu",
    "small parameters' state": "lower offload_optimizer.small_param_threshold",
}


def model_params(*, hf_config: Optional[str] = None, count: Optional[int] = None,
                 dtype: str = "bf16") -> list[torch.Tensor]:
    """The trainable parameters of a model, on the meta device (shapes and dtypes only, no memory).

    Args:
        hf_config: a Hugging Face ``config.json`` (or its directory), built with ``transformers``'
            ``AutoModelForCausalLM.from_config`` on the meta device; tied weights are counted once.
        count: a parameter count instead, as tensors of 4M elements (a stack of layers).
        dtype: ``"fp32"``, ``"bf16"`` or ``"fp16"``.

    Raises:
        UsageError: neither or both given, a file that is not a model config, or transformers missing.
    """
    if (hf_config is None) == (count is None):
        raise UsageError("give a model: --hf-config config.json or --params N (one of the two)")
    torch_dtype = _DTYPES[dtype]
    if count is not None and count > _MOST_PARAMS:
        raise UsageError(f"--params {count:.3g}: a plan is for at most {_MOST_PARAMS / 1e12:g}T parameters (more than "
                         "any model trained so far); give the model's size, e.g. 7B or 1.5T")
    if count is not None:
        whole, rest = divmod(count, _TENSOR_ELEMENTS)
        sizes = [_TENSOR_ELEMENTS] * whole + ([rest] if rest else [])
        return [torch.empty(n, dtype=torch_dtype, device="meta") for n in sizes]
    try:
        import transformers
    except ImportError:
        raise UsageError("--hf-config needs the transformers package (pip install transformers), or give "
                         "--params N instead") from None
    path = os.path.join(hf_config, "config.json") if os.path.isdir(hf_config) else hf_config
    try:
        doc = json.loads(read_config_bytes(path))
        _check_sizes(doc, path)
        cfg = transformers.CONFIG_MAPPING[doc["model_type"]].from_dict(doc)
    except UsageError:
        raise
    except Exception as err:  # transformers' own validation errors are Exceptions: a user's file
        raise UsageError(f"{path} is not a Hugging Face model config ({type(err).__name__}: {err})") from None
    try:
        with torch.device("meta"):
            try:
                model = transformers.AutoModelForCausalLM.from_config(cfg)
            except ValueError:  # not a causal language model: its base model
                model = transformers.AutoModel.from_config(cfg)
        model.to(torch_dtype)
    except Exception as err:  # a config transformers takes but cannot build: the user's mistake
        raise UsageError(f"{path}: transformers cannot build this model ({type(err).__name__}: {err}); check its "
                         "sizes") from None
    return [p for p in model.parameters() if p.requires_grad]


# Config keys that count or size something (layers, heads, experts, widths): whole numbers, within bounds. A
# model is built module by module on the meta device, so the counts of repeated modules bound the time it takes.
_SIZE_KEY = re.compile(r"^(num_|n_)|(_size|_dim|_layers?|_heads|_experts|_embeddings)$")
_REPEATS = re.compile(r"layers?$|experts$")
_MOST_SIZE = 1 << 31
_MOST_REPEATS = 1024
_MOST_PARAMS = 2 * 10**12


def _check_sizes(doc, path: str, where: str = "") -> None:
    """Refuse a config whose sizes cannot be a model's (negative, fractional, text, absurdly large), naming the
    key, before transformers builds anything from it."""
    if not isinstance(doc, dict):
        raise UsageError(f"{path} is not a Hugging Face model config (not a JSON object)")
    if not where and not isinstance(doc.get("model_type"), str):
        raise UsageError(f"{path} is not a Hugging Face model config (no model_type)")
    for key, value in doc.items():
        if isinstance(value, dict) and not where:
            _check_sizes(value, path, f"{key}.")  # a sub-model's config (text_config, ...)
            continue
        if not isinstance(key, str) or not _SIZE_KEY.search(key) or value is None or isinstance(value, (bool, list)):
            continue
        most = _MOST_REPEATS if _REPEATS.search(key) else _MOST_SIZE
        if not isinstance(value, int) or not 0 <= value <= most:
            raise UsageError(f"{path}: {where}{key} is {value!r}; it must be a whole number from 0 to {most}")


def plan(params: Sequence[torch.Tensor], config: Config, *, offload_params: bool = False, on_gpu: bool = False,
         amsgrad: bool = False, nvme_paths: Sequence[str] = (), read_gib_s: Optional[float] = None,
         write_gib_s: Optional[float] = None, available_host_bytes: Optional[int] = None,
         keep_for_backward: bool = True) -> Plan:
    """What training ``params`` with OffloadedAdam(W) (and, with ``offload_params``, offload_parameters) under
    ``config`` needs and moves: sizes as the optimizer and the parameter store lay them out.

    Per step, the optimizer reads and writes every unit of state not resident in the host cache, less the
    units still in pool buffers from the last step (the pool as a cache: ``buffer_count - 1``). Offloaded
    weights are read for forward and for backward (and those without an fp32 master, fp32 ones or bf16 ones
    with ``master_weights`` off, once more by the step) and written once; offloaded grads are written in
    backward and read by the optimizer. With ``overlap_backward=True`` (``"auto"`` is planned as off: it turns on
    only for a loop that allows it) the update takes each weight as backward leaves it, resident, with its grad in
    memory: no grad round trip and no read by the step (so long as
    what waits for its update stays within twice the optimizer pool or 256 MiB, as it does when the update
    keeps up with backward; and not with ``max_grad_norm``, whose updates wait for every grad).
    ``keep_for_backward``: ``offload_parameters``' (forward's last modules resident into backward, up to the
    parameter pool's bytes, counted in memory).
    """
    oc = config.offload_optimizer
    dtype = next((k for k, v in _DTYPES.items() if params and params[0].dtype == v), "fp32")
    small = [p for p in params if p.numel() < oc.small_param_threshold]
    candidates = [(p, {}, amsgrad) for p in params if p.numel() >= oc.small_param_threshold]
    unit_bytes = pool_buffer_size(oc, candidates)
    units = Layout(unit_bytes, oc.state_dtype, master=oc.master_weights).plan(candidates)
    if available_host_bytes is None:
        available_host_bytes = psutil.virtual_memory().available
    host, cache, nvme_state, read, write = _optimizer(units, unit_bytes, config, len(nvme_paths), available_host_bytes)
    in_memory = sum(p.numel() * (8 + (4 if _keeps_master(p, oc) else 0) + (4 if amsgrad else 0)) for p in small)
    if in_memory:
        host["small parameters' state"] = in_memory
    weights_nvme = grads_nvme = gpu = 0
    if offload_params:
        held, weights_nvme, unmastered, grads_nvme, gpu = _offloaded_weights(params, config.offload_param, on_gpu, oc,
                                                                              keep_for_backward)
        host.update(held)
        # Read for forward and backward; weights without a master by the step too, and grads read by the
        # optimizer, unless the update runs inside backward.
        read += 2 * weights_nvme
        write += weights_nvme
        if oc.overlap_backward is not True:  # "auto" updates inside backward only for a loop that allows it
            read += unmastered + grads_nvme
            write += grads_nvme
    elif on_gpu:
        gpu = 2 * sum(round_up(p.numel() * p.element_size(), ALIGNMENT) for p in params)
    else:
        host["weights and grads"] = 2 * sum(round_up(p.numel() * p.element_size(), ALIGNMENT) for p in params)
    free = {}
    for path in nvme_paths:
        st = os.statvfs(_existing(path))
        free[path] = st.f_bavail * st.f_frsize
    return Plan(params=sum(p.numel() for p in params), dtype=dtype, unit_bytes=unit_bytes,
                state_bytes=sum(u.nbytes for u in units), state_in_memory_bytes=in_memory, host_cache_bytes=cache,
                optimizer_nvme_bytes=nvme_state, weights_nvme_bytes=weights_nvme, grads_nvme_bytes=grads_nvme,
                host_bytes=host, gpu_bytes=gpu, read_bytes=read, write_bytes=write, read_gib_s=read_gib_s,
                write_gib_s=write_gib_s, free_nvme_bytes=free, available_host_bytes=available_host_bytes,
                wear_threshold_bytes=wear_threshold([_existing(p) for p in nvme_paths]),
                pools=_pools(config, unit_bytes, host))


def _pools(config: Config, unit_bytes: int, host: dict) -> dict:
    """Each pool the plan holds: ``name -> (buffers, bytes each)``."""
    out = {}
    if "optimizer pool" in host:
        out["optimizer"] = (config.offload_optimizer.buffer_count, unit_bytes)
    if "parameter pool" in host:
        count = config.offload_param.buffer_count
        out["weights"] = (count, host["parameter pool"] // count)
    return out


# The ways to store and update the state, from the most exact to the leanest: what `plan` compares. Every
# row sets all three keys, so none inherits the config's (the rest of the config stands).
MODES = (
    ("fp32 state (torch's results)", {"state_dtype": "fp32", "master_weights": True, "overlap_backward": False}),
    ("bf16 state", {"state_dtype": "bf16", "master_weights": True, "overlap_backward": False}),
    ("int8 state", {"state_dtype": "int8", "master_weights": True, "overlap_backward": False}),
    ("int8 state, update inside backward", {"state_dtype": "int8", "master_weights": True,
                                            "overlap_backward": True}),
    ("int8 state, no master, inside backward", {"state_dtype": "int8", "master_weights": False,
                                                 "overlap_backward": True}),
)


def modes(params: Sequence[torch.Tensor], config: Config, **kwargs) -> list[tuple[str, Plan]]:
    """:func:`plan` of ``params`` for each of :data:`MODES` (those without a master only for bf16 weights)."""
    out = []
    for label, changes in MODES:
        if changes.get("master_weights") is False and not any(p.dtype == torch.bfloat16 for p in params):
            continue
        out.append((label, plan(params, config.replace(offload_optimizer=changes), **kwargs)))
    return out


def render_modes(rows: list[tuple[str, Plan]]) -> str:
    """The per-mode comparison as a table: NVMe space, bytes per step, the disk-bound step."""
    n = max(1, rows[0][1].params) if rows else 1
    lines = ["modes (bytes per parameter per iteration, read + written):"]
    for label, p in rows:
        step = f", disk-bound step {p.step_seconds:.2f} s" if p.step_seconds is not None else ""
        lines.append(f"  {label}: {(p.read_bytes + p.write_bytes) / n:.1f} ({p.read_bytes / n:.1f} + "
                     f"{p.write_bytes / n:.1f}), NVMe {format_size(p.nvme_bytes)}{step}")
    return "\n".join(lines)


def _optimizer(units: list, unit_bytes: int, config: Config, npaths: int, available: int) -> tuple:
    """(host memory by name, host cache bytes, swap space, bytes read and written per step) of the state."""
    oc = config.offload_optimizer
    state = sum(u.nbytes for u in units)
    if oc.device == "cpu":
        return {"optimizer state (device cpu)": state}, 0, 0, 0, 0
    host = {"optimizer pool": oc.buffer_count * unit_bytes}
    cache = min(oc.host_cache, state) if oc.host_cache != "auto" else auto_cache_bytes(
        pools=oc.buffer_count * unit_bytes, state=state, available=available, quiet=True)
    cached_units = min(len(units), cache // unit_bytes)
    if cached_units:
        host["host cache"] = cached_units * unit_bytes
    space = round_up(sum(round_up(u.nbytes, ALIGNMENT) for u in units), max(1, npaths) * config.aio.block_size)
    moving = sorted((u.nbytes for u in units), reverse=True)[cached_units:]
    write = sum(round_up(n, ALIGNMENT) for n in moving)
    pooled = sum(round_up(n, ALIGNMENT) for n in moving[:max(0, oc.buffer_count - 1)])
    return host, cached_units * unit_bytes, space, write - pooled, write


def _keeps_master(p: torch.Tensor, oc) -> bool:
    """Whether ``p`` has an fp32 master copy in the optimizer's state."""
    return p.dtype == torch.float16 or (p.dtype == torch.bfloat16 and oc.master_weights)


def _offloaded_weights(params: Sequence[torch.Tensor], pc, on_gpu: bool, oc, keep_for_backward: bool) -> tuple:
    """(host memory by name, weights on NVMe, those among them without an fp32 master, grads on NVMe, GPU
    bytes) with offload_parameters, whose rule (``smallest_within``) keeps the smallest parameters within
    max_in_cpu in memory, and the smallest offloaded grads within max_grad_in_cpu."""
    itemsize = max((p.element_size() for p in params), default=4)
    kept = smallest_within(list(params), pc.max_in_cpu)
    offloaded = [p for p in params if p not in kept]
    grad_kept = smallest_within(offloaded, pc.max_grad_in_cpu)
    buffer, needed = pool_buffer_bytes(list(params), kept, grads=True, on_device=on_gpu,
                                       max_grad_in_cpu=pc.max_grad_in_cpu, buffer_size=pc.buffer_size,
                                       itemsize=itemsize)
    host = {"parameter pool": pc.buffer_count * buffer} if needed else {}
    if kept:
        host["weights kept in memory"] = sum(p.numel() for p in kept) * itemsize
    if grad_kept:
        host["grads kept in memory"] = sum(p.numel() for p in grad_kept) * itemsize
    def nbytes(p) -> int:
        return round_up(p.numel() * p.element_size(), ALIGNMENT)

    weights = sum(nbytes(p) for p in offloaded)
    unmastered = sum(nbytes(p) for p in offloaded if not _keeps_master(p, oc))
    grads = sum(nbytes(p) for p in offloaded if p not in grad_kept)
    pool = host.get("parameter pool", 0)
    # Forward's last modules stay resident into backward, up to the pool's bytes (offload_parameters'
    # keep_for_backward, on by default): in host memory, or the device's for a model on a GPU.
    turn = min(pool, weights) if keep_for_backward else 0
    if turn and not on_gpu:
        host["weights kept for backward"] = turn
    return host, weights, unmastered, grads, 2 * pool + turn if on_gpu else 0


def _existing(path: str) -> str:
    """``path``, or its nearest existing parent (a swap directory is created at the first run)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


# -- the command ----------------------------------------------------------------------------------------


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """Add the ``plan`` subcommand."""
    p = sub.add_parser(
        "plan", parents=[common], help="before a run: what a model needs and moves, whether it fits here",
        description="Where each kind of training state lives (GPU, host memory, NVMe), host memory and NVMe space "
                    "needed and what dominates, bytes per step, the step's disk-bound time, drive writes per "
                    "day, whether it fits this machine and what to change if not. Nothing is allocated.",
    )
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--hf-config", metavar="PATH", help="a Hugging Face config.json (or its directory)")
    model.add_argument("--params", type=count_arg, metavar="N", help="a parameter count instead, e.g. 7B")
    p.add_argument("--dtype", choices=tuple(_DTYPES), default="bf16", help="parameter dtype (default bf16)")
    add_config_option(p)
    p.add_argument("--path", dest="paths", action="append", default=[], metavar="DIR",
                   help="an nvme_path (repeat for several drives; default: the config's)")
    p.add_argument("--offload-params", action="store_true", help="weights and grads on NVMe too (offload_parameters; "
                   "the default when --config has an offload_param block with device nvme)")
    p.add_argument("--no-keep-for-backward", dest="keep_for_backward", action="store_false",
                   help="offload_parameters(keep_for_backward=False): no weights kept from forward into backward")
    p.add_argument("--gpu", action="store_true", help="the model trains on a GPU (weights and grads in its memory)")
    p.add_argument("--amsgrad", action="store_true", help="AMSGrad (one more moment)")
    p.add_argument("--read-gib-s", type=float, metavar="X", help="drive read bandwidth, GiB/s (all paths together)")
    p.add_argument("--write-gib-s", type=float, metavar="X", help="drive write bandwidth, GiB/s")
    p.add_argument("--sweep", metavar="FILE", help="an `offload-bench sweep --json` result: its best point's "
                   "bandwidths and aio settings (block size, queue depth, threads) are planned with and emitted")
    p.add_argument("--host-memory", type=size_arg, metavar="SIZE", help="host memory to plan for (default: "
                   "what is available now)")
    p.add_argument("--emit-config", metavar="FILE", help="write the configuration planned for as JSON (the "
                   "blocks planned: aio, offload_optimizer and, with weights offloaded, offload_param)")
    p.add_argument("--json", metavar="FILE", help="write the plan as JSON")
    p.set_defaults(run=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    """``offload-bench plan``: exit 0 when the plan fits, 1 when it does not (after saying what to change)."""
    config = args.config
    offload_params = args.offload_params or ("offload_param" in config.given and config.offload_param.device == "nvme")
    paths = args.paths or list(dict.fromkeys(config.offload_optimizer.nvme_paths
                                              + (config.offload_param.nvme_paths if offload_params else ())))
    read, write = args.read_gib_s, args.write_gib_s
    if args.sweep:
        best, aio = _sweep_best(args.sweep)
        read, write = read or float(best["read_gib_s"]), write or float(best["write_gib_s"])
        config = config.replace(aio=aio)
        print(f"aio from {args.sweep} (the sweep's best point): " + ", ".join(f"{k} {v}" for k, v in aio.items()))
    for name, value in (("--read-gib-s", read), ("--write-gib-s", write)):
        if value is not None and not value > 0:
            raise UsageError(f"{name} must be a positive number of GiB/s, got {value}")
    params = model_params(hf_config=args.hf_config, count=args.params, dtype=args.dtype)
    result = plan(params, config, offload_params=offload_params, on_gpu=args.gpu, amsgrad=args.amsgrad,
                  nvme_paths=paths, read_gib_s=read, write_gib_s=write, available_host_bytes=args.host_memory,
                  keep_for_backward=args.keep_for_backward)
    print(render(result))
    print(render_modes(modes(params, config, offload_params=offload_params, on_gpu=args.gpu,
                             amsgrad=args.amsgrad, nvme_paths=paths, read_gib_s=read, write_gib_s=write,
                             available_host_bytes=args.host_memory, keep_for_backward=args.keep_for_backward)))
    if args.json:
        report.write_json(args.json, result.to_dict())
        print(f"wrote {args.json}")
    if args.emit_config:
        blocks = ("aio", "offload_optimizer") + (("offload_param",) if offload_params else ())
        doc = config_to_dict(config, only=blocks)
        for block in blocks[1:]:
            if paths:
                doc[block]["nvme_path"] = paths
        report.write_json(args.emit_config, doc)
        print(f"wrote {args.emit_config}: the configuration planned for ({', '.join(blocks)}"
              + (f"; nvme_path {', '.join(paths)}" if paths else "; no nvme_path: add yours") + ")")
    return EXIT_OK if not result.problems() else EXIT_FAILURE


def _sweep_best(path: str) -> tuple[dict, dict]:
    """An ``offload-bench sweep --json`` result's best point, and the aio settings it measured there."""
    try:
        doc = json.loads(read_config_bytes(path))  # a regular file of a config's size: never a FIFO or /dev/zero
        best = doc["best"]
        aio = {"block_size": int(best["block_size"]), "queue_depth": int(best["queue_depth"]),
               "thread_count": int(best["threads"])}
        backend = (doc.get("config") or {}).get("backend", "auto")
        if backend != "auto":  # the sweep was pinned to a backend: its figures are that backend's
            aio["backend"] = backend
        float(best["read_gib_s"]), float(best["write_gib_s"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UsageError(f"--sweep {path}: not an offload-bench sweep --json result ({err})") from None
    return best, aio


def render(p: Plan) -> str:
    """The plan as text."""
    size = format_size
    lines = [f"model: {p.params / 1e9:.3f}B parameters, {p.dtype}",
             f"optimizer state: {size(p.state_bytes)} in units of {size(p.unit_bytes)}"
             + (f", {size(p.host_cache_bytes)} of it resident in host memory" if p.host_cache_bytes else "")
             + (f"; small parameters' state in memory: {size(p.state_in_memory_bytes)}" if p.state_in_memory_bytes
                else "")]
    where = [("optimizer state", p.optimizer_nvme_bytes), ("weights", p.weights_nvme_bytes),
             ("grads", p.grads_nvme_bytes)]
    lines.append(f"NVMe: {size(p.nvme_bytes)} (" + ", ".join(f"{k} {size(v)}" for k, v in where if v) + ")"
                 + "".join(f"; {path}: {size(free)} free" for path, free in p.free_nvme_bytes.items()))
    host = sorted(p.host_bytes.items(), key=lambda kv: -kv[1])
    lines.append(f"host memory: {size(p.host_total)} of {size(p.available_host_bytes)} available ("
                 + ", ".join(f"{k} {size(v)}" for k, v in host) + ")")
    pools = [f"{name} {n} x {size(each)}" for name, (n, each) in p.pools.items()]
    lines.append(f"pools: {'; '.join(pools) if pools else 'none'} (defaults, at most: optimizer 4 x 64 MiB, less "
                 "for less state; weights 5 x 1e8 elements, each buffer no larger than the largest weight or grad "
                 "on NVMe, none when nothing is)")
    if p.gpu_bytes:
        lines.append(f"GPU memory: about {size(p.gpu_bytes)} for weights and grads, plus activations")
    lines.append(f"per step: {size(p.read_bytes)} read, {size(p.write_bytes)} written")
    if p.step_seconds is not None:
        per_day = p.written_per_day
        lines.append(f"disk-bound step: {p.step_seconds:.2f} s at {p.read_gib_s:.2f} GiB/s read, "
                     f"{p.write_gib_s:.2f} GiB/s write; drive writes: {per_day / 1e12:.1f} TB per day of training")
        if per_day >= p.wear_threshold_bytes:
            lines.append(f"  note: over one drive write per day ({p.wear_threshold_bytes / 1e12:.1f} TB here) uses a "
                         "consumer SSD's endurance rating up within a year or two; a host cache or bf16 state writes "
                         "less")
    else:
        lines.append("disk-bound step: give --read-gib-s/--write-gib-s or --sweep (offload-bench sweep --json)")
    problems = p.problems()
    lines.append("fits: yes" if not problems else "fits: NO (exit code 1)")
    lines.extend(f"  - {problem}" for problem in problems)
    return "\n".join(lines)
