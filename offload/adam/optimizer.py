"""The optimizer classes: torch's Adam/AdamW whose state is placed, streamed and checkpointed by a StateStore."""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable, Optional

import torch

from ..aio import warn_use_gds
from ..checkpoint import load_checkpoint, save_checkpoint, wait_for_saves
from ..config import offload_config
from ..distributed import is_dtensor
from ..errors import StateError
from ..interrupts import deferred, deferring
from ..params import UPDATES_SHARDS, ParamAccess, store_of
from ..state import StateStore, check_state_dict
from .checks import (
    check_dtensor_options,
    check_master_weights,
    check_max_grad_norm,
    check_params,
    check_seed,
    check_state_dtype,
    check_torch_options,
    no_duplicate_warning,
    params_with_grads,
)
from .offloaded import OffloadedStep
from .overlap import BackwardOverlap, NoOverlap
from .scaling import step_scaling
from .statedict import add_offloaded_state, load_state
from .update import NO_SCALING, Math, kernel_flags, update_in_memory
from .wear import WearMeter
from .weights import WeightWatch

__all__ = ["OffloadedAdam", "OffloadedAdamW"]

_HANDOFF_MIN = 256 << 20


# NOTE: these subclass torch.optim.Adam so that hyperparameter checks, param_groups, defaults,
# add_param_group, zero_grad and LR schedulers are torch's own. Only where the state lives changes:
# exp_avg, exp_avg_sq (max_exp_avg_sq with amsgrad, and an fp32 master copy of fp16/bf16 parameters)
# live in units of a StateStore, streamed through its pool of host buffers at each step. The update
# itself (update.py) is torch's functional Adam on views of the swapped-in buffers.
class OffloadedAdam(torch.optim.Adam):
    """Adam (Kingma & Ba) with optimizer state on NVMe; a drop-in for ``torch.optim.Adam``.

    Args:
        params: parameters or parameter groups, as for ``torch.optim.Adam``.
        lr, betas, eps, weight_decay, amsgrad, maximize: as for ``torch.optim.Adam``, checked the
            same way.
        foreach, fused: which of torch's kernels does the math. ``fused=None`` (the default) uses
            the fused kernel wherever it supports the parameter's device, so results equal
            ``torch.optim.Adam(fused=True)`` bit for bit; ``fused=False`` with ``foreach=None``
            equals torch's default on CPU.
        nvme_path: a directory, or a list of directories (one per drive, striped), for the swap
            files. Required here or in ``config``. ``{rank}``, ``{local_rank}`` and ``{world_size}``
            in it are this process's (docs/distributed.md).
        config: a path to a JSON file, a dict, or a :class:`offload.config.Config`; a whole
            DeepSpeed ``ds_config.json`` works (its ``aio`` and ``zero_optimization.offload_optimizer``
            blocks are used).
        device, buffer_count, buffer_size, pin_memory, pipeline_read, pipeline_write,
        small_param_threshold, host_cache, state_dtype, master_weights, checksum: override the
            ``offload_optimizer`` settings of ``config`` (see :class:`offload.config.OptimizerOffloadConfig`):
            ``device="cpu"`` keeps all state in host memory; ``host_cache`` keeps that many bytes of it (or
            ``"auto"``) resident between steps; ``state_dtype="bf16"`` stores the moments in bf16,
            ``"int8"`` as 8-bit codes (torchao's AdamW8bit formula, bit for bit with its eager path);
            ``master_weights=False`` keeps bf16 parameters without an fp32 master, rounding their updates
            stochastically.
        overlap_backward: update each unit inside backward once its grads are final (docs/overlap.md);
            ``"auto"`` (the config's default) from the third iteration, for weights on NVMe, once two iterations
            showed it exact; ``False``: every update in ``step()``.
        max_grad_norm: clip the grads to this total norm (torch's ``clip_grad_norm_``, bit for bit) as part
            of the step.
        seed: the seed of the stochastic rounding's random stream (a run resumed with the same seed draws
            what the uninterrupted run drew).

    Parameters may be DTensors (FSDP2's ``fully_shard``, tensor parallelism): each rank keeps and updates
    the state of its local shards, and ``state_dict()`` gives DTensors as torch's optimizers do. Their
    ``max_grad_norm`` is the norm across ranks (``step()`` is then a collective), and with
    ``overlap_backward`` a shard is updated once FSDP2's reduce-scatter has delivered its gradient
    (docs/distributed.md).

    Host memory for offloaded state is the pool, ``buffer_count * buffer_size`` bytes, plus the host
    cache, whatever the model size. Disk space for all state is reserved when the optimizer is built,
    so a full disk is reported here, not at step 4000.

    Raises:
        ValueError: a bad hyperparameter (as torch), a parameter listed twice, or ``ConfigError`` for a
            bad setting.
        OSError: the swap files cannot be created or the disk cannot hold the state.
    """

    _decoupled = False

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: Optional[bool] = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: Optional[bool] = None,
        nvme_path=None,
        config=None,
        buffer_count: Optional[int] = None,
        buffer_size=None,
        pin_memory: Optional[bool] = None,
        pipeline_read: Optional[bool] = None,
        pipeline_write: Optional[bool] = None,
        small_param_threshold: Optional[int] = None,
        device: Optional[str] = None,
        host_cache=None,
        state_dtype: Optional[str] = None,
        master_weights: Optional[bool] = None,
        seed: int = 0,
        checksum: Optional[bool] = None,
        overlap_backward: Optional[bool | str] = None,
        max_grad_norm: Optional[float] = None,
    ):
        check_torch_options(capturable=capturable, differentiable=differentiable)
        with no_duplicate_warning():  # refused below, with a message of our own
            super().__init__(
                params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize, foreach=foreach,
                capturable=False, differentiable=False, fused=fused, decoupled_weight_decay=self._decoupled,
            )
        self.config = offload_config(
            config, "offload_optimizer", user=type(self).__name__, what="state",
            otherwise="or use torch.optim.Adam for state in memory",
            nvme_path=nvme_path, buffer_count=buffer_count, buffer_size=buffer_size, pin_memory=pin_memory,
            pipeline_read=pipeline_read, pipeline_write=pipeline_write, small_param_threshold=small_param_threshold,
            device=device, host_cache=host_cache, state_dtype=state_dtype, master_weights=master_weights,
            checksum=checksum, overlap_backward=overlap_backward,
        )
        if self.config.aio.use_gds:
            warn_use_gds()  # once per process: what GPUDirect Storage gives here
        check_max_grad_norm(max_grad_norm)
        self.max_grad_norm = max_grad_norm
        self.last_grad_norm: Optional[torch.Tensor] = None
        check_params(self.param_groups)
        oc = self.config.offload_optimizer
        check_master_weights(self.param_groups, oc.master_weights)
        check_state_dtype(self.param_groups, oc.state_dtype, oc.small_param_threshold)
        self._math = Math(int8=oc.state_dtype == "int8", seed=check_seed(seed))
        self._note_positions()
        check_dtensor_options(self.param_groups, max_grad_norm=max_grad_norm)
        self.state_store = StateStore(self.state, self.param_groups, self.config)
        # Says once per process, after a minute of steps, what the writes mean for the swap files' drives.
        self._wear = WearMeter(self.state_store.space.paths if self.state_store.space is not None else ())
        self._place_state()
        # With overlap_backward, weights on NVMe (offload_parameters) whose gradients are final wait, resident,
        # for their update instead of a round trip of their gradients through NVMe: up to this many bytes.
        handoff = max(2 * self.host_pool_bytes, _HANDOFF_MIN)
        self._access = ParamAccess(pin_memory=self.state_store.pin_memory, handoff_bytes=handoff)
        self._weights = WeightWatch(self.param_groups, self.state_store, self.state)
        self.state_store.on_restored.append(self._weights.note)  # a load of ours restores masters with them
        self._offloaded = OffloadedStep(self.state_store, self._access, self.state, self._weights, self.param_groups,
                                        self._math)
        self._overlap = self._start_overlap()

    def _place_state(self) -> None:
        """Space for the state of every trainable parameter, and the host cache sized; the store is closed
        again if that fails."""
        try:
            self.state_store.place(self.param_groups, trainable_only=True)
            self.state_store.size_cache()
        except BaseException:
            self.state_store.close()
            raise

    def _start_overlap(self) -> BackwardOverlap | NoOverlap:
        """With overlap_backward, the hooks through which backward starts the updates (``"auto"``: once it has
        seen that they may, see :class:`offload.adam.overlap.Learning`); else a NoOverlap."""
        mode = self.config.offload_optimizer.overlap_backward
        weights_offloaded = any(store_of(p) is not None for g in self.param_groups for p in g["params"])
        if mode is False or (mode == "auto" and (self.max_grad_norm is not None or _sharded(self.param_groups)
                                                 or not weights_offloaded)):
            # "auto" never updates inside backward when clipping waits, for DTensors, or without weights on NVMe
            # (offload_parameters comes first), where it saves little: no hooks then, nothing watched.
            return NoOverlap()
        # The worker a backward starts holds the OffloadedStep, never the optimizer (see its note).
        overlap = BackwardOverlap(self._offloaded, clip=self.max_grad_norm is not None, armed=mode is True)
        weakref.finalize(self, overlap.abandon, StateError("the optimizer was dropped during backward"))
        overlap.hook(p for g in self.param_groups for p in g["params"])
        return overlap

    # -- what users call ---------------------------------------------------------------------

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """Whether a GradScaler may hand its scale to step() (torch's fused kernel unscales and skips inf
        steps itself): as torch's, when every group uses the fused kernel. Then fp16 parameters work with
        a GradScaler, their grads unscaled against the fp32 master; otherwise the scaler unscales the
        grads first, as for any optimizer (and refuses fp16 ones, as torch does).

        A GradScaler asks this first in ``scaler.step``: with overlap_backward, once backward has started an
        update (on the scaled grads), that is where the scaler is refused and the state marked failed,
        before the scaler reads any grad (an offloaded one would fail it with another error, and the
        state would look usable)."""
        if self._overlap.running:
            self._overlap.refuse_scaler()
        if self._math.int8:
            return False  # torchao's formula has no scale to hand: the scaler unscales the grads itself
        return all(kernel_flags(g, p.device)["fused"] for g in self.param_groups for p in g["params"])

    @_step_supports_amp_scaling.setter
    def _step_supports_amp_scaling(self, value) -> None:
        pass  # torch's Adam sets it in __init__; here it follows the kernels in use

    @property
    def takes_grad_scale(self) -> bool:
        """Whether step() honours a loss scale handed to it as ``grad_scale``/``found_inf`` (the GradScaler
        protocol): with torch's fused kernel it divides by it, with 8-bit state the grads are unscaled first."""
        return self._math.int8 or all(kernel_flags(g, p.device)["fused"] for g in self.param_groups
                                      for p in g["params"])

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None):
        """Perform one optimization step; ``closure`` re-evaluates the model and returns the loss.

        A Ctrl-C during the step is held until the step has finished (its state stays whole), then raised; a
        second one stops it at its next unit (the state must then be restored).

        Raises:
            StateError: an earlier step failed part-way; restore state with ``load_state_dict``.
            OSError: reading or writing state failed (the optimizer then refuses further steps).
        """
        self._check_can_step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with deferred(urgent=False):
            # From a GradScaler (see _step_supports_amp_scaling): an inf or nan in the grads skips the step
            # (torch's fused kernel leaves every tensor as it was, step counts included), else the kernels
            # divide the grads by the scale.
            found_inf = getattr(self, "found_inf", None)
            if found_inf is not None and bool(found_inf.sum() > 0):
                return loss
            in_memory, offloaded, with_grad = params_with_grads(self.param_groups, self.state_store.is_small)
            self._update(in_memory, offloaded, with_grad, scale=getattr(self, "grad_scale", None))
            self._wear.step(self.state_store.bytes_written)
            self._overlap.note_step(clean=closure is None and getattr(self, "grad_scale", None) is None
                                    and any(store_of(p) is not None for _, p in offloaded))
        return loss

    def _check_can_step(self, closure: Optional[Callable]) -> None:
        """The state usable (else a step that failed during backward ends here), what overlap_backward
        cannot honour refused, and no offloaded weights replaced under a master."""
        try:
            self.state_store.check_usable("step")
        except StateError as err:
            self._overlap.abandon(err)  # a step that failed during backward ends here
            raise
        scaler = getattr(self, "grad_scale", None) is not None or getattr(self, "found_inf", None) is not None
        self._overlap.refuse_unsupported(closure=closure, scaler=scaler)
        self._weights.check()

    def _update(self, in_memory: list, offloaded: list, with_grad: list, *, scale: Optional[torch.Tensor]) -> None:
        """Update the state of the parameters with grads. Until the update starts, a failure leaves the
        state as it was (placing late parameters is all or nothing), unless an update is already under way
        since backward; after that, a failure marks the state failed."""
        changing = self._overlap.running
        try:
            self._offloaded.scaling = self._grad_scaling(with_grad, scale)
            self.state_store.place_late(self.param_groups, (p for _, p in offloaded))
            changing = True
            # Parameters whose weights live on NVMe (offload_parameters) are fetched for the update and
            # written back after it; ordinary parameters are untouched by this.
            with self._access.resident([p for _, p in in_memory], dirty=True):
                update_in_memory(self.state, in_memory, grad_of=self._access.grad, scaling=self._offloaded.scaling,
                                 math=self._math, master=self.config.offload_optimizer.master_weights)
            self._update_rest(offloaded)
        except BaseException as err:
            self._fail_step(err, changing)
            raise
        finally:
            self._offloaded.scaling = NO_SCALING

    def _update_rest(self, offloaded: list) -> None:
        """With overlap_backward most units were updated during backward: finish that, then the rest."""
        done = self._overlap.finish()
        rest = [self.state_store.slot(p) for _, p in offloaded if self.state_store.slot(p) not in done]
        if rest:
            self._offloaded.run(rest)

    def _fail_step(self, err: BaseException, changing: bool) -> None:
        """A step that raised ``err``: one running since backward ends, and state that was changing is failed."""
        self._overlap.abandon(err)
        if changing and not isinstance(err, (ValueError, TypeError)):
            self.state_store.mark_failed(err)

    def no_step(self):
        """A context in which backward passes only accumulate gradients, with ``overlap_backward``.

        Shaped like DDP's ``no_sync()``: wrap the micro-batches of a gradient accumulation that must not
        step; the backward of the last one (outside the block) updates the state, then call ``step()``.
        Without ``overlap_backward`` updates happen in ``step()`` only, and the block changes nothing.
        """
        return self._overlap.no_step()

    @deferring
    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's; gradients held in a parameter grad store are dropped (or marked zero) too. With
        overlap_backward, a step a backward started and no step() finished (an interrupted backward) ends
        here: the state stays usable if that step had updated nothing, else it is failed until restored."""
        self._overlap.cancel("zero_grad()")
        super().zero_grad(set_to_none)
        self._access.forget_grads(p for g in self.param_groups for p in g["params"])

    @deferring
    def add_param_group(self, param_group: dict) -> None:
        """Add a parameter group (as torch); its state gets space on the swap files at once.

        Raises:
            ValueError: a parameter is already in a group (or listed twice), or is not a usable tensor.
            OSError: the disk cannot hold the new state; the optimizer keeps its groups and state as before.
        """
        if hasattr(self, "state_store"):
            self._overlap.refuse_while_running("add_param_group()")
        with no_duplicate_warning():
            super().add_param_group(param_group)
        if hasattr(self, "state_store"):
            try:
                check_params(self.param_groups)
                oc = self.config.offload_optimizer
                check_master_weights(self.param_groups[-1:], oc.master_weights)
                check_state_dtype(self.param_groups[-1:], oc.state_dtype, oc.small_param_threshold)
                check_dtensor_options(self.param_groups, max_grad_norm=self.max_grad_norm)
                self.state_store.place(self.param_groups[-1:], trainable_only=True)
            except BaseException:
                self.param_groups.pop()
                raise
            self._note_positions()
            self._overlap.hook(self.param_groups[-1]["params"])

    @deferring
    def state_dict(self) -> dict:
        """The state in torch's layout: ``{"state": {index: {...}}, "param_groups": [...]}``.

        Offloaded state is read back into host memory (one CPU tensor per state entry, shaped like its
        parameter, whatever the parameter's device), so this needs host memory for the whole state and no
        device memory. fp16/bf16 parameters also carry their fp32 master copy as ``"master"``. A DTensor
        parameter's state is DTensors laid out as the parameter (as torch's optimizers keep it), each rank
        holding its local shard: what ``torch.distributed.checkpoint`` saves and loads.

        Raises:
            StateError: the last step failed part-way, so the offloaded state may be half written.
        """
        self._overlap.refuse_while_running("state_dict()")
        self.state_store.check_usable("export the state")
        return add_offloaded_state(super().state_dict(), self.param_groups, self.state_store, self.state)

    @deferring
    def load_state_dict(self, state_dict: dict) -> None:
        """Load state saved by this class or by ``torch.optim.Adam``/``AdamW``; clears a failed step.

        For a DTensor parameter the state may be DTensors (laid out as the parameter, or redistributed to
        its layout: a collective, so every rank loads together) or whole tensors of the parameter's global
        shape, of which each rank keeps its part.

        Raises:
            ValueError: the groups, parameter counts or state shapes do not match this optimizer.
        """
        if self.state_store.closed:
            raise ValueError("the optimizer is closed")
        params = check_state_dict(self.param_groups, state_dict)
        self._overlap.end_for_load("load_state_dict()")
        load_state(self, state_dict, params, self._access)

    def save_checkpoint(self, directory, *, model=None, extra=None, blocking: bool = True,
                        snapshot: str = "auto", progress: Optional[bool] = None, alone: bool = False):
        """Save the whole optimizer state to ``directory`` atomically, streaming it through the pool.

        Host memory stays bounded by the pool whatever the model size. ``model``'s weights are saved
        beside it (offloaded ones streamed through the parameter pool), and ``extra`` (for instance
        ``{"step": step}``). ``blocking=False`` returns a handle at once while training goes on (the
        checkpoint holds the state at the call). In a job of several ranks every rank calls it (one
        checkpoint for the job), unless ``alone=True`` (one rank saving by itself, e.g. rank 0 under DDP). See
        :func:`offload.checkpoint.save_checkpoint`.
        """
        return save_checkpoint(self, directory, model=model, extra=extra, blocking=blocking,
                               snapshot=snapshot, progress=progress, alone=alone)

    def load_checkpoint(self, directory, *, model=None, progress: Optional[bool] = None,
                        alone: bool = False):
        """Restore state saved by :meth:`save_checkpoint` (checksums verified), and ``model``'s
        weights if given; returns its ``extra``. ``alone`` as for :meth:`save_checkpoint`. See
        :func:`offload.checkpoint.load_checkpoint`.
        """
        return load_checkpoint(self, directory, model=model, progress=progress, alone=alone)

    def __getstate__(self):
        raise TypeError(
            f"an {type(self).__name__} cannot be pickled or deep-copied: it owns swap files, a pool of host "
            "buffers and I/O threads. Save its state with save_checkpoint() (or state_dict()) and load it into "
            "a new optimizer with load_checkpoint() (or load_state_dict()).")

    def __deepcopy__(self, memo):
        self.__getstate__()

    def close(self) -> None:
        """Wait for a save in flight, then delete the swap files and free the pools. The optimizer cannot
        step afterwards. A Ctrl-C while the save is waited for stops the wait (close again); once the
        resources are being let go it is held until they all are."""
        error = None
        try:
            wait_for_saves(self)
        except KeyboardInterrupt:
            raise  # nothing is let go yet: close() again waits again
        except BaseException as err:  # raised below, once everything is let go
            error = err
        with deferred(urgent=False):
            self._overlap.abandon(StateError("the optimizer was closed during backward"))
            self._overlap.remove()
            self.state_store.close()
            self._access.close()
        if error is not None:
            raise error

    # -- introspection -----------------------------------------------------------------------

    @property
    def host_pool_bytes(self) -> int:
        """Host memory of the pool that offloaded state moves through (0 with ``device: "cpu"``)."""
        return self.state_store.pool.nbytes if self.state_store.pool is not None else 0

    @property
    def host_cache_bytes(self) -> int:
        """Host memory holding resident state: the host tier (``host_cache``, or all state with
        ``device: "cpu"``)."""
        return self.state_store.tier.nbytes if self.state_store.tier is not None else 0

    @property
    def grad_pool_bytes(self) -> int:
        """Host memory held for reading offloaded gradients (0 until a step needed it)."""
        return self._access.grad_pool_bytes

    @property
    def offloaded_state_bytes(self) -> int:
        """Bytes of state stored on the swap space (all units); 0 with ``device: "cpu"``, whose state is all in
        host memory (:attr:`host_cache_bytes`)."""
        return self.state_store.state_bytes if self.state_store.space is not None else 0

    def check_no_step_running(self, what: str) -> None:
        """Refuse ``what`` (a checkpoint save) while a step that backward started (``overlap_backward``) runs
        on the pool: it would race it.

        Raises:
            StateError: such a step is running; call step() first.
        """
        self._overlap.refuse_while_running(what)

    def end_running_step(self, what: str) -> None:
        """End a step that backward started (``overlap_backward``), if one runs: ``what`` (a checkpoint load)
        replaces the state."""
        self._overlap.end_for_load(what)

    @property
    def swap_space(self):
        """The :class:`offload.space.SwapSpace` holding the state."""
        return self.state_store.space

    def io_bytes(self) -> tuple[int, int]:
        """(bytes read, bytes written) of offloaded state since construction."""
        return self.state_store.bytes_read, self.state_store.bytes_written

    # -- the step ----------------------------------------------------------------------------

    def _note_positions(self) -> None:
        """Each parameter's index over the groups (``state_dict``'s), which keys its rounding stream."""
        self._math.position.clear()
        self._math.position.update({id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])})

    def _grad_scaling(self, params: list, scale: Optional[torch.Tensor]):
        """What this step does to ``params``' grads (:func:`step_scaling`); with max_grad_norm, their total
        norm becomes ``last_grad_norm`` (norms taken during backward with overlap_backward)."""
        scaling, norm = step_scaling(params, scale, max_grad_norm=self.max_grad_norm,
                                     norms_taken=self._overlap.norms,
                                     grad_of=self._access.grad, kernel_takes_scale=not self._math.int8)
        if norm is not None:
            self.last_grad_norm = norm
        return scaling


def _sharded(groups: list) -> bool:
    return any(is_dtensor(p) for g in groups for p in g["params"])


# Its step fetches each local FSDP2 shard on NVMe for the update (offload.params refuses other optimizers' steps).
setattr(OffloadedAdam, UPDATES_SHARDS, True)


class OffloadedAdamW(OffloadedAdam):
    """AdamW (decoupled weight decay) with optimizer state on NVMe; a drop-in for ``torch.optim.AdamW``.

    Same arguments as :class:`OffloadedAdam`, with ``weight_decay`` defaulting to 1e-2 as in torch.
    """

    _decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
                 **kwargs):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kwargs)
