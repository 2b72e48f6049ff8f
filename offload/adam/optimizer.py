"""The optimizer classes: torch's Adam/AdamW whose state is placed, streamed and checkpointed by a StateStore."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Optional

import torch

from .. import copies
from ..aio import warn_use_gds
from ..checkpoint import load_checkpoint, save_checkpoint, wait_for_saves
from ..checkpoint.load import restore_in_memory
from ..clipping import clip_coef, grad_norm, total_norm
from ..config import offload_config
from ..copies import DONE, Ticket
from ..distributed import is_dtensor, like
from ..errors import StateError
from ..overlap import BackwardOverlap
from ..params import ParamAccess, store_of, weight_loads
from ..state import ParamSlot, StateStore, check_state_dict, local_entry
from .checks import check_dtensor_options, check_grad, check_params, no_duplicate_warning
from .update import NO_SCALING, GradScaling, kernel_flags, update_chunks, update_in_memory
from .wear import WearMeter

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
        small_param_threshold, host_cache, state_dtype, checksum: override the ``offload_optimizer``
            settings of ``config`` (see :class:`offload.config.OptimizerOffloadConfig`): ``device="cpu"``
            keeps all state in host memory; ``host_cache`` keeps that many bytes of it (or ``"auto"``)
            resident between steps; ``state_dtype="bf16"`` stores the moments in bf16.

    Parameters may be DTensors (FSDP2's ``fully_shard``, tensor parallelism): each rank keeps and updates
    the state of its local shards, and ``state_dict()`` gives DTensors as torch's optimizers do.

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
        checksum: Optional[bool] = None,
        overlap_backward: Optional[bool] = None,
        max_grad_norm: Optional[float] = None,
    ):
        if capturable:
            raise ValueError("capturable=True is not supported by OffloadedAdam (state is not on the device)")
        if differentiable:
            raise ValueError("differentiable=True is not supported by OffloadedAdam")
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
            device=device, host_cache=host_cache, state_dtype=state_dtype, checksum=checksum,
            overlap_backward=overlap_backward,
        )
        if self.config.aio.use_gds:
            warn_use_gds()  # once per process: what GPUDirect Storage gives here
        if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0):
            raise ValueError(f"max_grad_norm must be a positive number, got {max_grad_norm!r}")
        self.max_grad_norm = max_grad_norm
        self.last_grad_norm: Optional[torch.Tensor] = None
        self._scaling = NO_SCALING  # what step() does to the grads, for its updates
        self._wear = WearMeter()  # says once what the writes mean for the drives
        check_params(self.param_groups)
        check_dtensor_options(self.param_groups, max_grad_norm=max_grad_norm,
                               overlap_backward=self.config.offload_optimizer.overlap_backward)
        self.state_store = StateStore(self.state, self.param_groups, self.config)
        try:
            self.state_store.place(self.param_groups, trainable_only=True)
            self.state_store.size_cache()
        except BaseException:
            self.state_store.close()
            raise
        # With overlap_backward, weights on NVMe (offload_parameters) whose gradients are final wait, resident,
        # for their update instead of a round trip of their gradients through NVMe: up to this many bytes.
        handoff = max(2 * self.host_pool_bytes, _HANDOFF_MIN)
        self._access = ParamAccess(pin_memory=self.state_store.pin_memory, handoff_bytes=handoff)
        # Loads of offloaded weights seen by the fp32 masters: a load after a master was made (load_parameters,
        # load_safetensors) would be undone by the next update, which writes the master's weights back.
        self._weights_seen: dict[int, int] = {}
        self._note_weights()
        self.state_store.on_restored.append(self._note_weights)  # a load of ours restores masters with them
        self._overlap = None
        if self.config.offload_optimizer.overlap_backward:
            self._overlap = BackwardOverlap(self._step_offloaded, self._overlap_slots, self.state_store.units_of,
                                            clip=max_grad_norm is not None, mark_failed=self.state_store.mark_failed,
                                            access=self._access)
            self._overlap.hook(p for g in self.param_groups for p in g["params"])

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
        if self._overlap is not None and self._overlap.running:
            self._refuse_scaler_in_overlap()
        return all(kernel_flags(g, p.device)["fused"] for g in self.param_groups for p in g["params"])

    @_step_supports_amp_scaling.setter
    def _step_supports_amp_scaling(self, value) -> None:
        pass  # torch's Adam sets it in __init__; here it follows the kernels in use

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None):
        """Perform one optimization step; ``closure`` re-evaluates the model and returns the loss.

        Raises:
            StateError: an earlier step failed part-way; restore state with ``load_state_dict``.
            OSError: reading or writing state failed (the optimizer then refuses further steps).
        """
        store = self.state_store
        overlap = self._overlap
        try:
            store.check_usable("step")
        except StateError as err:
            if overlap is not None:
                overlap.abandon(err)  # a step that failed during backward ends here
            raise
        if overlap is not None:
            self._refuse_in_overlap(closure)
        self._check_weights()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # From a GradScaler (see _step_supports_amp_scaling): an inf or nan in the grads skips the step
        # (torch's fused kernel leaves every tensor as it was, step counts included), else the kernels
        # divide the grads by the scale.
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and bool(found_inf.sum() > 0):
            return loss
        scale = getattr(self, "grad_scale", None)

        in_memory, offloaded, with_grad = [], [], []  # with_grad: in the groups' order, as torch's clip stacks norms
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                check_grad(p)
                with_grad.append(p)
                (in_memory if store.is_small(p) else offloaded).append((group, p))
        # Until the update starts, a failure leaves the state as it was (placing late parameters is
        # all or nothing), unless an update is already under way since backward.
        changing = overlap is not None and overlap.running
        try:
            self._scaling = self._grad_scaling(with_grad, scale)
            late = {p for _, p in offloaded if store.slot(p) is None}
            if late:
                # Parameters that were frozen at construction and now have grads get their place.
                store.place(self.param_groups, only=late)
            changing = True
            # Parameters whose weights live on NVMe (offload_parameters) are fetched for the update and
            # written back after it; ordinary parameters are untouched by this.
            with self._access.resident([p for _, p in in_memory], dirty=True):
                update_in_memory(self.state, in_memory, grad_of=self._access.grad, scaling=self._scaling)
            # With overlap_backward most units were updated during backward: finish that, then the rest.
            done = overlap.finish() if overlap is not None else set()
            rest = [store.slot(p) for _, p in offloaded if store.slot(p) not in done]
            if rest:
                self._step_offloaded(rest)
        except BaseException as err:
            if overlap is not None:
                overlap.abandon(err)
            if changing and not isinstance(err, (ValueError, TypeError)):
                store.mark_failed(err)
            raise
        finally:
            self._scaling = NO_SCALING
        self._wear.step(store.bytes_written)
        return loss

    def no_step(self):
        """A context in which backward passes only accumulate gradients, with ``overlap_backward``.

        Shaped like DDP's ``no_sync()``: wrap the micro-batches of a gradient accumulation that must not
        step; the backward of the last one (outside the block) updates the state, then call ``step()``.
        Without ``overlap_backward`` updates happen in ``step()`` only, and the block changes nothing.
        """
        return self._overlap.no_step() if self._overlap is not None else contextlib.nullcontext()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's; gradients held in a parameter grad store are dropped (or marked zero) too. With
        overlap_backward, a step a backward started and no step() finished (an interrupted backward) ends
        here: the state stays usable if that step had updated nothing, else it is failed until restored."""
        if self._overlap is not None:
            self._overlap.cancel("zero_grad()")
        super().zero_grad(set_to_none)
        self._access.forget_grads(p for g in self.param_groups for p in g["params"])

    def add_param_group(self, param_group: dict) -> None:
        """Add a parameter group (as torch); its state gets space on the swap files at once.

        Raises:
            ValueError: a parameter is already in a group (or listed twice), or is not a usable tensor.
            OSError: the disk cannot hold the new state; the optimizer keeps its groups and state as before.
        """
        if hasattr(self, "state_store"):
            self._refuse_during_backward_step("add_param_group()")
        with no_duplicate_warning():
            super().add_param_group(param_group)
        if hasattr(self, "state_store"):
            try:
                check_params(self.param_groups)
                self.state_store.place(self.param_groups[-1:], trainable_only=True)
            except BaseException:
                self.param_groups.pop()
                raise
            if self._overlap is not None:
                self._overlap.hook(self.param_groups[-1]["params"])

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
        self._refuse_during_backward_step("state_dict()")
        self.state_store.check_usable("export the state")
        sd = super().state_dict()
        index = {p: i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        for slot, tensors in self.state_store.read_state():
            # Offloaded state lives on the host side: it stays there (as torch's optimizers keep state where
            # it lives), so saving state larger than the GPU's memory works. A DTensor's shard goes to its
            # mesh's device, where a DTensor's local tensor must be.
            entry = {k: like(t.to(slot.param.device) if is_dtensor(slot.param) else t, slot.param)
                     for k, t in tensors.items()}
            entry["step"] = self.state[slot.param]["step"].clone()
            sd["state"][index[slot.param]] = entry
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Load state saved by this class or by ``torch.optim.Adam``/``AdamW``; clears a failed step.

        For a DTensor parameter the state may be DTensors (laid out as the parameter, or redistributed to
        its layout: a collective, so every rank loads together) or whole tensors of the parameter's global
        shape, of which each rank keeps its part.

        Raises:
            ValueError: the groups, parameter counts or state shapes do not match this optimizer.
        """
        store = self.state_store
        if store.closed:
            raise ValueError("the optimizer is closed")
        params = check_state_dict(self.param_groups, state_dict)
        self._abandon_backward_step("load_state_dict()")
        entries = {params[k]: local_entry(entry, params[k]) for k, entry in state_dict["state"].items()}
        offloaded = {p: e for p, e in entries.items() if not store.is_small(p)}
        restore_in_memory(self, state_dict["param_groups"], {p: e for p, e in entries.items() if p not in offloaded},
                          {p: e.get("step", 0.0) for p, e in offloaded.items()})
        late = {p for p in offloaded if store.slot(p) is None}
        if late:
            store.place(self.param_groups, only=late)  # frozen at construction: placed now, together
        by_slot = {store.slot(p): e for p, e in offloaded.items()}
        units = store.units_of(by_slot)
        with self._access.units(units, {id(s) for s in by_slot}, write_back=False) as unit_pass:
            # A master copy made from weights on NVMe needs them resident, one unit's worth at a time.
            store.write_state(by_slot, master_from=unit_pass.weights, after_unit=unit_pass.done)
        store.restored()

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
        self._refuse_during_backward_step("save_checkpoint()")
        return save_checkpoint(self, directory, model=model, extra=extra, blocking=blocking,
                               snapshot=snapshot, progress=progress, alone=alone)

    def load_checkpoint(self, directory, *, model=None, progress: Optional[bool] = None,
                        alone: bool = False):
        """Restore state saved by :meth:`save_checkpoint` (checksums verified), and ``model``'s
        weights if given; returns its ``extra``. ``alone`` as for :meth:`save_checkpoint`. See
        :func:`offload.checkpoint.load_checkpoint`.
        """
        self._abandon_backward_step("load_checkpoint()")
        return load_checkpoint(self, directory, model=model, progress=progress, alone=alone)

    def _refuse_during_backward_step(self, what: str) -> None:
        """With overlap_backward, between a backward and step() the step is running on the pool: what
        reads or changes the state then would race it."""
        if self._overlap is not None and self._overlap.running:
            raise StateError(f"{what} was called between backward and step() with overlap_backward=True, while "
                             "the update that backward started is still running: call step() first.")

    def _abandon_backward_step(self, what: str) -> None:
        """A load replaces the state: a step left running by a backward (or failed in it) ends first."""
        if self._overlap is not None and self._overlap.running:
            self._overlap.abandon(StateError(f"{what} replaced the state during an overlapped step"))

    def __getstate__(self):
        raise TypeError(
            f"an {type(self).__name__} cannot be pickled or deep-copied: it owns swap files, a pool of host "
            "buffers and I/O threads. Save its state with save_checkpoint() (or state_dict()) and load it into "
            "a new optimizer with load_checkpoint() (or load_state_dict()).")

    def __deepcopy__(self, memo):
        self.__getstate__()

    def close(self) -> None:
        """Wait for a save in flight, then delete the swap files and free the pools. The optimizer cannot
        step afterwards."""
        try:
            wait_for_saves(self)
        finally:
            if self._overlap is not None:
                self._overlap.abandon(StateError("the optimizer was closed during backward"))
                self._overlap.remove()
            self.state_store.close()
            self._access.close()

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
        """Bytes of state stored on the swap space (all units)."""
        return self.state_store.state_bytes

    @property
    def swap_space(self):
        """The :class:`offload.space.SwapSpace` holding the state."""
        return self.state_store.space

    def io_bytes(self) -> tuple[int, int]:
        """(bytes read, bytes written) of offloaded state since construction."""
        return self.state_store.bytes_read, self.state_store.bytes_written

    # -- the step ----------------------------------------------------------------------------

    def _step_offloaded(self, slots: list[ParamSlot], gate: Optional[Callable] = None,
                        order: Optional[list] = None) -> set:
        """Update the units of ``slots`` (in ``order``, else the store's snake order); ``gate(unit)`` runs
        before each update (overlap_backward: until its grads are final). A chunk is updated when its slot
        is one of ``slots`` and its parameter has a grad then. Returns the slots updated."""
        store = self.state_store
        candidates = {id(s) for s in slots}
        units = order if order is not None else store.step_order(store.units_of(slots))
        # With an fp32 master copy on disk the old weights are not read: the update rewrites all of them.
        has_master = lambda slot: "master" in slot.keys and slot.initialized  # noqa: E731
        copying: dict[int, Ticket] = {}  # id(unit) -> the copies of its updated state back into its buffer
        updated: set = set()

        def before_write(unit) -> None:
            # The state copied back from the device must be in the buffer before it is written.
            copying.pop(id(unit), DONE).wait()

        try:
            with self._access.units(units, candidates) as unit_pass:
                def update(unit, buf) -> None:
                    if gate is not None:
                        gate(unit)
                    # What this update changes: the chunks whose parameter has a grad now. Only their weights
                    # are fetched (and written back); a parameter unused in this iteration keeps its weights on
                    # NVMe untouched (fetched without a read, as a master allows, they would go back as garbage).
                    chunks = [c for c in unit.chunks if id(c.slot) in candidates and c.slot.param.grad is not None]
                    grads = unit_pass.grads(unit)
                    unit_pass.fetch(unit, {c.slot for c in chunks}, skip_read=has_master)
                    by_group: dict[int, list] = {}
                    for c in chunks:
                        by_group.setdefault(id(c.slot.group), []).append(c)
                        updated.add(c.slot)
                        # A state entry only for a parameter that is updated (a parameter without a grad gets
                        # none, as in torch); made once, not a tensor per chunk per step.
                        st = self.state[c.slot.param]
                        if "step" not in st:
                            st["step"] = torch.tensor(0.0, dtype=torch.float32)
                    read = landed = DONE
                    try:
                        for chunks in by_group.values():
                            r, w = update_chunks(chunks, buf, grads, state=self.state, scaling=self._scaling)
                            read, landed = read | r, landed | w
                    except BaseException:
                        # The pipeline hands the buffer back at once: no copy of an earlier group may be in flight.
                        copies.waited([read, landed])
                        raise
                    copying[id(unit)] = landed
                    unit_pass.done(unit, read)

                # Its last writes land while the caller goes on (the next forward); reading a unit back, a
                # checkpoint, state_dict() or close() waits for them.
                store.step(units, update, before_write)
        finally:
            # Units resident in host memory are never written: their copies back must land before the step
            # ends (and after a failure, before anyone reuses their buffers).
            copies.waited(copying.values())
        for s in updated:
            s.initialized = True
            self.state[s.param]["step"] += 1
        return updated

    def _note_weights(self) -> None:
        self._loads_checked = weight_loads()
        for g in self.param_groups:
            for p in g["params"]:
                s = store_of(p)
                if s is not None:
                    self._weights_seen[id(p)] = s.loads(p)

    def _check_weights(self) -> None:
        """Refuse to update a parameter whose offloaded weights were replaced from outside after its fp32
        master was made: the update would write the master's weights back over the ones loaded."""
        loads = weight_loads()
        if loads == self._loads_checked:
            return  # no weights were loaded anywhere since the last look: nothing per parameter to do
        store = self.state_store
        for g in self.param_groups:
            for p in g["params"]:
                s = store_of(p)
                if s is None or s.loads(p) == self._weights_seen.get(id(p), s.loads(p)):
                    continue
                slot = store.slot(p)
                has_master = ("master" in slot.keys and slot.initialized) if slot is not None \
                    else "master" in self.state.get(p, {})
                if not has_master:  # no master yet: it is made from the weights as they are now
                    self._weights_seen[id(p)] = s.loads(p)
                    continue
                raise StateError(
                    f"the weights of a {tuple(p.shape)} {str(p.dtype).removeprefix('torch.')} parameter were "
                    "replaced (load_parameters, load_safetensors) after this optimizer made its fp32 master copy "
                    "of them; the next update would write the old weights back over them. Load weights before "
                    "the first step (or build the optimizer after loading), or load a checkpoint of this "
                    "optimizer (load_checkpoint with model=), which restores both together.")
        self._loads_checked = loads

    def _overlap_slots(self) -> list:
        self._check_weights()  # before backward starts any update
        store = self.state_store
        return [store.slot(p) for g in self.param_groups for p in g["params"]
                if p.requires_grad and store.slot(p) is not None]

    def _refuse_in_overlap(self, closure) -> None:
        """What overlap_backward cannot honour, refused when first seen (the state is then failed: the
        updates of the backward just run used grads that were not meant to be stepped on as they were)."""
        if closure is not None:
            raise ValueError("step(closure) cannot be used with overlap_backward=True: the update runs during "
                             "backward; call loss.backward() yourself, then step()")
        if getattr(self, "grad_scale", None) is not None or getattr(self, "found_inf", None) is not None:
            self._refuse_scaler_in_overlap()

    def _refuse_scaler_in_overlap(self) -> None:
        err = StateError(
            "a GradScaler cannot be used with overlap_backward=True: the update ran during backward on the "
            "scaled gradients, before the scaler could unscale them or skip an inf step. Restore the state "
            "(load_checkpoint), then train without the GradScaler (bf16 autocast needs none) or without "
            "overlap_backward.")
        self._overlap.abandon(err)
        self.state_store.mark_failed(err)
        raise err

    def _grad_scaling(self, params: list, scale: Optional[torch.Tensor]) -> GradScaling:
        """What this step does to ``params``' grads. ``scale``: a GradScaler's, handed to step() (see
        _step_supports_amp_scaling). With max_grad_norm, the total norm of the grads (torch's
        clip_grad_norm_, bit for bit; norms taken during backward with overlap_backward) gives the factor
        they are multiplied by. Clipping needs unscaled grads: with a scale too, the grads are first
        multiplied by 1/scale as ``scaler.unscale_`` does, so the step is torch's ``unscale_``,
        ``clip_grad_norm_``, ``step`` bit for bit."""
        if self.max_grad_norm is None or not params:
            return GradScaling(kernel_scale=scale)
        unscaling = GradScaling(unscale=None if scale is None else scale.double().reciprocal().float())
        taken = self._overlap.norms() if self._overlap is not None else {}  # no GradScaler with overlap
        norms = []
        for p in params:
            norm = taken.get(id(p))
            if norm is None:
                g = unscaling.apply(self._access.grad(p))
                norm = grad_norm(g)
                del g  # one gradient of a grad store in memory at a time
            norms.append(norm)
        self.last_grad_norm = total_norm([p.grad for p in params], norms)
        return GradScaling(unscale=unscaling.unscale, clip=clip_coef(self.last_grad_norm, self.max_grad_norm))

class OffloadedAdamW(OffloadedAdam):
    """AdamW (decoupled weight decay) with optimizer state on NVMe; a drop-in for ``torch.optim.AdamW``.

    Same arguments as :class:`OffloadedAdam`, with ``weight_decay`` defaulting to 1e-2 as in torch.
    """

    _decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
                 **kwargs):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kwargs)
