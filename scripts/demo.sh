#!/usr/bin/env bash
# Sets up .venv and the build, then runs `vpaged demo` (extra arguments go to the demo).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_env.sh"
"$VENV/bin/vpaged" demo "$@"
