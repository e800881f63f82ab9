#!/usr/bin/env bash
# The GPU half of the test suite and the GPU data-plane benchmark, from a relocatable bundle, on
# a machine with a GPU and no build tools (e.g. the H200 machine):
#   here:   deploy/bundle --build build --out BUNDLE --strip --with-bench --with-gpu-tests
#   there:  scripts/gpu_suite.sh BUNDLE OUT [bench parts, default a,b,c,d; "none" skips]
# Runs the bundle's environment check, every gpu-labelled test (kernels, GpuShardPass, the GPU
# data plane against an in-process hostd, the C ABI through torch, the native GPU trainer against
# the CPU reference, python_client against GPU-resident torch AdamW, three train_hf.py processes
# in turn against one hostd) and
# bench/gpu_plane/run_gpu_plane_bench.py; logs and JSON go to OUT.
# Exit status: the number of failed steps.
set -u
cd "$(dirname "$0")/.."
BUNDLE=${1:?usage: gpu_suite.sh BUNDLE OUT [PARTS]}
OUT=${2:?usage: gpu_suite.sh BUNDLE OUT [PARTS]}
PARTS=${3:-a,b,c,d}
B="$BUNDLE/bin"
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
failed=0
step() {  # step NAME COMMAND...: runs it with its output in OUT/NAME.log
  local name=$1
  shift
  "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc"
  ((rc == 0)) || failed=$((failed + 1))
  grep -E "^\[  (PASSED|FAILED) |Failure|R=|^Ran |^OK|FAIL|ok: " "$OUT/$name.log" | head -12
}
step slidedp_env "$B/slidedp-env"
for t in cuda_kernels_test cuda_handles_gpu_test gpu_mlp_test gpu_plane_test; do step "$t" timeout 300 "$B/$t"; done
step rank_ctypes_gpu_test timeout 300 python3 tests/rank_ctypes_gpu_test.py "$B/hostd" \
  "$B/slidedpctl" "$BUNDLE/lib/libslidedp_rank.so"
step gpu_trainer_test timeout 600 python3 tests/gpu_trainer_test.py "$B/hostd" \
  "$B/native_gpu_trainer" "$B/native_reference"
step python_client_gpu_test timeout 900 python3 tests/python_client_test.py "$B/hostd" \
  "$BUNDLE/lib/libslidedp_rank.so" --device cuda
step attach_cycles_gpu_test timeout 900 tests/attach_cycles_gpu_test.sh "$BUNDLE" "$OUT/attach_cycles"
if [ "$PARTS" != none ]; then
  step gpu_plane_bench timeout 900 python3 bench/gpu_plane/run_gpu_plane_bench.py --bin "$B" \
    --out "$OUT/gpu_plane.json" --parts "$PARTS"
  grep -E "GB/s|ms/layer|step [0-9]+:" "$OUT/gpu_plane_bench.log" | tail -30
fi
exit "$failed"
