"""Decode attention on quantized K/V (int8 with a scale per head row, fp8 e4m3 / e5m2 with per-tensor scales)
against bf16 K/V, on the CPU kernels directly (raw buffers, no caches).

Batch 8, 32 query heads / 8 kv heads, head_dim 128, contexts 1K / 4K / 8K (every sequence that long), dense
[batch, tokens, kv_heads, row] buffers: bf16 rows of 128 x 2 bytes, int8 rows of 128 + 4 bytes (the float32
scale after the values), fp8 rows of 128 bytes. Per CPU code path (forced: baseline, avx2, and the best one
when it is neither) the four formats of a context are timed round-robin (one call of each per round, so a
burst of load from other processes lands on all alike), each call after flushing the caches by reading a
buffer larger than the last-level cache (see bench_decode.py: every call reads K/V from memory, as a decode
step over many layers would). Reports the median ms, the K/V read rate, and quantized / bf16. With --warm the
caches are not flushed: K/V small enough (--batch 1, a short context) stay in the core's caches from call to
call, and the times show the kernel's own work rather than the memory's.

    python benchmarks/bench_decode_quant.py                  # 2 threads, 7 repeats
    python benchmarks/bench_decode_quant.py --repeats 15 --contexts 4096
    python benchmarks/bench_decode_quant.py --threads 1 --clock cpu   # on a machine busy with other work
    python benchmarks/bench_decode_quant.py --warm --batch 1 --threads 1 --contexts 64 192 --repeats 201

Writes benchmarks/results/decode_quant_<machine>.json (machine: e.g. epyc-avx2-2c, xeon-avx512-2c).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from bench_decode import Timer  # noqa: E402 - this folder is on sys.path when run as a script
from common import RESULTS, machine, print_table, write_json

from vpaged import _C

BATCH, HEADS, KV_HEADS, HEAD_DIM = 8, 32, 8, 128  # BATCH: --batch
FORMATS = {"bf16": (2, -1), "int8": (0, 3), "e4m3": (0, 4), "e5m2": (0, 5)}  # name: (dtype, kv_dtype)


def machine_tag(info: dict) -> str:
    cpu = info["cpu"].lower()
    name = "epyc" if "epyc" in cpu else "xeon" if "xeon" in cpu else (cpu.split()[0] if cpu else "cpu")
    # The best ISA of this CPU in the name, so that runs on an AVX2 and an AVX-512 box of one vendor land in
    # different files.
    name += "-" + _C.decode_cpu_isas()[-1]
    return f"{name}-{info['cores']}c"


def storage(fmt: str, ctx: int, gen: torch.Generator):
    """(K buffer, V buffer, head row in elements, k_scale, v_scale): random K/V of BATCH sequences of ctx tokens."""
    shape = (BATCH, ctx, KV_HEADS, HEAD_DIM)
    if fmt == "bf16":
        return (
            torch.randn(shape, generator=gen).to(torch.bfloat16),
            torch.randn(shape, generator=gen).to(torch.bfloat16),
            HEAD_DIM,
            1.0,
            1.0,
        )
    if fmt == "int8":
        bufs = []
        for _ in range(2):
            vals = torch.randint(-127, 128, shape, dtype=torch.int8, generator=gen)
            scale = torch.rand(*shape[:3], 1, generator=gen) / 127
            bufs.append(torch.cat([vals.view(torch.uint8), scale.view(torch.uint8)], -1).contiguous())
        return bufs[0], bufs[1], HEAD_DIM + 4, 1.0, 1.0
    dt = torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2
    k = (torch.randn(shape, generator=gen) * 16).to(dt).view(torch.uint8)
    v = (torch.randn(shape, generator=gen) * 16).to(dt).view(torch.uint8)
    return k, v, HEAD_DIM, 1 / 16, 1 / 16


def cell_params(fmt: str, ctx: int, gen: torch.Generator):
    dtype, kv_dtype = FORMATS[fmt]
    k, v, row, k_scale, v_scale = storage(fmt, ctx, gen)
    q = torch.randn(BATCH, HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16 if dtype == 2 else torch.float32)
    out = torch.empty_like(q)
    lengths = torch.full((BATCH,), ctx, dtype=torch.int32)
    slots = torch.arange(BATCH, dtype=torch.int32)
    p = _C.DecodeParams()
    p.dtype, p.kv_dtype = dtype, kv_dtype
    p.num_seqs, p.num_heads, p.num_kv_heads, p.head_dim = BATCH, HEADS, KV_HEADS, HEAD_DIM
    p.q, p.out, p.k, p.v = q.data_ptr(), out.data_ptr(), k.data_ptr(), v.data_ptr()
    p.token_stride, p.head_stride = KV_HEADS * row, row
    p.slot_stride = ctx * KV_HEADS * row
    p.lengths, p.slots, p.max_tokens = lengths.data_ptr(), slots.data_ptr(), ctx
    p.scale, p.k_scale, p.v_scale = 1 / math.sqrt(HEAD_DIM), k_scale, v_scale
    kv_bytes = k.numel() * k.element_size() + v.numel() * v.element_size()
    return p, (k, v, q, out, lengths, slots), kv_bytes


def main() -> None:
    global BATCH  # --batch: storage() and cell_params() read it
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: the calling thread's CPU time (with --threads 1, on a machine busy with other work)",
    )
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--batch", type=int, default=BATCH, help="sequences per call (every one of the context's length)")
    ap.add_argument(
        "--warm",
        action="store_true",
        help="no cache flush: each timed call right after an untimed call of the same format (its K/V as far up "
        "the cache hierarchy as they fit)",
    )
    ap.add_argument("--isas", nargs="+", default=None, help="CPU code paths (default: baseline, avx2, the best)")
    ap.add_argument(
        "--output", type=Path, default=None, help="JSON file name under benchmarks/results/ (an absolute path as given)"
    )
    args = ap.parse_args()
    BATCH = args.batch

    have = _C.decode_cpu_isas()
    isas = args.isas or [i for i in ("baseline", "avx2") if i in have] + (
        [have[-1]] if have[-1] not in ("baseline", "avx2") else []
    )
    info = machine()
    out_path = RESULTS / (args.output or f"decode_quant_{machine_tag(info)}.json")
    if args.clock == "cpu" and args.threads != 1:
        ap.error("--clock cpu measures the calling thread only: use it with --threads 1")
    timer = Timer(torch.device("cpu"), args.clock)
    gen = torch.Generator().manual_seed(0)
    rows, results = [], []
    for ctx in args.contexts:
        cells = {fmt: cell_params(fmt, ctx, gen) for fmt in FORMATS}
        for isa in isas:
            fns = {fmt: (lambda p=c[0]: _C.decode_cpu(p, args.threads, isa)) for fmt, c in cells.items()}
            times = timer.many(fns, args.repeats, flush=not args.warm, primes=fns if args.warm else None)
            base = times["bf16"]
            for fmt, t in times.items():
                gbps = cells[fmt][2] / t / 1e9
                results.append(
                    {"context": ctx, "isa": isa, "format": fmt, "ms": t * 1e3, "kv_gb_per_s": gbps, "vs_bf16": t / base}
                )
                rows.append([ctx, isa, fmt, f"{t * 1e3:.2f}", f"{gbps:.1f}", f"{t / base:.2f}"])
        del cells
        payload = {
            "benchmark": "decode_quant",
            "machine": info,
            "config": {
                "batch": BATCH,
                "heads": HEADS,
                "kv_heads": KV_HEADS,
                "head_dim": HEAD_DIM,
                "threads": args.threads,
                "clock": args.clock,
                "repeats": args.repeats,
                "contexts": args.contexts,
                "isas": isas,
                "flush_bytes": 0 if args.warm else timer.flush.numel() * 4,
                "timing": "median over repeats, formats round-robin, "
                + (
                    "each timed call right after an untimed call of the same format (no flush)"
                    if args.warm
                    else "caches flushed (by a read) before each call"
                ),
            },
            "results": results,
        }
        write_json(out_path, payload)
    print(
        f"{info['cpu']}, {args.threads} threads ({args.clock} clock), batch {BATCH}, {HEADS}/{KV_HEADS} heads, d{HEAD_DIM}"
        + (", warm (no flush)" if args.warm else "")
    )
    print_table(["context", "isa", "format", "ms", "KV GB/s", "vs bf16"], rows)
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
