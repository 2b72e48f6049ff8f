"""The three configuration blocks as frozen dataclasses, and :class:`Config`, which holds them.

Each block checks every field at construction and reports every problem in one ``ConfigError``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .rules import ALIASES, BLOCKS, DEFAULT, RULES, check, convert, did_you_mean, raise_if, show, unknown_key

__all__ = ["CLASSES", "AioConfig", "Config", "OptimizerOffloadConfig", "ParamOffloadConfig", "block_to_dict",
           "read_block"]  # fmt: skip


# NOTE: every setting is checked in one place, at the edge. A block's ``__post_init__`` runs the rules of
# offload.config.rules over every field; the loader reads JSON with the same rules plus the conveniences a
# file needs (human sizes, "auto", aliases). Nothing downstream re-validates.
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
        use_gds: GPUDirect Storage (the ``gds`` extra: kvikio and a cuFile driver). Accepted, so DeepSpeed
            files that set it load as they are; an optimizer or parameter store built with it warns once
            what GDS gives on this machine (unavailable: the reason) and moves state through the pinned
            host pool either way. See :func:`offload.aio.gds_status`.
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
        device: ``"nvme"`` (state on the drives of ``nvme_path``), or ``"cpu"`` (all state in host memory,
            no swap file: pinned with ``pin_memory``, and updated on the GPU for CUDA parameters).
            ``"none"`` is read from DeepSpeed files but refused by the optimizers (use ``torch.optim``).
        nvme_path: a directory, or a list of directories (one per drive; state is striped over them), or
            ``None`` to give the path when building the optimizer. Stored as a ``str`` or a ``tuple``.
        buffer_count: buffers in the host pool, 2 to 4096 (3 or more lets a read, an update and a write
            overlap). DeepSpeed's default, 4.
        buffer_size: bytes per pool buffer (our extension; DeepSpeed sizes them from the largest
            sub-group). A multiple of 4096; human sizes such as ``"64MiB"`` are read from files.
            Parameters larger than a buffer are split across buffers. The pool must fit in the
            machine's memory; that is checked when it is allocated.
        pin_memory: register the pool (and the host cache) with CUDA, page-locked, for fast GPU copies:
            pageable memory copied at 17 GB/s against 54 GB/s pinned on an H100. ``"auto"`` (the default):
            pinned when any parameter is on a GPU.
        pipeline_read: read the next sub-group while the current one is updated.
        pipeline_write: write the previous sub-group while the current one is updated.
        fast_init: accepted for DeepSpeed compatibility; swap files are always preallocated up front.
        ratio: fraction of optimizer state offloaded; only ``1.0`` (all of it) is supported.
        small_param_threshold: parameters with fewer elements keep their state in host memory (our
            extension): a disk round trip costs more than it saves for biases and norms.
        host_cache: bytes of NVMe state kept resident in host memory between steps (a human size in
            files, ``"48GiB"``), or ``"auto"`` (a share of available memory, see the README); 0: none.
            Units are visited in snake order, so bytes moved per step fall to (state - cache) each way.
        state_dtype: ``"fp32"`` (exp_avg and exp_avg_sq in fp32: bitwise torch) or ``"bf16"`` (stored as
            bf16, computed in fp32, rounded to nearest; fp32 master copies stay fp32).
        checksum: keep an xxh3_64 of every unit written and verify it on every read, so state changed on
            disk behind our back is found instead of trained on (off by default: on a 2-core machine it
            cost 3-7% of a step; measure yours with ``offload-bench adam --checksum-cost``).
        overlap_backward: read and update state during backward, as each unit's grads become final, so an
            iteration costs about max(compute, I/O); see the README for what it cannot be combined with.

    Raises:
        ConfigError: at construction, naming every bad field.
    """

    device: str = "nvme"
    nvme_path: str | tuple | None = None
    buffer_count: int = 4
    buffer_size: int = 64 << 20
    pin_memory: bool | str = "auto"
    pipeline_read: bool = True
    pipeline_write: bool = True
    fast_init: bool = False
    ratio: float = 1.0
    small_param_threshold: int = 4096
    host_cache: int | str = 0
    state_dtype: str = "fp32"
    checksum: bool = False
    overlap_backward: bool = False

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
        buffer_count: buffers in the parameter pool, 2 to 4096. DeepSpeed's default, 5.
        buffer_size: ELEMENTS per buffer (not bytes, as in DeepSpeed), default 1e8, at most an int64.
        max_in_cpu: parameter elements that may stay in host memory, default 1e9.
        max_grad_in_cpu: gradient elements of offloaded parameters kept in host memory between backward
            and the step instead of being written to NVMe and read back (smallest first), default 1e9.
        pin_memory: register the pool with CUDA (page-locked); ``"auto"`` (the default): when the model is
            on a GPU.
        checksum: keep an xxh3_64 of every weight unit written and verify it when read back (off by
            default, as for the optimizer's state).

    Raises:
        ConfigError: at construction, naming every bad field.
    """

    device: str = "nvme"
    nvme_path: str | tuple | None = None
    buffer_count: int = 5
    buffer_size: int = 100_000_000
    max_in_cpu: int = 1_000_000_000
    max_grad_in_cpu: int = 1_000_000_000
    pin_memory: bool | str = "auto"
    checksum: bool = False

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


@dataclass(frozen=True)
class Config:
    """The three blocks together: what :func:`offload.config.load_config` returns.

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
