"""Saving an offloaded optimizer and a model, blocking or in the background: the entry points, the save's
steps and its thread, and the verified copy of a committed checkpoint to a second level (another drive, a
network mount); what is captured at the call is ``snapshot``'s, a job's save ``job``'s."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any, Callable, Optional

from torch import nn

from ..buffers import BufferPool
from ..config import config_to_dict
from ..errors import CheckpointError
from ..interrupts import deferring
from .commit import SaveHandle, Staged, in_background, reading, wait_for_save, write_atomically
from .format import DEFAULT_STORAGE, MANIFEST, Storage, torch_bytes
from .job import job_world, save_job
from .manifest import FileEntry, Manifest, read_process
from .model import save_model
from .snapshot import StateCopy, plan, write_small_files
from .stream import progress_bar
from .verify import verify_files

__all__ = ["mirror_checkpoint", "save_checkpoint", "wait_for_saves"]

SNAPSHOTS = ("auto", "stream", "reflink")


@deferring
def save_checkpoint(optimizer, directory: str | os.PathLike, *, model: nn.Module | None = None,
                    extra: Any = None, blocking: bool = True, snapshot: str = "auto",
                    progress: Optional[bool] = None, alone: bool = False,
                    storage: Optional[Storage] = None) -> str | SaveHandle:
    """Save an offloaded optimizer's whole state to ``directory``, atomically, without materialising it.

    Offloaded state goes from the swap space to ``state.bin`` (its extents cloned where the checkpoint is
    on the swap files' XFS or btrfs, else streamed through host buffers), small parameters' state and the
    steps to ``memory.pt``, ``extra`` to ``extra.pt``; with ``model``, offloaded weights stream to
    ``params.bin`` (nothing is fetched) and the rest of the model to ``model.pt``. An existing checkpoint at
    ``directory`` is replaced only once the new one is complete on disk. With ``blocking=False`` training
    goes on while the state at the call is written (``docs/checkpoint.md``, "Saves that do not stop
    training"); its errors come from ``handle.wait()`` and, if nobody looked, from the next save.

    Args:
        optimizer: an :class:`offload.OffloadedAdam` or ``OffloadedAdamW``.
        directory: the checkpoint directory; its parent is created if missing.
        model: the model whose weights to save too (offloaded with ``offload_parameters`` or not).
        extra: anything ``torch.save`` can write and ``torch.load(weights_only=True)`` can read back.
        blocking: False: return at once with a :class:`SaveHandle` (see above).
        snapshot: ``"auto"`` clones extents where the file system can and streams elsewhere;
            ``"stream"`` always streams; ``"reflink"`` raises ``CheckpointError`` where it cannot clone.
        progress: show a progress bar on stderr for a long save; None: for a blocking save where
            stderr is a terminal.
        alone: where torch.distributed runs a job of several ranks, the save is the job's: every
            rank calls it and writes its shard, and it is committed for the whole job (see
            ``docs/checkpoint.md``, "Saves of a job"). ``alone=True`` saves this process's state by
            itself, an ordinary checkpoint, as outside a job (rank 0 saving DDP's replicated state
            while the other ranks do not call it).
        storage: the file-system and engine calls the save makes (:class:`Storage`); the default does
            what they say. Tests pass one that fails where they want it to.

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
    return save(optimizer, directory, model=model, extra=extra, blocking=blocking, snapshot=snapshot,
                 progress=progress, alone=alone, storage=storage)


def wait_for_saves(optimizer, timeout: float | None = None) -> None:
    """Wait for ``optimizer``'s save in flight (and its copy to a mirror level of ``Retention``), if any.

    Call it before closing the optimizer or exiting when saves were started with ``blocking=False``.

    Raises:
        CheckpointError: that save failed and its error was not looked at yet (chained).
        TimeoutError: ``timeout`` seconds passed first.
    """
    wait_for_save(optimizer.state_store, report=True, timeout=timeout)


def save(optimizer, directory, *, model=None, extra=None, blocking=True, mirror=None, snapshot="auto",
         progress=None, then: Optional[Callable[[str], None]] = None,
         then_mirror: Optional[Callable[[str], None]] = None, shard: Optional[Staged] = None,
         alone: bool = False, storage: Optional[Storage] = None):
    """:func:`save_checkpoint`, with ``then(directory)`` run once committed, then a copy to ``mirror`` (a
    directory of ``Retention``'s mirror level), and ``then_mirror(mirror)`` once the copy is done
    (``Retention`` verifies and prunes with them).

    Where torch.distributed runs a job of several ranks, the save is the job's (:func:`job.save_job`),
    which writes this rank's part through this function with ``shard``, a shard's :class:`commit.Staged`
    to fill and finish in place of a directory of its own."""
    # Arguments are checked first, on every rank alike, before any collective of a job's save.
    if snapshot not in SNAPSHOTS:
        raise ValueError(f"snapshot must be one of {', '.join(SNAPSHOTS)}, got {snapshot!r}")
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    storage = storage or DEFAULT_STORAGE
    if shard is None and not alone and job_world() is not None:
        return save_job(optimizer, directory, blocking=blocking, mirror=mirror, then=then, storage=storage,
                        write_shard=lambda shard: save(optimizer, shard.directory, model=model, extra=extra,
                                                       snapshot=snapshot, progress=progress, shard=shard))
    # Between a backward and step() with overlap_backward the update runs on the pool: refused, not raced
    # (in a job, inside the shard's write, so every rank hears of it).
    optimizer.check_no_step_running("save_checkpoint()")
    store = optimizer.state_store
    wait_for_save(store, report=True)  # one save at a time per optimizer; a failure nobody saw is raised here
    store.check_usable("save a checkpoint")
    store.drain()  # the last step's writes, and their errors, before anything is copied
    # Every write has landed without error: forget the futures, so that a read of a unit from the
    # save's thread and one from a step never race on them (a step writes a unit only after the
    # change guard has copied it).
    store.drain(quiet=True)
    show = progress if progress is not None else (None if blocking else False)  # None: where stderr is a tty
    staged = Staged(directory, storage=storage) if shard is None else shard
    started = False  # True once a worker owns the save (and cleans up after it)
    try:
        taken = plan(optimizer)
        memory = None
        if not blocking:  # copies of what training may change, taken now
            memory = torch_bytes({"param_groups": taken.groups, "state": taken.memory_state, "steps": taken.steps})
            extra = torch_bytes(extra) if extra is not None else None
        model_part = None  # the model's files: written at the call, after state.bin's for a blocking save
        state = StateCopy(taken.units, staged, optimizer.config.aio)
        try:
            if snapshot != "stream":
                state.clone()
                if snapshot == "reflink" and state.cloned < state.on_disk:
                    raise CheckpointError(
                        f"cannot clone the state into {staged.directory}: {state.why_not or 'units live in memory'}"
                        "; use snapshot=\"auto\" (clones where it can, streams the rest)")
            state.reserve()

            def finish(data: tuple) -> None:
                manifest = write_small_files(
                    staged, taken, data, kind=type(optimizer).__name__, extra=extra,
                    config=config_to_dict(optimizer.config, only=None), unit_bytes=taken.units.unit_bytes,
                    threshold=store.threshold, memory=memory)
                manifest = replace(manifest, snapshot=state.summary(asynchronous=not blocking))
                if model_part is not None:
                    section, files = model_part
                    files = {**manifest.files, **{n: FileEntry(**e) for n, e in files.items()}}
                    manifest = replace(manifest, model=section, files=files)
                staged.commit(manifest)

            if blocking:
                with progress_bar(state.total, "save", show) as bar:
                    data = state.run(store.lend_buffers(), bar)
                model_part = save_model(model, staged, taken.index) if model is not None else None
                finish(data)
            else:
                model_part = save_model(model, staged, taken.index) if model is not None else None
                state.guard_on()  # from here the next step hands the units over; waiting on the handle hurries it
                handle = SaveHandle(staged.directory, hurry=state.hurry)

                def work() -> None:
                    _finish_in_background(handle, staged, state, finish, show)
                    _after(staged.directory, then, mirror, then_mirror, background=False, storage=storage)

                in_background(store, handle, work, "offload-checkpoint-save")
                started = True
                return handle
        finally:
            if not started:
                state.close()  # else the worker's
    except BaseException:
        if not started:
            try:
                staged.abort()
            finally:
                staged.close()  # the directory's lock goes, whatever the cleanup met
        raise
    staged.close()
    _after(staged.directory, then, mirror, then_mirror, background=True, owner=store, storage=storage)
    return staged.directory


def _after(directory: str, then, mirror, then_mirror, *, background: bool, owner=None,
           storage: Optional[Storage] = None) -> None:
    """What follows a committed save: ``then(directory)``, then the copy to ``mirror`` (in the background
    where the save was not) and ``then_mirror(mirror)``."""
    if then is not None:
        then(directory)
    if mirror is None:
        return

    def copy_out() -> None:
        mirror_checkpoint(directory, mirror, storage=storage)
        if then_mirror is not None:
            then_mirror(mirror)

    if not background:
        copy_out()
        return
    handle = SaveHandle(directory)
    handle.committed = True
    in_background(owner, handle, copy_out, "offload-checkpoint-mirror")


def _finish_in_background(handle: SaveHandle, staged: Staged, state: StateCopy, finish, show) -> None:
    """The thread of an asynchronous save: the units not copied yet, memory.pt, the commit. The directory's
    lock goes with ``staged`` (an open descriptor), which it closes."""
    with staged.owned():
        try:
            state.make_spares()
            with BufferPool(2, state.items.unit_bytes) as pool:
                try:
                    with progress_bar(state.total, "save (background)", bool(show)) as bar:
                        data = state.run(list(pool), bar)
                finally:
                    state.close()  # the engine lets go of the pool's buffers before they are freed
            finish(data)
        finally:
            state.close()
    handle.committed = True


# -- the copy to a second level ----------------------------------------------------------------------


@deferring
def mirror_checkpoint(source: str | os.PathLike, destination: str | os.PathLike, *,
                      progress: Optional[bool] = None, storage: Optional[Storage] = None) -> str:
    """Copy the checkpoint ``source`` to ``destination`` (another drive, a network mount), atomically, and
    verify the copy by checksum after it is written (``offload-ckpt mirror SRC DST``).

    ``source`` is held still (:func:`reading`) while it is copied; the copy is staged and committed
    like a save, so ``destination`` is either the previous checkpoint there or the whole verified
    copy, and it may only replace what a save may (missing, an empty directory, a checkpoint of
    ours). Files are copied with ``copy_file_range`` (a server-side copy or a reflink where the file
    systems offer one), then read back with O_DIRECT and checked against the manifest. ``storage``: the
    file-system calls it makes, as for :func:`save_checkpoint`.

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
    storage = storage or DEFAULT_STORAGE

    def write(staged: Staged) -> Manifest:
        with reading(src):  # inside the save of dst's parent: a read there counts up, never waits for itself
            manifest = read_process(src)
            staged.within = os.stat(os.path.join(src, MANIFEST)).st_mode  # the copy's manifest: no wider
            total = sum(e.bytes for e in manifest.files.values())
            with progress_bar(total, "mirror", progress) as bar:
                for name in sorted(manifest.files):
                    storage.copy_file(manifest.path(name), staged.path(name), bar)
        copy = replace(manifest, root=staged.target, manifest_xxh3_64=None,
                       files={n: replace(e, file=staged.written[n]) for n, e in manifest.files.items()})
        verify_files(copy)  # the copy, read back from its drive
        return copy

    return write_atomically(dst, write, storage)
