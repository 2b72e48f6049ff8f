"""What ``offload-bench`` shows: the header, tables, the JSON file and the plots (progress: ``offload.progress``)."""

from __future__ import annotations

import json
import os
import platform
import socket
import sys
from typing import Any, Optional, Sequence, TextIO

from .._proc import status_bytes
from ..commit import replace_file
from ..sizes import GIB, format_size
from .cli import BenchError, short_size

PLOT_INSTALL_HINT = (
    "--plot needs matplotlib, which is not installed: pip install 'nvme-offload[plot]' "
    "(or pip install matplotlib)"
)


# -- the machine -------------------------------------------------------------------------------


def _unescape_mount(field: str) -> str:
    # /proc/mounts writes space, tab, newline and backslash as octal escapes (\040 ...).
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def file_system(path: str, mounts: str = "/proc/mounts") -> dict[str, str]:
    """The mount holding ``path``: ``{"type", "device", "mount_point"}`` (``"unknown"`` where unreadable)."""
    real = os.path.realpath(path)
    best = {"type": "unknown", "device": "unknown", "mount_point": "unknown"}
    best_len = -1
    try:
        with open(mounts, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return best
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        device, point, fstype = _unescape_mount(parts[0]), _unescape_mount(parts[1]), parts[2]
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        # The longest matching mount point wins; a later line for the same point shadows an earlier one.
        if inside and len(point) >= best_len:
            best = {"type": fstype, "device": device, "mount_point": point}
            best_len = len(point)
    return best


def machine_info(paths: Sequence[str]) -> dict[str, Any]:
    """Hostname, CPUs, memory, kernel, versions and the file system of each path."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        memory = None
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:  # pragma: no cover - torch is a dependency
        torch_version = None
    from .._version import __version__

    return {
        "hostname": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "memory_bytes": memory,
        "kernel": platform.release(),
        "system": platform.platform(),
        "python": platform.python_version(),
        "torch": torch_version,
        "nvme_offload": __version__,
        "file_systems": {p: file_system(p) for p in paths},
    }


def memory_bytes(key: str) -> int:
    """A memory figure of this process in bytes (``VmRSS``, ``VmHWM``: see :func:`offload._proc.status_bytes`).

    Raises:
        BenchError: the kernel does not report it (memory cannot be measured here).
    """
    try:
        return status_bytes(key)
    except LookupError as err:
        raise BenchError(f"{err}; peak memory cannot be measured here") from None


def print_header(title: str, machine: dict[str, Any], params: Sequence[tuple[str, str]],
                 out: Optional[TextIO] = None) -> None:
    """The machine and every parameter of the run, one per line, to ``out`` (default: sys.stdout as it is
    at the call, not at import: a caller may have replaced it since)."""
    out = out if out is not None else sys.stdout
    mem = format_size(machine["memory_bytes"]) if machine.get("memory_bytes") else "unknown"
    print(f"offload-bench {title}", file=out)
    print(f"  machine      {machine['hostname']}, {machine['cpu_count']} CPUs, {mem} RAM", file=out)
    print(f"  kernel       {machine['kernel']}", file=out)
    print(f"  versions     nvme-offload {machine['nvme_offload']}, torch {machine['torch']}, "
          f"python {machine['python']}", file=out)
    for p, fs in machine["file_systems"].items():
        where = f"{fs['type']} on {fs['device']}, mounted at {fs['mount_point']}"
        print(f"  path         {p} ({where})", file=out)
    for name, value in params:
        print(f"  {name:<12} {value}", file=out)
    print(file=out, flush=True)


# -- tables ------------------------------------------------------------------------------------


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain text table: the first column left-aligned, the others right-aligned."""
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(str(h))
              for i, h in enumerate(headers)]

    def line(cells):
        return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


def drive_writes(bytes_per_step: int, step_s: float) -> tuple[float, str]:
    """Bytes written per day of training at ``bytes_per_step`` every ``step_s`` seconds, and as text (TB/day),
    which SSDs' endurance ratings (TB written, drive writes per day) are stated in."""
    per_day = bytes_per_step * 86400 / step_s if step_s > 0 else 0.0
    return per_day, f"{per_day / 1e12:.1f} TB/day"


def disk_bound(read: int, written: int, fio_read: float | None, fio_write: float | None) -> float | None:
    """Seconds the drive needs for ``read`` and ``written`` bytes at fio's GiB/s (None without fio's figures):
    the lower bound every benchmark reads its time against."""
    if not (fio_read and fio_write):
        return None
    return read / GIB / fio_read + written / GIB / fio_write


def fmt_gib(x: float | None) -> str:
    """GiB/s with three decimals, or ``-``."""
    return "-" if x is None else f"{x:.3f}"


def fmt_ratio(x: float | None) -> str:
    """A ratio with three decimals and an ``x``, or ``-``."""
    return "-" if x is None else f"{x:.3f}x"


# -- files -----------------------------------------------------------------------------------------


def write_json(path: str, doc: dict[str, Any]) -> None:
    """Write ``doc`` atomically in place of ``path``, a regular file or nothing (see
    :func:`offload.commit.replace_file`: a device or a link given as the output is refused, never replaced)."""
    text = (json.dumps(doc, indent=2) + "\n").encode()
    replace_file(path, lambda f: f.write(text), private=False)


def require_matplotlib() -> None:
    """Raise :class:`BenchError` with install instructions if matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise BenchError(PLOT_INSTALL_HINT) from None


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: never needs a display
    import matplotlib.pyplot as plt

    return plt


def plot_io(path: str, results: Sequence[dict[str, Any]], title: str) -> None:
    """Bars of ours and fio per run, one panel per operation, a line at each median."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4), sharey=True, squeeze=False)
    for ax, r in zip(axes[0], results):
        runs = r["gib_s_runs"]
        fio_runs = r.get("fio_gib_s_runs") or []
        xs = range(len(runs))
        w = 0.38 if fio_runs else 0.6
        ax.bar([x - (w / 2 if fio_runs else 0) for x in xs], runs, width=w, label="nvme-offload", color="C0")
        ax.axhline(r["gib_s"], color="C0", linestyle="--", linewidth=1)
        if fio_runs:
            ax.bar([x + w / 2 for x in range(len(fio_runs))], fio_runs, width=w, label="fio", color="C1")
            ax.axhline(r["fio_gib_s"], color="C1", linestyle="--", linewidth=1)
        sub = f"{r['op']}: median {r['gib_s']:.2f} GiB/s"
        if r.get("ratio_to_fio") is not None:
            sub += f", {r['ratio_to_fio']:.3f}x fio"
        ax.set_title(sub)
        ax.set_xticks(list(xs))
        ax.set_xticklabels([f"run {i + 1}" for i in xs])
        ax.set_ylabel("GiB/s")
        ax.legend(loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(path: str, results: Sequence[dict[str, Any]], title: str) -> None:
    """Throughput against block size, one line per (queue depth, threads), write and read panels."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    series = sorted({(r["queue_depth"], r["threads"]) for r in results})
    block_sizes = sorted({r["block_size"] for r in results})
    for ax, op in zip(axes, ("write", "read")):
        for k, (qd, th) in enumerate(series):
            pts = sorted((r["block_size"], r["gib_s"], r.get("fio_gib_s")) for r in results
                         if r["op"] == op and r["queue_depth"] == qd and r["threads"] == th)
            label = f"qd {qd}, {th} thread{'s' if th > 1 else ''}"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=f"C{k}", label=label)
            if all(p[2] is not None for p in pts):
                ax.plot([p[0] for p in pts], [p[2] for p in pts], marker="x", linestyle=":",
                        color=f"C{k}", label=f"fio, {label}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(block_sizes)
        ax.set_xticklabels([short_size(b) for b in block_sizes])
        ax.minorticks_off()
        ax.set_xlabel("block size")
        ax.set_title(op)
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("GiB/s")
    axes[0].set_ylim(bottom=0)
    axes[1].legend(fontsize=8, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
