"""Atomic checkpoint commits: recovery of a checkpoint left aside never races a save in progress."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

from helpers import HOLD

from offload.checkpoint.commit import recover_for_reading
from offload.checkpoint.format import FORMAT, MANIFEST, _manifest_digest


def fake_checkpoint(path) -> None:
    """Make ``path`` a directory holding an empty but complete checkpoint of ours (a valid manifest)."""
    path.mkdir()
    manifest = {"format": FORMAT, "version": 1, "files": {}}
    manifest["manifest_xxh3_64"] = _manifest_digest(manifest)
    (path / MANIFEST).write_text(json.dumps(manifest))


def test_recovery_waits_for_a_save_holding_the_parent_lock(tmp_path):
    """A reader finding the checkpoint missing and an `.old-` sibling does not rename it back while
    another process holds the parent's lock (a save between its two renames); it does once released."""
    ckpt = tmp_path / "ckpt"
    aside = tmp_path / "ckpt.old-0123abcd"
    fake_checkpoint(aside)
    saver = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert saver.stdout.readline().strip() == "locked"
        reader = threading.Thread(target=recover_for_reading, args=(str(ckpt),), daemon=True)
        reader.start()
        reader.join(0.5)
        assert reader.is_alive() and not ckpt.exists() and aside.exists()
        saver.stdin.write("\n")
        saver.stdin.flush()
        reader.join(10)
        assert not reader.is_alive()
        assert (ckpt / MANIFEST).exists() and not aside.exists()
    finally:
        saver.kill()
        saver.wait()


def test_recovery_leaves_an_existing_checkpoint_alone(tmp_path):
    """With the checkpoint present, a stray `.old-` sibling is not touched (and no lock is taken)."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    aside = tmp_path / "ckpt.old-0123abcd"
    fake_checkpoint(aside)
    recover_for_reading(str(ckpt))
    assert aside.exists() and not os.listdir(ckpt)
