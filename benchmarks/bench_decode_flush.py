"""How the cache flush before a timed decode call changes what is measured (see NOTES.md).

One process, one set of K/V (from_tensors, Llama-3-8B geometry of bench_decode.py), round-robin over
(flush kind x workload) so load from other processes lands on every combination alike:

    write flush  fill a buffer of twice the L3 (the cache is left full of dirty lines)
    read flush   read that buffer (clean lines only)

and two workloads on the same bytes: the contiguous decode kernel, and torch.max over K and V (a plain
streaming read). Reports medians and the ratio write / read flush for each.

    python benchmarks/bench_decode_flush.py --threads 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from bench_decode import HEAD_DIM, HEADS, KV_HEADS, last_level_cache_bytes
from common import RESULTS, write_json

from vpaged import ops
from vpaged.kvcache.virtual.cache import BatchedKV


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    buf = torch.ones(max(256 << 20, min(2 * last_level_cache_bytes(), 2 << 30)) // 4, dtype=torch.int32)
    flushes = {"write": lambda: buf.fill_(1), "read": lambda: buf.max()}
    rows = []
    for dtype, batch, ctx in ((torch.float32, 8, 4096), (torch.float32, 1, 4096), (torch.bfloat16, 8, 4096)):
        k = torch.randn(batch, ctx, KV_HEADS, HEAD_DIM).to(dtype)
        v = torch.randn(batch, ctx, KV_HEADS, HEAD_DIM).to(dtype)
        desc = BatchedKV.from_tensors(k, v, ctx)
        q = torch.randn(batch, HEADS, HEAD_DIM).to(dtype)
        out = torch.empty_like(q)
        work = {
            "kernel": lambda: ops.decode_attention_contiguous(q, desc, out=out, max_len=ctx),
            "torch.max": lambda: (k.max(), v.max()),
        }
        samples = {(f, w): [] for f in flushes for w in work}
        for _ in range(args.repeats):
            for (f, w), s in samples.items():
                flushes[f]()
                t0 = time.perf_counter()
                work[w]()
                s.append(time.perf_counter() - t0)
        med = {key: statistics.median(s) * 1e3 for key, s in samples.items()}
        row = {
            "dtype": str(dtype).removeprefix("torch."),
            "batch": batch,
            "context": ctx,
            "kv_bytes": k.nbytes + v.nbytes,
            "median_ms": {f"{w}, {f} flush": t for (f, w), t in med.items()},
            "write_over_read": {w: med[("write", w)] / med[("read", w)] for w in work},
            "load_average": os.getloadavg(),
        }
        rows.append(row)
        print(row, flush=True)
    write_json(RESULTS / "decode_flush_cpu.json", {"benchmark": "decode_flush", "threads": args.threads, "rows": rows})


if __name__ == "__main__":
    main()
