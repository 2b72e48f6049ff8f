"""The optimizer's offloaded state in torch's state_dict layout: read out by ``state_dict()``, written back
by ``load_state_dict()``."""

from __future__ import annotations

from ..checkpoint.load import restore_in_memory
from ..distributed import is_dtensor, like
from ..params import ParamAccess
from ..state import StateStore, local_entry

__all__ = ["add_offloaded_state", "load_state"]


def add_offloaded_state(sd: dict, groups: list[dict], store: StateStore, state: dict) -> dict:
    """``sd``, torch's state_dict of the optimizer (the steps alone of offloaded parameters), with the
    offloaded state of each parameter read back into it; returns ``sd``.

    Offloaded state lives on the host side: it stays there (as torch's optimizers keep state where it
    lives), so saving state larger than the GPU's memory works. A DTensor's shard goes to its mesh's
    device, where a DTensor's local tensor must be.
    """
    index = {p: i for i, p in enumerate(p for g in groups for p in g["params"])}
    for slot, tensors in store.read_state():
        entry = {k: like(t.to(slot.param.device) if is_dtensor(slot.param) else t, slot.param)
                 for k, t in tensors.items()}
        entry["step"] = state[slot.param]["step"].clone()
        sd["state"][index[slot.param]] = entry
    return sd


def load_state(optimizer, state_dict: dict, params: list, access: ParamAccess) -> None:
    """Put ``state_dict``'s state in place: the in-memory side, then the offloaded state unit by unit.

    Args:
        optimizer: an :class:`offload.OffloadedAdam` or ``OffloadedAdamW``.
        state_dict: torch's layout, already checked against the optimizer's groups.
        params: the optimizer's parameters by the state dict's indices.
        access: the optimizer's access to weights that ``offload_parameters`` holds.
    """
    store = optimizer.state_store
    entries = {params[k]: local_entry(entry, params[k]) for k, entry in state_dict["state"].items()}
    offloaded = {p: e for p, e in entries.items() if not store.is_small(p)}
    restore_in_memory(optimizer, state_dict["param_groups"], {p: e for p, e in entries.items() if p not in offloaded},
                      {p: e.get("step", 0.0) for p, e in offloaded.items()})
    _write_offloaded(store, optimizer.param_groups, offloaded, access)
    store.restored()


def _write_offloaded(store: StateStore, groups: list[dict], offloaded: dict, access: ParamAccess) -> None:
    """``{param: state}`` written to the store's units, parameters that have no place yet placed first."""
    store.place_late(groups, offloaded)  # frozen at construction: placed now, together
    by_slot = {store.slot(p): e for p, e in offloaded.items()}
    units = store.units_of(by_slot)
    with access.units(units, {id(s) for s in by_slot}, write_back=False) as unit_pass:
        # A master copy made from weights on NVMe needs them resident, one unit's worth at a time.
        store.write_state(by_slot, master_from=unit_pass.weights, after_unit=unit_pass.done)
