"""The rest of a DeepSpeed ``ds_config.json``: what ``offload.initialize`` honours (optimizer, scheduler, gradient
clipping, bf16/fp16, batch sizes) read and checked here, and, for each component, the keys it does not use.

The offload blocks (``aio``, ``offload_optimizer``, ``offload_param``) are :mod:`offload.config.loader`'s; this
module never reads them. Every other key of a document is either honoured by :func:`read_training` or named by
:func:`unused_keys`, so that nothing in a user's file is dropped without a word.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from collections.abc import Mapping
from typing import Any, Optional

from .files import read_document
from .rules import BLOCKS, did_you_mean, raise_if, show

__all__ = ["Training", "document", "read_training", "unused_keys", "unused_message"]

OPTIMIZERS = ("adam", "adamw")
SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
# Each schedule's parameters (DeepSpeed's names and defaults); last_batch_iteration: -1 only (a resume restores
# the schedule from a checkpoint instead).
SCHEDULE_PARAMS: dict[str, dict[str, Any]] = {
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000, "warmup_type": "log"},
    "WarmupDecayLR": {"total_num_steps": None, "warmup_min_lr": 0.0, "warmup_max_lr": 0.001,
                      "warmup_num_steps": 1000, "warmup_type": "log"},
    "WarmupCosineLR": {"total_num_steps": None, "warmup_min_ratio": 0.0, "warmup_num_steps": 1000,
                       "cos_min_ratio": 0.0001, "warmup_type": "log"},
}
# DeepSpeed's optimizer defaults (DeepSpeedCPUAdam, FusedAdam): what a missing key means.
OPTIMIZER_DEFAULTS: dict[str, Any] = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
# fp16 block: DeepSpeed's keys and defaults (runtime/constants.py).
FP16_DEFAULTS = {"enabled": False, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                 "hysteresis": 2, "consecutive_hysteresis": False, "min_loss_scale": 1}
# Top-level keys initialize reads (besides the offload blocks and zero_optimization).
TRAINING_KEYS = ("optimizer", "scheduler", "gradient_clipping", "bf16", "bfloat16", "fp16",
                 "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")

# What to do instead, for keys a component does not read (by the component using the document).
_HINTS_OPTIMIZER = {
    "optimizer": "pass lr=, betas=, eps=, weight_decay= to the optimizer",
    "scheduler": "build a scheduler over the optimizer (offload.schedulers has DeepSpeed's)",
    "gradient_clipping": "pass max_grad_norm=",
    "bf16": "cast the model: model.to(torch.bfloat16)",
    "fp16": "cast the model and scale the loss",
    "offload_param": "offload_parameters(model, config=...) reads it",
    "zero_optimization.offload_param": "offload_parameters(model, config=...) reads it",
}
_HINTS_PARAMS = {
    "offload_optimizer": "OffloadedAdamW(params, config=...) reads it",
    "zero_optimization.offload_optimizer": "OffloadedAdamW(params, config=...) reads it",
    "optimizer": "the optimizer's: OffloadedAdamW(params, lr=..., config=...)",
}
_HINTS_INITIALIZE = {
    "zero_optimization.stage": "there is no data-parallel partitioning here: each block of offload settings says "
                               "what lives on NVMe; FSDP2 shards across GPUs",
    "activation_checkpointing": "use torch.utils.checkpoint in the model",
    "steps_per_print": "log from the training loop",
    "wall_clock_breakdown": "time the loop yourself (offload-bench compare splits an iteration)",
}


@dataclasses.dataclass(frozen=True)
class Training:
    """What a DeepSpeed config sets up for training, besides where state lives.

    Attributes:
        decoupled: AdamW (decoupled weight decay; DeepSpeed's "Adam" too, unless ``adam_w_mode`` is false).
        lr, betas, eps, weight_decay, amsgrad: the optimizer's hyperparameters.
        scheduler: the schedule's name (one of :data:`SCHEDULERS`) or None.
        scheduler_params: its parameters, DeepSpeed's defaults filled in.
        gradient_clipping: the largest total grad norm (0: none).
        precision: "bf16", "fp16" or None (the model's own dtype).
        fp16: the fp16 block, DeepSpeed's defaults filled in.
        micro_batch, accumulation, train_batch_size: DeepSpeed's three batch sizes, resolved as it resolves
            them (per process; any missing one derived from the others).
        optimizer_given: whether the document has an ``optimizer`` block.
        notes: what is read differently from how it is written, in words (for the warning).
    """

    decoupled: bool = True
    lr: float = OPTIMIZER_DEFAULTS["lr"]
    betas: tuple = OPTIMIZER_DEFAULTS["betas"]
    eps: float = OPTIMIZER_DEFAULTS["eps"]
    weight_decay: float = OPTIMIZER_DEFAULTS["weight_decay"]
    amsgrad: bool = False
    scheduler: Optional[str] = None
    scheduler_params: dict = dataclasses.field(default_factory=dict)
    gradient_clipping: float = 0.0
    precision: Optional[str] = None
    fp16: dict = dataclasses.field(default_factory=lambda: dict(FP16_DEFAULTS))
    micro_batch: Optional[int] = None
    accumulation: int = 1
    train_batch_size: Optional[int] = None
    optimizer_given: bool = False
    notes: tuple = ()


def document(source) -> Optional[Mapping]:
    """The raw document of a config ``source`` (a path or a mapping), or None for anything else (a Config)."""
    if isinstance(source, (str, os.PathLike)):
        return read_document(os.fspath(source))
    if isinstance(source, Mapping):
        return source
    return None


def unused_keys(doc: Mapping, used: tuple[str, ...]) -> list[str]:
    """The JSON paths of ``doc``'s keys a component reading only the blocks ``used`` (of ``aio``,
    ``offload_optimizer``, ``offload_param``) does not use: top-level keys, and ``zero_optimization``'s."""
    if not any(k in doc for k in (*BLOCKS, "zero_optimization")):
        return []  # a bare aio block (every key checked as aio's), or a mapping of one block's keys
    out = []
    for key, value in doc.items():
        if key == "zero_optimization" and isinstance(value, Mapping):
            out += [f"zero_optimization.{k}" for k in value if k not in used]
        elif key not in used and key != "zero_optimization":
            out.append(key)
    return out


def unused_message(who: str, origin: str, unused: list[str], hints: Mapping[str, str], *,
                   suggest_initialize: bool = True) -> str:
    """One warning naming every key ``who`` does not use, each with what to do where there is something."""
    named = [f"{k} ({hints[k]})" if k in hints else k for k in unused]
    message = f"{who} does not use these keys of {origin}: {'; '.join(named)}. They are ignored here"
    if suggest_initialize:
        message += ("; offload.initialize(model, config=...) sets up training from the whole file, as "
                    "deepspeed.initialize does")
    return message + "."


def hints_for(component: str) -> Mapping[str, str]:
    """What to do instead, by key, for ``component`` ("optimizer", "params" or "initialize")."""
    return {"optimizer": _HINTS_OPTIMIZER, "params": _HINTS_PARAMS, "initialize": _HINTS_INITIALIZE}[component]


def read_training(doc: Mapping, *, world_size: int = 1) -> tuple[Training, list[str]]:
    """What ``doc`` (a whole DeepSpeed config) sets up for training, and the keys initialize does not honour.

    Raises:
        ConfigError: every problem at once, each with its JSON path: an optimizer or schedule that is not
            DeepSpeed's Adam/AdamW or one of :data:`SCHEDULERS` (with what to do instead), an unknown key in
            their params, a wrong type, both bf16 and fp16 enabled, batch sizes that do not agree.
    """
    problems: list[tuple[str, str]] = []
    values: dict[str, Any] = {}
    _optimizer(doc.get("optimizer"), values, problems)
    _scheduler(doc.get("scheduler"), values, problems)
    clip = doc.get("gradient_clipping", 0.0)
    if not _number(clip) or clip < 0:
        problems.append(("gradient_clipping", f"must be a number, at least 0 (0: no clipping), got {show(clip)}"))
    else:
        values["gradient_clipping"] = float(clip)
    _precision(doc, values, problems)
    _batches(doc, values, problems, world_size)
    raise_if(problems, "invalid DeepSpeed configuration")
    honoured = {*BLOCKS, *TRAINING_KEYS}
    unused = [k for k in doc if k not in honoured and k != "zero_optimization"]
    zero = doc.get("zero_optimization")
    if isinstance(zero, Mapping):
        unused += [f"zero_optimization.{k}" for k in zero if k not in BLOCKS]
    return Training(**values), unused


def _optimizer(block, values: dict, problems: list) -> None:
    if block is None:
        return
    if not isinstance(block, Mapping):
        problems.append(("optimizer", f'must be an object {{"type": "AdamW", "params": {{...}}}}, got {show(block)}'))
        return
    values["optimizer_given"] = True
    kind = block.get("type")
    if not isinstance(kind, str) or kind.lower() not in OPTIMIZERS:
        problems.append(("optimizer.type", f'must be "Adam" or "AdamW" (state offloaded by OffloadedAdam/AdamW), got '
                         f"{show(kind)}; for another optimizer, build it yourself and pass optimizer= (its state "
                         "then stays in memory unless it is an OffloadedAdam)"))
        return
    params = block.get("params", {})
    if not isinstance(params, Mapping):
        problems.append(("optimizer.params", f"must be an object, got {show(params)}"))
        return
    for key, value in params.items():
        _adam_param(key, value, values, problems)
    # DeepSpeed: "AdamW" is always decoupled; "Adam" too unless adam_w_mode is false (ADAM_W_MODE_DEFAULT True).
    if kind.lower() == "adamw":
        values["decoupled"] = True


_ADAM_PARAMS = frozenset({"lr", "betas", "eps", "weight_decay", "amsgrad", "bias_correction", "adam_w_mode",
                          "torch_adam", "fused"})


def _adam_param(key: str, value, values: dict, problems: list) -> None:
    """Check ``optimizer.params.<key>``; a value the optimizer takes goes to ``values`` (``torch_adam`` and
    ``fused``, DeepSpeed's choices of kernel, are checked and otherwise ignored)."""
    path = f"optimizer.params.{key}"
    if key == "max_grad_norm":
        problems.append((path, "is not an optimizer parameter (as in DeepSpeed): use the top-level "
                               "\"gradient_clipping\""))
    elif key not in _ADAM_PARAMS:
        problems.append((path, f"unknown parameter of Adam{did_you_mean(key, _ADAM_PARAMS)}"))
    elif isinstance(value, str) and value.strip().lower() == "auto":
        problems.append((path, '"auto" is filled in by the Hugging Face Trainer\'s DeepSpeed integration; '
                               "write the value"))
    elif key in ("lr", "eps", "weight_decay"):
        if not _number(value) or value < 0:
            problems.append((path, f"must be a number, at least 0, got {show(value)}"))
        else:
            values[key] = float(value)
    elif key == "betas":
        if not (isinstance(value, (list, tuple)) and len(value) == 2 and all(_number(b) and 0 <= b < 1
                                                                         for b in value)):
            problems.append((path, f"must be a list of two numbers in [0, 1), got {show(value)}"))
        else:
            values["betas"] = (float(value[0]), float(value[1]))
    else:
        _adam_switch(key, value, path, values, problems)


def _adam_switch(key: str, value, path: str, values: dict, problems: list) -> None:
    """Check one of ``optimizer.params``' true-or-false keys."""
    if not isinstance(value, bool):
        problems.append((path, f"must be true or false, got {show(value)}"))
    elif key == "bias_correction" and not value:
        problems.append((path, "false is not supported: Adam's update here is torch's, which always corrects "
                               "its moments' bias"))
    elif key == "amsgrad":
        values["amsgrad"] = value
    elif key == "adam_w_mode":
        values["decoupled"] = value


def _scheduler(block, values: dict, problems: list) -> None:
    if block is None:
        return
    if not isinstance(block, Mapping) or not isinstance(block.get("type"), str):
        problems.append(("scheduler", f'must be an object {{"type": "WarmupLR", "params": {{...}}}}, got '
                         f"{show(block)}"))
        return
    kind = block["type"]
    if kind not in SCHEDULERS:
        problems.append(("scheduler.type", f"{kind!r} is not mapped to a torch scheduler here; supported: "
                         f"{', '.join(SCHEDULERS)}{did_you_mean(kind, SCHEDULERS)}. For another schedule build a "
                         "torch scheduler and pass lr_scheduler= (a callable taking the optimizer)"))
        return
    params = block.get("params", {})
    if not isinstance(params, Mapping):
        problems.append(("scheduler.params", f"must be an object, got {show(params)}"))
        return
    allowed = SCHEDULE_PARAMS[kind]
    out = {k: v for k, v in allowed.items() if v is not None}
    for key, value in params.items():
        path = f"scheduler.params.{key}"
        if key == "last_batch_iteration":
            if value != -1:
                problems.append((path, "only -1 (a new run): a resumed run restores its schedule from the "
                                       "engine's checkpoint (engine.load_checkpoint)"))
        elif key not in allowed:
            problems.append((path, f"unknown parameter of {kind}{did_you_mean(key, allowed)}"))
        else:
            _schedule_param(key, value, path, out, problems)
    for key, default in allowed.items():
        if default is None and key not in out:
            problems.append((f"scheduler.params.{key}", f"is required by {kind}"))
    values["scheduler"], values["scheduler_params"] = kind, out


def _schedule_param(key: str, value, path: str, out: dict, problems: list) -> None:
    """Check ``scheduler.params.<key>``, one the schedule takes; a valid value goes to ``out``."""
    if key == "warmup_type":
        if value not in ("log", "linear"):
            problems.append((path, f'must be "log" or "linear", got {show(value)}'))
        else:
            out[key] = value
    elif key in ("warmup_num_steps", "total_num_steps"):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            problems.append((path, f"must be a whole number of steps, got {show(value)}"))
        else:
            out[key] = value
    elif key in ("warmup_min_lr", "warmup_max_lr") and isinstance(value, (list, tuple)):
        if not all(_number(v) and v >= 0 for v in value):
            problems.append((path, f"must be a number (or one per parameter group), got {show(value)}"))
        else:
            out[key] = [float(v) for v in value]
    elif not _number(value) or value < 0:
        problems.append((path, f"must be a number, at least 0, got {show(value)}"))
    else:
        out[key] = float(value)


def _precision(doc: Mapping, values: dict, problems: list) -> None:
    bf16 = doc.get("bf16", doc.get("bfloat16"))
    enabled = {}
    for name, block in (("bf16" if "bf16" in doc else "bfloat16", bf16), ("fp16", doc.get("fp16"))):
        if block is None:
            continue
        if not isinstance(block, Mapping):
            problems.append((name, f'must be an object {{"enabled": true}}, got {show(block)}'))
            continue
        on = block.get("enabled", False)
        if not isinstance(on, bool):
            problems.append((f"{name}.enabled", f"must be true or false, got {show(on)}"))
            continue
        enabled[name] = on
        if name == "fp16":
            fp16 = dict(FP16_DEFAULTS)
            for key, value in block.items():
                path = f"fp16.{key}"
                if key not in FP16_DEFAULTS:
                    problems.append((path, f"not supported here{did_you_mean(key, FP16_DEFAULTS)}: the loss "
                                           f"scaling keys are {', '.join(k for k in FP16_DEFAULTS if k != 'enabled')}"))
                elif isinstance(FP16_DEFAULTS[key], bool):
                    if not isinstance(value, bool):
                        problems.append((path, f"must be true or false, got {show(value)}"))
                    else:
                        fp16[key] = value
                elif not _number(value) or value < 0:
                    problems.append((path, f"must be a number, at least 0, got {show(value)}"))
                else:
                    fp16[key] = value
            values["fp16"] = fp16
    if sum(enabled.values()) > 1:
        problems.append(("fp16.enabled", "bf16 and fp16 are both enabled; enable one"))
    elif enabled.get("fp16"):
        values["precision"] = "fp16"
    elif enabled.get("bf16") or enabled.get("bfloat16"):
        values["precision"] = "bf16"


def _batches(doc: Mapping, values: dict, problems: list, world: int) -> None:
    """DeepSpeed's three batch sizes: train_batch_size = micro batch x accumulation x world size; a missing one
    derived from the others (as runtime/config.py's _configure_train_batch_size)."""
    got = {}
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        value = doc.get(key)
        if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
            continue
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.append((key, f"must be a whole number, at least 1, got {show(value)}"))
        else:
            got[key] = value
    tbs, micro, gas = (got.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                            "gradient_accumulation_steps"))
    if tbs is not None and micro is not None and gas is not None:
        if tbs != micro * gas * world:
            # Written for another number of processes (the seed's 70B config is for 8 GPUs): each process runs
            # the micro batch and accumulation as written; DeepSpeed would stop here.
            values["notes"] = (f"train_batch_size {tbs} is not train_micro_batch_size_per_gpu x "
                               f"gradient_accumulation_steps x processes = {micro} x {gas} x {world} here (written "
                               f"for {tbs / (micro * gas):g} processes?): each process runs {micro} x {gas} as "
                               "written.",)
    elif tbs is not None and micro is not None:
        gas = tbs // (micro * world)
        if gas < 1 or tbs % (micro * world):
            problems.append(("train_batch_size", f"{tbs} is not a multiple of train_micro_batch_size_per_gpu x "
                             f"world size = {micro} x {world}"))
    elif tbs is not None and gas is not None:
        micro = tbs // (gas * world)
        if micro < 1 or tbs % (gas * world):
            problems.append(("train_batch_size", f"{tbs} is not a multiple of gradient_accumulation_steps x "
                             f"world size = {gas} x {world}"))
    elif tbs is not None:
        gas, micro = 1, tbs // world
    elif micro is not None:
        gas = gas or 1
        tbs = micro * gas * world
    values.update(micro_batch=micro, accumulation=gas or 1, train_batch_size=tbs)


def _number(value) -> bool:
    """A finite real number that is not a boolean."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)

