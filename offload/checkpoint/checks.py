"""What a process's manifest must say as a whole, once each of its entries is read: every index names
something the manifest lists, every range lies within what it points into, every file is inside the
checkpoint directory. One function per rule, run in the order of :data:`RULES` on a
:class:`~offload.checkpoint.manifest.Manifest`; each refuses with a ``CheckpointError`` naming the field.
Then, when a load reads memory.pt, :func:`memory_holds` checks it holds what the manifest lists."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import CheckpointError
from ..units import ALIGNMENT, round_up
from .fields import fail
from .format import DATA, MEMORY, PARAMS_DATA, PIECES_VERSION


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
        sizes = [d.itemsize for d in p.state_dtypes()] if p.keys else []
        for j, c in enumerate(p.chunks):
            _chunk_within_unit(m.units, f"params[{i}].chunks[{j}]", c, sizes)


def _chunk_within_unit(units: tuple, name: str, c: Any, sizes: list) -> None:
    """Chunk ``c`` (field ``name``) names one of ``units``, and each key's slice (of ``sizes``-byte
    elements) lies within the unit's state bytes at an offset that is a multiple of its element size."""
    if c.unit >= len(units):
        raise CheckpointError(f"manifest field {name} names unit {c.unit}, and there are {len(units)}")
    unit = units[c.unit]
    room = unit.nbytes if unit.nbytes is not None else unit.length
    if any(c.key_offset(k) + c.numel * size > room for k, size in enumerate(sizes)):
        fail(name, f"slices within unit {c.unit}'s {room} bytes", c.to_json())
    if any(c.key_offset(k) % size for k, size in enumerate(sizes)):
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
