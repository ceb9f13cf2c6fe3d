"""Serving engines on several KV stores, stepped alternately in one process: a comparison that a shared,
loaded machine does not drown.

  python benchmarks/bench_serve_steps.py                       # kv=paged vs kv=vpaged, 64 requests x 16 tokens
  python benchmarks/bench_serve_steps.py --kv paged,vpaged,static --requests 32 --max-tokens 64
  python benchmarks/bench_serve_steps.py --kv vpaged-unfused,vpaged   # the fused RMSNorm / MLP forwards
  python benchmarks/bench_serve_steps.py --kv vpaged-transformers,vpaged --model smollm2 --dtype bfloat16
                                                                      # the direct forward vs transformers'

bench_serve.py runs its rows one after the other, so on a machine whose load changes by the minute a row's
time follows the neighbours' work as much as the cache (here: the same two rows 1.03x and 0.55x apart in
consecutive runs). This script builds one LLMEngine per store on the same requests (bench_serve's throughput
workload: prompts of 64..512 random ids, greedy, EOS ignored, all at t=0, bench-llama fp32) and steps them in
turn, the first one alternating, so every store's step i runs within seconds of the others'. The stores plan
identical steps (checked), so steps compare one to one: per-phase sums over the steps that carry prefill
chunks and over decode-only steps, the forward's wall and CPU time (CPU time is what a busy machine inflates
least), and the median over steps of each store's forward time divided by the first store's. Tokens are
checked identical. JSON to benchmarks/results/serve_steps_cpu.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("MKL_NUM_THREADS", "1")  # as bench_serve.py (see there)

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_model  # noqa: E402
from common import machine, write_json  # noqa: E402

from vpaged.hf.prepack import prepack_linears, prepack_supported  # noqa: E402
from vpaged.serve import LLMEngine, SamplingParams, load_model  # noqa: E402
from vpaged.serve.bench import random_prompts  # noqa: E402

PHASES = ("schedule", "prepare", "forward", "forward_cpu", "sample", "output")


def cpu_timed(fn, sink: list):
    def run(*a, **k):
        t0 = time.process_time()
        try:
            return fn(*a, **k)
        finally:
            sink.append(time.process_time() - t0)

    return run


def summarize(logs: dict[str, list[dict]], kinds: list[str], pick) -> dict | None:
    base = logs[kinds[0]]
    idx = [i for i, s in enumerate(base) if pick(s)]
    if not idx:
        return None
    out = {"steps": len(idx)}
    for kv in kinds:
        out[kv] = {p: sum(logs[kv][i][p] for i in idx) for p in PHASES}
    for kv in kinds[1:]:
        for key in ("forward", "forward_cpu"):
            out[kv][f"median_step_{key}_ratio"] = statistics.median(
                logs[kv][i][key] / base[i][key] for i in idx if base[i][key] > 0
            )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--kv", default="paged,vpaged", help="stores (<kv>-noprefix: prefix caching off), the first is the reference"
    )
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--min-prompt", type=int, default=64)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--budget-mib", type=int, default=1024)
    ap.add_argument(
        "--model", default="random:bench-llama", help="a load_model spec, or smollm2 (benchmarks/real_model.py)"
    )
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--max-batched", type=int, default=512, help="max_num_batched_tokens of every engine")
    ap.add_argument("--output", default="serve_steps_cpu.json", help="JSON file name under benchmarks/results/")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    kinds = list(dict.fromkeys(k.strip() for k in args.kv.split(",") if k.strip()))
    dtype = getattr(torch, args.dtype)
    spec = str(real_model.model_dir()) if args.model == "smollm2" else args.model
    model, _ = load_model(spec, dtype=dtype)
    prompts = random_prompts(
        args.requests, args.min_prompt, args.max_prompt, model.config.get_text_config(decoder=True).vocab_size
    )
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    load_before = open("/proc/loadavg").read().split()[:3]
    engines, cpu = {}, {}
    for kv in kinds:
        # "<kv>-noprefix": that store with prefix caching off; "<kv>-unfused": on a second copy of the model
        # (the same seeded weights) whose linears are prepacked but whose RMSNorms and MLPs run eager;
        # "<kv>-transformers": on a second copy, prepared alike, stepped by the transformers forward instead of
        # the direct forward (vpaged.serve.direct_forward).
        store, _, option = kv.partition("-")
        if option not in ("", "noprefix", "unfused", "transformers"):
            raise SystemExit(
                f"unknown store option {option!r} in {kv!r} (use <kv>, <kv>-noprefix, <kv>-unfused or <kv>-transformers)"
            )
        own_model = model
        if option in ("unfused", "transformers"):
            own_model, _ = load_model(spec, dtype=dtype)
        if option == "unfused" and prepack_supported(own_model.dtype)[0]:
            prepack_linears(own_model, batch_hint=64)
        e = LLMEngine(
            own_model,
            None,
            kv_budget_bytes=args.budget_mib << 20,
            max_num_seqs=64,
            max_num_batched_tokens=args.max_batched,
            kv=store,
            enable_prefix_caching=option != "noprefix",
            max_model_len=args.max_prompt + args.max_tokens,
            record_steps=True,
            cpu_prepack=option != "unfused",  # the unfused copy stays as prepared above
            direct_forward=option != "transformers",
        )
        for p in prompts:
            e.add_request(list(p), params)
        cpu[kv] = []
        e.runner.forward = cpu_timed(e.runner.forward, cpu[kv])
        engines[kv] = e
    tokens = {kv: {} for kv in kinds}
    step = 0
    try:
        while any(e.has_unfinished() for e in engines.values()):
            for kv in kinds if step % 2 == 0 else kinds[::-1]:
                if engines[kv].has_unfinished():
                    for out in engines[kv].step():
                        tokens[kv][out.request_id] = list(out.token_ids)
            step += 1
        logs = {}
        for kv, e in engines.items():
            logs[kv] = [dict(s.as_dict(), forward_cpu=c) for s, c in zip(e.step_log, cpu[kv])]
    finally:
        for e in engines.values():
            e.close()
    base = logs[kinds[0]]
    for kv in kinds[1:]:
        same = len(logs[kv]) == len(base) and all(
            (a["decodes"], a["prefill_tokens"]) == (b["decodes"], b["prefill_tokens"]) for a, b in zip(base, logs[kv])
        )
        if not same:
            raise SystemExit(f"kv={kv} planned other steps than kv={kinds[0]}: no step-by-step comparison")
    report = {
        "machine": machine(),
        "threads": args.threads,
        "config": vars(args),
        "load_average_before": load_before,
        "load_average_after": open("/proc/loadavg").read().split()[:3],
        "tokens_identical": all(tokens[kv] == tokens[kinds[0]] for kv in kinds),
        "forward_paths": {
            kv: "direct" if e.runner.direct is not None else e.direct_forward_off for kv, e in engines.items()
        },
        "prefill_steps": summarize(logs, kinds, lambda s: s["prefill_tokens"] > 0),
        "decode_steps": summarize(logs, kinds, lambda s: s["prefill_tokens"] == 0),
        "total_seconds": {kv: sum(s[p] for s in logs[kv] for p in PHASES if p != "forward_cpu") for kv in kinds},
    }
    for name in ("prefill_steps", "decode_steps"):
        part = report[name]
        if part is None:
            continue
        print(f"{name} ({part['steps']} steps), seconds summed; ratios to kv={kinds[0]}")
        for p in PHASES:
            cells = "  ".join(f"{kv} {part[kv][p]:8.3f}" for kv in kinds)
            ratios = "  ".join(f"{part[kv][p] / part[kinds[0]][p]:.3f}" for kv in kinds[1:] if part[kinds[0]][p] > 0)
            print(f"  {p:12s} {cells}   {ratios}")
        for kv in kinds[1:]:
            print(
                f"  median per-step forward ratio {kv}/{kinds[0]}: wall {part[kv]['median_step_forward_ratio']:.3f}, "
                f"CPU {part[kv]['median_step_forward_cpu_ratio']:.3f}"
            )
    tot = report["total_seconds"]
    print("all steps:", ", ".join(f"{kv} {tot[kv]:.2f} s ({tot[kv] / tot[kinds[0]]:.3f}x)" for kv in kinds))
    print("tokens identical:", report["tokens_identical"], "load", report["load_average_after"])
    print(f"wrote {write_json(args.output, report)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
