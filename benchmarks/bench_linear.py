"""A model's linear products at decode and prompt row counts: vpaged's panel product (vpaged.ops.linear) against
oneDNN's product on its packed weight (what vpaged.hf.prepack and vLLM's CPU backend run) and F.linear (MKL on the
plain weight), side by side in one process.

The layers are a real model's shapes with their own weights, 30 layers of SmolLM2-135M by default (q, k, v, o,
gate+up as one product, down; 428 MB of fp32 weights, far past any cache), called in the model's order, so every
product streams its weight from memory as a decode step's does. Per row count M, the arms alternate round by
round; reported per arm: median milliseconds for all layers, GFLOP/s, GB/s of weights read, and each arm's time
over the panel product's. In --dtype bfloat16 the weights are bf16: the panel product reads them as they are,
oneDNN packs them (in fp32 where the CPU has no bf16 path, as pack_weight does) and F.linear runs torch's bf16
matmul.

    .venv/bin/python benchmarks/bench_linear.py [--rows 1,4,8,16,32,64,128,256,512] [--dtype float32]
        [--layers 30] [--hidden 576] [--intermediate 1536] [--kv-width 192] [--repeats 7] [--threads 2]

--engine: instead, the serving engine on SmolLM2-135M-Instruct (benchmarks/real_model.py) with each packing plan
of --plans (vpaged.hf.prepack.linear_plan forced to each; default "onednn,panels"): one engine per plan in one
process, a burst of 32 random prompts x 256 tokens -> 64 (greedy, ignore_eos) on each in turn, --repeats rounds,
fresh prompts every round; reported: each burst's seconds, each plan's median over the first plan's, the time in
the linear products split at 64 rows (decode steps below, prompt steps above), and how many completions every plan
shares with the first. --max-batched sets the engines' tokens per step (default 2,048, the engine's own).

Writes benchmarks/results/OUTPUT (default linear.json, or linear-engine.json). Time it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, print_table, write_json  # noqa: E402

from vpaged.hf.prepack import pack_onednn, packed_linear_ops  # noqa: E402
from vpaged.ops.linear import pack_panels, panel_linear  # noqa: E402


def layer_shapes(hidden: int, intermediate: int, kv_width: int) -> list[tuple[int, int]]:
    """(out_features, in_features) of one decoder layer's products, in call order."""
    return [
        (hidden, hidden),
        (kv_width, hidden),
        (kv_width, hidden),
        (hidden, hidden),
        (2 * intermediate, hidden),
        (hidden, intermediate),
    ]


def engine_section(args) -> None:
    """The --engine run (see the module's text)."""
    import collections
    import random

    import real_model

    import vpaged.hf.fused as fused_module
    import vpaged.hf.prepack as prepack_module
    from vpaged.serve import LLM, SamplingParams

    split = collections.defaultdict(float)
    current = ["warm-up"]
    plain = prepack_module.packed_linear

    def count(x, seconds):
        rows = x.numel() // x.shape[-1]
        split[(current[0], "rows <= 64" if rows <= 64 else "rows > 64")] += seconds

    def timed(x, packed, bias=None, weight=None):
        t = time.perf_counter()
        y = plain(x, packed, bias, weight)
        count(x, time.perf_counter() - t)
        return y

    class TimedFunctional:
        """torch.nn.functional for the fused MLP, its F.linear timed: past PANEL_ROWS_MAX rows on fp32 panels it
        runs gate_proj's and up_proj's products there, not through packed_linear."""

        def __getattr__(self, name):
            return getattr(F, name)

        @staticmethod
        def linear(x, weight, bias=None):
            t = time.perf_counter()
            y = F.linear(x, weight, bias)
            count(x, time.perf_counter() - t)
            return y

    prepack_module.packed_linear = fused_module.packed_linear = timed
    fused_module.F = TimedFunctional()

    def prompts(seed: int, n: int = 32, length: int = 256) -> list[list[int]]:
        rng = random.Random(seed)
        return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]

    dtype = getattr(torch, args.dtype)
    plans = args.plans.split(",")
    for plan in plans:
        if plan not in prepack_module.LINEAR_PLANS:
            raise SystemExit(f"--plans: {plan!r} is not one of {prepack_module.LINEAR_PLANS}")
    engines = {}
    for plan in plans:
        prepack_module.linear_plan = lambda plan=plan: plan
        model, tok = real_model.load(dtype)
        engines[plan] = LLM(model, tok, kv_budget_bytes=1 << 30, max_num_batched_tokens=args.max_batched)
        engines[plan].generate(prompts(99, 2), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    seconds = {plan: [] for plan in engines}
    same = total = 0
    for r in range(args.repeats):
        tokens = {}
        for plan, llm in engines.items():
            current[0] = plan
            t = time.perf_counter()
            outs = llm.generate(prompts(1000 + r), params)
            seconds[plan].append(round(time.perf_counter() - t, 2))
            tokens[plan] = [list(o.outputs[0].token_ids) for o in outs]
        first = tokens[plans[0]]
        same += sum(all(t[i] == first[i] for t in tokens.values()) for i in range(len(first)))
        total += len(first)
        print(f"round {r + 1}: " + ", ".join(f"{p} {seconds[p][-1]} s" for p in engines), flush=True)
    medians = {plan: statistics.median(v) for plan, v in seconds.items()}
    payload = {
        "benchmark": "linear-engine",
        "machine": machine(),
        "dtype": args.dtype,
        "threads": args.threads,
        "workload": f"SmolLM2-135M-Instruct, 32 x 256 -> 64, greedy, max_num_batched_tokens {args.max_batched}",
        "plans": plans,
        "seconds": seconds,
        "median_seconds": medians,
        "over_first_plan": {plan: round(medians[plan] / medians[plans[0]], 3) for plan in plans[1:]},
        "linear_seconds": {f"{plan}, {rows}": round(v, 2) for (plan, rows), v in sorted(split.items())},
        "identical_completions": [same, total],
    }
    write_json(args.output or "linear-engine.json", payload)
    print(
        json.dumps(
            {k: payload[k] for k in ("median_seconds", "over_first_plan", "linear_seconds", "identical_completions")},
            indent=1,
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,8,16,32,64,128,256,512")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--kv-width", type=int, default=192)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engine", action="store_true", help="the engine on SmolLM2 with each plan (see above)")
    ap.add_argument("--plans", default="onednn,panels", help="--engine: the packing plans, the first the reference")
    ap.add_argument("--max-batched", type=int, default=2048, help="--engine: the engines' tokens per step")
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.engine:
        engine_section(args)
        return
    dtype = getattr(torch, args.dtype)
    rows_list = [int(r) for r in args.rows.split(",")]
    shapes = layer_shapes(args.hidden, args.intermediate, args.kv_width)
    gen = torch.Generator().manual_seed(0)
    weights = [[(torch.randn(n, k, generator=gen) / k**0.5).to(dtype) for n, k in shapes] for _ in range(args.layers)]
    ops = packed_linear_ops()
    arms = {"panels": [[pack_panels(w) for w in layer] for layer in weights]}
    if ops is not None:
        arms["onednn"] = [[pack_onednn(w, 64) for w in layer] for layer in weights]
    arms["F.linear"] = weights
    flops_per_row = 2 * sum(n * k for n, k in shapes) * args.layers
    weight_bytes = sum(w.numel() * w.element_size() for layer in weights for w in layer)
    x_full = torch.randn(max(rows_list), max(k for _, k in shapes), generator=gen).to(dtype)

    def forward(arm: str, m: int) -> None:
        for layer in arms[arm]:
            for (n, k), w in zip(shapes, layer):
                x = x_full[:m, :k]
                if arm == "panels":
                    panel_linear(x, w)
                elif arm == "onednn":
                    ops[1](x, w, None)
                else:
                    F.linear(x, w)

    results = []
    for m in rows_list:
        times = {arm: [] for arm in arms}
        for arm in arms:  # warm: oneDNN creates its primitives per shape on the first call
            forward(arm, m)
        for _ in range(args.repeats):
            for arm in arms:
                t = time.perf_counter()
                forward(arm, m)
                times[arm].append(time.perf_counter() - t)
        row = {"rows": m}
        base = statistics.median(times["panels"])
        for arm, ts in times.items():
            med = statistics.median(ts)
            row[arm] = {
                "ms": round(med * 1e3, 4),
                "gflops": round(flops_per_row * m / med / 1e9, 1),
                "weight_gbs": round(weight_bytes / med / 1e9, 1),
                "over_panels": round(med / base, 3),
            }
        results.append(row)
        print(
            f"M={m:4d} "
            + "  ".join(f"{arm} {row[arm]['ms']:8.1f} ms ({row[arm]['over_panels']:.2f}x)" for arm in arms),
            flush=True,
        )
        write_json(
            args.output or "linear.json",
            {
                "benchmark": "linear",
                "machine": machine(),
                "dtype": args.dtype,
                "threads": args.threads,
                "layers": args.layers,
                "shapes": shapes,
                "weight_bytes": weight_bytes,
                "repeats": args.repeats,
                "results": results,
            },
        )
    print_table(
        ["rows"] + [f"{arm} ms" for arm in arms] + [f"{arm} / panels" for arm in arms if arm != "panels"],
        [
            [r["rows"]] + [r[a]["ms"] for a in arms] + [r[a]["over_panels"] for a in arms if a != "panels"]
            for r in results
        ],
    )


if __name__ == "__main__":
    main()
