#!/usr/bin/env bash
# Run here, in the project's root, to take the project to a GPU machine that has torch but no network:
# after a bundle script has filled .device-bundle/ with the cffi wheels, liburing and build.sh, this adds
# what such a machine also lacks for the tests and benchmarks: the hjson wheel (a dependency of the
# package) and libxxhash (the engine's checksums in C). With --deepspeed it adds DeepSpeed for
# `offload-bench compare --device cuda`: its wheel, the needs of it a torch image lacks (pydantic and its
# parts) and libaio for its aio op. Python 3.12 wheels for x86-64 (set PYVER to change).
set -euo pipefail
B=.device-bundle
PYVER=${PYVER:-3.12}
[ -f "$B/build.sh" ] || { echo "no $B/build.sh: fill $B first (cffi wheels, liburing, build.sh)" >&2; exit 1; }
get_wheels() {  # into $1: the named wheels for Python $PYVER on x86-64
  local dir=$1; shift
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$dir" "$@" 2>&1 | grep -v "is ignored" || true
}
unpack_debs() {  # the named Debian packages, unpacked under $1
  local tmp; tmp=$(mktemp -d)
  (cd "$tmp" && apt-get download "${@:2}" >/dev/null 2>&1) || { apt-get update -qq && (cd "$tmp" && apt-get download "${@:2}" >/dev/null); }
  for f in "$tmp"/*.deb; do dpkg -x "$f" "$1"; done
  rm -rf "$tmp"
}
get_wheels "$B/whl" hjson
x=$(mktemp -d)
unpack_debs "$x" libxxhash0 libxxhash-dev
cp "$x"/usr/include/xxh*.h "$B/uring/inc/"
cp -L "$x"/usr/lib/x86_64-linux-gnu/libxxhash.so "$B/uring/lib/libxxhash.so"
cp -L "$x"/usr/lib/x86_64-linux-gnu/libxxhash.so "$B/uring/lib/libxxhash.so.0"
rm -rf "$x"
if [ "${1:-}" = "--deepspeed" ]; then
  mkdir -p "$B/ds" "$B/aio/inc" "$B/aio/lib"
  python3 -m pip wheel -q --no-deps deepspeed==0.19.8 -w "$B/ds" 2>&1 | grep -v "is ignored" || true
  # The versions that ran on the GPU image (newer pydantic needs a newer typing-extensions than it may have).
  get_wheels "$B/ds" pydantic==2.13.4 pydantic_core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2
  x=$(mktemp -d)
  unpack_debs "$x" libaio1 libaio-dev
  cp "$x"/usr/include/libaio.h "$B/aio/inc/"
  cp -L "$x"/usr/lib/x86_64-linux-gnu/libaio.so "$B/aio/lib/libaio.so"
  cp -L "$x"/usr/lib/x86_64-linux-gnu/libaio.so "$B/aio/lib/libaio.so.1"
  rm -rf "$x"
fi
du -sh "$B"
