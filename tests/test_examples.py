"""Every script in examples/ runs to its end (tiny sizes, CPU) and shows what it claims, leaving no swap file.

The scripts are started together when the first test needs one, each in its own directory, so that
their imports overlap; each test then waits for its own.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
from helpers import REPO, python_env

EXAMPLES = {
    "plain_loop.py": [],
    "hf_trainer.py": ["transformers"],
    "lightning_fit.py": ["lightning"],
    "accelerate_loop.py": ["accelerate"],
    "resume_after_kill.py": [],
}
DONE = "bit for bit the same weights"


def _missing(modules) -> list:
    return [m for m in modules if importlib.util.find_spec(m) is None]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each example's process (started in its own directory, all at once)."""
    procs = {}
    for name, needs in EXAMPLES.items():
        if _missing(needs):
            continue
        where = tmp_path_factory.mktemp(name.removesuffix(".py"))
        procs[name] = (where, subprocess.Popen([sys.executable, os.path.join(REPO, "examples", name), str(where)],
                                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                               env=python_env(), cwd=where))
    yield procs
    for _, proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_every_example_is_run_here():
    """No script in examples/ goes untested."""
    found = {f for f in os.listdir(os.path.join(REPO, "examples")) if f.endswith(".py")}
    assert found == set(EXAMPLES)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_runs_and_resumes_bit_for_bit(runs, name):
    """The example exits 0, says its resumed run ended bit for bit where the uninterrupted one did, and leaves
    no swap file behind."""
    missing = _missing(EXAMPLES[name])
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (pip install 'nvme-offload[integrations]')")
    where, proc = runs[name]
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-4000:]
    assert DONE in out.splitlines()[-1], out[-2000:]
    assert "TB of optimizer state per day" not in out, "a toy example printed the drive-wear figure"
    left = [os.path.join(d, f) for d, _, files in os.walk(where) for f in files if f.endswith(".swap")]
    assert not left, f"swap files left behind: {left}"
    if name == "resume_after_kill.py":
        assert "exit status -9" in out and "2 stale swap file(s) removed" in out
