"""What the tools write and read on a user's say: an output (``--json``, ``--emit-config``, an export) replaces
only a regular file or nothing, never follows a link or replaces a device, and is created under a fresh name;
every input of ``offload-bench`` is bounded and a user's mistake is a message, not a traceback."""

from __future__ import annotations

import json
import os
import stat

import pytest
from helpers import saved_checkpoint
from test_special_files import deadline, plant

from offload.commit import replace_file
from offload.tools.ckpt_cli import main as ckpt_main
from offload.tools.cli import main as bench_main


def bench(capsys, *args: str) -> tuple[int, str]:
    """``offload-bench`` in this process: exit code and what it printed on stderr."""
    try:
        code = bench_main(list(args))
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().err


def _targets(tmp_path) -> dict:
    """Outputs that are not regular files, each with what must hold afterwards."""
    victim = tmp_path / "victim.txt"
    victim.write_text("mine\n")
    link = tmp_path / "link.json"
    link.symlink_to(victim)
    fd_link = tmp_path / "stdout.json"
    fd_link.symlink_to("/proc/self/fd/1")
    fifo = tmp_path / "fifo.json"
    plant(fifo, "fifo")
    out = {"a link to a file": link, "a link to /proc/self/fd/1": fd_link, "a FIFO": fifo}
    if os.geteuid() == 0:  # a character device of our own (the null device's numbers), not /dev/null itself
        dev = tmp_path / "null.json"
        os.mknod(dev, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
        out["a character device"] = dev
    return out


def _unchanged(path, tmp_path) -> None:
    assert not stat.S_ISREG(os.lstat(path).st_mode), f"{path} was replaced by a regular file"
    assert (tmp_path / "victim.txt").read_text() == "mine\n"


@pytest.mark.parametrize("option", ["--json", "--emit-config"])
def test_an_output_that_is_a_link_a_fifo_or_a_device_is_refused_and_left_as_it_is(tmp_path, capsys, option):
    """offload-bench plan --json/--emit-config naming a link (to a file, to /proc/self/fd/1), a FIFO or a
    character device exits 2 naming what is there, before planning; the name still leads where it did and
    the file behind a link is untouched."""
    for what, target in _targets(tmp_path).items():
        with deadline():
            code, err = bench(capsys, "plan", "--params", "1M", option, str(target))
        assert code == 2, (what, err)
        assert "is there, and only a regular file (or nothing) is replaced" in err, (what, err)
        _unchanged(target, tmp_path)


def test_an_output_replaces_a_regular_file_and_makes_a_new_one(tmp_path, capsys):
    """A regular file given as the output is replaced whole; a new name is created; nothing else is left
    beside them (the temporary file is renamed, not copied)."""
    old = tmp_path / "plan.json"
    old.write_text("old\n")
    assert bench(capsys, "plan", "--params", "1M", "--json", str(old), "--emit-config",
                 str(tmp_path / "new.json"))[0] == 0
    assert json.loads(old.read_text())["params"] == 1_000_000
    assert "offload_optimizer" in json.loads((tmp_path / "new.json").read_text())
    assert sorted(os.listdir(tmp_path)) == ["new.json", "plan.json"]


def test_a_link_planted_at_the_temporary_name_is_never_followed(tmp_path, monkeypatch):
    """The temporary file an output is written to is created exclusively without following a link: a link
    planted where it will be created (its name predicted) is refused, not written through; the file behind
    it, and the output, stay as they were."""
    import secrets

    victim = tmp_path / "victim.txt"
    victim.write_text("mine\n")
    out = tmp_path / "out.json"
    monkeypatch.setattr(secrets, "token_hex", lambda n=None: "0" * 12)
    (tmp_path / f".out.json.{'0' * 12}.tmp").symlink_to(victim)
    with pytest.raises(FileExistsError):
        replace_file(out, lambda f: f.write(b"{}"))
    assert victim.read_text() == "mine\n" and not out.exists()
    # The old writer's name, PATH.tmp<pid>, is never used either.
    monkeypatch.undo()
    os.symlink(victim, f"{out}.tmp{os.getpid()}")
    replace_file(out, lambda f: f.write(b"{}"))
    assert victim.read_text() == "mine\n" and out.read_text() == "{}"


def test_an_export_onto_a_link_or_a_device_is_refused(tmp_path, capsys):
    """offload-ckpt export (torch.save of the optimizer's or the model's state) onto a link or a device is
    refused; what the link leads to is untouched."""
    path = saved_checkpoint(tmp_path)
    for what, target in _targets(tmp_path).items():
        for args in (["export", str(path), str(target)], ["export", str(path), "--model-out", str(target)]):
            with deadline():
                assert ckpt_main(args) == 1, (what, args)
            assert "only a regular file (or nothing) is replaced" in capsys.readouterr().err
            _unchanged(target, tmp_path)


@pytest.mark.parametrize("args, says", [
    (["--params", "99999999999999999999999999T"], "a plan is for at most 2T parameters"),
    (["--params", "1M", "--sweep", "{fifo}"], "is a FIFO"),
    (["--params", "1M", "--sweep", "{zero}"], "is a character device"),
    (["--params", "1M", "--config", "{fifo}"], "is a FIFO"),
    (["--params", "1M", "--config", "{zero}"], "is a character device"),
    (["--hf-config", "{hf}", "hidden_size=-4"], "hidden_size is -4; it must be a whole number"),
    (["--hf-config", "{hf}", "hidden_size='big'"], "hidden_size is 'big'"),
    (["--hf-config", "{hf}", "hidden_size=1e30"], "hidden_size is 1e+30"),
    (["--hf-config", "{hf}", "num_hidden_layers=2000000000"], "num_hidden_layers is 2000000000"),
    (["--hf-config", "{hf}", "num_attention_heads=3"], "is not a Hugging Face model config"),
    (["--hf-config", "{hf}", "model_type=None"], "no model_type"),
    (["--hf-config", "{zero}"], "is a character device"),
], ids=["huge-params", "sweep-fifo", "sweep-zero", "config-fifo", "config-zero", "negative", "string", "float",
        "huge-layers", "bad-heads", "no-model-type", "hf-zero"])
def test_plan_inputs_are_bounded_and_a_mistake_is_a_message(tmp_path, capsys, monkeypatch, args, says):
    """offload-bench plan with an absurd --params, a FIFO or /dev/zero as --sweep/--config/--hf-config, or a
    Hugging Face config with a negative, fractional, text or huge size answers at once with exit code 2 and a
    message naming the problem: no traceback, no hang, no memory blow-up. (A --config pipe no process writes to
    is refused once it has been quiet for PIPE_QUIET_S, made short here.)"""
    pytest.importorskip("transformers")
    from offload.config import files as config_files

    monkeypatch.setattr(config_files, "PIPE_QUIET_S", 0.5)
    fifo, zero = tmp_path / "fifo.json", tmp_path / "zero.json"
    plant(fifo, "fifo")
    plant(zero, "dev-zero")
    hf = tmp_path / "hf"
    hf.mkdir()
    doc = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 8,
           "num_attention_heads": 1, "vocab_size": 10}
    if "=" in args[-1]:
        key, value = args.pop().split("=")
        doc[key] = eval(value)  # the test's own literals
    (hf / "config.json").write_text(json.dumps(doc))
    argv = [a.format(fifo=fifo, zero=zero, hf=hf) for a in args]
    with deadline(60):
        code, err = bench(capsys, "plan", *argv)
    assert code == 2 and says in err, err
    assert "Traceback" not in err


def test_a_benchmark_asked_for_more_parameters_than_memory_holds_says_so(tmp_path, capsys):
    """offload-bench adam --params 100T (parameters and grads materialised in host memory) stops at once with
    what it would need and what is available, instead of filling the memory."""
    with deadline(60):
        code, err = bench(capsys, "adam", "--params", "100T", "--no-fio", "--no-torch", "--path", str(tmp_path / "s"))
    assert code == 1 and "of host memory" in err and "give a smaller --params" in err, err


def test_a_process_killed_while_it_writes_an_output_leaves_nothing_beside_it(tmp_path):
    """An output being written when its process is killed (SIGKILL: no clean-up runs) leaves the previous file as
    it was and no temporary copy beside it: the file is unnamed (O_TMPFILE) until it is complete."""
    from helpers import run_code

    out = tmp_path / "export.pt"
    out.write_bytes(b"previous")
    code = """
import os, signal, sys
from offload.commit import replace_file

def write(f):
    f.write(b"x" * (1 << 20))
    f.flush()
    os.kill(os.getpid(), signal.SIGKILL)

replace_file(sys.argv[1], write)
"""
    done = run_code(code, str(out))
    assert done.returncode == -9, done.stdout + done.stderr
    assert sorted(os.listdir(tmp_path)) == ["export.pt"] and out.read_bytes() == b"previous"
