"""Records read from JSON and written back, field by field: each field of a frozen dataclass carries the
check its JSON value must pass, named in the error when it fails (``CheckpointError``). The manifest's
dataclasses (:mod:`offload.checkpoint.manifest`) are built on :class:`Entry` and these checks.
"""

from __future__ import annotations

from dataclasses import field, fields
from typing import Any, Callable

from ..errors import CheckpointError
from .format import dtype_of

__all__ = ["Entry", "bare_name", "check_value", "count", "dtype_value", "fail", "flag", "json_field", "json_object",
           "list_of", "maybe", "number", "one_of", "string"]


# -- reading JSON values, each checked with its field's name ----------------------------------------

def fail(name: str, want: str, value: Any):
    """Refuse field ``name``: it must be ``want`` and is ``value`` (shown cut to 60 characters)."""
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    raise CheckpointError(f"manifest field {name} must be {want}, got {shown}")


def check_value(want: str, ok: Callable[[Any], bool]) -> Callable[[Any, str], Any]:
    """A check of a JSON value: ``ok(value)``, else refused as not ``want``."""
    def read(value: Any, name: str) -> Any:
        if not ok(value):
            fail(name, want, value)
        return value
    return read


count = check_value("a non-negative integer", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0)
number = check_value("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool))
string = check_value("a string", lambda v: isinstance(v, str))
flag = check_value("true or false", lambda v: isinstance(v, bool))
json_object = check_value("an object", lambda v: isinstance(v, dict))
# A file name inside the checkpoint directory: no separator, not absolute, not "." or "..".
bare_name = check_value("a file name inside the checkpoint directory (no '/', not '..')",
                    lambda v: isinstance(v, str) and v not in ("", ".", "..") and "/" not in v and "\0" not in v)


def dtype_value(value: Any, name: str) -> str:
    """A check of a torch dtype's name (``"float32"``)."""
    string(value, name)
    try:
        dtype_of(value)
    except CheckpointError:
        fail(name, "the name of a torch dtype", value)
    return value


def list_of(item: Callable[[Any, str], Any]) -> Callable[[Any, str], tuple]:
    """A check of a JSON list whose every item passes ``item`` (named ``field[i]``); read as a tuple."""
    def read(value: Any, name: str) -> tuple:
        if not isinstance(value, list):
            fail(name, "a list", value)
        return tuple(item(v, f"{name}[{i}]") for i, v in enumerate(value))
    return read


def maybe(check: Callable[[Any, str], Any]) -> Callable[[Any, str], Any]:
    """``check``, or null."""
    return lambda value, name: None if value is None else check(value, name)


def one_of(*choices: str) -> Callable[[Any, str], str]:
    """A check that the value is one of ``choices``."""
    return check_value("one of " + ", ".join(repr(c) for c in choices), lambda v: v in choices)


# -- entries read from and written to JSON, field by field ------------------------------------------

def json_field(check: Callable[[Any, str], Any], default: Any = None, *, required: bool = False,
           null: bool = False) -> Any:
    """A dataclass field read from the manifest's JSON with ``check`` (``required``: refused if missing) and
    written back by ``to_json`` (where None only with ``null``)."""
    meta = {"check": check, "null": null, "required": required}
    if isinstance(default, dict):
        return field(default_factory=dict, metadata=meta)
    return field(default=default, metadata=meta)


def to_json_value(value: Any) -> Any:
    if hasattr(value, "to_json"):
        return value.to_json()
    if isinstance(value, (list, tuple)):
        return [to_json_value(v) for v in value]
    if isinstance(value, dict):
        return {k: to_json_value(v) for k, v in value.items()}
    return value


class Entry:
    """Parsing and writing of a frozen dataclass, from the checks of its :func:`json_field` fields."""

    @classmethod
    def parse(cls, value: Any, name: str, **more):
        """Read an entry from its JSON ``value`` (field ``name`` of the manifest), checking every field.

        Raises:
            CheckpointError: a field is missing, of the wrong type or out of range (named).
        """
        json_object(value, name or "(the whole manifest)")
        given = {}
        for f in fields(cls):
            if "check" not in f.metadata:
                continue
            where = f"{name}.{f.name}" if name else f.name
            if f.name in value:
                given[f.name] = f.metadata["check"](value[f.name], where)
            elif f.metadata["required"]:
                raise CheckpointError(f"manifest field {where} is missing")
        entry = cls(**given, **more)
        entry.check(name)
        return entry

    def check(self, name: str) -> None:
        """Checks between fields, once each is read."""

    def require(self, name: str, *keys: str) -> None:
        """Refuse the entry (field ``name``) unless it has every one of ``keys``."""
        for key in keys:
            if getattr(self, key) is None:
                raise CheckpointError(f"manifest field {name}.{key} is missing")

    def to_json(self) -> dict:
        """The entry as the manifest's JSON holds it."""
        return {f.name: to_json_value(getattr(self, f.name)) for f in fields(self)
                if "check" in f.metadata and (getattr(self, f.name) is not None or f.metadata["null"])}
