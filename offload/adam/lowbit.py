"""The update of 8-bit state and of bf16 weights without an fp32 master: torchao's AdamW8bit formula, on chunks.

Two implementations of one formula: :func:`reference_step`, torch's element-wise operations in torchao's
order (any device; the oracle), and the native kernel (``offload._kernels``, host memory; about 20x faster on
a CPU), which equals it bit for bit. Which one runs is the caller's choice by device (:func:`step_chunk`).
"""

from __future__ import annotations

import platform
import threading
from dataclasses import dataclass
from typing import Optional

import torch

from .. import codes
from .._native import kernels_ffi, kernels_lib

__all__ = ["Constants", "constants", "reference_step", "round_bf16", "step_chunk", "stream_key"]

_MASK32 = 0xFFFFFFFF
_MASK64 = (1 << 64) - 1
_DTYPES = {torch.float32: kernels_lib.OFL_DTYPE_F32, torch.bfloat16: kernels_lib.OFL_DTYPE_BF16,
           torch.float16: kernels_lib.OFL_DTYPE_F16}
_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


# NOTE: the scalars of a step are computed here with torch's fp32 0-dim tensors exactly as torchao computes
# them (lr as an fp32 tensor, 1 - beta ** step with step an fp32 tensor), then handed to both implementations
# as fp32 values: so the kernel multiplies by the very numbers the reference does.
@dataclass(frozen=True)
class Constants:
    """One group's scalars at one step, as fp32 tensors (0-dim) and flags."""

    lr: torch.Tensor
    lr_wd: torch.Tensor  # lr * weight_decay (AdamW)
    wd: float
    w1: float  # 1 - beta1, lerp's weight
    w2: float
    bc1: torch.Tensor  # 1 - beta1 ** step
    bc2_sqrt: torch.Tensor
    eps: float
    adamw: bool
    amsgrad: bool
    maximize: bool


def constants(group: dict, step: float) -> Constants:
    """``group``'s scalars for the update that makes its count ``step`` (1 for the first)."""
    beta1, beta2 = group["betas"]
    lr = torch.as_tensor(group["lr"], dtype=torch.float32).detach().cpu()
    count = torch.tensor(float(step), dtype=torch.float32)
    wd = float(group["weight_decay"])
    return Constants(lr=lr, lr_wd=lr * wd, wd=wd, w1=1 - beta1, w2=1 - beta2, bc1=1 - beta1 ** count,
                     bc2_sqrt=(1 - beta2 ** count).sqrt(), eps=float(group["eps"]),
                     adamw=bool(group["decoupled_weight_decay"]), amsgrad=bool(group["amsgrad"]),
                     maximize=bool(group["maximize"]))


def stream_key(seed: int, param: int, step: int) -> tuple[int, int]:
    """The two 32-bit keys of the random stream that rounds parameter number ``param`` at step ``step``.

    A counter-based stream (element ``i`` of it is a hash of the keys and ``i``), so a run resumed from a
    checkpoint draws what the uninterrupted run drew, whatever the chunking, device or thread count.
    """
    h = _splitmix64(_splitmix64(_splitmix64(seed & _MASK64) ^ (param & _MASK64)) ^ (step & _MASK64))
    return h & _MASK32, h >> 32


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


# -- the formula in torch operations ----------------------------------------------------------------

def reference_step(c: Constants, param: torch.Tensor, grad: torch.Tensor, state: dict, *,
                   first: int = 0, key: Optional[tuple[int, int]] = None) -> None:
    """One step of torchao's ``single_param_adam`` over 1-D tensors, in place.

    Args:
        c: the group's scalars at this step.
        param: fp32 weights (a master or an fp32 parameter), or bf16 weights without a master (rounded
            stochastically with the stream ``key`` at elements ``first + i``).
        grad: the gradient (any float dtype).
        state: ``{"exp_avg": ..., "exp_avg_sq": ...}`` (and ``"max_exp_avg_sq"`` with amsgrad): fp32 tensors,
            or uint8 codes with their ``"<key>_absmax"``.
    """
    dev = param.device
    p = param.float()
    g = grad.float()
    if c.maximize:
        g = -g
    if c.adamw:
        p = p - c.lr_wd.to(dev) * p
    else:
        g = g + c.wd * p
    m = _load(state, "exp_avg").lerp(g, c.w1)
    v = _load(state, "exp_avg_sq").lerp(g.square(), c.w2)
    _store(state, "exp_avg", m)
    _store(state, "exp_avg_sq", v)
    if c.amsgrad:
        v = torch.maximum(_load(state, "max_exp_avg_sq"), v)
        _store(state, "max_exp_avg_sq", v)
    denom = (v.sqrt() / c.bc2_sqrt.to(dev)) + c.eps
    p = p - c.lr.to(dev) * (m / c.bc1.to(dev)) / denom
    if param.dtype == torch.float32:
        param.copy_(p)
    else:
        param.copy_(round_bf16(p, first=first, key=key))


def _load(state: dict, key: str) -> torch.Tensor:
    t = state[key]
    if t.dtype == torch.uint8:
        return codes.dequantize(t, state[key + "_absmax"], signed=codes.signed_for(key))
    return t.float()


def _store(state: dict, key: str, values: torch.Tensor) -> None:
    t = state[key]
    if t.dtype == torch.uint8:
        q, absmax = codes.quantize(values, signed=codes.signed_for(key))
        t.copy_(q)
        state[key + "_absmax"].copy_(absmax)
    else:
        t.copy_(values)


def round_bf16(x: torch.Tensor, *, first: int = 0, key: Optional[tuple[int, int]] = None) -> torch.Tensor:
    """fp32 ``x`` (1-D) rounded to bf16 stochastically: toward zero, or away from it with the probability of
    the 16 bits dropped (torchao's rule, so the rounding is unbiased), with the stream ``key`` at elements
    ``first + i``. On the CPU the native kernel draws the same stream."""
    key = key or (0, 0)
    x = x.float().reshape(-1).contiguous()
    if x.device.type == "cpu":
        out = torch.empty(x.numel(), dtype=torch.bfloat16)
        rc = kernels_lib.ofl_round_bf16(_ptr("float *", x), _ptr("uint16_t *", out), x.numel(), first, key[0], key[1],
                                        torch.get_num_threads())
        _check(rc)
        return out
    bits = x.view(torch.int32).long() & _MASK32
    index = torch.arange(first, first + x.numel(), device=x.device, dtype=torch.int64)
    rand = random16(key, index)
    trunc = bits & 0xFFFF0000
    out = torch.where(rand < (bits & 0xFFFF), trunc + 0x10000, trunc) & _MASK32
    return _bf16_from_upper(out)


def _bf16_from_upper(bits: torch.Tensor) -> torch.Tensor:
    """bf16 values whose bits are the upper halves of the 32-bit patterns ``bits`` (int64 holding uint32)."""
    signed = torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32)
    return signed.view(torch.float32).bfloat16()  # exact: the lower 16 bits are zero


def random16(key: tuple[int, int], index: torch.Tensor) -> torch.Tensor:
    """The stream's 16 random bits at ``index`` (int64), as the native kernel draws them (``ofl_random16``)."""
    lo = index & _MASK32
    hi = (index >> 32) & _MASK32
    return _lowbias32(_lowbias32(lo ^ key[0]) ^ key[1] ^ hi) >> 16


def _lowbias32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x < 2**32 held in int64, without overflowing it: c in two 16-bit halves."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _MASK32


# -- the native kernel ------------------------------------------------------------------------------

def native_step(c: Constants, param: torch.Tensor, grad: torch.Tensor, state: dict, *, first: int = 0,
                key: Optional[tuple[int, int]] = None) -> None:
    """:func:`reference_step` by the native kernel: host tensors, each contiguous and 1-D.

    In slices of :data:`_SLICE` elements, each in two native passes with torch's square root between them
    (see ``ofl_adam_moments``): the scratch is two fp32 slices, whatever the chunk's size.
    """
    args = kernels_ffi.new("ofl_adam_args *")
    n = args.n = param.numel()
    args.first = first
    if param.dtype == torch.float32:
        args.param = _ptr("float *", param)
    else:
        args.param_bf16 = _ptr("uint16_t *", param)
    args.grad = _ptr("void *", grad)
    args.grad_dtype = _DTYPES[grad.dtype]
    for j, name in enumerate(_KEYS[:3 if c.amsgrad else 2]):
        t = state[name]
        if t.dtype == torch.uint8:
            args.codes[j] = _ptr("uint8_t *", t)
            args.absmax[j] = _ptr("float *", state[name + "_absmax"])
        else:
            args.moment[j] = _ptr("float *", t)
    (signed, steps_signed), (unsigned, steps_unsigned) = _books()
    args.qmap_signed, args.steps_signed = _ptr("float *", signed), _ptr("uint32_t *", steps_signed)
    args.qmap_unsigned, args.steps_unsigned = _ptr("float *", unsigned), _ptr("uint32_t *", steps_unsigned)
    args.lr, args.lr_wd, args.wd = c.lr.item(), c.lr_wd.item(), c.wd
    args.w1, args.w2 = c.w1, c.w2
    args.bc1, args.bc2_sqrt, args.eps = c.bc1.item(), c.bc2_sqrt.item(), c.eps
    args.adamw, args.amsgrad, args.maximize = c.adamw, c.amsgrad, c.maximize
    args.fused = _FUSED
    args.key0, args.key1 = key or (0, 0)
    threads = torch.get_num_threads()
    scratch = torch.empty(2, min(n, _SLICE), dtype=torch.float32)
    m, second = _ptr("float *", scratch[0]), _ptr("float *", scratch[1])
    for lo in range(0, n, _SLICE):
        hi = min(n, lo + _SLICE)
        _check(kernels_lib.ofl_adam_moments(args, lo, hi, m, second, threads))
        root = scratch[1, :hi - lo]
        torch.sqrt(root, out=root)
        _check(kernels_lib.ofl_adam_apply(args, lo, hi, m, second, threads))


def step_chunk(c: Constants, param: torch.Tensor, grad: torch.Tensor, state: dict, *, first: int = 0,
               key: Optional[tuple[int, int]] = None) -> None:
    """One step over a chunk: the native kernel for host tensors, the reference elsewhere (a GPU)."""
    tensors = [param, grad, *state.values()]
    if all(t.device.type == "cpu" and t.is_contiguous() for t in tensors):
        native_step(c, param, grad, state, first=first, key=key)
    else:
        reference_step(c, param, grad, state, first=first, key=key)


# torch's vectorized lerp uses a fused multiply-add wherever its CPU kernels do (AVX2, AVX-512; NEON, which
# aarch64 builds vectorize with even at the DEFAULT capability); the kernel does the same so that the two
# agree on this machine.
_FUSED = torch.backends.cpu.get_cpu_capability() != "DEFAULT" or platform.machine() in ("aarch64", "arm64")
_SLICE = 1 << 20  # elements per native pass: a multiple of codes.BLOCK
_BOOKS: list = []
_BOOKS_LOCK = threading.Lock()  # the overlap worker and step() may ask first at once


def _books() -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """Per book (signed, unsigned): its values, and its step table (``steps_signed`` in offload_kernels.h)."""
    with _BOOKS_LOCK:
        if not _BOOKS:
            _BOOKS.append(tuple((codes.book(signed), _steps(signed)) for signed in (True, False)))
        return _BOOKS[0]


# NOTE: a code is a non-decreasing function of the value it encodes, so of its bits made sortable; it steps up
# 255 times between -1 and 1 (the only values a block divided by its absmax holds, and NaN). Each step is found
# here exactly, by bisection over the sortable bits with the reference quantize itself, and the kernel's table
# gives, for the upper 16 bits, the code of their lowest value and where within them the next step lies.
def _steps(signed: bool) -> torch.Tensor:
    """The step table of a book: int32 words as offload_kernels.h lays them out."""
    lo = torch.full((255,), _sortable(-1.0), dtype=torch.int64)
    hi = torch.full((255,), _sortable(1.0) + 1, dtype=torch.int64)
    goal = torch.arange(1, 256)
    ones = torch.ones(codes.blocks(255))
    while bool((hi - lo > 1).any()):  # invariant: code(lo) < goal <= code(hi), hi the first such
        mid = (lo + hi) // 2
        up = codes.quantize(_from_sortable(mid), signed, absmax=ones)[0].long() >= goal
        hi, lo = torch.where(up, mid, hi), torch.where(up, lo, mid)
    bucket = hi >> 16
    if bool((torch.bincount(bucket, minlength=1 << 16) > 1).any()):
        raise RuntimeError("two steps of a code book within 16 bits: the kernel's table cannot hold them")
    key = torch.arange(1 << 16, dtype=torch.int64)
    base = torch.searchsorted(hi, key << 16, right=True)  # steps at or below a bucket's lowest value
    step = torch.full((1 << 16,), 0x10000, dtype=torch.int64)
    inside = (hi & 0xFFFF) != 0  # a step at a bucket's lowest value is in its base already
    step[bucket[inside]] = hi[inside] & 0xFFFF
    base[key >= _sortable(float("inf")) >> 16] = 0  # NaN (and +inf, never a quotient) encode as 0
    word = base | (step << 8)
    return torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)


def _sortable(x: float) -> int:
    """The bits of fp32 ``x`` made sortable: their unsigned order is the values' order."""
    bits = int(torch.tensor(x, dtype=torch.float32).view(torch.int32).item()) & _MASK32
    return bits ^ 0x80000000 if bits < 0x80000000 else ~bits & _MASK32


def _from_sortable(s: torch.Tensor) -> torch.Tensor:
    """fp32 values of sortable bits held in int64 (the inverse of :func:`_sortable`)."""
    bits = torch.where(s >= 0x80000000, s ^ 0x80000000, ~s & _MASK32)
    return torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32).view(torch.float32)


def _ptr(kind: str, t: torch.Tensor):
    return kernels_ffi.cast(kind, t.data_ptr())


def _check(rc: int) -> None:
    if rc != 0:  # never the user's input: a chunk the library laid out wrongly
        raise RuntimeError(f"the native optimizer kernel refused its arguments (error {rc})")
