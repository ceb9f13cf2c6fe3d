"""A decode step's K/V writes: ops.write_kv once per layer (each call checking and copying the step's rows,
positions and bounds) against one ops.WritePlan built for the step and written per layer, side by side in one
process on the same cache and sources.

The cache has SmolLM2-135M-Instruct's K/V shape by default (30 layers, 3 kv heads of 64, fp32); --batch sequences
of --context tokens each get one new token per layer, as a decode step writes them (sources strided as attention
hands them). Per batch size the arms alternate round by round; reported: the median milliseconds a step of each
arm (the plan's construction included), and the plan's over write_kv's.

    .venv/bin/python benchmarks/bench_write_plan.py [--batch 1,8,32] [--layers 30] [--kv-heads 3] [--head-dim 64]
        [--context 200] [--repeats 31]

Writes benchmarks/results/OUTPUT (default write-plan.json).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, print_table, write_json  # noqa: E402

from vpaged import KVGeometry, VirtualCacheConfig, VirtualKVCache, ops  # noqa: E402


def step_arms(cache, seqs, layers: int):
    """The two ways to write one decode step's new tokens (rows 0..B-1, one each) into every layer."""
    batch = len(seqs)
    descriptors = [cache.batch(layer, seqs) for layer in range(layers)]
    rows = torch.arange(batch, dtype=torch.int32)
    positions = torch.tensor([cache.seq_len(s) - 1 for s in seqs], dtype=torch.int32)
    first = torch.tensor([cache.writable_range(s)[0] for s in seqs], dtype=torch.int32)
    geometry = cache.geometry
    k = torch.randn(geometry.num_kv_heads, batch, geometry.head_dim).transpose(0, 1)
    v = torch.randn(geometry.num_kv_heads, batch, geometry.head_dim).transpose(0, 1)

    def per_layer():
        for layer in range(layers):
            ops.write_kv(k, v, descriptors[layer], rows, positions, writable_from=first, check_mapped=False)

    def plan():
        step = ops.WritePlan(descriptors, rows, positions, writable_from=first, check_mapped=False)
        for layer in range(layers):
            step.write(layer, k, v)

    return {"write_kv per layer": per_layer, "WritePlan": plan}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=31)
    ap.add_argument("--output", default="write-plan.json")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batch.split(",")]
    results = []
    for batch in batches:
        cache = VirtualKVCache(
            KVGeometry(args.layers, args.kv_heads, args.head_dim, torch.float32),
            VirtualCacheConfig(max_seqs=batch, max_seq_len=args.context, capacity_bytes=1 << 30),
        )
        seqs = []
        for _ in range(batch):
            s = cache.allocate()
            cache.extend(s, args.context)
            seqs.append(s)
        arms = step_arms(cache, seqs, args.layers)
        times = {name: [] for name in arms}
        for fn in arms.values():
            fn()  # warm-up
        for r in range(args.repeats):
            for name in list(arms) if r % 2 == 0 else list(arms)[::-1]:
                t = time.perf_counter()
                arms[name]()
                times[name].append(time.perf_counter() - t)
        ms = {name: round(statistics.median(ts) * 1e3, 4) for name, ts in times.items()}
        results.append(
            {"batch": batch, "ms": ms, "plan_over_write_kv": round(ms["WritePlan"] / ms["write_kv per layer"], 3)}
        )
        cache.close()
    payload = {
        "benchmark": "write-plan",
        "machine": machine(),
        "layers": args.layers,
        "kv_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "context": args.context,
        "repeats": args.repeats,
        "results": results,
    }
    print_table(
        ["batch", "write_kv per layer ms", "WritePlan ms", "plan / write_kv"],
        [[r["batch"], r["ms"]["write_kv per layer"], r["ms"]["WritePlan"], r["plan_over_write_kv"]] for r in results],
    )
    write_json(args.output if "/" not in args.output else Path(args.output), payload)
    return payload


if __name__ == "__main__":
    main()
