"""Lightning with nvme-offload: ``Trainer(callbacks=[OffloadCheckpoint()])`` makes its checkpoints stream.

An ``OffloadedAdam``'s state (and weights offloaded with ``offload_parameters``) go to a directory
beside each ``.ckpt`` file (``epoch=3-step=400.ckpt.offload``) through ``save_checkpoint`` /
``load_checkpoint``; the ``.ckpt`` keeps everything else. Lightning is imported only when
``OffloadCheckpoint`` or ``OffloadCheckpointIO`` is first used.
"""

from __future__ import annotations

import os
import re
from types import MethodType
from typing import Any, Optional

import torch

from ..commit import make_dirs, replace_file
from ..errors import CheckpointError
from ._common import check_fingerprint, fingerprint, has_offloaded_weights, offloaded_optimizer

__all__ = ["KEY", "SUFFIX", "OffloadCheckpoint", "OffloadCheckpointIO"]  # noqa: F822 (built by __getattr__)

SUFFIX = ".offload"  # X.ckpt -> X.ckpt.offload (optimizer 0 and the weights), X.ckpt.offload-1, ...
KEY = "nvme_offload"  # what the .ckpt says about the directories beside it
_NUMBERED = r"(?:-[1-9][0-9]*)?"  # the n of X.ckpt.offload-<n>
_STREAMED = {KEY: "streamed beside the .ckpt"}  # stands in checkpoint["optimizer_states"][i]
_OVERRIDES = ("optimizer_state", "lightning_module_state_dict", "load_model_state_dict", "load_optimizer_state_dict")


# NOTE: Lightning gathers ``optimizer.state_dict()`` and ``module.state_dict()`` in its strategy, into
# one dict, before any callback or CheckpointIO sees it (its DeepSpeed and FSDP strategies override
# exactly these steps for the same reason). OffloadCheckpoint therefore overrides them on the
# Trainer's strategy (single device or DDP): an OffloadedAdam's entry becomes a small marker, and an
# offloaded model's state_dict an empty one; OffloadCheckpointIO, given the file's path, streams them
# into directories beside it and writes the rest with torch.save. The .ckpt records each directory's
# fingerprint (its manifest's checksum), checked before anything is loaded: a crash between the two
# writes, or a .ckpt copied without its directory, is refused rather than trained on.
def _optimizer_state(strategy, optimizer) -> dict:
    if offloaded_optimizer(optimizer) is not None:
        return dict(_STREAMED)
    return type(strategy).optimizer_state(strategy, optimizer)


def _lightning_module_state_dict(strategy) -> dict:
    if has_offloaded_weights(strategy.lightning_module):
        return {}  # streamed beside the .ckpt
    return type(strategy).lightning_module_state_dict(strategy)


def _load_model_state_dict(strategy, checkpoint, strict: bool = True) -> None:
    info = checkpoint.get(KEY)
    if info is None or not info["model"]:
        return type(strategy).load_model_state_dict(strategy, checkpoint, strict=strict)
    from ..checkpoint import load_parameters

    load_parameters(strategy.lightning_module, info["dirs"][0])


def _load_optimizer_state_dict(strategy, checkpoint) -> None:
    info = checkpoint.get(KEY)
    if info is None:
        return type(strategy).load_optimizer_state_dict(strategy, checkpoint)
    from lightning.fabric.utilities.optimizer import _optimizer_to_device

    dirs = iter(info["dirs"])
    for optimizer, state in zip(strategy.optimizers, checkpoint["optimizer_states"]):
        if state != _STREAMED:
            optimizer.load_state_dict(state)
            _optimizer_to_device(optimizer, strategy.root_device)
            continue
        offloaded_optimizer(optimizer).load_checkpoint(next(dirs), alone=True)


def _dirs(path: str, count: int) -> list[str]:
    return [f"{path}{SUFFIX}" + (f"-{i}" if i else "") for i in range(count)]


def _ours_beside(path: str) -> list[str]:
    """The directories beside the file ``path`` whose names a save of it writes (``X.ckpt.offload``,
    ``X.ckpt.offload-<n>``): never ``X.ckpt.offload-1-backup`` or another name a user chose."""
    where, name = os.path.split(os.path.abspath(path))
    mine = re.compile(re.escape(name + SUFFIX) + _NUMBERED)
    try:
        names = os.listdir(where or ".")
    except FileNotFoundError:
        return []
    return [os.path.join(where, n) for n in sorted(names) if mine.fullmatch(n)]


def _confined(info: Any, path: str) -> dict:
    """``info`` (what the ``.ckpt`` at ``path`` says of its directories), checked: each a name of ours
    beside the file, never one that leads elsewhere (``..``, an absolute path, a link out)."""
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{path}: its {KEY!r} entry {why}; this .ckpt was not written by OffloadCheckpoint "
                               "as it is, so it is not loaded. Use the .ckpt and its directories as saved.")

    if not (isinstance(info, dict) and isinstance(info.get("dirs"), list) and isinstance(info.get("fingerprints"), list)
            and isinstance(info.get("model"), bool) and len(info["dirs"]) == len(info["fingerprints"])):
        raise bad("is not what a save writes (dirs, fingerprints, model)")
    where = os.path.dirname(os.path.realpath(path))
    out = []
    for name in info["dirs"]:
        if not (isinstance(name, str) and re.fullmatch(r"[^/\\\x00]+" + re.escape(SUFFIX) + _NUMBERED, name)):
            raise bad(f"names {name!r}, not a directory beside it")
        full = os.path.join(where, name)
        if os.path.islink(full) or os.path.dirname(os.path.realpath(full)) != where:
            raise bad(f"names {name!r}, which leads out of {where}")
        out.append(full)
    if not all(isinstance(f, str) for f in info["fingerprints"]):
        raise bad("has fingerprints that are not text")
    return {**info, "dirs": out}


def _save_streamed(trainer, checkpoint: dict, path: str) -> None:
    """Save the offloaded optimizers' state and the offloaded weights of ``trainer`` in directories beside
    ``path`` (see :class:`OffloadCheckpoint`), and name them in ``checkpoint`` under :data:`KEY`."""
    module = trainer.lightning_module
    model = module if has_offloaded_weights(module) else None
    states = checkpoint.get("optimizer_states", [])
    ours = [offloaded_optimizer(o) for o, s in zip(trainer.optimizers, states) if s == _STREAMED]
    if not ours and model is None:
        return
    dirs = _dirs(path, max(len(ours), 1))
    for i, (opt, directory) in enumerate(zip(ours, dirs)):
        opt.save_checkpoint(directory, model=model if i == 0 else None, alone=True)
    if not ours:
        from ..checkpoint import save_parameters

        save_parameters(model, dirs[0])
    checkpoint[KEY] = {"dirs": [os.path.basename(d) for d in dirs], "model": model is not None,
                       "fingerprints": [fingerprint(d) for d in dirs]}


def _write_whole(checkpoint: dict, path: str) -> None:
    """``torch.save`` ``checkpoint`` to ``path`` as one durable replacement (:func:`offload.commit.replace_file`:
    written unnamed, fsynced, renamed over ``path`` only if that is a regular file or nothing, the directory
    fsynced after; Lightning's own write leaves the directory unsynced)."""
    make_dirs(os.path.dirname(os.path.abspath(path)))  # durably: a new directory's name survives a power loss too
    replace_file(path, lambda f: torch.save(checkpoint, f), private=False)


def _check_streamed(checkpoint: dict, path: str) -> None:
    """Confine the directories ``checkpoint`` (loaded from ``path``) names under :data:`KEY` to beside the
    file (a link's target, if a link), and check each is the one its save wrote."""
    info = checkpoint.get(KEY)
    if info is None:
        return
    info = checkpoint[KEY] = _confined(info, path)
    for directory, expected in zip(info["dirs"], info["fingerprints"]):
        check_fingerprint(directory, expected, path)


def _classes() -> dict:
    """``OffloadCheckpointIO`` and ``OffloadCheckpoint``, built on first use (Lightning imported then)."""
    if _built:
        return _built
    try:
        from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
        from lightning.pytorch.callbacks import Callback
        from lightning.pytorch.plugins.io import CheckpointIO
        from lightning.pytorch.strategies import Strategy
    except ImportError as err:
        raise ImportError("OffloadCheckpoint needs lightning: pip install 'nvme-offload[integrations]'") from err

    class OffloadCheckpointIO(CheckpointIO):
        """Writes a checkpoint's streamed parts beside the ``.ckpt`` (see :class:`OffloadCheckpoint`),
        then the rest through ``inner`` (Lightning's default: ``torch.save`` into a temporary file,
        renamed over the ``.ckpt``).

        Args:
            inner: the CheckpointIO that was in place (writes and reads the ``.ckpt`` itself).
            trainer: the Trainer whose optimizers and module the streamed parts come from.
        """

        def __init__(self, inner, trainer):
            self.inner = inner
            self.trainer = trainer

        def save_checkpoint(self, checkpoint: dict, path, storage_options: Optional[Any] = None) -> None:
            path = os.fspath(path)
            _save_streamed(self.trainer, checkpoint, path)
            # Lightning's own write serialises the whole dict into memory first.
            if type(self.inner) is TorchCheckpointIO and storage_options is None and "://" not in path:
                _write_whole(checkpoint, path)
            else:
                self.inner.save_checkpoint(checkpoint, path, storage_options=storage_options)

        def load_checkpoint(self, path, map_location=None, weights_only=None) -> dict:
            checkpoint = self.inner.load_checkpoint(path, map_location=map_location, weights_only=weights_only)
            _check_streamed(checkpoint, os.fspath(path))
            return checkpoint

        def remove_checkpoint(self, path) -> None:
            from ..checkpoint.ownership import remove_checkpoint

            self.inner.remove_checkpoint(path)
            for directory in _ours_beside(os.fspath(path)):
                # Only the files its manifest names: a directory holding anything else keeps it (a warning
                # says so), one that is not a checkpoint of ours (or is a link) is left whole.
                remove_checkpoint(directory)

        def teardown(self) -> None:
            self.inner.teardown()

    class OffloadCheckpoint(Callback):
        """Lightning checkpoints that stream offloaded state: ``Trainer(callbacks=[OffloadCheckpoint()])``.

        Every checkpoint Lightning writes (``ModelCheckpoint``, ``trainer.save_checkpoint``) puts an
        ``OffloadedAdam``'s state, and weights offloaded with ``offload_parameters``, in a directory
        beside the ``.ckpt`` (``X.ckpt.offload``), streamed through the pools; ``ckpt_path=`` resumes
        from both. Host memory stays the pools whatever the model size. Works with the single-device
        and DDP strategies (others gather state their own way and are refused at setup).
        """

        def setup(self, trainer, pl_module, stage: str) -> None:
            strategy = trainer.strategy
            own = [name for name in _OVERRIDES if getattr(type(strategy), name) is not getattr(Strategy, name)]
            if own:
                raise ValueError(
                    f"OffloadCheckpoint cannot work with {type(strategy).__name__}, which gathers state its own way "
                    f"({', '.join(own)}); use a single-device or DDP strategy")
            if not isinstance(strategy.checkpoint_io, OffloadCheckpointIO):
                strategy.checkpoint_io = OffloadCheckpointIO(strategy.checkpoint_io, trainer)
            # Left in place after fit, so that a trainer.save_checkpoint() afterwards streams too.
            for name in _OVERRIDES:
                setattr(strategy, name, MethodType(globals()[f"_{name}"], strategy))

    for cls in (OffloadCheckpointIO, OffloadCheckpoint):
        cls.__module__ = __name__
    _built.update(OffloadCheckpointIO=OffloadCheckpointIO, OffloadCheckpoint=OffloadCheckpoint)
    return _built


_built: dict = {}


def __getattr__(name: str):
    if name in ("OffloadCheckpoint", "OffloadCheckpointIO"):
        return _classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
