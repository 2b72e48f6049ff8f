"""offload-report: one line a check (versions, engine, checksums, each path's file system, O_DIRECT and reflink,
locked memory, host memory, CUDA), what to do where something is off, exit 1 only when a check failed."""

from __future__ import annotations

import json
import os

from helpers import REPO, run_python

from offload.config import load_config
from offload.tools.cli import main as bench_main
from offload.tools.doctor import FAIL, checks, main


def test_a_usable_directory_passes_every_check_and_the_json_says_the_same(tmp_path, capsys):
    """A writable directory: every check is printed, none failed (exit 0); the probes leave nothing behind; the
    JSON lists the same checks; offload-bench report is the same command."""
    out = tmp_path / "report.json"
    assert main([str(tmp_path / "swap"), "--json", str(out)]) == 0  # missing: created at the first run
    text = capsys.readouterr().out
    for what in ("versions", "engine", "checksums", f"path {tmp_path / 'swap'}: O_DIRECT", "reflink",
                 "locked memory", "host memory", "CUDA"):
        assert what in text, what
    assert "FAIL" not in text
    doc = json.loads(out.read_text())
    assert [c["what"] for c in doc["checks"]] == [c.what for c in checks(load_config(None), [str(tmp_path / "swap")])]
    assert sorted(os.listdir(tmp_path)) == ["report.json"]
    assert bench_main(["report", str(tmp_path)]) == 0


def test_an_unusable_path_fails_with_what_to_do(tmp_path, capsys):
    """A file, or a directory whose parent is missing, is a FAIL naming what to give instead: exit 1."""
    (tmp_path / "file").write_text("x")
    assert main([str(tmp_path / "file"), str(tmp_path / "no" / "such")]) == 1
    text = capsys.readouterr().out
    assert text.count(FAIL) == 2 and "not a directory" in text and "missing, and so is its parent" in text
    assert "-> give a directory on the NVMe drive" in text


def test_the_command_is_installed_and_runs_in_a_fresh_process(tmp_path):
    """pyproject installs offload-report as this module's main; run as a module in a new process it prints the
    checks and exits 0."""
    with open(os.path.join(REPO, "pyproject.toml"), encoding="utf-8") as f:
        assert 'offload-report = "offload.tools.doctor:main"' in f.read()
    done = run_python("-m", "offload.tools.doctor", str(tmp_path))
    assert done.returncode == 0, done.stderr
    # One line a check, in order, each starting with its status (advice lines start with blanks).
    lines = [ln for ln in done.stdout.splitlines() if not ln.startswith(" ")]
    expected = checks(load_config(None), [str(tmp_path)])
    assert [ln.split(None, 1)[0] for ln in lines] == [c.status for c in expected]
    assert all(c.what in ln for c, ln in zip(expected, lines))
    assert not os.listdir(tmp_path)


def test_the_pools_line_gives_each_pool_s_size_and_how_it_follows_the_model(tmp_path, capsys):
    """One line says both pools' settings (defaults without a config) and that each shrinks with the model; a
    config without offload_param offloads no weights and the memory checks count the optimizer's pool alone; the
    seed's 70B config offloads weights and counts both."""
    assert main([str(tmp_path)]) == 0
    text = capsys.readouterr().out
    pools = next(ln for ln in text.splitlines() if ln.split()[1:2] == ["pools"])
    assert "optimizer 4 x 64.00 MiB = 256.00 MiB at most" in pools
    assert "weights 5 x 1e+08 elements = 953.69 MiB at bf16 at most" in pools and "none when all stay" in pools
    assert "this config offloads no weights" in pools and "the pools take at most 256.00 MiB" in text
    assert main([str(tmp_path), "--config", os.path.join(REPO, "configs", "ds_config_70b.json")]) == 0
    text = capsys.readouterr().out
    assert "offloads no weights" not in text and "the pools take at most 1.18 GiB" in text
