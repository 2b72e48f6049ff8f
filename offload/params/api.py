"""``offload_parameters`` / ``restore_parameters``: a model's weights on NVMe, and back."""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from torch import nn

from ..aio import warn_use_gds
from ..config import Config, offload_config
from ..distributed import is_dtensor
from ..errors import ConfigError
from .holds import resident
from .hooks import _EXTERNAL, DDP_GRADS, Scheduler
from .meta import Init, initialise, replace_meta
from .registry import store_of
from .shards import FSDP2_GRADS, ShardHooks, fsdp_shards
from .store import ParamStore

__all__ = [
    "ParamOffload", "compile_offloaded", "materialized", "offload_parameters", "offloaded",
    "register_external_parameter", "restore_parameters", "shards_held",
]

_ATTR = "_nvme_offload_params"


class ParamOffload:
    """What :func:`offload_parameters` attached to a model: its store and its hooks.

    Attributes:
        store: the :class:`offload.params.store.ParamStore` (I/O counters, ``resident_bytes``,
            ``resident_bytes_max``, ``bytes_read``, ``bytes_written``, ``swap_space``).
        scheduler: the hooks and the recorded execution order (``trace``, ``order_changes``): a
            :class:`offload.params.hooks.Scheduler`, or under FSDP2 a :class:`offload.params.shards.ShardHooks`
            (its trace is of FSDP2's parameter groups).
        config: the configuration in use.
    """

    def __init__(self, store: ParamStore, scheduler: Scheduler, config: Config):
        self.store = store
        self.scheduler = scheduler
        self.config = config


def offload_parameters(
    model: nn.Module,
    nvme_path=None,
    config=None,
    *,
    max_in_cpu: Optional[int] = None,
    max_grad_in_cpu: Optional[int] = None,
    prefetch: int = 2,
    keep_for_backward: bool = True,
    buffer_count: Optional[int] = None,
    buffer_size: Optional[int] = None,
    pin_memory: Optional[bool] = None,
    offload_grads: Optional[bool] = None,
    device=None,
    init: Init = None,
) -> nn.Module:
    """Move ``model``'s parameters to NVMe; each submodule's are fetched for its forward and backward.

    The model is changed in place and returned. Parameters keep their objects, shapes, dtypes, devices
    and ``requires_grad``; between uses their storage is empty (zero bytes) and their class is
    :class:`offload.params.guard.OffloadedParameter`, a ``Parameter`` subclass on which any torch
    use while released raises ``RuntimeError`` instead of reading freed memory. Buffers stay in
    memory. Move the model to its device (and dtype) before calling this: afterwards ``model.to()``
    to where the weights already are does nothing, and a real move or conversion raises.

    Parameters on the meta device (a model built under ``torch.device("meta")``,
    :func:`offload.params.meta.empty_parameters` or accelerate's ``init_empty_weights``) get their bytes
    straight in the swap space: one module at a time, its parameters are made resident, initialised by
    ``init`` (default: the module's own ``reset_parameters``) and written out, so building a model of any
    size needs the pools and one module. Seed before this call for the draws of a normal build. Weights no
    initialiser sets are zeros until a load (:func:`offload.pretrained.load_safetensors`). A model may
    mix meta and real parameters.

    Under FSDP2 (``model`` the root module ``fully_shard`` wrapped) each rank offloads its local shards, which are
    fetched ahead of FSDP2's all-gather and released once it has copied them in; pass ``offload_grads=False``
    (FSDP2's sharded gradients stay in memory). See docs/distributed.md.

    Args:
        model: the module whose parameters (all of them, recursively) are offloaded.
        nvme_path: a directory, or a list of directories (one per drive, striped), for the swap file;
            ``{rank}``, ``{local_rank}`` and ``{world_size}`` in it are this process's (docs/distributed.md).
        config: a path to a JSON file, a dict, a :class:`offload.config.Config` or a
            :class:`offload.config.ParamOffloadConfig`; a whole DeepSpeed ``ds_config.json`` works (its
            ``aio`` block and ``zero_optimization.offload_param`` are used). A dict holding only
            ``offload_param`` keys is read as that block.
        max_in_cpu: parameter elements kept in host memory instead of on NVMe (smallest parameters
            first). On a CPU model they simply stay in place; on a GPU model a host copy is kept and
            copied to the device on each fetch. Default: the config's (1e9, as in DeepSpeed).
        max_grad_in_cpu: gradient elements (with ``offload_grads``) kept in host memory from backward
            to the step instead of written to NVMe and read back (smallest first). Default: the
            config's (1e9).
        prefetch: how many upcoming submodules (in the order recorded on the first call) to read ahead.
        keep_for_backward: forward's last submodules keep their weights resident into backward, which needs
            them first, up to the parameter pool's bytes (in host memory, or the device's for a device model):
            fewer reads per iteration. False: none kept, resident weights stay about two modules'. Under FSDP2
            nothing is kept either way (each group's shards are released once gathered).
        buffer_count, buffer_size, pin_memory: override the config's ``offload_param`` settings
            (``buffer_size`` in elements).
        offload_grads: (default: True, except under FSDP2, whose sharded gradients stay in memory) move each
            offloaded parameter's gradient to NVMe as backward produces it,
            leaving a placeholder in ``p.grad`` (read it with :func:`load_grad`; clip with
            :func:`clip_grad_norm_`; step with ``OffloadedAdam``), so grads need no memory for the
            whole model. ``False``: ordinary ``p.grad`` tensors, every torch utility works, and the
            grads of all parameters are resident at once.
        device: where parameters on the meta device go (default: where the model's other parameters
            are, else the CPU). Meta buffers become zeros there (see :mod:`offload.params.meta`).
        init: for modules with parameters from the meta device: ``None`` runs each one's
            ``reset_parameters`` (or ``_reset_parameters``), children before parents as their constructors
            ran; ``False`` runs none (the weights are zeros, left for a load); a callable ``init(module)`` runs
            instead (for Hugging Face models, ``model._init_weights``).

    Returns:
        ``model``.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ConfigError: no ``nvme_path``, or a bad setting; or ``model`` is sharded by FSDP2 and ``offload_grads`` is
            True; or ``model`` is a ``DistributedDataParallel`` and ``offload_grads`` is True (DDP reduces gradients
            in its own buckets: pass ``offload_grads=False``; the same is refused at the first forward of a model a
            DDP wrapper calls).
        ValueError: the model is offloaded already, its parameters are on several devices, are DTensors
            other than FSDP2's (tensor parallelism), or two parameters share storage.
        OSError: the swap file cannot be created or the disk cannot hold the parameters.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"offload_parameters expects a torch.nn.Module, got {type(model).__name__}")
    if getattr(model, _ATTR, None) is not None:
        raise ValueError("this model's parameters are offloaded already; call restore_parameters(model) first")
    if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
        raise ValueError(f"prefetch must be a non-negative number of submodules, got {prefetch!r}")
    if not isinstance(keep_for_backward, bool):
        raise TypeError(f"keep_for_backward must be True or False, got {keep_for_backward!r}")
    cfg = offload_config(config, "offload_param", user="offload_parameters", what="parameters",
                         otherwise="or leave the model as it is to keep parameters in memory",
                         nvme_path=nvme_path, max_in_cpu=max_in_cpu, max_grad_in_cpu=max_grad_in_cpu,
                         buffer_count=buffer_count, buffer_size=buffer_size, pin_memory=pin_memory)
    if cfg.aio.use_gds:
        warn_use_gds()  # once per process: what GPUDirect Storage gives here
    if offload_grads is not None and not isinstance(offload_grads, bool):
        raise TypeError(f"offload_grads must be True or False, got {offload_grads!r}")
    if init is not None and init is not False and not callable(init):
        raise TypeError(f"init must be None, False or a callable taking a module, got {init!r}")
    if any(is_dtensor(p) for p in model.parameters()):
        if offload_grads:
            fsdp_shards(model)  # a model FSDP2 does not shard is refused for that first
            raise ConfigError(FSDP2_GRADS)
        if device is not None or init not in (None, False):
            raise ValueError("under FSDP2 the shards stay on the device fully_shard put them on and are not "
                             "initialised here: leave device and init out (materialise a meta model before "
                             "fully_shard's lazy init, then offload_parameters)")
        return _offload_shards(model, cfg, prefetch)
    offload_grads = True if offload_grads is None else offload_grads
    if isinstance(model, torch.nn.parallel.DistributedDataParallel) and offload_grads:
        raise ConfigError(DDP_GRADS)
    real = {p.device for p in model.parameters() if not p.is_meta}
    target = torch.device(device) if device is not None else next(iter(real)) if len(real) == 1 else \
        torch.device("cpu")
    fresh, meta_buffers = replace_meta(model, target)
    params = _check_params(model, fresh)
    store = ParamStore(params, cfg, name="params", offload_grads=offload_grads, names=_names(model), fresh=fresh)
    try:
        scheduler = Scheduler(model, store, prefetch, keep_for_backward=keep_for_backward)
    except BaseException:
        store.restore()
        raise
    setattr(model, _ATTR, ParamOffload(store, scheduler, cfg))
    if fresh or meta_buffers:
        try:
            initialise(model, store, fresh, init, meta_buffers)
        except BaseException:
            # The weights from meta have no sound values: the model stays guarded (any use raises).
            scheduler.remove()
            store.close()
            delattr(model, _ATTR)
            raise
    return model


def _offload_shards(model: nn.Module, cfg: Config, prefetch: int) -> nn.Module:
    """:func:`offload_parameters` of a model sharded by FSDP2: each rank's local shards on its drive."""
    groups = fsdp_shards(model)
    assert groups is not None  # the caller saw DTensor parameters (fsdp_shards refuses other ones)
    shards = [s for _, group in groups for s in group]
    store = ParamStore([s.held for s in shards], cfg, name="params", names={s.held: s.name for s in shards},
                       guard=False)
    try:
        hooks = ShardHooks(model, store, prefetch, groups)
    except BaseException:
        store.restore()
        raise
    setattr(model, _ATTR, ParamOffload(store, hooks, cfg))  # type: ignore[arg-type]
    return model


@contextlib.contextmanager
def shards_held(model: Optional[nn.Module], *, modified: bool = False) -> Iterator[None]:
    """For the block, every local shard of ``model`` that :func:`offload_parameters` put on NVMe under FSDP2 in
    memory (a checkpoint reads and writes them as in-memory DTensors); nothing for other models, whose offloaded
    weights a checkpoint streams through the parameter pool. ``modified``: written back after the block."""
    state = offloaded(model) if isinstance(model, nn.Module) else None
    if state is None or not isinstance(state.scheduler, ShardHooks):
        yield
        return
    with resident([s.held for s in state.scheduler.shards], dirty=modified):
        yield


def restore_parameters(model: nn.Module) -> nn.Module:
    """Undo :func:`offload_parameters`: every weight back in memory, hooks removed, swap file deleted.

    Returns:
        ``model``, with ordinary parameters holding their latest values.

    Raises:
        ValueError: the model's parameters are not offloaded.
    """
    state = offloaded(model)
    if state is None:
        raise ValueError("this model's parameters are not offloaded (offload_parameters was not called on it)")
    state.scheduler.remove()
    state.store.restore()
    delattr(model, _ATTR)
    return model


def register_external_parameter(module: nn.Module, param: torch.Tensor) -> None:
    """Declare that ``module``'s forward uses ``param``, a parameter owned by another module.

    The parameter is then fetched before ``module``'s forward and backward and released after, like
    the module's own (e.g. a parent calling ``F.linear(x, self.child.weight)``, or a head using an
    embedding's weight without holding it as its own Parameter). Call it before or after
    :func:`offload_parameters`; for a model that is not offloaded it only takes note.

    Raises:
        TypeError: ``module`` is not an ``nn.Module`` or ``param`` not a tensor.
        ValueError: the model is offloaded and ``module`` is not part of the one holding ``param``.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"register_external_parameter expects a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(param, torch.Tensor):
        raise TypeError(f"register_external_parameter expects a parameter tensor, got {type(param).__name__}")
    declared = module.__dict__.setdefault(_EXTERNAL, [])
    if not any(q is param for q in declared):
        declared.append(param)
    store = store_of(param)
    scheduler = store.handoff.hooks if store is not None else None
    if scheduler is not None:
        scheduler.add_external(module, param)


def offloaded(model: nn.Module) -> Optional[ParamOffload]:
    """The :class:`ParamOffload` of an offloaded model, or ``None``."""
    return getattr(model, _ATTR, None)


@contextlib.contextmanager
def materialized(model: nn.Module, *, modified: bool = False) -> Iterator[nn.Module]:
    """Hold every offloaded parameter of ``model`` in memory for the ``with`` block.

    Use it to read or change weights outside forward/backward (printing a weight, custom init, EMA).
    Needs memory for the whole model. With ``modified=True`` the parameters are written back to NVMe
    afterwards (change them in place, under ``torch.no_grad()``).

    Touching a released parameter outside this block or a forward/backward raises ``RuntimeError``
    (its storage is empty, as with FSDP).
    """
    state = offloaded(model)
    if state is None:
        yield model
        return
    with resident(list(state.store.records), dirty=modified):
        yield model


# NOTE: torch.compile of the whole model would trace the fetch hooks, which do I/O and must run
# eagerly (the guard refuses it with a pointer here). Compiling a module's ``forward`` leaves its
# hooks outside the graph: ``Module.__call__`` runs the pre-hook (fetch), then the compiled forward,
# then the post-hook (release), and backward's hooks fire from autograd between compiled pieces. So
# the largest subtrees with no hooks below their root are compiled, each as one graph, and the
# modules above them stay eager.
def compile_offloaded(model: nn.Module, **compile_kwargs) -> nn.Module:
    """``torch.compile`` for a model offloaded with :func:`offload_parameters`, hooks outside the graphs.

    Each largest submodule with no offloaded parameters below it (its own are fetched by its own
    hooks, around its forward) gets ``module.forward = torch.compile(module.forward, **compile_kwargs)``;
    modules above those run eagerly. A model that is not offloaded is compiled whole the same way.
    Changes ``model`` in place and returns it.

    Args:
        model: the model, after :func:`offload_parameters`.
        compile_kwargs: passed to ``torch.compile`` (``backend``, ``mode``, ``dynamic``, ...).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"compile_offloaded expects a torch.nn.Module, got {type(model).__name__}")
    hooked = {id(m) for m in _hooked_modules(model)}
    below: dict[int, bool] = {}  # id(module) -> whether a hooked module is strictly below it

    def has_hooks_below(module: nn.Module) -> bool:
        if id(module) not in below:
            below[id(module)] = any(id(c) in hooked or has_hooks_below(c) for c in module.children())
        return below[id(module)]

    seen: set[int] = set()

    def visit(module: nn.Module) -> None:
        if id(module) in seen:  # a module used in two places is compiled once
            return
        seen.add(id(module))
        if not has_hooks_below(module):
            module.forward = torch.compile(module.forward, **compile_kwargs)
            return
        for child in module.children():
            visit(child)

    visit(model)
    return model


def _hooked_modules(model: nn.Module) -> list[nn.Module]:
    """The submodules whose forward fetches offloaded parameters (their own or declared ones)."""
    state = offloaded(model)
    if state is None:
        return []
    return [m for m, params in zip(state.scheduler.modules, state.scheduler.params) if params]


# -- helpers ------------------------------------------------------------------------------------


def _names(model: nn.Module) -> dict:
    """Each parameter's first qualified name and its owner's class, for error messages."""
    names: dict = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, p in module._parameters.items():
            if p is not None and p not in names:
                full = f"{prefix}.{name}" if prefix else name
                names[p] = f"'{full}' (of {type(module).__name__})"
    return names


def _check_params(model: nn.Module, fresh: list) -> list[torch.Tensor]:
    """The parameters to offload, checked; ``fresh`` ones (from the meta device) have no bytes yet."""
    params = [p for p in model.parameters() if p.numel() > 0]
    new = {id(p) for p in fresh}
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ValueError(
            f"the model's parameters are on several devices ({sorted(map(str, devices))}); "
            "move the model to one device before offloading its parameters"
        )
    owners: dict = {}
    for p in params:
        if id(p) in new:
            continue
        if type(p) is not nn.Parameter:
            raise ValueError(
                f"parameter of shape {tuple(p.shape)} is a {type(p).__name__}, not a torch.nn.Parameter; "
                "only plain Parameters can be offloaded"
            )
        if p.is_sparse:
            raise ValueError(f"sparse parameter of shape {tuple(p.shape)} cannot be offloaded")
        st = p.untyped_storage()
        key = (st.device, st.data_ptr())
        if key in owners:
            raise ValueError(
                f"two parameters (shapes {tuple(owners[key].shape)} and {tuple(p.shape)}) share storage; "
                "give each its own (p.data = p.data.clone()) or tie them as one Parameter object"
            )
        owners[key] = p
        if (not p.is_contiguous() or p.storage_offset() != 0
                or st.nbytes() != p.numel() * p.element_size()):
            # Our bytes move as one flat block: give the parameter a storage of exactly its own.
            with torch.no_grad():
                p.data = p.data.clone(memory_format=torch.contiguous_format)
    return params
