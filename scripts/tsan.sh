#!/usr/bin/env bash
# ThreadSanitizer run over the update worker and the step protocol, in its own build tree,
# ${TSAN_BUILD_DIR:-build-tsan} (g++ -fsanitize=thread; configured on first use, then rebuilt
# incrementally with ccache).
#
#   scripts/tsan.sh build        configure if needed, build the TSan test binaries
#   scripts/tsan.sh run TEST     run one of them with TSAN_OPTIONS (halt on the first report)
#   scripts/tsan.sh              build, then run them all
# CTest runs `build` once and `run` per test (labels tsan and fuzz). The tests: thread_pool_test,
# shm_segment_test, state_test, optimizer_test (update worker), reducer_test (gradient rings,
# engine in process), engine_test (the step protocol through the gRPC service).
# gRPC and protobuf are not instrumented; scripts/tsan.supp suppresses what TSan reports inside
# them (each entry says why). Our own code has no suppression.
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=$PWD
BUILD=${TSAN_BUILD_DIR:-build-tsan}
TESTS=(thread_pool_test shm_segment_test state_test optimizer_test reducer_test engine_test)

build() {
  export CCACHE_BASEDIR=$SRC CCACHE_NOHASHDIR=1
  if [ ! -f "$BUILD/build.ninja" ]; then
    cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSLIDEDP_TSAN=ON \
      -DSLIDEDP_CUDA=OFF >/dev/null
  fi
  cmake --build "$BUILD" --target "${TESTS[@]}" -j "${JOBS:-2}"
}

run() {
  local t=$1 bin
  bin=$(find "$BUILD" -name "$t" -type f -perm -u+x | head -1)
  [ -n "$bin" ] || { echo "tsan.sh: $t is not built (scripts/tsan.sh build)" >&2; exit 2; }
  # halt_on_error: a report fails the test even when the assertions pass; second_deadlock_stack
  # for lock-order reports; the TSan exit code is 66.
  TSAN_OPTIONS="halt_on_error=1 exitcode=66 second_deadlock_stack=1 history_size=4 suppressions=$SRC/scripts/tsan.supp ${TSAN_OPTIONS:-}" \
    "$bin" --gtest_brief=1
}

case "${1:-all}" in
  build) build ;;
  run) run "$2" ;;
  *)
    build
    for t in "${TESTS[@]}"; do run "$t"; done
    ;;
esac
