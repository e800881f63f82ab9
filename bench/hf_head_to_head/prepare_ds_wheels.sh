#!/usr/bin/env bash
# Rebuild the offline DeepSpeed wheel folder (default .carry/ds_wheels, gitignored) that
# install_deepspeed.sh installs on the GPU machine (Python 3.12, x86_64, no network). Run on a machine
# with network, from anywhere:
#
#   bench/hf_head_to_head/prepare_ds_wheels.sh [OUTDIR]
#     PY=.venv/bin/python   an interpreter with pip and torch (DeepSpeed's setup.py imports torch;
#                           with DS_BUILD_OPS=0 nothing is compiled, so its torch/Python versions do
#                           not matter: the wheel is py3-none-any)
#     DS_VERSION=0.19.8     the DeepSpeed release (0.19.x supports torch 2.11)
#
# DeepSpeed is an sdist on PyPI: built here into a pure-python wheel (DS_BUILD_OPS=0: its ops,
# DeepSpeedCPUAdam among them, JIT-compile on first use on the GPU machine). Its dependencies that
# the GPU machine's Python may lack are downloaded as cp312 manylinux x86_64 (or pure) wheels; every
# one is installed --no-deps there, into a folder only the deepspeed children see, so an older copy
# in that Python (typing_extensions, psutil) is not touched. torch, numpy, packaging, tqdm come from
# that Python (transformers needs them too).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
OUTDIR=${1:-$REPO/.carry/ds_wheels}
PY=${PY:-$REPO/.venv/bin/python}
DS_VERSION=${DS_VERSION:-0.19.8}
# install_requires of deepspeed 0.19 (hjson, pydantic>=2, py-cpuinfo, msgpack, ninja, einops, psutil,
# nvidia-ml-py; numpy, packaging, torch, tqdm left out) plus pydantic's own requirements
DEPS=(hjson pydantic pydantic_core annotated_types typing_inspection typing_extensions py-cpuinfo msgpack ninja
      einops psutil nvidia-ml-py)
mkdir -p "$OUTDIR"
rm -f "$OUTDIR"/*.whl
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT

# 1. deepspeed: sdist -> py3-none-any wheel. --no-build-isolation: the build uses $PY's torch
#    (an isolated build would download torch, ~1 GB).
DS_BUILD_OPS=0 DS_BUILD_STRING="" "$PY" -m pip wheel --no-deps --no-build-isolation --no-binary deepspeed \
  --wheel-dir "$W" "deepspeed==$DS_VERSION"
cp "$W"/deepspeed-*-py3-none-any.whl "$OUTDIR"/
# what the built wheel requires (to compare with DEPS when DS_VERSION changes)
"$PY" - "$OUTDIR"/deepspeed-*.whl <<'EOF'
import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
print("deepspeed requires:", ", ".join(l.split(":", 1)[1].strip() for l in z.read(meta).decode().splitlines()
                                       if l.startswith("Requires-Dist:") and "extra ==" not in l))
EOF

# 2. its dependencies, for CPython 3.12 on x86_64 Linux, binary wheels only (pure ones are py3-none-any)
"$PY" -m pip download --only-binary=:all: --no-deps --python-version 3.12 --implementation cp --abi cp312 \
  --abi abi3 --abi none --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_5_x86_64 --platform any \
  --dest "$OUTDIR" "${DEPS[@]}"

# pydantic and pydantic_core are released in lockstep: the pydantic_core downloaded must be the one that
# pydantic pins (an unpinned download gets the newest, which that pydantic refuses to import)
pin=$(unzip -p "$OUTDIR"/pydantic-[0-9]*.whl '*.dist-info/METADATA' | sed -n 's/^Requires-Dist: pydantic-core==\([^ ;]*\).*/\1/p')
have=$(ls "$OUTDIR" | sed -n 's/^pydantic_core-\([^-]*\)-.*/\1/p')
if [ -n "$pin" ] && [ "$pin" != "$have" ]; then
  rm -f "$OUTDIR"/pydantic_core-*.whl
  "$PY" -m pip download --only-binary=:all: --no-deps --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --dest "$OUTDIR" "pydantic_core==$pin"
fi
ls -la "$OUTDIR"
du -sh "$OUTDIR"
