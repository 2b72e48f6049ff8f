"""Whether GPUDirect Storage can serve ``aio.use_gds`` on this machine, and the one warning given when
it is asked for."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import threading
import warnings

from ..errors import user_stacklevel

__all__ = ["GDS_INSTALL", "gds_status", "warn_use_gds"]

GDS_INSTALL = "pip install 'nvme-offload[gds]'"

_warn_lock = threading.Lock()
_warned = False


# NOTE: GDS needs three things: the kvikio package (the ``gds`` extra, built for the machine's CUDA), a GPU,
# and a cuFile driver that does real GPUDirect transfers. kvikio runs without the last one in "compatibility
# mode" (POSIX reads into a host bounce buffer, then a copy): that is our pinned pool's path with more
# copies, so it counts as unavailable. The answer does not change within a process, so it is cached;
# ``gds_status.cache_clear()`` asks again. Every failure becomes a reason, never an exception: the caller
# falls back to the pinned pool.
@functools.cache
def gds_status() -> tuple[bool, str]:
    """Whether GPUDirect Storage is usable here, and why (or why not).

    Returns:
        ``(True, "kvikio <version>, cuFile <major>.<minor>")`` where kvikio opens a cuFile driver with
        GDS, else ``(False, reason)``: kvikio not installed or not importable, no CUDA device, kvikio in
        compatibility mode, or a cuFile driver without GDS (no nvidia-fs).
    """
    if importlib.util.find_spec("kvikio") is None:
        return False, f"the kvikio package is not installed ({GDS_INSTALL})"
    import torch

    if not torch.cuda.is_available():
        return False, "torch sees no CUDA device"
    try:
        kvikio = importlib.import_module("kvikio")
        defaults = importlib.import_module("kvikio.defaults")
    except Exception as err:  # a wheel for another CUDA, a missing libcufile: any import failure is a reason
        return False, f"kvikio cannot be imported ({type(err).__name__}: {err})"
    version = getattr(kvikio, "__version__", "?")
    try:
        driver = _driver_properties(kvikio)
    except Exception as err:
        return False, f"kvikio {version}'s cuFile driver properties cannot be read ({type(err).__name__}: {err})"
    if driver is None:
        return False, (f"kvikio {version} has none of the driver-property interfaces known here (kvikio."
                       "cufile_driver.get or .properties, cufile_driver.DriverProperties, kvikio.DriverProperties)")
    try:
        compat = _compat_mode_preferred(defaults)
    except Exception as err:
        return False, f"kvikio {version} cannot tell its compatibility mode ({type(err).__name__}: {err})"
    if compat:
        return False, (f"kvikio {version} runs in compatibility mode (POSIX reads through a bounce buffer): "
                       "libcufile is missing, /run/udev is not readable (a container started without "
                       "--volume /run/udev:/run/udev:ro), or KVIKIO_COMPAT_MODE is ON")
    try:
        available = bool(driver("is_gds_available"))
    except Exception as err:
        return False, f"the cuFile driver cannot be opened ({type(err).__name__}: {err})"
    if not available:
        return False, ("the cuFile driver reports no GPUDirect Storage (the nvidia-fs kernel module is not "
                       "loaded, or this file system or GPU does not support it)")
    try:
        cufile = f", cuFile {driver('major_version')}.{driver('minor_version')}"
    except Exception:
        cufile = ""
    return True, f"kvikio {version}{cufile}"


def _compat_mode_preferred(defaults) -> bool:
    """kvikio's compatibility mode, "AUTO" resolved (the API changed in kvikio 24.12 and 25.02)."""
    if hasattr(defaults, "is_compat_mode_preferred"):
        return bool(defaults.is_compat_mode_preferred())
    mode = defaults.get("compat_mode") if hasattr(defaults, "get") else defaults.compat_mode()
    return getattr(mode, "name", str(mode)).upper() not in ("OFF", "FALSE", "0")


def _driver_properties(kvikio):
    """A function of a cuFile driver property's name (``is_gds_available``, ``major_version``, ...) giving its
    value, through whichever interface this kvikio has, or None: ``kvikio.cufile_driver.get`` (25.04 on),
    ``kvikio.cufile_driver.properties`` or ``.DriverProperties()`` (24.12 on), ``kvikio.DriverProperties()``
    (before 24.12, where ``kvikio.cufile_driver`` does not exist)."""
    try:
        driver = importlib.import_module("kvikio.cufile_driver")
    except ImportError:
        driver = None
    if driver is not None and callable(getattr(driver, "get", None)):
        return driver.get
    if driver is not None and hasattr(driver, "properties"):
        props = driver.properties
    elif driver is not None and hasattr(driver, "DriverProperties"):
        props = driver.DriverProperties()
    elif hasattr(kvikio, "DriverProperties"):
        props = kvikio.DriverProperties()
    else:
        return None
    return lambda name: getattr(props, name)


def warn_use_gds() -> None:
    """Say once per process what ``aio.use_gds: true`` gets here (a RuntimeWarning naming the user's line).

    Optimizer state and offloaded parameters move through the pinned host pool in either case: where GDS
    is unavailable the warning gives the reason; where it is available, it says that the direct NVMe-GPU
    path serves ``offload-bench io --gds`` only.
    """
    global _warned
    with _warn_lock:
        if _warned:
            return
        _warned = True
    ok, reason = gds_status()
    if ok:
        message = (f"aio.use_gds is true and GPUDirect Storage is available ({reason}), but optimizer state "
                   "and offloaded parameters still move through the pinned host pool: the direct NVMe-GPU "
                   "path is not used for them (offload-bench io --gds measures it). Set use_gds to false to "
                   "silence this.")
    else:
        message = (f"aio.use_gds is true, but GPUDirect Storage is not available here: {reason}. Optimizer "
                   "state and offloaded parameters move through the pinned host pool instead. Set use_gds "
                   "to false to silence this.")
    warnings.warn(message, RuntimeWarning, stacklevel=user_stacklevel())
