#!/usr/bin/env bash
# Serving against vLLM's CPU engine with vLLM's settings swept (issue #40 item 1): for each max_num_batched_tokens
# (both engines get it) one bench_serve.py run whose throughput rows alternate vpaged with vLLM at its default
# block (128 tokens on its CPU build, compiled) and at block 32 eager (more settings at 4096: eager at the default
# block, block 32 compiled), --repeats rounds each; then vLLM's engine core in the runner's process
# (VLLM_ENABLE_V1_MULTIPROCESSING=0) at 4096 and 512; then at 512 vpaged against vLLM compiled, in its own
# process and in process, with every library in both engines capped at AVX2 (vpaged's kernels by
# VPAGED_CPU_ISA, torch's by ATEN_CPU_CAPABILITY, oneDNN's by ONEDNN_MAX_CPU_ISA, MKL's by
# MKL_ENABLE_INSTRUCTIONS; vLLM's own C++ kernels cannot be capped); and the floor of the workload with
# bench_serve_floor.py --compare on every file.
#
#   benchmarks/sweep_serve_vllm.sh TAG [VLLM_PYTHON]     (TAG names the machine in the result files)
#
# Nothing else may run on the machine meanwhile: on 2 cores it takes about an hour.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TAG="${1:?usage: sweep_serve_vllm.sh TAG [VLLM_PYTHON]}"
VLLM_PY="${2:-$ROOT/.venv-vllm/bin/python}"
PY="${PYTHON_BIN:-$ROOT/.venv/bin/python}"
REPEATS="${REPEATS:-2}"
cd "$ROOT/benchmarks"
files=()
serve() {  # serve OUTPUT MAX_BATCHED ROWS [env...]
  local out="$1" mb="$2" rows="$3"
  shift 3
  env "$@" "$PY" bench_serve.py --sections throughput --rows "$rows" --repeats "$REPEATS" \
    --vllm-python "$VLLM_PY" --set max_batched="$mb" --output "$out"
  files+=("$out")
}
for mb in 512 2048; do
  serve "serve_sweep_mb${mb}_${TAG}.json" "$mb" vpaged,vllm,vllm-bs32-eager
done
serve "serve_sweep_mb4096_${TAG}.json" 4096 vpaged,vllm,vllm-bs32-eager,vllm-eager,vllm-bs32
for mb in 4096 512; do
  serve "serve_sweep-inproc_mb${mb}_${TAG}.json" "$mb" vpaged,vllm-inproc,vllm-bs32-eager-inproc
done
serve "serve_avx2-capped_mb512_${TAG}.json" 512 vpaged,vllm,vllm-inproc \
  VPAGED_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
compare=()
for f in "${files[@]}"; do compare+=(--compare "$f"); done
"$PY" bench_serve_floor.py "${compare[@]}" --output "serve_floor_${TAG}.json"
