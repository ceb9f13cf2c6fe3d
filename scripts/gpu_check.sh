#!/usr/bin/env bash
# The one-shot check for a lent GPU machine (an H200 with torch+CUDA, nvcc, pybind11, cuda-bindings and
# no internet): build vpaged in place, show the GPU, run the GPU tests and the GPU benchmarks, and leave a
# log and JSON behind. Finishes within ~6 minutes: every stage has a time limit, and a stage that fails
# does not stop the later ones.
#
#   scripts/gpu_check.sh [OUT_DIR]
#
# OUT_DIR: the first argument, else $OUT, else benchmarks/results/gpu-<UTC date>. It receives:
#   gpu_check.log   everything printed
#   summary.json    each stage's status and time, every GPU test's outcome, each benchmark's goals
#   <bench>.json    what each GPU benchmark wrote to benchmarks/results/ during the run
# Exit status: 0 when every stage passed; 1 when a stage failed, timed out or had no time left.
#
# GPU tests: everything marked `gpu` under tests/ (pytest -m gpu). GPU benchmarks: benchmarks/bench_*cuda*.py,
# benchmarks/bench_*gpu*.py and bench_decode.py (with --device cuda), each run as
# `python FILE $GPU_BENCH_ARGS` (default --quick); a benchmark
# writes its JSON with benchmarks/common.write_json, and the files it wrote are copied to OUT_DIR.
#
# Settings (environment): PYTHON (default python3), GPU_CHECK_BUDGET_S (total seconds, default 345),
# GPU_BENCHES (space-separated benchmark files instead of the pattern), GPU_BENCH_ARGS, VPAGED_CUDA_ARCHS
# (default 90: Hopper only, to save build time).
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
START=$(date +%s)
BUDGET=${GPU_CHECK_BUDGET_S:-345}
DEADLINE=$((START + BUDGET - 20)) # the last 20 s are kept for the report
PY=${PYTHON:-python3}
OUT_DIR=${1:-${OUT:-$ROOT/benchmarks/results/gpu-$(date -u +%Y%m%d-%H%M%S)}}
mkdir -p "$OUT_DIR" || { echo "gpu_check: cannot create $OUT_DIR" >&2; exit 1; }
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
WORK="$(mktemp -d)"
LOG="$OUT_DIR/gpu_check.log"

# Everything printed from here on goes to the terminal and to the log.
exec 3>&1 4>&2
exec > >(tee -a "$LOG") 2>&1
TEE_PID=$!

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" # the in-place build, from any working directory
export PYTHONUNBUFFERED=1
export VPAGED_CUDA_ARCHS=${VPAGED_CUDA_ARCHS:-90}
export PY ROOT OUT_DIR WORK

STAGE_NAMES=()
STAGE_STATUS=()
STAGE_SECONDS=()
STAGE_NOTES=()
FAILED=0

# run_stage NAME CAP_SECONDS COMMAND: run COMMAND (a bash string) for at most CAP_SECONDS, or what is left
# of the budget, and record how it went.
run_stage() {
  local name=$1 cap=$2 cmd=$3
  local left=$((DEADLINE - $(date +%s)))
  local limit=$((cap < left ? cap : left))
  local status note="" t0 t1 rc
  echo
  echo "=== [$name] $(date -u +%H:%M:%S), limit ${limit}s"
  [[ $cmd == *$'\n'* ]] || echo "\$ $cmd"
  if ((limit < 10)); then
    status="no-time"
    note="skipped: ${left}s of the budget left"
    rc=124
    t0=$(date +%s)
  else
    t0=$(date +%s)
    timeout -k 10 "$limit" bash -c "$cmd"
    rc=$?
    if ((rc == 0)); then
      status="ok"
    elif ((rc == 124 || rc == 137)); then
      status="timeout"
      note="stopped after ${limit}s"
    else
      status="failed"
      note="exit status $rc"
    fi
  fi
  t1=$(date +%s)
  ((rc == 0)) || FAILED=$((FAILED + 1))
  STAGE_NAMES+=("$name")
  STAGE_STATUS+=("$status")
  STAGE_SECONDS+=($((t1 - t0)))
  STAGE_NOTES+=("$note")
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$((t1 - t0))" "$note" >>"$WORK/stages.tsv"
  echo "=== [$name] $status ($((t1 - t0))s)${note:+: $note}"
}

COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo "no git")
echo "gpu_check: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname), repo $ROOT ($COMMIT), output $OUT_DIR"

run_stage env 40 '
  nvidia-smi --format=csv --query-gpu=index,name,driver_version,memory.total,memory.used,temperature.gpu,\
utilization.gpu,clocks.sm,clocks.max.sm,power.draw
  smi=$?
  nvidia-smi -L
  command -v nvcc >/dev/null && nvcc --version | tail -n 2
  "$PY" - <<"EOF"
import importlib.metadata as md, platform, torch
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-"
print("python", platform.python_version(), "| torch", torch.__version__, "| torch CUDA", torch.version.cuda,
      "| cuda available", torch.cuda.is_available(), "|", gpu)
for name in ("pybind11", "setuptools", "cuda-bindings", "cuda-python", "numpy", "transformers", "pytest"):
    try:
        print(f"  {name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"  {name} not installed")
EOF
  exit $smi'

# In place, without build isolation (no internet): the C++/CUDA extension lands next to the sources.
run_stage build 200 '
  "$PY" setup.py build_ext --inplace || exit 1
  "$PY" -c "import sys, vpaged._C as C; print(\"CUDA:\", C.built_with_cuda()); sys.exit(not C.built_with_cuda())"'

run_stage probe 60 '
  "$PY" - <<"EOF"
import sys, torch, vpaged
for name, info in vpaged.backends().items():
    print(f"  {name}: usable={info.usable} granularity={info.granularity} devices={info.devices} {info.reason}")
cuda = vpaged.backends()["cuda"]
if not (cuda.usable and torch.cuda.is_available()):
    sys.exit("CUDA is not usable here: " + (cuda.reason or "torch has no CUDA"))
EOF'

PYTEST_ARGS="-m gpu -v -rs -p no:cacheprovider --junitxml=$WORK/junit.xml"
if "$PY" -c "import pytest_timeout" 2>/dev/null; then
  PYTEST_ARGS="$PYTEST_ARGS --timeout=120"
fi
run_stage tests 170 "\"\$PY\" -m pytest $PYTEST_ARGS tests/"

if [ -n "${GPU_BENCHES:-}" ]; then
  read -r -a BENCHES <<<"$GPU_BENCHES"
else
  mapfile -t BENCHES < <(ls benchmarks/bench_*cuda*.py benchmarks/bench_*gpu*.py 2>/dev/null | sort -u)
  BENCHES+=(benchmarks/bench_decode.py) # decode kernels: contiguous-on-VMM vs block table vs SDPA
fi
export GPU_BENCH_ARGS=${GPU_BENCH_ARGS:---quick}
for bench in "${BENCHES[@]}"; do
  touch "$WORK/before-bench"
  sleep 1 # so that a file the benchmark writes is strictly newer than the marker
  extra=""
  [ "$(basename "$bench")" = bench_decode.py ] && extra="--device cuda"
  run_stage "bench:$(basename "$bench" .py)" 150 "\"\$PY\" \"$bench\" \$GPU_BENCH_ARGS $extra"
  find benchmarks/results -maxdepth 1 -name '*.json' -newer "$WORK/before-bench" -exec cp {} "$OUT_DIR/" \;
done
((${#BENCHES[@]})) || echo "gpu_check: no GPU benchmarks found (benchmarks/bench_*cuda*.py, bench_*gpu*.py)"

# Report: summary.json, then the table of stages (last).
echo
echo "=== [report]"
timeout 30 "$PY" - <<'EOF' || echo "gpu_check: the report step failed; summary.json holds the stages only"
import json, os, socket, sys, time
import xml.etree.ElementTree as ET
from pathlib import Path

out, work = Path(os.environ["OUT_DIR"]), Path(os.environ["WORK"])
stages = []
for line in (work / "stages.tsv").read_text().splitlines():
    name, status, rc, seconds, note = (line.split("\t") + [""] * 5)[:5]
    stages.append({"stage": name, "status": status, "exit": int(rc), "seconds": int(seconds), "note": note})
summary = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "host": socket.gethostname(),
           "stages": stages, "ok": all(s["status"] == "ok" for s in stages)}
junit = work / "junit.xml"
if junit.is_file():
    tests, counts = {}, {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    for case in ET.parse(junit).iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = (el.get("message") or "")[:300]
                break
        counts[outcome] += 1
        tests[name] = outcome if not message else f"{outcome}: {message}"
    summary["tests"] = {"counts": counts, "outcomes": tests}
    print(f"tests (-m gpu): {counts['passed']} passed, {counts['failed']} failed, {counts['error']} errors, "
          f"{counts['skipped']} skipped")
    skips = {}
    for name, outcome in tests.items():
        if outcome.startswith("skipped"):
            skips[outcome] = skips.get(outcome, 0) + 1
        elif not outcome.startswith("passed"):
            print(f"  {name}: {outcome}")
    for reason, n in sorted(skips.items(), key=lambda kv: -kv[1]):
        print(f"  {n} {reason}")
benches = {}
for path in sorted(out.glob("*.json")):
    if path.name == "summary.json":
        continue
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        benches[path.name] = {"unreadable": str(e)}
        continue
    benches[path.name] = {k: data[k] for k in ("goals", "failed_parts", "gpu") if k in data}
    print(f"benchmark {path.name}: goals {data.get('goals', '-')}"
          + (f", failed parts {data['failed_parts']}" if data.get("failed_parts") else ""))
summary["benchmarks"] = benches
(out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
EOF
if [ ! -s "$OUT_DIR/summary.json" ]; then # the report step failed: the stages, from bash
  {
    printf '{"stages": ['
    for i in "${!STAGE_NAMES[@]}"; do
      ((i)) && printf ', '
      printf '{"stage": "%s", "status": "%s", "seconds": %s}' \
        "${STAGE_NAMES[$i]}" "${STAGE_STATUS[$i]}" "${STAGE_SECONDS[$i]}"
    done
    printf '], "ok": %s}\n' "$( ((FAILED == 0)) && echo true || echo false)"
  } >"$OUT_DIR/summary.json"
fi

echo
echo "=== gpu_check summary ($(($(date +%s) - START))s, output in $OUT_DIR)"
printf '%-28s %-8s %7s  %s\n' stage status seconds note
for i in "${!STAGE_NAMES[@]}"; do
  printf '%-28s %-8s %7s  %s\n' "${STAGE_NAMES[$i]}" "${STAGE_STATUS[$i]}" "${STAGE_SECONDS[$i]}" "${STAGE_NOTES[$i]}"
done
if ((FAILED)); then
  echo "gpu_check: FAILED ($FAILED stage(s) not ok)"
else
  echo "gpu_check: all stages ok"
fi

# Let tee finish writing the log before returning (bounded: a stray process could hold the pipe open).
exec 1>&3 2>&4 3>&- 4>&-
for _ in $(seq 50); do
  kill -0 "$TEE_PID" 2>/dev/null || break
  sleep 0.1
done
rm -rf "$WORK"
((FAILED == 0))
