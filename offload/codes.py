"""8-bit block-wise state: Adam moments as one uint8 code per element and one fp32 absmax per block of 256.

The format of bitsandbytes' and torchao's 8-bit optimizers (Dettmers et al., "8-bit Optimizers via Block-wise
Quantization", arXiv:2110.02861): a block's values are divided by their largest magnitude (its *absmax*, at
least 1e-12) and each quotient is stored as the index of the nearest value of a 256-entry code book, the
*dynamic tree* map: a sign, a run of zeros giving a decimal exponent down to 1e-6, an indicator bit, and a
linear fraction in the bits left. ``exp_avg`` uses the signed book, ``exp_avg_sq`` (and ``max_exp_avg_sq``)
the unsigned one, which spends the sign bit on the fraction. 2.03 bytes per element for two moments.

Everything here is written with torch's element-wise operations, so it runs on any device; it is also the
reference the native kernel (``offload._kernels``) must equal bit for bit.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

__all__ = ["ABSMAX", "BLOCK", "MIN_NUMEL", "blocks", "book", "dequantize", "elements", "eligible", "encode", "quantize",
           "signed_for"]

BLOCK = 256
# Parameters with fewer elements keep fp32 moments (as bitsandbytes' and torchao's do): their state is small,
# and a block-wise scale over a few elements saves little.
MIN_NUMEL = 4096


def eligible(numel: int) -> bool:
    """Whether a parameter of ``numel`` elements keeps 8-bit moments: at least :data:`MIN_NUMEL` elements,
    in whole blocks (torchao's rule; others keep fp32 moments, updated by the same formula)."""
    return numel >= MIN_NUMEL and numel % BLOCK == 0


def blocks(numel: int) -> int:
    """Blocks (absmax values) for ``numel`` elements."""
    return -(-numel // BLOCK)


ABSMAX = "_absmax"  # the suffix of the state key holding a moment's absmax ("exp_avg_absmax")


def signed_for(key: str) -> bool:
    """Whether state ``key`` is coded with the signed book: the first moment is; the second (and its maximum,
    with amsgrad) never negative, uses the unsigned one."""
    return key == "exp_avg"


def elements(key: str, numel: int) -> int:
    """Elements state ``key`` holds for ``numel`` elements of its parameter: one per block for an absmax."""
    return blocks(numel) if key.endswith(ABSMAX) else numel


# NOTE: the book is built as the paper describes and bitsandbytes computes it, in fp32 (torch.linspace's own
# rounding included), so its 256 values are exactly those of both libraries; a test compares them. Level i
# (0..6) covers magnitudes [10^(i-6) * 0.1, 10^(i-6)]: the means of 2^i + 1 (signed) or 2^(i+1) + 1
# (unsigned) evenly spaced points, then 0 and 1 complete the book.
@functools.cache
def _book(signed: bool) -> tuple:
    values: list[float] = []
    for level in range(7):
        edges = torch.linspace(0.1, 1, 2 ** (level + (0 if signed else 1)) + 1, dtype=torch.float32)
        means = (edges[:-1] + edges[1:]) / 2.0
        scale = 10 ** (level - 6)
        values += (scale * means).tolist()
        if signed:
            values += (-scale * means).tolist()
    values += [0.0, 1.0]
    return tuple(sorted(values))


def book(signed: bool, device=None) -> torch.Tensor:
    """The 256 ascending values codes stand for: the signed book (``exp_avg``) or the unsigned one."""
    return torch.tensor(_book(signed), dtype=torch.float32, device=device)


def quantize(values: torch.Tensor, signed: bool,
             absmax: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and per-block absmax of fp32 ``values`` (1-D, blocks of :data:`BLOCK` from its first element; the
    last may be short).

    Args:
        values: the values.
        signed: which book (see :func:`book`).
        absmax: the blocks' absmax to use instead of computing it (loading values a dequantization made:
            with the scale they were made with, each value gets its code back).

    Returns:
        ``(codes, absmax)``: uint8 codes like ``values``, fp32 absmax of :func:`blocks` elements.
    """
    values = values.float().reshape(-1)
    n = values.numel()
    q = book(signed, values.device)
    if absmax is None:
        absmax = _absmax(values)
    scale = absmax.float().reshape(-1).repeat_interleave(BLOCK)[:n]
    x = values / scale
    # The largest code whose value is at most x, as a branch-free binary search, then the nearer of it and
    # the next (ties up): torchao's order of operations, which the native kernel follows.
    codes = torch.where(x >= q[128], 128, 0)
    for step in (64, 32, 16, 8, 4, 2, 1):
        codes += torch.where(x >= q[codes + step], step, 0)
    up = (codes + 1).clip(max=255)
    below = q[codes]
    codes = torch.where(x - below >= (q[up] - below) * 0.5, up, codes)
    return codes.to(torch.uint8), absmax


def dequantize(codes: torch.Tensor, absmax: torch.Tensor, signed: bool) -> torch.Tensor:
    """fp32 values of ``codes`` (1-D) with their blocks' ``absmax``."""
    codes = codes.reshape(-1)
    q = book(signed, codes.device)
    scale = absmax.float().reshape(-1).repeat_interleave(BLOCK)[:codes.numel()]
    return q[codes.long()] * scale


def _absmax(values: torch.Tensor) -> torch.Tensor:
    """Each block's largest magnitude, at least 1e-12 (NaN where the block holds one)."""
    n = values.numel()
    full = n // BLOCK * BLOCK
    parts = [values[:full].view(-1, BLOCK).abs().amax(-1)] if full else []
    if full < n:
        parts.append(values[full:].abs().amax().reshape(1))
    out = torch.cat(parts) if parts else values.new_empty(0)
    return out.clip(1e-12)


# NOTE: state_dict() gives 8-bit moments dequantized (torch's layout), so loading one must find each block's
# scale again for its codes to come back. A block's absmax is its largest magnitude, whose quotient is 1 or -1:
# 1 has a code whose value is 1, so then the dequantized block's largest magnitude is the absmax itself, and
# quantizing as usual gives every value back. -1 has none (the signed book's lowest value is -0.993): when a
# block's extreme was negative, its absmax is a scale s with fl(book[0] * s) equal to the block's lowest value,
# found by division and the neighbouring floats, the one that gives every value back. A block for which none
# does was not made by a dequantization, and is quantized as any values are.
def encode(values: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and absmax of fp32 ``values`` (1-D): where a block holds the dequantization of some codes, those
    codes and their absmax; elsewhere :func:`quantize`'s."""
    values = values.float().reshape(-1)
    n = values.numel()
    out, scale = quantize(values, signed)
    done = _blocks_equal(dequantize(out, scale, signed), values)
    if not signed or bool(done.all()):
        return out, scale
    lowest = _block_extremes(values)
    q0 = book(True, values.device)[0]
    guess = lowest / q0
    for candidate in (guess, torch.nextafter(guess, torch.full_like(guess, float("inf"))),
                      torch.nextafter(guess, torch.zeros_like(guess))):
        tried = ~done & (q0 * candidate == lowest)
        if not bool(tried.any()):
            continue
        again, _ = quantize(values, signed, absmax=torch.where(tried, candidate, scale))
        hit = tried & _blocks_equal(dequantize(again, candidate, signed), values)
        out = torch.where(hit.repeat_interleave(BLOCK)[:n], again, out)
        scale = torch.where(hit, candidate, scale)
        done |= hit
    return out, scale


def _block_extremes(values: torch.Tensor) -> torch.Tensor:
    """Each block's lowest value."""
    pad = blocks(values.numel()) * BLOCK - values.numel()
    return torch.cat([values, values.new_full((pad,), float("inf"))]).view(-1, BLOCK).amin(-1)


def _blocks_equal(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per block, whether ``a`` and ``b`` hold the same values (bit for bit but for the sign of zero)."""
    pad = blocks(a.numel()) * BLOCK - a.numel()
    same = torch.cat([a == b, a.new_ones(pad, dtype=torch.bool)])
    return same.view(-1, BLOCK).all(-1)
