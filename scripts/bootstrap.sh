#!/usr/bin/env bash
# Installs everything SlideDP needs to build and test on Debian 12 / Ubuntu 24.04 (run as root or
# with sudo). Idempotent: packages already present are not reinstalled, so a second run is fast.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build pkg-config git python3 python3-venv
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libboost-dev libhwloc-dev libnuma-dev hwloc numactl
  libcli11-dev libspdlog-dev nlohmann-json3-dev libtomlplusplus-dev prometheus-cpp-dev
  libsystemd-dev libxxhash-dev libgtest-dev libgmock-dev libbenchmark-dev clang-format
  ccache patchelf
  clang-14 libclang-rt-14-dev clang-tidy-14 python3-grpcio
)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  echo "bootstrap: installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
