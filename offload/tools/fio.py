"""Running fio as the reference for the swap space's throughput, and reading its JSON output."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from typing import Sequence

from ..progress import tracked
from ..sizes import GIB

INSTALL_HINT = (
    "fio is not installed (or not on PATH). Install it with your package manager "
    "(apt-get install fio, dnf install fio, pacman -S fio, brew install fio), "
    "or run without --fio to skip the comparison."
)



class FioError(Exception):
    """fio is missing, or failed; the message says why and what to do."""


@dataclass(frozen=True)
class FioResult:
    """One fio measurement of one operation."""

    op: str  # "write" or "read"
    nbytes: int  # bytes moved by all jobs
    seconds: float  # the longest job's runtime
    engine: str

    @property
    def gib_s(self) -> float:
        """Throughput in GiB/s."""
        return self.nbytes / self.seconds / GIB


def find_fio() -> str:
    """Path of the fio executable.

    Raises:
        FioError: fio is not on PATH; the message says how to install it.
    """
    fio = shutil.which("fio")
    if fio is None:
        raise FioError(INSTALL_HINT)
    return fio


def fio_version(fio: str) -> str:
    """What ``fio --version`` prints (``"unknown"`` where it prints nothing)."""
    out = subprocess.run([fio, "--version"], capture_output=True, text=True, check=False)
    return out.stdout.strip() or "unknown"


def pick_engine(fio: str) -> str:
    """``"io_uring"`` if this fio was built with it, else ``"libaio"``."""
    out = subprocess.run([fio, "--enghelp"], capture_output=True, text=True, check=False)
    engines = {line.strip() for line in out.stdout.splitlines()}
    return "io_uring" if "io_uring" in engines else "libaio"


# NOTE: fio runs the same work as the swap space: one job per path (the swap space keeps one queue
# per path), ``numjobs`` = worker threads per path, each job with ``iodepth`` = queue depth on its own
# file in that path, O_DIRECT, io_uring (libaio where fio or the kernel lacks it), and in total the
# same number of bytes. fio's files are preallocated like the swap file (fio's default
# ``fallocate=native``) and kept between runs, as the swap file is. Throughput is the bytes of all
# jobs over the longest job's runtime, i.e. the wall time of the group, as ours is.
class Fio:
    """fio jobs mirroring one swap-space configuration over ``paths``.

    Args:
        paths: directories, one job per directory.
        size: total bytes per operation, split evenly over paths and threads.
        block_size: bytes per request (``bs``).
        queue_depth: requests in flight per job (``iodepth``).
        threads: jobs per path (``numjobs``).
        fio: the executable (default: found on PATH).
    """

    def __init__(self, paths: Sequence[str], size: int, block_size: int, queue_depth: int, threads: int,
                 *, fio: str | None = None):
        self.fio = fio or find_fio()
        self.engine = pick_engine(self.fio)
        self.paths = list(paths)
        self.block_size = block_size
        self.queue_depth = queue_depth
        self.threads = threads
        per_job = size // (len(self.paths) * threads)
        # fio moves whole blocks; round each job down so the total never exceeds --size.
        self.job_size = max(block_size, per_job // block_size * block_size)
        # A name unique to this process, so two benchmarks sharing a directory never share files.
        self._prefix = f"offload-bench-fio-{os.getpid()}"

    def command(self, op: str) -> list[str]:
        """The fio command line of one ``op`` pass (``--rw``: write, read, ...) over every path at once."""
        cmd = [
            self.fio, "--output-format=json", f"--rw={op}", f"--bs={self.block_size}",
            f"--iodepth={self.queue_depth}", f"--numjobs={self.threads}", f"--size={self.job_size}",
            f"--ioengine={self.engine}", "--direct=1",
        ]
        for i, p in enumerate(self.paths):
            # Options after --name apply to that job only; fio separates directories with ':'.
            cmd += [f"--name={self._prefix}-{i}", "--directory=" + p.replace(":", "\\:")]
        return cmd

    def run(self, op: str) -> FioResult:
        """Run one write or read pass over every path at once.

        Raises:
            FioError: fio failed (its error output is in the message).
        """
        try:
            out = subprocess.run(self.command(op), capture_output=True, text=True, check=False)
        except OSError as err:
            raise FioError(f"cannot run {self.fio}: {err}") from err
        if out.returncode != 0 and self.engine == "io_uring" and "io_uring" in (out.stderr + out.stdout):
            # fio knows io_uring but the kernel refuses it (e.g. io_uring_disabled): use libaio.
            self.engine = "libaio"
            return self.run(op)
        if out.returncode != 0:
            detail = (out.stderr.strip() or out.stdout.strip()).splitlines()[-5:]
            raise FioError(f"fio failed with exit code {out.returncode}: " + " | ".join(detail))
        nbytes, seconds = parse_output(out.stdout, op)
        return FioResult(op, nbytes, seconds, self.engine)

    def cleanup(self) -> None:
        """Remove fio's data files."""
        for p in self.paths:
            for f in glob.glob(os.path.join(glob.escape(p), self._prefix + "-*")):
                try:
                    os.unlink(f)
                except FileNotFoundError:
                    pass


def parse_output(text: str, op: str) -> tuple[int, float]:
    """Bytes moved by all jobs and the longest job's runtime (seconds) for ``op``, from fio's JSON.

    fio reports runtimes in whole milliseconds, so passes shorter than a few hundred milliseconds
    give coarse figures.

    Raises:
        FioError: the text is not fio's JSON output, or holds no job for ``op``.
    """
    # fio may print notes before the JSON document.
    start = text.find("{")
    try:
        doc = json.loads(text[start:]) if start >= 0 else None
    except json.JSONDecodeError as err:
        raise FioError(f"cannot read fio's JSON output: {err}") from err
    if not isinstance(doc, dict) or not doc.get("jobs"):
        raise FioError("fio's output has no jobs")
    nbytes, runtime_ms = 0, 0
    for job in doc["jobs"]:
        if job.get("error"):
            raise FioError(f"fio job {job.get('jobname')} failed with error {job['error']}")
        stats = job.get(op) or {}
        nbytes += int(stats.get("io_bytes", 0))
        runtime_ms = max(runtime_ms, int(stats.get("runtime", 0)))
    if nbytes <= 0:
        raise FioError(f"fio moved no bytes for {op}")
    # A pass under a millisecond reads as 0 ms; count it as half a millisecond.
    return nbytes, max(runtime_ms, 0.5) / 1000.0


def write_read_gib_s(paths: Sequence[str], size: int, block_size: int, queue_depth: int, threads: int,
                     ) -> tuple[float | None, float | None]:
    """fio's (write, read) GiB/s on ``paths`` for one pass each, or ``(None, None)`` with the reason
    printed where fio is missing or fails; its files are removed either way."""
    try:
        fio = Fio(paths, max(block_size, size), block_size, queue_depth, threads)
        try:
            rates = [fio.run(op).gib_s for op in tracked(("write", "read"), "fio: write and read")]
            return rates[0], rates[1]
        finally:
            fio.cleanup()
    except FioError as err:
        print(f"fio skipped: {err}")
        return None, None
