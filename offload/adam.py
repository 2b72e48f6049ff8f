"""OffloadedAdam and OffloadedAdamW: torch's Adam/AdamW with their state on NVMe."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Iterable, Optional

import torch
from torch.optim.adam import adam as _torch_adam

from .checkpoint import load_checkpoint, save_checkpoint
from .config import offload_config
from .params import ParamAccess
from .state import HALF_DTYPES, ParamSlot, StateStore, check_state_dict, in_memory_state, step_tensor

__all__ = ["OffloadedAdam", "OffloadedAdamW"]

_FUSED_DEVICES = ("cpu", "cuda")


# NOTE: these subclass torch.optim.Adam so that hyperparameter checks, param_groups, defaults,
# add_param_group, zero_grad and LR schedulers are torch's own. Only where the state lives changes:
# exp_avg, exp_avg_sq (max_exp_avg_sq with amsgrad, and an fp32 master copy of fp16/bf16 parameters)
# live in units of a StateStore, streamed through its pool of host buffers at each step. The update
# itself is torch's functional Adam (torch.optim.adam.adam) on views of the swapped-in buffers; Adam
# is element-wise, so updating a parameter chunk by chunk gives the same bits as updating it whole.
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
            files. Required here or in ``config``.
        config: a path to a JSON file, a dict, or a :class:`offload.config.Config`; a whole
            DeepSpeed ``ds_config.json`` works (its ``aio`` and ``zero_optimization.offload_optimizer``
            blocks are used).
        device, buffer_count, buffer_size, pin_memory, pipeline_read, pipeline_write,
        small_param_threshold, host_cache, state_dtype, checksum: override the ``offload_optimizer``
            settings of ``config`` (see :class:`offload.config.OptimizerOffloadConfig`): ``device="cpu"``
            keeps all state in host memory; ``host_cache`` keeps that many bytes of it (or ``"auto"``)
            resident between steps; ``state_dtype="bf16"`` stores the moments in bf16.

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
    ):
        if capturable:
            raise ValueError("capturable=True is not supported by OffloadedAdam (state is not on the device)")
        if differentiable:
            raise ValueError("differentiable=True is not supported by OffloadedAdam")
        with _no_duplicate_warning():  # refused below, with a message of our own
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
        )
        _check_params(self.param_groups)
        self.state_store = StateStore(self.state, self.param_groups, self.config)
        try:
            self.state_store.place(self.param_groups, trainable_only=True)
            self.state_store.size_cache()
        except BaseException:
            self.state_store.close()
            raise
        self._access = ParamAccess(pin_memory=self.state_store.pin_memory)

    # -- what users call ---------------------------------------------------------------------

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """Whether a GradScaler may hand its scale to step() (torch's fused kernel unscales and skips inf
        steps itself): as torch's, when every group uses the fused kernel. Then fp16 parameters work with
        a GradScaler, their grads unscaled against the fp32 master; otherwise the scaler unscales the
        grads first, as for any optimizer (and refuses fp16 ones, as torch does)."""
        return all(self._kernel_flags(g, p.device)["fused"] for g in self.param_groups for p in g["params"])

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
        store.check_usable("step")
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
        self._grad_scale = getattr(self, "grad_scale", None)

        in_memory, offloaded = [], []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                _check_grad(p)
                (in_memory if store.is_small(p) else offloaded).append((group, p))
        late = {p for _, p in offloaded if store.slot(p) is None}
        if late:
            # Parameters that were frozen at construction and now have grads get their place.
            store.place(self.param_groups, only=late)

        # Parameters whose weights live on NVMe (offload_parameters) are fetched for the update and
        # written back after it; ordinary parameters are untouched by this.
        with self._access.resident([p for _, p in in_memory], dirty=True):
            self._step_in_memory(in_memory)
        if offloaded:
            try:
                self._step_offloaded([store.slot(p) for _, p in offloaded])
            except BaseException as err:
                store.failed(err)
                raise
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's; gradients held in a parameter grad store are dropped (or marked zero) too."""
        super().zero_grad(set_to_none)
        self._access.forget_grads(p for g in self.param_groups for p in g["params"])

    def add_param_group(self, param_group: dict) -> None:
        """Add a parameter group (as torch); its state gets space on the swap files at once.

        Raises:
            ValueError: a parameter is already in a group (or listed twice), or is not a usable tensor.
            OSError: the disk cannot hold the new state; the optimizer keeps its groups and state as before.
        """
        with _no_duplicate_warning():
            super().add_param_group(param_group)
        if hasattr(self, "state_store"):
            try:
                _check_params(self.param_groups)
                self.state_store.place(self.param_groups[-1:], trainable_only=True)
            except BaseException:
                self.param_groups.pop()
                raise

    def state_dict(self) -> dict:
        """The state in torch's layout: ``{"state": {index: {...}}, "param_groups": [...]}``.

        Offloaded state is read back into memory (one tensor per state entry, shaped like its
        parameter), so this needs host memory for the whole state. fp16/bf16 parameters also carry
        their fp32 master copy as ``"master"``.

        Raises:
            StateError: the last step failed part-way, so the offloaded state may be half written.
        """
        self.state_store.check_usable("export the state")
        sd = super().state_dict()
        index = {p: i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        for slot, tensors in self.state_store.read_state():
            entry = {k: t.to(slot.param.device) for k, t in tensors.items()}
            entry["step"] = self.state[slot.param]["step"].clone()
            sd["state"][index[slot.param]] = entry
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Load state saved by this class or by ``torch.optim.Adam``/``AdamW``; clears a failed step.

        Raises:
            ValueError: the groups, parameter counts or state shapes do not match this optimizer.
        """
        store = self.state_store
        if store.closed:
            raise ValueError("the optimizer is closed")
        params = check_state_dict(self.param_groups, state_dict)
        for g, s in zip(self.param_groups, state_dict["param_groups"]):
            g.update({k: v for k, v in s.items() if k != "params"})
        entries = {params[k]: entry for k, entry in state_dict["state"].items()}
        late = {p for p in entries if not store.is_small(p) and store.slot(p) is None}
        if late:
            store.place(self.param_groups, only=late)  # frozen at construction: placed now, together
        self.state.clear()
        for slot in store.layout.slots.values():
            slot.initialized = False
        by_slot = {}
        for p, entry in entries.items():
            if store.is_small(p):
                # An fp32 master missing from it is seeded from the weights (fetched if they are offloaded).
                with self._access.resident([p] if p.dtype in HALF_DTYPES and "master" not in entry else []):
                    self.state[p] = in_memory_state(p, entry)
            else:
                self.state[p] = {"step": step_tensor(entry.get("step", 0.0))}
                by_slot[store.slot(p)] = entry
        units = store.units_of(by_slot)
        with self._access.units(units, {id(s) for s in by_slot}, write_back=False) as unit_pass:
            # A master copy made from weights on NVMe needs them resident, one unit's worth at a time.
            store.write_state(by_slot, master_from=unit_pass.weights, after_unit=unit_pass.done)
        store.restored()

    def save_checkpoint(self, directory, *, model=None, extra=None) -> str:
        """Save the whole optimizer state to ``directory`` atomically, streaming it through the pool.

        Host memory stays bounded by the pool whatever the model size. ``model``'s weights are saved
        beside it (offloaded ones streamed through the parameter pool), and ``extra`` (for instance
        ``{"step": step}``). See :func:`offload.checkpoint.save_checkpoint`.
        """
        return save_checkpoint(self, directory, model=model, extra=extra)

    def load_checkpoint(self, directory, *, model=None):
        """Restore state saved by :meth:`save_checkpoint` (checksums verified), and ``model``'s
        weights if given; returns its ``extra``. See :func:`offload.checkpoint.load_checkpoint`.
        """
        return load_checkpoint(self, directory, model=model)

    def __getstate__(self):
        raise TypeError(
            f"an {type(self).__name__} cannot be pickled or deep-copied: it owns swap files, a pool of host "
            "buffers and I/O threads. Save its state with save_checkpoint() (or state_dict()) and load it into "
            "a new optimizer with load_checkpoint() (or load_state_dict()).")

    def __deepcopy__(self, memo):
        self.__getstate__()

    def close(self) -> None:
        """Delete the swap files and free the pools. The optimizer cannot step afterwards."""
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

    def _kernel_flags(self, group: dict, device: torch.device) -> dict:
        fused = group["fused"]
        if fused is None:
            fused = device.type in _FUSED_DEVICES and not group["foreach"]
        return {"fused": bool(fused), "foreach": None if fused else group["foreach"]}

    def _adam(self, group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps) -> None:
        beta1, beta2 = group["betas"]
        dev = params[0].device
        scale = getattr(self, "_grad_scale", None)
        scale = scale.to(dev) if scale is not None else None
        _torch_adam(
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
            **self._kernel_flags(group, dev),
            capturable=False, differentiable=False, grad_scale=scale,
            found_inf=torch.zeros((), dtype=torch.float32, device=dev) if scale is not None else None,
            has_complex=False, decoupled_weight_decay=group["decoupled_weight_decay"],
            amsgrad=group["amsgrad"], beta1=beta1, beta2=beta2, lr=group["lr"],
            weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
        )

    def _step_in_memory(self, items) -> None:
        by_group: dict[int, list] = {}
        for group, p in items:
            by_group.setdefault(id(group), [group, []])[1].append(p)
        for group, params in by_group.values():
            targets, lists = [], [[], [], [], [], []]
            for p in params:
                st = self.state[p]
                fused = self._kernel_flags(group, p.device)["fused"]
                half = p.dtype in HALF_DTYPES
                if len(st) == 0:
                    st["step"] = (torch.zeros((), dtype=torch.float32, device=p.device) if fused
                                  else torch.tensor(0.0, dtype=torch.float32))
                    if half:
                        # Every fp16/bf16 parameter has an fp32 master, small ones too: their small updates
                        # would otherwise round away, and they would drift from the large ones.
                        st["master"] = p.detach().float().clone(memory_format=torch.preserve_format)
                    for key in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ()):
                        st[key] = torch.zeros_like(st["master"] if half else p, memory_format=torch.preserve_format)
                if fused and st["step"].device != p.device:
                    st["step"] = st["step"].to(p.device)
                grad = self._access.grad(p)  # read whole from a grad store: these are small
                targets.append(st["master"] if half else p)
                lists[0].append(grad.float() if half else grad)
                lists[1].append(st["exp_avg"])
                lists[2].append(st["exp_avg_sq"])
                if group["amsgrad"]:
                    lists[3].append(st["max_exp_avg_sq"])
                lists[4].append(st["step"])
            self._adam(group, targets, *lists)
            for p, target in zip(params, targets):
                if target is not p:
                    p.detach().copy_(target)

    def _step_offloaded(self, slots: list[ParamSlot]) -> None:
        store = self.state_store
        active = {id(s) for s in slots}
        for s in slots:
            self.state[s.param].setdefault("step", torch.tensor(0.0, dtype=torch.float32))
        units = store.step_order(store.units_of(slots))
        # With an fp32 master copy on disk the old weights are not read: the update rewrites all of them.
        has_master = lambda slot: "master" in slot.keys and slot.initialized  # noqa: E731
        copying: dict[int, set] = {}  # id(unit) -> CUDA devices still copying state back into its buffer

        def before_write(unit) -> None:
            # The state copied back from the device must be in the buffer before it is written.
            for dev in copying.pop(id(unit), ()):
                torch.cuda.current_stream(dev).synchronize()

        with self._access.units(units, active) as unit_pass:
            def update(unit, buf) -> bool:
                grads = unit_pass.grads(unit)
                unit_pass.fetch(unit, skip_read=has_master)
                by_group: dict[int, list] = {}
                for c in unit.chunks:
                    if id(c.slot) in active:
                        by_group.setdefault(id(c.slot.group), []).append(c)
                devices = set()
                for chunks in by_group.values():
                    devices |= self._update_chunks(chunks, buf, grads)
                if devices:
                    copying[id(unit)] = devices
                unit_pass.done(unit)
                return True

            # Its last writes land while the caller goes on (the next forward); reading a unit back, a
            # checkpoint, state_dict() or close() waits for them.
            store.run(units, update, needs_read=lambda u: any(c.slot.initialized for c in u.chunks),
                      before_write=before_write, settle=True, drain=False)
        # Units resident in host memory were never written: their copies back must land before the step ends.
        for dev in set().union(*copying.values()) if copying else ():
            torch.cuda.current_stream(dev).synchronize()
        for s in slots:
            s.initialized = True
            self.state[s.param]["step"] += 1

    def _update_chunks(self, chunks, buf, grad_views: dict) -> set:
        """Update ``chunks`` (one group's) in ``buf``; returns the CUDA devices whose copies back to
        ``buf`` are queued and must be waited for before the buffer is written."""
        group = chunks[0].slot.group
        amsgrad = group["amsgrad"]
        params, grads, m, v, vmax, steps = [], [], [], [], [], []
        writeback, narrow = [], []  # (host view, device tensor); (bf16 moment, its fp32 working copy)
        for c in chunks:
            p = c.slot.param
            lo, hi = c.start, c.start + c.numel
            flat_p = p.detach().view(-1)[lo:hi]
            flat_g = grad_views.get(c)
            if flat_g is None:
                flat_g = p.grad.reshape(-1)[lo:hi]
            elif flat_g.device != p.device:
                flat_g = flat_g.to(p.device, non_blocking=True)
            state = {k: c.slice(buf, k) for k in c.slot.keys}
            if not c.slot.initialized:
                for k, t in state.items():
                    if k == "master":
                        t.copy_(flat_p)
                    else:
                        t.zero_()
            dev = p.device
            if dev.type != "cpu":
                # State crosses to the parameter's device through the (pinned) buffer.
                on_dev = {k: t.to(dev, non_blocking=True) for k, t in state.items()}
                writeback.extend((state[k], on_dev[k]) for k in state)
                state = on_dev
            for k in [k for k in state if k != "master" and state[k].dtype == torch.bfloat16]:
                # Narrow state (state_dtype "bf16"): computed in fp32, rounded to nearest when stored.
                wide = state[k].float()
                narrow.append((state[k], wide))
                state[k] = wide
            master = state.get("master")
            target = master if master is not None else flat_p
            params.append(target)
            grads.append(flat_g if flat_g.dtype == target.dtype else flat_g.to(target.dtype))
            m.append(state["exp_avg"])
            v.append(state["exp_avg_sq"])
            if amsgrad:
                vmax.append(state["max_exp_avg_sq"])
            step = self.state[p]["step"]
            # A copy per chunk: the kernel increments it, and a parameter may span several chunks.
            # non_blocking: a blocking copy would wait for every state copy queued before it.
            steps.append(step.to(dev, copy=True, non_blocking=True) if self._kernel_flags(group, dev)["fused"]
                         else step.clone())
        self._adam(group, params, grads, m, v, vmax, steps)
        for stored, wide in narrow:
            stored.copy_(wide)
        for c, target in zip(chunks, params):
            if "master" in c.slot.keys:
                c.slot.param.detach().view(-1)[c.start:c.start + c.numel].copy_(target)
        for host, dev_t in writeback:
            host.copy_(dev_t, non_blocking=True)
        return {dev_t.device for _, dev_t in writeback}


class OffloadedAdamW(OffloadedAdam):
    """AdamW (decoupled weight decay) with optimizer state on NVMe; a drop-in for ``torch.optim.AdamW``.

    Same arguments as :class:`OffloadedAdam`, with ``weight_decay`` defaulting to 1e-2 as in torch.
    """

    _decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
                 **kwargs):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kwargs)


@contextlib.contextmanager
def _no_duplicate_warning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*duplicate parameters", category=UserWarning)
        yield


def _check_params(groups: list[dict]) -> None:
    """Every parameter usable for offloaded state, and listed once across all groups."""
    seen: set = set()
    for gi, group in enumerate(groups):
        for p in group["params"]:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"optimizer parameters must be tensors, got {type(p).__name__}")
            if id(p) in seen:
                raise ValueError(
                    f"a parameter of shape {tuple(p.shape)} is listed twice (again in group {gi}); its state would "
                    "be updated once and its step counted twice. List each parameter once.")
            seen.add(id(p))
            if p.is_complex():
                raise ValueError("complex parameters are not supported by OffloadedAdam; use torch.view_as_real")
            if not p.is_floating_point():
                raise ValueError(f"parameters must be floating point, got {p.dtype}")
            if p.device.type == "meta":
                raise ValueError(
                    f"a parameter of shape {tuple(p.shape)} is on the meta device (it has no data); materialise the "
                    "model (e.g. model.to_empty(device=...) and initialise it) before building the optimizer")
            if not p.is_contiguous():
                raise ValueError(
                    f"parameter of shape {tuple(p.shape)} is not contiguous; offloaded state is stored flat, so "
                    "make the parameter contiguous (p.data = p.data.contiguous()) before building the optimizer")


def _check_grad(p: torch.Tensor) -> None:
    if p.grad.is_sparse:
        raise RuntimeError("OffloadedAdam does not support sparse gradients; consider torch.optim.SparseAdam")
    if p.grad.is_complex():
        raise RuntimeError("complex gradients are not supported by OffloadedAdam")
