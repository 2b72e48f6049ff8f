"""``offload.initialize``: a whole DeepSpeed config sets up training as ``deepspeed.initialize`` would, with the
weights, grads and Adam state placed by nvme-offload.

What a ds_config.json says, and where it goes:

* ``optimizer`` (Adam/AdamW: ``lr``, ``betas``, ``eps``, ``weight_decay``, ``amsgrad``, ``adam_w_mode``):
  an :class:`~offload.OffloadedAdamW` (or ``OffloadedAdam`` for ``"Adam"`` with ``adam_w_mode: false``, as
  DeepSpeed decides), its state where ``zero_optimization.offload_optimizer`` says (without that block, in
  host memory, ``device: "cpu"``);
* ``scheduler`` (WarmupLR, WarmupDecayLR, WarmupCosineLR): the same schedule as a torch scheduler
  (:mod:`offload.schedulers`), stepped after each optimizer step as DeepSpeed steps it;
* ``gradient_clipping``: the optimizer's ``max_grad_norm`` (torch's clip over all grads, offloaded ones too);
* ``bf16`` / ``fp16``: the model cast (fp32 masters kept by the optimizer); fp16 with DeepSpeed's dynamic loss
  scaling (``initial_scale_power``, ``loss_scale_window``, ``hysteresis``, ``min_loss_scale``), an overflowing
  step skipped without stepping the schedule;
* ``zero_optimization.offload_param`` (device ``nvme``): :func:`~offload.offload_parameters` on the model;
* ``aio``: the engine's settings for both;
* ``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``, ``train_batch_size``: the data loader's
  batch (with ``training_data``), and ``engine.backward``/``engine.step`` accumulating as DeepSpeed's engine does.

Every other key is named in one :class:`~offload.errors.ConfigWarning`; none is dropped without a word.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any, Callable, Optional

import torch
from torch import nn

from .adam import OffloadedAdam, OffloadedAdamW
from .commit import replace_file
from .config import Config
from .config.deepspeed import Training, document, hints_for, read_training, unused_message
from .config.loader import config_from_document
from .errors import ConfigError, ConfigWarning, user_stacklevel
from .params import load_grad, offload_parameters, offloaded, restore_parameters
from .schedulers import WarmupCosineLR, WarmupDecayLR, WarmupLR

__all__ = ["LossScale", "OffloadEngine", "initialize"]

_SCHEDULES = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR}
_LATEST = "latest"  # DeepSpeed's file naming the newest checkpoint tag in a save directory


def initialize(model: Optional[nn.Module] = None, config=None, *, model_parameters=None, optimizer=None,
               lr_scheduler=None, training_data=None, collate_fn: Optional[Callable] = None, nvme_path=None,
               args=None, config_params=None, mpu=None, dist_init_required=None):
    """Set up training from a DeepSpeed config, as ``deepspeed.initialize`` does; returns the same four things.

    Args:
        model: the model (its weights are cast for bf16/fp16 and, with ``offload_param``, moved to NVMe: in place).
        config: a ds_config.json path, a dict, or a :class:`offload.config.Config` (offload blocks only).
            ``config_params`` (DeepSpeed's older name) and ``args.deepspeed_config`` are read the same way.
        model_parameters: the parameters (or groups) to train (default: all of ``model``'s).
        optimizer: instead of the config's ``optimizer`` block: an ``OffloadedAdam``/``OffloadedAdamW``, or a
            callable making one from the parameters.
        lr_scheduler: instead of the config's ``scheduler``: a torch scheduler, or a callable making one from
            the optimizer.
        training_data: a dataset: a ``DataLoader`` of ``train_micro_batch_size_per_gpu`` samples is made, shuffled
            (a ``DistributedSampler`` under ``torch.distributed``), with ``collate_fn``.
        nvme_path: a directory (or list) that replaces both blocks' ``nvme_path`` (DeepSpeed's examples carry
            ``/local_nvme`` as a placeholder).
        args, config_params, mpu, dist_init_required: DeepSpeed's; ``mpu`` (model parallelism) is refused.

    Returns:
        ``(engine, optimizer, training_dataloader, lr_scheduler)``: the engine is an ``nn.Module`` calling
        ``model`` with ``backward(loss)`` and ``step()`` as DeepSpeed's (see :class:`OffloadEngine`); plain
        ``loss.backward(); optimizer.step(); lr_scheduler.step()`` works too (clipping is the optimizer's).
        ``training_dataloader`` and ``lr_scheduler`` are None when not asked for.

    Raises:
        ConfigError: no config, an optimizer or schedule that is not mapped (saying what to do), bad values (all
            named with their JSON paths), or a config optimizer/scheduler given twice.
        TypeError: ``model`` is not a module, or ``optimizer`` is not an OffloadedAdam.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"initialize expects model=, a torch.nn.Module, got {type(model).__name__}")
    if mpu is not None:
        raise ConfigError("mpu= (model parallelism) is not supported: shard with FSDP2 and give OffloadedAdamW the "
                          "sharded parameters")
    source, origin = _config_source(config, config_params, args)
    doc = document(source)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    training, unused = read_training(doc, world_size=world) if doc is not None else (Training(), [])
    cfg = config_from_document(doc, origin) if doc is not None else source
    if nvme_path is not None:
        paths = os.fspath(nvme_path) if isinstance(nvme_path, os.PathLike) else nvme_path
        cfg = cfg.replace(offload_optimizer={"nvme_path": paths}, offload_param={"nvme_path": paths})
    notes = list(training.notes) + _offload_notes(cfg)
    if optimizer is not None and training.optimizer_given:
        raise ConfigError(f"{origin or 'the config'} has an \"optimizer\" block and optimizer= was given too; "
                          "keep one (as deepspeed.initialize asks)")
    if optimizer is None and not training.optimizer_given:
        raise ConfigError(f"no optimizer: {origin or 'the config'} has no \"optimizer\" block and optimizer= was not "
                          'given; add {"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}')
    if lr_scheduler is not None and training.scheduler is not None:
        raise ConfigError(f"{origin or 'the config'} has a \"scheduler\" block and lr_scheduler= was given too; "
                          "keep one")
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    _cast(model, training.precision)
    weights_offloaded = "offload_param" in cfg.given and cfg.offload_param.device == "nvme"
    opt = sched = None
    try:
        if weights_offloaded:
            offload_parameters(model, config=cfg)
        opt = _optimizer(optimizer, training, cfg, model, model_parameters)
        sched = _scheduler(lr_scheduler, training, opt)
        loader = _loader(training_data, training, collate_fn)
        clip = training.gradient_clipping if opt.max_grad_norm is None else 0.0
        scale = LossScale(**training.fp16) if training.precision == "fp16" else None
        if scale is not None and not opt.takes_grad_scale:
            raise ConfigError("fp16 needs the optimizer's fused kernel (fused=None or True) to take the loss scale")
        engine = OffloadEngine(model, opt, sched, accumulation=training.accumulation, clip=clip, loss_scale=scale,
                               weights_offloaded=weights_offloaded)
    except BaseException:
        if opt is not None:
            opt.close()
        if offloaded(model) is not None:
            restore_parameters(model)
        if training.precision is not None and len(dtypes) == 1:
            model.to(dtypes.pop())  # as it came
        raise
    if unused or notes:
        message = unused_message("offload.initialize", origin or "the config given", unused, hints_for("initialize"),
                                 suggest_initialize=False) if unused else ""
        warnings.warn(" ".join(filter(None, [message, *notes])), ConfigWarning, stacklevel=user_stacklevel())
    return engine, opt, loader, sched


def _config_source(config, config_params, args) -> tuple[Any, Optional[str]]:
    """The config given (DeepSpeed takes it three ways) and the file it came from, if any."""
    given = [c for c in (config, config_params, getattr(args, "deepspeed_config", None)) if c is not None]
    if not given:
        raise ConfigError("initialize needs a DeepSpeed config: config=\"ds_config.json\" (or a dict)")
    if len(given) > 1 and any(g is not given[0] for g in given[1:]):
        raise ConfigError("the config is given twice (config=, config_params= or args.deepspeed_config); give one")
    source = given[0]
    if not isinstance(source, (str, os.PathLike, dict, Config)) and not hasattr(source, "keys"):
        raise TypeError(f"config must be a path, a dict or a Config, got {type(source).__name__}")
    return source, os.fspath(source) if isinstance(source, (str, os.PathLike)) else None


def _offload_notes(cfg: Config) -> list[str]:
    """What the offload blocks ask for that is done differently here, in words for the warning."""
    notes = []
    if "offload_param" in cfg.given and cfg.offload_param.device != "nvme":
        notes.append(f'zero_optimization.offload_param.device "{cfg.offload_param.device}": the weights stay where '
                     "the model is (only device \"nvme\" moves them).")
    if "offload_optimizer" not in cfg.given:
        notes.append("No offload_optimizer block: the optimizer state is kept in host memory (device \"cpu\").")
    elif cfg.offload_optimizer.device == "none":
        notes.append('offload_optimizer.device "none": the optimizer state is kept in host memory (device "cpu").')
    return notes


def _cast(model: nn.Module, precision: Optional[str]) -> None:
    """bf16 or fp16 weights (and floating buffers), as DeepSpeed's engine casts the module."""
    if precision is not None:
        model.to(torch.bfloat16 if precision == "bf16" else torch.float16)


def _optimizer(given, training: Training, cfg: Config, model: nn.Module, model_parameters) -> OffloadedAdam:
    params = model_parameters if model_parameters is not None else model.parameters()
    if given is not None:
        opt = given if isinstance(given, torch.optim.Optimizer) else given(params)
        if not isinstance(opt, OffloadedAdam):
            raise TypeError(f"optimizer= must be an OffloadedAdam or OffloadedAdamW (or make one), got "
                            f"{type(opt).__name__}: its state would not be offloaded")
        return opt
    if "offload_optimizer" not in cfg.given or cfg.offload_optimizer.device == "none":
        cfg = cfg.replace(offload_optimizer={"device": "cpu"})
    cls = OffloadedAdamW if training.decoupled else OffloadedAdam
    return cls(params, lr=training.lr, betas=training.betas, eps=training.eps, weight_decay=training.weight_decay,
               amsgrad=training.amsgrad, config=cfg, max_grad_norm=training.gradient_clipping or None)


def _scheduler(given, training: Training, opt: OffloadedAdam):
    if given is not None:
        return given if isinstance(given, torch.optim.lr_scheduler.LRScheduler) else given(opt)
    if training.scheduler is None:
        return None
    try:
        return _SCHEDULES[training.scheduler](opt, **training.scheduler_params)
    except ValueError as err:
        raise ConfigError(f"invalid DeepSpeed configuration: scheduler.params: {err}") from None


def _loader(data, training: Training, collate_fn):
    if data is None:
        return None
    from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

    sampler = DistributedSampler(data) if torch.distributed.is_initialized() else RandomSampler(data)
    return DataLoader(data, batch_size=training.micro_batch or 1, sampler=sampler, collate_fn=collate_fn)


# NOTE: DeepSpeed's DynamicLossScaler (runtime/fp16/loss_scaler.py), the same rules: an overflow lowers the
# scale by 2 (not below min_loss_scale) once hysteresis overflows have been seen, else spends one; every
# loss_scale_window steps since the last overflow the scale doubles (and hysteresis refills). One difference:
# ZeRO-3 updates the scale before it unscales the grads, so on a step where the scale doubles it divides the
# grads by the new scale, not the one they were scaled by; here a step's grads are always unscaled by the scale
# its backward used.
class LossScale:
    """fp16 loss scaling as DeepSpeed configures it: ``loss_scale`` 0 is dynamic from ``2**initial_scale_power``,
    anything else a static scale (overflowing steps skipped either way)."""

    def __init__(self, enabled: bool = True, loss_scale: float = 0, initial_scale_power: float = 16,
                 loss_scale_window: float = 1000, hysteresis: float = 2, consecutive_hysteresis: bool = False,
                 min_loss_scale: float = 1):
        self.dynamic = loss_scale == 0
        self.cur_scale = float(2 ** initial_scale_power) if self.dynamic else float(loss_scale)
        self.scale_factor = 2.0
        self.scale_window = int(loss_scale_window)
        self.min_scale = float(min_loss_scale)
        self.delayed_shift = int(hysteresis)
        self.cur_hysteresis = int(hysteresis)
        self.consecutive_hysteresis = consecutive_hysteresis
        self.cur_iter = 0
        self.last_overflow_iter = -1

    def update(self, overflow: bool) -> None:
        """After a step (``overflow``: it was skipped)."""
        if not self.dynamic:
            return
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale:
                    raise FloatingPointError(
                        f"fp16 gradients overflow at the smallest loss scale ({self.min_scale:g}, fp16.min_loss_scale):"
                        " training diverged, or the model needs bf16")
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    def state_dict(self) -> dict:
        """The loss scale's counters, for a checkpoint."""
        return dict(self.__dict__)

    def load_state_dict(self, state: dict) -> None:
        """Take back the counters of :meth:`state_dict`."""
        self.__dict__.update(state)


class OffloadEngine(nn.Module):
    """What :func:`initialize` returns first: the model, called as it is, with DeepSpeed's engine methods.

    ``engine(batch)`` runs the model; ``engine.backward(loss)`` scales the loss for gradient accumulation
    (``loss / gradient_accumulation_steps``, in fp32 as DeepSpeed does) and for fp16's loss scale, then runs
    backward; ``engine.step()`` steps the optimizer and the schedule and zeroes the grads at each accumulation
    boundary (an fp16 step whose grads overflow is skipped, schedule included), and counts micro-steps otherwise.
    ``save_checkpoint`` / ``load_checkpoint`` keep DeepSpeed's tags and ``latest`` file, with the model, the
    optimizer's state, the schedule and ``client_state`` in one checkpoint. ``close()`` frees the swap files.

    Attributes:
        module, optimizer, lr_scheduler: what it drives.
        global_steps, micro_steps, skipped_steps: DeepSpeed's counters.
    """

    def __init__(self, module: nn.Module, optimizer: OffloadedAdam, lr_scheduler=None, *, accumulation: int = 1,
                 clip: float = 0.0, loss_scale: Optional[LossScale] = None, weights_offloaded: bool = False):
        super().__init__()
        self.module = module
        self.optimizer, self.lr_scheduler, self.loss_scale = optimizer, lr_scheduler, loss_scale
        self.gradient_accumulation_steps = accumulation
        self._clip = clip  # a given optimizer without max_grad_norm: the engine clips
        self._weights_offloaded = weights_offloaded
        self.global_steps = self.micro_steps = self.skipped_steps = 0

    def forward(self, *args, **kwargs):
        """The model's forward."""
        return self.module(*args, **kwargs)

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next ``step()`` steps the optimizer (the last micro-batch of an accumulation)."""
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> torch.Tensor:
        """Backward of ``loss`` divided by the accumulation steps (and times fp16's loss scale); returns ``loss``."""
        scaled = loss
        if self.gradient_accumulation_steps > 1:
            scaled = loss.float() / self.gradient_accumulation_steps
        if self.loss_scale is not None:
            scaled = scaled.float() * self.loss_scale.cur_scale
        # Micro-batches before the boundary only accumulate: an update inside backward waits for the last one.
        with self.optimizer.no_step() if not self.is_gradient_accumulation_boundary() else contextlib.nullcontext():
            scaled.backward(retain_graph=retain_graph)
        return loss

    def step(self) -> None:
        """At an accumulation boundary: the optimizer's step (skipped on an fp16 overflow), the schedule's, and
        the grads zeroed; else only the count of micro-steps."""
        if self.is_gradient_accumulation_boundary():
            overflow = self.loss_scale is not None and self._overflow()
            if overflow:
                self.skipped_steps += 1
            else:
                self._optimizer_step()
                if self.lr_scheduler is not None:
                    self.lr_scheduler.step()
            if self.loss_scale is not None:
                self.loss_scale.update(overflow)
            self.optimizer.zero_grad()
            self.global_steps += 1
        self.micro_steps += 1

    def _optimizer_step(self) -> None:
        if self._clip:
            from .params import clip_grad_norm_

            clip_grad_norm_([p for g in self.optimizer.param_groups for p in g["params"]], self._clip)
        if self.loss_scale is None:
            self.optimizer.step()
            return
        # The GradScaler protocol: the optimizer unscales the grads by grad_scale as it reads them (before its
        # clipping), nothing having overflowed.
        device = self.optimizer.param_groups[0]["params"][0].device
        self.optimizer.grad_scale = torch.tensor(self.loss_scale.cur_scale, dtype=torch.float32, device=device)
        self.optimizer.found_inf = torch.zeros((), dtype=torch.float32, device=device)
        try:
            self.optimizer.step()
        finally:
            del self.optimizer.grad_scale, self.optimizer.found_inf

    def _overflow(self) -> bool:
        """Whether a grad holds an inf or a nan (read one at a time, offloaded ones too)."""
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                grad = load_grad(p) if p.grad is not None else None
                if grad is not None and not bool(torch.isfinite(grad).all()):
                    return True
        return False

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the optimizer's grads (as torch's ``zero_grad``)."""
        self.optimizer.zero_grad(set_to_none)

    def get_lr(self) -> list[float]:
        """Each parameter group's learning rate now."""
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> Optional[float]:
        """The total grad norm of the last clipped step (None without clipping)."""
        norm = self.optimizer.last_grad_norm
        return float(norm) if norm is not None else None

    # -- checkpoints ---------------------------------------------------------------------------------------

    def save_checkpoint(self, save_dir, tag: Optional[str] = None, client_state: Optional[dict] = None,
                        save_latest: bool = True) -> str:
        """Save model, optimizer state, schedule, counters and ``client_state`` to ``save_dir/tag`` (default tag
        ``global_step<N>``), then name it in ``save_dir/latest``; returns the checkpoint's directory."""
        tag = tag if tag is not None else f"global_step{self.global_steps}"
        path = os.path.join(os.fspath(save_dir), str(tag))
        extra = {"engine": {"global_steps": self.global_steps, "micro_steps": self.micro_steps,
                            "skipped_steps": self.skipped_steps},
                 "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
                 "loss_scale": self.loss_scale.state_dict() if self.loss_scale is not None else None,
                 "client_state": client_state or {}}
        self.optimizer.save_checkpoint(path, model=self.module, extra=extra)
        if save_latest:
            # As DeepSpeed's: a file naming the tag, replaced whole (a link planted there is refused, not followed).
            replace_file(os.path.join(os.fspath(save_dir), _LATEST), lambda f: f.write(str(tag).encode()),
                         private=False)
        return path

    def load_checkpoint(self, load_dir, tag: Optional[str] = None) -> tuple[Optional[str], dict]:
        """Load what :meth:`save_checkpoint` saved (``tag``, else the one ``load_dir/latest`` names); returns
        ``(its directory, client_state)``, or ``(None, {})`` where there is nothing to load, as DeepSpeed does."""
        if tag is None:
            latest = os.path.join(os.fspath(load_dir), _LATEST)
            if not os.path.isfile(latest):
                return None, {}
            with open(latest, encoding="utf-8") as f:
                tag = f.read().strip()
        path = os.path.join(os.fspath(load_dir), str(tag))
        extra = self.optimizer.load_checkpoint(path, model=self.module) or {}
        counters = extra.get("engine", {})
        self.global_steps = counters.get("global_steps", 0)
        self.micro_steps = counters.get("micro_steps", 0)
        self.skipped_steps = counters.get("skipped_steps", 0)
        if self.lr_scheduler is not None and extra.get("lr_scheduler") is not None:
            self.lr_scheduler.load_state_dict(extra["lr_scheduler"])
        if self.loss_scale is not None and extra.get("loss_scale") is not None:
            self.loss_scale.load_state_dict(extra["loss_scale"])
        return path, extra.get("client_state", {})

    def close(self) -> None:
        """Free the optimizer's swap files and pools, and bring offloaded weights back into memory."""
        self.optimizer.close()
        if self._weights_offloaded and offloaded(self.module) is not None:
            restore_parameters(self.module)

    def __repr__(self) -> str:
        return f"OffloadEngine({self.module!r})"

