"""Configuration: DeepSpeed's ``aio``, ``offload_optimizer`` and ``offload_param`` blocks, validated once.

# NOTE: every setting is checked in one place, at the edge. Each block is a frozen dataclass whose
# ``__post_init__`` checks every field and reports every problem in one ``ConfigError``; the loader turns
# JSON (our own files, a bare ``aio`` block or a whole DeepSpeed ``ds_config.json``) into those
# dataclasses with the same rules, plus the conveniences a file needs: human sizes (``"64MiB"``),
# comments, trailing commas, a "did you mean" for misspelt keys and the JSON path of each problem.
# Nothing downstream re-validates, and this module imports neither the engine nor torch.

Presets live in ``configs/*.json`` (``default.json``, ``deepspeed_example.json``, ``tiny.json``); variants
are made with ``dataclasses.replace`` or the ``replace`` methods.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import numbers
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError
from .units import format_size, parse_count, parse_size

__all__ = [
    "AioConfig",
    "Config",
    "OptimizerOffloadConfig",
    "ParamOffloadConfig",
    "config_to_dict",
    "load_config",
    "offload_config",
]

BLOCKS = ("aio", "offload_optimizer", "offload_param")
_ALIGN = 4096
_MAX_BLOCK_SIZE = 1 << 30  # Linux moves at most 2 GiB - 4 KiB per read/write call; keep well below.


# ---------------------------------------------------------------------------------------------------
# Field rules. One table per block drives both the dataclass checks and the JSON loader.


@dataclass(frozen=True)
class _Rule:
    kind: str  # "bytes", "int", "count", "bool", "choice", "o_direct", "paths", "ratio"
    lo: int | None = None
    hi: int | None = None
    multiple: int | None = None
    choices: tuple = ()
    # What an HF-style "auto" string means for this key: "value" (a real value of the key),
    # "default" (the documented default), or an error message saying what to write instead.
    auto: str = "default"


_BOOL_AUTO = "write true or false"
_AIO_RULES = {
    "block_size": _Rule("bytes", lo=_ALIGN, hi=_MAX_BLOCK_SIZE, multiple=_ALIGN),
    "queue_depth": _Rule("int", lo=1, hi=4096),
    "thread_count": _Rule("int", lo=1, hi=64),
    "single_submit": _Rule("bool", auto=_BOOL_AUTO),
    "overlap_events": _Rule("bool", auto=_BOOL_AUTO),
    "use_gds": _Rule("bool", auto=_BOOL_AUTO),
    "backend": _Rule("choice", choices=("auto", "io_uring", "threads"), auto="value"),
    "o_direct": _Rule("o_direct", auto="value"),
}
_DEVICE_AUTO = 'name the device: "nvme" ("cpu" and "none" are read but not implemented)'
_PATH_AUTO = "give a directory on the NVMe drive, or a list of directories, one per drive"
_DEVICES = ("nvme", "cpu", "none")
_OPTIMIZER_RULES = {
    "device": _Rule("choice", choices=_DEVICES, auto=_DEVICE_AUTO),
    "nvme_path": _Rule("paths", auto=_PATH_AUTO),
    "buffer_count": _Rule("int", lo=2),
    "buffer_size": _Rule("bytes", lo=_ALIGN, multiple=_ALIGN),
    "pin_memory": _Rule("bool", auto=_BOOL_AUTO),
    "pipeline_read": _Rule("bool", auto=_BOOL_AUTO),
    "pipeline_write": _Rule("bool", auto=_BOOL_AUTO),
    "fast_init": _Rule("bool", auto=_BOOL_AUTO),
    "ratio": _Rule("ratio"),
    "small_param_threshold": _Rule("count", lo=0),
}
_PARAM_RULES = {
    "device": _Rule("choice", choices=_DEVICES, auto=_DEVICE_AUTO),
    "nvme_path": _Rule("paths", auto=_PATH_AUTO),
    "buffer_count": _Rule("int", lo=2),
    "buffer_size": _Rule("count", lo=1),
    "max_in_cpu": _Rule("count", lo=0),
    "pin_memory": _Rule("bool", auto=_BOOL_AUTO),
}
_RULES = {"aio": _AIO_RULES, "offload_optimizer": _OPTIMIZER_RULES, "offload_param": _PARAM_RULES}
# DeepSpeed renamed thread_count to intra_op_parallelism (2025) without an alias; both mean the same.
_ALIASES = {"aio": {"intra_op_parallelism": "thread_count"}, "offload_optimizer": {}, "offload_param": {}}


# ---------------------------------------------------------------------------------------------------
# The blocks.


@dataclass(frozen=True)
class AioConfig:
    """Settings of the native I/O engine (DeepSpeed's ``aio`` block, same key names).

    Attributes:
        block_size: bytes per request piece; a multiple of 4096, from 4 KiB to 1 GiB.
        queue_depth: pieces in flight per worker, 1 to 4096.
        thread_count: worker threads, each with its own io_uring ring, 1 to 64. DeepSpeed's newer name
            ``intra_op_parallelism`` is read as the same key.
        single_submit: one submit system call per piece instead of one per batch.
        overlap_events: refill the queue as completions arrive instead of submit-all-then-wait.
        use_gds: GPUDirect Storage (not supported; must stay false).
        backend: ``"auto"`` (io_uring, else threads), ``"io_uring"`` or ``"threads"``.
        o_direct: ``"auto"`` (O_DIRECT, else buffered with one warning), ``True`` or ``False``.

    Raises:
        ConfigError: at construction, naming every bad field.
    """

    block_size: int = 1 << 20
    queue_depth: int = 32
    thread_count: int = 1
    single_submit: bool = False
    overlap_events: bool = True
    use_gds: bool = False
    backend: str = "auto"
    o_direct: bool | str = "auto"

    def __post_init__(self) -> None:
        _validate(self, "aio")

    def replace(self, **changes: Any) -> AioConfig:
        """A copy with ``changes`` applied (Python values; validated like the constructor)."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class OptimizerOffloadConfig:
    """Where and how optimizer state is offloaded (DeepSpeed's ``zero_optimization.offload_optimizer``).

    Attributes:
        device: ``"nvme"``; ``"cpu"`` and ``"none"`` are DeepSpeed values the loader reads so that a
            ds_config.json loads, but the optimizers of this library refuse them (state always goes to
            NVMe here; use ``torch.optim`` to keep it in memory).
        nvme_path: a directory, or a list of directories (one per drive; state is striped over them), or
            ``None`` to give the path when building the optimizer. Stored as a ``str`` or a ``tuple``.
        buffer_count: buffers in the host pool, at least 2 (3 or more lets a read, an update and a write
            overlap). DeepSpeed's default, 4.
        buffer_size: bytes per pool buffer (our extension; DeepSpeed sizes them from the largest
            sub-group). A multiple of 4096; human sizes such as ``"64MiB"`` are read from files.
            Parameters larger than a buffer are split across buffers.
        pin_memory: register the pool with CUDA (page-locked) for fast GPU copies.
        pipeline_read: read the next sub-group while the current one is updated.
        pipeline_write: write the previous sub-group while the current one is updated.
        fast_init: accepted for DeepSpeed compatibility; swap files are always preallocated up front.
        ratio: fraction of optimizer state offloaded; only ``1.0`` (all of it) is supported.
        small_param_threshold: parameters with fewer elements keep their state in host memory (our
            extension): a disk round trip costs more than it saves for biases and norms.

    Raises:
        ConfigError: at construction, naming every bad field.
    """

    device: str = "nvme"
    nvme_path: str | tuple | None = None
    buffer_count: int = 4
    buffer_size: int = 64 << 20
    pin_memory: bool = False
    pipeline_read: bool = True
    pipeline_write: bool = True
    fast_init: bool = False
    ratio: float = 1.0
    small_param_threshold: int = 4096

    def __post_init__(self) -> None:
        _validate(self, "offload_optimizer")

    @property
    def nvme_paths(self) -> tuple[str, ...]:
        """``nvme_path`` as a tuple of directories (empty when unset)."""
        return _as_paths(self.nvme_path)

    def replace(self, **changes: Any) -> OptimizerOffloadConfig:
        """A copy with ``changes`` applied (Python values; validated like the constructor)."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class ParamOffloadConfig:
    """Where and how parameters are offloaded (DeepSpeed's ``zero_optimization.offload_param``).

    Attributes:
        device: ``"nvme"``; ``"cpu"`` and ``"none"`` are read from DeepSpeed files but refused by
            parameter offloading, as for :class:`OptimizerOffloadConfig`.
        nvme_path: a directory, a list of directories (striped), or ``None``.
        buffer_count: buffers in the parameter pool, at least 2. DeepSpeed's default, 5.
        buffer_size: ELEMENTS per buffer (not bytes, as in DeepSpeed), default 1e8.
        max_in_cpu: parameter elements that may stay in host memory, default 1e9.
        pin_memory: register the pool with CUDA (page-locked).

    Raises:
        ConfigError: at construction, naming every bad field.
    """

    device: str = "nvme"
    nvme_path: str | tuple | None = None
    buffer_count: int = 5
    buffer_size: int = 100_000_000
    max_in_cpu: int = 1_000_000_000
    pin_memory: bool = False

    def __post_init__(self) -> None:
        _validate(self, "offload_param")

    @property
    def nvme_paths(self) -> tuple[str, ...]:
        """``nvme_path`` as a tuple of directories (empty when unset)."""
        return _as_paths(self.nvme_path)

    def replace(self, **changes: Any) -> ParamOffloadConfig:
        """A copy with ``changes`` applied (Python values; validated like the constructor)."""
        return dataclasses.replace(self, **changes)


_CLASSES = {
    "aio": AioConfig,
    "offload_optimizer": OptimizerOffloadConfig,
    "offload_param": ParamOffloadConfig,
}


@dataclass(frozen=True)
class Config:
    """The three blocks together: what :func:`load_config` returns.

    A block may also be given as a mapping, read with the loader's rules (human sizes, aliases):
    ``Config(aio={"block_size": "256KiB"})``.

    Attributes:
        aio: the I/O engine's settings.
        offload_optimizer: optimizer-state offload settings.
        offload_param: parameter offload settings.
    """

    aio: AioConfig = field(default_factory=AioConfig)
    offload_optimizer: OptimizerOffloadConfig = field(default_factory=OptimizerOffloadConfig)
    offload_param: ParamOffloadConfig = field(default_factory=ParamOffloadConfig)

    def __post_init__(self) -> None:
        problems: list[tuple[str, str]] = []
        blocks = {}
        for name in BLOCKS:
            value = getattr(self, name)
            if isinstance(value, _CLASSES[name]):
                blocks[name] = value
            elif isinstance(value, Mapping):
                blocks[name] = _read_block(name, value, name, problems)
            else:
                problems.append((name, f"must be an {_CLASSES[name].__name__} or a mapping, got {value!r}"))
        _raise_if(problems, "invalid configuration")
        for name, value in blocks.items():
            object.__setattr__(self, name, value)

    def replace(self, **changes: Any) -> Config:
        """A copy with some blocks replaced or changed.

        Args:
            **changes: ``aio``, ``offload_optimizer`` or ``offload_param``, each either a block instance
                (replaces the block) or a mapping of keys to change in it, read with the loader's rules:
                ``config.replace(offload_optimizer={"buffer_count": 8, "buffer_size": "128MiB"})``.

        Raises:
            ConfigError: an unknown block or key, or bad values (all named at once).
        """
        problems: list[tuple[str, str]] = []
        new = {}
        for name, change in changes.items():
            if name not in _RULES:
                problems.append((name, f"unknown block{_did_you_mean(name, BLOCKS)}"))
            elif isinstance(change, Mapping):
                merged = _block_to_dict(getattr(self, name))
                aliases = _ALIASES[name]
                merged.update({aliases.get(k, k): v for k, v in change.items()})
                new[name] = _read_block(name, merged, name, problems)
            else:
                new[name] = change
        _raise_if(problems, "invalid configuration")
        return dataclasses.replace(self, **new)


# ---------------------------------------------------------------------------------------------------
# Loading.

_CONTAINERS = (*BLOCKS, "zero_optimization")


def load_config(source: Config | AioConfig | Mapping | str | os.PathLike | None = None) -> Config:
    """Read a configuration from a file, a mapping, or pass one through.

    Accepted layouts (a file or a mapping):

    * our own: ``{"aio": {...}, "offload_optimizer": {...}, "offload_param": {...}}``, any block optional;
    * a bare ``aio`` block: ``{"block_size": "256KiB", "queue_depth": 16}``;
    * a whole DeepSpeed ``ds_config.json``: ``aio`` at the top level or inside ``zero_optimization``,
      and ``zero_optimization.offload_optimizer`` / ``.offload_param``. Keys we do not use
      (``train_batch_size``, ``fp16``, ``optimizer``, ``zero_optimization.stage``, ...) are ignored. A block
      given in two places must be identical in both. A missing or ``null`` block means its defaults.

    Files are read the way DeepSpeed reads them (it uses hjson), as far as JSON allows: ``//``, ``/* */``
    and ``#`` comments and trailing commas are accepted; duplicate keys are an error (as in DeepSpeed).
    Unquoted keys and strings are not accepted.

    Inside the three blocks every key is checked: an unknown key is an error with a "did you mean", and
    types are strict (``true``/``false`` for switches, not ``"yes"`` or ``1``; integers for counts).
    Byte sizes (``aio.block_size``, ``offload_optimizer.buffer_size``) may be written ``"64MiB"``;
    element counts (``offload_param.buffer_size``, ``max_in_cpu``, ``small_param_threshold``) may be written
    ``1e8`` or ``"100M"``. Every problem is reported at once, each with its JSON path.

    HF-style ``"auto"`` values (written by templates for the Hugging Face Trainer to fill in):

    * ``aio.backend`` and ``aio.o_direct``: ``"auto"`` is a real value (see :class:`AioConfig`);
    * numbers (``block_size``, ``queue_depth``, ``thread_count``, ``buffer_count``, ``buffer_size``,
      ``max_in_cpu``, ``small_param_threshold``, ``ratio``): the documented default of the key;
    * switches (``pin_memory``, ``pipeline_read``, ...), ``device`` and ``nvme_path``: an error naming the
      key, since no default is safe to guess (a switch may cost memory; a path must be the user's drive).

    Args:
        source: ``None`` (all defaults), a :class:`Config` (returned as is), an :class:`AioConfig`
            (wrapped with default offload blocks), a mapping, or the path of a JSON file.

    Returns:
        The validated configuration.

    Raises:
        ConfigError: a syntax error (with file, line and column), a duplicate key, an unknown key, a wrong
            type or a value out of range; the message lists every problem found, and its ``problems``
            attribute holds them as (JSON path, message) pairs.
        OSError: the file cannot be read (e.g. ``FileNotFoundError``).
        TypeError: ``source`` is none of the above.
    """
    if source is None:
        return Config()
    if isinstance(source, Config):
        return source
    if isinstance(source, AioConfig):
        return Config(aio=source)
    if isinstance(source, Mapping):
        return _from_document(source, origin=None)
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        with open(path, encoding="utf-8-sig") as f:
            text = f.read()
        return _from_document(_parse_lenient_json(text, path), origin=path)
    raise TypeError(
        f"load_config expects None, a Config, an AioConfig, a dict or a path to a JSON file; got {source!r}"
    )


def offload_config(source, block: str, *, user: str, what: str, otherwise: str, **overrides: Any) -> Config:
    """The configuration an offloading component runs with: ``source`` plus keyword overrides, checked for use.

    Args:
        source: anything :func:`load_config` reads, or an instance of ``block``'s class, or a mapping of
            that block's keys alone.
        block: ``"offload_optimizer"`` or ``"offload_param"``.
        user, what, otherwise: for the error message (who refuses which device, and what to do instead).
        **overrides: keys of ``block``; ``None`` means not given. Paths may be ``os.PathLike``.

    Raises:
        ConfigError: bad values (all named at once), a device other than ``"nvme"``, or no ``nvme_path``.
    """
    cls = _CLASSES[block]
    if isinstance(source, cls):
        cfg = Config(**{block: source})
    elif isinstance(source, Mapping) and source and set(source) <= set(cls.__dataclass_fields__):
        cfg = Config(**{block: dict(source)})
    else:
        cfg = load_config(source)
    changes = {k: v for k, v in overrides.items() if v is not None}
    path = changes.get("nvme_path")
    if isinstance(path, os.PathLike):
        changes["nvme_path"] = os.fspath(path)
    elif isinstance(path, (list, tuple)):
        changes["nvme_path"] = [os.fspath(x) if isinstance(x, os.PathLike) else x for x in path]
    if changes:
        # Read with the loader's rules: human sizes ("256MiB"), ranges, one ConfigError for all problems.
        cfg = cfg.replace(**{block: changes})
    b = getattr(cfg, block)
    if b.device != "nvme":
        raise ConfigError(f'{block}.device is "{b.device}"; {user} keeps {what} on NVMe only. '
                          f'Set it to "nvme" ({otherwise}).')
    if not b.nvme_path:
        raise ConfigError(f"nvme_path is required: pass nvme_path=... or set {block}.nvme_path")
    return cfg


def config_to_dict(
    config: Config | AioConfig | OptimizerOffloadConfig | ParamOffloadConfig,
    *,
    only: Iterable[str] | None = ("aio",),
) -> dict:
    """A JSON-ready dict of some blocks, which :func:`load_config` reads back unchanged.

    Args:
        config: a :class:`Config`, or a single block (then ``only`` defaults to that block).
        only: the blocks to include, by name (``"aio"``, ``"offload_optimizer"``, ``"offload_param"``);
            ``None`` for all three.

    Returns:
        ``{"aio": {...}, ...}`` with every key of each block, under the names this module writes
        (``thread_count``, not its alias), real booleans, sizes in bytes and lists for path lists.

    Raises:
        ValueError: ``only`` names an unknown block.
    """
    for name, cls in _CLASSES.items():
        if isinstance(config, cls):
            config = Config(**{name: config})
            if only == ("aio",):
                only = (name,)
    if not isinstance(config, Config):
        raise TypeError(f"config_to_dict expects a Config or one of its blocks, got {config!r}")
    names = BLOCKS if only is None else tuple(only)
    unknown = [n for n in names if n not in _RULES]
    if unknown:
        raise ValueError(f"unknown block(s) {unknown} in only=; choose from {list(BLOCKS)}")
    return {name: _block_to_dict(getattr(config, name)) for name in names}


def _from_document(doc: Mapping, origin: str | None) -> Config:
    problems: list[tuple[str, str]] = []
    found = _locate_blocks(doc, problems)
    blocks = {}
    for name, (prefix, raw) in found.items():
        if raw is None:
            continue
        if not isinstance(raw, Mapping):
            problems.append((prefix, f"must be an object of {name} settings, got {_show(raw)}"))
            continue
        blocks[name] = _read_block(name, raw, prefix, problems)
    where = f"invalid configuration in {origin}" if origin else "invalid configuration"
    _raise_if(problems, where)
    return Config(**blocks)


def _locate_blocks(doc: Mapping, problems: list) -> dict[str, tuple[str, Any]]:
    """Find each block's raw mapping and its JSON path, for any of the accepted layouts."""
    aio_keys = set(_AIO_RULES) | set(_ALIASES["aio"])
    if not any(k in doc for k in _CONTAINERS) and any(k in aio_keys for k in doc):
        return {"aio": ("aio", doc)}  # a bare aio block: every key in it is checked
    zero = doc.get("zero_optimization")
    if zero is not None and not isinstance(zero, Mapping):
        problems.append(("zero_optimization", f"must be an object, got {_show(zero)}"))
        zero = None
    found = {}
    for name in BLOCKS:
        places = [(name, doc)] + ([(f"zero_optimization.{name}", zero)] if zero is not None else [])
        given = [(path, where[name]) for path, where in places if name in where]
        if len(given) == 2 and given[0][1] != given[1][1]:
            problems.append(
                (given[1][0], f"{name} is also given at the top level, differently; keep one of the two")
            )
        if given:
            found[name] = given[0]
    # Misplaced or misspelt blocks would otherwise be ignored like the keys DeepSpeed has and we do not.
    block_keys = {k: b for b in BLOCKS for k in (*_RULES[b], *_ALIASES[b])}
    for key in doc:
        if key in _CONTAINERS:
            continue
        if key in block_keys:
            problems.append((key, f'belongs inside "{block_keys[key]}", not at the top level'))
        elif hint := _did_you_mean(key, [*_CONTAINERS, *block_keys], cutoff=0.85):
            problems.append((key, "unknown top-level key" + hint))
    for key in zero or ():
        if key not in BLOCKS and not key.startswith("cpu_offload"):  # DeepSpeed's own deprecated keys
            if hint := _did_you_mean(key, BLOCKS, cutoff=0.85):
                problems.append((f"zero_optimization.{key}", "unknown key" + hint))
    return found


def _read_block(name: str, raw: Mapping, prefix: str, problems: list) -> Any:
    """Convert one raw block (JSON values) into its dataclass; problems are appended, not raised."""
    rules, aliases = _RULES[name], _ALIASES[name]
    values: dict[str, Any] = {}
    raw_by_field: dict[str, tuple[str, Any]] = {}
    ok = True
    for key, raw_value in raw.items():
        path = f"{prefix}.{key}"
        field_name = aliases.get(key, key)
        if field_name not in rules:
            problems.append((path, _unknown_key(key, name)))
            ok = False
            continue
        if field_name in raw_by_field:
            other_key, other_value = raw_by_field[field_name]
            if _json_key(other_value) != _json_key(raw_value):
                problems.append(
                    (path, f"{key} and {other_key} mean the same ({field_name}) and are given different "
                     f"values ({_show(raw_value)} and {_show(other_value)}); keep one")
                )  # fmt: skip
                ok = False
            continue
        raw_by_field[field_name] = (key, raw_value)
        value, problem = _convert(rules[field_name], field_name, raw_value)
        if problem:
            problems.append((path, problem))
            ok = False
        elif value is not _DEFAULT:
            values[field_name] = value
    return _CLASSES[name](**values) if ok else None


_DEFAULT = object()  # sentinel: "auto" chose the key's default


def _convert(rule: _Rule, name: str, raw: Any) -> tuple[Any, str | None]:
    """A JSON value -> (Python value, None) or (None, problem). Ends with the dataclass check."""
    if isinstance(raw, str) and raw.strip().lower() == "auto":
        if rule.auto == "default":
            return _DEFAULT, None
        if rule.auto != "value":
            return None, f'"auto" is not accepted here: {rule.auto}'
        raw = "auto"
    if rule.kind == "bytes":
        if isinstance(raw, str):
            try:
                raw = parse_size(raw)
            except ValueError as err:
                return None, str(err)
        elif isinstance(raw, float):
            return None, f'must be a number of bytes as an integer or a size such as "1MiB", got {_show(raw)}'
    elif rule.kind == "count":
        if isinstance(raw, (str, float)):
            try:
                raw = parse_count(raw)
            except ValueError as err:
                return None, str(err)
    elif rule.kind == "paths" and isinstance(raw, os.PathLike):
        raw = os.fspath(raw)
    return _check(rule, name, raw)


def _check(rule: _Rule, name: str, value: Any) -> tuple[Any, str | None]:
    """A Python value -> (normalized value, None) or (None, problem)."""
    kind = rule.kind
    if kind in ("bytes", "int", "count"):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            unit = " of bytes" if kind == "bytes" else ""
            return None, f"must be an integer number{unit}, got {_show(value)}"
        value = int(value)
        show = (lambda n: f"{n} ({format_size(n)})") if kind == "bytes" and value >= 1024 else str
        if rule.lo is not None and rule.hi is not None and not rule.lo <= value <= rule.hi:
            return None, f"must be between {rule.lo} and {_fmt(rule.hi, kind)}, got {show(value)}"
        if rule.lo is not None and value < rule.lo:
            return None, f"must be at least {rule.lo}, got {value}"
        if rule.multiple and value % rule.multiple:
            down = value - value % rule.multiple
            up = down + rule.multiple
            near = f"{down} or {up}" if down else str(up)
            return None, f"must be a multiple of {rule.multiple} (for direct I/O), got {value}; try {near}"
        return value, None
    if kind == "bool":
        if not isinstance(value, bool):
            return None, f"must be true or false, got {_show(value)}"
        if name == "use_gds" and value:
            return None, "GPUDirect Storage is not supported; set use_gds to false or leave it out"
        return value, None
    if kind == "choice":
        if value not in rule.choices or not isinstance(value, str):
            options = ", ".join(json.dumps(c) for c in rule.choices)
            hint = _did_you_mean(value.lower(), rule.choices) if isinstance(value, str) else ""
            return None, f"must be one of {options}, got {_show(value)}{hint}"
        return value, None
    if kind == "o_direct":
        if value is True or value is False or value == "auto":
            return value, None
        return None, f'must be "auto", true or false (without quotes), got {_show(value)}'
    if kind == "paths":
        return _check_paths(value)
    if kind == "ratio":
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return None, f"must be a number in (0, 1], got {_show(value)}"
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
            return None, f"must list directories as non-empty strings, got {_show(bad[0])}"
        twice = sorted({p for p in paths if paths.count(p) > 1})
        if twice:
            return None, f"lists {twice[0]!r} more than once; each drive's directory should appear once"
        return tuple(paths), None
    return None, f"must be a directory (a string) or a list of directories, got {_show(value)}"


def _validate(obj: Any, name: str) -> None:
    """The dataclasses' check: every field, all problems in one ConfigError; normalizes in place."""
    problems = []
    for field_name, rule in _RULES[name].items():
        value, problem = _check(rule, field_name, getattr(obj, field_name))
        if problem:
            problems.append((f"{name}.{field_name}", problem))
        else:
            object.__setattr__(obj, field_name, value)  # e.g. numpy ints -> int, lists -> tuples
    _raise_if(problems, f"invalid {name} settings")


def _raise_if(problems: list[tuple[str, str]], what: str) -> None:
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


def _block_to_dict(block: Any) -> dict:
    out = {}
    for f in dataclasses.fields(block):
        value = getattr(block, f.name)
        out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


def _as_paths(value: str | tuple | None) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def _unknown_key(key: str, block: str) -> str:
    valid = [*_RULES[block], *_ALIASES[block]]
    hint = _did_you_mean(key, valid)
    if not hint:
        homes = [b for b in BLOCKS if b != block and key in (*_RULES[b], *_ALIASES[b])]
        if homes:
            return f'unknown key in "{block}"; it is a key of "{homes[0]}"'
        return f'unknown key in "{block}"; valid keys: {", ".join(valid)}'
    return f'unknown key in "{block}"{hint}'


def _did_you_mean(word: str, candidates: Iterable[str], cutoff: float = 0.6) -> str:
    close = difflib.get_close_matches(str(word), list(candidates), n=1, cutoff=cutoff)
    return f'; did you mean "{close[0]}"?' if close else ""


def _fmt(n: int, kind: str) -> str:
    return f"{n} ({format_size(n)})" if kind == "bytes" else str(n)


def _json_key(value: Any) -> str:
    # Compare values as JSON sees them: 1 and true differ, 1 and 1.0 do not matter here.
    return json.dumps(value, sort_keys=True, default=str)


def _show(value: Any) -> str:
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
        return str(int(value))
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, (list, tuple)):
        return "a list"
    return repr(value)


# ---------------------------------------------------------------------------------------------------
# Lenient JSON: comments and trailing commas, found by a small tokenizer that knows about strings, so
# that "//" inside a path or a URL is left alone.


class _ObjectWithDuplicates(dict):
    duplicates: list


def _keep_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    obj = _ObjectWithDuplicates()
    obj.duplicates = []
    for key, value in pairs:
        if key in obj:
            obj.duplicates.append(key)
        obj[key] = value
    return obj


def _parse_lenient_json(text: str, origin: str) -> dict:
    cleaned = _strip_comments_and_trailing_commas(text, origin)
    try:
        doc = json.loads(cleaned, object_pairs_hook=_keep_duplicates)
    except json.JSONDecodeError as err:
        # Comments were blanked, not removed, so line and column refer to the original text.
        lines = text.splitlines()
        line = lines[err.lineno - 1] if err.lineno <= len(lines) else ""
        raise ConfigError(
            f"{origin}: invalid JSON at line {err.lineno}, column {err.colno}: {err.msg}\n"
            f"    {line}\n    {' ' * (err.colno - 1)}^"
        ) from None
    problems: list[tuple[str, str]] = []
    _find_duplicates(doc, "", problems)
    _raise_if(problems, f"invalid configuration in {origin}")
    if not isinstance(doc, dict):
        raise ConfigError(f"{origin}: the top level must be a JSON object {{...}}, got {_show(doc)}")
    return doc


def _find_duplicates(value: Any, path: str, problems: list) -> None:
    if isinstance(value, _ObjectWithDuplicates):
        for key in dict.fromkeys(value.duplicates):
            where = f"{path}.{key}" if path else key
            problems.append((where, "duplicate key (DeepSpeed rejects these too); keep one"))
        for key, item in value.items():
            _find_duplicates(item, f"{path}.{key}" if path else key, problems)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _find_duplicates(item, f"{path}[{i}]", problems)


def _strip_comments_and_trailing_commas(text: str, origin: str) -> str:
    out = list(text)
    n = len(text)
    i = 0
    comma = -1  # a comma that may turn out to be trailing
    previous = ""  # the last significant character outside comments
    while i < n:
        c = text[i]
        if c == '"':
            i = _end_of_string(text, i)
            comma, previous = -1, '"'
            continue
        if c == "#" or text.startswith("//", i):
            end = text.find("\n", i)
            end = n if end < 0 else end
            out[i:end] = " " * (end - i)
            i = end
            continue
        if text.startswith("/*", i):
            end = text.find("*/", i + 2)
            if end < 0:
                line = text.count("\n", 0, i) + 1
                column = i - (text.rfind("\n", 0, i) + 1) + 1
                raise ConfigError(f"{origin}: unterminated /* comment at line {line}, column {column}")
            for j in range(i, end + 2):
                if out[j] != "\n":
                    out[j] = " "
            i = end + 2
            continue
        if c in "}]" and comma >= 0:
            out[comma] = " "
        if c == "," and previous not in ("", "{", "[", ","):
            comma = i
        elif not c.isspace():
            comma = -1
        if not c.isspace():
            previous = c
        i += 1
    return "".join(out)


def _end_of_string(text: str, start: int) -> int:
    """Index just past the string literal opening at ``start`` (or at the line's end, if unterminated)."""
    i = start + 1
    n = len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
        elif c == '"':
            return i + 1
        elif c == "\n":
            return i  # unterminated: json reports it at the right place
        else:
            i += 1
    return n
