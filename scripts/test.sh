#!/usr/bin/env bash
# The test command: sets up .venv and the build, then runs the whole suite (GPU tests skip without a GPU).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
"$VENV/bin/python" -m pytest -q -ra "$@"
