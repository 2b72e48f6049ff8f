"""A manifest as a file, before its content is read: where a checkpoint directory's is (a job's shard has
the one its job manifest names), its JSON, and what every manifest carries around its content: its format,
its version and its own checksum (``manifest_xxh3_64``)."""

from __future__ import annotations

import errno as _errno
import json
import os
import re
from typing import Any

import xxhash

from ..errors import CheckpointError, ChecksumError
from .fields import bare_name
from .format import FORMAT, FORMAT_VERSION, JOB_FORMAT, JOB_VERSION, MANIFEST, PIECES_VERSION, io_error

SHARD_NAME = re.compile(r"^rank-(\d{5,})$")


def shard_name(rank: int) -> str:
    """The directory of ``rank``'s shard inside a job's checkpoint."""
    return f"rank-{rank:05d}"


def digest(body: dict) -> str:
    """The xxh3_64 a manifest records of itself: over its JSON without the ``manifest_xxh3_64`` field."""
    body = {k: v for k, v in body.items() if k != "manifest_xxh3_64"}
    return xxhash.xxh3_64(json.dumps(body, sort_keys=True).encode()).hexdigest()


def raw_manifest(directory: str, name: str = MANIFEST) -> Any:
    """The JSON in ``directory/name``, unchecked; None if there is none or it does not parse."""
    try:
        with open(os.path.join(directory, name), "rb") as f:
            return json.loads(f.read())
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError, ValueError):
        return None


def read_json(directory: str) -> tuple[Any, str]:
    """The JSON of checkpoint ``directory``'s manifest, unchecked, and the manifest's path. A job's shard
    has the manifest its job manifest names; anything else ``manifest.json``.

    Raises:
        FileNotFoundError: no such directory.
        CheckpointError: no manifest (no save of ours finished there); ``ChecksumError``: not JSON.
    """
    if not os.path.isdir(directory):
        raise FileNotFoundError(_errno.ENOENT, "no checkpoint directory", directory)
    path = os.path.join(directory, _manifest_name(directory))
    try:
        with open(path, "rb") as f:
            text = f.read()
    except FileNotFoundError:
        raise CheckpointError(f"{directory} is not a complete checkpoint (no {MANIFEST}); a save commits by "
                              f"writing its {MANIFEST} last, so no save of ours finished here") from None
    except OSError as err:
        raise io_error(err, path, "cannot read") from err
    try:
        return json.loads(text), path
    except ValueError as err:
        raise ChecksumError(f"{path} is not valid JSON ({err}); the checkpoint is corrupt") from None


def check_envelope(raw: Any, where: str) -> str:
    """The format of ``raw`` (the JSON read from ``where``), once its format, its version and its own
    checksum are checked; its content is not looked at.

    Raises:
        CheckpointError: not a manifest of ours, or a version this library does not read;
            ``ChecksumError``: its checksum does not hold.
    """
    kind = raw.get("format") if isinstance(raw, dict) else None
    if kind not in (FORMAT, JOB_FORMAT):
        raise CheckpointError(f"{where} is not an nvme-offload checkpoint manifest")
    versions = (JOB_VERSION,) if kind == JOB_FORMAT else (FORMAT_VERSION, PIECES_VERSION)
    if raw.get("version") not in versions:
        raise CheckpointError(f"{where} has format version {raw.get('version')!r}; this library reads version "
                              f"{' or '.join(map(str, versions))}. Load it with the nvme-offload version that saved it "
                              "(a newer one, if its version is higher), or load another checkpoint")
    found = digest(raw)
    if found != raw.get("manifest_xxh3_64"):
        raise ChecksumError(f"{where}: xxh3_64 of its content is {found}, it records "
                            f"{raw.get('manifest_xxh3_64')}; the manifest is corrupt")
    return kind


def _manifest_name(directory: str) -> str:
    """A job's shard (a directory named ``rank-<n>``) has the manifest its job manifest in the directory
    above names (a save writes it under the job's generation); anything else ``manifest.json``. A name that
    is not a bare file name there is ignored."""
    parent, name = os.path.split(directory)
    job = raw_manifest(parent) if SHARD_NAME.match(name) else None
    if isinstance(job, dict) and job.get("format") == JOB_FORMAT and isinstance(job.get("shards"), list):
        for entry in job["shards"]:
            if isinstance(entry, dict) and entry.get("name") == name:
                try:
                    return bare_name(entry.get("manifest", MANIFEST), "manifest")
                except CheckpointError:
                    break
    return MANIFEST
