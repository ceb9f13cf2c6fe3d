#!/usr/bin/env bash
# Runs the transformers tests against each supported transformers release, each in its own environment.
#
#   scripts/test_transformers_versions.sh [VERSION ...]     (default: $VPAGED_HF_VERSIONS, else 5.17.0 5.24.0)
#
# 5.17.0 is the oldest release vpaged supports, 5.24.0 the newest tested (vpaged/hf/compat.py says why).
# Each environment, .venv-hf/<version>, holds only transformers and what it pulls in; torch, numpy, pytest and
# the vpaged build come from the main environment (.venv, or $VPAGED_VENV, made by scripts/setup_env.sh
# when missing) through a .pth file, so nothing is built twice and torch is not installed again. A second
# run finds each release installed and installs nothing. Extra arguments for pytest: $PYTEST_ARGS.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
BASE="${VPAGED_VENV:-$ROOT/.venv}"
if ! "$BASE/bin/python" -c "import torch, vpaged._C" 2>/dev/null; then
  source "$ROOT/scripts/setup_env.sh"
fi
VERSIONS=("$@")
if [ ${#VERSIONS[@]} -eq 0 ]; then
  read -r -a VERSIONS <<< "${VPAGED_HF_VERSIONS:-5.17.0 5.24.0}"
fi
# The serving tests too: the engine's greedy tokens against generate()'s on each release.
TESTS=(tests/hf/test_hf.py tests/hf/test_hf_models.py tests/hf/test_hf_compat.py tests/project/test_examples.py tests/cli/test_cli.py
  tests/serve/test_serve_engine.py tests/cli/test_cli_serve.py tests/serve/test_serve_server.py tests/serve/test_serve_stores.py
  tests/kvcache/test_prefix_geometry.py tests/ops/test_decode_support.py tests/serve/test_direct_forward.py)
BASE_PY="$("$BASE/bin/python" -c 'import sys; print(sys._base_executable)')"
BASE_SITE="$("$BASE/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"

failed=()
for version in "${VERSIONS[@]}"; do
  venv="$ROOT/.venv-hf/$version"
  echo "==> transformers $version ($venv)"
  if [ ! -x "$venv/bin/python" ]; then
    "$BASE_PY" -m venv "$venv"
  fi
  site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  # The repository first (the in-place build of vpaged, also for scripts run from examples/), then the main
  # environment, after this one's own packages: this environment's transformers wins over the main one's.
  printf '%s\n%s\n' "$ROOT" "$BASE_SITE" > "$site/_vpaged_main_env.pth"
  have="$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("transformers"))' 2>/dev/null || true)"
  if [ "$have" != "$version" ]; then
    echo "    installing transformers==$version"
    "$venv/bin/python" -m pip install -q --no-compile --disable-pip-version-check "transformers==$version" \
      2> >(grep -v -e "^WARNING: Location" -e "outside environment" -e "No files were found to uninstall" >&2)
  fi
  # shellcheck disable=SC2086
  if ! "$venv/bin/python" -m pytest -q -ra -p no:cacheprovider "${TESTS[@]}" ${PYTEST_ARGS:-}; then
    failed+=("$version")
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "transformers tests failed on: ${failed[*]}" >&2
  exit 1
fi
echo "transformers tests passed on: ${VERSIONS[*]}"
