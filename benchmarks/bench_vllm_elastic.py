"""Two vLLM engines on one machine, bursty traffic that alternates between them: a static split of the KV
memory (each engine owns half) against one shared vpaged budget (each may grow to the whole of it while
the other is idle). Reports time to first token (TTFT) p50/p99 per model and overall.

    PYTHONPATH=. /work/venv-vllm/bin/python benchmarks/bench_vllm_elastic.py \
        --budget-blocks 64 --bursts 4 --burst-requests 16 --rate 30 --max-tokens 128 --gap-s 6 \
        --min-share 0.1 --rounds 2 [--out results/vllm_elastic]

Each engine is a process of its own (this file with `--engine`), an in-process LLMEngine (VLLM_ENABLE_V1_
MULTIPROCESSING=0) bound to one core (VLLM_CPU_OMP_THREADS_BIND=0 and =1: two cores, one each). Two copies
of the tiny random Llama of tests/integrations/test_vllm_plugin.py, 32-token blocks of 64 KiB (set explicitly: vLLM's CPU
default is 128 tokens, and the budget's bytes must be counted in the blocks the engines really use). Static: each engine
gets budget_blocks / 2 blocks of its own (num_gpu_blocks_override), vpaged off. Shared: each engine's
buffer is budget_blocks blocks (its ceiling), vpaged on with VPAGED_SHARED_BUDGET naming one budget of
budget_blocks blocks' bytes, --min-share of it guaranteed to each (VPAGED_SHARED_MIN_MIB). Burst k goes to model k % 2: burst_requests requests with Poisson arrivals at
--rate per second, then --gap-s of quiet before the next burst. The arrival schedule is drawn once (seeded)
and both modes replay it from a common start time; TTFT counts from a request's arrival to the step that
returns its first token.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BLOCK_TOKENS = 32  # the smallest block vLLM's CPU attention takes (a multiple of 32)
BLOCK_BYTES = 2 * 2 * 2 * 64 * 4 * BLOCK_TOKENS  # layers * (K, V) * kv heads * head dim * fp32 * tokens
LAYER_BLOCK_BYTES = BLOCK_BYTES // 2  # one layer's part of a block: the page size that gives each its own pages


def schedule(bursts: int, burst_requests: int, rate: float, gap_s: float, seed: int) -> list[dict]:
    """Arrivals (seconds from the start) for both models: bursts alternate, Poisson within a burst."""
    rng = random.Random(seed)
    t, out = 1.0, []
    for k in range(bursts):
        for i in range(burst_requests):
            t += rng.expovariate(rate)
            prompt = [rng.randrange(3, 512) for _ in range(rng.randint(64, 256))]
            out.append({"model": k % 2, "id": f"b{k}r{i}", "at": t, "prompt": prompt})
        t += gap_s
    return out


def engine(model: str, blocks: int, arrivals_path: str, which: int, max_tokens: int) -> None:
    import vpaged.integrations.vllm as plugin
    from vpaged.integrations.vllm.patches import STATE

    plugin.register()  # where vLLM's entry point would call it
    from vllm import EngineArgs, SamplingParams
    from vllm.v1.engine.llm_engine import LLMEngine

    args = EngineArgs(
        model=model,
        dtype="float32",
        max_model_len=512,
        enforce_eager=True,
        seed=0,
        num_gpu_blocks_override=blocks,
        block_size=BLOCK_TOKENS,
    )
    eng = LLMEngine.from_engine_args(args)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    eng.add_request("warm", {"prompt_token_ids": [5] * 32}, SamplingParams(max_tokens=2))
    while eng.has_unfinished_requests():
        eng.step()
    mine = [a for a in json.loads(Path(arrivals_path).read_text()) if a["model"] == which]
    print("READY", flush=True)
    start = float(sys.stdin.readline())  # the common start time (time.time()) from the parent
    first: dict[str, float] = {}
    pending = list(mine)
    peak_mapped = 0
    while pending or eng.has_unfinished_requests():
        now = time.time() - start
        while pending and pending[0]["at"] <= now:
            a = pending.pop(0)
            eng.add_request(a["id"], {"prompt_token_ids": a["prompt"]}, params, arrival_time=start + a["at"])
        if not eng.has_unfinished_requests():
            time.sleep(min(0.005, max(0.0, pending[0]["at"] - now)) if pending else 0)
            continue
        for out in eng.step():
            if out.request_id not in first and out.outputs and out.outputs[0].token_ids:
                first[out.request_id] = time.time() - start
        backing = STATE.backing
        peak_mapped = max(peak_mapped, backing.mapped_bytes() if backing is not None else 0)
    ttft = {a["id"]: first[a["id"]] - a["at"] for a in mine}
    print(json.dumps({"ttft": ttft, "peak_mapped_bytes": peak_mapped}), flush=True)


def run_mode(mode: str, model: str, args, arrivals_path: str, budget_name: str) -> dict:
    procs = []
    for which in (0, 1):
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND=str(which))
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"
        if mode == "shared":
            env.update(VPAGED_VLLM="1", VPAGED_SHARED_BUDGET=budget_name)
            env["VPAGED_SHARED_MIN_MIB"] = str(args.min_share * args.budget_blocks * BLOCK_BYTES / 2**20)
            blocks = args.budget_blocks
        else:
            env["VPAGED_VLLM"] = "0"
            blocks = args.budget_blocks // 2
        cmd = [sys.executable, __file__, "--engine", f"{model}{which}", str(blocks), arrivals_path, str(which)]
        cmd.append(str(args.max_tokens))
        procs.append(
            subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        )
    for p in procs:
        while True:
            line = p.stdout.readline().decode()
            if not line:
                sys.exit(p.stderr.read().decode()[-3000:])
            if line.startswith("READY"):
                break
    start = time.time() + 0.5
    for p in procs:
        p.stdin.write(f"{start}\n".encode())
        p.stdin.flush()
    results = []
    for p in procs:
        out, err = p.communicate()
        if p.returncode != 0:
            sys.exit(err.decode()[-3000:])
        results.append(json.loads(out.decode().strip().splitlines()[-1]))
    return {"models": results}


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(q * (len(v) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-blocks", type=int, default=200)
    ap.add_argument("--bursts", type=int, default=6)
    ap.add_argument("--burst-requests", type=int, default=16)
    ap.add_argument("--rate", type=float, default=8.0)
    ap.add_argument("--gap-s", type=float, default=8.0)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=1, help="runs of both arms, alternating which goes first")
    ap.add_argument("--min-share", type=float, default=0.25)  # of the budget, guaranteed to each engine
    ap.add_argument(
        "--page-size", type=int, default=LAYER_BLOCK_BYTES,
        help="the budget's page size (default: one layer's block, so that blocks never share a page)",
    )  # fmt: skip
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "vllm_elastic"))
    args = ap.parse_args()
    from vpaged.memory import SharedBudget

    work = Path(tempfile.mkdtemp(prefix="vpaged_elastic_"))
    for which in (0, 1):
        subprocess.run(
            [sys.executable, str(ROOT / "tests" / "integrations" / "test_vllm_plugin.py"), "model", f"{work}/m{which}"],
            check=True,
        )
    arrivals = schedule(args.bursts, args.burst_requests, args.rate, args.gap_s, args.seed)
    (work / "arrivals.json").write_text(json.dumps(arrivals))
    budget_name = f"vpaged-elastic-{os.getpid()}"
    report = {"cpu": machine()["cpu"], "settings": vars(args), "budget_bytes": args.budget_blocks * BLOCK_BYTES}
    runs: dict[str, list[dict]] = {"static": [], "shared": []}
    for k in range(args.rounds):
        for mode in ("static", "shared") if k % 2 == 0 else ("shared", "static"):  # neither always goes first
            shared = mode == "shared"
            budget = (
                SharedBudget.create(budget_name, args.budget_blocks * BLOCK_BYTES, args.page_size) if shared else None
            )
            try:
                runs[mode].append(run_mode(mode, f"{work}/m", args, str(work / "arrivals.json"), budget_name))
            finally:
                if budget is not None:
                    budget.close()
                    SharedBudget.remove(budget_name)
    for mode, results in runs.items():
        # Every round's requests pooled per model: the percentiles of all of them.
        per_model = [[t for res in results for t in res["models"][i]["ttft"].values()] for i in (0, 1)]
        both = per_model[0] + per_model[1]
        report[mode] = {
            "ttft_p50_s": {f"model{i}": pct(v, 0.5) for i, v in enumerate(per_model)} | {"all": pct(both, 0.5)},
            "ttft_p99_s": {f"model{i}": pct(v, 0.99) for i, v in enumerate(per_model)} | {"all": pct(both, 0.99)},
            "ttft_mean_s": statistics.mean(both),
            "ttft_p99_per_round_s": [
                pct([t for m in res["models"] for t in m["ttft"].values()], 0.99) for res in results
            ],
            "peak_mapped_bytes": [max(res["models"][i]["peak_mapped_bytes"] for res in results) for i in (0, 1)],
            "runs": [res["models"] for res in results],
        }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report))
    print(json.dumps({k: v for k, v in report.items() if k not in ("static", "shared")}, indent=1))
    for mode in ("static", "shared"):
        print(mode, json.dumps({k: v for k, v in report[mode].items() if k != "runs"}))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--engine":
        a = sys.argv[2:]
        engine(a[0], int(a[1]), a[2], int(a[3]), int(a[4]))
    else:
        main()
