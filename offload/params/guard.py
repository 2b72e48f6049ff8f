"""Guarded tensor classes: a released parameter, or an offloaded gradient, raises instead of crashing."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

__all__ = ["OffloadedGrad", "OffloadedParameter"]

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
        "register_hook", "register_post_accumulate_grad_hook", "get_device", "type", "__hash__",
        "detach_", "retain_grad", "is_pinned", "is_shared", "__len__", "is_inference",
    ) if hasattr(_T, name)]
    # New tensors shaped like the argument read none of its elements.
    + [torch.empty_like, torch.zeros_like, torch.ones_like, torch.full_like, torch.rand_like, torch.randn_like]
)
_ZERO = frozenset([_T.zero_, torch._foreach_zero_])


def _run(func, args, kwargs):
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def _blocked(value: Any):
    """The first released parameter or gradient placeholder in ``value`` (one level of lists), or None."""
    t = type(value)
    if t is OffloadedParameter:
        return None if value.__dict__.get("_nvme_resident", True) else value
    if t is OffloadedGrad:
        return value
    if t is list or t is tuple:
        for v in value:
            tv = type(v)
            if (tv is OffloadedParameter and not v.__dict__.get("_nvme_resident", True)) or tv is OffloadedGrad:
                return v
    return None


# NOTE: a released parameter's storage is resized to zero bytes (autograd's saved views share it, so
# the memory really is freed and a fetch regrows the same storage). Its shape still says otherwise, so
# any kernel that reads it would read freed memory and crash the process. Offloaded parameters
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
    for a in args:
        bad = _blocked(a)
        if bad is not None:
            raise RuntimeError(_message(bad, func))
    for a in kwargs.values():
        bad = _blocked(a)
        if bad is not None:
            raise RuntimeError(_message(bad, func))
    return _run(func, args, kwargs)


def _zero(func, args, kwargs):
    """``zero_()`` of gradient placeholders marks their stored gradients zero; other tensors are zeroed."""
    target = args[0] if args else kwargs.get("self", kwargs.get("tensors"))
    many = isinstance(target, (list, tuple))
    items = list(target) if many else [target]
    rest = []
    for t in items:
        if type(t) is OffloadedGrad:
            t._nvme_zero()
        elif type(t) is OffloadedParameter and not t.__dict__.get("_nvme_resident", True):
            raise RuntimeError(_message(t, func))
        else:
            rest.append(t)
    if many:
        if rest:
            _run(func, (rest,), {})
        return None
    return target if not rest else _run(func, args, kwargs)


def _message(t, func) -> str:
    what = getattr(func, "__name__", repr(func))
    if type(t) is OffloadedGrad:
        return (
            f"the gradient of parameter {t._nvme_name} is offloaded to NVMe (offload_parameters(..., "
            f"offload_grads=True)), so torch's {what} cannot read it. Read it with "
            "offload.params.load_grad(param), clip with offload.params.clip_grad_norm_(model, max_norm), "
            "step with OffloadedAdam/OffloadedAdamW, or pass offload_grads=False to keep ordinary gradients"
        )
    return (
        f"parameter {t.__dict__.get('_nvme_name', '?')} is offloaded to NVMe and not resident now, so "
        f"{what} cannot read it; read it inside `with offload.params.materialized(model):`, or, if a "
        "module other than its owner uses it in its forward, declare that with "
        "offload.params.register_external_parameter(module, param)"
    )


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

    def __deepcopy__(self, memo):
        # A copy is an ordinary Parameter: it belongs to no store. Reading a released one raises.
        if id(self) in memo:
            return memo[id(self)]
        out = nn.Parameter(self.data.clone(memory_format=torch.preserve_format), self.requires_grad)
        memo[id(self)] = out
        return out

    def __reduce_ex__(self, proto):
        return nn.Parameter(self.data, self.requires_grad).__reduce_ex__(proto)


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
