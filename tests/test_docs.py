"""Every code block of README.md and docs/*.md works, as tests/test_examples.py holds the examples to it: a snippet
that stops working fails here.

Python blocks run for real (tests/docs_blocks.py: tiny models on the CPU, the names a page leaves to the reader
given, paths moved to a scratch directory; torchrun scripts as two gloo ranks; the SIGTERM script stopped by
SIGTERM and resumed). Shell blocks are commands of ours, run through the command line's own parser (every
subcommand and option must exist and take its value: a renamed flag fails), or make targets, scripts and programs
that must exist; their heredoc Python compiles. Every block is labelled python, sh or text (diagrams and output).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest
from docs_blocks import LANGUAGES, REPO, blocks
from helpers import python_env

BLOCKS = blocks()
PYTHON = [b for b in BLOCKS if b.language == "python"]
SHELL = [b for b in BLOCKS if b.language == "sh"]
# Programs a shell block may name besides ours: checked to be programs, not run.
PROGRAMS = {"torchrun", "pip", "hf", "huggingface-cli", "apt-get", "fio", "sh", "bash"}


@pytest.fixture(scope="module")
def python_results(tmp_path_factory):
    """Each Python block's result, from one run of them all in a process of its own."""
    where = tmp_path_factory.mktemp("docs")
    out = where / "results.jsonl"
    scratch = where / "scratch"
    scratch.mkdir()
    done = subprocess.run([sys.executable, os.path.join(REPO, "tests", "docs_blocks.py"), str(scratch), str(out)],
                          capture_output=True, text=True, env=python_env(), cwd=scratch, timeout=900)
    assert out.exists(), done.stderr[-4000:]
    results = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    left = [os.path.join(d, f) for d, _, files in os.walk(scratch) for f in files if f.endswith(".swap")]
    return results, left


def test_every_block_is_labelled_and_none_hides_a_command():
    """Every fenced block says python, sh or text, and a text block does not start with a command of ours (it
    would escape its check)."""
    for b in BLOCKS:
        assert b.language in LANGUAGES, f"{b.id}: label the block ```python, ```sh or ```text"
        if b.language == "text":
            first = b.code.strip().split()[0] if b.code.strip() else ""
            assert not first.startswith(("offload-", "python", "make")), f"{b.id}: a command: label it ```sh"
    assert len(PYTHON) >= 20 and len(SHELL) >= 8


@pytest.mark.parametrize("block", PYTHON, ids=[b.id for b in PYTHON])
def test_the_python_block_runs(python_results, block):
    """The block runs to its end (with its page's prelude)."""
    results, _ = python_results
    result = results.get(block.id)
    assert result is not None, f"{block.id} was not run"
    assert result["ok"], f"{block.id} failed:\n{result['error']}"


def test_no_block_leaves_a_swap_file(python_results):
    """Once every block has run and closed what it opened, no swap file is left (one that fails may leave its)."""
    _, left = python_results
    assert not left, f"swap files left behind: {left}"


@pytest.mark.parametrize("block", SHELL, ids=[b.id for b in SHELL])
def test_the_shell_block_s_commands_parse(block, capsys):
    """Each command of the block exists and its arguments parse with the command line's own parser."""
    for argv in commands(block.code):
        check(argv, block.id)
        capsys.readouterr()


def commands(code: str) -> list[list[str]]:
    """The block's commands as argument lists: continuation lines joined, comments dropped, a heredoc's body
    compiled as Python (and left out), ``sh -c '...'`` opened up."""
    out, lines, heredoc = [], iter(code.splitlines()), None
    for line in lines:
        while line.endswith("\\"):
            line = line[:-1] + " " + next(lines)
        if "<<" in line:
            heredoc = line.split("<<")[1].strip().strip("'\"")
            body = []
            for inner in lines:
                if inner.strip() == heredoc:
                    break
                body.append(inner)
            compile("\n".join(body), "<heredoc>", "exec")
            line = line.split("<<")[0]
        argv = shlex.split(line, comments=True)
        while argv and "=" in argv[0] and not argv[0].startswith("-"):  # VAR=value before a command
            argv = argv[1:]
        if argv:
            out.append(argv)
    return out


def check(argv: list[str], where: str) -> None:
    """One command: ours through its parser, make targets in the Makefile, scripts in the repository."""
    argv = [a.strip("[]") for a in argv if a not in ("[", "]", "...")]  # [--bf16 --params-nvme]: optional parts
    name, args = argv[0], argv[1:]
    if name == "python" and args[:2] == ["-m", "offload.tools"]:
        name, args = "offload-bench", args[2:]
    elif name == "python" and args[:1] == ["-"]:
        return  # its heredoc compiled above
    if name in ("offload-bench", "offload-ckpt", "offload-swap", "offload-report"):
        parse(name, args, where)
    elif name == "make":
        with open(os.path.join(REPO, "Makefile")) as f:
            targets = {line.split(":")[0] for line in f if ":" in line and not line.startswith(("\t", "#"))}
        assert set(args) <= targets, f"{where}: make {args}: not a target of the Makefile"
    elif name.startswith("scripts/"):
        assert os.access(os.path.join(REPO, name), os.X_OK), f"{where}: {name} is not an executable script here"
    elif name == "torchrun":
        inner = args[args.index("-c") + 1] if "-c" in args else None
        for sub in commands(inner or ""):
            check(sub, where)
    else:
        assert name in PROGRAMS, f"{where}: {name}: not a command of ours nor a known program"


def parse(name: str, args: list[str], where: str) -> None:
    from offload.tools.ckpt_cli import build_parser as ckpt
    from offload.tools.cli import build_parser as bench
    from offload.tools.doctor import main as report
    from offload.tools.swap_cli import build_parser as swap

    if name == "offload-report":
        return  # its only arguments are paths and a config file: read, not parsed
    parser = {"offload-bench": bench, "offload-ckpt": ckpt, "offload-swap": swap}[name]()
    try:
        parser.parse_args(args)
    except SystemExit as exit_:
        pytest.fail(f"{where}: {name} {' '.join(args)}: its parser refuses it (exit {exit_.code})")
    assert report is not None
