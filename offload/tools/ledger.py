"""The bytes ledger: what an iteration moves to and from the drives, per parameter, by what moves and when.

Every benchmark that trains (``compare``'s runs, ``params``, ``adam``) counts the same things the same way, from
the stores' own counters (bytes each request moved) read at the boundaries of forward, backward and step, and,
beside them, the process's disk bytes (``/proc/self/io``: what the kernel read and wrote for it, the only figure a
peer that is not ours has). An iteration of bf16 weights and fp32 state, weights on NVMe and the step after
backward, moves 2 + 2 (weights read in forward, in backward) + 2 + 2 (grads out and back) + 12 + 12 (master and
moments) + 2 (weights written) bytes per parameter, less what the pool still holds.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

__all__ = ["KINDS", "Ledger", "Meter", "disk_bytes", "render"]

# What moves, in the order an iteration moves it; each names the counter and the phase it is read in ("any":
# wherever it happens, e.g. state updated inside backward).
KINDS = (
    ("weights read in forward", "weights_read", "forward"),
    ("weights read in backward", "weights_read", "backward"),
    ("weights read by the step", "weights_read", "step"),
    ("grads written", "grads_written", "any"),
    ("grads read", "grads_read", "any"),
    ("state read", "state_read", "any"),
    ("state written", "state_written", "any"),
    ("weights written", "weights_written", "any"),
)
PHASES = ("forward", "backward", "step")


def disk_bytes(pid: str = "self") -> Optional[int]:
    """Bytes the process read from and wrote to storage so far (``/proc/<pid>/io``), or None where unreadable."""
    try:
        with open(f"/proc/{pid}/io", encoding="ascii") as f:
            fields = dict(line.split(": ", 1) for line in f.read().splitlines() if ": " in line)
        return int(fields["read_bytes"]) + int(fields["write_bytes"])
    except (OSError, KeyError, ValueError):
        return None


@dataclasses.dataclass
class Ledger:
    """Bytes per parameter per iteration, by kind (:data:`KINDS`), and the process's disk bytes beside them."""

    params: int
    kinds: dict = dataclasses.field(default_factory=dict)  # kind -> bytes per parameter per iteration
    disk: Optional[float] = None  # /proc/self/io, bytes per parameter per iteration

    @property
    def total(self) -> float:
        """Bytes per parameter per iteration, every kind together."""
        return sum(self.kinds.values())

    def to_dict(self) -> dict:
        """The ledger as a report's JSON holds it."""
        return {"bytes_per_param_iteration": dict(self.kinds), "total": self.total, "disk": self.disk}

    @classmethod
    def from_dict(cls, doc: dict, params: int) -> Ledger:
        """The ledger of :meth:`to_dict`'s ``doc``, for a run of ``params`` parameters."""
        return cls(params, dict(doc.get("bytes_per_param_iteration", {})), doc.get("disk"))


class Meter:
    """Counts what one run's iterations move, phase by phase.

    Args:
        params: parameters (the ledger is per parameter).
        counters: ``counters()`` gives ``{counter: bytes so far}`` for the counters :data:`KINDS` name (missing
            ones count nothing: weights in memory, say).
    """

    def __init__(self, params: int, counters: Callable[[], dict]):
        self.params = params
        self.counters = counters
        self.totals: dict = {}
        self.disk = 0
        self.iterations = 0
        self._at: Optional[tuple] = None

    def start(self) -> None:
        """An iteration starts: the counters now are its base."""
        self._at = (self.counters(), disk_bytes())

    def phase(self, name: str) -> None:
        """Phase ``name`` (one of :data:`PHASES`) has just ended: what moved since the last boundary is its."""
        then, disk_then = self._at
        now, disk_now = self.counters(), disk_bytes()
        for kind, counter, phase in KINDS:
            if phase in ("any", name):
                self.totals[kind] = self.totals.get(kind, 0) + now.get(counter, 0) - then.get(counter, 0)
        if disk_now is not None and disk_then is not None:
            self.disk += disk_now - disk_then
        self._at = (now, disk_now)

    def end(self) -> None:
        """An iteration has ended (after its step)."""
        self.iterations += 1

    def ledger(self) -> Ledger:
        """Bytes per parameter per iteration over the iterations counted."""
        per = max(1, self.iterations) * max(1, self.params)
        return Ledger(self.params, {kind: self.totals.get(kind, 0) / per for kind, _, _ in KINDS},
                      self.disk / per if disk_bytes() is not None else None)


def counters_of(opt, store=None) -> Callable[[], dict]:
    """The counters of an optimizer (its state's reads and writes) and, for weights offloaded with
    ``offload_parameters``, of their store (weights and grads)."""
    def read() -> dict:
        r, w = opt.io_bytes()
        out = {"state_read": r, "state_written": w}
        if store is not None:
            out.update(weights_read=store.bytes_read, weights_written=store.bytes_written,
                       grads_read=store.grad_bytes_read, grads_written=store.grad_bytes_written)
        return out
    return read


def render(rows: list[tuple[str, Optional[Ledger]]]) -> list[list[str]]:
    """Table rows (kind by kind, then the totals) with a column per ledger; a peer's ledger may have the disk
    figure alone."""
    out = []
    for kind, _, _ in KINDS:
        if any(ledger is not None and ledger.kinds.get(kind) for _, ledger in rows):
            out.append([kind] + [_cell(ledger.kinds.get(kind) if ledger else None) for _, ledger in rows])
    out.append(["total (the stores' counters)"] + [_cell(ledger.total if ledger and ledger.kinds else None)
                                                    for _, ledger in rows])
    out.append(["the process's disk bytes (/proc)"] + [_cell(ledger.disk if ledger else None) for _, ledger in rows])
    return out


def _cell(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}"
