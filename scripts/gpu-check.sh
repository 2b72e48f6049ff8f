#!/usr/bin/env bash
# Run on a GPU machine, in the project's root, with .device-bundle/ (scripts/gpu-bundle.sh) carried along:
# builds the engine, runs the GPU tests, then the GPU benchmarks at sizes that fit a few minutes, and, when
# the bundle holds DeepSpeed, compare --device cuda beside it. Logs go to $OUT (or ./gpu-check-out).
# BUDGET (seconds, default 420) bounds the whole run: the benchmarks get what the tests leave. Exits with the
# build's status if it fails, else the GPU tests'.
set -u -o pipefail
OUT=${OUT:-$PWD/gpu-check-out}
BUDGET=${BUDGET:-420}
mkdir -p "$OUT"
D=$PWD/.device-bundle
bash "$D/build.sh" 2>&1 | tee "$OUT/build.log" || exit 1
export PYTHONPATH=/tmp/site:$PWD LD_LIBRARY_PATH=$D/uring/lib:$D/aio/lib PYTHONUNBUFFERED=1
left() { echo $(( BUDGET - SECONDS )); }
timeout $(( $(left) / 2 )) python3 -m pytest -q -m gpu tests/ -p no:cacheprovider -rfEs --tb=short \
  --basetemp=/tmp/gpu-check-pt 2>&1 | tee "$OUT/gpu-tests.log"
tests=$?
scratch=$(mktemp -d)
bench() {  # a name, then offload-bench's arguments; skipped once the budget is spent
  local name=$1; shift
  [ "$(left)" -gt 30 ] || { echo "### $name: skipped (budget spent)"; return; }
  echo "### $name"
  timeout $(( $(left) - 10 )) python3 -m offload.tools "$@" 2>&1 | { grep -v " TB of " || true; }
}
{
  bench gpu gpu --size 512MiB --rounds 3
  bench device-cpu adam --device cuda --dtype bf16 --params 256M --offload-device cpu --steps 4 --no-fio --path "$scratch"
  bench overlap adam --device cuda --overlap --params 64M --steps 3 --rounds 2 --path "$scratch"
  bench params params --device cuda --layers 8 --hidden 1024 --steps 4 --path "$scratch"
  if [ -d "$D/ds" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$D"/ds/*.whl
    # DeepSpeed builds its ops on first use and cannot parse an arch list like "9.0a", which GPU images
    # often set: the list without such suffixes, else this GPU's compute capability (9.0 if that fails).
    arch=$(echo "${TORCH_CUDA_ARCH_LIST:-}" | sed -E 's/([0-9]+\.[0-9]+)[a-z]+/\1/g')
    [ -n "$arch" ] || arch=$(python3 -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())" \
      2>/dev/null) || arch=9.0
    export TORCH_CUDA_ARCH_LIST=${arch:-9.0}
    export CPATH=$D/aio/inc LIBRARY_PATH=$D/aio/lib \
      CFLAGS="-I$D/aio/inc" LDFLAGS="-L$D/aio/lib"
    bench compare compare --device cuda --params 64M --rounds 1 --iterations 4 --no-extras --peer-python python3 \
      --path "$scratch" --json "$OUT/compare.json"
  fi
} 2>&1 | tee "$OUT/bench.log"
rm -rf "$scratch" /tmp/gpu-check-pt
echo "took $SECONDS s; the GPU tests exited $tests"
exit $tests
