#!/usr/bin/env bash
# Creates .venv (if missing) with vpaged's run-time and test dependencies and builds vpaged into it.
# Sourced by scripts/test.sh and scripts/demo.sh; safe to run again (it only rebuilds what changed).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VPAGED_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "==> creating $VENV"
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
# The CPU build of torch: a bare 'torch' requirement would pull a multi-GB CUDA build.
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "==> installing torch (CPU)"
  "${PIP[@]}" "torch==${VPAGED_TORCH_VERSION:-2.13.0}"
fi
echo "==> installing build and test dependencies"
"${PIP[@]}" numpy pybind11 "setuptools>=64" wheel pytest hypothesis rich "transformers>=5,<6" \
  fastapi uvicorn openai httpx
echo "==> building vpaged"
"${PIP[@]}" --no-build-isolation --no-deps -e "$ROOT"
