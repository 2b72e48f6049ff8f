"""cffi build script for the native engine (run by setup.py through ``cffi_modules``).

The header ``native/offload_engine.h`` is the cdef: one short file says what crosses the boundary.
liburing is used when it links here; otherwise the extension is built with the thread-pool
backend only (set ``OFFLOAD_NO_URING=1`` to force that).
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


def _read_version() -> str:
    scope: dict = {}
    exec((ROOT / "offload" / "_version.py").read_text(), scope)
    return scope["__version__"]


def _liburing_links() -> bool:
    """True if a program using liburing compiles and links on this machine."""
    if os.environ.get("OFFLOAD_NO_URING") == "1":
        return False
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return False
    probe = (
        "#include <liburing.h>\n"
        "int main(void){struct io_uring r; return io_uring_queue_init(2,&r,0) < -1000;}\n"
    )
    with tempfile.TemporaryDirectory() as tmp:
        src = pathlib.Path(tmp) / "probe.c"
        src.write_text(probe)
        done = subprocess.run(
            [cc, str(src), "-o", str(pathlib.Path(tmp) / "probe"), "-luring"],
            capture_output=True,
        )
        return done.returncode == 0


HAVE_URING = _liburing_links()
if not HAVE_URING:
    print(
        "nvme-offload: liburing not found; building the thread-pool backend only "
        "(as root: apt-get install liburing-dev, then reinstall)",
        file=sys.stderr,
    )

ffibuilder = FFI()
ffibuilder.cdef(HEADER.read_text())
ffibuilder.set_source(
    "offload._engine",
    '#include "offload_engine.h"',
    sources=[str(SOURCE.relative_to(ROOT))],
    include_dirs=[str(NATIVE.relative_to(ROOT))],
    define_macros=[("OFL_VERSION", f'"{_read_version()}"')]
    + ([("OFL_HAVE_URING", "1")] if HAVE_URING else []),
    libraries=(["uring"] if HAVE_URING else []) + ["pthread"],
    extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
