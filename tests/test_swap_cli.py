"""``offload-swap``: lists and removes swap files whose owner is gone, and never one a live process holds."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers import python_env

from offload.tools.swap_cli import EXIT_FAILURE, EXIT_OK, main

# ``python -c HOLD DIR NAME``: creates a swap space named NAME in DIR, prints "ready", then waits for a line
# on stdin; on "use" it writes and reads back its swap space and prints "ok", then exits cleanly.
HOLD = """
import sys
import torch
from offload.buffers import BufferPool
from offload.space import SwapSpace
pool = BufferPool(1, 1 << 20)
space = SwapSpace(sys.argv[1], 1 << 20, buffers=pool, name=sys.argv[2])
extent = space.alloc(1 << 20)
print("ready", flush=True)
if sys.stdin.readline().strip() == "use":
    pool[0].tensor.fill_(7)
    space.write(extent, pool[0]).wait()
    pool[0].tensor.zero_()
    space.read(extent, pool[0]).wait()
    print("ok" if bool((pool[0].tensor == 7).all()) else "corrupt", flush=True)
space.close()
pool.close()
"""
# ``python -c DIE DIR NAME [DIR NAME]...``: creates a swap space in each DIR, named NAME, and dies without any
# clean-up (their files stay, unlocked).
DIE = """
import os, sys
from offload.space import SwapSpace
spaces = [SwapSpace(d, 1 << 20, name=n) for d, n in zip(sys.argv[1::2], sys.argv[2::2])]
os._exit(0)
"""


@pytest.fixture(scope="module")
def swap_dirs(tmp_path_factory):
    """A directory with a live run's swap file ("live", held by a child process until the module's tests are
    done) and a dead run's ("dead"), and a subdirectory with another dead run's ("deeper"). The tests below
    run in order: those that only look come before the one that cleans."""
    root = tmp_path_factory.mktemp("swap")
    top, below = root / "nvme", root / "nvme" / "rank1"
    below.mkdir(parents=True)
    live = subprocess.Popen([sys.executable, "-c", HOLD, str(top), "live"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=python_env())
    dead = [subprocess.Popen([sys.executable, "-c", DIE, str(top), "dead", str(below), "deeper"], env=python_env())]
    try:
        assert live.stdout.readline().strip() == "ready"
        assert all(p.wait(timeout=120) == 0 for p in dead)
        yield top, below, live
    finally:
        if live.poll() is None:
            live.kill()
            live.wait()
        for d in (top, below):
            for f in os.listdir(d):
                if f.endswith(".swap"):
                    os.unlink(d / f)


def _swap_files(directory) -> dict:
    return {f.split("-")[2]: os.path.join(directory, f) for f in os.listdir(directory) if f.endswith(".swap")}


def test_list_names_only_files_whose_owner_is_gone(swap_dirs, capsys):
    """``list`` prints the dead run's file with its size, never the live run's, and changes nothing; the
    directories below a path are looked at with ``-r`` only."""
    top, below, live = swap_dirs
    assert main(["list", str(top)]) == EXIT_OK
    out = capsys.readouterr().out
    files, deeper = _swap_files(top), _swap_files(below)["deeper"]
    assert files["dead"] in out and files["live"] not in out and deeper not in out
    assert "1 stale swap file(s) holding 1.00 MiB" in out
    assert main(["list", "-r", str(top)]) == EXIT_OK
    out = capsys.readouterr().out
    assert files["dead"] in out and deeper in out and files["live"] not in out
    assert set(_swap_files(top)) == {"dead", "live"} and set(_swap_files(below)) == {"deeper"}


def test_clean_removes_dead_runs_files_and_the_live_run_goes_on(swap_dirs, capsys):
    """``clean -r`` removes the dead runs' files; the live run's stays, and the live run still writes and
    reads it, then removes it itself when it closes."""
    top, below, live = swap_dirs
    assert main(["clean", "-r", str(top)]) == EXIT_OK
    # Two 1 MiB swap files, each with its 4 KiB guard block.
    assert "2 stale swap file(s) removed, freeing 2.01 MiB" in capsys.readouterr().out
    assert set(_swap_files(top)) == {"live"} and _swap_files(below) == {}
    live.stdin.write("use\n")
    live.stdin.flush()
    assert live.stdout.readline().strip() == "ok"
    assert live.wait(timeout=60) == 0
    assert _swap_files(top) == {}


def test_a_missing_path_fails_before_anything_is_listed_or_counted(tmp_path, capsys):
    """A missing path (or a file) is an error with exit code 1, named on stderr with what to give instead; nothing
    is listed or removed and no count of stale files follows, which would read as if it had been searched."""
    (tmp_path / "a-file").write_text("x")
    for command in ("list", "clean"):
        assert main([command, str(tmp_path / "missing"), str(tmp_path)]) == EXIT_FAILURE
        out, err = capsys.readouterr()
        assert "missing does not exist; give the swap directory" in err
        assert out == ""
    assert main(["list", str(tmp_path / "a-file")]) == EXIT_FAILURE
    out, err = capsys.readouterr()
    assert "a-file is not a directory" in err and out == ""


def test_a_command_is_required(capsys):
    """Without ``list`` or ``clean`` the usage is printed, with exit code 2."""
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2 and "required: COMMAND" in capsys.readouterr().err


def test_files_not_provably_ours_are_named_and_left_alone(tmp_path, capsys):
    """A file named like a swap file of a dead run but without our seal (made before swap files were sealed,
    changed since, or a user's) is listed apart by list and clean, with what to do, and never removed."""
    import socket

    name = tmp_path / f"nvme-offload-swap-{socket.gethostname()}-{_dead_pid()}-0123abcd.swap"
    name.write_bytes(b"\0" * 8192)
    for command in ("list", "clean"):
        assert main([command, str(tmp_path)]) == EXIT_OK
        out = capsys.readouterr().out
        assert "0 stale swap file(s)" in out and "not provably ours" in out and str(name) in out
    assert name.exists()


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid
