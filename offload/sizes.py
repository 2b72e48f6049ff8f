"""Sizes and counts: size constants, one ``round_up``, and sizes and counts written for humans."""

from __future__ import annotations

import numbers
import re
from fractions import Fraction

__all__ = ["ALIGNMENT", "GIB", "KIB", "MIB", "format_size", "parse_count", "parse_size", "round_up"]

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30
# Direct I/O alignment assumed until a file system says otherwise (statx): every extent offset and
# length, every buffer address and every checkpoint data offset is a multiple of it.
ALIGNMENT = 4096
_KIB = KIB
_SIZE_UNITS = {
    "": 1, "b": 1, "byte": 1, "bytes": 1,
    "k": _KIB, "ki": _KIB, "kib": _KIB, "kb": 10**3,
    "m": _KIB**2, "mi": _KIB**2, "mib": _KIB**2, "mb": 10**6,
    "g": _KIB**3, "gi": _KIB**3, "gib": _KIB**3, "gb": 10**9,
    "t": _KIB**4, "ti": _KIB**4, "tib": _KIB**4, "tb": 10**12,
    "p": _KIB**5, "pi": _KIB**5, "pib": _KIB**5, "pb": 10**15,
    "e": _KIB**6, "ei": _KIB**6, "eib": _KIB**6, "eb": 10**18,
}  # fmt: skip
_COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "b": 10**9, "t": 10**12}

# A number (sign, digits with optional "_" separators, fraction, exponent) then an optional unit word.
_NUMBER_AND_UNIT = re.compile(
    r"\s*(?P<number>[+-]?(?:\d(?:_?\d)*(?:\.\d*)?|\.\d+)(?:[eE](?P<exp>[+-]?\d+))?)\s*(?P<unit>[A-Za-z]*)\s*"
)
# Exponents beyond this are typos, and 10**huge would take the interpreter a long time to build.
_MAX_EXPONENT = 30

_SIZE_EXAMPLES = '"4096", "4 KiB", "512MiB", "1G", "1.5GiB", "100MB" or "1e8"'
_COUNT_EXAMPLES = '"4096", "64M", "1.5G", "7B" or "1e8"'
_SIZE_UNIT_NAMES = "B, K/KiB, M/MiB, G/GiB, T/TiB, P/PiB, E/EiB (binary) or KB, MB, GB, TB, PB, EB (decimal)"
_COUNT_UNIT_NAMES = "K (1e3), M (1e6), G or B (1e9), T (1e12)"


# NOTE: two different conventions live here on purpose:
#
# * **Sizes** (bytes) follow what storage people type: ``KiB``/``MiB``/``GiB``/``TiB``/``PiB`` and the bare
#   letters ``K``/``M``/``G``/``T`` are binary (powers of 1024, as in fio, dd and ``torch`` memory stats);
#   ``KB``/``MB``/``GB``/``TB`` are decimal (powers of 1000, as on a drive's label).
# * **Counts** (numbers of parameters or elements) are decimal: ``K`` = 1e3, ``M`` = 1e6, ``G`` or ``B``
#   (billion) = 1e9, ``T`` = 1e12, as in "a 7B model".
#
# Both accept plain integers, decimal fractions and exponents (``"1.5GiB"``, ``"1e8"``), as long as the
# result is a whole number; anything else raises ``ValueError`` naming the text.
def parse_size(value: int | str) -> int:
    """Parse a byte size written for humans.

    Args:
        value: a non-negative ``int``, or a string: a number (``"1048576"``, ``"1e8"``, ``"1.5"``) with
            an optional unit, spaces allowed between them. Units, case-insensitive: ``B``;
            ``K``/``Ki``/``KiB``, ``M``/``Mi``/``MiB``, ``G``/``Gi``/``GiB``, ``T``/``Ti``/``TiB``,
            ``P``/``Pi``/``PiB``, ``E``/``Ei``/``EiB`` (binary, powers of 1024); ``KB``, ``MB``, ``GB``,
            ``TB``, ``PB``, ``EB`` (decimal, powers of 1000).

    Returns:
        The number of bytes.

    Raises:
        ValueError: the text is not a size, names an unknown unit, is negative, or is not a whole number
            of bytes (``"0.3K"``). The message quotes the text.
        TypeError: ``value`` is neither an ``int`` nor a string (a ``float`` is refused so that a
            rounded value never turns silently into a size).
    """
    return _parse(value, _SIZE_UNITS, "size", "bytes", _SIZE_EXAMPLES, _SIZE_UNIT_NAMES)


def parse_count(value: int | float | str) -> int:
    """Parse a count of parameters or elements, with decimal suffixes.

    Args:
        value: a non-negative ``int``; a ``float`` holding a whole number (DeepSpeed configs write element
            counts as ``1e8``); or a string: a number with an optional suffix, case-insensitive,
            ``K`` (1e3), ``M`` (1e6), ``G`` or ``B`` (1e9), ``T`` (1e12), e.g. ``"64M"``, ``"1.5G"``,
            ``"7B"``, ``"1e8"``.

    Returns:
        The count.

    Raises:
        ValueError: the text is not a count, is negative, or is not a whole number (``"1.5"``).
        TypeError: ``value`` is not a number or a string.
    """
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")) or not value.is_integer():
            raise ValueError(f"invalid count {value!r}: not a whole number")
        value = int(value)
    return _parse(value, _COUNT_UNITS, "count", "", _COUNT_EXAMPLES, _COUNT_UNIT_NAMES)


def round_up(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple`` (a positive int)."""
    return -(-n // multiple) * multiple


def format_size(nbytes: int) -> str:
    """Format a byte count with binary units, the way :func:`parse_size` reads it back.

    Args:
        nbytes: a number of bytes (negative values keep their sign, for differences).

    Returns:
        ``"512 B"`` below 1 KiB, otherwise two decimals and the largest unit that keeps the number
        at least 1: ``"1.00 GiB"``, ``"1.50 MiB"``, ``"4.00 KiB"``.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Integral):
        raise TypeError(f"format_size expects an int number of bytes, got {nbytes!r}")
    sign = "-" if nbytes < 0 else ""
    n = abs(int(nbytes))
    if n < _KIB:
        return f"{sign}{n} B"
    units = ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
    scale, unit = _KIB, 0
    while unit + 1 < len(units) and n >= scale * _KIB:
        scale, unit = scale * _KIB, unit + 1
    # Rounding can carry into the next unit (1 MiB - 1 B is "1024.00 KiB" at two decimals).
    if round(n / scale, 2) >= _KIB and unit + 1 < len(units):
        scale, unit = scale * _KIB, unit + 1
    return f"{sign}{n / scale:.2f} {units[unit]}"


def _parse(value, units: dict[str, int], what: str, of: str, examples: str, unit_names: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, str)):
        raise TypeError(
            f"a {what} must be an int or a string such as {examples}; got {value!r} ({type(value).__name__})"
        )
    if not isinstance(value, str):
        if value < 0:
            raise ValueError(f"invalid {what} {value!r}: must not be negative")
        return int(value)
    m = _NUMBER_AND_UNIT.fullmatch(value)
    if m is None:
        raise ValueError(f"invalid {what} {value!r}: expected a number and an optional unit, e.g. {examples}")
    unit = m["unit"].lower()
    if unit not in units:
        raise ValueError(f"invalid {what} {value!r}: unknown unit {m['unit']!r}; use {unit_names} (any case)")
    if m["exp"] is not None and abs(int(m["exp"])) > _MAX_EXPONENT:
        raise ValueError(f"invalid {what} {value!r}: exponent out of range")
    amount = Fraction(m["number"].replace("_", "")) * units[unit]
    if amount < 0:
        raise ValueError(f"invalid {what} {value!r}: must not be negative")
    if amount.denominator != 1:
        whole = f"a whole number of {of}" if of else "a whole number"
        raise ValueError(f"invalid {what} {value!r}: not {whole} ({float(amount):g})")
    return int(amount)
