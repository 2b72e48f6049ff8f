"""What each configuration key accepts: one rule table per block, the checks, and the wording of problems."""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import numbers
import os
from collections.abc import Iterable, Mapping
from typing import Any

from ..errors import ConfigError
from ..sizes import ALIGNMENT, format_size, parse_count, parse_size

__all__ = [
    "ALIASES",
    "BLOCKS",
    "BOOL",
    "BUFFER_COUNT",
    "BYTES",
    "BLOCK_BYTES",
    "COUNT",
    "DEVICE",
    "IGNORED",
    "PATHS",
    "PIN",
    "POSITIVE_COUNT",
    "DEFAULT",
    "Rule",
    "check",
    "convert",
    "did_you_mean",
    "raise_if",
    "show",
]

BLOCKS = ("aio", "offload_optimizer", "offload_param")

# NOTE: upper bounds are limits that are certain, not tuning advice: past them a value is a typo or an
# attack, never a setting that works. Linux moves at most 2 GiB - 4 KiB per read or write call, so a
# request piece stays at or below 1 GiB; element counts are int64 in torch (numel) and byte sizes are
# int64 in the kernel (off_t, ssize_t); a pool of more than a few thousand buffers gains nothing (a
# read, an update and a write in flight need 3) and was, in practice, 10**6 typed for 10**6 bytes.
# Whether a pool of buffer_count x buffer_size bytes fits this machine's memory is checked where the
# pool is allocated (offload.buffers), since only there is the machine known.
MAX_BLOCK_SIZE = 1 << 30
INT64_MAX = (1 << 63) - 1
MAX_BYTES = INT64_MAX - INT64_MAX % ALIGNMENT
MAX_BUFFERS = 4096
_INT64 = "the largest int64"
_INT64_BYTES = "the largest aligned int64 byte count"
_BUFFERS = "the pool is buffer_count x buffer_size of host memory; 3 to 8 buffers are typical"


@dataclasses.dataclass(frozen=True)
class Rule:
    """What one key accepts.

    Attributes:
        kind: "bytes", "int", "count", "bool", "choice", "o_direct", "paths", "ratio", "cache" (bytes, or
            the string "auto") or "pin" (true, false or "auto").
        lo, hi: inclusive bounds of a number (``None``: unbounded on that side).
        why_hi: said after ``hi`` in a message, when the bound is not self-evident.
        multiple: a number must be a multiple of this.
        choices: the values of a "choice".
        auto: what an HF-style ``"auto"`` string means for this key: "value" (a real value of the key),
            "default" (the documented default), or an error message saying what to write instead.
    """

    kind: str
    lo: int | None = None
    hi: int | None = None
    why_hi: str = ""
    multiple: int | None = None
    choices: tuple = ()
    auto: str = "default"


_BOOL_AUTO = "write true or false"
_DEVICE_AUTO = 'name the device: "nvme", or "cpu" for state in host memory'
_PATH_AUTO = "give a directory on the NVMe drive, or a list of directories, one per drive"
_DEVICES = ("nvme", "cpu", "none")

# The rules keys share; each key's own is declared with its field (offload.config.blocks).
BOOL = Rule("bool", auto=_BOOL_AUTO)
DEVICE = Rule("choice", choices=_DEVICES, auto=_DEVICE_AUTO)
PATHS = Rule("paths", auto=_PATH_AUTO)
BUFFER_COUNT = Rule("int", lo=2, hi=MAX_BUFFERS, why_hi=_BUFFERS)
BYTES = Rule("bytes", lo=ALIGNMENT, hi=MAX_BYTES, why_hi=_INT64_BYTES, multiple=ALIGNMENT)
BLOCK_BYTES = Rule("bytes", lo=ALIGNMENT, hi=MAX_BLOCK_SIZE, multiple=ALIGNMENT)
COUNT = Rule("count", lo=0, hi=INT64_MAX, why_hi=_INT64)
POSITIVE_COUNT = Rule("count", lo=1, hi=INT64_MAX, why_hi=_INT64)
PIN = Rule("pin", auto="value")

# DeepSpeed renamed thread_count to intra_op_parallelism (2025) without an alias; both mean the same.
ALIASES = {"aio": {"intra_op_parallelism": "thread_count"}, "offload_optimizer": {}, "offload_param": {}}
# Keys of DeepSpeed's blocks that change nothing here: checked (rule, why it changes nothing), then
# dropped, so a ds_config.json that sets them loads as it is.
IGNORED = {
    "aio": {},
    "offload_optimizer": {
        "fast_init": (BOOL, "accepted from DeepSpeed files and ignored: swap files are always preallocated."),
        "ratio": (Rule("ratio"), "accepted from DeepSpeed files when 1.0: all optimizer state is offloaded."),
    },
    "offload_param": {},
}

DEFAULT = object()  # what convert() returns when "auto" chose the key's default


def convert(rule: Rule, name: str, raw: Any) -> tuple[Any, str | None]:
    """A value read from a file or mapping -> (Python value, None) or (None, problem).

    Files may write human sizes (``"64MiB"``), counts as ``1e8`` or ``"100M"``, and HF-style ``"auto"``;
    the result then goes through :func:`check`, the dataclasses' own check.
    """
    if isinstance(raw, str) and raw.strip().lower() == "auto":
        if rule.auto == "default":
            return DEFAULT, None
        if rule.auto != "value":
            return None, f'"auto" is not accepted here: {rule.auto}'
        raw = "auto"
    if rule.kind == "cache" and isinstance(raw, str) and raw != "auto":
        try:
            raw = parse_size(raw)
        except ValueError as err:
            return None, f'{err}; or write "auto"'
    if rule.kind == "bytes":
        if isinstance(raw, str):
            try:
                raw = parse_size(raw)
            except ValueError as err:
                return None, str(err)
        elif isinstance(raw, float):
            return None, f'must be a number of bytes as an integer or a size such as "1MiB", got {show(raw)}'
    elif rule.kind == "count":
        if isinstance(raw, (str, float)):
            try:
                raw = parse_count(raw)
            except ValueError as err:
                return None, str(err)
    elif rule.kind == "paths" and isinstance(raw, os.PathLike):
        raw = os.fspath(raw)
    return check(rule, name, raw)


def check(rule: Rule, name: str, value: Any) -> tuple[Any, str | None]:
    """A Python value -> (normalized value, None) or (None, problem)."""
    kind = rule.kind
    if kind in ("bytes", "int", "count"):
        return _check_number(rule, value)
    if kind == "bool":
        if not isinstance(value, bool):
            return None, f"must be true or false, got {show(value)}"
        return value, None
    if kind == "choice":
        if value not in rule.choices or not isinstance(value, str):
            options = ", ".join(json.dumps(c) for c in rule.choices)
            hint = did_you_mean(value.lower(), rule.choices) if isinstance(value, str) else ""
            return None, f"must be one of {options}, got {show(value)}{hint}"
        return value, None
    if kind in ("o_direct", "pin"):
        if value is True or value is False or value == "auto":
            return value, None
        return None, f'must be "auto", true or false (without quotes), got {show(value)}'
    if kind == "paths":
        return _check_paths(value)
    if kind == "cache":
        if value == "auto":
            return value, None
        return _check_number(Rule("bytes", lo=0, hi=MAX_BYTES, why_hi=_INT64_BYTES), value)
    if kind == "ratio":
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return None, f"must be a number in (0, 1], got {show(value)}"
        value = float(value)
        if not 0.0 < value <= 1.0:
            return None, f"must be in (0, 1], got {value!r}"
        if value != 1.0:
            return None, (
                f"only 1.0 is supported, got {value!r}: all optimizer state is offloaded; keeping a "
                "fraction of it on the GPU (DeepSpeed's partial offload) is not implemented"
            )
        return value, None
    raise AssertionError(f"no rule kind {kind!r}")  # a bug in the tables above, never user input


def _check_number(rule: Rule, value: Any) -> tuple[Any, str | None]:
    kind = rule.kind
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        unit = " of bytes" if kind == "bytes" else ""
        return None, f"must be an integer number{unit}, got {show(value)}"
    value = int(value)
    shown = _bytes_text(value) if kind == "bytes" and value >= 1024 else _int_text(value)
    low = rule.lo is not None and value < rule.lo
    high = rule.hi is not None and value > rule.hi
    if rule.why_hi:
        # A far bound with a reason (int64, pool sizes): each side is its own message.
        if low:
            return None, f"must be at least {rule.lo}, got {shown}"
        if high:
            assert rule.hi is not None  # high: above it
            hi = format_size(rule.hi) if kind == "bytes" else str(rule.hi)
            return None, f"must be at most {hi} ({rule.why_hi}), got {shown}"
    elif low and rule.hi is None:
        return None, f"must be at least {rule.lo}, got {shown}"
    elif low or high:
        assert rule.hi is not None  # low without a high bound was the branch above
        hi = _bytes_text(rule.hi) if kind == "bytes" else str(rule.hi)
        return None, f"must be between {rule.lo} and {hi}, got {shown}"
    if rule.multiple and value % rule.multiple:
        down = value - value % rule.multiple
        up = down + rule.multiple
        near = f"{down} or {up}" if down else str(up)
        return None, f"must be a multiple of {rule.multiple} (for direct I/O), got {value}; try {near}"
    return value, None


def _check_paths(value: Any) -> tuple[Any, str | None]:
    if value is None:
        return None, None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, str):
        return (value, None) if value else (None, "must not be empty; give a directory")
    if isinstance(value, (list, tuple)):
        paths = [os.fspath(p) if isinstance(p, os.PathLike) else p for p in value]
        if not paths:
            return None, "must not be an empty list; give at least one directory"
        bad = [p for p in paths if not isinstance(p, str) or not p]
        if bad:
            return None, f"must list directories as non-empty strings, got {show(bad[0])}"
        twice = sorted({p for p in paths if paths.count(p) > 1})
        if twice:
            return None, f"lists {twice[0]!r} more than once; each drive's directory should appear once"
        return tuple(paths), None
    return None, f"must be a directory (a string) or a list of directories, got {show(value)}"


def raise_if(problems: list[tuple[str, str]], what: str) -> None:
    """Raise one ConfigError listing every (JSON path, message) problem, if there are any."""
    if not problems:
        return
    if len(problems) == 1:
        path, message = problems[0]
        err = ConfigError(f"{what}: {path}: {message}")
    else:
        lines = "\n".join(f"  {path}: {message}" for path, message in problems)
        err = ConfigError(f"{what} ({len(problems)} problems):\n{lines}")
    err.problems = list(problems)  # (json path, message) pairs, for tools and tests
    raise err


def did_you_mean(word: str, candidates: Iterable[str], cutoff: float = 0.6) -> str:
    """``'; did you mean "x"?'`` for the closest candidate, or ``""``."""
    close = difflib.get_close_matches(str(word), list(candidates), n=1, cutoff=cutoff)
    return f'; did you mean "{close[0]}"?' if close else ""


def show(value: Any) -> str:
    """A value as it looks in JSON, with its JSON type, for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"{json.dumps(value)} (a boolean)"
    if isinstance(value, str):
        return f"{json.dumps(value)} (a string)"
    if isinstance(value, float):
        return f"{value!r} (a float)" if math.isfinite(value) else repr(value)
    if isinstance(value, numbers.Integral):
        return _int_text(int(value))
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, (list, tuple)):
        return "a list"
    return repr(value)


def _int_text(n: int) -> str:
    """``n`` in full, or as ``1.00e+300`` when it is too long to read (or to print at all)."""
    try:
        digits = str(abs(n))
    except ValueError:  # beyond Python's limit on int-to-str conversion
        return f"a number of {n.bit_length()} bits"
    if len(digits) <= 21:
        return str(n)
    return f"{'-' if n < 0 else ''}{digits[0]}.{digits[1:3]}e+{len(digits) - 1}"


def _bytes_text(n: int) -> str:
    return f"{n} ({format_size(n)})" if n.bit_length() <= 64 else _int_text(n)
