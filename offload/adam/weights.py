"""Loads of offloaded weights as the fp32 masters saw them: a load after a master was made is refused."""

from __future__ import annotations

from ..errors import StateError
from ..params import store_of, weight_loads
from ..state import StateStore

__all__ = ["WeightWatch"]


class WeightWatch:
    """Loads of offloaded weights seen by the fp32 masters. A load after a master was made (load_parameters,
    load_safetensors) would be undone by the next update, which writes the master's weights back.

    Args:
        groups: the optimizer's param groups.
        store: the owner of the offloaded state, whose slots say where a master is.
        state: the optimizer's ``state``, holding the masters of parameters whose state is in memory.
    """

    def __init__(self, groups: list[dict], store: StateStore, state: dict):
        self.groups = groups
        self.store = store
        self.state = state
        self._seen: dict[int, int] = {}  # id(param) -> the loads of its weights seen
        self.note()

    def note(self) -> None:
        """The weights of the parameters as they are now are the ones the masters hold."""
        self._loads_checked = weight_loads()
        for g in self.groups:
            for p in g["params"]:
                s = store_of(p)
                if s is not None:
                    self._seen[id(p)] = s.loads(p)

    def check(self) -> None:
        """Refuse to update a parameter whose offloaded weights were replaced from outside after its fp32
        master was made: the update would write the master's weights back over the ones loaded.

        Raises:
            StateError: such a parameter, with what to do instead.
        """
        loads = weight_loads()
        if loads == self._loads_checked:
            return  # no weights were loaded anywhere since the last look: nothing per parameter to do
        for g in self.groups:
            for p in g["params"]:
                s = store_of(p)
                if s is None or s.loads(p) == self._seen.get(id(p), s.loads(p)):
                    continue
                if not self._has_master(p):  # no master yet: it is made from the weights as they are now
                    self._seen[id(p)] = s.loads(p)
                    continue
                raise StateError(
                    f"the weights of a {tuple(p.shape)} {str(p.dtype).removeprefix('torch.')} parameter were "
                    "replaced (load_parameters, load_safetensors) after this optimizer made its fp32 master copy "
                    "of them; the next update would write the old weights back over them. Load weights before "
                    "the first step (or build the optimizer after loading), or load a checkpoint of this "
                    "optimizer (load_checkpoint with model=), which restores both together.")
        self._loads_checked = loads

    def _has_master(self, p) -> bool:
        slot = self.store.slot(p)
        if slot is not None:
            return slot.has_master
        return "master" in self.state.get(p, {})
