#!/usr/bin/env bash
# Static checks in their own build tree, ${LINT_BUILD_DIR:-build-lint}: clang++-14, Debug at -O0,
# no CUDA, warnings as errors.
#
#   scripts/lint.sh build   configure if needed, build every target; clang's -Wthread-safety
#                           (cmake/SlidedpHelpers.cmake) checks the abseil lock annotations, so an
#                           unguarded access of an ABSL_GUARDED_BY member fails the build
#   scripts/lint.sh tidy    run-clang-tidy-14 (-j ${JOBS:-2}) with the root .clang-tidy over that
#                           tree's compile_commands.json; any finding fails
#   scripts/lint.sh [all]   build, then tidy
# CTest runs them as lint_build and lint_tidy (label lint, tests/CMakeLists.txt).
#
# tidy checks the project's own sources only: not third_party/, not the protobuf/gRPC files
# generated into the build tree, and not the *_test.cc files, which would double the run and keep
# CI time bounded only with a bigger budget (the headers they include are still checked through
# the product sources). The headers checked are the project's (HeaderFilterRegex in .clang-tidy).
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=$PWD
BUILD=${LINT_BUILD_DIR:-build-lint}

find_tool() {
  for c in "$@"; do
    if command -v "$c" >/dev/null; then
      echo "$c"
      return
    fi
  done
  echo "lint.sh: none of $* found (scripts/bootstrap.sh installs clang-14 clang-tidy-14)" >&2
  exit 2
}

build() {
  export CCACHE_BASEDIR=$SRC CCACHE_NOHASHDIR=1
  if [ ! -f "$BUILD/build.ninja" ]; then
    local cxx cc
    cxx=$(find_tool clang++-14 clang++)
    cc=${cxx/clang++/clang}
    # -O0 and no debug info: the binaries are never run, only compiled for their diagnostics.
    cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG=-O0 \
      -DCMAKE_C_FLAGS_DEBUG=-O0 -DCMAKE_C_COMPILER="$cc" -DCMAKE_CXX_COMPILER="$cxx" \
      -DSLIDEDP_CUDA=OFF -DSLIDEDP_WERROR=ON -DCMAKE_EXPORT_COMPILE_COMMANDS=ON >/dev/null
  fi
  cmake --build "$BUILD" -j "${JOBS:-2}"
}

tidy() {
  local runner
  runner=$(find_tool run-clang-tidy-14 run-clang-tidy)
  [ -f "$BUILD/compile_commands.json" ] ||
    { echo "lint.sh: $BUILD/compile_commands.json missing (scripts/lint.sh build)" >&2; exit 2; }
  # The generated protobuf/gRPC headers must exist before the sources including them are parsed.
  cmake --build "$BUILD" --target slidedp_proto -j "${JOBS:-2}" >/dev/null
  # run-clang-tidy takes the whole database; the sources to check go into a filtered copy.
  local db=$BUILD/lint-db
  mkdir -p "$db"
  python3 - "$SRC" "$BUILD/compile_commands.json" "$db/compile_commands.json" <<'EOF'
import json, os, sys
src, inp, out = sys.argv[1], sys.argv[2], sys.argv[3]
src = os.path.realpath(src)
keep = []
for e in json.load(open(inp)):
    f = os.path.realpath(os.path.join(e["directory"], e["file"]))
    rel = os.path.relpath(f, src)
    if rel.startswith("..") or rel.startswith("third_party/") or rel.startswith("build"):
        continue
    if rel.endswith("_test.cc"):
        continue
    keep.append(e)
json.dump(keep, open(out, "w"), indent=1)
print(f"lint.sh: clang-tidy over {len(keep)} sources", file=sys.stderr)
EOF
  "$runner" -quiet -p "$db" -j "${JOBS:-2}" -clang-tidy-binary "$(find_tool clang-tidy-14 clang-tidy)"
}

case "${1:-all}" in
  build) build ;;
  tidy) tidy ;;
  all)
    build
    tidy
    ;;
  *)
    echo "usage: scripts/lint.sh build|tidy|all" >&2
    exit 2
    ;;
esac
