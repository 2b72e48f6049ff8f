"""The three configuration blocks as frozen dataclasses, and :class:`Config`, which holds them.

Each key is declared once, as a field made by :func:`setting`: its default, its rule (what it accepts) and
what it means. The rule tables, the classes' docstrings and the README's table of keys are derived from
those declarations. Each block checks every field at construction and reports every problem in one
``ConfigError``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..sizes import format_size
from .rules import (
    ALIASES,
    BLOCK_BYTES,
    BLOCKS,
    BOOL,
    BUFFER_COUNT,
    BYTES,
    COUNT,
    DEFAULT,
    DEVICE,
    IGNORED,
    PATHS,
    PIN,
    POSITIVE_COUNT,
    Rule,
    check,
    convert,
    did_you_mean,
    raise_if,
    show,
)

__all__ = ["CLASSES", "RULES", "AioConfig", "Config", "OptimizerOffloadConfig", "ParamOffloadConfig",
           "block_to_dict", "keys_table", "read_block", "unknown_key"]  # fmt: skip


def setting(default: Any, rule: Rule, doc: str, *, shown: str = "") -> Any:
    """A configuration key: its ``default``, the ``rule`` every value must pass, and ``doc`` (what it means,
    for the class docstring and the README table; ``shown``: the default as the table writes it)."""
    return field(default=default, metadata={"rule": rule, "doc": doc, "shown": shown})


def _documented(cls):
    """Append an ``Attributes:`` section, written from the fields' docs, to ``cls``'s docstring."""
    lines = [f"        {f.name}: {f.metadata['doc']}" for f in dataclasses.fields(cls)]
    cls.__doc__ = cls.__doc__.rstrip() + "\n\n    Attributes:\n" + "\n".join(lines) + "\n"
    return cls


# NOTE: every setting is checked in one place, at the edge. A block's ``__post_init__`` runs the rules
# over every field; the loader reads JSON with the same rules plus the conveniences a file needs (human
# sizes, "auto", aliases, DeepSpeed's keys that do nothing here). Nothing downstream re-validates.
@_documented
@dataclass(frozen=True)
class AioConfig:
    """Settings of the native I/O engine (DeepSpeed's ``aio`` block, same key names).

    Raises:
        ConfigError: at construction, naming every bad field.
    """

    block_size: int = setting(1 << 20, BLOCK_BYTES, "bytes per request piece; a multiple of 4096, from 4 KiB "
                              "to 1 GiB.")
    queue_depth: int = setting(32, Rule("int", lo=1, hi=4096), "pieces in flight per worker, 1 to 4096.")
    thread_count: int = setting(1, Rule("int", lo=1, hi=64), "worker threads, each with its own io_uring ring, "
                                "1 to 64. DeepSpeed's newer name ``intra_op_parallelism`` is the same key.")
    single_submit: bool = setting(False, BOOL, "one submit system call per piece instead of one per batch.")
    overlap_events: bool = setting(True, BOOL, "refill the queue as completions arrive instead of "
                                   "submit-all-then-wait.")
    use_gds: bool = setting(False, BOOL, "GPUDirect Storage (the ``gds`` extra: kvikio and a cuFile driver). "
                            "True is accepted, so DeepSpeed files that set it load as they are: the first "
                            "optimizer or parameter store built with it warns once what GDS gives on this "
                            "machine (:func:`offload.aio.gds_status`); state moves through the pinned host "
                            "pool either way.")
    backend: str = setting("auto", Rule("choice", choices=("auto", "io_uring", "threads"), auto="value"),
                           '``"auto"`` (io_uring, else threads), ``"io_uring"`` or ``"threads"``.')
    o_direct: bool | str = setting("auto", Rule("o_direct", auto="value"), '``"auto"`` (O_DIRECT, else buffered '
                                   "with one warning), ``True`` or ``False``.")

    def __post_init__(self) -> None:
        _validate(self, "aio")

    def replace(self, **changes: Any) -> AioConfig:
        """A copy with ``changes`` applied (Python values; validated like the constructor)."""
        return dataclasses.replace(self, **changes)


@_documented
@dataclass(frozen=True)
class OptimizerOffloadConfig:
    """Where and how optimizer state is offloaded (DeepSpeed's ``zero_optimization.offload_optimizer``).

    Raises:
        ConfigError: at construction, naming every bad field.
    """

    device: str = setting("nvme", DEVICE, '``"nvme"`` (state on the drives of ``nvme_path``), or ``"cpu"`` '
                          "(all state in host memory, no swap file: pinned with ``pin_memory``, and updated on "
                          'the GPU for CUDA parameters). ``"none"`` is read from DeepSpeed files but refused by '
                          "the optimizers (use ``torch.optim``).")
    nvme_path: str | tuple | None = setting(None, PATHS, "a directory, or a list of directories (one per drive; "
                                            "state is striped over them), or ``None`` to give the path when "
                                            "building the optimizer. Stored as a ``str`` or a ``tuple``.")
    buffer_count: int = setting(4, BUFFER_COUNT, "buffers in the host pool, 2 to 4096 (3 or more lets a read, "
                                "an update and a write overlap). DeepSpeed's default, 4.")
    buffer_size: int = setting(64 << 20, BYTES, "bytes per pool buffer (DeepSpeed sizes them from the largest "
                               'sub-group); a multiple of 4096, ``"64MiB"`` in files; smaller when the state '
                               "is. Parameters larger than a buffer are split across buffers.")
    pin_memory: bool | str = setting("auto", PIN, "register the pool (and the host cache) with CUDA, "
                                     "page-locked, for fast GPU copies; ``\"auto\"``: when any parameter is "
                                     "on a GPU.", shown="auto")
    pipeline_read: bool = setting(True, BOOL, "read the next unit while the current one is updated.")
    pipeline_write: bool = setting(True, BOOL, "write the previous unit while the current one is updated.")
    small_param_threshold: int = setting(4096, COUNT, "parameters with fewer elements keep their state in host "
                                         "memory: a disk round trip costs more than it saves for biases and "
                                         "norms.")
    host_cache: int | str = setting(0, Rule("cache", auto="value"), "bytes of NVMe state kept resident in host "
                                    'memory between steps (``"48GiB"`` in files), or ``"auto"`` (a share of '
                                    "available memory); units are visited in snake order, so bytes moved per "
                                    "step fall to (state - cache) each way.")
    state_dtype: str = setting("fp32", Rule("choice", choices=("fp32", "bf16", "int8"),
                                            auto='write "fp32", "bf16" or "int8"'),
                               '``"fp32"`` (bitwise torch), ``"bf16"`` (moments stored as bf16, computed in '
                               'fp32, rounded to nearest) or ``"int8"`` (moments as 8-bit codes with an fp32 '
                               "absmax per block of 256, updated as torchao's AdamW8bit does, bit for bit; "
                               "parameters under 4096 elements or not in whole blocks keep fp32 moments). "
                               "fp32 masters stay fp32.")
    master_weights: bool = setting(True, BOOL, "keep an fp32 master copy of bf16 parameters (4 bytes per "
                                   "parameter each way per step). ``false``: the update is computed in fp32 "
                                   "from the bf16 weights and rounded back stochastically, with a random "
                                   "stream keyed by seed, step, parameter and element (a resumed run equals "
                                   "the uninterrupted one); fp16 parameters always keep their master.")
    checksum: bool = setting(True, BOOL, "an xxh3_64 of every unit written, verified on every read, so state "
                             "changed on disk behind our back is found instead of trained on; hashed on the "
                             "engine's threads as requests complete (measure its cost with ``offload-bench adam "
                             "--checksum-cost``).")
    overlap_backward: bool | str = setting(
        "auto", PIN, "read and update state during backward, as each unit's grads become final, so an iteration "
        "costs about max(compute, I/O), and weights on NVMe are updated while backward holds them (no grad round "
        "trip, no second read); accumulation then needs ``no_step()``, and the grads and hyperparameters must not "
        'change between backward and step. ``"auto"`` (the default): from the third iteration, once two have '
        "shown that for a model whose weights are on NVMe (later departures are refused); ``false``: every "
        "update in step().", shown="auto")

    def __post_init__(self) -> None:
        _validate(self, "offload_optimizer")

    @property
    def nvme_paths(self) -> tuple[str, ...]:
        """``nvme_path`` as a tuple of directories (empty when unset)."""
        return _as_paths(self.nvme_path)

    def replace(self, **changes: Any) -> OptimizerOffloadConfig:
        """A copy with ``changes`` applied (Python values; validated like the constructor)."""
        return dataclasses.replace(self, **changes)


@_documented
@dataclass(frozen=True)
class ParamOffloadConfig:
    """Where and how parameters are offloaded (DeepSpeed's ``zero_optimization.offload_param``).

    Raises:
        ConfigError: at construction, naming every bad field.
    """

    device: str = setting("nvme", DEVICE, '``"nvme"``; ``"cpu"`` and ``"none"`` are read from DeepSpeed files '
                          "but refused by parameter offloading.")
    nvme_path: str | tuple | None = setting(None, PATHS, "a directory, a list of directories (striped), or "
                                            "``None``.")
    buffer_count: int = setting(5, BUFFER_COUNT, "buffers in the parameter pool, 2 to 4096. DeepSpeed's "
                                "default, 5.")
    buffer_size: int = setting(100_000_000, POSITIVE_COUNT, "ELEMENTS per buffer (not bytes, as in DeepSpeed).",
                               shown="1e8")
    max_in_cpu: int = setting(1_000_000_000, COUNT, "parameter elements that may stay in host memory "
                              "(smallest parameters first).", shown="1e9")
    max_grad_in_cpu: int = setting(1_000_000_000, COUNT, "gradient elements of offloaded parameters kept in "
                                   "host memory between backward and the step instead of a round trip "
                                   "through NVMe (smallest first).", shown="1e9")
    pin_memory: bool | str = setting("auto", PIN, "register the pool with CUDA (page-locked); ``\"auto\"``: "
                                     "when the model is on a GPU.", shown="auto")
    checksum: bool = setting(True, BOOL, "an xxh3_64 of every weight unit written, verified when read back.")

    def __post_init__(self) -> None:
        _validate(self, "offload_param")

    @property
    def nvme_paths(self) -> tuple[str, ...]:
        """``nvme_path`` as a tuple of directories (empty when unset)."""
        return _as_paths(self.nvme_path)

    def replace(self, **changes: Any) -> ParamOffloadConfig:
        """A copy with ``changes`` applied (Python values; validated like the constructor)."""
        return dataclasses.replace(self, **changes)


CLASSES = {
    "aio": AioConfig,
    "offload_optimizer": OptimizerOffloadConfig,
    "offload_param": ParamOffloadConfig,
}
# What each key accepts, by block, from the declarations above.
RULES = {name: {f.name: f.metadata["rule"] for f in dataclasses.fields(cls)} for name, cls in CLASSES.items()}


@dataclass(frozen=True)
class Config:
    """The three blocks together: what :func:`offload.config.load_config` returns.

    A block may also be given as a mapping, read with the loader's rules (human sizes, aliases):
    ``Config(aio={"block_size": "256KiB"})``.

    Attributes:
        aio: the I/O engine's settings.
        offload_optimizer: optimizer-state offload settings.
        offload_param: parameter offload settings.
        given: the blocks the file or mapping it was read from set (a DeepSpeed config without
            ``offload_param`` does not offload weights); not compared.
    """

    aio: AioConfig = field(default_factory=AioConfig)
    offload_optimizer: OptimizerOffloadConfig = field(default_factory=OptimizerOffloadConfig)
    offload_param: ParamOffloadConfig = field(default_factory=ParamOffloadConfig)
    given: frozenset = field(default=frozenset(), compare=False, repr=False)

    if TYPE_CHECKING:
        # What the generated __init__ takes: __post_init__ reads a block given as a mapping.
        def __init__(self, aio: AioConfig | Mapping[str, Any] = ...,
                     offload_optimizer: OptimizerOffloadConfig | Mapping[str, Any] = ...,
                     offload_param: ParamOffloadConfig | Mapping[str, Any] = ..., given: frozenset = ...) -> None:
            ...

    def __post_init__(self) -> None:
        problems: list[tuple[str, str]] = []
        blocks = {}
        for name in BLOCKS:
            value = getattr(self, name)
            if isinstance(value, CLASSES[name]):
                blocks[name] = value
            elif isinstance(value, Mapping):
                blocks[name] = read_block(name, value, name, problems)
            else:
                problems.append((name, f"must be an {CLASSES[name].__name__} or a mapping, got {value!r}"))
        raise_if(problems, "invalid configuration")
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
            if name not in RULES:
                problems.append((name, f"unknown block{did_you_mean(name, BLOCKS)}"))
            elif isinstance(change, Mapping):
                merged = block_to_dict(getattr(self, name))
                aliases = ALIASES[name]
                merged.update({aliases.get(k, k): v for k, v in change.items()})
                new[name] = read_block(name, merged, name, problems)
            else:
                new[name] = change
        raise_if(problems, "invalid configuration")
        return dataclasses.replace(self, **new)


def read_block(name: str, raw: Mapping, prefix: str, problems: list) -> Any:
    """One raw block (JSON values) -> its dataclass, or ``None``; problems are appended, not raised.

    Args:
        name: the block (``"aio"``, ``"offload_optimizer"`` or ``"offload_param"``).
        raw: its keys and values as read from a file or given in a mapping.
        prefix: the block's JSON path, for messages (``"zero_optimization.offload_param"``).
        problems: where (JSON path, message) pairs are appended.
    """
    rules, aliases = RULES[name], ALIASES[name]
    values: dict[str, Any] = {}
    raw_by_field: dict[str, tuple[str, Any]] = {}
    ok = True
    for key, raw_value in raw.items():
        path = f"{prefix}.{key}"
        field_name = aliases.get(key, key)
        if field_name in IGNORED[name]:
            # DeepSpeed's key, which does nothing here: checked as it would be there, then dropped.
            _, problem = convert(IGNORED[name][field_name][0], field_name, raw_value)
            if problem:
                problems.append((path, problem))
                ok = False
            continue
        if field_name not in rules:
            problems.append((path, unknown_key(key, name)))
            ok = False
            continue
        if field_name in raw_by_field:
            other_key, other_value = raw_by_field[field_name]
            if _as_json(other_value) != _as_json(raw_value):
                problems.append(
                    (path, f"{key} and {other_key} mean the same ({field_name}) and are given different "
                     f"values ({show(raw_value)} and {show(other_value)}); keep one")
                )  # fmt: skip
                ok = False
            continue
        raw_by_field[field_name] = (key, raw_value)
        value, problem = convert(rules[field_name], field_name, raw_value)
        if problem:
            problems.append((path, problem))
            ok = False
        elif value is not DEFAULT:
            values[field_name] = value
    return CLASSES[name](**values) if ok else None


def unknown_key(key: str, block: str) -> str:
    """The problem for a key that ``block`` does not have: a "did you mean", or where it belongs."""
    valid = [*RULES[block], *ALIASES[block], *IGNORED[block]]
    hint = did_you_mean(key, valid)
    if not hint:
        homes = [b for b in BLOCKS if b != block and key in (*RULES[b], *ALIASES[b])]
        if homes:
            return f'unknown key in "{block}"; it is a key of "{homes[0]}"'
        return f'unknown key in "{block}"; valid keys: {", ".join(valid)}'
    return f'unknown key in "{block}"{hint}'


def keys_table() -> str:
    """The README's table of configuration keys (Markdown), written from the declarations."""
    rows = ["| block | key | default | meaning |", "|---|---|---|---|"]
    for name, cls in CLASSES.items():
        for f in dataclasses.fields(cls):
            key = " = ".join(f"`{k}`" for k in (f.name, *(a for a, to in ALIASES[name].items() if to == f.name)))
            rows.append(f"| `{name}` | {key} | {_shown(f)} | {_markdown(f.metadata['doc'])} |")
        for key, (_, doc) in IGNORED[name].items():
            rows.append(f"| `{name}` | `{key}` | | {_markdown(doc)} |")
    return "\n".join(rows) + "\n"


def _markdown(doc: str) -> str:
    return " ".join(doc.replace("``", "`").replace(":func:", "").split())


def _shown(f: dataclasses.Field) -> str:
    if f.metadata["shown"]:
        return f.metadata["shown"]
    value = f.default
    if value is None or value is dataclasses.MISSING:
        return ""
    if isinstance(value, bool):
        return str(value).lower()
    if f.metadata["rule"].kind == "bytes" and value >= 1024:
        return format_size(value)
    return str(value)


def block_to_dict(block: Any) -> dict:
    """A block's fields as JSON values (tuples of paths become lists)."""
    out = {}
    for f in dataclasses.fields(block):
        value = getattr(block, f.name)
        out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


def _validate(obj: Any, name: str) -> None:
    """The dataclasses' check: every field, all problems in one ConfigError; normalizes in place."""
    problems = []
    for field_name, rule in RULES[name].items():
        value, problem = check(rule, field_name, getattr(obj, field_name))
        if problem:
            problems.append((f"{name}.{field_name}", problem))
        else:
            object.__setattr__(obj, field_name, value)  # e.g. numpy ints -> int, lists -> tuples
    raise_if(problems, f"invalid {name} settings")


def _as_paths(value: str | tuple | None) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def _as_json(value: Any) -> tuple:
    # Compare values as JSON sees them: 1 and true differ (Python's 1 == True does not tell them apart).
    return (type(value).__name__ if isinstance(value, bool) else "", value)
