#!/usr/bin/env bash
# A Python that imports DeepSpeed, for `offload-bench compare` to run DeepSpeed ZeRO-3 beside nvme-offload on the
# same machine, disk and sizes (DeepSpeed is never a dependency of nvme-offload). Installs fio, liburing-dev and
# libaio-dev (DeepSpeed's aio op needs libaio) with apt-get where they are missing, then a venv at $PEER_VENV
# (default ~/.peer-venv, where `offload-bench compare` looks first) over the installed torch, with DeepSpeed
# 0.19.8 and ninja. Prints the venv's python: give it to `offload-bench compare --peer-python`, or leave it at the
# default place. DeepSpeed compiles its CPU Adam and aio ops at first use (a few minutes, once): compare builds
# them before its first round and shows it.
set -eu
V=${PEER_VENV:-$HOME/.peer-venv}
for p in fio liburing-dev libaio-dev; do
  dpkg -s "$p" >/dev/null 2>&1 || {
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fio liburing-dev libaio-dev >/dev/null
    break
  }
done
python3 -c "import torch" 2>/dev/null || pip install -q torch==2.13.0
[ -x "$V/bin/python" ] || python3 -m venv --system-site-packages "$V"
"$V/bin/python" -c "import deepspeed" 2>/dev/null || "$V/bin/pip" install -q deepspeed==0.19.8 ninja >/dev/null 2>&1
echo "$V/bin/python"
