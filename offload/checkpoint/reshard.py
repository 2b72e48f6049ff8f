"""A checkpoint loaded by ranks that hold other parts of the parameters than the ranks that saved it: a job's
checkpoint on another number of ranks (or on one process alone), a process's checkpoint under FSDP2. Each
rank finds, for its local shard of every tensor (a box of the full tensor, its elements in the full tensor's
flat order), the saved shards that hold those elements, and which of their elements they are."""

from __future__ import annotations

import itertools
import math
import os
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..distributed import Box, is_dtensor, like, local, local_box
from ..errors import CheckpointError
from ..params import named_tensors
from ..state.dicts import check_param_state
from .format import MODEL_MEMORY, dtype_of
from .manifest import JobManifest, LocalPart, Manifest, TensorEntry
from .model import model_memory, model_section
from .verify import missing_shards, shard_manifest


@dataclass(eq=False)
class Source:
    """A saved checkpoint of one rank (a shard of a job's, or a process's, rank 0) that a load reads from;
    its memory.pt and model.pt are read once, when first needed."""

    manifest: Manifest
    rank: int = 0
    _memory: Optional[dict] = field(default=None, repr=False)
    _model: Optional[dict] = field(default=None, repr=False)

    @property
    def name(self) -> str:
        """Its directory's name (a shard's: ``rank-<n>``)."""
        return os.path.basename(self.manifest.root)

    def memory(self) -> dict:
        """memory.pt, checked (:meth:`Manifest.memory`)."""
        if self._memory is None:
            self._memory = self.manifest.memory()
        return self._memory

    def model(self) -> dict:
        """model.pt, checked (:func:`model.model_memory`)."""
        if self._model is None:
            self._model = model_memory(self.manifest)
        return self._model


@dataclass(frozen=True)
class Piece:
    """Elements ``[new, new + n)`` of the part of a tensor this rank holds are elements ``[old, old + n)`` of
    the part ``source`` saved (``entry``: its manifest's entry of the tensor)."""

    source: Source
    entry: Any
    old: int
    new: int
    n: int

    def clip(self, lo: int, hi: int) -> Optional[Piece]:
        """The part of this piece that falls in ``[lo, hi)`` of this rank's elements, or None."""
        a, b = max(lo, self.new), min(hi, self.new + self.n)
        if a >= b:
            return None
        return Piece(self.source, self.entry, self.old + a - self.new, a, b - a)

    def saved(self, key: str) -> Optional[torch.Tensor]:
        """Elements ``[old, old + n)`` of state ``key`` held in memory.pt (flat, as saved), or None where the
        saved state is not in memory.pt or has no ``key``."""
        if self.entry.where != "memory":
            return None
        value = self.source.memory()["state"][self.entry.index].get(key)
        return None if value is None else local(value).detach().reshape(-1)[self.old:self.old + self.n]


@dataclass(frozen=True)
class SavedState:
    """A parameter's saved state as this rank loads it: pieces covering its local elements in order, its
    step, and the keys of its state in torch's layout (moments, master) that every piece holds."""

    pieces: tuple
    step: Any
    keys: tuple

    @classmethod
    def of(cls, pieces: tuple, source: Source, entry) -> SavedState:
        """The state of ``pieces``, with the step ``source`` saved in ``entry`` (for a local shard of no
        elements, no pieces: the keys are that entry's)."""
        held = [set(value_keys(x.source, x.entry)) for x in pieces]
        keys = tuple(k for k in value_keys(source, entry) if all(k in h for h in held))
        return cls(tuple(pieces), saved_step(source, entry), keys)

    def within(self, lo: int, hi: int) -> list[Piece]:
        """The pieces of elements ``[lo, hi)``, cut to them."""
        return [c for c in (p.clip(lo, hi) for p in self.pieces) if c is not None]


def value_keys(source: Source, entry) -> list[str]:
    """The keys of the state ``source`` saved for the parameter of ``entry``, in torch's layout."""
    if entry.where == "memory":
        return sorted(k for k in source.memory()["state"][entry.index] if k != "step")
    return entry.value_keys()


def saved_step(source: Source, entry) -> Any:
    """The step ``source`` saved for the parameter of ``entry``."""
    memory = source.memory()
    return memory["steps"][entry.index] if entry.where == "swap" else memory["state"][entry.index].get("step", 0.0)


# -- which shards a rank reads, and whether it must ------------------------------------------------


def sources_here(job: JobManifest) -> tuple[list[Source], list[str]]:
    """The shards of ``job`` in its directory here, by rank (each checked against the job manifest), and
    the names of those that are not here (node-local directories: on other nodes)."""
    missing = missing_shards(job)
    return [Source(shard_manifest(job, s.rank), s.rank) for s in job.shards if s.name not in missing], missing


def same_layout(source: Source, params: list, model: Optional[nn.Module]) -> bool:
    """Whether every part of a parameter (and of a model tensor) that ``source`` saved is the part this rank
    holds. A part not recorded (checkpoints from before it was) counts as the same where the saving rank held
    as many elements as this rank holds (or none): the same ranks in the same layout, as such checkpoints
    always loaded."""
    manifest = source.manifest
    if not all(_as_held(source, e, params[e.index], unknown=True) for e in manifest.params):
        return False
    if model is None or manifest.model is None:
        return True
    saved = {t.name: t for t in manifest.model.tensors}
    return all(_as_held(source, saved[name], t, unknown=False) for name, t, _ in named_tensors(model)
               if name in saved and saved[name].same_as is None)


def _as_held(source: Source, e, t: torch.Tensor, *, unknown: bool) -> bool:
    """Whether ``source`` saved the part of ``t`` this rank holds (entry ``e``); a part not recorded, where the
    saving rank held as many elements (or, with ``unknown``, saved no state)."""
    if e.local is not None:
        return _holds(e.local, t)
    n = held(source, e)
    return n == local(t).numel() or (unknown and n is None)


def _holds(part: LocalPart, t: torch.Tensor) -> bool:
    """Whether ``part`` is the part of ``t`` this rank holds."""
    return part.box is not None and part.box == local_box(t)


# NOTE: versions before parts were recorded wrote no ``local``. What the rank saved still shows how many
# elements it held; where that is all of the tensor (a process's checkpoint, DDP's replicated parameters, a
# DTensor whole on its rank) the part is the whole, and the checkpoint reshards like any other. A part of
# fewer elements stays unknown: it loads only into the layout that saved it (same_layout), and is refused
# anywhere else (_saved_box) rather than taken for elements it may not be.
def held(source: Source, entry) -> Optional[int]:
    """How many elements of the tensor of ``entry`` (a parameter's or a model tensor's) ``source`` saved,
    from what it saved; None for a parameter without saved state."""
    if isinstance(entry, TensorEntry):
        if entry.where != MODEL_MEMORY:
            return math.prod(entry.shape)  # params.bin: whole tensors only
        value = source.model().get(entry.name)
        return local(value).numel() if torch.is_tensor(value) else None
    if not entry.initialized or entry.where == "none":
        return None
    if entry.where == "swap":
        return max((c.start + c.numel for c in entry.chunks), default=0)
    values = [v for k, v in source.memory()["state"][entry.index].items() if k != "step" and torch.is_tensor(v)]
    return local(values[0]).numel() if values else None


def with_parts(source: Source) -> Source:
    """``source`` with the part of each tensor its rank held filled in where its manifest does not record it
    and the rank held the whole tensor (or, for a parameter, saved no state for it); see the NOTE above."""
    manifest = source.manifest

    def whole(e):
        if e.local is not None or e.shape is None or getattr(e, "same_as", None) is not None:
            return e
        if held(source, e) not in (None, math.prod(e.shape)):
            return e
        return replace(e, local=LocalPart(tuple(e.shape), (0,) * len(e.shape)))

    params = tuple(whole(e) for e in manifest.params)
    model = manifest.model
    if model is not None:
        model = replace(model, tensors=tuple(whole(t) for t in model.tensors))
    return replace(source, manifest=replace(manifest, params=params, model=model))


# -- the plan: each tensor's pieces ----------------------------------------------------------------


@dataclass
class Resharded:
    """What a rank loads from a checkpoint saved by ranks that held other parts of the parameters.

    Attributes:
        root: the checkpoint directory.
        sources: the saved shards here, by rank.
        missing: the names of the job's shards that are not here.
        state: per parameter index, its :class:`SavedState`, or None where the checkpoint has no state
            for it.
        model: per model tensor name laid out otherwise than when saved (a DTensor's local shard), its
            pieces; the others load as saved by ``first``.
    """

    root: str
    sources: list
    missing: list
    state: dict = field(default_factory=dict)
    model: dict = field(default_factory=dict)

    @property
    def first(self) -> Source:
        """The lowest-ranked shard here: its param groups, ``extra`` and whole model tensors are loaded."""
        return self.sources[0]


def plan(root: str, sources: list, missing: list, params: list, amsgrad: dict,
         model: Optional[nn.Module]) -> Resharded:
    """Where each of this rank's parts of ``params`` (the optimizer's, by the checkpoint's indices;
    ``amsgrad``: per index, its group's) and of ``model``'s tensors is in ``sources``. Everything is
    checked here, before a load changes anything.

    Raises:
        CheckpointError: a shard does not fit the others or this optimizer, a part was not recorded or
            is no box, or elements this rank holds are in no shard here (the range named, and what to do).
    """
    if not sources:
        raise CheckpointError(f"checkpoint {root}: none of its shards ({', '.join(missing)}) is here. "
                              + _remedy(root))
    out = Resharded(root, sources, missing)
    for s in sources[1:]:
        _fits(s, out.first)
    for e in out.first.manifest.params:
        p = params[e.index]
        what = f"parameter {e.index} (shape {list(p.shape)})"
        pieces = _pieces(out, lambda m, i=e.index: m.params[i], p, what, holds_state=True)
        out.state[e.index] = _state(pieces, out, e.index, p, amsgrad[e.index], what)
    if model is not None:
        _plan_model(out, model)
    return out


def _fits(source: Source, first: Source) -> None:
    """Refuse a shard whose optimizer does not have ``first``'s parameters (count, shapes, dtypes)."""
    a, b = source.manifest, first.manifest
    if a.optimizer is None or len(a.params) != len(b.params) or len(a.param_groups) != len(b.param_groups):
        raise CheckpointError(f"checkpoint {os.path.dirname(a.root)}: shard {source.name} does not hold the "
                              f"parameters {first.name} holds ({len(a.params)} and {len(b.params)}); the "
                              "checkpoint is damaged or was edited: load another one")
    for x, y in zip(a.params, b.params):
        if (x.shape, x.dtype) != (y.shape, y.dtype):
            raise CheckpointError(f"checkpoint {os.path.dirname(a.root)}: parameter {x.index} has shape "
                                  f"{x.shape} {x.dtype} in shard {source.name}, {y.shape} {y.dtype} in {first.name}")


def _state(pieces: list, out: Resharded, index: int, p: torch.Tensor, amsgrad: bool,
           what: str) -> Optional[SavedState]:
    """The saved state of parameter ``index`` from its ``pieces`` (None where it has none): every piece's
    shard must hold its moments, all with one step."""
    entries = [(x.source, x.entry) for x in pieces] or [(out.first, out.first.manifest.params[index])]
    with_state = [e.initialized and e.where != "none" for _, e in entries]
    if not any(with_state):
        return None
    if not all(with_state):
        lacking = sorted({s.name for (s, _), ok in zip(entries, with_state) if not ok})
        raise CheckpointError(f"checkpoint {out.root}: {what} has state in some shards and none in "
                              f"{', '.join(lacking)}; the checkpoint is damaged or was edited: load another one")
    steps: dict = {}
    for s, e in dict.fromkeys(entries):
        steps.setdefault(float(saved_step(s, e)), s.name)
        keys = set(s.memory()["state"][e.index]) - {"step"} if e.where == "memory" else set(e.keys)
        check_param_state(p, index, shape=None, dtype=None, keys=keys, amsgrad=amsgrad,
                          where=f"checkpoint {s.manifest.root}", error=CheckpointError)
        if e.where == "memory":
            _held_in_memory(s, e, what)
    if len(steps) > 1:
        raise CheckpointError(f"checkpoint {out.root}: {what} has step "
                              + " and ".join(f"{v:g} in {n}" for v, n in steps.items())
                              + "; the ranks of a job step together, so these shards are not of one save")
    return SavedState.of(tuple(pieces), *entries[0])


def _held_in_memory(source: Source, entry, what: str) -> None:
    """Refuse memory.pt state of another number of elements than the part its manifest records."""
    for key, value in source.memory()["state"][entry.index].items():
        if key != "step" and torch.is_tensor(value) and local(value).numel() != entry.local.numel:
            raise CheckpointError(f"checkpoint {source.manifest.root}: its memory.pt holds {local(value).numel()} "
                                  f"elements of {key!r} of {what}, its manifest says the shard held "
                                  f"{entry.local.numel}; the checkpoint is damaged or was edited: load another one")


def _plan_model(out: Resharded, model: nn.Module) -> None:
    """The pieces of each model tensor laid out otherwise than ``first`` saved it (in model.pt, where FSDP2's
    DTensors are; offloaded weights are never DTensors, and load whole from ``first``)."""
    section = model_section(out.first.manifest)
    for name, t, _ in named_tensors(model):
        e = next((x for x in section.tensors if x.name == name), None)
        if e is None or e.same_as is not None or (e.local is not None and _holds(e.local, t)):
            continue  # a name the load's checks refuse, a tied name, or a tensor saved as held here
        what = f"model tensor {name!r} (shape {list(t.shape)})"

        def entry_of(m: Manifest, name=name, e=e, what=what):
            mine = next((x for x in model_section(m).tensors if x.name == name), None)
            mine = mine if mine is None or mine.same_as is None else model_section(m).source(name)
            if mine is not None and (mine.shape, mine.dtype, mine.where) != (e.shape, e.dtype, e.where):
                raise CheckpointError(f"checkpoint {out.root}: {what} is saved as {list(mine.shape)} {mine.dtype} "
                                      f"in {mine.where} in one shard, {list(e.shape)} {e.dtype} in {e.where} in "
                                      "another; the checkpoint is damaged or was edited: load another one")
            return mine

        if e.where != MODEL_MEMORY:
            raise CheckpointError(f"checkpoint {out.root}: {what} is an offloaded weight saved in a layout other "
                                  "than this rank's; load it into the layout it was saved in")
        out.model[name] = _pieces(out, entry_of, t, what, holds_state=False)


def _pieces(out: Resharded, entry_of: Callable[[Manifest], Any], t: torch.Tensor, what: str, *,
            holds_state: bool) -> list[Piece]:
    """The pieces of this rank's part of ``t`` in ``out.sources`` (``entry_of(manifest)``: a shard's entry of
    the tensor), covering it exactly, in order. Where several shards hold one part (replicated), the
    lowest-ranked one here with state (``holds_state``) is read."""
    box = local_box(t)
    if box is None:
        raise CheckpointError(f"{what} is a DTensor placed as {tuple(t.placements)} here, whose local shard is "
                              "not one box of the full tensor; loading a checkpoint into another layout needs "
                              "Shard and Replicate placements (save and load through torch.distributed.checkpoint)")
    chosen: dict = {}
    for s in out.sources:
        e = entry_of(s.manifest)
        if e is None:
            raise CheckpointError(f"checkpoint {out.root}: shard {s.name} has no {what}")
        saved = _saved_box(e, s, what)
        held = not holds_state or (e.initialized and e.where != "none")
        if saved not in chosen or (held and not chosen[saved][2]):
            chosen[saved] = (s, e, held)
    hits = [(saved, s, e, saved.intersect(box)) for saved, (s, e, _) in chosen.items()]
    hits = [h for h in hits if h[3] is not None]
    for (a, sa, _, _), (b, sb, _, _) in itertools.combinations(hits, 2):
        if a.intersect(b) is not None:
            raise CheckpointError(f"checkpoint {out.root}: shards {sa.name} and {sb.name} hold overlapping, "
                                  f"different parts of {what}; the checkpoint is damaged or was edited")
    if sum(part.numel for *_, part in hits) != box.numel:
        raise CheckpointError(_uncovered(out, what, t.shape, box, [part for *_, part in hits]))
    pieces = [Piece(s, e, a, b, n) for saved, s, e, part in hits for a, b, n in part.runs(saved, box)]
    return sorted(pieces, key=lambda x: x.new)


def _saved_box(e, s: Source, what: str) -> Box:
    """The part of the tensor shard ``s`` saved (entry ``e``)."""
    if e.local is None:
        raise CheckpointError(f"checkpoint {s.manifest.root} (nvme-offload {s.manifest.library_version}) does not "
                              f"record which part of {what} each rank held, which loading it into another layout "
                              "needs: load it on the ranks and layout that saved it, save it again with this "
                              "version, and load that")
    if e.local.box is None:
        raise CheckpointError(f"checkpoint {s.manifest.root}: {what} was a DTensor whose local shard was not one "
                              "box of the full tensor (placements other than Shard and Replicate); it loads only "
                              "into the layout that saved it")
    return e.local.box


def _uncovered(out: Resharded, what: str, shape, box: Box, parts: list) -> str:
    """The message for elements of ``box`` that no shard here holds: the first range missing, and what to do."""
    covered = sorted(r for part in parts for r in part.flat_ranges(shape))
    missing, total = None, 0
    for a, b in box.flat_ranges(shape):
        for c, d in covered:
            if d <= a or c >= b:
                continue
            if c > a:
                missing = missing or (a, c)
                total += c - a
            a = max(a, d)
        if a < b:
            missing = missing or (a, b)
            total += b - a
    held = f"elements [{missing[0]}, {missing[1]}) of {what}, in the flat order of the full tensor"
    if total > missing[1] - missing[0]:
        held += f" ({total} elements in all)"
    if out.missing:
        return (f"checkpoint {out.root}: this rank holds {held}, and no shard here has them; the shard(s) "
                f"{', '.join(out.missing)} of the job are not here. {_remedy(out.root)}")
    return (f"checkpoint {out.root}: this rank holds {held}, and no shard of the checkpoint has them; it is "
            "incomplete (damaged or edited), so nothing is loaded: load another checkpoint")


def _remedy(root: str) -> str:
    return ("Loading on another number of ranks (or another layout) reads every shard that holds a rank's "
            f"elements: put the checkpoint where every rank reads all of it (a shared file system), or copy the "
            f"shards each node lacks into {root} there, then load again")


# -- the model's tensors, as this rank now holds them ------------------------------------------------


def model_tensors(resharded: Resharded, model: nn.Module) -> dict:
    """model.pt's tensors of ``first`` with those laid out otherwise here replaced by this rank's parts,
    gathered from the shards (a DTensor as one laid out as this rank's parameter)."""
    memory = dict(resharded.first.model())
    targets = {name: t for name, t, _ in named_tensors(model)}
    for name, pieces in resharded.model.items():
        t = targets[name]
        part = torch.empty(local(t).shape, dtype=dtype_of(pieces[0].entry.dtype) if pieces else local(t).dtype)
        flat = part.view(-1)
        for x in pieces:
            saved = local(x.source.model()[x.entry.name]).detach().reshape(-1)
            if saved.numel() != x.entry.local.numel:
                raise CheckpointError(f"checkpoint {x.source.manifest.root}: its model.pt holds {saved.numel()} "
                                      f"elements of {name!r}, its manifest says the shard held {x.entry.local.numel}")
            flat[x.new:x.new + x.n].copy_(saved[x.old:x.old + x.n])
        memory[name] = like(part, t) if is_dtensor(t) else part
    return memory
