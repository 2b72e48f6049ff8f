"""Module hooks that fetch a submodule's parameters around its forward and backward, and prefetch."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..errors import ConfigError
from ..interrupts import deferring
from .holds import release_each, resident
from .store import ParamStore
from .turn import BACKWARD, FORWARD, Turn

_EXTERNAL = "_nvme_external_params"  # a module's declared external parameters (a list)

DDP_GRADS = (
    "DistributedDataParallel cannot reduce gradients that offload_parameters moves to NVMe "
    "(offload_grads=True): it copies each gradient into its own buckets and copies the all-reduced values "
    "back into p.grad, where a placeholder stands. Keep ordinary gradients: wrap the model in DDP first, then "
    "offload_parameters(ddp_model.module, nvme_path=..., offload_grads=False).")


def own_params(module: nn.Module) -> list[torch.Tensor]:
    """The module's own parameters (not its children's), without duplicates."""
    out, seen = [], set()
    for p in module._parameters.values():
        if p is not None and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def _tensors(value: Any, out: list) -> list:
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _tensors(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            _tensors(v, out)
    return out


# NOTE: residency is counted per parameter by the store: every fetch is one user, every release one
# fewer, and the storage is freed when none is left. Forward: a pre-hook fetches the module's own
# parameters (``recurse=False``), a post-hook releases them. Backward: the post-hook also puts a
# tensor hook on each output that requires grad; the first of them to fire (before the module's own
# backward nodes run, since it fires when the output's grad is complete) fetches the parameters again
# and holds them in ``_held`` (a set, so a module called twice holds them once). Each parameter is
# released by its post-accumulate-grad hook, which fires once per backward after every node that
# produces its grad (the nodes that read it) has run. An end-of-backward callback releases whatever is
# still held (frozen parameters, ``autograd.grad`` that accumulates nothing); autograd runs no callback for a
# backward that raised, so the next root call (outside any backward) releases what that one held.
#
# Gradients (``store.offload_grads``): a tensor hook on each parameter (before torch accumulates into
# ``p.grad``) and the post-accumulate-grad hook (after) hand the gradient to the store, which moves it
# to NVMe and leaves a placeholder in ``p.grad`` (see GradStore.begin/put). An optimizer that updates
# during backward (overlap_backward) watches the parameter through the store's hand-off (``Handoff``,
# told once the gradient is in place) and may take it at that hook, resident, with its gradient in
# memory: it is then updated, written back once, and its gradient dropped, with no trip through NVMe.
#
# External parameters: a module that uses another module's parameter in its forward declares it
# (``register_external_parameter``); the parameter is then fetched and released around that
# module's forward and backward exactly like its own.
#
# Prefetch: the sequence of fetch events (module, forward or backward) between two calls of the root
# module is recorded once; afterwards each event that matches the recording issues reads for the
# parameters of the next ``prefetch`` events. An event that does not match stops prefetching and
# starts a new recording from there, used from the next root call on.
class Scheduler:
    """Installs the hooks on ``root``'s submodules and runs the prefetch recording.

    Args:
        root: the model.
        store: the store holding every parameter of ``root`` that is offloaded.
        prefetch: how many upcoming fetch events to read ahead for (0: none).
    """

    def __init__(self, root: nn.Module, store: ParamStore, prefetch: int, *, keep_for_backward: bool = True):
        self.root = root
        self.store = store
        store.handoff.join(self)  # final gradients are reported to an optimizer updating during backward
        self.prefetch = prefetch
        self.modules: list[nn.Module] = []
        self.params: list[list[torch.Tensor]] = []
        self._handles: list = []
        self._held: set = set()
        # Forward's last weights, kept for backward's first fetches (none without keep_for_backward).
        self.turn = Turn(store, budget=store.pool.nbytes if keep_for_backward else 0)
        self._calls: dict[int, list] = {}
        self._callback_queued = False  # an end-of-backward callback is queued, not run yet
        self.trace: list[tuple[int, int]] = []
        self._recording: list[tuple[int, int]] = []
        self._pos = 0
        self._following = False
        self.order_changes = 0
        self._index: dict[int, int] = {}  # id(module) -> its index
        self._hooked: set[int] = set()  # indices of modules with forward hooks
        self._wrapped: list[nn.Module] = []  # modules whose _save_to_state_dict is wrapped

        self._handles.append(root.register_forward_pre_hook(self._on_root_call, prepend=True))
        for module in root.modules():
            if id(module) in self._index:
                continue
            mine = [p for p in own_params(module) if p in store.records]
            index = len(self.modules)
            self._index[id(module)] = index
            self.modules.append(module)
            self.params.append(mine)
            if mine:
                self._hook_forward(index)
                # state_dict(): fetch around torch's own copy-out, keep a clone, release.
                module._save_to_state_dict = self._save_wrapper(module, module._save_to_state_dict)
                self._wrapped.append(module)
            # load_state_dict() must see weights, one module at a time. (torch marks its hooks with
            # an attribute, which bound methods cannot take: wrap them.)
            self._handles.append(module.register_load_state_dict_pre_hook(
                lambda *a: self._load_pre_hook(*a)))
            self._handles.append(module.register_load_state_dict_post_hook(
                lambda *a: self._load_post_hook(*a)))
        for module in root.modules():
            for p in getattr(module, _EXTERNAL, ()):
                self.add_external(module, p)
        for p in store.records:
            if p.requires_grad:
                if store.offload_grads:
                    self._handles.append(p.register_hook(self._grad_pre_hook(p)))
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad_accumulated))

    def add_external(self, module: nn.Module, param: torch.Tensor) -> None:
        """Fetch ``param`` around ``module``'s forward and backward too (it uses it but does not own it)."""
        index = self._index.get(id(module))
        if index is None:
            raise ValueError(f"{type(module).__name__} is not a submodule of the offloaded model")
        if param not in self.store.records or any(q is param for q in self.params[index]):
            return
        self.params[index].append(param)
        self.turn.replan()
        self._hook_forward(index)

    def _hook_forward(self, index: int) -> None:
        if index in self._hooked:
            return
        self._hooked.add(index)
        module = self.modules[index]
        self._handles.append(module.register_forward_pre_hook(self._pre_forward(index)))
        self._handles.append(module.register_forward_hook(self._post_forward(index), always_call=True))

    def remove(self) -> None:
        """Take every hook off and release what the backward still holds."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for module in self._wrapped:
            module.__dict__.pop("_save_to_state_dict", None)
        self._wrapped.clear()
        self._release_held()

    # -- order and prefetch -------------------------------------------------------------------

    @deferring
    def _on_root_call(self, module, args) -> None:
        if self.store.offload_grads and _inside_ddp(self.root):
            raise ConfigError(DDP_GRADS)
        if self._callback_queued and _outside_backward():
            # The last backward raised: autograd ran no callback of its, so release here what it held.
            self._callback_queued = False
            self._release_held()
        self.turn.release_all()  # kept by the last forward, which no backward followed
        if self._following and self._pos != len(self.trace):
            self._following = False  # the last call stopped early: the order changed
            self.order_changes += 1
            self._recording = self.trace[:self._pos]
        if not self._following and self._recording:
            self.trace = self._recording
        self._recording = []
        self._pos = 0
        self._following = bool(self.trace)
        if self._following:
            self._prefetch_from(0)

    def _event(self, key: tuple[int, int]) -> None:
        if self._following:
            if self._pos < len(self.trace) and self.trace[self._pos] == key:
                self._pos += 1
                self._prefetch_from(self._pos)
                return
            # Not the recorded order: fetch on demand and record the new order from here.
            self._following = False
            self.order_changes += 1
            self._recording = self.trace[:self._pos]
        self._recording.append(key)

    def _prefetch_from(self, pos: int) -> None:
        for index, _ in self.trace[pos:pos + self.prefetch]:
            for p in self.params[index]:
                self.store.prefetch(p)

    # -- forward ------------------------------------------------------------------------------

    def _pre_forward(self, index: int):
        @deferring
        def hook(module, args):
            self._event((index, FORWARD))
            # Where in the recorded order this call is (None: not following it), and what it fetched, for its
            # post-hook, which also runs when a fetch here fails.
            fetched: list = []
            self._calls.setdefault(index, []).append((self._pos - 1 if self._following else None, fetched))
            for p in self.params[index]:
                self.store.fetch(p)
                fetched.append(p)
        return hook

    def _post_forward(self, index: int):
        @deferring
        def hook(module, args, output):
            stack = self._calls.get(index)
            pos, fetched = stack.pop() if stack else (None, [])
            keep: dict = {}
            try:
                keep = self._keeps_for_backward(pos)
            finally:  # whatever happened, this call's holds are kept or released
                self.turn.release_or_keep(fetched, keep=keep)
            if torch.is_grad_enabled():
                outs = [t for t in _tensors(output, []) if t.requires_grad]
                if outs:
                    fired = [False]
                    for t in outs:
                        t.register_hook(self._before_backward(index, fired))
        return hook

    def _keeps_for_backward(self, pos):
        """The weights that the forward event at ``pos`` of the recorded order (None: none) keeps for backward
        (:class:`offload.params.turn.Turn`), the order being followed still: a dict, maybe empty. Nothing in eval
        mode (a validation pass with grad enabled has no backward to keep them for)."""
        if pos is None or not self._following or not self.root.training:
            return {}
        return self.turn.plan(self.trace, self.params).get(pos, {})

    # -- backward -----------------------------------------------------------------------------

    def _before_backward(self, index: int, fired: list):
        @deferring
        def hook(grad):
            if fired[0]:
                return None
            fired[0] = True
            self._event((index, BACKWARD))
            for p in self.params[index]:
                if p not in self._held:
                    if not self.turn.take(p):  # else forward kept it resident: no read
                        self.store.fetch(p)
                    self._held.add(p)
            if not self._callback_queued:
                self._callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            return None
        return hook

    def _grad_pre_hook(self, p: torch.Tensor):
        @deferring
        def hook(grad):
            self.store.grads.begin(p)
            return None
        return hook

    @deferring
    def _on_grad_accumulated(self, p: torch.Tensor) -> None:
        handoff = self.store.handoff
        if handoff.offer(p, held=p in self._held):
            # An optimizer updating during backward took p as it is: the weights stay resident (this hold is
            # now the optimizer's, released after the update) and the gradient in memory, never written.
            self._held.discard(p)
            if self.store.offload_grads:
                self.store.grads.merge(p)
        else:
            if self.store.offload_grads:
                self.store.grads.put(p)
            if p in self._held:
                self._held.discard(p)
                self.store.release(p)
        handoff.final(p)  # after the gradient is where the optimizer will look for it

    @deferring
    def _end_of_backward(self) -> None:
        self._callback_queued = False
        self._release_held()

    def _release_held(self) -> None:
        held, self._held = self._held, set()
        try:
            release_each(held, self.store.release)
        finally:
            self.turn.release_all()

    # -- state dicts ----------------------------------------------------------------------------

    def _save_wrapper(self, module: nn.Module, save):
        store = self.store

        def save_to_state_dict(destination, prefix, keep_vars):
            if keep_vars:  # the Parameters themselves, not their values
                return save(destination, prefix, keep_vars)
            mine = [p for p in own_params(module) if p in store.records]
            with resident(mine):
                save(destination, prefix, keep_vars)
                for name, p in module._parameters.items():
                    if p is not None and p in store.records and prefix + name in destination:
                        # torch stored a detached alias of storage about to be freed: keep a copy.
                        destination[prefix + name] = destination[prefix + name].clone()
        return save_to_state_dict

    @deferring
    def _load_pre_hook(self, module, state_dict, prefix, *args) -> None:
        for p in own_params(module):
            if p in self.store.records:
                self.store.fetch(p)

    @deferring
    def _load_post_hook(self, module, incompatible_keys) -> None:
        for p in own_params(module):
            if p in self.store.records:
                self.store.release(p, dirty=True)


# NOTE: DDP's reducer works in C++ on the gradients autograd accumulates, after our hooks have moved
# them to NVMe; no hook of ours sees its bucket copies. DDP marks the module whose forward it runs
# (``_active_ddp_module``, set around every forward with its default reducer), so a root call of an
# offloaded model inside it is the first moment the combination can be seen, before any gradient exists.
def _inside_ddp(root: nn.Module) -> bool:
    """Whether ``root`` is being called by a DistributedDataParallel forward (``root`` is in its module)."""
    ddp = getattr(DistributedDataParallel, "_active_ddp_module", None)
    return ddp is not None and any(m is root for m in ddp.module.modules())


def _outside_backward() -> bool:
    """Whether no backward is running on this thread (autograd's current graph task: every torch this library
    supports has the call)."""
    return torch._C._current_graph_task_id() == -1
