"""Guarded tensor classes: a released parameter, or an offloaded gradient, raises instead of crashing."""

from __future__ import annotations

import os
import sys
import weakref
from typing import Any

import torch
from torch import nn

__all__ = ["OffloadedGrad", "OffloadedParameter", "OffloadedView"]

_T = torch.Tensor

# Calls that read no element: allowed on a released parameter and on a gradient placeholder.
_META = frozenset(
    [getattr(_T, name).__get__ for name in (
        "shape", "dtype", "device", "requires_grad", "grad", "is_leaf", "grad_fn", "_grad_fn", "ndim",
        "layout", "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_nested", "names",
        "_post_accumulate_grad_hooks", "_backward_hooks", "output_nr", "_version", "retains_grad",
        "itemsize", "nbytes", "is_mkldnn", "is_xpu", "is_mps",
    ) if hasattr(_T, name)]
    + [getattr(_T, name).__set__ for name in (
        "grad", "requires_grad", "_post_accumulate_grad_hooks", "_backward_hooks",
    ) if hasattr(_T, name)]
    + [getattr(_T, name) for name in (
        "size", "dim", "numel", "nelement", "element_size", "stride", "storage_offset", "is_contiguous",
        "is_floating_point", "is_complex", "is_signed", "untyped_storage", "requires_grad_",
        "register_hook", "register_post_accumulate_grad_hook", "get_device", "__hash__",
        "detach_", "retain_grad", "is_pinned", "is_shared", "__len__", "is_inference",
    ) if hasattr(_T, name)]
    # New tensors shaped like the argument read none of its elements.
    + [torch.empty_like, torch.zeros_like, torch.ones_like, torch.full_like, torch.rand_like, torch.randn_like]
    # Module._apply (model.to(), .cuda(), .float(), ...) asks this before assigning ``param.data``.
    + [torch._has_compatible_shallow_copy_type]
)
_ZERO = frozenset([_T.zero_, torch._foreach_zero_])
# Conversions: ``Module.to()``/``.cuda()``/``.cpu()``/``.float()``... call these on every parameter.
_DTYPES = {_T.double: torch.float64, _T.float: torch.float32, _T.half: torch.float16,
           _T.bfloat16: torch.bfloat16}
_MOVES = frozenset([_T.to, _T.cuda, _T.cpu, _T.type, *_DTYPES])
_SET_DATA = _T.data.__set__
_ATEN = (torch._ops.OpOverload, torch._ops.OpOverloadPacket)
# set_() makes its first argument share a storage: of an offloaded weight it is refused (the store owns it),
# onto one that argument becomes a view of the weight.
_SET = frozenset([_T.set_, torch.ops.aten.set_, *(getattr(torch.ops.aten.set_, o) for o in
                                                   torch.ops.aten.set_.overloads())])
# Exports of the weight's memory by address to another library (DLPack): what it reads is out of the guard's
# sight, so they are refused; a copy is exported instead by the caller.
_EXPORTS = frozenset([_T.__dlpack__])


def _run(func, args, kwargs):
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def _blocked(value: Any):
    """The first released parameter, view of one or gradient placeholder in ``value`` (one level of lists),
    or None."""
    t = type(value)
    if t is list or t is tuple:
        return next((v for v in value if _blocked_one(v) is not None), None)
    return _blocked_one(value)


def _blocked_one(value: Any):
    """``value`` if it is a released parameter, a view of one or a gradient placeholder, else None."""
    t = type(value)
    if t is OffloadedParameter:
        return None if value.__dict__.get("_nvme_resident", True) else value
    if t is OffloadedGrad:
        return value
    if t is OffloadedView:
        return value if _view_released(value) else None
    return None


def _view_released(view) -> bool:
    """Whether the parameter whose memory ``view`` shares is released (or, the parameter gone, its storage
    freed)."""
    p = view.__dict__["_nvme_base"]()
    if p is not None:
        return not p.__dict__.get("_nvme_resident", True)
    with torch._C.DisableTorchFunctionSubclass():
        return view.untyped_storage().nbytes() == 0 and view.numel() > 0


def _source(value: Any):
    """The offloaded parameter whose memory ``value`` is (a resident parameter) or shares (a view), or None."""
    t = type(value)
    if t is OffloadedParameter:
        return value
    if t is OffloadedView:
        return value.__dict__["_nvme_base"]()
    return None


# NOTE: a view of a resident parameter (``w[0]``, ``w.t()``, ``w.view(...)``, ``w.detach()``, ``w.data``,
# ``torch.split(w, ...)``) shares its storage, whose bytes the store gives back at the release: read afterwards,
# it would read zeros (a CPU weight, on pages of its own: params/mapped.py) or freed memory (a GPU weight, or
# where no mapping could be made). Every such result of a call given an offloaded parameter (or a view of one)
# becomes an ``OffloadedView``, refused by the same guard once its parameter is released. Views torch
# makes inside its kernels and autograd (``F.linear``'s transposed weight) never reach Python and stay
# plain; they are read only while the parameter is resident.
def _mark_views(out, sources: list, args: list) -> None:
    """Turn the tensors in ``out`` (one, or a tuple or list of them) that share the memory of one of
    ``sources`` (resident offloaded parameters or views of them) into ``OffloadedView``s. Any result is
    compared, not only views in autograd's sense: ``detach()``, ``.data`` and ``view(dtype)`` share memory
    too. A result that is one of the call's ``args`` (an in-place op, ``out=``) is the caller's: left as is."""
    t = type(out)
    if t is _T:
        results = (out,)
    elif (t is tuple or t is list) and out:
        results = [o for o in out if type(o) is _T]
    else:
        return
    with torch._C.DisableTorchFunctionSubclass():
        by_memory = {s.untyped_storage().data_ptr(): s for s in sources}
    by_memory.pop(0, None)
    for o in results:
        src = by_memory.get(o.untyped_storage().data_ptr())
        p = _source(src) if src is not None and not any(o is a for a in args) else None
        if p is not None:
            o.__class__ = OffloadedView
            o._nvme_base = weakref.ref(p)
            o._nvme_name = p.__dict__.get("_nvme_name", "?")


# NOTE: a released parameter's storage gives its memory back (a CPU weight's pages are dropped, its addresses
# kept: params/mapped.py; elsewhere the storage is resized to zero bytes); autograd's saved views share it, and a
# fetch refills the same storage. Its shape still says otherwise, so a kernel that read it would compute on
# zeros, or read freed memory and crash the process. Offloaded parameters
# therefore have their class switched (``p.__class__ = OffloadedParameter``, undone on restore), whose
# ``__torch_function__`` refuses every torch call that has a released parameter among its arguments,
# with an error saying what to do, and lets everything else through unchanged (results are plain
# tensors, as with ``nn.Parameter``). Calls that read no element (shape, dtype, device, grad,
# requires_grad, hooks, the storage object itself) always pass: torch's own bookkeeping needs them.
#
# An offloaded gradient is left in ``p.grad`` as an ``OffloadedGrad``: a one-element tensor expanded
# to the parameter's shape (no real storage), refused by the same guard, except ``zero_()`` (and
# ``torch._foreach_zero_``), which torch's ``zero_grad(set_to_none=False)`` calls: it marks the
# stored gradient as zero.
#
# Residency is a plain attribute on the parameter (``_nvme_resident``), set by the store under its
# lock; the guard reads it without the lock, since a parameter in use by a kernel is resident by then.
def _guard(func, args, kwargs):
    kwargs = kwargs or {}
    if func in _META:
        return _run(func, args, kwargs)
    if func in _ZERO:
        return _zero(func, args, kwargs)
    if func in _MOVES and args and type(args[0]) in (OffloadedParameter, OffloadedGrad):
        return _move(func, args, kwargs)
    if func == _SET_DATA and args and type(args[0]) in (OffloadedParameter, OffloadedGrad):
        return _set_data(args[0], args[1] if len(args) > 1 else kwargs.get("value"))
    if func in _SET:
        return _set(func, args, kwargs)
    if func in _EXPORTS and args and _source(args[0]) is not None:
        raise RuntimeError(
            f"{_what(args[0])} is offloaded to NVMe: exporting its memory through DLPack would hand another library "
            "an address the parameter guard cannot watch, whose bytes go when the weight is released. Export a "
            "copy, taken while the weight is resident: torch.from_dlpack(w.detach().clone())")
    return _checked(func, args, kwargs)


def _set(func, args, kwargs):
    """``t.set_(source, ...)``: refused on an offloaded parameter or gradient placeholder; a plain ``t`` set onto
    an offloaded weight's memory becomes an ``OffloadedView`` of it (refused once the weight is released)."""
    target = args[0] if args else kwargs.get("self")
    if type(target) in (OffloadedParameter, OffloadedGrad):
        raise RuntimeError(
            f"set_() on {_what(target)}, which is offloaded to NVMe, would take it away from its store. Change its "
            "values in place inside `with offload.params.materialized(model, modified=True):`, or restore_parameters"
            "(model) first")
    values = [*args[1:], *kwargs.values()]
    out = _checked(func, args, kwargs)
    sources = _memory_of_weights(values)
    if sources and type(target) is _T and not torch.compiler.is_compiling():
        _mark_views(target, sources, [])
    return out


def _zero(func, args, kwargs):
    """``zero_()`` of gradient placeholders marks their stored gradients zero; other tensors are zeroed."""
    target = args[0] if args else kwargs.get("self", kwargs.get("tensors"))
    many = isinstance(target, (list, tuple))
    items = list(target) if many else [target]
    rest = []
    for t in items:
        if type(t) is OffloadedGrad:
            t._nvme_zero()
        elif _blocked(t) is not None:
            raise RuntimeError(_message(t, func))
        else:
            rest.append(t)
    if many:
        if rest:
            _run(func, (rest,), {})
        return None
    return target if not rest else _run(func, args, kwargs)


# NOTE: ``model.to(device)`` to the device the weights already use is common in training code that
# did not place the model itself (Hugging Face's Trainer, accelerate's device placement, DDP, Lightning):
# torch's ``Module._apply`` calls ``param.to(device)``, which returns the parameter itself when
# nothing changes, then assigns ``param.data = param``. Both are answered here without reading the
# released bytes. A real move or conversion would give the parameter a storage the store does not
# own; it is refused, naming the order that works (move first, then offload). ``copy=True`` reads
# the bytes: it goes on to the ordinary check below.
def _move(func, args, kwargs):
    """A conversion of an offloaded parameter (or gradient placeholder): itself when nothing changes."""
    t = args[0]
    if func is _T.type and len(args) == 1 and not kwargs:
        return _run(func, args, kwargs)  # ``p.type()``: the type's name
    target = _target(func, t, args[1:], kwargs)
    if target is None:  # not a conversion this can read (``p.type()`` naming the type, copy=True, ...)
        return _checked(func, args, kwargs)
    device, dtype, memory_format = target
    same = (_same_device(device, t.device) and (dtype is None or dtype == t.dtype)
            and memory_format in (None, torch.preserve_format, torch.contiguous_format))
    if same:
        return t
    if type(t) is OffloadedParameter and t._nvme_is_resident():
        return _run(func, args, kwargs)  # a converted copy (``F.linear(x, self.weight.to(x.dtype))``)
    raise RuntimeError(
        f"{_what(t)} is offloaded to NVMe on {t.device} as {t.dtype} and not resident now, so "
        f"{getattr(func, '__name__', func)} cannot convert it to {device if device is not None else t.device} as "
        f"{dtype if dtype is not None else t.dtype}. Move or convert the model before offload_parameters: "
        "restore_parameters(model), then model.to(...), then offload_parameters(model, ...). (A forward that "
        "reads another module's parameter declares it: offload.params.register_external_parameter(module, param))")


def _target(func, t, args, kwargs):
    """(device, dtype, memory_format) that ``func(t, *args, **kwargs)`` converts to, or None."""
    if func in _DTYPES:
        return None, _DTYPES[func], kwargs.get("memory_format")
    if func is _T.cpu:
        return torch.device("cpu"), None, kwargs.get("memory_format")
    if func is _T.cuda:
        device = args[0] if args else kwargs.get("device")
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cuda")
        return device, None, kwargs.get("memory_format")
    if func is _T.type:
        dtype = args[0] if args else kwargs.get("dtype")
        return (None, dtype, None) if isinstance(dtype, torch.dtype) else None
    kwargs = dict(kwargs)
    if kwargs.pop("copy", False):
        return None
    try:
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
    except (TypeError, RuntimeError):
        return None
    return device, dtype, memory_format


def _same_device(device, current: torch.device) -> bool:
    if device is None:
        return True
    device = torch.device(device)
    if device.type != current.type:
        return False
    if device.index is None:
        return current.type != "cuda" or current.index == torch.cuda.current_device()
    return device.index == current.index


def _set_data(t, value):
    """``t.data = value`` (as ``Module._apply`` does after a conversion): only ``t`` itself is accepted."""
    if value is t:
        return None
    raise RuntimeError(
        f"assigning .data of {_what(t)}, which is offloaded to NVMe, would take it away from its store. Change "
        "its values in place inside `with offload.params.materialized(model, modified=True):`, or move or "
        "convert the model before offload_parameters (restore_parameters(model) first)")


def _checked(func, args, kwargs):
    values = [*args, *kwargs.values()]
    for a in values:
        bad = _blocked(a)
        if bad is not None:
            if type(bad) is OffloadedGrad:
                _tell_refused(bad)
            raise RuntimeError(_message(bad, func))
    out = _run(func, args, kwargs)
    if _marks(func):
        sources = _memory_of_weights(values)
        if sources:
            _mark_views(out, sources, values)
    return out


def _marks(func) -> bool:
    """Whether views among ``func``'s results are marked: not while a graph is traced, and, for an aten op, not
    under a dispatch mode (a compiled graph running: its modes refuse tensors of classes they do not know);
    aten ops a user calls directly give marked views like any other call."""
    if torch.compiler.is_compiling():
        return False
    return not isinstance(func, _ATEN) or torch._C._len_torch_dispatch_stack() == 0


def _memory_of_weights(values: list) -> list:
    """The offloaded parameters and views of them among ``values`` (one level of lists)."""
    found = []
    for a in values:
        ta = type(a)
        if ta is OffloadedParameter or ta is OffloadedView:
            found.append(a)
        elif (ta is tuple or ta is list) and a:
            found.extend(v for v in a if type(v) is OffloadedParameter or type(v) is OffloadedView)
    return found


def _tell_refused(grad) -> None:
    """A torch use of a gradient placeholder is refused: its store's hand-off tells an optimizer updating during
    backward, whose update may already have used the gradient as backward left it (a GradScaler's unscale_,
    torch's clip_grad_norm_ would have changed it)."""
    from .registry import store_of

    p = grad._nvme_param()
    store = store_of(p) if p is not None else None
    if store is not None:
        store.handoff.refused(p)


def _what(t) -> str:
    if type(t) is OffloadedGrad:
        return f"the gradient of parameter {t._nvme_name}"
    if type(t) is OffloadedView:
        return f"a view of parameter {t._nvme_name}"
    return f"parameter {t.__dict__.get('_nvme_name', '?')}"


def _message(t, func) -> str:
    what = getattr(func, "__name__", repr(func))
    if torch.compiler.is_compiling():
        # Dynamo traced into the fetch hooks (torch.compile of the whole model): they must stay outside.
        return (
            f"torch.compile traced {_what(t)} ({what}), which is offloaded to NVMe and fetched by module hooks "
            "that cannot run inside a compiled graph. Compile the submodules instead, with the hooks outside "
            "the graph: offload.params.api.compile_offloaded(model, **compile_kwargs), after offload_parameters "
            "and in place of torch.compile(model) or Module.compile()"
        )
    if type(t) is OffloadedGrad:
        return (
            f"the gradient of parameter {t._nvme_name} is offloaded to NVMe (offload_parameters(..., "
            f"offload_grads=True)), so torch's {what} cannot read it. Read it with "
            "offload.params.load_grad(param), clip with offload.params.clip_grad_norm_(model, max_norm), "
            "step with OffloadedAdam/OffloadedAdamW (with Hugging Face's Trainer, use "
            "offload.integrations.transformers.OffloadTrainer), or pass offload_grads=False to keep ordinary "
            "gradients"
        )
    if type(t) is OffloadedView:
        return (
            f"this tensor shares the memory of parameter {t._nvme_name} (a view, .detach() or .data taken while it "
            f"was resident), and the parameter is offloaded to NVMe and not resident now, so {what} cannot read it: "
            "its memory is gone. Keep a copy instead (.clone() while the parameter is resident, e.g. inside the "
            "forward), or read it inside `with offload.params.materialized(model):`"
        )
    if _in_ddp_constructor():
        return (
            f"DistributedDataParallel reads every weight when it is built (to broadcast rank 0's), and parameter "
            f"{t.__dict__.get('_nvme_name', '?')} is offloaded to NVMe. Wrap the model first, then offload: "
            "ddp_model = DistributedDataParallel(model); offload_parameters(ddp_model.module, nvme_path=..., "
            "offload_grads=False) (DDP reduces gradients in its own buckets, so they stay ordinary tensors)"
        )
    return (
        f"parameter {t.__dict__.get('_nvme_name', '?')} is offloaded to NVMe and not resident now, so "
        f"{what} cannot read it; read it inside `with offload.params.materialized(model):`, or, if a "
        "module other than its owner uses it in its forward, declare that with "
        "offload.params.register_external_parameter(module, param)"
    )


_DDP_SOURCE = os.path.join("nn", "parallel", "distributed.py")


def _in_ddp_constructor() -> bool:
    """Whether the call being refused comes from DistributedDataParallel's constructor (on an error path only)."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "__init__" and code.co_filename.endswith(_DDP_SOURCE):
            return True
        frame = frame.f_back
    return False


class OffloadedParameter(nn.Parameter):
    """The class of an offloaded parameter: a ``Parameter`` whose use while released raises.

    ``isinstance(p, nn.Parameter)`` holds; shape, dtype, device and requires_grad stay truthful. Any
    torch function given a released one raises ``RuntimeError`` naming the parameter and the fix.
    """

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _guard(func, args, kwargs)

    def _nvme_is_resident(self) -> bool:
        return self.__dict__.get("_nvme_resident", True)

    def __repr__(self) -> str:
        if self._nvme_is_resident():
            return super().__repr__()
        return (f"OffloadedParameter({self.__dict__.get('_nvme_name', '?')}, shape={tuple(self.shape)}, "
                f"dtype={self.dtype}, device={self.device}, requires_grad={self.requires_grad}: "
                "on NVMe, not resident)")

    def __format__(self, spec: str) -> str:
        return super().__format__(spec) if self._nvme_is_resident() else format(repr(self), spec)

    def _nvme_data(self, func) -> torch.Tensor:
        """A plain tensor of this parameter's memory, for ``func``; raises if the parameter is released."""
        if not self._nvme_is_resident():
            raise RuntimeError(_message(self, func))
        with torch._C.DisableTorchFunctionSubclass():
            return self.data

    def __deepcopy__(self, memo):
        # A copy is an ordinary Parameter: it belongs to no store. Reading a released one raises.
        if id(self) in memo:
            return memo[id(self)]
        data = self._nvme_data(_T.__deepcopy__)
        out = nn.Parameter(data.clone(memory_format=torch.preserve_format), self.requires_grad)
        memo[id(self)] = out
        return out

    def __reduce_ex__(self, proto):
        return nn.Parameter(self._nvme_data(_T.__reduce_ex__), self.requires_grad).__reduce_ex__(proto)


class OffloadedGrad(torch.Tensor):
    """What ``p.grad`` holds while an offloaded parameter's gradient lives in the grad store.

    No storage behind it (a one-element tensor expanded to the parameter's shape). Metadata reads
    work; ``zero_()`` marks the stored gradient zero; any other torch use raises ``RuntimeError``.
    """

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _guard(func, args, kwargs)

    def _nvme_zero(self) -> None:
        p = self._nvme_param()
        on_zero = self._nvme_on_zero()
        if p is not None and p.grad is self and on_zero is not None:
            on_zero(p)

    def __repr__(self) -> str:
        return (f"OffloadedGrad(of {self._nvme_name}, shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"device={self.device}: in the grad store on NVMe)")

    def __format__(self, spec: str) -> str:
        return format(repr(self), spec)


def make_placeholder(param: torch.Tensor, name: str, on_zero) -> OffloadedGrad:
    """A gradient placeholder for ``param``: same shape, dtype and device, one element of storage.

    ``on_zero(param)`` (a bound method, held weakly) is called when the placeholder is zeroed in place.
    """
    with torch._C.DisableTorchFunctionSubclass():
        base = torch.zeros((), dtype=param.dtype, device=param.device).expand(param.shape)
    ph = base.as_subclass(OffloadedGrad)
    ph._nvme_name = name
    ph._nvme_param = weakref.ref(param)
    ph._nvme_on_zero = weakref.WeakMethod(on_zero)
    return ph


class OffloadedView(torch.Tensor):
    """A tensor sharing an offloaded parameter's memory: a view (``w[0]``, ``w.t()``, ``w.view(...)``),
    ``w.detach()`` or ``w.data``, taken while the parameter was resident.

    It is an ordinary tensor while the parameter is resident (and again after a fetch: it sees the
    fetched bytes); once the parameter is released any torch call that reads it raises ``RuntimeError``
    naming the parameter, instead of reading freed memory. Copies of it (``clone()``, ``copy.deepcopy``,
    pickling) are plain tensors.
    """

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _guard(func, args, kwargs)

    def _plain(self, func) -> torch.Tensor:
        """A plain tensor sharing this one's memory, for ``func``; raises if the parameter is released."""
        if _view_released(self):
            raise RuntimeError(_message(self, func))
        with torch._C.DisableTorchFunctionSubclass():
            return self.as_subclass(_T)

    def __repr__(self) -> str:
        if _view_released(self):
            return (f"OffloadedView(of {self._nvme_name}, shape={tuple(self.shape)}, dtype={self.dtype}, "
                    f"device={self.device}: its parameter is on NVMe, not resident)")
        return repr(self._plain(_T.__repr__))

    def __format__(self, spec: str) -> str:
        return repr(self) if _view_released(self) else format(self._plain(_T.__format__), spec)

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        import copy

        out = copy.deepcopy(self._plain(_T.__deepcopy__), memo)
        memo[id(self)] = out
        return out

    def __reduce_ex__(self, proto):
        return self._plain(_T.__reduce_ex__).__reduce_ex__(proto)
