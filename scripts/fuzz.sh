#!/usr/bin/env bash
# libFuzzer targets (tests/fuzz/) in their own build tree, ${FUZZ_BUILD_DIR:-build-fuzz}: clang with
# -fsanitize=fuzzer-no-link,address,undefined for every library, -fsanitize=fuzzer for the
# targets. Configured on first use, rebuilt incrementally (with ccache) afterwards.
#
#   scripts/fuzz.sh build                  configure if needed, build the targets
#   scripts/fuzz.sh run TARGET [SECONDS]   the target's regression inputs (tests/fuzz/regressions/TARGET,
#                                          each must pass), then fuzzing for SECONDS (default 60)
#                                          from the checked-in seeds (tests/fuzz/corpus/TARGET) and the
#                                          corpus grown in the build tree; a crash fails the run
#                                          and leaves its input in BUILD/artifacts/TARGET/
#   scripts/fuzz.sh [SECONDS]              build, then run every target
# CTest runs `build` once and `run` per target (label fuzz).
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=$PWD
BUILD=${FUZZ_BUILD_DIR:-build-fuzz}
TARGETS=(fuzz_safetensors fuzz_config fuzz_shm fuzz_rpc)

find_clang() {
  for c in clang++-14 clang++; do
    if command -v "$c" >/dev/null; then
      echo "$c"
      return
    fi
  done
  echo "fuzz.sh: clang++ not found (scripts/bootstrap.sh installs clang-14 libclang-rt-14-dev)" >&2
  exit 2
}

build() {
  if [ ! -f "$BUILD/build.ninja" ]; then
    local cxx cc
    cxx=$(find_clang)
    cc=${cxx/clang++/clang}
    export CCACHE_BASEDIR=$SRC CCACHE_NOHASHDIR=1
    # No CUDA, no -Werror: warnings of other clang versions must not fail the fuzz build.
    cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DCMAKE_C_COMPILER="$cc" -DCMAKE_CXX_COMPILER="$cxx" -DSLIDEDP_FUZZ=ON \
      -DSLIDEDP_CUDA=OFF -DSLIDEDP_WERROR=OFF >/dev/null
  fi
  CCACHE_BASEDIR=$SRC CCACHE_NOHASHDIR=1 cmake --build "$BUILD" --target fuzz_all -j "${JOBS:-2}"
}

run() {
  local t=$1 secs=${2:-60}
  local bin=$BUILD/tests/fuzz/$t
  [ -x "$bin" ] || { echo "fuzz.sh: $bin is not built (scripts/fuzz.sh build)" >&2; exit 2; }
  local work=$BUILD/corpus/$t artifacts=$BUILD/artifacts/$t/
  mkdir -p "$work" "$artifacts"
  local opts=(-timeout=30 -rss_limit_mb=4096 -artifact_prefix="$artifacts" -print_final_stats=1)
  [ -f "tests/fuzz/dict/$t.dict" ] && opts+=(-dict="tests/fuzz/dict/$t.dict")
  # Inputs that once crashed, fixed since: each runs once and must pass.
  if compgen -G "tests/fuzz/regressions/$t/*" >/dev/null; then
    echo "== $t: regression inputs"
    "$bin" "${opts[@]}" tests/fuzz/regressions/$t/*
  fi
  echo "== $t: fuzzing for ${secs}s"
  local seeds=()
  [ -d "tests/fuzz/corpus/$t" ] && seeds=("tests/fuzz/corpus/$t")
  if ! "$bin" "${opts[@]}" -max_total_time="$secs" "$work" "${seeds[@]}"; then
    echo "fuzz.sh: $t failed; reproduce with $bin $artifacts<crash file>; once fixed, check the" \
      "input in under tests/fuzz/regressions/$t/" >&2
    exit 1
  fi
}

case "${1:-all}" in
  build) build ;;
  run) run "$2" "${3:-60}" ;;
  *)
    secs=${1:-60}
    [ "$secs" = all ] && secs=60
    build
    for t in "${TARGETS[@]}"; do run "$t" "$secs"; done
    ;;
esac
