"""Hugging Face ``Trainer`` with nvme-offload: checkpoints that stream, and the grad norm of offloaded grads.

``OffloadTrainer`` is ``transformers.Trainer`` with the overrides of :class:`OffloadTrainerMixin`;
the mixin goes in front of any other ``Trainer`` subclass (``class MyTrainer(OffloadTrainerMixin,
SFTTrainer)``). ``transformers`` is imported only when ``OffloadTrainer`` is first used.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch

from ..config.files import read_config_bytes
from ..errors import CheckpointError, ConfigError
from ..params import clip_grad_norm_
from ..pretrained import model_directory, offload_pretrained, save_pretrained
from ..pretrained.save import save_into
from . import OFFLOAD_DIR
from ._common import has_offloaded_grads, has_offloaded_weights, offloaded_optimizer, unwrap_model

__all__ = ["OFFLOAD_DIR", "OffloadTrainer", "OffloadTrainerMixin",  # noqa: F822 (built by __getattr__)
           "from_pretrained", "save_pretrained"]

_SCHEDULER = "scheduler.pt"  # transformers.trainer.SCHEDULER_NAME
_TRAINING_ARGS = "training_args.bin"  # transformers.trainer.TRAINING_ARGS_NAME


# NOTE: Trainer saves a checkpoint with torch.save(optimizer.state_dict()) and the model's weights
# with model.state_dict(); both hold everything in memory at once, and no TrainerCallback runs
# before them. These overrides of Trainer's own save and load steps send what lives on NVMe (an
# OffloadedAdam's state; weights offloaded with offload_parameters) through save_checkpoint /
# load_checkpoint into ``checkpoint-N/offload`` instead, and leave everything else to Trainer:
# scheduler, RNG and trainer state, and the weights of a model that is not offloaded (saving those
# copies nothing). A checkpoint without that directory (written by a plain Trainer) resumes the
# ordinary way. Trainer also reads every gradient for the norm it logs, with torch's functions,
# which cannot read offloaded gradients: the norm (and the clipping) is ours for those.
class OffloadTrainerMixin:
    """Overrides of ``transformers.Trainer`` for an ``OffloadedAdam`` and models offloaded with
    ``offload_parameters``; put it before ``Trainer`` (or a subclass of it) in the bases.

    - Checkpoints (``save_steps``, ``resume_from_checkpoint``): the optimizer's state, and offloaded
      weights, stream to and from ``checkpoint-N/offload`` (``opt.save_checkpoint``); host memory
      stays the pools whatever the model size. A model that is not offloaded is saved by Trainer as
      usual (``model.safetensors``).
    - ``trainer.save_model(dir)`` of offloaded weights writes a Hugging Face checkpoint (config.json,
      sharded safetensors) one weight at a time, then the tokenizer and training arguments, as Trainer does.
    - Gradient norm and clipping (``max_grad_norm``, the logged ``grad_norm``) with offloaded
      gradients use :func:`offload.params.clip_grad_norm_`: torch's numbers, bit for bit.

    With neither an ``OffloadedAdam`` nor offloaded weights, Trainer's own code runs unchanged.
    """

    def train(self, *args, **kwargs):
        """Trainer's ``train``, after refusing what an optimizer with ``overlap_backward`` cannot honour."""
        _refuse_overlap(self.optimizer, self.args)
        return super().train(*args, **kwargs)

    def create_optimizer(self, *args, **kwargs):
        """Trainer's optimizer, refused where it has ``overlap_backward`` and the arguments ask what it cannot
        honour."""
        opt = super().create_optimizer(*args, **kwargs)
        _refuse_overlap(opt, self.args)
        return opt

    # -- saving ---------------------------------------------------------------------------------

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """A checkpoint's save of offloaded weights streams them to ``OFFLOAD_DIR`` (with the optimizer's state,
        or alone with ``save_only_model``); any other save is Trainer's."""
        if not (_internal_call and has_offloaded_weights(self.model)):
            return super().save_model(output_dir, _internal_call)
        # A checkpoint's weights go with the optimizer's state (below), or alone with save_only_model.
        if self.args.save_only_model and self.args.should_save:
            from ..checkpoint import save_parameters

            save_parameters(unwrap_model(self.model), os.path.join(output_dir, OFFLOAD_DIR))

    def _save(self, output_dir: Optional[str] = None, state_dict=None) -> None:
        # Reached from a user's save_model() (a checkpoint's save_model is handled above).
        if state_dict is not None or not has_offloaded_weights(self.model):
            return super()._save(output_dir, state_dict)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return None
        save_into(unwrap_model(self.model), output_dir)
        tokenizer = self.processing_class if self.processing_class is not None else \
            getattr(self.data_collator, "tokenizer", None)
        if tokenizer is not None:
            tokenizer.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, _TRAINING_ARGS))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        opt = offloaded_optimizer(self.optimizer)
        if opt is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        if self.args.should_save:
            model = unwrap_model(self.model)
            opt.save_checkpoint(os.path.join(output_dir, OFFLOAD_DIR),
                                model=model if has_offloaded_weights(model) else None, alone=True)
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER))

    # -- resuming -------------------------------------------------------------------------------

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        model = unwrap_model(model if model is not None else self.model)
        ours = os.path.join(resume_from_checkpoint, OFFLOAD_DIR)
        if not (has_offloaded_weights(model) and os.path.isdir(ours)):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        from ..checkpoint import load_parameters

        load_parameters(model, ours)

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        opt = offloaded_optimizer(self.optimizer)
        ours = os.path.join(checkpoint, OFFLOAD_DIR) if checkpoint is not None else None
        if opt is None or ours is None or not os.path.isdir(ours):
            return super()._load_optimizer_and_scheduler(checkpoint)
        from ..checkpoint import read_manifest

        if read_manifest(ours).get("optimizer") is None:
            return None  # weights alone (save_only_model): nothing to resume the optimizer from, as in Trainer
        opt.load_checkpoint(ours, alone=True)  # the weights came in _load_from_checkpoint, from the same directory
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, _SCHEDULER), weights_only=True))

    # -- gradient norm --------------------------------------------------------------------------

    def _clip_grad_norm(self, model) -> Any:
        if not has_offloaded_grads(self.model):
            return super()._clip_grad_norm(model)
        return clip_grad_norm_(unwrap_model(self.model), self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None) -> Any:
        opt = offloaded_optimizer(self.optimizer)
        if grad_norm is None and has_offloaded_grads(self.model) and opt is not None and \
                opt.config.offload_optimizer.overlap_backward is True:
            return None  # updated during backward, the gradients are gone: nothing to log
        if grad_norm is None and has_offloaded_grads(self.model):
            grad_norm = clip_grad_norm_(unwrap_model(self.model), float("inf"))  # the norm alone
        return super()._get_grad_norm(model, grad_norm)


def _refuse_overlap(optimizer, args) -> None:
    """What Trainer does between backward and step() that an optimizer with ``overlap_backward`` cannot
    honour (its update runs during backward), refused before training starts."""
    opt = offloaded_optimizer(optimizer) if optimizer is not None else None
    if opt is None or opt.config.offload_optimizer.overlap_backward is not True:
        return
    if args.max_grad_norm and args.max_grad_norm > 0:
        raise ValueError(
            f"TrainingArguments(max_grad_norm={args.max_grad_norm}) clips after backward, but this optimizer has "
            "overlap_backward=True and updates during backward: pass max_grad_norm=0 to TrainingArguments and "
            f"give the optimizer max_grad_norm={args.max_grad_norm} instead.")
    if args.gradient_accumulation_steps > 1:
        raise ValueError(
            f"TrainingArguments(gradient_accumulation_steps={args.gradient_accumulation_steps}) runs several "
            "backward passes per step, which an optimizer with overlap_backward=True can do only inside its "
            "no_step() block, and Trainer does not call it. Use gradient_accumulation_steps=1 (a larger "
            "per-device batch), or build the optimizer without overlap_backward.")


# What transformers' from_pretrained takes that has no meaning here, each with what to do instead.
_REFUSED = {
    "device_map": "weights live on NVMe and each module's are fetched to the model's one device for its forward; "
                  "pass device=\"cuda:0\" (or leave it for the CPU). Across GPUs, shard with FSDP2 and offload the "
                  "optimizer state (OffloadedAdamW), or one process per GPU with DDP",
    "max_memory": "host memory for weights is the parameter pool and max_in_cpu (elements kept in host memory): set "
                  "max_in_cpu= and max_grad_in_cpu= instead (0: everything on NVMe)",
    "offload_folder": "weights are offloaded to nvme_path: pass nvme_path= instead",
    "offload_state_dict": "weights always stream from the checkpoint one tensor at a time",
    "offload_buffers": "buffers stay in memory (they are small); weights go to nvme_path",
    "load_in_8bit": "quantized weights are not supported: pass dtype=torch.bfloat16 for half the bytes of fp32",
    "load_in_4bit": "quantized weights are not supported: pass dtype=torch.bfloat16 for half the bytes of fp32",
    "quantization_config": "quantized weights are not supported: pass dtype=torch.bfloat16 for half the bytes of fp32",
    "tp_plan": "tensor parallelism is not supported with weights on NVMe: shard with FSDP2 and offload the optimizer "
               "state (OffloadedAdamW)",
    "tp_size": "tensor parallelism is not supported with weights on NVMe: shard with FSDP2 and offload the optimizer "
               "state (OffloadedAdamW)",
    "device_mesh": "tensor parallelism is not supported with weights on NVMe: shard with FSDP2 and offload the "
                   "optimizer state (OffloadedAdamW)",
    "gguf_file": "only safetensors checkpoints are read: convert the GGUF file with transformers first",
    "from_tf": "only safetensors checkpoints are read: save the model with transformers' save_pretrained first",
    "from_flax": "only safetensors checkpoints are read: save the model with transformers' save_pretrained first",
    "variant": "only the default weight files are read: save the variant without it, or give its directory",
    "output_loading_info": "what was loaded, missing or unexpected is checked strictly (strict=False loads what "
                           "matches); there is no separate report",
}
# Accepted for compatibility, when they ask for what is done anyway.
_SAME_AS_OURS = {"low_cpu_mem_usage": (True, "weights are always loaded one tensor at a time: low_cpu_mem_usage "
                                             "cannot be False"),
                 "use_safetensors": (True, "only safetensors checkpoints are read: use_safetensors cannot be False")}
_OFFLOAD_KEYWORDS = ("max_in_cpu", "max_grad_in_cpu", "prefetch", "buffer_count", "buffer_size", "pin_memory",
                     "offload_grads", "device", "drop_behind")


def from_pretrained(path: str | os.PathLike, nvme_path=None, config=None, *, model_class=None, dtype=None,
                    torch_dtype=None, strict: bool = True, revision: Optional[str] = None,
                    cache_dir: Optional[str] = None, token=None, local_files_only: Optional[bool] = None,
                    subfolder: str = "", trust_remote_code: bool = False, attn_implementation: Optional[str] = None,
                    progress: Optional[bool] = None, **kwargs):
    """Build a Hugging Face model from ``path``'s config.json with its weights straight on NVMe, and load its
    safetensors weights, in one call; host memory stays the pools and one module whatever the model's size.

    The model is built with its parameters on the meta device (buffers real), checked against the
    checkpoint (names, shapes, dtypes, every file's header) before anything is written, then offloaded
    with :func:`offload.offload_parameters`, each module's weights read from the checkpoint as it is
    materialised (converted to ``dtype``) and written to the swap space once. Tied weights stay tied.
    Returns the model in eval mode, as ``transformers`` does.

    Args:
        path: a directory holding config.json and ``model.safetensors`` or shards with
            ``model.safetensors.index.json`` (what ``save_pretrained`` writes), or a Hugging Face hub id
            (``"gpt2"``, ``"org/name"``): one in the local hub cache loads with no network at all; one that is not
            is downloaded once (JSON and safetensors files only), unless ``HF_HUB_OFFLINE`` (or
            ``local_files_only``) forbids it, where it is an error saying how to fetch it.
        nvme_path, config: as for :func:`offload.offload_parameters` (``offload_param`` settings).
        model_class: the ``transformers`` class to build (default ``AutoModelForCausalLM``).
        dtype: the weights' dtype: a ``torch.dtype``, its name (``"bfloat16"``) or ``"auto"`` (default: config.json's
            ``dtype``, else float32). ``torch_dtype`` is transformers' older name for it.
        strict: refuse a checkpoint whose names differ from the model's; with False, tensors it lacks get
            the model's own ``_init_weights``.
        revision, cache_dir, token, local_files_only, subfolder: where a hub id is found, as in transformers.
        trust_remote_code, attn_implementation: passed to transformers (the config and the model's build).
        progress: a progress bar of the bytes loaded (None: where stderr is a terminal).
        kwargs: keywords of :func:`offload.offload_parameters` (``max_in_cpu=0``, ``max_grad_in_cpu=0``,
            ``device="cuda"``, ...), and ``drop_behind`` of :func:`offload.pretrained.offload_pretrained`.
            transformers' placement and quantization keywords (``device_map``, ``max_memory``, ``load_in_8bit``,
            ...) are refused, each with what to do instead.

    Raises:
        CheckpointError: no such directory or cached hub id, no config.json, or a checkpoint that is missing,
            corrupt, or does not fit the config (named); no swap file was made.
        TypeError: a keyword this function does not take, or one of transformers' it refuses.
    """
    _check_keywords(kwargs)
    dtype = _dtype_argument(dtype, torch_dtype)
    try:
        import transformers
    except ImportError as err:
        raise ImportError("from_pretrained needs transformers: pip install 'nvme-offload[integrations]'") from err
    directory = model_directory(path, revision=revision, cache_dir=cache_dir, token=token,
                                local_files_only=local_files_only, subfolder=subfolder)
    for name in ("config.json", "generation_config.json"):  # transformers opens them by name: checked first
        if os.path.lexists(os.path.join(directory, name)):
            try:
                read_config_bytes(os.path.join(directory, name))
            except ConfigError as err:
                raise CheckpointError(str(err)) from None
    hf_config = transformers.AutoConfig.from_pretrained(directory, trust_remote_code=trust_remote_code)
    if dtype is None or dtype == "auto":
        dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or torch.float32
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    cls = model_class if model_class is not None else transformers.AutoModelForCausalLM
    build = {"dtype": dtype, "trust_remote_code": trust_remote_code} if cls is transformers.AutoModelForCausalLM \
        else {"dtype": dtype}
    if attn_implementation is not None:
        build["attn_implementation"] = attn_implementation
    model = offload_pretrained(lambda: cls.from_config(hf_config, **build), directory, nvme_path, config,
                               strict=strict, init_missing=lambda m: m._init_weights, progress=progress, **kwargs)
    if getattr(model, "generation_config", None) is not None and \
            os.path.isfile(os.path.join(directory, "generation_config.json")):
        model.generation_config = transformers.GenerationConfig.from_pretrained(directory)
    return model.eval()


def _check_keywords(kwargs: dict) -> None:
    """Refuse what from_pretrained does not take, naming it from_pretrained's (not offload_parameters')."""
    for key, value in kwargs.items():
        if key in _REFUSED:
            raise TypeError(f"from_pretrained(..., {key}=...) is not supported here: {_REFUSED[key]}.")
        if key in _SAME_AS_OURS:
            wanted, why = _SAME_AS_OURS[key]
            if value != wanted:
                raise TypeError(f"from_pretrained(..., {key}={value!r}): {why}.")
            continue
        if key not in _OFFLOAD_KEYWORDS:
            raise TypeError(f"from_pretrained() got an unexpected keyword argument {key!r}; besides its own it takes "
                            f"offload_parameters' {', '.join(_OFFLOAD_KEYWORDS)}")
    for key in _SAME_AS_OURS:
        kwargs.pop(key, None)


def _dtype_argument(dtype, torch_dtype):
    """``dtype`` or its older name ``torch_dtype`` (not both, unless the same) as a torch dtype, "auto" or None."""
    if torch_dtype is not None:
        if dtype is not None and dtype != torch_dtype:
            raise TypeError(f"from_pretrained got dtype={dtype!r} and torch_dtype={torch_dtype!r}: they are the same "
                            "setting (torch_dtype is transformers' older name); give one")
        dtype = torch_dtype
    if isinstance(dtype, str) and dtype != "auto":
        named = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(named, torch.dtype) or not named.is_floating_point:
            raise TypeError(f"dtype={dtype!r} is not a floating-point torch dtype; give torch.bfloat16, "
                            "\"bfloat16\", \"float16\", \"float32\" or \"auto\"")
        dtype = named
    if dtype is not None and dtype != "auto" and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype={dtype!r} is not a floating-point torch dtype")
    return dtype


_NEEDED = ("save_model", "_save", "_save_optimizer_and_scheduler", "_load_from_checkpoint",
           "_load_optimizer_and_scheduler", "_clip_grad_norm", "_get_grad_norm")
_classes: dict = {}


def _trainer_class() -> type:
    """``OffloadTrainer``, built on first use (so that importing this module needs no transformers)."""
    if "OffloadTrainer" not in _classes:
        try:
            from transformers import Trainer
        except ImportError as err:
            raise ImportError("OffloadTrainer needs transformers: pip install 'nvme-offload[integrations]'") from err
        missing = [name for name in _NEEDED if not hasattr(Trainer, name)]
        if missing:
            import transformers

            raise ImportError(
                f"transformers {transformers.__version__} has no Trainer.{', Trainer.'.join(missing)}, which "
                "OffloadTrainer overrides; install the version nvme-offload[integrations] names")
        _classes["OffloadTrainer"] = type("OffloadTrainer", (OffloadTrainerMixin, Trainer), {
            "__doc__": "``transformers.Trainer`` with :class:`OffloadTrainerMixin`'s streaming checkpoints and "
                       "gradient norm.",
            "__module__": __name__,
        })
    return _classes["OffloadTrainer"]


save_pretrained = save_pretrained  # offload.pretrained.save_pretrained: an offloaded model as a HF checkpoint


def __getattr__(name: str):
    if name == "OffloadTrainer":
        return _trainer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
