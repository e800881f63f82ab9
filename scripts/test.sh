#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs dependencies, builds, runs every CTest label
# (unit, integration, fault, python, fuzz; gpu tests skip without a GPU).
# Extra arguments go to ctest, e.g. scripts/test.sh -L unit
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
scripts/bootstrap_python.sh
scripts/build.sh
ctest --test-dir "${BUILD_DIR:-build}" --output-on-failure -j "${JOBS:-2}" "$@"
