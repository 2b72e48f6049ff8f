"""The optimizer's work inside backward: state read as backward reaches it, updated once its grads are final."""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from typing import Callable, Iterator, Optional

import torch

from .. import copies
from ..clipping import grad_norm
from ..distributed import check_grad_layout, local, rank_info
from ..errors import StateError
from ..params import ParamAccess, grad_reads, store_of
from .offloaded import OffloadedStep

__all__ = ["BackwardOverlap", "Learning", "NoOverlap"]

log = logging.getLogger("offload")


# NOTE: with overlap_backward, a post-accumulate-grad hook on every parameter tells a step in progress
# that the parameter's gradient is final. The step runs on a worker thread, started by the first hook
# of a backward: it is the optimizer's ordinary step (the one pipeline, units read ahead in the order
# the previous backward finished them), except that before updating a unit it waits until every
# parameter with a chunk in it has its final gradient (or until step() says there will be no more).
# So reads and writes of state overlap backward's compute, and an iteration costs about
# max(compute, I/O) instead of their sum. With clipping, updates also wait for the global norm, which is
# known at step(): then only the reads overlap backward. The math is unchanged, so results are bit for
# bit those of the same optimizer without overlap. Under FSDP2 the hooks are its hand-over: FSDP2 calls a
# sharded parameter's post-accumulate-grad hooks once its reduce-scatter has put the sharded gradient in
# place (on its reduce-scatter stream, which produced() then marks), so each rank updates its shard as
# its gradient arrives; the norms taken then are DTensors' local ones, made whole at step().
class BackwardOverlap:
    """Hooks and the step in progress of an optimizer built with ``overlap_backward=True``.

    Args:
        step: the optimizer's offloaded step, which the worker runs (``step.run(slots, gate, order)``, calling
            ``gate(unit)`` before each update); a clip factor it needs is set before :meth:`finish` opens the
            gates. When the step in progress fails, its store is marked failed (on the worker): the state may
            then be half updated, and the optimizer refuses further steps until it is restored. Its
            ``access`` is the optimizer's :class:`ParamAccess`, through which gradients are watched and
            parameters whose weights live on NVMe are taken as backward finishes them.
        clip: whether updates must wait for the global gradient norm (``max_grad_norm``).
        armed: whether updates run inside backward from the first one (``overlap_backward=True``); else
            (``"auto"``) they do once :class:`Learning` has seen that they may. An update that ran inside
            backward used the groups' hyperparameters as they were then, so step() refuses a change made in
            between.
    """

    def __init__(self, step: OffloadedStep, *, clip: bool, armed: bool = True):
        self.armed = armed
        self.armed_at: Optional[int] = None  # with "auto", the steps seen when it armed
        self.step = step
        self.learning = None if armed else Learning(step.hyperparameters)
        self._params: list = []  # every parameter watched, to watch again once armed
        self.clip = clip
        self.access = step.access
        self._handles: dict[int, object] = {}
        # The hooks on the parameters reach this object only weakly, so a model outliving its optimizer does
        # not keep the optimizer (its pool, its swap files) alive; once it is gone the hooks go too.
        self._watcher = _Watcher(weakref.ref(self))
        weakref.finalize(self, _remove_hooks, self._handles)
        self._skip = 0
        self._run: Optional[_Run] = None
        self._order: list = []  # units, in the order the last backward finished them
        self._lock = threading.Lock()

    def hook(self, params) -> None:
        """Watch ``params``' gradients (those that require grad; each once)."""
        params = [p for p in params if p.requires_grad and id(p) not in self._handles]
        self._params += params
        for p, handle in zip(params, self.access.watch(params, self._watcher, strict=self.armed)):
            self._handles[id(p)] = handle

    @property
    def described(self) -> str:
        """How the setting reads in a message: the user may have asked for "auto" and not know it armed."""
        if self.armed_at is None:
            return "overlap_backward=True"
        return f'overlap_backward="auto" (updating inside backward since step {self.armed_at + 1})'

    def note_step(self, *, clean: bool) -> None:
        """A step ended; ``clean``: nothing in it kept its updates from running inside backward (no closure,
        no GradScaler, no max_grad_norm, weights on NVMe). Unarmed, this is what :class:`Learning` weighs."""
        if self.learning is None or self.armed:
            return
        if self.learning.step(clean=clean):
            self.armed = True
            self.armed_at = self.learning.steps
            self.learning = None
            log.info('overlap_backward="auto": %d iterations showed updating inside backward exact; it does so from '
                     "now on (overlap_backward=False keeps every update in step())", self.armed_at)
            # Watched again, now through the stores' hand-off: weights offloaded since are taken too.
            _remove_hooks(self._handles)
            params, self._params = self._params, []
            self.hook(params)

    @contextlib.contextmanager
    def no_step(self) -> Iterator[None]:
        """Backward passes inside the block only accumulate gradients (shaped like DDP's ``no_sync``)."""
        self._skip += 1
        try:
            yield
        finally:
            self._skip -= 1

    @property
    def running(self) -> bool:
        """Whether a step that a backward started is running (until step() finishes it)."""
        return self._run is not None

    def norms(self) -> dict:
        """``{id(param): gradient norm}`` taken as each gradient became final in the backward so far."""
        return dict(self._run.norms) if self._run is not None else {}

    def finish(self) -> set:
        """No more gradients this iteration: let the step in progress update what is left and end.

        Returns:
            The slots it updated.

        Raises:
            Whatever the step raised (an ``OSError`` naming the file, a ``StateError``).
        """
        run, self._run = self._run, None
        if run is None:
            return set()
        if run.begun and run.hyper != self.step.hyperparameters():  # updates that begin from here on use the new ones
            err = StateError(
                "the optimizer's hyperparameters (a learning rate, say) changed between backward and step(), but "
                f"with {self.described} the update ran during backward with those it had then. Change them before "
                "the forward pass (an LR scheduler's step() after the optimizer's, as torch expects), or build the "
                "optimizer with overlap_backward=False; restore the state (load_checkpoint) before going on.")
            run.abort(err)
            raise err
        if run.grads_changed():
            err = StateError(
                "gradients changed between backward and step() (clip_grad_norm_, a GradScaler's "
                f"unscale_, or another in-place change), but with {self.described} the update uses the "
                "gradients as backward left them and has already run for most of them. Clip with the "
                "optimizer's max_grad_norm=, use a GradScaler only without overlap_backward, or leave the "
                f"gradients as backward makes them; restore the state (load_checkpoint) before going on.{_in_a_job()}")
            run.abort(err)
            raise err
        updated = run.finish()
        self._order = run.finished_order
        return updated

    def abandon(self, err: BaseException) -> None:
        """Stop a step in progress after an error elsewhere (it finishes what it holds, then ends)."""
        run, self._run = self._run, None
        if run is not None:
            run.abort(err)

    def cancel(self, what: str) -> None:
        """A backward started a step and ``what`` came instead of step() (the backward was interrupted, by a
        KeyboardInterrupt or an error, or step() was skipped): end the step in progress. If it had not updated
        any unit yet, the state is as before that backward, as torch's would be, and stays usable; else it is
        failed (part of it holds that backward's update) until restored."""
        run, self._run = self._run, None
        if run is None:
            return
        run.cancelled = True
        run.abort(StateError(
            f"a backward was interrupted (or failed, or was not followed by step()) with {self.described}, and "
            f"{what} ended the update it had started: that update had already changed part of the optimizer state "
            "with the backward's gradients, so the state is neither that before nor that after a step. Restore it "
            "with load_checkpoint() or load_state_dict() before stepping again; a loop that must be able to skip "
            "step() after a backward needs overlap_backward=False."))

    def remove(self) -> None:
        """Take the hooks off the parameters."""
        _remove_hooks(self._handles)

    # -- what the optimizer refuses, or ends, while a step that backward started runs ------------

    def refuse_while_running(self, what: str) -> None:
        """Between a backward and step() the step runs on the pool: ``what``, which reads or changes the
        state, would race it.

        Raises:
            StateError: such a step is running.
        """
        if self.running:
            raise StateError(f"{what} was called between backward and step() with {self.described}, while "
                             "the update that backward started is still running: call step() first.")

    def end_for_load(self, what: str) -> None:
        """``what`` replaces the state: a step left running by a backward (or failed in it) ends first."""
        if self.running:
            self.abandon(StateError(f"{what} replaced the state during an overlapped step"))

    def refuse_unsupported(self, *, closure: Optional[Callable], scaler: bool) -> None:
        """What step() cannot honour with overlap_backward, refused when first seen.

        Args:
            closure: step()'s closure.
            scaler: whether a GradScaler handed step() its scale or found infs.

        Raises:
            ValueError: a closure.
            StateError: a GradScaler (see :meth:`refuse_scaler`).
        """
        if not self.armed:
            return  # "auto" still watching: the step is an ordinary one (and not a clean one to learn from)
        if closure is not None:
            raise ValueError(f"step(closure) cannot be used with {self.described}: the update runs during "
                             "backward; call loss.backward() yourself, then step()")
        if scaler:
            self.refuse_scaler()

    def refuse_scaler(self) -> None:
        """A GradScaler: the updates backward ran used the scaled gradients, so the step in progress is
        abandoned and the state marked failed.

        Raises:
            StateError: always.
        """
        err = StateError(
            f"a GradScaler cannot be used with {self.described}: the update ran during backward on the "
            "scaled gradients, before the scaler could unscale them or skip an inf step. Restore the state "
            "(load_checkpoint), then train without the GradScaler (bf16 autocast needs none) or without "
            "overlap_backward.")
        self.abandon(err)
        self.step.store.mark_failed(err)
        raise err

    # -- what the parameter layer calls (ParamAccess.watch) --------------------------------------

    def take(self, p: torch.Tensor) -> bool:
        """Whether the step in progress takes ``p`` (weights on NVMe) as backward leaves it: resident, its
        gradient in memory, to be updated and written back once (not when clipping, which waits for every
        gradient, nor inside no_step(), nor before it is armed)."""
        if self._skip or self.clip or not self.armed:
            return False
        run = self._current_run()
        with run.lock:  # never adopted after the worker gave back what it held: that hold would stay
            return not run.ended and run.error is None and run.wants(p) and self.access.adopt(p)

    def refused(self, p: torch.Tensor) -> None:
        """Something tried to read or change ``p``'s offloaded gradient with torch (a GradScaler's unscale_,
        torch's clip_grad_norm_) while the step backward started runs: that update used the gradient as
        backward left it, so the state is failed until restored (the caller also gets the placeholder's
        RuntimeError)."""
        if not self.running:
            return
        err = StateError(
            "an offloaded gradient was read with torch (a GradScaler's unscale_, torch's clip_grad_norm_ or other "
            f"math) between backward and step() with {self.described}, but the update ran during backward on "
            "the gradients as backward left them. Restore the state (load_checkpoint), then clip with the "
            "optimizer's max_grad_norm=, and use a GradScaler only without overlap_backward.")
        self.abandon(err)
        self.step.store.mark_failed(err)

    def final(self, p: torch.Tensor) -> None:
        """``p``'s gradient is final for this backward."""
        if self._skip:
            return
        if not self.armed:
            self.learning.final(p)
            return
        self._current_run().ready(p)

    def _current_run(self) -> _Run:
        with self._lock:
            if self._run is None:
                slots = self.step.slots_now()
                self._run = _Run(self, slots, self._predict(self.step.store.units_of(slots)))
            return self._run

    def _predict(self, units: list) -> list:
        """The order the coming backward will finish ``units`` in: as the last one did; units it did not see
        go last, last layer first (backward runs from the output back)."""
        seen = {id(u): i for i, u in enumerate(self._order)}
        known = sorted((u for u in units if id(u) in seen), key=lambda u: seen[id(u)])
        return known + [u for u in reversed(units) if id(u) not in seen]


class NoOverlap:
    """What an optimizer without overlap_backward has in place of a :class:`BackwardOverlap`: the same
    calls, none of which does anything (updates happen in step() only)."""

    running = False

    def hook(self, params) -> None:
        """Nothing to watch: updates run in step() only."""

    def no_step(self) -> contextlib.AbstractContextManager:
        """Backward never steps: an empty block."""
        return contextlib.nullcontext()

    def norms(self) -> dict:
        """No gradient norms are taken during backward."""
        return {}

    def finish(self) -> set:
        """No step is in progress: nothing was updated."""
        return set()

    def abandon(self, err: BaseException) -> None:
        """No step is in progress: nothing to stop."""

    def cancel(self, what: str) -> None:
        """No step is in progress: nothing to end."""

    def remove(self) -> None:
        """No hooks to take off."""

    def refuse_while_running(self, what: str) -> None:
        """Never running: nothing to refuse."""

    def end_for_load(self, what: str) -> None:
        """Never running: nothing to end."""

    def refuse_unsupported(self, *, closure: Optional[Callable], scaler: bool) -> None:
        """step() honours closures and GradScalers without overlap: nothing to refuse."""

    def refuse_scaler(self) -> None:
        """Never running: nothing to refuse."""

    def note_step(self, *, clean: bool) -> None:
        """Nothing to learn: overlap is off."""


# NOTE: an update inside backward is exact only when the backward that makes a gradient final is the last
# before step() and nothing reads or changes the gradients or the hyperparameters in between. With
# overlap_backward="auto" the optimizer does not assume it: it watches two iterations in a row (each gradient
# final once per step; the same sampled elements at step() as when final; the same hyperparameters; no offloaded
# gradient read, by load_grad or clip_grad_norm_, since an update inside backward consumes them; one process,
# not a rank of a job, whose gradients DDP or ZeRO reduce after backward made them final; and from the
# optimizer: no closure, no GradScaler, no max_grad_norm, weights on NVMe, where updating inside backward saves
# the gradients' round trip). Then it arms, and from there on it is overlap_backward=True: a later departure (a
# second backward: accumulation without no_step()) is refused with what to do. A loop that accumulates, reads
# or clips gradients never arms, and trains as without it.
class Learning:
    """What an optimizer with ``overlap_backward="auto"`` has seen of the training loop, step by step."""

    STEPS = 2  # clean steps in a row before updates run inside backward

    def __init__(self, hyper: Callable[[], list] = list):
        self.hyper = hyper
        self.steps = 0
        self.clean_steps = 0
        self._at_backward = None  # the hyperparameters when this step's first gradient became final
        self._fired: set = set()
        self._twice = False
        self._seen: list = []  # (param, grad, sample) as each gradient became final
        self._reads = grad_reads()

    def final(self, p: torch.Tensor) -> None:
        """``p``'s gradient became final: noted, with the hyperparameters at a step's first one, a second
        backward before step() (accumulation), and a sample of an ordinary gradient to compare at step()."""
        if id(p) in self._fired:
            self._twice = True  # a second backward before step(): accumulation
        if not self._fired:
            self._at_backward = self.hyper()
        self._fired.add(id(p))
        store = store_of(p)
        if p.grad is not None and p.grad.layout == torch.strided and not (store is not None and store.holds_grad(p)):
            self._seen.append((p, p.grad, _sample(p.grad)))  # an ordinary grad tensor (offload_grads=False too)

    def step(self, *, clean: bool) -> bool:
        """A step ended; returns whether updates may run inside backward from the next backward."""
        self.steps += 1
        reads, self._reads = self._reads, grad_reads()
        unchanged = all(p.grad is g and torch.equal(_sample(g).view(torch.int32), s.view(torch.int32))
                        for p, g, s in self._seen)
        ok = (clean and bool(self._fired) and not self._twice and unchanged and reads == self._reads
              and self._at_backward == self.hyper() and not rank_info().distributed)
        self.clean_steps = self.clean_steps + 1 if ok else 0
        self._fired, self._twice, self._seen, self._at_backward = set(), False, [], None
        return self.clean_steps >= self.STEPS


class _Run:
    """One backward's step in progress, on its worker thread."""

    def __init__(self, owner: BackwardOverlap, slots: list, order: list):
        self.owner = owner
        self.order = order
        self.hyper = owner.step.hyperparameters()  # what the updates run with
        self.fired: set = set()
        # Per parameter whose grad the update reads as backward left it: where the stream that produced it
        # was when it became final. The worker runs on its own streams, so it waits for that first.
        self.producers: dict = {}
        self.seen_grads: list = []  # (param, its final grad, a few of its elements): changed later is refused
        self.norms: dict = {}
        # Per unit, how many of its chunks still wait for their parameter's final gradient.
        self.waiting: dict = {id(u): sum(1 for c in u.chunks if c.slot.param.requires_grad) for u in order}
        # Per parameter, the units holding its chunks, each once: with int8 state a parameter split at a unit's
        # edge may have several chunks in one unit, and ready() counts them all down at that unit's one entry.
        self.chunks_of: dict = {}
        for u in order:
            for c in u.chunks:
                units = self.chunks_of.setdefault(id(c.slot.param), [])
                if not units or units[-1] is not u:
                    units.append(u)
        self.ready_units: dict = {id(u): threading.Event() for u in order}
        self.finished_order: list = []
        self.all_final = threading.Event()
        self.error: Optional[BaseException] = None
        self.updated: set = set()
        self.params = copies.on_each_device(s.param for s in slots)  # where the streams below are taken
        # Where the worker's streams were once it had issued its last work (set however it ended), and where
        # the stream of the thread calling finish() was when it opened the remaining gates (what it computed
        # for them, a clip factor, and grads an earlier backward made).
        self.done = copies.DONE
        self.opened = copies.DONE
        self.lock = threading.Lock()
        self.ended = False  # the worker has given back the holds it took (under ``lock``)
        self.begun = 0  # updates the worker has begun (a unit's state changes once one has)
        self.cancelled = False  # ended by cancel(): state is failed only if an update had begun
        self.thread = threading.Thread(target=self._work, args=(slots,), name="offload-overlap", daemon=True)
        self.thread.start()

    def wants(self, p: torch.Tensor) -> bool:
        """Whether ``p``'s gradient is new to this step (a small parameter, updated in step(), is held until then)."""
        return id(p) not in self.fired

    def ready(self, p: torch.Tensor) -> None:
        """``p``'s gradient is final (its post-accumulate-grad hook fired)."""
        if self.error is not None:
            raise self.error
        if id(p) in self.fired:
            err = StateError(
                f"a backward ran again before step() with {self.owner.described} (gradient accumulation, or a "
                "backward that failed or was not followed by step()): the optimizer updates state as soon as a "
                "backward makes the grads final, so the earlier backward's update has already run. Put the "
                "micro-batches that must not step inside `with optimizer.no_step():` (as with DDP's no_sync), "
                "and restore the state (load_checkpoint) before going on; or build the optimizer with "
                "overlap_backward=False, which keeps every update in step().")
            self.abort(err)
            raise err
        try:
            check_grad_layout(p)  # a DTensor's: its local shard is what the update reads
        except RuntimeError as err:
            self.abort(err)
            raise
        self.fired.add(id(p))
        store = store_of(p)
        in_store = store is not None and store.holds_grad(p)  # p.grad is then a placeholder
        if id(p) in self.chunks_of and p.grad is not None and not in_store:
            # Where the worker's update of p's unit must wait (gate): this thread, which reads the grad below,
            # runs on the stream that produced it already.
            self.producers[id(p)] = copies.produced([p.grad])
        watched = id(p) in self.chunks_of and p.grad is not None and (store is None or not store.offload_grads)
        if watched:
            # An ordinary grad tensor (offload_grads=False too) that a GradScaler's unscale_ or clip_grad_norm_
            # could change in place: watched. (A grad the store holds, or hands to the update, is not the
            # user's to change: its placeholder refuses.)
            g = p.grad
            self.seen_grads.append((p, g, _sample(g)))
        if self.owner.clip and p.grad is not None:
            self.norms[id(p)] = grad_norm(ParamAccess.grad(p) if in_store else p.grad)
        with self.lock:  # hooks of parameters on two GPUs run on two autograd threads
            for u in self.chunks_of.get(id(p), ()):
                for c in u.chunks:
                    if c.slot.param is p:
                        self.waiting[id(u)] -= 1
                if self.waiting[id(u)] == 0:
                    self.finished_order.append(u)
                    if not self.owner.clip:
                        self.ready_units[id(u)].set()

    def grads_changed(self) -> bool:
        """Whether a final gradient was replaced or changed in place since its hook fired."""
        if any(p.grad is not g for p, g, _ in self.seen_grads):
            return True
        by_device: dict = {}
        for _, g, before in self.seen_grads:
            by_device.setdefault(g.device, ([], []))
            by_device[g.device][0].append(before)
            by_device[g.device][1].append(_sample(g))
        for before, now in by_device.values():
            # Bit for bit: a NaN (a diverged backward) equals itself here, as torch.equal would not say.
            if not torch.equal(torch.cat(before).view(torch.int32), torch.cat(now).view(torch.int32)):
                return True
        return False

    def gate(self, unit) -> None:
        """Before updating ``unit`` (on the worker): wait until its grads are final (and, when clipping,
        the clip factor known)."""
        # finish() and abort() set every unit's event: no polling while backward runs.
        (self.all_final if self.owner.clip else self.ready_units[id(unit)]).wait()
        if self.error is not None:
            raise self.error
        if self.owner.clip or self.waiting[id(unit)] > 0:
            # Opened by finish(): after what its caller issued before (the clip factor, and the grads of
            # parameters whose hook did not fire in this backward: made by an earlier one, under no_step()).
            copies.after(self.opened)
        for c in unit.chunks:
            produced = self.producers.get(id(c.slot.param))
            if produced is not None:
                copies.after(produced)  # the grad this update reads was produced on another thread's stream
        self.begun += 1

    def finish(self) -> set:
        try:
            self.opened = copies.produced(self.params)
        finally:  # the gates open whatever happened: the worker must not wait forever
            self.all_final.set()
            for event in self.ready_units.values():
                event.set()
        self._join()
        if self.error is not None:
            raise self.error
        seen = {id(u) for u in self.finished_order}
        self.finished_order += [u for u in self.order if id(u) not in seen]
        return self.updated

    def abort(self, err: BaseException) -> None:
        self.error = err
        self.all_final.set()
        for event in self.ready_units.values():
            event.set()
        if threading.current_thread() is not self.thread:
            self._join()

    def _join(self) -> None:
        """Wait for the worker; work this thread issues from here on runs after the worker's (the weights
        its updates wrote, the grads they read), whether it ended well or not."""
        self.thread.join()
        copies.after(self.done)

    def _work(self, slots: list) -> None:
        try:
            # On streams of its own: on the default stream the updates would queue behind all of backward
            # issued so far (and hold it up); gate() orders each update after the grads it reads instead.
            with copies.own_streams(self.params):
                try:
                    self.updated = self.owner.step.run(slots, self.gate, self.order)
                except BaseException:
                    with contextlib.suppress(Exception):  # the step's error is the one to report
                        self.done = copies.produced(self.params)
                    raise
                self.done = copies.produced(self.params)
        except BaseException as err:  # reported by the next hook and by step()
            self.error = self.error or err
            if self.begun or not self.cancelled:
                self.owner.step.store.mark_failed(self.error)
        finally:
            with self.lock:
                self.ended = True
            self.owner.access.release_handed()


class _Watcher:
    """What the parameters' hooks call: forwarded to the overlap while it lives, nothing after."""

    def __init__(self, owner: weakref.ref):
        self._owner = owner

    def take(self, p: torch.Tensor) -> bool:
        owner = self._owner()
        return owner is not None and owner.take(p)

    def refused(self, p: torch.Tensor) -> None:
        owner = self._owner()
        if owner is not None:
            owner.refused(p)

    def final(self, p: torch.Tensor) -> None:
        owner = self._owner()
        if owner is not None:
            owner.final(p)


def _remove_hooks(handles: dict) -> None:
    for h in handles.values():
        h.remove()
    handles.clear()


# NOTE: a few elements of each final gradient are kept and compared at step(): any scaling or clipping of a
# gradient changes them (unless they are all zero), while a multiplication by 1 (clip_grad_norm_ with an
# infinite max_norm, to log the norm) leaves them, and the result, as they were. Tensor versions cannot tell
# these apart, and some in-place kernels (a GradScaler's foreach unscale) do not bump them. One comparison
# per device, whatever the number of parameters.
def _sample(g: torch.Tensor) -> torch.Tensor:
    """Up to eight elements spread over ``g``, copied."""
    if g.layout != torch.strided:
        return torch.empty(0)  # a sparse gradient: refused by step() with its own error
    flat = local(g).detach().reshape(-1)  # a DTensor's local shard: no communication
    return flat[:: max(1, flat.numel() // 8)][:8].float().clone()


def _in_a_job() -> str:
    """What to add to the message about grads changed after backward in a job: DDP is the likely cause."""
    if not rank_info().distributed:
        return ""
    return (" In a job of several ranks, DistributedDataParallel all-reduces the gradients after backward made them "
            "final, so it cannot be used with overlap_backward: shard the model with FSDP2's fully_shard instead "
            "(its reduce-scatter comes before the update), or keep overlap_backward=False.")
