"""Files that are not regular files where a checkpoint, a shard or a config should be: a FIFO (whose open
waits for a writer for ever) or a link to /dev/zero (which reads for ever) is refused by name, at once, by
every reader; nothing hangs and no memory runs out."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import warnings

import pytest
import torch
from helpers import saved_checkpoint

from offload import OffloadedAdamW
from offload import checkpoint as ckpt
from offload.checkpoint.format import DEFAULT_STORAGE, read_checked
from offload.checkpoint.manifest import read
from offload.config import files as config_files
from offload.config import load_config
from offload.errors import CheckpointError, ConfigError
from offload.regular import FileTooLargeError, NotRegularFileError, read_regular
from offload.tools.ckpt_cli import main as ckpt_main

KINDS = ["fifo", "dev-zero"]
_DEADLINE_S = 20


@contextlib.contextmanager
def deadline(seconds: float = _DEADLINE_S):
    """Fail (instead of hanging the run) when the block takes longer than ``seconds``: a blocking open of a
    FIFO is interrupted by the alarm."""

    class HungError(Exception):
        pass

    def ring(signum, frame):
        raise HungError(f"still running after {seconds} s: it hangs")

    old = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def plant(path, kind: str) -> None:
    """Replace ``path`` with a FIFO or a symbolic link to /dev/zero."""
    path = os.fspath(path)
    if os.path.lexists(path):
        os.unlink(path)
    if kind == "fifo":
        os.mkfifo(path, 0o600)
    else:
        os.symlink("/dev/zero", path)


@pytest.mark.parametrize("kind", KINDS)
def test_read_regular_refuses_special_files_and_files_over_their_bound(tmp_path, kind):
    """The one reader of small files refuses a FIFO or a device by what it is, without blocking or reading,
    and a regular file larger than the bound given before reading it."""
    special = tmp_path / "x"
    plant(special, kind)
    with deadline(), pytest.raises(NotRegularFileError, match="FIFO|character device"):
        read_regular(special, limit=1 << 20)
    big = tmp_path / "big"
    big.write_bytes(b"x" * 4097)
    with pytest.raises(FileTooLargeError, match="4097 bytes, more than the 4096"):
        read_regular(big, limit=4096)
    assert read_regular(big, limit=4097) == b"x" * 4097


@pytest.mark.parametrize("kind", KINDS)
def test_a_manifest_that_is_a_fifo_or_dev_zero_is_refused_by_every_reader_without_hanging(tmp_path, kind, capsys):
    """With manifest.json a FIFO or a link to /dev/zero: load_checkpoint, verify, inspect, offload-ckpt verify
    and list, Retention.latest and a save over the directory each answer at once (an error naming the file,
    or no checkpoint there) instead of hanging or reading until memory runs out."""
    root = tmp_path / "root"
    root.mkdir()
    path = saved_checkpoint(root, "step-0000000001")
    manifest = path / "manifest.json"
    plant(manifest, kind)
    opt = OffloadedAdamW([torch.nn.Parameter(torch.zeros(10))], nvme_path=tmp_path / "swap")
    try:
        with deadline():
            for call in (lambda: ckpt.load_checkpoint(opt, path), lambda: ckpt.verify_checkpoint(path),
                         lambda: ckpt.inspect_checkpoint(path)):
                with pytest.raises(CheckpointError, match=r"manifest.json is (a FIFO|a character device)"):
                    call()
            assert ckpt_main(["verify", str(path)]) == 1
            out = capsys.readouterr()
            assert "manifest.json is" in out.out + out.err
            assert ckpt_main(["list", str(root)]) == 0
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                assert ckpt.Retention(root, keep_last=2).latest() is None
            with pytest.raises(FileExistsError):
                ckpt.save_checkpoint(opt, path)
    finally:
        opt.close()
    assert os.path.lexists(manifest)  # refused, not replaced


@pytest.mark.parametrize("kind", KINDS)
def test_a_small_checkpoint_file_that_is_a_fifo_or_dev_zero_is_refused_by_name(tmp_path, kind):
    """memory.pt (or a mirror's data file) replaced by a FIFO or a link to /dev/zero: the load and the mirror
    raise a CheckpointError naming it, before reading anything from it."""
    path = saved_checkpoint(tmp_path)
    manifest = read(os.fspath(path))
    memory = manifest.path("memory.pt")
    plant(memory, kind)
    opt = OffloadedAdamW([torch.nn.Parameter(torch.zeros(n)) for n in (10, 100, 5000, 70_000, 300_001)],
                         nvme_path=tmp_path / "swap", buffer_size=256 * 1024, buffer_count=3, small_param_threshold=64)
    try:
        refused = r"memory\.[0-9a-f]+\.pt\)? is (a symbolic link|not a regular|a FIFO)"
        with deadline(), pytest.raises(CheckpointError, match=refused):
            ckpt.load_checkpoint(opt, path)
    finally:
        opt.close()
    # Swapped after its manifest was checked: the read itself refuses it.
    with deadline(), pytest.raises(CheckpointError, match="is (a FIFO|a character device)"):
        read_checked(memory, manifest.files["memory.pt"])
    # The mirror's copy of a file swapped after its manifest was checked: refused as it is opened.
    with deadline(), pytest.raises(CheckpointError, match="is (a FIFO|a symbolic link)"):
        DEFAULT_STORAGE.copy_file(memory, str(tmp_path / "copy"), _NoBar())
    assert not os.path.exists(tmp_path / "copy")


class _NoBar:
    def update(self, n):
        pass


@pytest.mark.parametrize("kind", KINDS)
def test_a_config_file_that_is_a_fifo_or_dev_zero_is_a_config_error(tmp_path, kind, monkeypatch):
    """A configuration file that is a FIFO no process writes to, or a link to /dev/zero, is a ConfigError naming
    it, not a hang or an endless read (a pipe is waited on only while its writer may still come)."""
    monkeypatch.setattr(config_files, "PIPE_QUIET_S", 0.5)
    path = tmp_path / "ds_config.json"
    plant(path, kind)
    with deadline(), pytest.raises(ConfigError, match=r"ds_config.json is (a FIFO \(named pipe\) that no process "
                                   r"wrote to or closed within 0.5 s|a character device)"):
        load_config(str(path))


def _writer(path, data: bytes):
    """A thread that opens ``path`` for writing (waiting for a reader, as a shell's writer does), writes
    ``data`` and closes it."""
    def run():
        with open(path, "wb") as f:
            f.write(data)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_config_given_through_a_pipe_is_read(tmp_path):
    """``--config <(jq ... ds_config.json)``: a named pipe with a writer, or /dev/fd/N of a pipe, is read to its
    end like the file it carries."""
    text = json.dumps({"aio": {"block_size": 262144}, "zero_optimization": {"offload_optimizer": {
        "device": "nvme", "nvme_path": str(tmp_path)}}}).encode()
    (tmp_path / "ds_config.json").write_bytes(text)
    want = load_config(str(tmp_path / "ds_config.json"))
    fifo = tmp_path / "named"
    os.mkfifo(fifo, 0o600)
    with deadline():
        writer = _writer(fifo, text)
        assert load_config(str(fifo)) == want
        writer.join()
        r, w = os.pipe()
        try:
            os.write(w, text)
            os.close(w)
            w = -1
            assert load_config(f"/dev/fd/{r}") == want
        finally:
            os.close(r)
            if w >= 0:
                os.close(w)


def test_a_config_pipe_that_gives_too_much_is_refused(tmp_path, monkeypatch):
    """A pipe is read only up to a configuration's bound; past it the read stops and the config is refused."""
    monkeypatch.setattr(config_files, "CONFIG_LIMIT", 1000)
    fifo = tmp_path / "named"
    os.mkfifo(fifo, 0o600)
    with deadline():
        writer = _writer(fifo, b" " * 5000 + b"{}")
        with pytest.raises(ConfigError, match="named is a pipe that gave more than the 1000 bytes"):
            load_config(str(fifo))
        os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))  # ends the writer's wait, if it still waits
        writer.join(5)


def test_a_hugging_face_config_json_through_a_pipe_is_still_refused(tmp_path):
    """Files found inside a directory (a Hugging Face config.json) are regular files or refused, writer or not."""
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo, 0o600)
    with deadline():
        writer = _writer(fifo, b"{}")
        with pytest.raises(ConfigError, match="config.json is a FIFO"):
            config_files.read_config_bytes(str(fifo))
        os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
        writer.join(5)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("what", ["index", "shard", "single"])
def test_a_safetensors_file_that_is_a_fifo_or_dev_zero_is_refused(tmp_path, kind, what):
    """A Hugging Face checkpoint whose index, a shard, or its one model.safetensors is a FIFO or a link to
    /dev/zero: opening it raises a CheckpointError naming the file, without hanging."""
    from safetensors.torch import save_file

    from offload.pretrained import SafetensorsCheckpoint

    d = tmp_path / "hf"
    d.mkdir()
    if what == "single":
        save_file({"w": torch.ones(4)}, str(d / "model.safetensors"))
        plant(d / "model.safetensors", kind)
    else:
        save_file({"w": torch.ones(4)}, str(d / "model-00001-of-00001.safetensors"))
        (d / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {"w": "model-00001-of-00001.safetensors"}}))
        plant(d / ("model.safetensors.index.json" if what == "index" else "model-00001-of-00001.safetensors"), kind)
    with deadline(), pytest.raises(CheckpointError, match="is (a FIFO|a character device)"):
        SafetensorsCheckpoint(d)


@pytest.mark.parametrize("kind", KINDS)
def test_an_import_source_that_is_a_fifo_or_dev_zero_is_refused(tmp_path, kind):
    """import_state_dict (offload-ckpt import) given a FIFO or a link to /dev/zero as its torch.save file refuses
    it by name instead of waiting or reading for ever, and writes no checkpoint."""
    src = tmp_path / "adam.pt"
    plant(src, kind)
    with deadline(), pytest.raises(CheckpointError, match="adam.pt is (a FIFO|a character device)"):
        ckpt.import_state_dict(src, tmp_path / "ckpt")
    assert not os.path.exists(tmp_path / "ckpt")


@pytest.mark.parametrize("kind", KINDS)
def test_a_hugging_face_config_that_is_a_fifo_or_dev_zero_is_refused(tmp_path, kind, capsys):
    """from_pretrained, and offload-ckpt export --hf --config, with a config.json that is a FIFO or a link to
    /dev/zero: an error naming it, before transformers opens it (which would hang or read for ever)."""
    pytest.importorskip("transformers")
    from offload.integrations.transformers import from_pretrained

    d = tmp_path / "hf"
    d.mkdir()
    plant(d / "config.json", kind)
    with deadline(), pytest.raises(CheckpointError, match="config.json is (a FIFO|a character device)"):
        from_pretrained(d, nvme_path=tmp_path / "swap")
    path = saved_checkpoint(tmp_path)
    with deadline():
        assert ckpt_main(["export", str(path), "--hf", str(tmp_path / "out"), "--config", str(d)]) == 2
    assert "config.json is" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "out")
