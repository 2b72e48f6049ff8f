"""offload-bench compare's DeepSpeed side without DeepSpeed: a stand-in package that only builds "ops". Its ops are
built before the runs with a progress bar, a lock left by a killed build does not block the next, a failed build
leaves DeepSpeed out, and --no-deepspeed leaves it out where it is installed."""

from __future__ import annotations

import os
import textwrap

import pytest
from helpers import run_python

from offload.tools import compare

# A stand-in for deepspeed: its op builders do what torch's cpp_extension does around a build (wait forever while
# the build directory holds a "lock" file; hold one while building), and record that they built.
FAKE_OP_BUILDER = """
import os, time
class _Builder:
    name = "op"
    def load(self):
        d = os.path.join(os.environ["TORCH_EXTENSIONS_DIR"], self.name)
        os.makedirs(d, exist_ok=True)
        while os.path.exists(os.path.join(d, "lock")):
            time.sleep(0.1)  # torch's FileBaton: "Waiting for lock ..."
        while os.environ.get("FAKE_BUILD_HANGS"):
            time.sleep(0.1)
        if os.environ.get("FAKE_BUILD_FAILS"):
            raise RuntimeError("Error building extension 'cpu_adam': ninja: build stopped")
        open(os.path.join(d, "built"), "w").close()
class CPUAdamBuilder(_Builder):
    name = "cpu_adam"
class AsyncIOBuilder(_Builder):
    name = "async_io"
"""


@pytest.fixture
def fake_deepspeed(tmp_path, monkeypatch):
    """A ``deepspeed`` package that imports (version 0.0.fake) on PYTHONPATH, and a cache directory of the test's."""
    root = tmp_path / "site"
    (root / "deepspeed" / "ops" / "op_builder").mkdir(parents=True)
    (root / "deepspeed" / "__init__.py").write_text('__version__ = "0.0.fake"\n')
    (root / "deepspeed" / "ops" / "__init__.py").write_text("")
    (root / "deepspeed" / "ops" / "op_builder" / "__init__.py").write_text(textwrap.dedent(FAKE_OP_BUILDER))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "nvme-offload" / "torch_extensions"


def test_the_ops_build_once_with_a_bar_and_a_lock_left_by_a_killed_build_is_removed(fake_deepspeed, capsys,
                                                                                   monkeypatch):
    """A build killed half way leaves torch's "lock" file, on which the next build would wait forever: holding
    our own lock on the build directory, compare removes it (saying so), builds both ops with a progress bar,
    and their runs find them there."""
    import sys

    monkeypatch.setenv("OFFLOAD_PROGRESS", "1")
    (fake_deepspeed / "cpu_adam").mkdir(parents=True)
    (fake_deepspeed / "cpu_adam" / "lock").write_text("")
    assert compare.build_ops(sys.executable, timeout=60) is None
    out, err = capsys.readouterr()
    assert f"removed {fake_deepspeed / 'cpu_adam' / 'lock'}, left by a build" in out
    assert "building DeepSpeed's ops" in err
    assert (fake_deepspeed / "cpu_adam" / "built").exists() and (fake_deepspeed / "async_io" / "built").exists()
    assert compare._peer_env()["TORCH_EXTENSIONS_DIR"] == str(fake_deepspeed)


def test_a_build_that_fails_is_reported_in_a_line_and_a_stuck_one_times_out(fake_deepspeed, monkeypatch):
    """A build that fails gives the end of its error; one that cannot finish is stopped at the timeout."""
    import sys

    monkeypatch.setenv("FAKE_BUILD_FAILS", "1")
    assert "ninja: build stopped" in compare.build_ops(sys.executable, timeout=60)
    monkeypatch.delenv("FAKE_BUILD_FAILS")
    monkeypatch.setenv("FAKE_BUILD_HANGS", "1")
    with pytest.raises(compare.BenchError, match="more than 2 s"):
        compare.build_ops(sys.executable, timeout=2)


def test_no_deepspeed_leaves_an_installed_deepspeed_out(fake_deepspeed, tmp_path):
    """With DeepSpeed importable, --no-deepspeed builds nothing and runs ours alone, saying why."""
    done = run_python("-m", "offload.tools", "compare", "--params", "1M", "--rounds", "1", "--iterations", "3",
                      "--no-extras", "--no-deepspeed", "--path", str(tmp_path / "nvme"), timeout=300,
                      env={"PYTHONPATH": os.environ["PYTHONPATH"], "XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr
    assert "DeepSpeed: left out (--no-deepspeed)" in done.stdout
    assert not fake_deepspeed.exists()  # no build was even started
    assert not any(line.startswith("deepspeed") for line in done.stdout.splitlines())  # no row of its own
