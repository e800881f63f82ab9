#!/usr/bin/env bash
# Install DeepSpeed (pure-python wheel built with DS_BUILD_OPS=0; its ops, DeepSpeedCPUAdam among
# them, JIT-compile on first use) and the dependencies the GPU machine's Python lacks, offline,
# from a folder of wheels, into a target folder that run.py puts on PYTHONPATH of its deepspeed
# children only (the Python environment itself is left alone).
#
#   bench/hf_head_to_head/install_deepspeed.sh WHEELDIR [TARGET]
#       WHEELDIR  e.g. .carry/ds_wheels (deepspeed-*.whl, hjson, pydantic, pydantic_core cp312, ...)
#       TARGET    default: <repo>/.carry/ds_site (run.py's default --ds-path)
#   PYTHON=/opt/torch/.venv/bin/python3 by default (the interpreter that will import it).
#
# Every wheel in WHEELDIR is installed with --no-deps; torch, numpy, packaging, tqdm come from the
# interpreter's own environment. prepare_ds_wheels.sh (next to this script) rebuilds WHEELDIR from PyPI.
set -euo pipefail
WHEELDIR=${1:?usage: install_deepspeed.sh WHEELDIR [TARGET]}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
TARGET=${2:-$REPO/.carry/ds_site}
if [ -z "${PYTHON:-}" ]; then
  if [ -x /opt/torch/.venv/bin/python3 ]; then PYTHON=/opt/torch/.venv/bin/python3; else PYTHON=python3; fi
fi
WHEELDIR=$(cd "$WHEELDIR" && pwd)
shopt -s nullglob
wheels=("$WHEELDIR"/*.whl)
[ ${#wheels[@]} -gt 0 ] || { echo "no wheels in $WHEELDIR" >&2; exit 2; }
mkdir -p "$TARGET"
echo "installing ${#wheels[@]} wheels from $WHEELDIR into $TARGET for $("$PYTHON" -c 'import sys; print(sys.executable, sys.version.split()[0])')"

if "$PYTHON" -m pip --version >/dev/null 2>&1; then
  "$PYTHON" -m pip install --no-index --no-deps --no-compile --disable-pip-version-check \
      --upgrade --target "$TARGET" "${wheels[@]}"
else
  # no pip in that environment: a wheel is a zip laid out for site-packages (none of these
  # needs its .data scripts), so unpacking it is an install
  echo "no pip for $PYTHON: unpacking the wheels"
  for w in "${wheels[@]}"; do "$PYTHON" -m zipfile -e "$w" "$TARGET"; done
fi
# torch's cpp_extension runs `ninja` from PATH (run.py puts TARGET/bin there): pip writes that entry
# script, an unpacked wheel does not, so point TARGET/bin/ninja at the wheel's binary then
if [ ! -e "$TARGET/bin/ninja" ] && [ -x "$TARGET/ninja/data/bin/ninja" ]; then
  mkdir -p "$TARGET/bin" && ln -s ../ninja/data/bin/ninja "$TARGET/bin/ninja"
fi

# check: the pure-python part imports (the cpu_adam op is only compiled by the first deepspeed run)
PYTHONPATH="$TARGET${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" - <<'EOF'
import importlib
for m in ("hjson", "pydantic", "pydantic_core", "psutil", "msgpack", "cpuinfo", "einops"):
    importlib.import_module(m)
try:
    import torch  # noqa: F401
except ImportError:
    print("torch not importable here: deepspeed import not checked")
else:
    import deepspeed
    print("deepspeed", deepspeed.__version__, "from", deepspeed.__file__)
    from deepspeed.ops.op_builder import CPUAdamBuilder
    b = CPUAdamBuilder()
    print("cpu_adam op compatible here:", b.is_compatible(verbose=True))
EOF
echo "done: run.py --ds-path $TARGET (or leave it at the default when TARGET is <repo>/.carry/ds_site)"
