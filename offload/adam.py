"""OffloadedAdam and OffloadedAdamW: torch's Adam/AdamW with their state on NVMe.

# NOTE: these subclass torch.optim.Adam so that hyperparameter checks, param_groups, defaults,
# add_param_group, zero_grad and LR schedulers are torch's own. Only where the state lives changes:
# exp_avg, exp_avg_sq (max_exp_avg_sq with amsgrad, and an fp32 master copy of fp16/bf16 parameters)
# are packed into units on the swap space (offload/layout.py) and streamed through a fixed pool of
# host buffers by the swapper at each step. The update itself is torch's functional Adam
# (torch.optim.adam.adam) applied to views of the swapped-in buffers; Adam is element-wise, so
# updating a parameter chunk by chunk gives the same bits as updating it whole.
#
# Parameters with fewer than ``small_param_threshold`` elements keep their state in memory like
# torch's Adam does: a read and a write of a few KiB cost more than the memory they would save.
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import Any, Callable, Iterable, Optional

import torch
from torch.optim.adam import adam as _torch_adam

from .aio import wait_quietly
from .buffers import BufferPool
from .config import offload_config
from .errors import StateError
from .layout import Layout, ParamSlot
from .params.store import resident as _resident
from .params.store import store_of
from .space import SwapSpace
from .swapper import Swapper
from .units import ALIGNMENT, round_up

_FUSED_DEVICES = ("cpu", "cuda")


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
        buffer_count, buffer_size, pin_memory, pipeline_read, pipeline_write, small_param_threshold:
            override the ``offload_optimizer`` settings of ``config``.

    Host memory for offloaded state is the pool alone: ``buffer_count * buffer_size`` bytes,
    whatever the model size. Disk space for all state is reserved when the optimizer is built, so
    a full disk is reported here, not at step 4000.

    Raises:
        ValueError: a bad hyperparameter (as torch), or ``ConfigError`` for a bad setting.
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
    ):
        if capturable:
            raise ValueError("capturable=True is not supported by OffloadedAdam (state is not on the device)")
        if differentiable:
            raise ValueError("differentiable=True is not supported by OffloadedAdam")
        super().__init__(
            params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize, foreach=foreach,
            capturable=False, differentiable=False, fused=fused, decoupled_weight_decay=self._decoupled,
        )
        # GradScaler must unscale grads before step() and skip the step on inf, as for any optimizer:
        # the fused kernel's in-kernel unscaling would need grads and state on one device.
        self._step_supports_amp_scaling = False

        cfg = offload_config(
            config, "offload_optimizer", user=type(self).__name__, what="state",
            otherwise="or use torch.optim.Adam for state in memory",
            nvme_path=nvme_path, buffer_count=buffer_count, buffer_size=buffer_size, pin_memory=pin_memory,
            pipeline_read=pipeline_read, pipeline_write=pipeline_write, small_param_threshold=small_param_threshold,
        )
        oc = cfg.offload_optimizer
        self.config = cfg
        self._threshold = oc.small_param_threshold
        self._error: Optional[BaseException] = None

        for group in self.param_groups:
            for p in group["params"]:
                _check_param(p)

        self._pool = BufferPool(oc.buffer_count, oc.buffer_size, pin_memory=oc.pin_memory)
        self._layout = Layout(self._pool.buffer_size)
        units = self._layout.add(self._offload_candidates(self.param_groups, only_trainable=True))
        # Reserve the whole layout up front, so a full disk is reported here and not at step 4000.
        reserve = sum(round_up(u.nbytes, ALIGNMENT) for u in units)
        try:
            self._space = SwapSpace(oc.nvme_path, reserve, aio=cfg.aio, buffers=self._pool, name="adam")
        except BaseException:
            self._pool.close()
            raise
        self._swapper = Swapper(
            self._space, self._pool, pipeline_read=oc.pipeline_read, pipeline_write=oc.pipeline_write
        )
        self._allocate(units)
        # Host buffers that offloaded gradients (offload_parameters' grad store) are read into, sized
        # and made at the first step that needs them; a list, so the finalizer sees a later one.
        self._grad_pools: list = []
        self._finalizer = weakref.finalize(self, _release, self._space, self._pool, self._grad_pools)

    # -- what users call ---------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None):
        """Perform one optimization step; ``closure`` re-evaluates the model and returns the loss.

        Raises:
            StateError: an earlier step failed part-way; restore state with ``load_state_dict``.
            OSError: reading or writing state failed (the optimizer then refuses further steps).
        """
        self._check_usable()
        if self._error is not None:
            raise StateError(
                f"a previous step failed part-way ({self._error}); the offloaded state may be half "
                "written. Restore it with load_state_dict() (or load_checkpoint) before stepping again."
            ) from self._error
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        in_memory: list = []
        offloaded: list[ParamSlot] = []
        late = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                _check_grad(p)
                if self._is_small(p):
                    in_memory.append((group, p))
                else:
                    if p not in self._layout.slots:
                        late.append(p)
                    offloaded.append(p)
        if late:
            # Parameters that were frozen at construction and now have grads get their place.
            self._lay_out(self._offload_candidates(self.param_groups, restrict=set(late)))
        slots = [self._layout.slots[p] for p in offloaded]

        # Parameters whose weights live on NVMe (offload_parameters) are fetched for the update and
        # written back after it; ordinary parameters are untouched by this.
        with _resident([p for _, p in in_memory], dirty=True):
            self._step_in_memory(in_memory)
        if slots:
            try:
                self._step_offloaded(slots)
            except BaseException as err:
                self._error = err
                raise
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's; gradients held in a parameter grad store are dropped (or marked zero) too."""
        super().zero_grad(set_to_none)
        for group in self.param_groups:
            for p in group["params"]:
                store = store_of(p)
                if store is not None:
                    store.forget_grad(p)

    def add_param_group(self, param_group: dict) -> None:
        """Add a parameter group (as torch); its state gets space on the swap files at once."""
        super().add_param_group(param_group)
        if hasattr(self, "_layout"):
            for p in self.param_groups[-1]["params"]:
                _check_param(p)
            self._lay_out(self._offload_candidates(self.param_groups[-1:], only_trainable=True))

    def state_dict(self) -> dict:
        """The state in torch's layout: ``{"state": {index: {...}}, "param_groups": [...]}``.

        Offloaded state is read back into memory (one tensor per state entry, shaped like its
        parameter), so this needs host memory for the whole state. fp16/bf16 parameters also carry
        their fp32 master copy as ``"master"``.

        Raises:
            StateError: the last step failed part-way, so the offloaded state may be half written.
        """
        self._check_usable()
        if self._error is not None:
            raise StateError(
                f"a previous step failed part-way ({self._error}); its state may be half written and is not "
                "exported. Restore it with load_state_dict() or load_checkpoint() first."
            ) from self._error
        sd = super().state_dict()
        index = {}
        for i, p in enumerate(p for g in self.param_groups for p in g["params"]):
            index[p] = i
        for slot, tensors in self._read_all_state():
            entry = dict(tensors)
            entry["step"] = self.state[slot.param]["step"].clone()
            sd["state"][index[slot.param]] = entry
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Load state saved by this class or by ``torch.optim.Adam``/``AdamW``; clears a failed step.

        Raises:
            ValueError: the groups, parameter counts or state shapes do not match this optimizer.
        """
        groups = self.param_groups
        saved = state_dict["param_groups"]
        if len(groups) != len(saved):
            raise ValueError(
                f"loaded state dict has {len(saved)} parameter groups, this optimizer has {len(groups)}"
            )
        for i, (g, s) in enumerate(zip(groups, saved)):
            if len(g["params"]) != len(s["params"]):
                raise ValueError(
                    f"parameter group {i} has {len(g['params'])} parameters, the state dict's has "
                    f"{len(s['params'])}"
                )
        id_map = {
            old: p for s, g in zip(saved, groups) for old, p in zip(s["params"], g["params"])
        }
        for key, entry in state_dict["state"].items():
            if key not in id_map:
                raise ValueError(f"state dict has state for parameter {key}, which no group lists")
            p = id_map[key]
            for name, value in entry.items():
                if name != "step" and torch.is_tensor(value) and value.shape != p.shape:
                    raise ValueError(
                        f"state {name!r} of parameter {key} has shape {tuple(value.shape)}, the parameter "
                        f"has {tuple(p.shape)}"
                    )
        for i, (g, s) in enumerate(zip(groups, saved)):
            if bool(g["amsgrad"]) != bool(s.get("amsgrad", False)):
                raise ValueError(
                    f"parameter group {i}: the state dict's amsgrad is {s.get('amsgrad')}, this optimizer's is "
                    f"{g['amsgrad']}; the offloaded layout depends on it, so build the optimizer with the same value"
                )
        for g, s in zip(groups, saved):
            for k, v in s.items():
                if k != "params":
                    g[k] = v

        missing = {id_map[k] for k in state_dict["state"]
                   if not self._is_small(id_map[k]) and id_map[k] not in self._layout.slots}
        if missing:
            # Parameters frozen at construction get their place now, together, as step() does.
            self._lay_out(self._offload_candidates(self.param_groups, restrict=missing))
        self.state.clear()
        for slot in self._layout.slots.values():
            slot.initialized = False
        by_slot = {}
        for key, entry in state_dict["state"].items():
            p = id_map[key]
            step = entry.get("step", torch.tensor(0.0))
            step = torch.tensor(float(step), dtype=torch.float32) if not torch.is_tensor(step) else step
            if self._is_small(p):
                self.state[p] = _in_memory_state(p, entry, step)
            else:
                self.state[p] = {"step": step.detach().to("cpu", torch.float32).clone()}
                by_slot[self._layout.slots[p]] = entry
        try:
            self._write_all_state(by_slot)
        except BaseException as err:
            # Part of the state is written, the rest is stale: refuse to step until a load succeeds.
            self._error = err
            raise
        self._error = None

    def save_checkpoint(self, directory, *, model=None, extra=None) -> str:
        """Save the whole optimizer state to ``directory`` atomically, streaming it through the pool.

        Host memory stays bounded by the pool whatever the model size. ``model``'s weights are saved
        beside it (offloaded ones streamed through the parameter pool), and ``extra`` (for instance
        ``{"step": step}``). See :func:`offload.checkpoint.save_checkpoint`.
        """
        from .checkpoint import save_checkpoint

        return save_checkpoint(self, directory, model=model, extra=extra)

    def load_checkpoint(self, directory, *, model=None):
        """Restore state saved by :meth:`save_checkpoint` (checksums verified), and ``model``'s
        weights if given; returns its ``extra``. See :func:`offload.checkpoint.load_checkpoint`.
        """
        from .checkpoint import load_checkpoint

        return load_checkpoint(self, directory, model=model)

    def close(self) -> None:
        """Delete the swap files and free the pool. The optimizer cannot step afterwards."""
        self._finalizer()

    # -- introspection -----------------------------------------------------------------------

    @property
    def host_pool_bytes(self) -> int:
        """Host memory held for offloaded state (the pool)."""
        return self._pool.nbytes

    @property
    def grad_pool_bytes(self) -> int:
        """Host memory held for reading offloaded gradients (0 until a step needed it)."""
        return sum(p.nbytes for p in self._grad_pools)

    @property
    def offloaded_state_bytes(self) -> int:
        """Bytes of state stored on the swap space (all units)."""
        return self._layout.state_bytes

    @property
    def swap_space(self) -> SwapSpace:
        return self._space

    def io_bytes(self) -> tuple[int, int]:
        """(bytes read, bytes written) by the swapper since construction."""
        return self._swapper.bytes_read, self._swapper.bytes_written

    # -- the step ----------------------------------------------------------------------------

    def _kernel_flags(self, group: dict, device: torch.device) -> dict:
        fused = group["fused"]
        if fused is None:
            fused = device.type in _FUSED_DEVICES and not group["foreach"]
        return {"fused": bool(fused), "foreach": None if fused else group["foreach"]}

    def _adam(self, group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps) -> None:
        beta1, beta2 = group["betas"]
        _torch_adam(
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
            **self._kernel_flags(group, params[0].device),
            capturable=False, differentiable=False, grad_scale=None, found_inf=None,
            has_complex=False, decoupled_weight_decay=group["decoupled_weight_decay"],
            amsgrad=group["amsgrad"], beta1=beta1, beta2=beta2, lr=group["lr"],
            weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
        )

    def _step_in_memory(self, items) -> None:
        by_group: dict[int, list] = {}
        for group, p in items:
            by_group.setdefault(id(group), [group, []])[1].append(p)
        for group, params in by_group.values():
            lists = [[], [], [], [], []]
            for p in params:
                st = self.state[p]
                if len(st) == 0:
                    fused = self._kernel_flags(group, p.device)["fused"]
                    st["step"] = (torch.zeros((), dtype=torch.float32, device=p.device) if fused
                                  else torch.tensor(0.0, dtype=torch.float32))
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    if group["amsgrad"]:
                        st["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if self._kernel_flags(group, p.device)["fused"] and st["step"].device != p.device:
                    st["step"] = st["step"].to(p.device)
                store = store_of(p)
                # A gradient in the grad store is read whole: these parameters are small.
                lists[0].append(store.load_grad(p) if store is not None and store.holds_grad(p) else p.grad)
                lists[1].append(st["exp_avg"])
                lists[2].append(st["exp_avg_sq"])
                if group["amsgrad"]:
                    lists[3].append(st["max_exp_avg_sq"])
                lists[4].append(st["step"])
            self._adam(group, params, *lists)

    def _step_offloaded(self, slots: list[ParamSlot]) -> None:
        active = {id(s) for s in slots}
        for s in slots:
            st = self.state[s.param]
            if "step" not in st:
                st["step"] = torch.tensor(0.0, dtype=torch.float32)
        units = [u for u in self._layout.units if any(id(c.slot) in active for c in u.chunks)]

        def needs_read(unit) -> bool:
            return any(c.slot.initialized for c in unit.chunks)

        # Weights on NVMe (offload_parameters): a parameter is fetched at its first chunk and written
        # back at its last, so about one unit's worth of them is resident at a time. With an fp32
        # master copy already on disk the old weights are not read: the update rewrites all of them.
        held: dict = {}
        position = {id(u): i for i, u in enumerate(units)}
        # Offloaded gradients: each unit's are read into a grad buffer ahead of its update, as far
        # ahead as the swapper reads the state.
        grads = _GradReader(units, active, self._grad_pool_for, self._swapper.lookahead)

        def update(unit, buf) -> bool:
            # Start reading the next unit's weights while this one is updated (never waits for a buffer).
            i = position[id(unit)]
            grad_views = grads.begin(i)
            for c in units[i + 1].chunks if i + 1 < len(units) else ():
                store = store_of(c.slot.param)
                if store is not None and id(c.slot) in active and c.slot not in held and not (
                        "master" in c.slot.keys and c.slot.initialized):
                    store.prefetch(c.slot.param)
            by_group: dict[int, list] = {}
            for c in unit.chunks:
                if id(c.slot) in active:
                    by_group.setdefault(id(c.slot.group), []).append(c)
                    store = store_of(c.slot.param)
                    if store is not None and c.slot not in held:
                        store.fetch(c.slot.param, read=not ("master" in c.slot.keys and c.slot.initialized))
                        held[c.slot] = store
            devices = set()
            for chunks in by_group.values():
                devices |= self._update_chunks(chunks, buf, grad_views)
            for dev in devices:
                # The state copied back from the device must be in the buffer before the swapper writes
                # it: one wait per unit, after every group's copies are queued.
                torch.cuda.current_stream(dev).synchronize()
            for c in unit.chunks:
                if c.slot in held and c is c.slot.chunks[-1]:
                    held.pop(c.slot).release(c.slot.param, dirty=True)
            return True

        try:
            self._swapper.run(units, update, needs_read=needs_read)
        finally:
            grads.close()
            for slot, store in held.items():
                store.release(slot.param, dirty=True)
        for s in slots:
            s.initialized = True
            self.state[s.param]["step"] += 1

    def _grad_pool_for(self, count: int, size: int) -> BufferPool:
        """A pool of at least ``count`` buffers of ``size`` bytes for offloaded gradients (kept for later steps)."""
        if self._grad_pools:
            pool = self._grad_pools[0]
            if len(pool) >= count and pool.buffer_size >= size:
                return pool
            pool.close()
            self._grad_pools.clear()
        pool = BufferPool(count, size, pin_memory=self.config.offload_optimizer.pin_memory)
        self._grad_pools.append(pool)
        return pool

    def _update_chunks(self, chunks, buf, grad_views=None) -> set:
        """Update ``chunks`` (one group's) in ``buf``; returns the CUDA devices whose copies back to
        ``buf`` are queued and must be waited for before the buffer is written."""
        group = chunks[0].slot.group
        amsgrad = group["amsgrad"]
        params, grads, m, v, vmax, steps, writeback = [], [], [], [], [], [], []
        for c in chunks:
            slot = c.slot
            p = slot.param
            lo, hi = c.start, c.start + c.numel
            flat_p = p.detach().view(-1)[lo:hi]
            flat_g = grad_views.get(c) if grad_views else None
            if flat_g is None:
                flat_g = p.grad.reshape(-1)[lo:hi]
            elif flat_g.device != p.device:
                flat_g = flat_g.to(p.device, non_blocking=True)
            exp_avg, exp_avg_sq = c.slice(buf, "exp_avg"), c.slice(buf, "exp_avg_sq")
            max_sq = c.slice(buf, "max_exp_avg_sq") if amsgrad else None
            master = c.slice(buf, "master") if "master" in slot.keys else None
            if not slot.initialized:
                exp_avg.zero_()
                exp_avg_sq.zero_()
                if max_sq is not None:
                    max_sq.zero_()
                if master is not None:
                    master.copy_(flat_p)
            target = master if master is not None else flat_p
            grad = flat_g if flat_g.dtype == target.dtype else flat_g.to(target.dtype)
            dev = p.device
            if dev.type != "cpu":
                # State crosses to the parameter's device through the (pinned) pool buffer.
                exp_avg_d, exp_avg_sq_d = exp_avg.to(dev, non_blocking=True), exp_avg_sq.to(dev, non_blocking=True)
                max_sq_d = max_sq.to(dev, non_blocking=True) if max_sq is not None else None
                target_d = target.to(dev, non_blocking=True) if master is not None else target
                writeback.append((exp_avg, exp_avg_d))
                writeback.append((exp_avg_sq, exp_avg_sq_d))
                if max_sq is not None:
                    writeback.append((max_sq, max_sq_d))
                if master is not None:
                    writeback.append((master, target_d))
                exp_avg, exp_avg_sq, max_sq, target = exp_avg_d, exp_avg_sq_d, max_sq_d, target_d
            params.append(target)
            grads.append(grad)
            m.append(exp_avg)
            v.append(exp_avg_sq)
            if amsgrad:
                vmax.append(max_sq)
            step = self.state[p]["step"]
            # A copy per chunk: the kernel increments it, and a parameter may span several chunks.
            # non_blocking: a blocking copy would wait for every state copy queued before it.
            steps.append(step.to(dev, copy=True, non_blocking=True) if self._kernel_flags(group, dev)["fused"]
                         else step.clone())
        self._adam(group, params, grads, m, v, vmax, steps)
        for c, target in zip(chunks, params):
            if "master" in c.slot.keys:
                c.slot.param.detach().view(-1)[c.start:c.start + c.numel].copy_(target)
        for host, dev_t in writeback:
            host.copy_(dev_t, non_blocking=True)
        return {dev_t.device for _, dev_t in writeback}

    # -- materialising state -----------------------------------------------------------------

    def _read_all_state(self):
        """Yield ``(slot, {key: tensor shaped like the parameter})`` for every initialized slot."""
        wanted = [s for s in self._layout.slots.values() if s.initialized]
        if not wanted:
            return
        out = {}
        for s in wanted:
            out[s] = {k: torch.empty(s.param.shape, dtype=s.dtype) for k in s.keys}
        units = [u for u in self._layout.units if any(c.slot.initialized for c in u.chunks)]

        def copy_out(unit, buf) -> bool:
            for c in unit.chunks:
                if c.slot in out:
                    for k in c.slot.keys:
                        out[c.slot][k].view(-1)[c.start:c.start + c.numel].copy_(c.slice(buf, k))
            return False

        self._swapper.run(units, copy_out)
        for s in wanted:
            tensors = out[s]
            if s.param.device.type != "cpu":
                tensors = {k: t.to(s.param.device) for k, t in tensors.items()}
            yield s, tensors

    def _write_all_state(self, by_slot: dict) -> None:
        if not by_slot:
            return
        units = [u for u in self._layout.units if any(c.slot in by_slot for c in u.chunks)]

        def copy_in(unit, buf) -> bool:
            for c in unit.chunks:
                entry = by_slot.get(c.slot)
                if entry is None:
                    continue
                for k in c.slot.keys:
                    view = c.slice(buf, k)
                    if k == "master":
                        src = entry.get("master")
                        src = c.slot.param.detach() if src is None else src
                    elif k in entry:
                        src = entry[k]
                    else:
                        view.zero_()
                        continue
                    view.copy_(src.detach().reshape(-1)[c.start:c.start + c.numel])
            return True

        # Units also holding chunks of other initialized parameters must keep their bytes.
        # A master copy made from the weights needs them resident if they live on NVMe.
        seeds = [s.param for s, e in by_slot.items() if "master" in s.keys and e.get("master") is None]
        with _resident(seeds, dirty=False):
            self._swapper.run(units, copy_in, needs_read=lambda u: any(
                c.slot.initialized and c.slot not in by_slot for c in u.chunks))
        for slot in by_slot:
            slot.initialized = True

    # -- layout ------------------------------------------------------------------------------

    def _is_small(self, p: torch.Tensor) -> bool:
        return p.numel() < self._threshold

    def _offload_candidates(self, groups, *, only_trainable: bool = False, restrict=None):
        out = []
        for g in groups:
            for p in g["params"]:
                if self._is_small(p) or (only_trainable and not p.requires_grad):
                    continue
                if restrict is not None and p not in restrict:
                    continue
                out.append((p, g, bool(g["amsgrad"])))
        return out

    def _lay_out(self, candidates) -> None:
        self._allocate(self._layout.add(candidates))

    def _allocate(self, units) -> None:
        for unit in units:
            unit.extent = self._space.alloc(unit.nbytes)

    def _check_usable(self) -> None:
        if not self._finalizer.alive:
            raise ValueError("the optimizer is closed")


class OffloadedAdamW(OffloadedAdam):
    """AdamW (decoupled weight decay) with optimizer state on NVMe; a drop-in for ``torch.optim.AdamW``.

    Same arguments as :class:`OffloadedAdam`, with ``weight_decay`` defaulting to 1e-2 as in torch.
    """

    _decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
                 **kwargs):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kwargs)


# -- helpers ------------------------------------------------------------------------------------


def _release(space, pool, grad_pools) -> None:
    space.close()
    pool.close()
    for p in grad_pools:
        p.close()
    grad_pools.clear()


class _GradReader:
    """Reads each unit's offloaded gradients (one request per chunk) into a buffer, ahead of its update.

    ``begin(i)`` hands back the buffer of unit ``i - 1``, issues the reads of the units up to
    ``i + ahead`` that buffers allow, waits for unit ``i``'s and returns ``{chunk: gradient view}``.
    """

    def __init__(self, units, active, make_pool, ahead: int):
        self.plans = []
        size = 0
        for u in units:
            plan, need = [], 0
            for c in u.chunks:
                store = store_of(c.slot.param)
                if id(c.slot) in active and store is not None and store.holds_grad(c.slot.param):
                    align = store.space.alignment
                    need = -(-need // align) * align + store.grad_span(c.slot.param, c.start, c.start + c.numel)
                    plan.append((c, store))
            self.plans.append(plan)
            size = max(size, need)
        self.active = size > 0
        self.ahead = ahead
        self.free: deque = deque(make_pool(ahead + 1, size) if self.active else ())
        self.pending: dict = {}  # unit index -> (buffer, [(chunk, GradRead)])
        self.in_use = None
        self.next = 0

    def _issue(self, i: int) -> None:
        buf = self.free.popleft()
        reads, offset = [], 0
        try:
            for c, store in self.plans[i]:
                align = store.space.alignment
                offset = -(-offset // align) * align
                read, span = store.read_grad(c.slot.param, c.start, c.start + c.numel, buf, offset)
                reads.append((c, read))
                offset += span
        finally:
            self.pending[i] = (buf, reads)

    def begin(self, i: int) -> dict:
        if not self.active:
            return {}
        if self.in_use is not None:
            self.free.append(self.in_use)
            self.in_use = None
        while self.next < len(self.plans) and self.next <= i + self.ahead and self.free:
            self._issue(self.next)
            self.next += 1
        buf, reads = self.pending.pop(i)
        self.in_use = buf
        return {c: read.wait() for c, read in reads}

    def close(self) -> None:
        """Let every read still in flight land (the buffers are reused by the next step)."""
        for _, reads in self.pending.values():
            wait_quietly(read for _, read in reads)
        self.pending.clear()


def _check_param(p: torch.Tensor) -> None:
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"optimizer parameters must be tensors, got {type(p).__name__}")
    if p.is_complex():
        raise ValueError("complex parameters are not supported by OffloadedAdam; use torch.view_as_real")
    if not p.is_floating_point():
        raise ValueError(f"parameters must be floating point, got {p.dtype}")
    if not p.is_contiguous():
        raise ValueError(
            f"parameter of shape {tuple(p.shape)} is not contiguous; offloaded state is stored flat, so "
            "make the parameter contiguous (p.data = p.data.contiguous()) before building the optimizer"
        )


def _check_grad(p: torch.Tensor) -> None:
    if p.grad.is_sparse:
        raise RuntimeError("OffloadedAdam does not support sparse gradients; consider torch.optim.SparseAdam")
    if p.grad.is_complex():
        raise RuntimeError("complex gradients are not supported by OffloadedAdam")


def _in_memory_state(p: torch.Tensor, entry: dict, step: torch.Tensor) -> dict:
    st = {"step": step.detach().to("cpu", torch.float32).clone()}
    for k, v in entry.items():
        if k in ("step", "master"):
            continue
        st[k] = v.detach().to(device=p.device, dtype=p.dtype).clone() if torch.is_tensor(v) else v
    return st
