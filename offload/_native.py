"""The only importer of the compiled modules: the engine (``offload._engine``) and the optimizer's kernels
(``offload._kernels``).

It refuses to load a build whose compiled-in version differs from the package's: with editable
installs, a stale extension otherwise runs silently against newer Python code.
"""

from ._version import __version__

try:
    from ._engine import ffi, lib
    from ._kernels import ffi as kernels_ffi
    from ._kernels import lib as kernels_lib
except ImportError as err:  # pragma: no cover - depends on the installation
    raise ImportError(
        "nvme-offload's native engine is not built. Build it with `pip install -e .` "
        "(or `make install`) from the source tree."
    ) from err

BUILT_VERSION = ffi.string(lib.ofl_version()).decode()
_KERNELS_VERSION = kernels_ffi.string(kernels_lib.ofl_kernels_version()).decode()
for _name, _built in (("engine", BUILT_VERSION), ("kernels", _KERNELS_VERSION)):
    if _built != __version__:
        raise ImportError(
            f"nvme-offload's native {_name} is a stale build (built for {_built}, package is "
            f"{__version__}). Rebuild it with `pip install -e .` (or `make install`)."
        )

HAVE_IO_URING = bool(lib.ofl_have_io_uring())
HAVE_XXHASH = bool(lib.ofl_have_xxhash())  # request digests computed on the engine's threads

BACKENDS = {
    "auto": lib.OFL_BACKEND_AUTO,
    "io_uring": lib.OFL_BACKEND_IO_URING,
    "threads": lib.OFL_BACKEND_THREADS,
}
BACKEND_NAMES = {lib.OFL_BACKEND_IO_URING: "io_uring", lib.OFL_BACKEND_THREADS: "threads"}
