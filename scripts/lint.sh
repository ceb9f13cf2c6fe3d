#!/usr/bin/env bash
# Lint and format checks: ruff (lint + format) over the Python code, clang-format over the C++/CUDA code.
# Changes nothing: prints what it would change and exits non-zero when something is off; then prints the
# largest modules of vpaged/ and their line counts (a report: it never fails the run).
#
#   scripts/lint.sh          check
#   scripts/lint.sh --fix    apply ruff's fixes and both formatters instead
#
# ruff and clang-format (pinned: formatting must not change with a new release) come from PyPI into the venv
# (.venv, or $VPAGED_VENV) when they are missing there.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VPAGED_VENV:-$ROOT/.venv}"
cd "$ROOT"
if [ ! -x "$VENV/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$VENV"
fi
if [ ! -x "$VENV/bin/ruff" ] || [ ! -x "$VENV/bin/clang-format" ]; then
  echo "==> installing ruff and clang-format into $VENV"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "ruff==0.17.6" "clang-format==23.1.5"
fi
RUFF="$VENV/bin/ruff"
CLANG_FORMAT="$VENV/bin/clang-format"
mapfile -t CXX < <(git ls-files 'csrc/*.cpp' 'csrc/*.h' 'csrc/*.cu' 'csrc/*.cuh' 'benchmarks/csrc/*.cpp' 'tests/fake_cuda/*.cpp')

if [ "${1:-}" = "--fix" ]; then
  # Format first, then apply the fixable lint rules; what ruff cannot fix is reported by the check below.
  "$RUFF" format .
  "$CLANG_FORMAT" -i "${CXX[@]}"
  "$RUFF" check --fix . || true
  exec "$0"
fi

status=0
echo "==> ruff check"
"$RUFF" check . || status=1
echo "==> ruff format --check"
"$RUFF" format --check . || status=1
echo "==> clang-format --dry-run -Werror (${#CXX[@]} files)"
"$CLANG_FORMAT" --dry-run -Werror "${CXX[@]}" || status=1
# A report, not a gate: modules are split by concern, not by a line cap; the largest are worth a look.
echo "==> largest modules (lines)"
find vpaged -name '*.py' -exec wc -l {} + | grep -v ' total$' | sort -rn | head -n "${LINT_REPORT_MODULES:-10}" || true
((status == 0)) && echo "lint: clean"
exit $status
