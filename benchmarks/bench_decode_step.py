"""Fixed cost of a decode call through a PagedKVCache on the CPU: the per-step path against the tensor API.

Per dtype, round-robin in one process (medians, no flush, 1 layer, bench_decode.py's geometry):

    contiguous      decode_attention on a VirtualKVCache (its per-step path)
    paged           decode_attention on a PagedKVCache (prebuilt layer parameters, tables and lengths as lists)
    paged_tensors   what decode_attention on a PagedKVCache did before it had that path: block_tables() and
                    lengths() as tensors, then decode_attention_paged(..., max_len=)

on a 1-token context (batch 1) and on batch 32 x 512 tokens (32 blocks per table). Then the cost of handing a
step's tables over, batch 32 x 4096 tokens (256 blocks per table, the kernel not run): tables_and_lengths()
(lists) plus their conversion into C++ (estimated: a call the entry refuses after converting its arguments,
less one with a 1-entry table) against block_tables() + lengths() (tensors).

    python benchmarks/bench_decode_step.py --threads 2 --dtypes fp32,bf16
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from vpaged import _C, KVGeometry, PagedCacheConfig, PagedKVCache, VirtualCacheConfig, VirtualKVCache, ops
from vpaged.errors import InvalidArgumentError
from vpaged.ops.plans import layer_plan

KV_HEADS, HEADS, HEAD_DIM, BLOCK = 8, 32, 128, 16
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def medians_us(fns: dict, repeats: int) -> dict:
    for fn in fns.values():
        fn()  # warm-up: lazy init, layer parameters, allocator
    samples = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(s) * 1e6 for name, s in samples.items()}


def caches(dtype, batch: int, ctx: int):
    """A PagedKVCache and a VirtualKVCache holding the same random K/V for `batch` sequences of ctx tokens."""
    paged = PagedKVCache(
        KVGeometry(1, KV_HEADS, HEAD_DIM, dtype),
        PagedCacheConfig(max_seqs=batch, max_seq_len=ctx, num_blocks=batch * -(-ctx // BLOCK), block_size=BLOCK),
    )
    virt = VirtualKVCache(
        KVGeometry(1, KV_HEADS, HEAD_DIM, dtype),
        VirtualCacheConfig(max_seqs=batch, max_seq_len=ctx, capacity_bytes=batch * ctx * 8 * 1024 + (8 << 20)),
    )
    ps, vs = paged.allocate_many(batch), virt.allocate_many(batch)
    paged.extend_many(ps, ctx)
    for p, v in zip(ps, vs):
        virt.extend(v, ctx)
        k, val = (torch.randn(ctx, KV_HEADS, HEAD_DIM).to(dtype) for _ in range(2))
        paged.write(0, p, k, val)
        virt.write(0, v, k, val)
    return paged, ps, virt, vs


def calls(dtype, batch: int, ctx: int, repeats: int) -> dict:
    paged, ps, virt, vs = caches(dtype, batch, ctx)
    q = torch.randn(batch, HEADS, HEAD_DIM).to(dtype)
    out = torch.empty_like(q)
    fns = {
        "contiguous": lambda: ops.decode_attention(q, virt, vs, 0, out=out),
        "paged": lambda: ops.decode_attention(q, paged, ps, 0, out=out),
        "paged_tensors": lambda: ops.decode_attention_paged(
            q,
            paged.key_caches[0],
            paged.value_caches[0],
            paged.block_tables(ps),
            paged.lengths(ps),
            out=out,
            max_len=max(paged.seq_len(s) for s in ps),
        ),
    }
    times = medians_us(fns, repeats)
    got = ops.decode_attention(q, paged, ps, 0)
    assert torch.equal(got, fns["paged_tensors"]()), "the two block-table paths differ"
    paged.close()
    virt.close()
    return times


def handover(batch: int, ctx: int, repeats: int) -> dict:
    paged = PagedKVCache(
        KVGeometry(1, 1, 8, torch.float32),
        PagedCacheConfig(max_seqs=batch, max_seq_len=ctx, num_blocks=batch * ctx // BLOCK, block_size=BLOCK),
    )
    ps = paged.allocate_many(batch)
    paged.extend_many(ps, ctx)
    base = layer_plan(paged, 0).params
    tables, _ = paged.tables_and_lengths(ps)
    q = torch.zeros(1, 1, 8)

    def refused(tbl) -> None:
        # The entry converts its arguments, then refuses the first length: conversion + one raised error.
        try:
            _C.decode_cpu_tables(base, q.data_ptr(), q.data_ptr(), 1, 1.0, tbl, [0] * len(tbl))
        except InvalidArgumentError:
            pass

    t = medians_us(
        {
            "lists": lambda: paged.tables_and_lengths(ps),
            "tensors": lambda: (paged.block_tables(ps), paged.lengths(ps)),
            "refused": lambda: refused(tables),
            "refused_1": lambda: refused([[0]]),
        },
        repeats,
    )
    return {
        "tables_and_lengths": t["lists"],
        "conversion into C++ (est.)": t["refused"] - t["refused_1"],
        "block_tables+lengths": t["tensors"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1001)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"threads {torch.get_num_threads()}, load average {os.getloadavg()}")
    for name in args.dtypes.split(","):
        dtype = DTYPES[name.strip()]
        for batch, ctx, repeats in ((1, 1, args.repeats), (32, 512, max(21, args.repeats // 20))):
            t = calls(dtype, batch, ctx, repeats)
            print(
                f"{name:>5} {batch:>3} x {ctx:<4} " + "  ".join(f"{k} {v:8.1f} us" for k, v in t.items()),
                f"  paged_tensors/paged {t['paged_tensors'] / t['paged']:.2f}",
                flush=True,
            )
    h = handover(32, 4096, max(21, args.repeats // 10))
    print("tables of 32 x 4096 tokens handed over: " + ", ".join(f"{k} {v:.1f} us" for k, v in h.items()))
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
