"""accelerate with nvme-offload: ``save_state``/``load_state`` stream an ``OffloadedAdam`` through its pool.

After ``accelerator.prepare(...)``, ``register(accelerator, optimizer, model=...)`` installs accelerate's
save and load hooks so that the optimizer's state (and the weights of a model offloaded with
``offload_parameters``) go to ``<output_dir>/offload`` through ``save_checkpoint``/``load_checkpoint``;
accelerate saves everything else. ``accelerate`` is imported only when ``register`` is called.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Optional

from torch import nn

from . import OFFLOAD_DIR
from ._common import has_offloaded_weights, offloaded_optimizer, unwrap_model

__all__ = ["OFFLOAD_DIR", "register"]

_MARKER = {"nvme_offload": OFFLOAD_DIR}  # what accelerate's optimizer.bin holds instead of the state


# NOTE: accelerate's save_state calls state_dict() on every prepared optimizer after its save hooks,
# with no way for a hook to leave one out. The prepared optimizer's class is therefore switched to a
# subclass (as offload_parameters switches a parameter's) whose state_dict() answers the small marker
# once, right after our save hook streamed the state, and whose load_state_dict() takes the marker
# as "already loaded by the load hook". Any other state_dict() call is accelerate's own.
def _streamed_class(base: type) -> type:
    class StreamedOptimizer(base):
        _nvme_saving = False

        def state_dict(self):
            if self._nvme_saving:
                self._nvme_saving = False
                return dict(_MARKER)
            return super().state_dict()

        def load_state_dict(self, state_dict):
            if state_dict == _MARKER:
                return None  # loaded by the load hook, from <input_dir>/offload
            return super().load_state_dict(state_dict)

    StreamedOptimizer.__name__ = StreamedOptimizer.__qualname__ = f"Streamed{base.__name__}"
    return StreamedOptimizer


def register(accelerator: Any, optimizer: Any, model: Optional[nn.Module] = None) -> list:
    """Make ``accelerator.save_state``/``load_state`` stream ``optimizer``'s state (and ``model``'s
    offloaded weights) through the pools, into ``<dir>/offload``.

    Call it once, after ``accelerator.prepare``. Host memory for the streamed part stays the pools
    whatever the model size. A model offloaded with ``offload_parameters`` should stay out of
    ``accelerator.prepare`` and be passed here: accelerate gathers the ``state_dict()`` of every
    prepared model (every weight in memory) before any hook runs. A model that is not offloaded is
    prepared and saved by accelerate as usual.

    Args:
        accelerator: the ``accelerate.Accelerator``.
        optimizer: what ``accelerator.prepare`` returned for an ``OffloadedAdam``/``OffloadedAdamW``.
        model: the model whose offloaded weights go with the optimizer's state.

    Returns:
        The two hooks' handles (``handle.remove()`` undoes the hooks).

    Raises:
        TypeError: ``optimizer`` is not a prepared ``OffloadedAdam``.
    """
    try:
        from accelerate.optimizer import AcceleratedOptimizer
    except ImportError as err:
        raise ImportError("register needs accelerate: pip install 'nvme-offload[integrations]'") from err
    opt = offloaded_optimizer(optimizer)
    if not isinstance(optimizer, AcceleratedOptimizer) or opt is None:
        raise TypeError(f"register expects what accelerator.prepare returned for an OffloadedAdam, got "
                        f"{type(optimizer).__name__}" + ("" if opt is not None else " (no OffloadedAdam inside)"))
    if not type(optimizer).__name__.startswith("Streamed"):
        optimizer.__class__ = _streamed_class(type(optimizer))
    model = unwrap_model(model) if model is not None else None
    with_weights = has_offloaded_weights(model)

    def save_hook(models: list, weights: list, output_dir: str) -> None:
        if accelerator.is_main_process:
            opt.save_checkpoint(os.path.join(output_dir, OFFLOAD_DIR), model=model if with_weights else None,
                                alone=True)
        optimizer._nvme_saving = True
        if with_weights:  # a prepared offloaded model: saved above, not again by accelerate
            for i in reversed(range(len(models))):
                if unwrap_model(models[i]) is model:
                    del weights[i]  # (``models`` is accelerate's own list: left alone)

    def load_hook(models: list, input_dir: str) -> None:
        opt.load_checkpoint(os.path.join(input_dir, OFFLOAD_DIR), model=model if with_weights else None,
                            alone=True)
        if with_weights:
            for i in reversed(range(len(models))):
                if unwrap_model(models[i]) is model:
                    del models[i]

    _clear_after_save(accelerator, optimizer)
    return [accelerator.register_save_state_pre_hook(save_hook),
            accelerator.register_load_state_pre_hook(load_hook)]


def _clear_after_save(accelerator: Any, optimizer: Any) -> None:
    """Drop the one-shot marker when ``save_state`` ends however it ends: a save that failed after our
    hook never leaves a later ``state_dict()`` answering the marker instead of the state."""
    if getattr(accelerator.save_state, "_nvme_clears", None) is not None:
        accelerator.save_state._nvme_clears.append(optimizer)
        return
    original = accelerator.save_state
    clears = [optimizer]

    @functools.wraps(original)
    def save_state(*args, **kwargs):
        try:
            return original(*args, **kwargs)
        finally:
            for opt in clears:
                opt._nvme_saving = False

    save_state._nvme_clears = clears
    accelerator.save_state = save_state
