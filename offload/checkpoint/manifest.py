"""The shape of a manifest, checked in one place: every field a reader uses, with its type, so that a
manifest of the wrong shape is refused with the field's name instead of failing later as a KeyError,
TypeError or IndexError somewhere in a load."""

from __future__ import annotations

from typing import Any, Callable

from ..errors import CheckpointError
from .format import FORMAT, JOB_FORMAT

# A check takes the value and its field's name and raises CheckpointError (a ValueError) naming it.
Check = Callable[[Any, str], None]


def _fail(name: str, want: str, value: Any) -> None:
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    raise CheckpointError(f"manifest field {name} must be {want}, got {shown}")


def _integer(value: Any, name: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        _fail(name, "a non-negative integer", value)


def _number(value: Any, name: str) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        _fail(name, "a number", value)


def _text(value: Any, name: str) -> None:
    if not isinstance(value, str):
        _fail(name, "a string", value)


def _flag(value: Any, name: str) -> None:
    if not isinstance(value, bool):
        _fail(name, "true or false", value)


def _any_object(value: Any, name: str) -> None:
    if not isinstance(value, dict):
        _fail(name, "an object", value)


def _maybe(check: Check) -> Check:
    def run(value: Any, name: str) -> None:
        if value is not None:
            check(value, name)
    return run


def _one_of(*choices: str) -> Check:
    def run(value: Any, name: str) -> None:
        if value not in choices:
            _fail(name, "one of " + ", ".join(repr(c) for c in choices), value)
    return run


def _list(item: Check, length: int | None = None) -> Check:
    def run(value: Any, name: str) -> None:
        if not isinstance(value, list) or (length is not None and len(value) != length):
            _fail(name, "a list" + (f" of {length}" if length is not None else ""), value)
        for i, v in enumerate(value):
            item(v, f"{name}[{i}]")
    return run


def _object(required: dict[str, Check], optional: dict[str, Check] | None = None) -> Check:
    def run(value: Any, name: str) -> None:
        if not isinstance(value, dict):
            _fail(name, "an object", value)
        for key, check in required.items():
            if key not in value:
                raise CheckpointError(f"manifest field {_field(name, key)} is missing")
            check(value[key], _field(name, key))
        for key, check in (optional or {}).items():
            if key in value:
                check(value[key], _field(name, key))
    return run


def _field(name: str, key: str) -> str:
    return f"{name}.{key}" if name else key


def _map(item: Check) -> Check:
    def run(value: Any, name: str) -> None:
        if not isinstance(value, dict):
            _fail(name, "an object", value)
        for key, v in value.items():
            item(v, f"{name}[{key!r}]")
    return run


_FILE = _object({"bytes": _integer, "xxh3_64": _text}, {"file": _text})
def _chunk(value: Any, name: str) -> None:
    """A chunk of a parameter's state in state.bin: [unit, first element, elements, byte offset in unit,
    bytes per key], and where the keys' dtypes differ (stride 0) a sixth: each key's slice offset."""
    if not isinstance(value, list) or len(value) not in (5, 6):
        _fail(name, "a list of 5 numbers (and the keys' offsets)", value)
    for i, v in enumerate(value[:5]):
        _integer(v, f"{name}[{i}]")
    if len(value) == 6:
        _list(_integer)(value[5], f"{name}[5]")


_CHUNK = _chunk
_PARAM = _object(
    {"index": _integer, "where": _one_of("swap", "memory", "none"), "initialized": _flag},
    {"shape": _maybe(_list(_integer)), "dtype": _maybe(_text), "numel": _maybe(_integer), "keys": _list(_text),
     "state_dtype": _text, "key_dtypes": _list(_text), "chunks": _list(_CHUNK), "step": _number})
_UNIT = _object({"offset": _integer, "length": _integer}, {"nbytes": _integer, "xxh3_64": _text})
_TENSOR = _object({"name": _text}, {
    "same_as": _text, "kind": _one_of("param", "buffer"), "shape": _list(_integer), "dtype": _text,
    "where": _one_of("params.bin", "model.pt"), "offset": _integer, "length": _integer, "xxh3_64": _text})
_GROUP = _object({"params": _list(_integer)})

_PROCESS = _object(
    {"version": _integer, "files": _map(_FILE), "units": _list(_UNIT)},
    {"optimizer": _maybe(_text), "step": _number, "steps": _list(_number), "param_groups": _list(_GROUP),
     "params": _list(_PARAM), "config": _any_object, "buffer_size": _integer, "threshold": _integer,
     "model": _object({"tensors": _list(_TENSOR)}), "snapshot": _any_object})
_SHARD = _object({"rank": _integer, "name": _text, "manifest_xxh3_64": _text, "files": _map(_FILE)},
                 {"manifest": _text, "step": _number})
_JOB = _object({"version": _integer, "job": _text, "world_size": _integer, "shards": _list(_SHARD)},
               {"step": _number})


def check_manifest(manifest: Any, where: str) -> None:
    """Check that ``manifest`` (a process's or a job's, by its ``format``) has every field a reader uses,
    of the right type; ``where`` (the manifest's path) begins the message.

    Raises:
        CheckpointError: a ValueError naming the first field that is missing or of the wrong type.
    """
    try:
        if not isinstance(manifest, dict):
            _fail("(the whole manifest)", "an object", manifest)
        kind = manifest.get("format")
        if kind == JOB_FORMAT:
            _JOB(manifest, "")
            if len(manifest["shards"]) != manifest["world_size"]:
                raise CheckpointError(f"manifest field shards lists {len(manifest['shards'])} shards for a "
                                      f"world_size of {manifest['world_size']}")
        elif kind == FORMAT:
            _PROCESS(manifest, "")
            for p in manifest.get("params", ()):
                for i, c in enumerate(p.get("chunks", ())):
                    if c[0] >= len(manifest["units"]):
                        raise CheckpointError(f"manifest field params[{p['index']}].chunks[{i}] names unit "
                                              f"{c[0]}, and there are {len(manifest['units'])}")
        else:
            _fail("format", f"{FORMAT!r} or {JOB_FORMAT!r}", kind)
    except CheckpointError as err:
        raise CheckpointError(f"{where}: {err}") from None
