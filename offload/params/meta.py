"""Parameters built on the meta device: given storage in the swap space, initialised one module at a time."""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, Iterator, Optional, Union

import torch
from torch import nn

from ..progress import tracked
from .holds import release_each

__all__ = ["Init", "empty_parameters", "initialise", "replace_meta"]

log = logging.getLogger("offload")

# What to run on each module whose parameters came from the meta device: None (its own
# ``reset_parameters``, where it has one), False (nothing: the weights are left for a load), or a callable.
Init = Union[None, bool, Callable[[nn.Module], None]]


@contextlib.contextmanager
def empty_parameters() -> Iterator[None]:
    """Build modules with their parameters on the meta device and their buffers real, for the block.

    Every parameter a module registers is moved to the meta device as it is registered (its constructor's
    own initialisation then runs on meta and draws nothing); buffers (rotary frequencies, masks) keep the
    values their constructors compute. Hand the model to :func:`offload.offload_parameters`, which gives
    the parameters their bytes in the swap space. ``torch.device("meta")`` puts buffers on meta too.
    Changes ``nn.Module.register_parameter`` for the block, in every thread.
    """
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param) -> None:
        original(module, name, param)
        p = module._parameters.get(name)
        if p is not None and not p.is_meta:
            q = type(p)(p.detach().to("meta"), requires_grad=p.requires_grad)
            q.__dict__.update(p.__dict__)
            module._parameters[name] = q

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def replace_meta(model: nn.Module, device: torch.device) -> tuple[list[nn.Parameter], list[str]]:
    """Give every meta parameter and buffer of ``model`` a place on ``device``.

    A meta parameter is replaced, in every module that holds it (so ties stay ties), by a Parameter of the
    same shape, dtype and ``requires_grad`` on ``device`` whose storage is empty: zero bytes, the state of
    an offloaded parameter between uses. Its bytes will live in the swap space only. A meta buffer becomes
    a tensor of zeros on ``device`` (buffers stay in memory).

    Returns:
        The new parameters, in the order ``model.parameters()`` gives them, and the qualified names of the
        buffers that were on meta.
    """
    new: dict[int, nn.Parameter] = {}
    buffers: list[str] = []
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            q = new.get(id(p))
            if q is None:
                if type(p) is not nn.Parameter:
                    raise ValueError(
                        f"parameter {prefix + '.' if prefix else ''}{name} on the meta device is a "
                        f"{type(p).__name__}, not a torch.nn.Parameter; only plain Parameters can be offloaded")
                data = torch.empty(p.shape, dtype=p.dtype, device=device)
                data.untyped_storage().resize_(0)  # never touched, so it never held memory on the host
                q = nn.Parameter(data, requires_grad=p.requires_grad)
                q.__dict__.update(p.__dict__)  # attributes frameworks set on parameters
                new[id(p)] = q
            module._parameters[name] = q
        for name, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                module._buffers[name] = torch.zeros(b.shape, dtype=b.dtype, device=device)
                buffers.append(f"{prefix}.{name}" if prefix else name)
    made = {id(q) for q in new.values()}
    return [p for p in model.parameters() if id(p) in made], buffers


# NOTE: a module's initialiser runs on its own parameters, resident in memory, and they are written to the
# swap space when it returns: one module's weights in memory at a time, so building a model of any size
# needs the pools and one module, no more. Modules are visited children first, the order in which their
# constructors ran when the model was built on a real device: a parent's initialiser that overrides a
# child's (MultiheadAttention zeroes its out_proj's bias) comes after it, and with the same seed the random
# draws are the same ones. Meta tensors draw nothing, so seeding before this call is what counts.
def initialise(model: nn.Module, store, fresh: list[nn.Parameter], init: Init,
               meta_buffers: list[str]) -> None:
    """Run each module's initialiser on its parameters that came from the meta device.

    Parameters no initialiser covers are written as zeros, for a load to replace. Parameters ``store`` keeps
    in memory instead of on the swap space (``max_in_cpu``) get their storage here, zeroed, and are
    initialised in place.

    Args:
        model: the model whose parameters ``fresh`` came from the meta device (see :func:`replace_meta`).
        store: the :class:`offload.params.store.ParamStore` holding them (built with ``fresh=``).
        init: see :data:`Init`.
        meta_buffers: the qualified names of buffers that were on meta (named in a warning if no initialiser
            set them).
    """
    waiting = {id(p) for p in fresh}
    for p in fresh:
        if p not in store.records:  # kept in memory as it is: give it its bytes now
            p.untyped_storage().resize_(p.numel() * p.element_size())
            with torch.no_grad():
                p.zero_()
    # An initialiser that says it sets every element (a load) spares the zeroing, a pass over new memory.
    zero = not getattr(init, "sets_every_element", False)
    initialised_modules: set[int] = set()
    modules = list(_children_first(model)) if init is not False else []
    # A load (an initialiser that sets every element) counts its own bytes; this counts modules otherwise.
    counted = modules if zero else []
    for module in tracked(counted, "initialising weights on NVMe, by module") if counted else modules:
        own = [p for p in module._parameters.values() if p is not None and id(p) in waiting]
        fn = _initialiser(module, init)
        if not own or fn is None:
            continue
        rng = _rng_state(module)
        try:
            with _Holding(store, own, set(waiting), zero):
                fn()
            done = own
        except torch.OutOfMemoryError:
            raise  # not a reach below the module: holding more would make it worse
        except RuntimeError:
            # The initialiser reached below the module (a parent resetting a child's bias): hold the
            # module's whole subtree and run it again from the same random state. What it did not set
            # of the subtree's new parameters stays zero, and is theirs now.
            _set_rng_state(rng)
            done = list({id(p): p for p in module.parameters()}.values())
            with _Holding(store, done, set(waiting)):
                fn()
        initialised_modules.add(id(module))
        waiting.difference_update(id(p) for p in done)
    # The swap space holds whatever was there before (the file's seal, for one): write zeros.
    for p in fresh:
        if id(p) in waiting:
            with _Holding(store, [p], waiting):
                pass
    _tell_uninitialised(model, waiting, meta_buffers, init, initialised_modules)


def _initialiser(module: nn.Module, init: Init) -> Optional[Callable[[], None]]:
    if callable(init) and init is not True:
        return lambda: init(module)
    # torch's own modules name it reset_parameters, a few (MultiheadAttention, Transformer) _reset_parameters.
    for name in ("reset_parameters", "_reset_parameters"):
        reset = getattr(module, name, None)
        if callable(reset):
            return reset
    return None


class _Holding:
    """Hold ``params`` resident for the block and write them back after it: those still ``waiting`` for
    their first values are fetched without reading (and zeroed, with ``zero``), the others read."""

    def __init__(self, store, params: list, waiting: set, zero: bool = True):
        self.store, self.params, self.waiting, self.zero = store, params, waiting, zero
        self.held: list = []

    def __enter__(self):
        try:
            for p in self.params:
                if p not in self.store.records:
                    continue
                first = id(p) in self.waiting
                self.store.fetch(p, read=not first)
                self.held.append(p)
                if first and self.zero:
                    with torch.no_grad():
                        p.zero_()  # what a parameter no initialiser sets holds, as on the swap space
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc):
        release_each(self.held, lambda p: self.store.release(p, dirty=True))
        self.held = []
        return False


def _children_first(model: nn.Module) -> Iterator[nn.Module]:
    seen: set[int] = set()

    def visit(module: nn.Module) -> Iterator[nn.Module]:
        if id(module) in seen:
            return
        seen.add(id(module))
        for child in module.children():
            yield from visit(child)
        yield module

    yield from visit(model)


def _rng_state(module: nn.Module):
    cuda = any(p.device.type == "cuda" for p in module.parameters(recurse=False))
    return torch.get_rng_state(), torch.cuda.get_rng_state() if cuda else None


def _set_rng_state(state) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1])


def _tell_uninitialised(model: nn.Module, waiting: set, meta_buffers: list[str], init: Init,
                        initialised: Optional[set] = None) -> None:
    """Say which weights from the meta device hold zeros for want of an initialiser (INFO: a load usually
    follows), and warn about meta buffers left as zeros, which a weight load may not bring."""
    names = [n for n, p in model.named_parameters() if id(p) in waiting]
    if names:
        why = "init=False" if init is False else "no initialiser covers them"
        log.info("%d parameters from the meta device hold zeros until loaded (%s): %s", len(names), why,
                 ", ".join(names[:8]) + (", ..." if len(names) > 8 else ""))
    if meta_buffers:
        initialised = initialised or set()
        left = [n for n in meta_buffers if id(_owner(model, n)) not in initialised]
        if left:
            log.warning(
                "%d buffers were on the meta device and hold zeros: %s. Buffers are not offloaded; build the "
                "model with only its parameters on meta (offload.params.empty_parameters(), or accelerate's "
                "init_empty_weights()) so that buffers get their real values, or set them before training",
                len(left), ", ".join(left[:8]) + (", ..." if len(left) > 8 else ""))


def _owner(model: nn.Module, name: str) -> nn.Module:
    prefix, _, _ = name.rpartition(".")
    return model.get_submodule(prefix) if prefix else model
