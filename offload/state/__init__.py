"""Offloaded optimizer state: its layout in units, the store that owns it, and saved state's checks."""

from .codec import chunk_values, exported_keys, set_chunk_values
from .dicts import check_param_state, check_state_dict, in_memory_state, local_entry, match_groups, step_tensor
from .layout import GRAIN, HALF_DTYPES, Chunk, Layout, ParamSlot, Unit, state_dtype_for, state_keys_for
from .store import StateStore, pool_buffer_size, resolve_pin

__all__ = [
    "GRAIN",
    "HALF_DTYPES",
    "Chunk",
    "Layout",
    "ParamSlot",
    "StateStore",
    "Unit",
    "check_param_state",
    "chunk_values",
    "exported_keys",
    "set_chunk_values",
    "check_state_dict",
    "in_memory_state",
    "local_entry",
    "match_groups",
    "pool_buffer_size",
    "resolve_pin",
    "state_dtype_for",
    "state_keys_for",
    "step_tensor",
]
