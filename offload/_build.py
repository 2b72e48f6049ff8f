"""cffi build script for the native engine (run by setup.py through ``cffi_modules``).

The header ``native/offload_engine.h`` is the cdef: one short file says what crosses the boundary.
liburing is used when it links here; otherwise the extension is built with the thread-pool
backend only (set ``OFFLOAD_NO_URING=1`` to force that). libxxhash likewise gives request digests
on the engine's threads (``OFFLOAD_NO_XXHASH=1``: checksums are then computed in Python).
"""

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

from cffi import FFI

ROOT = pathlib.Path(__file__).resolve().parent.parent
NATIVE = ROOT / "native"
HEADER = NATIVE / "offload_engine.h"
SOURCE = NATIVE / "offload_engine.c"
KERNELS_HEADER = NATIVE / "offload_kernels.h"
KERNELS_SOURCE = NATIVE / "offload_kernels.c"


def _read_version() -> str:
    scope: dict = {}
    exec((ROOT / "offload" / "_version.py").read_text(), scope)
    return scope["__version__"]


def _links(program: str, library: str, switch: str) -> bool:
    """True if ``program`` compiles and links against ``-l{library}`` here (and ``switch`` is not set to 1)."""
    if os.environ.get(switch) == "1":
        return False
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        src = pathlib.Path(tmp) / "probe.c"
        src.write_text(program)
        done = subprocess.run(
            [cc, str(src), "-o", str(pathlib.Path(tmp) / "probe"), f"-l{library}"],
            capture_output=True,
        )
        return done.returncode == 0


HAVE_URING = _links("#include <liburing.h>\n"
                    "int main(void){struct io_uring r; return io_uring_queue_init(2,&r,0) < -1000;}\n",
                    "uring", "OFFLOAD_NO_URING")
if not HAVE_URING:
    print(
        "nvme-offload: liburing not found; building the thread-pool backend only "
        "(as root: apt-get install liburing-dev, then reinstall)",
        file=sys.stderr,
    )
# Request digests on the engine's threads; without libxxhash the checksums are taken in Python instead.
HAVE_XXHASH = _links("#include <xxhash.h>\nint main(void){return (int)(XXH3_64bits(\"\", 0) & 1);}\n",
                     "xxhash", "OFFLOAD_NO_XXHASH")
if not HAVE_XXHASH:
    print("nvme-offload: libxxhash not found; checksums of offloaded state are computed in Python "
          "(as root: apt-get install libxxhash-dev, then reinstall)", file=sys.stderr)
# The same digests from the widest vector unit the CPU has (AVX2, AVX-512), chosen when the engine first
# hashes: about 1.4x the default build's speed on x86-64, where hashing competes with the optimizer's math.
HAVE_XXH_DISPATCH = HAVE_XXHASH and _links(
    "#include <xxh_x86dispatch.h>\nint main(void){return (int)(XXH3_64bits_dispatch(\"\", 0) & 1);}\n",
    "xxhash", "OFFLOAD_NO_XXHASH")

ffibuilder = FFI()
ffibuilder.cdef(HEADER.read_text())
ffibuilder.set_source(
    "offload._engine",
    '#include "offload_engine.h"',
    sources=[str(SOURCE.relative_to(ROOT))],
    include_dirs=[str(NATIVE.relative_to(ROOT))],
    define_macros=[("OFL_VERSION", f'"{_read_version()}"')]
    + ([("OFL_HAVE_URING", "1")] if HAVE_URING else [])
    + ([("OFL_HAVE_XXHASH", "1")] if HAVE_XXHASH else [])
    + ([("OFL_XXH_DISPATCH", "1")] if HAVE_XXH_DISPATCH else []),
    libraries=(["uring"] if HAVE_URING else []) + (["xxhash"] if HAVE_XXHASH else []) + ["pthread"],
    extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
)

# The optimizer's own kernels (8-bit state, stochastic rounding): a module of their own, since they share
# nothing with the engine. -ffp-contract=off: each operation rounds once, as torch's element-wise kernels do.
kernels = FFI()
kernels.cdef(KERNELS_HEADER.read_text())
kernels.set_source(
    "offload._kernels",
    '#include "offload_kernels.h"\nconst char *ofl_kernels_version(void) { return OFL_VERSION; }',
    sources=[str(KERNELS_SOURCE.relative_to(ROOT))],
    include_dirs=[str(NATIVE.relative_to(ROOT))],
    define_macros=[("OFL_VERSION", f'"{_read_version()}"')],
    libraries=["m", "pthread"],
    extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter", "-ffp-contract=off",
                        "-fno-math-errno"],
)
kernels.cdef("const char *ofl_kernels_version(void);")

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
    kernels.compile(verbose=True)
