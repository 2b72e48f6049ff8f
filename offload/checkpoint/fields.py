"""What a manifest is checked with: each field of a frozen dataclass carries the check its JSON value must
pass (:class:`Entry`, :func:`json_field`), and the rules of a process's manifest as a whole (:data:`RULES`)
run once its entries are read. Every refusal is a ``CheckpointError`` naming the field. The manifest's
dataclasses (:mod:`offload.checkpoint.manifest`) are built on these.
"""

from __future__ import annotations

from dataclasses import field, fields
from typing import Any, Callable

import torch

from .. import codes
from ..errors import CheckpointError
from ..sizes import ALIGNMENT, round_up
from .format import DATA, MEMORY, PARAMS_DATA, PIECES_VERSION, dtype_of, jsonable

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
        return {f.name: jsonable(getattr(self, f.name), strict=True) for f in fields(self)
                if "check" in f.metadata and (getattr(self, f.name) is not None or f.metadata["null"])}


# -- the rules of a process's manifest as a whole ------------------------------------------------------
# Once each of its entries is read: every index names something the manifest lists, every range lies
# within what it points into, every file is inside the checkpoint directory. One function per rule, run
# in the order of RULES on a Manifest. Then, when a load reads memory.pt, memory_holds checks it holds
# what the manifest lists.


def memory_listed(m: Any) -> None:
    """An optimizer's checkpoint lists memory.pt (its groups and small state)."""
    if m.optimizer is not None and MEMORY not in m.files:
        raise CheckpointError(f"manifest field files lists no {MEMORY}, which an optimizer's checkpoint has (its "
                              "groups and small state); load another checkpoint")


def units_within_data(m: Any) -> None:
    """Units lie within state.bin, which the manifest lists where it has units."""
    data = m.files.get(DATA)
    if m.units and data is None:
        raise CheckpointError(f"manifest field units lists {len(m.units)} units, and files has no {DATA}")
    for i, u in enumerate(m.units):
        if u.offset + u.length > data.bytes:
            fail(f"units[{i}]", f"a range within {DATA}'s {data.bytes} bytes", u.to_json())


def units_cover_data(m: Any) -> None:
    """state.bin without a checksum of its own: its units' checksums must cover every byte of it, so the
    units lie back to back from byte 0 to its end, each with a checksum."""
    data = m.files.get(DATA)
    if data is None or data.xxh3_64 is not None:
        return
    pos = 0
    for i, u in enumerate(m.units):
        if u.xxh3_64 is None:
            raise CheckpointError(f"manifest field units[{i}].xxh3_64 is missing (files[{DATA!r}] has no "
                                  "xxh3_64 of its own: every unit's checksum must cover it)")
        if u.offset != pos:
            fail(f"units[{i}].offset", f"{pos}, where the unit before it ends (files[{DATA!r}] has no xxh3_64 "
                 "of its own: its units must cover it back to back)", u.offset)
        pos += u.length
    if pos != data.bytes:
        fail(f"files[{DATA!r}].bytes", f"{pos}, where its last unit ends (it has no xxh3_64 of its own: its "
             "units must cover it)", data.bytes)


def version_has_pieces(m: Any) -> None:
    """Units checksummed in pieces, or state.bin without a checksum, come with the version that has them."""
    if m.in_pieces and m.version < PIECES_VERSION:
        fail("version", f"{PIECES_VERSION} (units checksummed in pieces, or state.bin without a checksum)",
             m.version)


def params_within_units(m: Any) -> None:
    """Each parameter is listed at its index, and each of its chunks lies in a unit the manifest lists."""
    for i, p in enumerate(m.params):
        if p.index != i:
            fail(f"params[{i}].index", f"{i} (its place in the list)", p.index)
        sizes = list(zip(p.keys, (d.itemsize for d in p.state_dtypes()))) if p.keys else []
        for j, c in enumerate(p.chunks):
            _chunk_within_unit(m.units, f"params[{i}].chunks[{j}]", c, sizes)


def _chunk_within_unit(units: tuple, name: str, c: Any, sizes: list) -> None:
    """Chunk ``c`` (field ``name``) names one of ``units``, and each key's slice (``sizes``: ``(key, bytes per
    element)``; an absmax has one element per block) lies within the unit's state bytes at an offset that is a
    multiple of its element size."""
    if c.unit >= len(units):
        raise CheckpointError(f"manifest field {name} names unit {c.unit}, and there are {len(units)}")
    unit = units[c.unit]
    room = unit.nbytes if unit.nbytes is not None else unit.length
    if any(c.key_offset(k) + codes.elements(key, c.numel) * size > room for k, (key, size) in enumerate(sizes)):
        fail(name, f"slices within unit {c.unit}'s {room} bytes", c.to_json())
    if any(c.key_offset(k) % size for k, (_, size) in enumerate(sizes)):
        fail(name, "slices at offsets that are multiples of their dtypes' sizes", c.to_json())


def groups_hold_adam_state(m: Any) -> None:
    """Each group's parameters are listed, and each with state has an Adam parameter's: its moments (and
    with amsgrad their maximum), what a load would find missing."""
    for i, g in enumerate(m.param_groups):
        need = {"exp_avg", "exp_avg_sq"} | ({"max_exp_avg_sq"} if g.get("amsgrad") is True else set())
        for j, index in enumerate(g["params"]):
            if index >= len(m.params):
                fail(f"param_groups[{i}].params[{j}]", f"one of the {len(m.params)} params' indices", index)
            p = m.params[index]
            if p.initialized and p.where != "none" and not need <= set(p.keys):
                fail(f"params[{index}].keys", f"the state of an Adam parameter ({', '.join(sorted(need))})",
                     list(p.keys))


def tensors_within_files(m: Any) -> None:
    """Each model tensor with bytes of its own is in a file the manifest lists, and within params.bin's
    size there (a tied tensor's are those of the tensor it names, checked where the section is read)."""
    for i, t in enumerate(m.model.tensors if m.model is not None else ()):
        if t.same_as is not None:
            continue
        if t.where is not None and t.where not in m.files:
            raise CheckpointError(f"manifest field model.tensors[{i}].where names {t.where}, and files has "
                                  f"no {t.where}")
        if t.where == PARAMS_DATA and t.offset + round_up(t.length, ALIGNMENT) > m.files[t.where].bytes:
            fail(f"model.tensors[{i}]", f"a range within {PARAMS_DATA}'s {m.files[t.where].bytes} bytes",
                 t.to_json())


def files_inside(m: Any) -> None:
    """Each file the manifest lists is inside the checkpoint directory, and not a link (``Manifest.path``)."""
    for n in m.files:
        m.path(n, must_exist=False)


RULES = (memory_listed, units_within_data, units_cover_data, version_has_pieces, params_within_units,
         groups_hold_adam_state, tensors_within_files, files_inside)


def memory_holds(m: Any, memory: Any) -> None:
    """Refuse ``memory`` (memory.pt's content) unless it holds what manifest ``m`` says: the groups, each
    small parameter's state, each offloaded parameter's step.

    Raises:
        CheckpointError: the first thing missing, named.
    """
    where = f"checkpoint {m.root}: {MEMORY}"
    if not isinstance(memory, dict) or not all(isinstance(memory.get(k), t) for k, t in
                                               (("param_groups", list), ("state", dict), ("steps", dict))):
        raise CheckpointError(f"{where} is not the groups, state and steps of an optimizer; load another "
                              "checkpoint")
    for e in m.params:
        if e.initialized and e.where != "none":
            table, kind = (memory["steps"], "step") if e.where == "swap" else (memory["state"], "state")
            if not isinstance(table.get(e.index), dict if kind == "state" else (torch.Tensor, float, int)):
                raise CheckpointError(f"{where} lacks the {kind} of parameter {e.index}, which the manifest "
                                      "lists; load another checkpoint")
