"""The overlap hand-off: how backward's hooks tell an optimizer that a gradient is final, and hand it weights."""

from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["Handoff"]


# NOTE: with overlap_backward an optimizer updates during backward, so it must learn when each offloaded
# parameter's gradient is final, and may take the weights backward still holds instead of fetching them
# again. This object is that protocol, made with the parameter store and given at construction to both
# sides: the hooks (``Scheduler``, which joins it) and the optimizer (through ``ParamAccess.watch``).
# For a watched parameter p, at its post-accumulate-grad hook, in this order:
#   1. ``offer(p)``: if backward holds p's weights, the watcher's ``take(p)`` says whether the optimizer
#      takes them as they are; then the hold is the optimizer's (ParamAccess.adopt) and the gradient stays
#      in memory (GradStore.merge) instead of going to NVMe (GradStore.put);
#   2. ``final(p)``: the gradient is where the update will look for it; the watcher's ``final(p)`` runs;
#   3. the update releases an adopted hold after p's last chunk, writing the weights back once, and
#      drops the gradient (GradStore.consume).
class Handoff:
    """The hand-off between the hooks of one offloaded model and an optimizer updating during backward."""

    def __init__(self):
        self.hooks: Any = None  # the hooks reporting final gradients (they join at their construction)
        self._watchers: dict[torch.Tensor, Any] = {}

    def join(self, hooks: Any) -> None:
        """``hooks`` report every final gradient of the store's parameters through :meth:`offer`/:meth:`final`."""
        self.hooks = hooks

    @property
    def reported(self) -> bool:
        """Whether final gradients are reported here (hooks have joined)."""
        return self.hooks is not None

    def watch(self, p: torch.Tensor, watcher: Any) -> _Unwatch:
        """Tell ``watcher`` about ``p`` (see the note above); returns a handle whose ``remove()`` stops it."""
        self._watchers[p] = watcher
        return _Unwatch(self._watchers, p)

    def offer(self, p: torch.Tensor, held: bool) -> bool:
        """``p``'s gradient is accumulated; ``held``: backward holds its weights. Returns whether the watcher
        took them (the hold is then its own)."""
        watcher = self._watchers.get(p)
        return held and watcher is not None and bool(watcher.take(p))

    def refused(self, p: torch.Tensor) -> None:
        """A torch use of ``p``'s gradient placeholder was refused: tell its watcher, if it wants to know."""
        watcher: Optional[Any] = self._watchers.get(p)
        if watcher is not None and hasattr(watcher, "refused"):
            watcher.refused(p)

    def final(self, p: torch.Tensor) -> None:
        """``p``'s gradient is final and in place: tell its watcher, if any."""
        watcher: Optional[Any] = self._watchers.get(p)
        if watcher is not None:
            watcher.final(p)


class _Unwatch:
    """A handle that stops a hand-off telling a watcher about a parameter."""

    def __init__(self, watchers: dict, p: torch.Tensor):
        self._watchers, self._p = watchers, p

    def remove(self) -> None:
        self._watchers.pop(self._p, None)
