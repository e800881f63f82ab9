#!/usr/bin/env bash
# Creates the project's Python environment (.venv) with torch for the parity tests and the
# Python client. Idempotent: an environment that already imports torch is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SLIDEDP_VENV:-.venv}
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import torch, numpy, transformers, safetensors, highspy" 2>/dev/null; then
  exit 0
fi
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --no-cache-dir --upgrade pip
"$VENV/bin/pip" install -q --no-cache-dir torch numpy transformers safetensors highspy
