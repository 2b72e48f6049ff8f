#!/usr/bin/env bash
# Installs what `make demo` and `make test` need and is missing: liburing-dev, libxxhash-dev, fio, xfsprogs
# (mkfs.xfs, for the reflink snapshot tests) and fuse3 (the power-loss tests' file system) (Debian/Ubuntu,
# as root; otherwise prints the command and carries on, and the engine uses its thread-pool backend),
# then torch's CPU build (2.13.0, which must be installed before anything pulls an unpinned torch),
# then this package in editable mode with its test extras.
set -euo pipefail
PYTHON=${PYTHON:-python3}

missing=()
for pkg in liburing-dev libxxhash-dev fio xfsprogs fuse3; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "missing system packages: ${missing[*]}. Install them with:" >&2
    echo "  sudo apt-get install ${missing[*]}" >&2
    echo "continuing: the engine will use its thread-pool backend, and fio comparisons are skipped" >&2
  fi
fi

if ! "$PYTHON" -c 'import torch' 2>/dev/null; then
  echo "installing torch 2.13.0"
  "$PYTHON" -m pip install -q torch==2.13.0
fi

"$PYTHON" -m pip install -q -e ".[dev,plot]"
