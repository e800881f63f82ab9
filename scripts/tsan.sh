#!/usr/bin/env bash
# ThreadSanitizer run over the update worker, the step protocol, the checkpointer and the engine
# behind its gRPC service, in its own build tree,
# ${TSAN_BUILD_DIR:-build-tsan} (g++ -fsanitize=thread; configured on first use, then rebuilt
# incrementally with ccache).
#
#   scripts/tsan.sh build        configure if needed, build the TSan test binaries
#   scripts/tsan.sh run TEST     run one of them with TSAN_OPTIONS (halt on the first report)
#   scripts/tsan.sh              build, then run them all
# CTest runs `build` once and `run` per test (labels tsan and fuzz; the list is repeated in
# tests/CMakeLists.txt). The tests: thread_pool_test, shm_segment_test, state_test,
# optimizer_test (update worker), reducer_test (gradient rings, the engine in process: aborts,
# streamed layers, torn state), checkpoint_test (the checkpointer's writer and pool threads beside
# the update worker; its address-space-limit case is compiled out under sanitizers, whose shadow
# memory the limit cannot leave room for) and engine_test (the engine behind its gRPC service with
# in-process RankClients: attach, steps, overlapping steps on every route, aborts, sessions,
# checkpoints, client-layer uploads; every case, no filter: 7-14 s each on 2 cores, 13-26 s with
# two busy loops beside them).
# engine_test's RankClient maps the segments hostd created in the same process. TSan keys its
# state by virtual address, so with a second mapping a release on hostd's copy of a word and an
# acquire on the rank's would be two unrelated words, and it reported what they order (the
# checksum after WaitStep) as races. In a TSan build ShmSegment therefore keeps one mapping per
# file and process (common/shm_segment.h): the rank's Open returns hostd's mapping, and every
# shared-memory word has one address. The ranks of the multi-process tests are unaffected.
# What gRPC hands between its threads (a request to its handler, a reply to the caller) is
# invisible too, so what the test reads of the engine after an RPC must be ordered by something
# TSan sees: Engine's state(), worker() and reducer() read under its mutex.
# Debian's abseil, gRPC and protobuf are not instrumented. absl::Mutex guards most of hostd's
# state, and TSan cannot see a lock taken inside an uninstrumented library (every guarded access
# would be reported), so `build` also compiles abseil's synchronization library (the 20220623.1
# sources of Debian's libabsl_synchronization, vendored in third_party/absl_tsan) with
# -fsanitize=thread into $BUILD/absl-tsan, and `run` puts it first on LD_LIBRARY_PATH: the same
# ABI, with absl's TSan annotations. scripts/tsan.supp suppresses what TSan still cannot see
# inside the uninstrumented libraries (each entry says why); our own code has no suppression.
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=$PWD
BUILD=${TSAN_BUILD_DIR:-build-tsan}
TESTS=(thread_pool_test shm_segment_test state_test optimizer_test reducer_test checkpoint_test
  engine_test)

build() {
  export CCACHE_BASEDIR=$SRC CCACHE_NOHASHDIR=1
  if [ ! -f "$BUILD/build.ninja" ]; then
    # g++ warns that TSan does not model atomic_thread_fence (rankclient's seqlock read uses
    # one): a warning, not an error, here.
    cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSLIDEDP_TSAN=ON -DSLIDEDP_WERROR=ON \
      -DSLIDEDP_CUDA=OFF -DCMAKE_CXX_FLAGS=-Wno-error=tsan >/dev/null
  fi
  cmake --build "$BUILD" --target "${TESTS[@]}" -j "${JOBS:-2}"
  local lib=$BUILD/absl-tsan/libabsl_synchronization.so.20220623 src=third_party/absl_tsan
  if [ ! -f "$lib" ] || [ -n "$(find "$src" -newer "$lib" -name '*.cc')" ]; then
    mkdir -p "$BUILD/absl-tsan"
    g++ -std=c++17 -O1 -g -fPIC -fsanitize=thread -shared \
      -Wl,-soname,libabsl_synchronization.so.20220623 -o "$lib" \
      "$src"/barrier.cc "$src"/blocking_counter.cc "$src"/notification.cc "$src"/mutex.cc \
      "$src"/internal/create_thread_identity.cc "$src"/internal/per_thread_sem.cc \
      "$src"/internal/waiter.cc -labsl_graphcycles_internal -labsl_stacktrace \
      -labsl_symbolize -labsl_time -labsl_malloc_internal -labsl_base -labsl_spinlock_wait \
      -labsl_raw_logging_internal
  fi
}

run() {
  local t=$1 bin
  bin=$(find "$BUILD" -name "$t" -type f -perm -u+x | head -1)
  [ -n "$bin" ] || { echo "tsan.sh: $t is not built (scripts/tsan.sh build)" >&2; exit 2; }
  # halt_on_error: a report fails the test even when the assertions pass; second_deadlock_stack
  # for lock-order reports; the TSan exit code is 66.
  local absl_dir
  absl_dir=$(cd "$BUILD/absl-tsan" && pwd)
  LD_LIBRARY_PATH="$absl_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
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
