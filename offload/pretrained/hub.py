"""Where a Hugging Face model is on this machine: a directory, or a hub id resolved through the local hub cache.

``huggingface_hub`` resolves ids, as transformers does (``HF_HOME``, ``HF_HUB_CACHE``, ``HF_HUB_OFFLINE``, tokens):
an id already in the cache is used with no network at all; one that is not is downloaded once (config, generation
config, tokenizer files and safetensors weights) unless the environment is offline, where it is a clear error. A
path that is neither a model directory nor an id is an error before transformers is asked anything.
"""

from __future__ import annotations

import os
from typing import Optional

from ..errors import CheckpointError

__all__ = ["WEIGHTS", "model_directory"]

# What a load needs of a hub repository: its JSON files (config, generation config, the shards' index,
# tokenizer) and its safetensors weights; never the PyTorch .bin, TensorFlow or Flax copies beside them.
WEIGHTS = ["*.json", "*.safetensors", "*.txt", "*.model", "tokenizer*"]


def model_directory(path: str | os.PathLike, *, revision: Optional[str] = None, cache_dir: Optional[str] = None,
                    token=None, local_files_only: Optional[bool] = None, subfolder: str = "") -> str:
    """The local directory of a model given as a directory or a Hugging Face hub id.

    Args:
        path: a directory holding config.json and safetensors weights, or a hub id (``"gpt2"``,
            ``"meta-llama/Llama-3.1-8B"``).
        revision: for a hub id, a branch, tag or commit (default ``main``).
        cache_dir: the hub cache (default: huggingface_hub's, from ``HF_HUB_CACHE`` / ``HF_HOME``).
        token: for gated or private repositories, as huggingface_hub takes it.
        local_files_only: never use the network (default: only when ``HF_HUB_OFFLINE`` says so).
        subfolder: the model's directory inside the repository or directory.

    Returns:
        The directory, holding config.json.

    Raises:
        CheckpointError: no such directory; a directory without config.json; an id that is not cached where the
            network may not be used, or cannot be downloaded; each says what to do.
    """
    given = os.fspath(path)
    if os.path.isdir(given):
        return _checked(os.path.join(given, subfolder) if subfolder else given, given)
    if os.path.exists(given):
        raise CheckpointError(f"{given} is a file, not a model directory: give the directory holding config.json "
                              "and the safetensors weights (or a Hugging Face hub id)")
    if _looks_like_a_path(given):
        raise CheckpointError(f"no such directory: {given}; give the directory holding config.json and the "
                              "safetensors weights, or a Hugging Face hub id such as \"gpt2\" or \"org/name\"")
    try:
        import huggingface_hub
        from huggingface_hub import constants
        from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
        from huggingface_hub.utils import validate_repo_id
    except ImportError:
        raise CheckpointError(f"{given} is not a directory here, and a Hugging Face hub id needs huggingface_hub "
                              "(pip install 'nvme-offload[integrations]'); or give the model's directory") from None
    try:
        validate_repo_id(given)
    except HFValidationError as err:
        raise CheckpointError(f"{given} is neither a directory nor a Hugging Face hub id ({err})") from None
    patterns = [f"{subfolder}/{p}" for p in WEIGHTS] if subfolder else WEIGHTS
    kw = dict(revision=revision, cache_dir=cache_dir, token=token, allow_patterns=patterns)
    where = cache_dir or constants.HF_HUB_CACHE
    try:
        folder = huggingface_hub.snapshot_download(given, local_files_only=True, **kw)  # no network
    except LocalEntryNotFoundError:
        offline = local_files_only if local_files_only is not None else constants.HF_HUB_OFFLINE
        if offline:
            why = "local_files_only=True" if local_files_only else "HF_HUB_OFFLINE is set"
            raise CheckpointError(
                f"{given}{_at(revision)} is neither a directory here nor in the local Hugging Face cache ({where}), "
                f"and {why}, so nothing is downloaded: fetch it first where there is network (hf download {given} "
                "--include '*.json' '*.safetensors'), or give its directory") from None
        folder = _download(huggingface_hub, given, revision, where, kw)
    return _checked(os.path.join(folder, subfolder) if subfolder else folder, f"{given}{_at(revision)} ({folder})")


def _download(huggingface_hub, repo: str, revision: Optional[str], where: str, kw: dict) -> str:
    """One attempt at fetching ``repo``'s config and safetensors into the cache (huggingface_hub's progress bars);
    any failure is one error naming the id, with how to go on without the network."""
    try:
        return huggingface_hub.snapshot_download(repo, etag_timeout=10, **kw)
    except Exception as err:  # network, auth, missing repo: all end the same way here
        raise CheckpointError(
            f"{repo}{_at(revision)} is neither a directory here nor in the local Hugging Face cache ({where}), and "
            "could not be downloaded "
            f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else 'no message'}). Check the id and "
            "your access (a gated model needs a token: hf auth login), or set HF_HUB_OFFLINE=1 and give a "
            "directory") from None


def _checked(directory: str, named: str) -> str:
    """``directory`` if it holds config.json, else a CheckpointError naming ``named``. A config.json that is
    there but not a regular file (a FIFO, a device) is the reader's to refuse, by what it is."""
    if not os.path.lexists(os.path.join(directory, "config.json")):
        raise CheckpointError(f"{named} has no config.json: it is not a Hugging Face model directory (give the "
                              "directory save_pretrained wrote, or the subfolder= holding the model)")
    return directory


def _looks_like_a_path(text: str) -> bool:
    """A path, not a hub id (``name`` or ``org/name``): absolute, relative with a dot, home, or deeper than two."""
    return (os.path.isabs(text) or text.startswith(("./", "../", "~", ".")) or text.count("/") > 1
            or os.sep != "/" and os.sep in text)


def _at(revision: Optional[str]) -> str:
    return f" (revision {revision})" if revision else ""
