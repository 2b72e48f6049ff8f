"""``offload-report`` (also ``offload-bench report``): what a bug report needs, and what a user should check
first, one line a check: ok, or what to do.

Versions, the engine's backend (io_uring or threads, and why), request checksums, and per swap directory its
file system, free space, O_DIRECT and reflink (clones for checkpoint snapshots); the locked-memory limit
against the pools the config asks for; host memory; CUDA, pinning and GPUDirect Storage.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import os
import platform
import resource
import struct
import sys
import tempfile
from typing import Optional, Sequence

import psutil

from .._version import __version__
from ..config import Config
from ..sizes import ALIGNMENT, format_size, round_up
from . import report
from .cli import EXIT_FAILURE, EXIT_OK, add_config_option, add_version_option, common_parser

__all__ = ["Check", "checks", "main", "register"]

OK, WARN, FAIL, INFO = "ok", "warn", "FAIL", "info"
_FICLONE = 0x40049409  # _IOW(0x94, 9, int)


@dataclasses.dataclass(frozen=True)
class Check:
    """One finding: ``status`` (ok, warn, FAIL or info), what was checked, what was found, what to do."""

    status: str
    what: str
    found: str
    todo: str = ""


def checks(config: Config, paths: Sequence[str]) -> list[Check]:
    """Every check, in the order printed."""
    out = [_versions()]
    out += _engine()
    for path in paths:
        out += _path(path)
    out.append(_pool_sizes(config))
    out.append(_memlock(config))
    out.append(_memory(config))
    out += _cuda()
    return out


def _versions() -> Check:
    import torch

    return Check(INFO, "versions", f"nvme-offload {__version__}, torch {torch.__version__}, Python "
                 f"{platform.python_version()}, Linux {platform.release()} ({platform.machine()})")


def _engine() -> list[Check]:
    from ..aio import HAVE_IO_URING, HAVE_XXHASH, Engine
    from ..config import AioConfig

    out = []
    if not HAVE_IO_URING:
        out.append(Check(WARN, "engine", "built without liburing: the thread-pool backend (pread/pwrite) is used",
                         "install liburing-dev, then reinstall (make install) for io_uring"))
    else:
        try:
            Engine(AioConfig(backend="io_uring")).close()
            out.append(Check(OK, "engine", "io_uring"))
        except OSError as err:
            out.append(Check(WARN, "engine", f"io_uring is built in but the kernel refused it ({err.strerror}): the "
                             "thread-pool backend is used", "allow io_uring (sysctl kernel.io_uring_disabled=0; a "
                             "container's seccomp profile may block it)"))
    out.append(Check(OK, "checksums", "xxh3 on the engine's threads") if HAVE_XXHASH else
               Check(WARN, "checksums", "built without libxxhash: state checksums are unavailable",
                     "install libxxhash-dev, then reinstall (make install)"))
    return out


def _path(path: str) -> list[Check]:
    what = f"path {path}"
    if not os.path.isdir(path):
        parent = os.path.dirname(os.path.abspath(path))
        if os.path.exists(path) or not os.path.isdir(parent):
            return [Check(FAIL, what, "not a directory" if os.path.exists(path) else "missing, and so is its parent",
                          "give a directory on the NVMe drive")]
        if parent == os.path.dirname(parent):
            return [Check(FAIL, what, "missing, and a directory at the file system's root is never created for you "
                          "(a placeholder of an example config?)", "give a directory on the NVMe drive, or create "
                          "this one")]
        probe_dir = parent
        created = " (missing: it is created at the first run)"
    else:
        probe_dir, created = path, ""
    fs = report.file_system(probe_dir)
    st = os.statvfs(probe_dir)
    out = [Check(INFO, what, f"{fs['type']} on {fs['device']}, {format_size(st.f_bavail * st.f_frsize)} "
                 f"free{created}")]
    try:
        fd, name = tempfile.mkstemp(prefix=".offload-report-", dir=probe_dir)
    except OSError as err:
        return out + [Check(FAIL, what, f"cannot create a file ({err.strerror})", "give this user write access "
                            "or choose another nvme_path")]
    try:
        out.append(_o_direct(what, fd))
        out.append(_reflink(what, fd, probe_dir))
    finally:
        os.close(fd)
        os.unlink(name)
    return out


def _o_direct(what: str, fd: int) -> Check:
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT)
        direct = bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)
    except OSError:
        direct = False
    fcntl.fcntl(fd, fcntl.F_SETFL, flags)
    if direct:
        return Check(OK, f"{what}: O_DIRECT", "supported")
    return Check(WARN, f"{what}: O_DIRECT", "refused by the file system: buffered I/O through the page cache, "
                 "slower and using memory", "put nvme_path on a local ext4 or XFS file system of the NVMe drive")


def _reflink(what: str, fd: int, directory: str) -> Check:
    try:
        os.pwrite(fd, b"\0" * ALIGNMENT, 0)
        clone_fd, clone = tempfile.mkstemp(prefix=".offload-report-", dir=directory)
    except OSError as err:
        return Check(FAIL, f"{what}: write", f"cannot write a file ({err.strerror})",
                     "free space, or choose a writable nvme_path")
    try:
        fcntl.ioctl(clone_fd, _FICLONE, struct.pack("i", fd))
        return Check(OK, f"{what}: reflink", "supported: checkpoint snapshots clone the state in place")
    except OSError:
        return Check(INFO, f"{what}: reflink", "not supported: an asynchronous save copies the state",
                     "XFS (mkfs.xfs -m reflink=1) or btrfs make snapshots metadata only")
    finally:
        os.close(clone_fd)
        os.unlink(clone)


def _weights_offloaded(config: Config) -> bool:
    """Whether the config offloads weights: an ``offload_param`` block with device "nvme" (without one, a
    DeepSpeed config keeps the weights in memory, and ``offload.initialize`` does too)."""
    return "offload_param" in config.given and config.offload_param.device == "nvme"


def _pools(config: Config) -> int:
    """The most host memory the pools can take under ``config`` (bf16 weights): what the locked-memory limit and
    the memory available are held against. Each is smaller for a smaller model (see :func:`_pool_sizes`)."""
    oc, pc = config.offload_optimizer, config.offload_param
    weights = pc.buffer_count * round_up(pc.buffer_size * 2, ALIGNMENT) if _weights_offloaded(config) else 0
    return (oc.buffer_count * oc.buffer_size if oc.device == "nvme" else 0) + weights


def _pool_sizes(config: Config) -> Check:
    """The two pools: their defaults or settings, and how each follows the model."""
    oc, pc = config.offload_optimizer, config.offload_param
    if oc.device == "nvme":
        optimizer = (f"optimizer {oc.buffer_count} x {format_size(oc.buffer_size)} = "
                     f"{format_size(oc.buffer_count * oc.buffer_size)} at most (less for less state)")
    else:
        optimizer = "optimizer: none (device cpu: the state is in host memory)"
    each = round_up(pc.buffer_size * 2, ALIGNMENT)
    weights = (f"weights {pc.buffer_count} x {pc.buffer_size:.3g} elements = {format_size(pc.buffer_count * each)} "
               f"at bf16 at most, buffers no larger than the largest weight or grad on NVMe, none when all stay "
               f"in memory (max_in_cpu {pc.max_in_cpu:.3g}, max_grad_in_cpu {pc.max_grad_in_cpu:.3g})")
    if not _weights_offloaded(config):
        weights += "; this config offloads no weights (no offload_param with device nvme)"
    return Check(INFO, "pools", f"{optimizer}; {weights}")


def _memlock(config: Config) -> Check:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    need = _pools(config)
    if os.geteuid() == 0:
        return Check(OK, "locked memory", "root: not limited by ulimit -l")
    if soft == resource.RLIM_INFINITY or soft >= need:
        shown = "unlimited" if soft == resource.RLIM_INFINITY else format_size(soft)
        return Check(OK, "locked memory", f"ulimit -l {shown}, pools at most {format_size(need)}")
    return Check(WARN, "locked memory", f"ulimit -l {format_size(soft)} is less than the pools "
                 f"({format_size(need)} at most): io_uring may refuse to register them as fixed buffers (a little "
                 "slower) and pinning may fail",
                 "raise it: ulimit -l unlimited (or memlock in /etc/security/limits.conf, LimitMEMLOCK in systemd, "
                 "--ulimit memlock=-1 for docker)")


def _memory(config: Config) -> Check:
    vm = psutil.virtual_memory()
    need = _pools(config)
    found = (f"{format_size(vm.available)} available of {format_size(vm.total)}; the pools take at most "
             f"{format_size(need)}")
    if vm.available < need:
        return Check(WARN, "host memory", found, "lower buffer_count or buffer_size")
    return Check(OK, "host memory", found)


def _cuda() -> list[Check]:
    import torch

    from ..aio import gds_status

    if not torch.cuda.is_available():
        return [Check(INFO, "CUDA", "no CUDA device: training runs on the CPU")]
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    out = [Check(OK, "CUDA", f"torch {torch.version.cuda}: {names}")]
    try:
        torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
        out.append(Check(OK, "pinning", "page-locked host memory works"))
    except RuntimeError as err:
        out.append(Check(WARN, "pinning", f"page-locked memory refused ({err})", "raise ulimit -l; set pin_memory "
                         "false to go on without (copies at about a third of the speed)"))
    ok, reason = gds_status()
    out.append(Check(OK if ok else INFO, "GPUDirect Storage", reason))
    return out


def render(found: Sequence[Check]) -> str:
    """One line a check (status, what, what was found); what to do on the line below, where there is something."""
    width = max(len(c.what) for c in found)
    lines = []
    for c in found:
        lines.append(f"{c.status:<4}  {c.what:<{width}}  {c.found}")
        if c.todo:
            lines.append(f"{'':<4}  {'':<{width}}  -> {c.todo}")
    return "\n".join(lines)


# -- the commands ---------------------------------------------------------------------------------------


def _add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("paths", nargs="*", metavar="PATH", help="swap directories to check (default: the config's "
                   "nvme_path, else the temporary directory)")
    add_config_option(p)
    p.add_argument("--json", metavar="FILE", help="write the checks as JSON")


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """Add the ``report`` subcommand."""
    p = sub.add_parser("report", parents=[common], help="what a bug report needs; what to check first",
                       description=__doc__.split("\n\n")[0])
    _add_options(p)
    p.set_defaults(run=run_report)


def run_report(args: argparse.Namespace) -> int:
    config = args.config
    paths = args.paths or list(config.offload_optimizer.nvme_paths or config.offload_param.nvme_paths) \
        or [tempfile.gettempdir()]
    found = checks(config, paths)
    print(render(found))
    if args.json:
        report.write_json(args.json, {"checks": [dataclasses.asdict(c) for c in found]})
    return EXIT_FAILURE if any(c.status == FAIL for c in found) else EXIT_OK


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``offload-report [PATH ...] [--config FILE] [--json FILE]``: exit 0, or 1 when a check failed."""
    p = argparse.ArgumentParser(prog="offload-report", parents=[common_parser()],
                                description=__doc__.split("\n\n")[0])
    add_version_option(p)
    _add_options(p)
    args = p.parse_args(argv)
    try:
        return run_report(args)
    except OSError as err:
        if args.debug:
            raise
        print(f"offload-report: error: {err}", file=sys.stderr)
        return EXIT_FAILURE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
