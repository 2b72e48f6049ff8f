"""Weights on NVMe under FSDP2: each rank's local shards fetched ahead of FSDP2's all-gather, released after it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from .. import copies
from ..errors import StateError
from ..interrupts import deferring
from . import registry
from .holds import release_each, resident
from .store import ParamStore

__all__ = ["FSDP2_GRADS", "UPDATES_SHARDS", "Shard", "ShardHooks", "fsdp_shards"]

FSDP2_GRADS = (
    "offload_parameters under FSDP2 (fully_shard) keeps gradients in memory: FSDP2 reduce-scatters each gradient "
    "into a sharded DTensor of its own (1/N of the model's gradients per rank), which no hook of ours can move to "
    "NVMe. Pass offload_grads=False.")


@dataclass(eq=False)
class Shard:
    """One sharded parameter of FSDP2 on this rank: its ``FSDPParam``, the DTensor parameter the model and the
    optimizer hold, and ``held``, FSDP2's padded sharded buffer (``_sharded_param_data``, the storage of the
    DTensor's local tensor), the tensor the store holds."""

    fsdp_param: Any
    param: torch.Tensor
    held: torch.Tensor
    name: str


def _storage_id(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


# Set on the optimizer classes that update through offload.params.ParamAccess (OffloadedAdam/AdamW), which fetch
# each local shard for its update and write it back.
UPDATES_SHARDS = "_nvme_offload_updates_shards"


# NOTE: a released local shard is not guarded (FSDP2 needs its buffer to stay a plain tensor): its pages read as
# zeros. An optimizer that does not fetch it (torch.optim.AdamW) would update zeros and write to pages the next
# fetch overwrites: it would train nothing, silently. So one hook, on every optimizer's step, refuses a step of
# any other optimizer over such shards before it changes anything.
def _refuse_other_optimizers(optimizer, args, kwargs) -> None:
    if getattr(type(optimizer), UPDATES_SHARDS, False):
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            if registry.holder(p)[1] is not None and registry.store_of(p) is None:
                raise StateError(
                    f"{type(optimizer).__name__}.step() over parameters whose FSDP2 shards offload_parameters keeps on "
                    "NVMe: it would read and update released shards (zeros) and train nothing. Use "
                    "offload.OffloadedAdamW (or OffloadedAdam), which fetches each shard for its update, or call "
                    "restore_parameters(model) first")


_step_hook = None


def _watch_optimizers() -> None:
    """Install :func:`_refuse_other_optimizers` on every optimizer's step, once per process."""
    global _step_hook
    if _step_hook is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _step_hook = register_optimizer_step_pre_hook(_refuse_other_optimizers)


def fsdp_shards(model: nn.Module) -> Optional[list[tuple[Any, list[Shard]]]]:
    """``[(FSDP2 parameter group, its shards)]`` of a model sharded by ``fully_shard`` (``model`` its root), in
    the order FSDP2 initialised them; ``None`` for a model without DTensor parameters.

    Ends FSDP2's lazy initialisation (what the root's first forward does: which module is the root, the padding
    of the local shards), while the shards are still in memory.

    Raises:
        ValueError: DTensor parameters not all of FSDP2's (tensor parallelism), ``model`` not the root
            ``fully_shard`` module, or a layout whose sharded data FSDP2 reads elsewhere (``CPUOffloadPolicy``,
            ``fsdp_pre_all_gather`` tensor subclasses, meta parameters).
    """
    from ..distributed import is_dtensor

    if not any(is_dtensor(p) for p in model.parameters()):
        return None
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - every build this project supports has it
        FSDPModule = ()  # noqa: N806 - a class, as the import names it
    if not isinstance(model, FSDPModule):
        inner = any(isinstance(m, FSDPModule) for m in model.modules()) if FSDPModule else False
        raise ValueError(
            "offload_parameters takes DTensor parameters only from FSDP2: pass the root module that fully_shard "
            "wrapped last (fully_shard(model) after its layers), whose forward runs first"
            if inner else
            "offload_parameters cannot offload DTensor parameters other than FSDP2's (tensor parallelism, "
            "distribute_tensor): their layers gather and free weights themselves. Offload the optimizer state instead "
            "(OffloadedAdamW takes DTensor parameters); offload_parameters works with FSDP2 (fully_shard), DDP and "
            "single-process models.")
    state = model._get_fsdp_state()
    state._lazy_init()
    groups, seen = [], set()
    for st in state._state_ctx.all_states:
        for group in st._fsdp_param_groups:
            shards = []
            for fp in group.fsdp_params:
                seen.add(id(fp.sharded_param))
                name = f"'{fp._param_fqn}' (this rank's shard)"
                if fp.offload_to_cpu:
                    raise ValueError(f"parameter {name} is offloaded by FSDP2's own CPUOffloadPolicy: leave "
                                     "offload_policy out of fully_shard to put the weights on NVMe instead")
                if hasattr(fp._sharded_local_tensor, "fsdp_pre_all_gather"):
                    raise ValueError(f"parameter {name} is a tensor subclass with fsdp_pre_all_gather (float8 "
                                     "training, for instance), whose all-gather inputs FSDP2 takes from it rather than "
                                     "from the sharded buffer: such parameters cannot be offloaded")
                held = fp._sharded_param_data
                if held.is_meta:
                    raise ValueError(f"parameter {name} is on the meta device: materialise the model (to_empty, "
                                     "then initialise or load it) before offload_parameters")
                if held.numel() == 0:
                    continue
                shards.append(Shard(fp, fp.sharded_param, held, name))
            groups.append((group, shards))
    if any(is_dtensor(p) and id(p) not in seen for p in model.parameters()):
        raise ValueError("offload_parameters can offload DTensor parameters only where FSDP2 shards them: this model "
                         "mixes fully_shard with another DTensor layout (tensor parallelism). Offload the optimizer "
                         "state instead")
    return groups


# NOTE: FSDP2 reads a parameter's sharded data in one place: the all-gather's copy-in (``foreach_all_gather``,
# from ``FSDPParam._sharded_param_data``, cast to ``param_dtype`` with mixed precision), issued by
# ``FSDPParamGroup.unshard``. That runs from the group's pre-forward and pre-backward, from FSDP2's prefetches
# (the implicit one of the next group in backward, ``set_modules_to_forward_prefetch``/``..._backward_prefetch``)
# and from ``FSDPModule.unshard()``, and it is waited for by ``wait_for_unshard`` before the unsharded weights
# are used. FSDP2 has no hook around the all-gather (its one extension point there, a tensor subclass's
# ``fsdp_pre_all_gather``, replaces FSDP2's own copy-in and mixed-precision cast), so each group's ``unshard`` and
# ``wait_for_unshard`` are wrapped, as attributes of that group object: the wrapped unshard fetches the group's
# shards (those FSDP2 will read: in state SHARDED, an all-gather about to be issued) and calls FSDP2's; the
# wrapped wait releases them after FSDP2's wait, when the copy-in has completed on every stream. The store keeps
# the shards in FSDP2's own buffers (the same storage, its pages given back at a release), so every view FSDP2
# and the DTensor hold sees the fetched bytes. Whatever calls unshard, in whatever order, finds its shards in
# memory.
#
# Prefetch: the sequence of unshards between two calls of the root module is recorded once; afterwards each
# unshard that matches it starts reading the shards of the next ``prefetch`` groups, as the hooks of a plain
# model do with its submodules.
class ShardHooks:
    """The wrappers of FSDP2's unshard of every group of ``root``, and ``root``'s state dict hooks.

    Args:
        root: the root ``fully_shard`` module.
        store: the store holding the shards.
        prefetch: how many upcoming groups to read ahead for (0: none).
        groups: from :func:`fsdp_shards`.
    """

    def __init__(self, root: nn.Module, store: ParamStore, prefetch: int, groups: list):
        self.root = root
        self.store = store
        self.prefetch = prefetch
        self.groups = [(g, [s for s in shards if s.held in store.records]) for g, shards in groups]
        self.shards = [s for _, shards in self.groups for s in shards]
        # What the API's ParamOffload shows of the hooks of a plain model: no submodule fetches on its own.
        self.modules: list[nn.Module] = []
        self.params: list[list[torch.Tensor]] = []
        self.trace: list[int] = []
        self.order_changes = 0
        self._recording: list[int] = []
        self._pos = 0
        self._following = False
        self._pending: dict[int, list] = {}  # group index -> shards fetched for its all-gather, not yet released
        self._handles: list = []
        self._wrapped: list = []  # (object, attribute) set here
        for s in self.shards:
            registry.register_shard(s.param, s.held, store)
        _watch_optimizers()
        from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

        self._sharded = ShardedState.SHARDED
        for index, (group, shards) in enumerate(self.groups):
            if shards:
                self._wrap(group, "unshard", self._unshard(index, group.unshard))
                self._wrap(group, "wait_for_unshard", self._wait(index, group.wait_for_unshard))
        self._handles.append(root.register_forward_pre_hook(self._on_root_call, prepend=True))
        by_module: dict[int, tuple[nn.Module, list]] = {}
        for s in self.shards:
            module = s.fsdp_param._module_info.module
            by_module.setdefault(id(module), (module, []))[1].append(s)
        for module, mine in by_module.values():
            self._wrap(module, "_save_to_state_dict", self._save_wrapper(mine, module._save_to_state_dict))
            self._wrap(module, "_load_from_state_dict", self._load_wrapper(mine, module._load_from_state_dict))

    def _wrap(self, obj: Any, name: str, fn) -> None:
        setattr(obj, name, fn)
        self._wrapped.append((obj, name))

    def add_external(self, module: nn.Module, param: torch.Tensor) -> None:
        """FSDP2 gathers whatever a module uses in its group's all-gather: nothing to add."""

    def remove(self) -> None:
        """Take every wrapper and hook off, release what is still fetched for an all-gather."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for obj, name in self._wrapped:
            obj.__dict__.pop(name, None)
        self._wrapped.clear()
        for s in self.shards:
            registry.forget_shard(s.param, self.store)
        pending, self._pending = self._pending, {}
        release_each([h for held in pending.values() for h in held], self.store.release)

    # -- the all-gather -------------------------------------------------------------------------

    # FSDP2's own unshard and wait run outside ``deferring``: a Ctrl-C stops a collective that hangs. Fetches and
    # releases are held off it, each counted to be released.
    def _unshard(self, index: int, unshard):
        group = self.groups[index][0]

        def wrapped(async_op: bool = False):
            if group._all_gather_result is not None or group.is_unsharded:
                return unshard(async_op)  # FSDP2 issues nothing: it reads no shard
            try:
                self._fetch_for(index)
            except BaseException:
                self._release_pending(index)  # the shards fetched before the failure
                raise
            try:
                return unshard(async_op)
            finally:
                if group._all_gather_result is None:
                    self._release_pending(index)  # nothing was issued (or it failed): nothing reads them
        return wrapped

    @deferring
    def _fetch_for(self, index: int) -> None:
        """Fetch the shards of group ``index`` that FSDP2's all-gather about to be issued reads."""
        self._release_pending(index)  # an all-gather dropped unwaited (FSDP2 reset after an error)
        fetched = self._pending.setdefault(index, [])
        self._event(index)
        for s in self.groups[index][1]:
            if s.fsdp_param.sharded_state != self._sharded:
                continue  # SHARDED_POST_FORWARD: FSDP2 gathers its own resharded copy
            if _storage_id(s.fsdp_param._sharded_param_data) != _storage_id(s.held):
                raise StateError(
                    f"FSDP2 replaced the sharded data of {s.name} (load_state_dict or model.to() re-padded it), so "
                    "its weights on NVMe are no longer the ones FSDP2 gathers. Call offload_parameters after such "
                    "changes: restore_parameters(model), then offload again")
            self.store.fetch(s.held)
            fetched.append(s.held)
        self._order_copy_in(self.groups[index][0], fetched)

    @staticmethod
    def _order_copy_in(group: Any, fetched: list) -> None:
        """FSDP2 copies a group's shards in on a stream of its own (forward, pre-backward), which waits for the
        current stream only in the root's pre-forward, while a fetch orders only the current stream after its copy
        to the device: make that stream wait for the fetches too (nothing to wait for on the CPU)."""
        ticket = copies.produced(fetched)
        stream = getattr(group.comm_ctx, "all_gather_copy_in_stream", None)
        if not ticket.parts or stream is None:
            return
        with group.comm_ctx.device_handle.stream(stream):
            copies.after(ticket)

    def _wait(self, index: int, wait):
        def wrapped():
            try:
                return wait()
            finally:
                self._release_pending(index)  # the copy-in completed: the all-gather holds its own copy
        return wrapped

    @deferring
    def _release_pending(self, index: int) -> None:
        fetched = self._pending.pop(index, None)
        if fetched:
            release_each(fetched, self.store.release)

    # -- order and prefetch -------------------------------------------------------------------

    @deferring
    def _on_root_call(self, module, args) -> None:
        if self._following and self._pos != len(self.trace):
            self._following = False  # the last iteration stopped early: the order changed
            self.order_changes += 1
            self._recording = self.trace[:self._pos]
        if not self._following and self._recording:
            self.trace = self._recording
        self._recording = []
        self._pos = 0
        self._following = bool(self.trace)
        if self._following:
            self._prefetch_from(0)

    def _event(self, index: int) -> None:
        if self._following:
            if self._pos < len(self.trace) and self.trace[self._pos] == index:
                self._pos += 1
                self._prefetch_from(self._pos)
                return
            self._following = False
            self.order_changes += 1
            self._recording = self.trace[:self._pos]
        self._recording.append(index)

    def _prefetch_from(self, pos: int) -> None:
        for index in self.trace[pos:pos + self.prefetch]:
            for s in self.groups[index][1]:
                self.store.prefetch(s.held)

    # -- state dicts ----------------------------------------------------------------------------

    def _save_wrapper(self, mine: list, save):
        names = {s.fsdp_param._module_info.param_name for s in mine}
        held = [s.held for s in mine]

        def save_to_state_dict(destination, prefix, keep_vars):
            if keep_vars:  # the Parameters themselves, not their values
                return save(destination, prefix, keep_vars)
            with resident(held):
                save(destination, prefix, keep_vars)
                for name in names:
                    if prefix + name in destination:
                        # A DTensor over the shard's storage, about to be given back: keep a copy.
                        destination[prefix + name] = destination[prefix + name].clone()
        return save_to_state_dict

    def _load_wrapper(self, mine: list, load):
        held = [s.held for s in mine]

        def load_from_state_dict(*args, **kwargs):
            # Released whatever happens (an error, a Ctrl-C): a hook pair would leave them resident when the
            # load stops between the two.
            fetched: list = []
            try:
                self._fetch_all(held, fetched)
                return load(*args, **kwargs)
            finally:
                self._release_all(fetched, dirty=True)  # written back as they are, loaded in full or in part
        return load_from_state_dict

    @deferring
    def _fetch_all(self, held: list, fetched: list) -> None:
        for t in held:
            self.store.fetch(t)
            fetched.append(t)

    @deferring
    def _release_all(self, held: list, *, dirty: bool) -> None:
        release_each(held, lambda t: self.store.release(t, dirty=dirty))
