"""The checks ``make lint`` runs, as tests: ruff (style, naming, docstrings, complexity), the layer contracts of
docs/architecture.md (import-linter) and mypy on the interfaces between layers. In the suite they run beside the
other tests instead of before them."""

from __future__ import annotations

import sys

from helpers import REPO, run_python


def _check(*args: str, timeout: float = 300) -> None:
    done = run_python(*args, cwd=REPO, timeout=timeout)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]


def test_ruff():
    """``ruff check .`` finds nothing (its rules are pyproject.toml's)."""
    _check("-m", "ruff", "check", "--no-cache", ".")


def test_import_contracts():
    """Every layer imports only from those below it (pyproject.toml's import-linter contracts)."""
    _check("-c", "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True))")


def test_mypy(tmp_path):
    """mypy passes on the files pyproject.toml names."""
    _check("-m", "mypy", "--cache-dir", str(tmp_path / "mypy-cache"), "--python-executable", sys.executable)
