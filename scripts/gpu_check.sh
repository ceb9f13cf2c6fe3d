#!/usr/bin/env bash
# The one-shot check for a lent GPU machine (an H200 with torch+CUDA and nvcc, no internet; pybind11,
# transformers, pytest may be missing: the probe says so): probe the environment, build vpaged in place, run
# each GPU test file, one request through `vpaged serve --device cuda` and each GPU benchmark as its own
# capped stage, and leave a log and JSON behind. The stages' time plan (below) fits the budget (default
# 300 s) with the environment probe and the report, so the whole script ends within 5 minutes: two runs fit
# 15 minutes of device time with the machines' start-up. A stage that fails or hits its cap does not stop the
# others.
#
#   scripts/gpu_check.sh [--dry-run] [OUT_DIR]
#
# OUT_DIR: the argument, else $OUT, else benchmarks/results/gpu-<UTC date>. It receives (a lent machine sends
# back at most 8 files; this is 3 + one per benchmark, 6 in all):
#   gpu_check.log   everything printed (pytest's tracebacks included, also of a stage stopped at its cap)
#   summary.json    the environment probe, each stage's status (ok / failed / timeout / skipped / no-time /
#                   pending), cap, time and note, every GPU test's outcome, each benchmark's goals and whether
#                   it completed. Rewritten after every stage: a run cut short still says how far it got.
#   junit.xml       the junit of every test stage (one <testsuite> per stage), also rewritten after every
#                   stage; a stage stopped at its cap gets a <testcase name="stage-timeout"> with an <error>
#   <bench>.json    what each benchmark wrote; benchmarks write after every part, so a stage stopped at its
#                   cap still leaves the parts it finished
# Exit status: 0 when every stage passed, or when nothing could run because this machine has no NVIDIA
# driver or --dry-run was given (every stage is then marked skipped, with the reason); 1 otherwise.
#
# Stages run in the order of the `stage` lines below (most informative first), each as its own process (an
# illegal address on the GPU is sticky for the process: one bad test must not poison the next file). The
# stages between `together NAME` and `alone` start at once, each in its own process with its own cap, their
# logs printed in order once all ended: test files that read no device-wide figure (one that compares the
# device's free memory before and after runs alone, and the benchmarks, which time things, run alone after
# them). A stage is stopped at its cap with SIGINT (`timeout -s INT`): pytest then ends the running test with
# KeyboardInterrupt, prints the tracebacks and its summary and writes its junit file; SIGKILL follows 10 s
# later if it does not exit. ADDING A STAGE is one line:
#
#   stage NAME CAP_SECONDS NEEDS COMMAND
#
#   NEEDS    gpu    skipped unless the probe found a usable GPU (driver, device, torch with CUDA)
#            vmm    also skipped when the device lacks virtual memory management (VirtualKVCache, the page
#                   pool and the torch allocator need it; the decode kernels on plain tensors do not)
#            Every stage after `build` is also skipped when the build cannot run (no nvcc, no Python.h) or
#            failed.
#   COMMAND  a bash string run from the repository root; helpers: `pytest_file FILE` (the file's tests
#            marked gpu, in one pytest process with its own junit file), `bench FILE ARGS...` (a benchmark
#            writing its JSON into OUT_DIR through benchmarks/common.py), `serve_request` (a tiny model
#            served through the CLI, one completion asked of it over HTTP)
#
# and its CAP comes out of the budget: the time plan (the caps of the stages alone, plus for each group its
# largest cap) must be at most GPU_CHECK_BUDGET_S minus 15 s (the report) minus 20 s (the environment probe,
# which runs before the stages), and every cap at least 1.25 times its stage's worst case in the table below,
# which tests/project/test_gpu_check.py checks; update the table of CAPS with it. Lower another cap or raise
# the budget only if two whole runs still fit the device time (docs/gpu.md). Every test file that uses the gpu
# mark must have a stage (also checked there).
#
# CAPS. No GPU has run these yet: the worst cases are costs measured on the CPU side (a 2-core AMD EPYC,
# load 1-2, CPU torch) scaled to the H200 machine (16 cores, CUDA torch, the page cache warm after the
# environment probe's cold `import torch`), plus CUDA's initialization, taken as 4 s per process (1-3 s is
# usual on an H200); a stage run together gets at least 1.5 times its worst case (7 processes share 16 cores
# and the GPU):
#   pytest start, torch + vpaged imported, one file collected: 4.5-5.0 s here (no GPU tests run); 6 s there
#   with CUDA torch's larger libraries, + 4 s CUDA's start: F = 10 s for a GPU test file
#   vpaged's build, 2 jobs            146-161 s wall here; its slowest unit is csrc/kernels/decode_cpu.cpp
#                                     at -O3 (~60 s of CPU), so the check builds the C++ at -O1
#                                     (GPU_CHECK_CXXFLAGS); nvcc of decode_cuda.cu for sm_90, 28 s here
#   quantized decode CUDA grid        108 cases (one-pass and split launches share a case), each ~0.2 s of
#                                     CPU reference work here on one thread (grouped GQA reference)
#   a process with torch and vpaged   4 s (imports) + 4 s CUDA's start; transformers 5 s more
#
#   stage                 cap   worst case (s) on a cold H200 machine, 16 cores
#   (environment probe)    -    15: nvidia-smi, a cold `import torch` (before the stages, out of the budget)
#   build                 60    40: 16 parallel compiles at -O1 (~13 s), bounded by nvcc of decode_cuda.cu
#                                   (28 s on the slow host here), + link
#   probe                  8     6: torch + vpaged import (warm), cuInit + device query
#   test:cuda_backend     18    13: F + tests (~3); alone: it compares the device's free memory
#   test:cuda_cache       22    17: F + tests (~4; the vLLM plugin's buffer on CUDA ~1; a prefix store between
#                                   two caches, 3 layouts, ~3); alone, as above
#   -- together (the group's time: its largest cap, 40) --
#   test:decode_quant     32    21: F + 108 quantized cases (~0.1 s each on the H200 host's cores)
#   test:decode_kernels   27    18: F + kernels at several geometries (~8)
#   test:torch_allocator  23    15: F + MemPool scopes, graph captures (~5)
#   test:budget_gpu       33    22: F + two member processes started together (8) + fills, checks (~4)
#   test:capture_trim     18    12: F + one capture with a trim, three replays (~2)
#   test:shared_pages     30    20: F + a peer process (torch + vpaged imported, CUDA's start: 8) + pages
#                                   written, exported, sent over a socket, imported and read (~2)
#   test:serve_engine     38    25: F + transformers (5) + two models and hundreds of steps (~10)
#   serve:cli             40    26: a tiny model saved (transformers, ~9), the server's start (~13), one
#                                   request (~2), shutdown (~2)
#   -- alone --
#   bench:vmm_cuda        18    13: torch + CUDA's start (8) + parts (~5); JSON after every part
#   bench:decode          22    16: the same (8) + parts (~8); JSON after every part
#   bench:allocator       36    27: parent (8, host part and latency ~5), then three workers started
#                                   together (8) that measure in turn (~2 each); JSON after every part
#   caps' sum            425    of 300 (the stages of the group run at once)
#   time plan            224    of 300: 15 for the report, 20 for the environment probe, 41 to spare
# A benchmark stopped at its cap keeps the parts it wrote; a test stage stopped at its cap keeps the tests
# that finished (junit on SIGINT) and names the one that was running in the log.
#
# Settings (environment): PYTHON (default python3), GPU_CHECK_BUDGET_S (default 300), GPU_CHECK_DRY_RUN=1
# (same as --dry-run), VPAGED_CUDA_ARCHS (default 90: Hopper only, to save build time), VPAGED_BUILD_JOBS
# (default: all cores), GPU_CHECK_CXXFLAGS (default -O1: the C++ flags of the check's build; "" for the
# release -O3), GPU_TEST_TIMEOUT_S (per test, default 60, with pytest-timeout). For tests of the script
# itself: GPU_CHECK_SIMULATE_TIMEOUT=STAGE runs that stage even in a dry run as a pytest file with one quick
# test and one that sleeps past GPU_CHECK_SIMULATE_CAP_S (default 15), which stands in for its cap.
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
DRY_RUN=${GPU_CHECK_DRY_RUN:-0}
if [ "${1:-}" = "--dry-run" ]; then
  DRY_RUN=1
  shift
fi
START=$(date +%s)
BUDGET=${GPU_CHECK_BUDGET_S:-300}
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
rm -f "$OUT_DIR/summary.json" "$OUT_DIR/junit.xml" # a reused folder: no results of an earlier run

# Everything printed from here on goes to the terminal and to the log.
exec 3>&1 4>&2
exec > >(tee -a "$LOG") 2>&1
TEE_PID=$!

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" # the in-place build, from any working directory
export PYTHONUNBUFFERED=1
export VPAGED_CUDA_ARCHS=${VPAGED_CUDA_ARCHS:-90}
export VPAGED_BUILD_JOBS=${VPAGED_BUILD_JOBS:-$(nproc 2>/dev/null || echo 4)}
# The check's build at -O1: less compile time for the CPU kernels (decode_cpu.cpp at -O3 is the slowest unit);
# the GPU stages measure CUDA code, which nvcc still compiles at -O3.
export VPAGED_CXXFLAGS="${VPAGED_CXXFLAGS:-} ${GPU_CHECK_CXXFLAGS--O1}"
export VPAGED_RESULTS_DIR="$OUT_DIR" # benchmarks/common.py writes the benchmarks' JSON here
export PY ROOT OUT_DIR WORK

# ---------------------------------------------------------------------------------------------------
# Helpers for stage commands (exported: each stage runs in its own bash).

# The tests of FILE marked gpu, in one pytest process, with the stage's junit file (named after the stage:
# GPU_CHECK_STAGE, set by run_stage). On SIGINT pytest stops the running test, writes the junit file and
# prints the tracebacks and its summary.
pytest_file() {
  local file=$1
  local args=(-m gpu -v -rs -p no:cacheprovider "--junitxml=$WORK/junit/${GPU_CHECK_STAGE//:/_}.xml")
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

# vpaged's own view of the backends (after the build). Without VMM (VMM_REASON) vpaged's CUDA backend is
# unusable by design: that is reported, and only torch's CUDA is required.
vpaged_probe() {
  "$PY" - <<"EOF"
import os, sys, torch, vpaged
for name, info in vpaged.backends().items():
    print(f"  {name}: usable={info.usable} granularity={info.granularity} devices={info.devices} {info.reason}")
cuda = vpaged.backends()["cuda"]
if not torch.cuda.is_available():
    sys.exit("torch has no CUDA here")
if not cuda.usable and not os.environ.get("VMM_REASON"):
    sys.exit("CUDA is not usable by vpaged here: " + cuda.reason)
EOF
}

# One completion through `vpaged serve --device cuda` on a tiny random-weight model with a word tokenizer
# (tests/serve_helpers.py: no download), over HTTP; the server is stopped with SIGINT afterwards.
serve_request() {
  "$PY" - <<"EOF"
import json, os, queue, signal, subprocess, sys, threading, time, urllib.request
from pathlib import Path

sys.path.insert(0, "tests")
from serve_helpers import save_model_with_tokenizer

path = Path(os.environ["WORK"]) / "tiny-model"
save_model_with_tokenizer(path)
cmd = [sys.executable, "-m", "vpaged.cli", "serve", str(path), "--device", "cuda", "--port", "0",
       "--served-model-name", "tiny", "--kv-budget-mib", "64", "--log-level", "warning"]
print("$", " ".join(cmd), flush=True)
proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
lines = queue.Queue()
threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
url, deadline = None, time.monotonic() + 60
try:
    while url is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            while not lines.empty():
                print(lines.get(), end="")
            sys.exit(f"the server did not come up (exit status {proc.poll()})")
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            continue
        print(line, end="", flush=True)
        if "serving" in line and " at " in line:
            url = line.split(" at ")[1].split()[0]
    body = {"model": "tiny", "prompt": "the cat sees a dog", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(url + "/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        answer = json.loads(r.read())
    print(json.dumps(answer))
    if answer["usage"]["completion_tokens"] != 5:
        sys.exit("the server answered with the wrong number of tokens")
finally:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
EOF
}

# A stand-in for a stage that runs past its cap (GPU_CHECK_SIMULATE_TIMEOUT): a real pytest run of one
# quick test and one that sleeps, so the SIGINT path (junit, tracebacks, "timeout") is what gets checked.
simulated_overcap() {
  cat >"$WORK/test_overcap.py" <<"EOF"
import time


def test_finishes_quickly():
    assert sum(range(10)) == 45


def test_sleeps_past_the_cap():
    time.sleep(3600)
EOF
  # No -m gpu here (the marker is not registered outside the repository's configuration).
  PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 "$PY" -m pytest -v -rs -p no:cacheprovider \
    "--junitxml=$WORK/junit/${GPU_CHECK_STAGE//:/_}.xml" \
    "$WORK/test_overcap.py"
}
export -f pytest_file bench build_in_place vpaged_probe serve_request simulated_overcap

# ---------------------------------------------------------------------------------------------------
# The stages: name, cap (s), needs, command; the time plan (alone: its cap; together: the group's largest
# cap) is 220 s of the 300 s budget (see CAPS above).
STAGE_NAMES=() STAGE_CAPS=() STAGE_NEEDS=() STAGE_CMDS=() STAGE_GROUPS=()
GROUP=""
stage() {
  STAGE_NAMES+=("$1")
  STAGE_CAPS+=("$2")
  STAGE_NEEDS+=("$3")
  STAGE_CMDS+=("$4")
  STAGE_GROUPS+=("$GROUP")
}
together() { GROUP=$1; } # the stages up to `alone` run at the same time, each still stopped at its own cap
alone() { GROUP=""; }

stage build 60 gpu build_in_place
stage probe 8 gpu vpaged_probe
stage test:cuda_backend 18 vmm 'pytest_file tests/memory/test_cuda_backend.py'
stage test:cuda_cache 22 vmm 'pytest_file tests/kvcache/test_cuda_cache.py'
together tests
stage test:decode_quant 32 gpu 'pytest_file tests/ops/test_decode_quant_kernel.py'
stage test:decode_kernels 27 gpu 'pytest_file tests/ops/test_decode_kernels.py'
stage test:torch_allocator 23 vmm 'pytest_file tests/memory/test_torch_allocator_gpu.py'
stage test:budget_gpu 33 vmm 'pytest_file tests/memory/test_budget_gpu.py'
stage test:capture_trim 18 vmm 'pytest_file tests/memory/test_capture_trim_gpu.py'
stage test:shared_pages 30 vmm 'pytest_file tests/memory/test_cuda_shared_pages_gpu.py'
stage test:serve_engine 38 vmm 'pytest_file tests/serve/test_serve_engine_gpu.py'
stage serve:cli 40 vmm serve_request
alone
stage bench:vmm_cuda 18 vmm 'bench benchmarks/bench_vmm_cuda.py --quick'
stage bench:decode 22 vmm 'bench benchmarks/bench_decode.py --quick --device cuda'
stage bench:allocator 36 vmm 'bench benchmarks/bench_allocator.py --quick'

# ---------------------------------------------------------------------------------------------------
COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo "no git")
CAPS_TOTAL=0 PLAN_S=0 # PLAN_S: the stages' wall time if every one ran to its cap (a group: its largest cap)
declare -A GROUP_MAX=()
for i in "${!STAGE_CAPS[@]}"; do
  cap=${STAGE_CAPS[$i]} group=${STAGE_GROUPS[$i]}
  CAPS_TOTAL=$((CAPS_TOTAL + cap))
  if [ -z "$group" ]; then
    PLAN_S=$((PLAN_S + cap))
  elif ((cap > ${GROUP_MAX[$group]:-0})); then
    PLAN_S=$((PLAN_S + cap - ${GROUP_MAX[$group]:-0}))
    GROUP_MAX[$group]=$cap
  fi
done
echo "gpu_check: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname), repo $ROOT ($COMMIT), output $OUT_DIR"
echo "gpu_check: ${#STAGE_NAMES[@]} stages, a time plan of ${PLAN_S}s (caps ${CAPS_TOTAL}s, some stages together) of a ${BUDGET}s budget (${REPORT_RESERVE}s kept for the report)"
if ((PLAN_S > BUDGET - REPORT_RESERVE - PROBE_RESERVE)); then
  echo "gpu_check: WARNING: the stages' time plan exceeds the budget: the last stages may get no time"
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
gpu_reason = build_reason = vmm_reason = ""
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
                vmm_reason = "device 0 does not support virtual memory management"
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
env.update(gpu_reason=gpu_reason, vmm_reason=vmm_reason, build_reason=build_reason, dry_run=dry)
Path(sys.argv[1]).write_text(json.dumps(env, indent=2))
for k, v in env.items():
    print(f"  {k}: {v}")
EOF
read_env() { "$PY" -c "import json,sys; print(json.load(open('$WORK/env.json')).get(sys.argv[1]) or '')" "$1" 2>/dev/null; }
if [ -s "$WORK/env.json" ]; then
  GPU_REASON=$(read_env gpu_reason)
  VMM_REASON=$(read_env vmm_reason)
  BUILD_REASON=$(read_env build_reason)
  [ "$(read_env dry_run)" = "True" ] && DRY_RUN=1
else
  GPU_REASON="the environment probe failed (see the log)"
  VMM_REASON="" BUILD_REASON=""
  ((DRY_RUN)) || command -v nvidia-smi >/dev/null || DRY_RUN=1
fi

# ---------------------------------------------------------------------------------------------------
FAILED=0
STAGE_STATUS=() STAGE_SECONDS=() STAGE_NOTES=()
SIMULATE=${GPU_CHECK_SIMULATE_TIMEOUT:-}
: >"$WORK/stages.tsv"

# summary.json and junit.xml in OUT_DIR from what the stages left in WORK; run after every stage (so a run
# stopped from outside keeps what it did) and once at the end (FINAL=1, which also prints the test counts).
write_report() {
  FINAL=${1:-0} timeout 30 "$PY" - <<'EOF'
import json, os, socket, time
import xml.etree.ElementTree as ET
from pathlib import Path

out, work = Path(os.environ["OUT_DIR"]), Path(os.environ["WORK"])
final = os.environ.get("FINAL") == "1"
stages = []
for line in (work / "stages.tsv").read_text().splitlines():
    name, status, rc, seconds, cap, note = (line.split("\t") + [""] * 6)[:6]
    stages.append({"stage": name, "status": status, "exit": int(rc), "seconds": int(seconds), "cap": int(cap),
                   "note": note})
done = {s["stage"] for s in stages}
pending = [{"stage": n, "status": "pending"} for n in os.environ["STAGES_PLANNED"].split() if n not in done]
env_file = work / "env.json"
dry = os.environ["DRY_RUN"] == "1"
summary = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "host": socket.gethostname(),
           "commit": os.environ["COMMIT"], "dry_run": dry, "complete": final, "budget_s": int(os.environ["BUDGET"]),
           "report_reserve_s": int(os.environ["REPORT_RESERVE"]), "caps_total_s": int(os.environ["CAPS_TOTAL"]),
           "plan_s": int(os.environ["PLAN_S"]),
           "environment": json.loads(env_file.read_text()) if env_file.is_file() else None,
           "stages": stages + pending,
           "ok": final and all(s["status"] == "ok" or (dry and s["status"] == "skipped") for s in stages)}

# junit: one <testsuite> per test stage, in stage order; a stage stopped at its cap gets a "stage-timeout"
# error case (also when pytest died before writing its file).
suites = ET.Element("testsuites")
tests, counts = {}, {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
for st in stages:
    junit = work / "junit" / (st["stage"].replace(":", "_") + ".xml")
    suite = None
    if junit.is_file():
        try:
            root = ET.parse(junit).getroot()
            suite = root if root.tag == "testsuite" else root.find("testsuite")
        except ET.ParseError as e:  # a process killed while writing
            suite = ET.Element("testsuite")
            case = ET.SubElement(suite, "testcase", classname=st["stage"], name="unreadable-junit")
            ET.SubElement(case, "error", message=f"unreadable junit file ({e})")
    if suite is None and st["status"] != "timeout":
        continue
    if suite is None:
        suite = ET.Element("testsuite")
    suite.set("name", st["stage"])
    for case in suite.findall("testcase"):  # the test SIGINT stopped: an empty entry (the log names it)
        if case.get("name") is None:
            suite.remove(case)
    if st["status"] == "timeout":
        case = ET.SubElement(suite, "testcase", classname=st["stage"], name="stage-timeout")
        ET.SubElement(case, "error", type="timeout", message=f"{st['stage']}: {st['note']} (see gpu_check.log)")
    suites.append(suite)
    for case in suite.iter("testcase"):
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
if len(suites):
    ET.ElementTree(suites).write(out / "junit.xml", encoding="unicode", xml_declaration=True)
if tests:
    summary["tests"] = {"counts": counts, "outcomes": tests}
    if final:
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
    if final:
        print(f"benchmark {path.name}: complete {data.get('complete', '-')}, goals {data.get('goals', '-')}"
              + (f", failed parts {data['failed_parts']}" if data.get("failed_parts") else ""))
summary["benchmarks"] = benches
files = sorted(p.name for p in out.iterdir())
summary["files"] = files
if final and len(files) > 8:
    print(f"gpu_check: WARNING: {len(files)} files in {out}; a lent machine sends back at most 8")
tmp = out / "summary.json.tmp"  # written whole, then renamed: a reader never sees half a file
tmp.write_text(json.dumps(summary, indent=2) + "\n")
tmp.replace(out / "summary.json")
EOF
}
export BUDGET CAPS_TOTAL PLAN_S DRY_RUN COMMIT REPORT_RESERVE
export STAGES_PLANNED="${STAGE_NAMES[*]}"

# Whether stage $1 may run with $2 seconds of the budget left. Sets G_NAME, G_CAP, G_CMD, G_LIMIT (its cap, or
# what is left), and G_STATUS: "" to run it, else skipped / no-time with G_NOTE and G_RC.
stage_gate() {
  local i=$1 left=$2 needs=${STAGE_NEEDS[$1]}
  G_NAME=${STAGE_NAMES[$i]} G_CAP=${STAGE_CAPS[$i]} G_CMD=${STAGE_CMDS[$i]}
  G_STATUS="" G_NOTE="" G_RC=0
  if [ "$G_NAME" = "$SIMULATE" ]; then # tests of this script: a stage that runs past its cap, even when dry
    G_CMD=simulated_overcap needs=- G_CAP=${GPU_CHECK_SIMULATE_CAP_S:-15}
  fi
  G_LIMIT=$((G_CAP < left ? G_CAP : left))
  if [ "$needs" != "-" ] && [ -n "$GPU_REASON" ]; then
    G_STATUS=skipped G_NOTE="no usable GPU: $GPU_REASON"
  elif [ "$needs" = vmm ] && [ -n "$VMM_REASON" ]; then
    G_STATUS=skipped G_NOTE="no VMM: $VMM_REASON"
  elif [ "$G_NAME" != build ] && [ "$needs" != "-" ] && [ -n "$BUILD_REASON" ]; then
    G_STATUS=skipped G_NOTE="no CUDA build: $BUILD_REASON"
  elif ((G_LIMIT < 5)); then
    G_STATUS=no-time G_NOTE="${left}s of the budget left" G_RC=124
  fi
}

# A stage's command, stopped at LIMIT: SIGINT (pytest and the Python benchmarks stop cleanly on
# KeyboardInterrupt, writing junit and tracebacks), SIGKILL 10 s later for a process stuck in a call that never
# returns. Arguments: name, limit, command, threads (OMP_NUM_THREADS; "" leaves it).
stage_command() {
  local name=$1 limit=$2 cmd=$3 threads=$4
  if [ -n "$threads" ]; then
    export OMP_NUM_THREADS=$threads # in the stage's own subshell (run_group): the cores shared out
  fi
  GPU_CHECK_STAGE=$name VMM_REASON=$VMM_REASON timeout -s INT -k 10 "$limit" bash -c "$cmd"
}

# Record stage $1's outcome: status (ok / failed / timeout from exit status $3 when $2 is ""), seconds $4,
# cap $5, note $6, the limit it ran under $7; then the report.
record_stage() {
  local i=$1 status=$2 rc=$3 seconds=$4 cap=$5 note=$6 limit=${7:-$5} name=${STAGE_NAMES[$1]}
  if [ -z "$status" ]; then
    if ((rc == 0)); then
      status=ok
    elif ((rc == 124 || rc == 137)); then
      status=timeout note="stopped at its cap of ${limit}s"
    else
      status=failed note="exit status $rc"
    fi
  fi
  if [ "$status" != ok ] && [ "$status" != skipped ]; then
    FAILED=$((FAILED + 1))
    [ "$name" = build ] && BUILD_REASON="the build stage $status"
  fi
  STAGE_STATUS+=("$status")
  STAGE_SECONDS+=("$seconds")
  STAGE_NOTES+=("$note")
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$seconds" "$cap" "$note" >>"$WORK/stages.tsv"
  echo "=== [$name] $status (${seconds}s)${note:+: $note}"
  write_report 0 || echo "gpu_check: the report step failed after $name"
}

run_stage() {
  local i=$1 t0 rc
  t0=$(date +%s)
  stage_gate "$i" $((DEADLINE - t0))
  echo
  echo "=== [$G_NAME] $(date -u +%H:%M:%S), cap ${G_CAP}s, limit ${G_LIMIT}s"
  if [ -n "$G_STATUS" ]; then
    record_stage "$i" "$G_STATUS" "$G_RC" $(($(date +%s) - t0)) "$G_CAP" "$G_NOTE"
    return
  fi
  echo "\$ $G_CMD"
  stage_command "$G_NAME" "$G_LIMIT" "$G_CMD" ""
  rc=$?
  record_stage "$i" "" "$rc" $(($(date +%s) - t0)) "$G_CAP" "" "$G_LIMIT"
}

# The stages of one `together` group ($@: their indices), started at once, each in its own process with its
# own cap, its output into its own log; once all ended, each log is printed and each stage recorded, in
# order. CPU threads are shared out (OMP_NUM_THREADS: the cores over the stages). Only stages that read no
# device-wide figure go together (a stage reading the device's free memory runs alone).
run_group() {
  local idx=("$@") i t0 left threads
  local -A pids=() limits=() caps=() cmds=() early=()
  t0=$(date +%s)
  left=$((DEADLINE - t0))
  threads=$(($(nproc 2>/dev/null || echo 4) / ${#idx[@]}))
  ((threads < 1)) && threads=1
  echo
  echo "=== [${STAGE_GROUPS[${idx[0]}]}: ${#idx[@]} stages together] $(date -u +%H:%M:%S), ${left}s of the budget left"
  for i in "${idx[@]}"; do
    stage_gate "$i" "$left"
    caps[$i]=$G_CAP limits[$i]=$G_LIMIT cmds[$i]=$G_CMD
    if [ -n "$G_STATUS" ]; then
      early[$i]="$G_STATUS	$G_RC	$G_NOTE"
      continue
    fi
    echo "=== [$G_NAME] started $(date -u +%H:%M:%S), cap ${G_CAP}s, limit ${G_LIMIT}s: \$ $G_CMD"
    (
      trap - INT # a background job of a script starts with SIGINT ignored: the cap's SIGINT must reach pytest
      stage_command "$G_NAME" "$G_LIMIT" "$G_CMD" "$threads" >"$WORK/stage_$i.log" 2>&1
      echo $? >"$WORK/stage_$i.rc"
      date +%s >"$WORK/stage_$i.end"
    ) &
    pids[$i]=$!
  done
  for i in "${idx[@]}"; do # each by its pid: a plain `wait` would also wait for the log's tee
    [ -n "${pids[$i]:-}" ] && wait "${pids[$i]}"
  done
  for i in "${idx[@]}"; do
    echo
    echo "=== [${STAGE_NAMES[$i]}] (together, started $(date -u -d "@$t0" +%H:%M:%S 2>/dev/null || echo "$t0"))"
    if [ -n "${early[$i]:-}" ]; then
      IFS=$'\t' read -r st rc note <<<"${early[$i]}"
      record_stage "$i" "$st" "$rc" 0 "${caps[$i]}" "$note"
      continue
    fi
    echo "\$ ${cmds[$i]}"
    cat "$WORK/stage_$i.log" 2>/dev/null
    rc=$(cat "$WORK/stage_$i.rc" 2>/dev/null || echo 1)
    record_stage "$i" "" "$rc" $(($(cat "$WORK/stage_$i.end" 2>/dev/null || date +%s) - t0)) "${caps[$i]}" "" "${limits[$i]}"
  done
}

i=0
while ((i < ${#STAGE_NAMES[@]})); do
  group=${STAGE_GROUPS[$i]}
  if [ -z "$group" ]; then
    run_stage "$i"
    i=$((i + 1))
    continue
  fi
  members=()
  while ((i < ${#STAGE_NAMES[@]})) && [ "${STAGE_GROUPS[$i]}" = "$group" ]; do
    members+=("$i")
    i=$((i + 1))
  done
  run_group "${members[@]}"
done
SKIPPED=0
for st in "${STAGE_STATUS[@]}"; do [ "$st" = skipped ] && SKIPPED=$((SKIPPED + 1)); done
# Nothing ran on a GPU although this machine has one: that is a failure, not a dry run.
((DRY_RUN == 0 && SKIPPED > 0)) && FAILED=$((FAILED + SKIPPED))

# Report: summary.json, then the table of stages (last).
echo
echo "=== [report]"
write_report 1 || echo "gpu_check: the report step failed; summary.json holds the stages only"

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
