#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs dependencies, builds, runs every CTest label
# (unit, integration, fault, python, fuzz, tsan, lint; gpu tests skip without a GPU). The fuzz,
# tsan and lint labels build their own trees (build-fuzz with clang, build-tsan, build-lint with
# clang) through scripts/fuzz.sh, scripts/tsan.sh and scripts/lint.sh.
# Extra arguments go to ctest, e.g. scripts/test.sh -L unit
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
scripts/bootstrap_python.sh
scripts/build.sh
# A user's build: the Release type, the project's defaults (no warnings as errors), no CUDA.
cmake -S . -B "${RELEASE_BUILD_DIR:-build-release}" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DSLIDEDP_CUDA=OFF >/dev/null
cmake --build "${RELEASE_BUILD_DIR:-build-release}" -j "${JOBS:-$(nproc)}"
ctest --test-dir "${BUILD_DIR:-build}" --output-on-failure -j "${JOBS:-2}" "$@"
