"""Loading a configuration: our layout, a bare ``aio`` block or a whole DeepSpeed ``ds_config.json``."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Mapping
from typing import Any, Optional

from ..errors import ConfigError, ConfigWarning, user_stacklevel
from .blocks import (
    CLASSES,
    RULES,
    AioConfig,
    Config,
    OptimizerOffloadConfig,
    ParamOffloadConfig,
    block_to_dict,
    read_block,
)
from .deepspeed import hints_for, unused_keys, unused_message
from .files import read_document
from .rules import ALIASES, BLOCKS, IGNORED, did_you_mean, raise_if, show

__all__ = ["config_from_document", "config_to_dict", "load_config", "offload_config"]

_CONTAINERS = (*BLOCKS, "zero_optimization")


def load_config(source: Config | AioConfig | Mapping | str | os.PathLike | None = None) -> Config:
    """Read a configuration from a file, a mapping, or pass one through.

    Accepted layouts (a file or a mapping):

    * our own: ``{"aio": {...}, "offload_optimizer": {...}, "offload_param": {...}}``, any block optional;
    * a bare ``aio`` block: ``{"block_size": "256KiB", "queue_depth": 16}``;
    * a whole DeepSpeed ``ds_config.json``: ``aio`` at the top level or inside ``zero_optimization``,
      and ``zero_optimization.offload_optimizer`` / ``.offload_param``. Keys of other parts of a DeepSpeed
      config (``train_batch_size``, ``fp16``, ``optimizer``, ``zero_optimization.stage``, ...) are not read here
      (``offload.initialize`` honours them; the optimizer and ``offload_parameters`` name them in a
      ``ConfigWarning``). A block given in two places must be identical in both. A missing or ``null`` block
      means its defaults.

    Files are UTF-8 and strict JSON, unless their name ends in ``.hjson``: those are read with hjson, as
    DeepSpeed reads every config (``//``, ``/* */`` and ``#`` comments, trailing commas, members separated by
    newlines alone, unquoted keys and strings). A ``.json`` file that only hjson reads is an error saying so,
    with line and column. In both, as in hjson, a number with a fraction or exponent that is a whole number
    below 1e10 (``8.0``, ``1e8``) is read as an integer. Duplicate keys are an error (as in DeepSpeed), and so
    is a file with no value in it.

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
        ConfigError: a file that is not UTF-8, a syntax error (with file, line and column), a duplicate key,
            nesting too deep, an unknown key, a wrong type or a value out of range; the message lists every
            problem found, and its ``problems`` attribute holds them as (JSON path, message) pairs.
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
        return _from_document(read_document(path), origin=path)
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
        ConfigError: bad values (all named at once), a device this block cannot use, or ``device:
            "nvme"`` without an ``nvme_path``.
    """
    cls = CLASSES[block]
    if isinstance(source, cls):
        cfg = _with_block(block, source)
    elif isinstance(source, Mapping) and source and set(source) <= {*RULES[block], *IGNORED[block]}:
        cfg = _with_block(block, dict(source))
    elif isinstance(source, (str, os.PathLike, Mapping)):
        if isinstance(source, Mapping):
            origin, doc = None, source
        else:
            origin = os.fspath(source)
            doc = read_document(origin)
        cfg = _from_document(doc, origin=origin)
        _warn_unused(doc, block, user, origin)
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
    devices = ("nvme", "cpu") if block == "offload_optimizer" else ("nvme",)
    if b.device not in devices:
        where = " or ".join(f'"{d}"' for d in devices)
        raise ConfigError(f'{block}.device is "{b.device}"; {user} keeps {what} on {where}. '
                          f'Set it to {where} ({otherwise}).')
    if b.device == "nvme" and not b.nvme_path:
        raise ConfigError(f"nvme_path is required: pass nvme_path=... or set {block}.nvme_path")
    return cfg


def _warn_unused(doc: Mapping, block: str, user: str, origin: Optional[str]) -> None:
    """One ConfigWarning naming every key of ``doc`` that ``user`` (which reads ``aio`` and ``block``) does not
    use, each with what reads it or what to do; nothing when every key is used."""
    unused = unused_keys(doc, ("aio", block))
    if unused:
        hints = hints_for("optimizer" if block == "offload_optimizer" else "params")
        message = unused_message(user, origin or "the config given", unused, hints)
        warnings.warn(message, ConfigWarning, stacklevel=user_stacklevel())


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
    for name, cls in CLASSES.items():
        if isinstance(config, cls):
            config = _with_block(name, config)
            if only == ("aio",):
                only = (name,)
    if not isinstance(config, Config):
        raise TypeError(f"config_to_dict expects a Config or one of its blocks, got {config!r}")
    names = BLOCKS if only is None else tuple(only)
    unknown = [n for n in names if n not in RULES]
    if unknown:
        raise ValueError(f"unknown block(s) {unknown} in only=; choose from {list(BLOCKS)}")
    return {name: block_to_dict(getattr(config, name)) for name in names}


def config_from_document(doc: Mapping, origin: str | None = None) -> Config:
    """The offload blocks of a document already read (:func:`offload.config.files.read_document`), as
    :func:`load_config` reads them; ``origin``: its file, for messages."""
    return _from_document(doc, origin)


def _with_block(block: str, value: Any) -> Config:
    """A Config with ``block`` given (an instance of its class, or a mapping of its keys), the others default."""
    given: dict[str, Any] = {block: value}  # which block is known only at run time
    return Config(**given)


def _from_document(doc: Mapping, origin: str | None) -> Config:
    problems: list[tuple[str, str]] = []
    found = _locate_blocks(doc, problems)
    blocks = {}
    for name, (prefix, raw) in found.items():
        if raw is None:
            continue
        if not isinstance(raw, Mapping):
            problems.append((prefix, f"must be an object of {name} settings, got {show(raw)}"))
            continue
        blocks[name] = read_block(name, raw, prefix, problems)
    where = f"invalid configuration in {origin}" if origin else "invalid configuration"
    raise_if(problems, where)
    return Config(**blocks, given=frozenset(blocks))


def _locate_blocks(doc: Mapping, problems: list) -> dict[str, tuple[str, Any]]:
    """Find each block's raw mapping and its JSON path, for any of the accepted layouts."""
    aio_keys = set(RULES["aio"]) | set(ALIASES["aio"])
    if not any(k in doc for k in _CONTAINERS) and any(k in aio_keys for k in doc):
        return {"aio": ("aio", doc)}  # a bare aio block: every key in it is checked
    zero = doc.get("zero_optimization")
    if zero is not None and not isinstance(zero, Mapping):
        problems.append(("zero_optimization", f"must be an object, got {show(zero)}"))
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
    block_keys = {k: b for b in BLOCKS for k in (*RULES[b], *ALIASES[b], *IGNORED[b])}
    for key in doc:
        if key in _CONTAINERS:
            continue
        if key in block_keys:
            problems.append((key, f'belongs inside "{block_keys[key]}", not at the top level'))
        elif hint := did_you_mean(key, [*_CONTAINERS, *block_keys], cutoff=0.85):
            problems.append((key, "unknown top-level key" + hint))
    for key in zero or ():
        if key not in BLOCKS and not key.startswith("cpu_offload"):  # DeepSpeed's own deprecated keys
            if hint := did_you_mean(key, BLOCKS, cutoff=0.85):
                problems.append((f"zero_optimization.{key}", "unknown key" + hint))
    return found
