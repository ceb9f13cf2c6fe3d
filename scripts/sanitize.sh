#!/usr/bin/env bash
# AddressSanitizer + UndefinedBehaviorSanitizer run of the C++ core: builds vpaged._C with
# -fsanitize=address,undefined into build/sanitize/ (apart from the normal build, which stays as it is) and
# runs the C++-heavy tests against it: ranges, caches, sharing, regressions, the shared budget's ledger (its
# SIGBUS guard against a truncated segment included), file pages mapped from a page store (the same guard
# against a data file cut short), the CUDA backend through the fake
# driver. Any sanitizer report fails the run (UBSan errors are fatal, ASan aborts on the first error).
#
#   scripts/sanitize.sh [extra pytest arguments]
#
# Uses the venv of scripts/setup_env.sh (run that first). The extension is compiled here with g++ directly,
# not through setup.py: it includes the CUDA backend (it needs only cuda.h; the tests drive it through the
# fake driver) but not the CUDA kernels, which run on GPUs only and would cost nvcc minutes. Objects are
# kept in build/sanitize/ and rebuilt when their source or a header changed. VPAGED_CUDA=0 builds without
# the CUDA backend (the fake-driver tests then skip). Python itself is not instrumented, so the ASan runtime
# is preloaded and leak detection is off (the interpreter keeps memory until exit by design).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VPAGED_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
OUT="$ROOT/build/sanitize"
CXX="${CXX:-g++}"
cd "$ROOT"
START=$(date +%s)

SAN=(-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer)
FLAGS=(-std=c++17 -O1 -g -fPIC -fvisibility=hidden -fopenmp "${SAN[@]}" -Icsrc
  -I"$("$PY" -c 'import pybind11; print(pybind11.get_include())')"
  -I"$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')")
CUDA_FLAGS=()
if [ "${VPAGED_CUDA:-1}" != 0 ]; then
  for home in "${CUDA_HOME:-}" /usr/local/cuda /usr/local/cuda-*; do
    if [ -n "$home" ] && [ -f "$home/include/cuda.h" ]; then
      CUDA_FLAGS=(-DVPAGED_WITH_CUDA=1 -I"$home/include")
      break
    fi
  done
fi
echo "==> building vpaged._C with ${SAN[*]} into $OUT (${CUDA_FLAGS[0]:-no CUDA backend})"
mkdir -p "$OUT/obj" "$OUT/pkg/vpaged"
NEWEST_HEADER=$(find csrc -name '*.h' -printf '%T@\n' | sort -n | tail -1)
OBJECTS=()
TODO=()
while IFS= read -r src; do
  obj="$OUT/obj/${src//\//_}.o"
  OBJECTS+=("$obj")
  if [ ! -f "$obj" ] || [ "$src" -nt "$obj" ] ||
    [ "$(printf '%.0f' "$NEWEST_HEADER")" -gt "$(stat -c %Y "$obj")" ]; then
    TODO+=("$src")
  fi
done < <(find csrc -name '*.cpp' | sort)
compile() { # the kernels' CUDA half is left out: csrc/kernels/*.cpp are built as in a CPU-only build (their
  # CUDA entry points then raise BackendUnavailable, as in a build without nvcc)
  local src=$1 obj="$OUT/obj/${1//\//_}.o" extra=()
  [[ $src == csrc/kernels/* ]] || extra=("${CUDA_FLAGS[@]}")
  echo "    $src"
  "$CXX" "${FLAGS[@]}" "${extra[@]}" -c "$src" -o "$obj"
}
export -f compile
export OUT CXX
export FLAGS_STR="${FLAGS[*]}" CUDA_STR="${CUDA_FLAGS[*]}"
for src in "${TODO[@]}"; do echo "$src"; done |
  xargs -r -P "${SANITIZE_JOBS:-2}" -I{} bash -c 'FLAGS=($FLAGS_STR); CUDA_FLAGS=($CUDA_STR); compile "$1"' _ {}
EXT="$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
"$CXX" -shared "${SAN[@]}" -fopenmp "${OBJECTS[@]}" -ldl -o "$OUT/pkg/vpaged/_C$EXT"
# A package of the sources (links) and the instrumented extension, found before the normal build.
for f in vpaged/*.py vpaged/*.pyi; do ln -sf "$ROOT/$f" "$OUT/pkg/vpaged/"; done
for d in vpaged/*/; do [ "$(basename "$d")" = __pycache__ ] || ln -sfn "$ROOT/${d%/}" "$OUT/pkg/${d%/}"; done
echo "==> built in $(($(date +%s) - START)) s"

# libstdc++ is preloaded too: python does not link it, and ASan must find the real __cxa_throw at start-up
# to intercept C++ exceptions (otherwise the first exception the extension throws aborts the process).
ASAN_RT="$("$CXX" -print-file-name=libasan.so):$("$CXX" -print-file-name=libstdc++.so)"
export LD_PRELOAD="$ASAN_RT${LD_PRELOAD:+:$LD_PRELOAD}"
# handle_sigbus=0: the budget ledger (csrc/bindings/shm_ledger.cpp) installs its own SIGBUS handler, which
# turns an access past a truncated segment into BudgetCorruptError; ASan must leave that signal to it.
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:allocator_may_return_null=1:handle_segv=0:handle_sigbus=0:${ASAN_OPTIONS:-}"
# The ledger fault test kills workers mid-change this many times (400 by default; fewer under ASan's cost).
export VPAGED_LEDGER_KILLS="${VPAGED_LEDGER_KILLS:-100}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:${UBSAN_OPTIONS:-}"
export PYTHONPATH="$OUT/pkg${PYTHONPATH:+:$PYTHONPATH}"
# From $OUT: `python -m` puts the working directory first on sys.path, and the checkout's vpaged/ (with the
# normal build) must not shadow the instrumented package.
cd "$OUT"
"$PY" -c "import vpaged._C as C; assert C.__file__.startswith('$OUT/pkg'), C.__file__; print('==> testing', C.__file__)"
T="$ROOT/tests"
"$PY" -m pytest -q -p no:cacheprovider --rootdir "$ROOT" "$T/memory/test_range.py" "$T/kvcache/test_cache.py" "$T/kvcache/test_cache_parts.py" \
  "$T/kvcache/test_sharing.py" "$T/kvcache/test_sharing_stateful.py" "$T/kvcache/test_regressions.py" "$T/kvcache/test_reliability.py" \
  "$T/memory/test_cuda_backend_fake.py" "$T/kvcache/test_paged_cache.py" "$T/ops/test_write_kv.py" "$T/ops/test_decode_kernels.py" \
  "$T/ops/test_decode_amx.py" "$T/ops/test_decode_paged_steps.py" "$T/ops/test_fused_ops.py" \
  "$T/ops/test_fused_residual_rotary.py" "$T/ops/test_linear.py" "$T/memory/test_pool_keep_freed.py" \
  "$T/memory/test_budget_ledger_faults.py" "$T/memory/test_shared_budget.py" "$T/memory/test_file_pages.py" \
  "$T/kvcache/test_prefix_store_cache.py" "$@"
echo "==> sanitizers clean ($(($(date +%s) - START)) s in all)"
