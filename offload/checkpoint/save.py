"""Saving an offloaded optimizer and a model: blocking or in the background, streamed or cloned, and the copy
of a committed checkpoint to a second level."""

from __future__ import annotations

import contextlib
import copy
import datetime
import errno as _errno
import json
import os
import secrets
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import xxhash
from torch import nn

from ..buffers import BufferPool
from ..config import AioConfig, config_to_dict
from ..distributed import rank_info
from ..errors import CheckpointError, ChecksumError
from ..pipeline import BufferRing
from ..units import ALIGNMENT, format_size, round_up
from . import stream
from .commit import (
    SaveHandle,
    _gather,
    _JobCommit,
    _settle,
    _Shard,
    _Staged,
    _track,
    _write_atomically,
    job_world,
    reading,
)
from .format import (
    DATA,
    JOB_FORMAT,
    JOB_VERSION,
    MANIFEST,
    _chunk_table,
    _cpu_state,
    _dtype_name,
    _io_error,
    _shard_name,
    _torch_bytes,
    _torch_groups,
    _write_memory_and_manifest,
)
from .model import _save_model
from .ownership import _remove_ours, _target_kind
from .stream import _clone_range, _progress, _stream
from .verify import _verify_files, read_manifest

__all__ = ["mirror_checkpoint", "save_checkpoint", "wait_for_saves"]

SNAPSHOTS = ("auto", "stream", "reflink")


def save_checkpoint(optimizer, directory: str | os.PathLike, *, model: nn.Module | None = None,
                    extra: Any = None, blocking: bool = True, mirror_to: str | os.PathLike | None = None,
                    snapshot: str = "auto", progress: Optional[bool] = None, alone: bool = False) -> str | SaveHandle:
    """Save an offloaded optimizer's whole state to ``directory``, atomically, without materialising it.

    Offloaded state goes from the swap space to ``state.bin``: where the checkpoint directory is on
    the same XFS (reflink) or btrfs file system as the swap files, its extents are cloned (metadata
    only, whatever the size); elsewhere it streams through host buffers with the native engine.
    Small parameters' state and the steps go to ``memory.pt``. With ``model``, its weights go into
    the same directory: offloaded parameters stream from the parameter store's swap space through
    its pool to ``params.bin`` (nothing is fetched), the rest of the model (other parameters,
    persistent buffers) to ``model.pt``. ``extra`` (e.g. ``{"step": step}``) goes to ``extra.pt``.
    An existing checkpoint at ``directory`` is replaced only once the new one is complete on disk.

    With ``blocking=False`` the call returns a :class:`SaveHandle` as soon as the state at the call
    is pinned down, and training goes on: the checkpoint holds exactly the state at the call. A step
    that would change a unit not yet copied first copies that unit (from the buffer the step has it
    in) and writes it to the checkpoint; small parameters' state, the steps and ``extra`` are copied
    in memory at the call, and the model's weights (``model``) are written before the call returns.
    The checkpoint is committed only once everything is in; a second save (or a load) waits for it.
    Its errors come from ``handle.wait()`` and, if nobody looked, from the next save.

    Args:
        optimizer: an :class:`offload.OffloadedAdam` or ``OffloadedAdamW``.
        directory: the checkpoint directory; its parent is created if missing.
        model: the model whose weights to save too (offloaded with ``offload_parameters`` or not).
        extra: anything ``torch.save`` can write and ``torch.load(weights_only=True)`` can read back.
        blocking: False: return at once with a :class:`SaveHandle` (see above).
        mirror_to: a directory on a second level (another drive, a network mount): once committed,
            the checkpoint is copied to ``mirror_to/<name of directory>`` in the background,
            atomically, and verified by checksum after the copy (see :func:`mirror_checkpoint`).
        snapshot: ``"auto"`` clones extents where the file system can and streams elsewhere;
            ``"stream"`` always streams; ``"reflink"`` raises ``CheckpointError`` where it cannot clone.
        progress: show a progress bar on stderr for a long save; None: for a blocking save where
            stderr is a terminal.
        alone: where torch.distributed runs a job of several ranks, the save is the job's: every
            rank calls it and writes its shard, and it is committed for the whole job (see
            ``docs/checkpoint.md``, "Saves of a job"). ``alone=True`` saves this process's state by
            itself, an ordinary checkpoint, as outside a job (rank 0 saving DDP's replicated state
            while the other ranks do not call it).

    Returns:
        The checkpoint directory (absolute); with ``blocking=False``, a :class:`SaveHandle`.

    Raises:
        StateError: the optimizer's last step failed part-way, so its state must not be saved (or
            loading weights into ``model`` failed part-way).
        OSError: writing failed (the message names file, offset and errno); the previous checkpoint
            at ``directory``, if any, is left as it was and nothing half written remains.
        CheckpointError: the previous asynchronous save failed and nobody looked at its error (it
            is chained); this save did not start.
    """
    return _save(optimizer, directory, model=model, extra=extra, blocking=blocking, mirror_to=mirror_to,
                 snapshot=snapshot, progress=progress, alone=alone)


def wait_for_saves(optimizer, timeout: float | None = None) -> None:
    """Wait for ``optimizer``'s save in flight (and its copy to ``mirror_to``), if any.

    Call it before closing the optimizer or exiting when saves were started with ``blocking=False``.

    Raises:
        CheckpointError: that save failed and its error was not looked at yet (chained).
        TimeoutError: ``timeout`` seconds passed first.
    """
    _settle(optimizer.state_store, report=True, timeout=timeout)


@dataclass
class _Plan:
    """What a save takes from the optimizer at the call (copies: training may go on)."""

    units: list
    entries: list
    groups: list
    memory_state: dict
    steps: dict


def _save(optimizer, directory, *, model=None, extra=None, blocking=True, mirror_to=None, snapshot="auto",
          progress=None, then: Optional[Callable[[str], None]] = None,
          then_mirror: Optional[Callable[[str], None]] = None, shard: Optional[_Staged] = None,
          alone: bool = False):
    """:func:`save_checkpoint`, with ``then(directory)`` run once committed (before the copy to the mirror)
    and ``then_mirror(copy)`` once the copy is done (``Retention`` verifies and prunes with them).

    Where torch.distributed runs a job of several ranks, the save is the job's (:func:`_save_job`),
    which writes this rank's part through this function with ``shard``, a ``commit._Shard`` to fill
    and finish in place of a directory of its own."""
    if shard is None and not alone and job_world() is not None:
        return _save_job(optimizer, directory, model=model, extra=extra, blocking=blocking, mirror_to=mirror_to,
                         snapshot=snapshot, progress=progress, then=then)
    if snapshot not in SNAPSHOTS:
        raise ValueError(f"snapshot must be one of {', '.join(SNAPSHOTS)}, got {snapshot!r}")
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    mirror = _mirror_path(directory, mirror_to)
    store = optimizer.state_store
    _settle(store, report=True)  # one save at a time per optimizer; a failure nobody saw is raised here
    store.check_usable("save a checkpoint")
    store.drain()  # the last step's writes, and their errors, before anything is copied
    # Every write has landed without error: forget the futures, so that a read of a unit from the
    # save's thread and one from a step never race on them (a step writes a unit only after the
    # change guard has copied it).
    store.drain(quiet=True)
    show = progress if progress is not None else (None if blocking else False)  # None: where stderr is a tty
    staged = _Staged(directory) if shard is None else shard
    started = threading.Event()  # set once a worker owns the save (and cleans up after it)
    try:
        plan = _plan(optimizer)
        memory = plan.memory_state
        if not blocking:  # copies of what training may change, taken now
            memory = _torch_bytes({"param_groups": plan.groups, "state": plan.memory_state, "steps": plan.steps})
            extra = _torch_bytes(extra) if extra is not None else None
        model_part = None  # the model's files: written at the call, after state.bin's for a blocking save
        state = _StateCopy(store, staged, optimizer.config.aio, plan.units)
        try:
            if snapshot != "stream":
                state.clone()
                if snapshot == "reflink" and state.cloned < state.on_disk:
                    raise CheckpointError(
                        f"cannot clone the state into {staged.directory}: {state.why_not or 'units live in memory'}"
                        "; use snapshot=\"auto\" (clones where it can, streams the rest)")
            state.reserve()

            def finish(data: dict) -> dict:
                manifest = _write_memory_and_manifest(
                    staged, kind=type(optimizer).__name__, groups=plan.groups, entries=plan.entries,
                    memory_state=memory, steps=plan.steps, extra=extra,
                    config=config_to_dict(optimizer.config, only=None), unit_bytes=store.layout.unit_bytes,
                    threshold=store.threshold, data=data)
                manifest["snapshot"] = state.summary(asynchronous=not blocking)
                if model_part is not None:
                    manifest["model"], files = model_part
                    manifest["files"].update(files)
                return manifest

            if blocking:
                with _progress(state.total, "save", show) as bar:
                    data = state.run(store.buffers, bar)
                model_part = _save_model(model, staged) if model is not None else None
                _commit(staged, finish(data))
            else:
                model_part = _save_model(model, staged) if model is not None else None
                handle, refused = SaveHandle(staged.directory), []
                state.guard_on()
                threading.Thread(target=_work, name="offload-checkpoint-save", args=(
                    handle, started, refused, staged, state, finish, show, then, mirror, then_mirror)).start()
                started.wait()
                if refused:
                    raise refused[0]  # the worker has cleaned up
                _track(store, handle)
                return handle
        finally:
            if not started.is_set():
                state.close()  # else the worker's
    except BaseException:
        if not started.is_set():
            staged.abort()
            staged.close()
        raise
    staged.close()
    if then is not None:
        then(staged.directory)
    if mirror is not None:
        _mirror_in_background(store, staged.directory, mirror, then_mirror)
    return staged.directory


def _work(handle: SaveHandle, started: threading.Event, refused: list, staged: _Staged, state: _StateCopy,
          finish, show, then, mirror, then_mirror) -> None:
    """The thread of an asynchronous save: the units not copied yet, memory.pt, the commit, then the copy to
    the mirror. It first makes the parent directory's lock its own, then sets ``started`` (the caller waits
    for that, and raises what is in ``refused`` instead of returning the handle)."""
    try:
        staged.hand_over(threading.get_ident())  # it commits, so it holds the lock and lets it go
    except BaseException as err:
        refused.append(err)
        state.close()
        staged.abort()
        staged.close()
        return
    finally:
        started.set()
    error = None
    try:
        try:
            state.make_spares()
            pool = BufferPool(2, state.store.layout.unit_bytes)
            try:
                with _progress(state.total, "save (background)", bool(show)) as bar:
                    data = state.run(list(pool), bar)
            finally:
                state.close()  # the engine lets go of the pool's buffers before they are freed
                pool.close()
            _commit(staged, finish(data))
        except BaseException:
            staged.abort()
            raise
        finally:
            state.close()
            staged.close()
        handle.committed = True
        if then is not None:
            then(staged.directory)
        if mirror is not None:
            mirror_checkpoint(staged.directory, mirror)
            if then_mirror is not None:
                then_mirror(mirror)
    except BaseException as err:  # noqa: BLE001 - surfaces on the handle and at the next save
        error = err
    finally:
        handle._finish(error)


# NOTE: for a rank's shard of a job's checkpoint (``commit._Shard``) this writes the shard's manifest
# only; the job's commit, once every rank has reported its shard fsynced, is ``_save_job``'s.
def _commit(staged: _Staged, manifest: dict) -> None:
    staged.commit(manifest)


# -- a job's save (torch.distributed) ---------------------------------------------------------------


# NOTE: a job's checkpoint is complete on every rank or is not there. Every rank writes its shard, as
# a save of its own would (streamed from its own swap space, checksummed, fsynced), into a staging
# directory ``<dir>.tmp-job-<id>`` whose id rank 0 draws; the ranks then exchange what they did
# (all_gather over the checkpoints' gloo group). If any failed, or one does not answer (dead, or past
# the process group's timeout), every rank removes its shard and raises: nothing is committed. Else
# the lowest rank among those that see the same staging directory (all of them on a shared file
# system, those of one node with node-local directories) writes the job manifest into it and commits
# it (``commit._JobCommit``): the job manifest is written last, and in each directory by one rank,
# so ranks that share a file system never race on it, and directories that share nothing each get a
# complete manifest of the whole job. The ranks then exchange again: if a directory could not commit,
# the others put their previous checkpoint back.
def _save_job(optimizer, directory, *, model, extra, blocking, mirror_to, snapshot, progress, then) -> str:
    """:func:`save_checkpoint` on every rank of a job (see the NOTE above); returns the directory."""
    rank, world = rank_info().rank, job_world()
    given = os.path.abspath(os.fspath(directory))
    if not blocking:
        raise CheckpointError(f"save_checkpoint(blocking=False) is for a process that saves alone; in a job of "
                              f"{world} ranks save with blocking=True (the ranks agree on the commit with "
                              "collectives, which a background thread would interleave with training's), or "
                              "save one rank's state by itself with alone=True")
    if mirror_to is not None:
        raise CheckpointError(f"mirror_to is for a process that saves alone; in a job of {world} ranks copy "
                              "each rank's directory to the second level yourself (offload-ckpt mirror), or "
                              "save one rank's state by itself with alone=True")
    target = os.path.realpath(given)
    token = _gather(secrets.token_hex(8), f"saving {given}")[0]
    stage = f"{target}.tmp-job-{token}"
    name = _shard_name(rank)
    status, own = {"rank": rank, "name": name, "ok": False}, None
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        _target_kind(target, given)  # refused before anything is written (and again at the commit)
        os.makedirs(stage, exist_ok=True)
        shard = _Shard(os.path.join(stage, name))
        _save(optimizer, shard.directory, model=model, extra=extra, snapshot=snapshot, progress=progress,
              shard=shard)
        status.update(ok=True, manifest_xxh3_64=shard.manifest["manifest_xxh3_64"], step=shard.manifest["step"],
                      files=shard.manifest["files"])
    except Exception as err:  # noqa: BLE001 - told to the other ranks, then raised
        own = err
        status["error"] = f"{type(err).__name__}: {err}"
    try:
        statuses = _gather(status, f"saving {given}")
    except CheckpointError as err:
        _discard_shard(stage, name)
        if own is not None:
            raise own from err
        raise
    failed = [s for s in statuses if not s["ok"]]
    if failed:
        _discard_shard(stage, name)
        if own is not None:
            raise own
        raise CheckpointError(f"the job's save to {given} failed on rank {failed[0]['rank']} "
                              f"({failed[0]['error']}); nothing was committed on any rank, and the checkpoint "
                              "that was there (if any) is as it was")
    job = _job_manifest(token, statuses)
    commit, result, own = None, {"ok": True}, None
    try:
        here = _ranks_here(stage, statuses, rank)
        if here is not None and min(here) == rank:
            commit = _JobCommit(stage, given)
            commit.commit(job)
    except Exception as err:  # noqa: BLE001 - told to the other ranks, then raised
        own = err
        result = {"ok": False, "error": f"{type(err).__name__}: {err}"}
    try:
        results = _gather({"rank": rank, **result}, f"committing {given}")
    except CheckpointError:
        if commit is not None:
            commit.roll_back()
        raise
    failed = [r for r in results if not r["ok"]]
    if failed:
        if commit is not None:
            commit.roll_back()
        if own is not None:
            raise own
        raise CheckpointError(f"the job's save to {given} could not be committed on rank {failed[0]['rank']} "
                              f"({failed[0]['error']}); every directory of the job has its previous checkpoint back")
    if commit is not None:
        commit.finish()
    if then is not None:
        then(given)
    return given


def _ranks_here(stage: str, statuses: list, rank: int) -> Optional[list]:
    """The ranks whose shards are in the same staging directory as this rank's (those that share its file
    system), or None once another of them has committed it (it is no longer at ``stage``).

    The directory is opened once and read through that descriptor, which follows it if the rank that
    commits it renames it meanwhile; what ``stage`` names after such a rename (the checkpoint it replaced)
    does not hold this rank's shard as written, which tells that it was committed.
    """
    try:
        fd = os.open(stage, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        def digest(name: str) -> Optional[str]:
            try:
                m = os.open(os.path.join(name, MANIFEST), os.O_RDONLY | os.O_CLOEXEC, dir_fd=fd)
            except (FileNotFoundError, NotADirectoryError):
                return None
            with os.fdopen(m, "rb") as f:
                try:
                    return json.loads(f.read()).get("manifest_xxh3_64")
                except (ValueError, AttributeError):
                    return None

        if digest(statuses[rank]["name"]) != statuses[rank]["manifest_xxh3_64"]:
            return None
        return [s["rank"] for s in statuses if digest(s["name"]) == s["manifest_xxh3_64"]]
    finally:
        os.close(fd)


def _job_manifest(token: str, statuses: list) -> dict:
    """The job manifest: its id, the world size, every rank's shard with its manifest's checksum and files."""
    shards = [{"rank": s["rank"], "name": s["name"], "manifest_xxh3_64": s["manifest_xxh3_64"], "step": s["step"],
               "files": s["files"]} for s in statuses]
    return {
        "format": JOB_FORMAT,
        "version": JOB_VERSION,
        "job": token,
        "world_size": len(statuses),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "step": max(s["step"] for s in shards),
        "shards": shards,
    }


def _discard_shard(stage: str, name: str) -> None:
    """Remove this rank's shard from a job's staging directory, and the directory once empty."""
    with contextlib.suppress(OSError):
        path = os.path.join(stage, name)
        if os.path.lexists(path):
            _remove_ours(path, quiet=True)
        os.rmdir(stage)


def _mirror_in_background(owner, directory: str, mirror: str, then_mirror) -> None:
    handle = SaveHandle(directory)
    handle.committed = True

    def copy_out() -> None:
        error = None
        try:
            mirror_checkpoint(directory, mirror)
            if then_mirror is not None:
                then_mirror(mirror)
        except BaseException as err:  # noqa: BLE001 - surfaces at the next save
            error = err
        finally:
            handle._finish(error)

    _track(owner, handle)
    threading.Thread(target=copy_out, name="offload-checkpoint-mirror").start()


def _plan(opt) -> _Plan:
    """Everything of the optimizer a save needs besides the units' bytes, copied now."""
    store = opt.state_store
    params = [p for g in opt.param_groups for p in g["params"]]
    index = {p: i for i, p in enumerate(params)}
    slots = store.layout.slots
    units = [u for u in store.layout.units if any(c.slot.initialized for c in u.chunks)]
    entries = []
    chunks_of = _chunk_table(units, index.__getitem__)
    memory_state, steps = {}, {}
    for i, p in enumerate(params):
        slot = slots.get(p)
        st = opt.state.get(p, {})
        entry = {"index": i, "shape": list(p.shape), "dtype": _dtype_name(p.dtype), "numel": p.numel()}
        if slot is not None and (slot.initialized or i in chunks_of):
            entry.update(where="swap", initialized=slot.initialized, keys=list(slot.keys),
                         state_dtype=_dtype_name(slot.dtype), chunks=chunks_of.get(i, []))
            if len(set(slot.dtypes)) > 1:
                entry["key_dtypes"] = [_dtype_name(d) for d in slot.dtypes]
            if slot.initialized:
                steps[i] = st["step"].detach().to("cpu", copy=True)
        elif slot is None and len(st) > 0:
            memory_state[i] = _cpu_state(st)
            entry.update(where="memory", initialized=True, keys=sorted(k for k in st if k != "step"),
                         state_dtype=_dtype_name(p.dtype))
        else:
            entry.update(where="none", initialized=False)
        if entry["initialized"]:
            entry["step"] = float(steps[i] if i in steps else memory_state[i].get("step", 0.0))
        entries.append(entry)
    groups = copy.deepcopy(_torch_groups(opt.param_groups, index))  # hyperparameters may change in place
    return _Plan(units, entries, groups, memory_state, steps)


# -- state.bin: the units as they were at the call ------------------------------------------------

_PENDING, _READING, _CAPTURING, _IN_FILE = range(4)


# NOTE: state.bin holds every unit as it was when the save was called, while training may go on.
# Each unit is in one of four states: pending; being read from the store by the save's thread
# (reading); being copied by the change guard (capturing); or already in state.bin (in file: cloned
# at the call, or written by the guard). A step calls the guard before it changes a unit: a pending
# unit is then copied from the step's own buffer (no extra read) into a spare buffer and written
# to state.bin, and a unit being read is waited for (that unit alone). The save's thread goes
# through the units in file order: it reads pending ones from the store and writes them, and reads
# back those in file, so that every unit's checksum and the file's are computed in order, and what
# the guard wrote is checked. A blocking save is the same walk with no guard, through the
# optimizer's own pool.
class _StateCopy:
    """state.bin of one save: offsets, what each unit's bytes are doing, the clone, the walk and the guard."""

    def __init__(self, store, staged: _Staged, aio: AioConfig, units: Sequence):
        self.store = store
        self.units = list(units)
        n = len(self.units)
        self.index = {id(u): i for i, u in enumerate(self.units)}
        self.lengths = [round_up(u.nbytes, ALIGNMENT) for u in self.units]
        self.offsets, pos = [], 0
        for length in self.lengths:
            self.offsets.append(pos)
            pos += length
        self.total = pos
        self.path = staged.path(DATA)
        self.state = [_PENDING] * n
        self.reads: list = [None] * n  # the save's read of a unit from the store (the guard waits for it)
        self.written: list = [None] * n  # the guard's write of a unit
        self.expected: list = [None] * n  # xxh3_64 of what the guard wrote
        self.issued = [threading.Event() for _ in range(n)]  # reads[i] is set, or the unit is in file
        # The slots that had state at the call: the guard trusts a step's buffer only while they still
        # do (a step reads such a unit; load_state_dict resets them all and then does not read).
        self.had_state = [[c.slot for c in u.chunks if c.slot.initialized] for u in self.units]
        self.digests = [""] * n
        tier = store.tier
        self.on_disk = sum(1 for u in self.units if u.extent is not None and not (tier and tier.resident(u)))
        self.cloned = self.cloned_bytes = 0
        self.why_not: Optional[str] = None
        self.mu = threading.Condition()
        self.failure: Optional[BaseException] = None
        self.guards = 0  # guard calls under way
        self.closed = False
        self._remove_guard: Optional[Callable[[], None]] = None
        self.spares: Optional[BufferPool] = None
        self.spares_ready = threading.Event()
        self.ring: Optional[BufferRing] = None
        self.engine = stream._make_engine(aio)
        self.file = None
        try:
            self.file = self.engine.open(self.path, "x+")
            if self.file.alignment > ALIGNMENT:
                raise CheckpointError(f"{self.path}: the file system wants {self.file.alignment}-byte direct I/O; "
                                      f"checkpoints use {ALIGNMENT}. Set aio.o_direct to false for this path")
        except BaseException:
            self.close()
            raise

    def reserve(self) -> None:
        """Allocate state.bin's space for the units that were not cloned (a full disk is reported now,
        before any data moves)."""
        runs, start = [], None
        for i in range(len(self.units) + 1):
            copied = i < len(self.units) and self.state[i] != _IN_FILE
            if copied and start is None:
                start = i
            elif not copied and start is not None:
                runs.append((self.offsets[start], self.offsets[i - 1] + self.lengths[i - 1]))
                start = None
        need = sum(b - a for a, b in runs)
        try:
            for a, b in runs:
                os.posix_fallocate(self.file.fd, a, b - a)
        except OSError as err:
            st = os.statvfs(os.path.dirname(self.path))
            raise OSError(err.errno, f"cannot reserve {need} bytes for the checkpoint data ({err.strerror}; "
                          f"{st.f_bavail * st.f_frsize} bytes free)", self.path) from err

    # -- the clone -----------------------------------------------------------------------------------

    def clone(self) -> None:
        """Clone every unit that lies on the swap files into state.bin (metadata only), where the file
        system can; the rest is copied later. The swap files must have no write in flight."""
        space, tier = self.store.space, self.store.tier
        if space is None or not self.on_disk:
            self.why_not = "the state lives in host memory" if space is None else None
            return
        devices = {os.stat(p).st_dev for p in space.files}
        if devices != {os.stat(self.path).st_dev}:
            self.why_not = "the checkpoint is not on the swap files' file system"
            return
        need = sum(self.lengths[i] for i, u in enumerate(self.units) if not (tier and tier.resident(u)))
        sources = {p: os.open(p, os.O_RDONLY | os.O_CLOEXEC) for p in space.files}
        pad = os.open(self.path, os.O_WRONLY | os.O_CLOEXEC)  # buffered: padding is not block-sized
        try:
            for i, u in enumerate(self.units):
                if u.extent is None or (tier and tier.resident(u)):
                    continue  # resident: its bytes are in memory, copied by the walk
                for path, offset, within, n in space.file_ranges(u.extent, self.lengths[i]):
                    if not _clone_range(sources[path], offset, n, self.file.fd, self.offsets[i] + within):
                        self.why_not = "the file system cannot clone these extents (no reflink)"
                        return  # this unit (maybe cloned in part) and the rest are copied by the walk
                    if not self.cloned:
                        self._check_room(need)
                gap = self.lengths[i] - u.nbytes
                if gap:
                    os.pwrite(pad, bytes(gap), self.offsets[i] + u.nbytes)  # as a copy pads: zeros
                self.state[i] = _IN_FILE
                self.issued[i].set()
                self.cloned += 1
                self.cloned_bytes += self.lengths[i]
        except OSError as err:
            raise _io_error(err, self.path, "cannot clone the state into") from err
        finally:
            for fd in sources.values():
                os.close(fd)
            os.close(pad)

    def _check_room(self, need: int) -> None:
        """A clone shares blocks until training overwrites them; each overwrite then needs new space. As a
        streamed save's fallocate would, refuse now (undoing the first clone) if that space is not free."""
        st = os.statvfs(self.path)
        if st.f_bavail * st.f_frsize < need:
            os.ftruncate(self.file.fd, 0)
            raise OSError(_errno.ENOSPC, f"a clone of {format_size(need)} of state needs as much free space for "
                          f"training to overwrite it ({format_size(st.f_bavail * st.f_frsize)} free)", self.path)

    def summary(self, *, asynchronous: bool) -> dict:
        """The manifest's ``snapshot`` entry: how state.bin was made."""
        cloned = self.cloned_bytes
        method = "clone" if cloned and cloned == self.total else "clone+stream" if cloned else "stream"
        return {"method": method, "cloned_bytes": cloned, "streamed_bytes": self.total - cloned,
                "asynchronous": asynchronous}

    # -- the guard -----------------------------------------------------------------------------------

    def guard_on(self) -> None:
        """Copy units before any step changes them, until the walk is over (asynchronous saves); nothing to
        do when every unit was cloned."""
        if all(s == _IN_FILE for s in self.state):
            self.spares_ready.set()
            return
        self._remove_guard = self.store.add_change_guard(self._guard)

    def make_spares(self) -> None:
        """The guard's two spare buffers, made by the save's thread (zeroing them is not the caller's time);
        a guard call before then waits for them."""
        try:
            if self._remove_guard is not None and self.spares is None:
                self.spares = BufferPool(2, self.store.layout.unit_bytes)
                self.ring = BufferRing(list(self.spares))
        finally:
            self.spares_ready.set()

    def _guard(self, unit, buf) -> None:
        i = self.index.get(id(unit))
        if i is None:
            return  # no state at the call: not in this checkpoint
        with self.mu:
            was = self.state[i]
            if was != _PENDING or self.closed or self.failure is not None:
                take = False
            else:
                self.state[i], take = _CAPTURING, True
                self.guards += 1
        if was == _READING:
            self.issued[i].wait()
            _wait_quietly(self.reads[i])  # the save's read of this unit has its bytes: the step may go on
            return
        if not take:
            return
        try:
            self._capture(i, unit, buf)
        except BaseException as err:  # noqa: BLE001 - the save fails, training goes on
            with self.mu:
                self.failure = self.failure or err
        finally:
            self.issued[i].set()
            with self.mu:
                self.guards -= 1
                self.mu.notify_all()

    def _capture(self, i: int, unit, buf) -> None:
        n, length = unit.nbytes, self.lengths[i]
        self.spares_ready.wait()
        if self.ring is None:
            raise CheckpointError("the save's spare buffers could not be made")
        spare = self.ring.take(wait=True)
        pending = None
        try:
            tier = self.store.tier
            if (tier is not None and tier.home(unit) is buf) or all(s.initialized for s in self.had_state[i]):
                spare.tensor[:n].copy_(buf.tensor[:n])
            else:  # the step did not read this unit: its bytes are still where the store keeps them
                _wait(self.store.read_unit(unit, spare))
            spare.tensor[n:length].zero_()
            pending = self.engine.write_async(self.file, spare, self.offsets[i], length)
            self.written[i] = pending
            self.expected[i] = xxhash.xxh3_64(spare.tensor[:length].numpy()).hexdigest()
            self.state[i] = _IN_FILE
        finally:
            self.ring.give(spare, pending)

    # -- the walk ------------------------------------------------------------------------------------

    def run(self, buffers: Sequence, bar) -> dict:
        """Put every unit not in state.bin yet there, hash the file in order, fsync; returns the file's
        entry and the units' table (as ``stream._write_data``)."""
        whole = xxhash.xxh3_64()
        from_store = [False] * len(self.units)

        def read(i: int, buf):
            with self.mu:
                if self.failure is not None:
                    raise self.failure
                was = self.state[i]
                if was == _PENDING:
                    self.state[i] = _READING
            if was == _PENDING:
                from_store[i] = True
                fut = None
                try:
                    fut = self.store.read_unit(self.units[i], buf)  # checked against the unit's last write
                finally:
                    self.reads[i] = fut
                    self.issued[i].set()
                return fut
            self.issued[i].wait()
            with self.mu:
                if self.failure is not None:
                    raise self.failure
            if self.written[i] is not None:
                self.written[i].wait()
            return self.engine.read_async(self.file, buf, self.offsets[i], self.lengths[i])

        def process(i: int, buf) -> bool:
            n, length = self.units[i].nbytes, self.lengths[i]
            if from_store[i]:
                buf.tensor[n:length].zero_()  # padding: same state, same bytes
            data = buf.tensor[:length].numpy()
            digest = xxhash.xxh3_64(data).hexdigest()
            if self.expected[i] is not None and digest != self.expected[i]:
                raise ChecksumError(f"{self.path}: bytes [{self.offsets[i]}, {self.offsets[i] + length}) read back "
                                    f"have xxh3_64 {digest}, {self.expected[i]} was written there")
            self.digests[i] = digest
            whole.update(data)
            bar.update(length)
            return from_store[i]

        def write(i: int, buf):
            return self.engine.write_async(self.file, buf, self.offsets[i], self.lengths[i])

        if buffers and all(b.index == k for k, b in enumerate(buffers)):
            try:
                self.engine.register_buffers(list(buffers))
            except (ValueError, RuntimeError, OSError):
                pass  # fixed buffers only save a little CPU
        _stream(range(len(self.units)), list(buffers), read=read, process=process, write=write)
        try:
            os.fsync(self.file.fd)
        except OSError as err:
            raise _io_error(err, self.path, "cannot fsync") from err
        table = [{"offset": o, "nbytes": u.nbytes, "length": n, "xxh3_64": d}
                 for u, o, n, d in zip(self.units, self.offsets, self.lengths, self.digests)]
        return {"file": {"bytes": self.total, "xxh3_64": whole.hexdigest()}, "units": table}

    def close(self) -> None:
        """Stop guarding (waiting for a guard call under way), let the guard's writes land, release all."""
        self.spares_ready.set()  # a guard call waiting for spares goes on (and finds none)
        with self.mu:
            self.closed = True
            if self._remove_guard is not None:
                self._remove_guard()
                self._remove_guard = None
            while self.guards:
                self.mu.wait()
        for fut in self.written:
            _wait_quietly(fut)
        if self.file is not None:
            self.file.close()
            self.file = None
        self.engine.close()
        if self.spares is not None:
            self.spares.close()
            self.spares = None


def _wait(fut) -> None:
    if fut is not None:
        fut.wait()


def _wait_quietly(fut) -> None:
    try:
        _wait(fut)
    except Exception:  # noqa: BLE001 - whoever issued it reports it
        pass


# -- a second level ----------------------------------------------------------------------------------


def _mirror_path(directory, mirror_to) -> Optional[str]:
    """Where ``mirror_to`` puts the copy of ``directory``: ``mirror_to/<its name>``."""
    if mirror_to is None:
        return None
    root = os.path.abspath(os.fspath(mirror_to))
    here = os.path.abspath(os.fspath(directory))
    if os.path.realpath(root) == os.path.realpath(os.path.dirname(here)):
        raise ValueError(f"mirror_to {root} is the directory the checkpoint {here} is saved in: its copy would "
                         "replace the checkpoint itself. Give a directory on another drive or a network mount")
    return os.path.join(root, os.path.basename(here))


def mirror_checkpoint(source: str | os.PathLike, destination: str | os.PathLike, *,
                      progress: Optional[bool] = None) -> str:
    """Copy the checkpoint ``source`` to ``destination`` (another drive, a network mount), atomically, and
    verify the copy by checksum after it is written (``offload-ckpt mirror SRC DST``).

    ``source`` is held still (:func:`reading`) while it is copied; the copy is staged and committed
    like a save, so ``destination`` is either the previous checkpoint there or the whole verified
    copy, and it may only replace what a save may (missing, an empty directory, a checkpoint of
    ours). Files are copied with ``copy_file_range`` (a server-side copy or a reflink where the file
    systems offer one), then read back with O_DIRECT and checked against the manifest.

    Returns:
        ``destination`` (absolute).

    Raises:
        ChecksumError: the source, or the copy as read back, fails a checksum (the copy is not committed).
        CheckpointError: ``source`` is not a complete checkpoint.
        FileExistsError: ``destination`` is something a save may not replace.
        OSError: reading or writing failed (file named).
    """
    src = os.path.abspath(os.fspath(source))
    dst = os.path.abspath(os.fspath(destination))
    if os.path.realpath(src) == os.path.realpath(dst):
        raise ValueError(f"cannot mirror {src} onto itself")

    def write(staged: _Staged) -> dict:
        with reading(src):  # inside the save of dst's parent: a read there counts up, never waits for itself
            manifest = read_manifest(src)
            total = sum(f["bytes"] for f in manifest["files"].values())
            with _progress(total, "mirror", progress) as bar:
                for name in sorted(manifest["files"]):
                    _copy_file(os.path.join(src, name), staged.path(name), bar)
        _verify_files(staged.tmp, manifest)  # the copy, read back from its drive
        return {k: v for k, v in manifest.items() if k != "manifest_xxh3_64"}

    return _write_atomically(dst, write)


_COPY_CHUNK = 64 << 20
_NO_COPY_RANGE = frozenset({_errno.EXDEV, _errno.EINVAL, _errno.ENOSYS, _errno.EOPNOTSUPP, _errno.ENOTSUP,
                            _errno.EBADF, _errno.EPERM})


def _copy_file(src: str, dst: str, bar) -> None:
    """Copy ``src`` to the new file ``dst`` and fsync it (``copy_file_range``, else reads and writes)."""
    try:
        fin = open(src, "rb")
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {os.path.dirname(src)} is missing {os.path.basename(src)}, which its "
                              "manifest lists") from None
    with fin:
        try:
            with open(dst, "xb") as fout:
                size = os.fstat(fin.fileno()).st_size
                pos, ranged = 0, True
                while pos < size:
                    want = min(_COPY_CHUNK, size - pos)
                    if ranged:
                        try:
                            n = os.copy_file_range(fin.fileno(), fout.fileno(), want, pos, pos)
                        except OSError as err:
                            if err.errno not in _NO_COPY_RANGE:
                                raise
                            ranged = False
                            continue
                    else:
                        data = os.pread(fin.fileno(), min(want, 8 << 20), pos)
                        n = len(data)
                        view = memoryview(data)
                        while view:
                            view = view[os.pwrite(fout.fileno(), view, pos + n - len(view)):]
                    if n == 0:
                        raise ChecksumError(f"{src}: ends at byte {pos}, {size} expected (it shrank while copied)")
                    pos += n
                    bar.update(n)
                fout.flush()
                os.fsync(fout.fileno())
        except OSError as err:
            raise _io_error(err, dst, "cannot copy to") from err
