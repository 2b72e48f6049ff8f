"""Hugging Face ``Trainer`` with nvme-offload: checkpoints that stream, and the grad norm of offloaded grads.

``OffloadTrainer`` is ``transformers.Trainer`` with the overrides of :class:`OffloadTrainerMixin`;
the mixin goes in front of any other ``Trainer`` subclass (``class MyTrainer(OffloadTrainerMixin,
SFTTrainer)``). ``transformers`` is imported only when ``OffloadTrainer`` is first used.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch

from ..params import clip_grad_norm_
from ..pretrained import offload_pretrained, save_pretrained
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
        _refuse_overlap(self.optimizer, self.args)
        return super().train(*args, **kwargs)

    def create_optimizer(self, *args, **kwargs):
        opt = super().create_optimizer(*args, **kwargs)
        _refuse_overlap(opt, self.args)
        return opt

    # -- saving ---------------------------------------------------------------------------------

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
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


def from_pretrained(path: str | os.PathLike, nvme_path=None, config=None, *, model_class=None, dtype=None,
                    strict: bool = True, **offload_kwargs):
    """Build a Hugging Face model from ``path``'s config.json with its weights straight on NVMe, and load its
    safetensors weights, in one call; host memory stays the pools and one module whatever the model's size.

    The model is built with its parameters on the meta device (buffers real), checked against the
    checkpoint (names, shapes, dtypes, every file's header) before anything is written, then offloaded
    with :func:`offload.offload_parameters`, each module's weights read from the checkpoint as it is
    materialised (converted to ``dtype``) and written to the swap space once. Tied weights stay tied.
    Returns the model in eval mode, as ``transformers`` does.

    Args:
        path: a directory holding config.json and ``model.safetensors`` or shards with
            ``model.safetensors.index.json`` (what ``save_pretrained`` writes; nothing is downloaded).
        nvme_path, config: as for :func:`offload.offload_parameters` (``offload_param`` settings).
        model_class: the ``transformers`` class to build (default ``AutoModelForCausalLM``).
        dtype: the weights' dtype (default: config.json's ``dtype``, else float32).
        strict: refuse a checkpoint whose names differ from the model's; with False, tensors it lacks get
            the model's own ``_init_weights``.
        offload_kwargs: more keywords for :func:`offload.offload_parameters` (``max_in_cpu=0``, ...), and
            ``drop_behind`` for :func:`offload.pretrained.offload_pretrained`.

    Raises:
        CheckpointError: the checkpoint is missing, corrupt, or does not fit the config (named); no swap
            file was made.
    """
    try:
        import transformers
    except ImportError as err:
        raise ImportError("from_pretrained needs transformers: pip install 'nvme-offload[integrations]'") from err
    hf_config = transformers.AutoConfig.from_pretrained(os.fspath(path))
    if dtype is None:
        dtype = getattr(hf_config, "dtype", None) or torch.float32
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    cls = model_class if model_class is not None else transformers.AutoModelForCausalLM
    model = offload_pretrained(lambda: cls.from_config(hf_config, dtype=dtype), path, nvme_path, config,
                               strict=strict, init_missing=lambda m: m._init_weights, **offload_kwargs)
    if getattr(model, "generation_config", None) is not None and \
            os.path.isfile(os.path.join(os.fspath(path), "generation_config.json")):
        model.generation_config = transformers.GenerationConfig.from_pretrained(os.fspath(path))
    return model.eval()


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
