#!/usr/bin/env bash
# The one-shot check for a lent GPU machine (an H200 with torch+CUDA, nvcc, pybind11, cuda-bindings and no
# internet): probe the environment, build vpaged in place, run each GPU test file and each GPU benchmark as
# its own capped stage, and leave a log and JSON behind. The stage caps add up to less than the budget
# (default 330 s), so the whole script ends within 5.5 minutes: two runs fit 15 minutes of device time with
# ~3 minutes of machine start-up. A stage that fails does not stop the others.
#
#   scripts/gpu_check.sh [--dry-run] [OUT_DIR]
#
# OUT_DIR: the argument, else $OUT, else benchmarks/results/gpu-<UTC date>. It receives (few files: a lent
# machine sends back at most 8):
#   gpu_check.log   everything printed
#   summary.json    the environment probe, each stage's status, cap, time and note, every GPU test's outcome
#                   (one junit file per test file, merged), each benchmark's goals and whether it completed
#   <bench>.json    what each benchmark wrote; benchmarks write after every part, so a stage stopped at its
#                   cap still leaves the parts it finished
# Exit status: 0 when every stage passed, or when nothing could run because this machine has no NVIDIA
# driver or --dry-run was given (every stage is then marked skipped, with the reason); 1 otherwise.
#
# Stages run in the order of the `stage` lines below, each as its own process (an illegal address on the
# GPU is sticky for the process: one bad test must not poison the next file). ADDING A STAGE is one line:
#
#   stage NAME CAP_SECONDS NEEDS COMMAND
#
#   NEEDS    gpu    skipped unless the probe found a usable GPU (driver, device with VMM, torch with CUDA)
#            build  also skipped when the build cannot run (no nvcc, no Python.h) or failed
#   COMMAND  a bash string run from the repository root; helpers: `pytest_file FILE` (the file's tests
#            marked gpu, in one pytest process with its own junit file) and `bench FILE ARGS...` (a
#            benchmark writing its JSON into OUT_DIR through benchmarks/common.py)
#
# and its CAP comes out of the budget: the caps must add up to at most GPU_CHECK_BUDGET_S minus 15 s (the
# report) minus 20 s (the environment probe, which runs before the stages), which tests/test_gpu_check.py
# checks; update the table of CAPS below with it. Lower another cap or raise the budget only if the whole run
# still fits the device time (README: "GPU check"). Every test file that uses the gpu mark must have a stage
# (also checked there).
#
# CAPS, from costs measured on the CPU side (a 2-core box at load 5-6, so pessimistic) plus CUDA's
# initialization, assumed 10 s per process (worst case; ~1-3 s is usual on an H200):
#   import torch                      6-12 s here (cold page cache on the first import; warm afterwards)
#   import transformers + Llama       18 s here (torch included)
#   pytest start + collecting a file  15 s here (torch imported)
#   vpaged's build, 2 jobs            146-161 s wall here, 118-135 s of CPU in all; its slowest unit, nvcc of
#                                     csrc/kernels/decode_cuda.cu for sm_90, 28 s here: with 16 jobs ~30-45 s
#   a benchmark worker process start  6 s (imports) + CUDA's initialization
#
#   stage                 cap   worst case (s) on a cold H200 machine, 16 cores
#   (environment probe)    -    15: nvidia-smi, a cold `import torch` (before the stages, out of the budget)
#   build                 60    45: 16 parallel compiles, bounded by nvcc of decode_cuda.cu, + link
#   probe                 15    12: torch + vpaged import (warm), cuInit + device query
#   test:cuda_backend     25    20: pytest + torch (5-15) + CUDA init (10) + tests (~5)
#   test:cuda_cache       25    22: the same fixed 15-25 + tests (~5)
#   test:decode_kernels   25    24: fixed + kernels at several geometries (~8)
#   test:decode_quant     20    20: fixed + int8 / fp8 K/V kernels, small geometries (~4)
#   test:torch_allocator  25    22: fixed + MemPool scopes, a graph capture (~5)
#   test:serve_engine     40    38: fixed + transformers (~8) + two models and hundreds of steps (~10)
#   bench:vmm_cuda        15    25: torch (5) + CUDA init (10) + parts (~10); JSON after every part
#   bench:decode          20    25: the same; JSON after every part
#   bench:allocator       25    40: parent (torch + CUDA init, host part, latency: ~20), then three workers
#                                   started together (imports + CUDA init overlap: ~15) that measure in turn
#                                   (~2 s each); JSON after every part and every worker
#   caps' sum            295    of 330: 15 for the report, 20 for the environment probe
# A benchmark stopped at its cap keeps the parts it wrote; tests have no such fallback, so their caps carry
# the slack.
#
# Settings (environment): PYTHON (default python3), GPU_CHECK_BUDGET_S (default 330), GPU_CHECK_DRY_RUN=1
# (same as --dry-run), VPAGED_CUDA_ARCHS (default 90: Hopper only, to save build time), VPAGED_BUILD_JOBS
# (default: all cores), GPU_TEST_TIMEOUT_S (per test, default 60, with pytest-timeout).
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
DRY_RUN=${GPU_CHECK_DRY_RUN:-0}
if [ "${1:-}" = "--dry-run" ]; then
  DRY_RUN=1
  shift
fi
START=$(date +%s)
BUDGET=${GPU_CHECK_BUDGET_S:-330}
REPORT_RESERVE=15
PROBE_RESERVE=20 # the environment probe, before the first stage
DEADLINE=$((START + BUDGET - REPORT_RESERVE))
PY=${PYTHON:-python3}
OUT_DIR=${1:-${OUT:-$ROOT/benchmarks/results/gpu-$(date -u +%Y%m%d-%H%M%S)}}
mkdir -p "$OUT_DIR" || { echo "gpu_check: cannot create $OUT_DIR" >&2; exit 1; }
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
WORK="$(mktemp -d)"
mkdir -p "$WORK/junit"
LOG="$OUT_DIR/gpu_check.log"
: >"$LOG"

# Everything printed from here on goes to the terminal and to the log.
exec 3>&1 4>&2
exec > >(tee -a "$LOG") 2>&1
TEE_PID=$!

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" # the in-place build, from any working directory
export PYTHONUNBUFFERED=1
export VPAGED_CUDA_ARCHS=${VPAGED_CUDA_ARCHS:-90}
export VPAGED_BUILD_JOBS=${VPAGED_BUILD_JOBS:-$(nproc 2>/dev/null || echo 4)}
export VPAGED_RESULTS_DIR="$OUT_DIR" # benchmarks/common.py writes the benchmarks' JSON here
export PY ROOT OUT_DIR WORK

# ---------------------------------------------------------------------------------------------------
# Helpers for stage commands (exported: each stage runs in its own bash).

# The tests of FILE marked gpu, in one pytest process, with their own junit file.
pytest_file() {
  local file=$1 name
  name=$(basename "$file" .py)
  local args=(-m gpu -v -rs -p no:cacheprovider "--junitxml=$WORK/junit/$name.xml")
  if "$PY" -c "import pytest_timeout" 2>/dev/null; then
    args+=("--timeout=${GPU_TEST_TIMEOUT_S:-60}")
  fi
  "$PY" -m pytest "${args[@]}" "$file"
  local rc=$?
  ((rc == 5)) && echo "gpu_check: $file has no tests marked gpu"
  return $rc
}

# A benchmark: FILE ARGS...; its JSON goes to OUT_DIR (VPAGED_RESULTS_DIR).
bench() {
  "$PY" "$@"
}

# The in-place build: C++ compiled in parallel, CUDA alongside, for VPAGED_CUDA_ARCHS.
build_in_place() {
  "$PY" setup.py build_ext --inplace || return 1
  "$PY" -c "import sys, vpaged._C as C; print('built with CUDA:', C.built_with_cuda()); sys.exit(not C.built_with_cuda())"
}

# vpaged's own view of the backends (after the build).
vpaged_probe() {
  "$PY" - <<"EOF"
import sys, torch, vpaged
for name, info in vpaged.backends().items():
    print(f"  {name}: usable={info.usable} granularity={info.granularity} devices={info.devices} {info.reason}")
cuda = vpaged.backends()["cuda"]
if not (cuda.usable and torch.cuda.is_available()):
    sys.exit("CUDA is not usable by vpaged here: " + (cuda.reason or "torch has no CUDA"))
EOF
}
export -f pytest_file bench build_in_place vpaged_probe

# ---------------------------------------------------------------------------------------------------
# The stages: name, cap (s), needs, command. Caps add up to 295 s of the 330 s budget (see CAPS above).
STAGE_NAMES=() STAGE_CAPS=() STAGE_NEEDS=() STAGE_CMDS=()
stage() {
  STAGE_NAMES+=("$1")
  STAGE_CAPS+=("$2")
  STAGE_NEEDS+=("$3")
  STAGE_CMDS+=("$4")
}

stage build 60 build build_in_place
stage probe 15 build vpaged_probe
stage test:cuda_backend 25 build 'pytest_file tests/test_cuda_backend.py'
stage test:cuda_cache 25 build 'pytest_file tests/test_cuda_cache.py'
stage test:decode_kernels 25 build 'pytest_file tests/test_decode_kernels.py'
stage test:decode_quant 20 build 'pytest_file tests/test_decode_quant_kernel.py'
stage test:torch_allocator 25 build 'pytest_file tests/test_torch_allocator_gpu.py'
stage test:serve_engine 40 build 'pytest_file tests/test_serve_engine_gpu.py'
stage bench:vmm_cuda 15 build 'bench benchmarks/bench_vmm_cuda.py --quick'
stage bench:decode 20 build 'bench benchmarks/bench_decode.py --quick --device cuda'
stage bench:allocator 25 build 'bench benchmarks/bench_allocator.py --quick'

# ---------------------------------------------------------------------------------------------------
COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo "no git")
CAPS_TOTAL=0
for cap in "${STAGE_CAPS[@]}"; do CAPS_TOTAL=$((CAPS_TOTAL + cap)); done
echo "gpu_check: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname), repo $ROOT ($COMMIT), output $OUT_DIR"
echo "gpu_check: ${#STAGE_NAMES[@]} stages, caps ${CAPS_TOTAL}s of a ${BUDGET}s budget (${REPORT_RESERVE}s kept for the report)"
if ((CAPS_TOTAL > BUDGET - REPORT_RESERVE - PROBE_RESERVE)); then
  echo "gpu_check: WARNING: the stage caps exceed the budget: the last stages may get no time"
fi

# Environment probe (first, ~seconds): driver, device and VMM support, nvcc, Python.h, torch's CUDA. It
# decides which stages can run, and says why not.
echo
echo "=== [environment] $(date -u +%H:%M:%S)"
command -v nvidia-smi >/dev/null && timeout 15 nvidia-smi --format=csv \
  --query-gpu=index,name,driver_version,memory.total,memory.used,temperature.gpu,clocks.sm,clocks.max.sm,power.draw
timeout 60 "$PY" - "$WORK/env.json" "$DRY_RUN" <<'EOF' || echo "gpu_check: the environment probe failed"
import ctypes, importlib.metadata as md, json, os, platform, shutil, subprocess, sys, sysconfig
from pathlib import Path

env = {"python": platform.python_version(), "python_executable": sys.executable}
gpu_reason = build_reason = ""
driver_present = False
try:  # the driver itself, through the same library vpaged loads
    cu = ctypes.CDLL("libcuda.so.1")
    driver_present = True
    version, count, vmm = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    rc = cu.cuInit(0)
    if rc:
        gpu_reason = f"cuInit failed with CUresult {rc}"
    else:
        cu.cuDriverGetVersion(ctypes.byref(version))
        env["driver_cuda"] = f"{version.value // 1000}.{version.value % 1000 // 10}"
        cu.cuDeviceGetCount(ctypes.byref(count))
        env["devices"] = count.value
        if count.value == 0:
            gpu_reason = "the NVIDIA driver sees no device"
        else:
            name = ctypes.create_string_buffer(256)
            cu.cuDeviceGetName(name, 256, 0)
            env["device0"] = name.value.decode()
            cu.cuDeviceGetAttribute(ctypes.byref(vmm), 102, 0)  # VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
            env["vmm_supported"] = bool(vmm.value)
            if not vmm.value:
                gpu_reason = "device 0 does not support virtual memory management"
except OSError as e:
    gpu_reason = f"no NVIDIA driver ({e})"
try:
    if driver_present and sys.argv[2] != "1":  # importing torch takes seconds: only where it can matter
        import torch
    else:
        raise ImportError("not checked: no NVIDIA driver or a dry run")
    env["torch"] = torch.__version__
    env["torch_cuda"] = torch.version.cuda
    env["torch_cuda_available"] = torch.cuda.is_available()
    if not gpu_reason and not torch.cuda.is_available():
        gpu_reason = f"torch {torch.__version__} cannot use CUDA (torch.version.cuda={torch.version.cuda})"
except ImportError as e:
    env["torch"] = str(e)
    gpu_reason = gpu_reason or f"torch is not importable: {e}"
nvcc = shutil.which("nvcc") or next((str(p) for p in (Path(os.environ.get("CUDA_HOME", "/nonexistent")) / "bin/nvcc",
                                                      Path("/usr/local/cuda/bin/nvcc")) if p.is_file()), None)
if nvcc:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()
    env["nvcc"] = out[-1] if out else nvcc
else:
    build_reason = "nvcc not found (PATH, CUDA_HOME, /usr/local/cuda): the build would have no CUDA"
header = Path(sysconfig.get_paths()["include"]) / "Python.h"
env["python_h"] = str(header) if header.is_file() else None
if not header.is_file():
    build_reason = build_reason or f"Python.h not found at {header} (install the Python development headers)"
for name in ("pybind11", "setuptools", "numpy", "cuda-bindings", "transformers", "pytest", "pytest-timeout"):
    try:
        env[name] = md.version(name)
    except md.PackageNotFoundError:
        env[name] = None
if sys.argv[2] == "1":
    gpu_reason = "dry run (--dry-run): nothing was run on a GPU"
dry = sys.argv[2] == "1" or not driver_present
env.update(gpu_reason=gpu_reason, build_reason=build_reason, dry_run=dry)
Path(sys.argv[1]).write_text(json.dumps(env, indent=2))
for k, v in env.items():
    print(f"  {k}: {v}")
EOF
read_env() { "$PY" -c "import json,sys; print(json.load(open('$WORK/env.json')).get(sys.argv[1]) or '')" "$1" 2>/dev/null; }
if [ -s "$WORK/env.json" ]; then
  GPU_REASON=$(read_env gpu_reason)
  BUILD_REASON=$(read_env build_reason)
  [ "$(read_env dry_run)" = "True" ] && DRY_RUN=1
else
  GPU_REASON="the environment probe failed (see the log)"
  BUILD_REASON=""
  ((DRY_RUN)) || command -v nvidia-smi >/dev/null || DRY_RUN=1
fi

# ---------------------------------------------------------------------------------------------------
FAILED=0
STAGE_STATUS=() STAGE_SECONDS=() STAGE_NOTES=()

run_stage() {
  local i=$1
  local name=${STAGE_NAMES[$i]} cap=${STAGE_CAPS[$i]} needs=${STAGE_NEEDS[$i]} cmd=${STAGE_CMDS[$i]}
  local left=$((DEADLINE - $(date +%s)))
  local limit=$((cap < left ? cap : left))
  local status note="" rc=0 t0 t1
  t0=$(date +%s)
  echo
  echo "=== [$name] $(date -u +%H:%M:%S), cap ${cap}s, limit ${limit}s"
  if [ "$needs" != "-" ] && [ -n "$GPU_REASON" ]; then
    status=skipped note="no usable GPU: $GPU_REASON"
  elif [ "$needs" = build ] && [ -n "$BUILD_REASON" ]; then
    status=skipped note="no CUDA build: $BUILD_REASON"
  elif ((limit < 5)); then
    status=no-time note="${left}s of the budget left"
    rc=124
  else
    echo "\$ $cmd"
    timeout -k 5 "$limit" bash -c "$cmd"
    rc=$?
    if ((rc == 0)); then
      status=ok
    elif ((rc == 124 || rc == 137)); then
      status=timeout note="stopped at ${limit}s"
    else
      status=failed note="exit status $rc"
    fi
  fi
  t1=$(date +%s)
  if [ "$status" != ok ] && [ "$status" != skipped ]; then
    FAILED=$((FAILED + 1))
    [ "$name" = build ] && BUILD_REASON="the build stage $status"
  fi
  STAGE_STATUS+=("$status")
  STAGE_SECONDS+=($((t1 - t0)))
  STAGE_NOTES+=("$note")
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$((t1 - t0))" "$cap" "$note" >>"$WORK/stages.tsv"
  echo "=== [$name] $status ($((t1 - t0))s)${note:+: $note}"
}

for i in "${!STAGE_NAMES[@]}"; do
  run_stage "$i"
done
SKIPPED=0
for st in "${STAGE_STATUS[@]}"; do [ "$st" = skipped ] && SKIPPED=$((SKIPPED + 1)); done
# Nothing ran on a GPU although this machine has one: that is a failure, not a dry run.
((DRY_RUN == 0 && SKIPPED > 0)) && FAILED=$((FAILED + SKIPPED))

# Report: summary.json, then the table of stages (last).
echo
echo "=== [report]"
export BUDGET CAPS_TOTAL DRY_RUN COMMIT REPORT_RESERVE
timeout 30 "$PY" - <<'EOF' || echo "gpu_check: the report step failed; summary.json holds the stages only"
import json, os, socket, time
import xml.etree.ElementTree as ET
from pathlib import Path

out, work = Path(os.environ["OUT_DIR"]), Path(os.environ["WORK"])
stages = []
for line in (work / "stages.tsv").read_text().splitlines():
    name, status, rc, seconds, cap, note = (line.split("\t") + [""] * 6)[:6]
    stages.append({"stage": name, "status": status, "exit": int(rc), "seconds": int(seconds), "cap": int(cap),
                   "note": note})
env_file = work / "env.json"
dry = os.environ["DRY_RUN"] == "1"
summary = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "host": socket.gethostname(),
           "commit": os.environ["COMMIT"], "dry_run": dry, "budget_s": int(os.environ["BUDGET"]),
           "report_reserve_s": int(os.environ["REPORT_RESERVE"]), "caps_total_s": int(os.environ["CAPS_TOTAL"]),
           "environment": json.loads(env_file.read_text()) if env_file.is_file() else None, "stages": stages,
           "ok": all(s["status"] == "ok" or (dry and s["status"] == "skipped") for s in stages)}
tests, counts = {}, {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
for junit in sorted((work / "junit").glob("*.xml")):
    try:
        cases = list(ET.parse(junit).iter("testcase"))
    except ET.ParseError as e:  # a process killed while writing
        tests[junit.stem] = f"error: unreadable junit file ({e})"
        counts["error"] += 1
        continue
    for case in cases:
        name = f"{case.get('classname')}::{case.get('name')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = (el.get("message") or "")[:300]
                if tag != "skipped" and el.text:
                    message += "\n" + el.text[-3000:]
                break
        counts[outcome] += 1
        tests[name] = outcome if not message else f"{outcome}: {message}"
if tests:
    summary["tests"] = {"counts": counts, "outcomes": tests}
    print(f"tests (-m gpu): {counts['passed']} passed, {counts['failed']} failed, {counts['error']} errors, "
          f"{counts['skipped']} skipped")
    for name, outcome in tests.items():
        if not outcome.startswith(("passed", "skipped")):
            print(f"  {name}: {outcome.splitlines()[0]}")
benches = {}
for path in sorted(out.glob("*.json")):
    if path.name == "summary.json":
        continue
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        benches[path.name] = {"unreadable": str(e)}
        continue
    benches[path.name] = {k: data[k] for k in ("complete", "goals", "failed_parts") if k in data}
    print(f"benchmark {path.name}: complete {data.get('complete', '-')}, goals {data.get('goals', '-')}"
          + (f", failed parts {data['failed_parts']}" if data.get("failed_parts") else ""))
summary["benchmarks"] = benches
(out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
EOF
if [ ! -s "$OUT_DIR/summary.json" ]; then # the report step failed: the stages, from bash
  {
    printf '{"dry_run": %s, "stages": [' "$( ((DRY_RUN)) && echo true || echo false)"
    for i in "${!STAGE_STATUS[@]}"; do
      ((i)) && printf ', '
      printf '{"stage": "%s", "status": "%s", "seconds": %s}' \
        "${STAGE_NAMES[$i]}" "${STAGE_STATUS[$i]}" "${STAGE_SECONDS[$i]}"
    done
    printf '], "ok": %s}\n' "$( ((FAILED == 0)) && echo true || echo false)"
  } >"$OUT_DIR/summary.json"
fi

echo
echo "=== gpu_check summary ($(($(date +%s) - START))s, output in $OUT_DIR)"
printf '%-24s %-8s %7s %5s  %s\n' stage status seconds cap note
for i in "${!STAGE_STATUS[@]}"; do
  printf '%-24s %-8s %7s %5s  %s\n' "${STAGE_NAMES[$i]}" "${STAGE_STATUS[$i]}" "${STAGE_SECONDS[$i]}" \
    "${STAGE_CAPS[$i]}" "${STAGE_NOTES[$i]}"
done
if ((FAILED)); then
  echo "gpu_check: FAILED ($FAILED stage(s) not ok)"
elif ((DRY_RUN)); then
  echo "gpu_check: dry run: every stage skipped (${GPU_REASON:-no GPU})"
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
