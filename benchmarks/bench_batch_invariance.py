"""Is the decode kernel batch-invariant? One row's attention output computed alone vs the same row inside a
batch of 16 (the other rows random, of other lengths), on fp32, int8 and fp8 K/V, bit for bit.

Issue #41 item 4: with int8 / fp8 K/V a greedy answer changed with what else was in the batch (12/16
identical alone vs among 16), while fp32 K/V gave 16/16. If the kernel alone is batch-invariant, the cause
lies upstream: fp32 linears are not batch-invariant (1.4e-5 on one row of SmolLM2's k_proj), and rounding
K/V to 8 bits turns such a difference into a whole quantization step now and then.

Geometry of SmolLM2-135M's attention (9 query heads, 3 kv heads, head_dim 64), lengths 1..400 (some past
the kernels' 256-token split), the target row at every position of the batch. Each format and thread count
reports the rows whose output is bit-identical and the largest difference.

    python benchmarks/bench_batch_invariance.py            # CPU, 1 and 2 threads (and CUDA when present)
    python benchmarks/bench_batch_invariance.py --quick    # fewer trials

Writes benchmarks/results/batch_invariance_<device>.json.
"""

from __future__ import annotations

import argparse
import contextlib

import torch
from common import machine, print_table, write_json

from vpaged import KVGeometry, VirtualCacheConfig, VirtualKVCache, ops

HEADS, KV_HEADS, HEAD_DIM, BATCH = 9, 3, 64, 16
FORMATS = {"fp32": None, "int8": torch.int8, "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


@contextlib.contextmanager
def torch_threads(n: int):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def trial(kv_dtype, device: str, gen: torch.Generator) -> tuple[int, float]:
    """(rows bit-identical alone and in the batch, largest |difference|) for one random batch."""
    lengths = torch.randint(1, 401, (BATCH,), generator=gen).tolist()
    scales = None if kv_dtype in (None, torch.int8) else "calibrate"
    cache = VirtualKVCache(
        KVGeometry(1, KV_HEADS, HEAD_DIM, torch.float32, kv_dtype=kv_dtype),
        VirtualCacheConfig(max_seqs=BATCH, max_seq_len=400, device=device, capacity_bytes=64 << 20, kv_scales=scales),
    )
    seqs = [cache.allocate() for _ in lengths]
    for s, n in zip(seqs, lengths):
        cache.extend(s, n)
        k, v = (torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen).to(device) for _ in range(2))
        cache.write(0, s, k, v)
    q = torch.randn(BATCH, HEADS, HEAD_DIM, generator=gen).to(device)
    together = ops.decode_attention(q, cache, seqs, 0)
    same, worst = 0, 0.0
    for row, s in enumerate(seqs):
        alone = ops.decode_attention(q[row : row + 1], cache, [s], 0)[0]
        same += int(torch.equal(alone, together[row]))
        worst = max(worst, float((alone - together[row]).abs().max()))
    cache.close()
    return same, worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 trials instead of 8")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cpu, and cuda when available)")
    args = ap.parse_args()
    trials = 2 if args.quick else 8
    devices = [args.device] if args.device else ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        rows, parts = [], []
        for threads in [1, 2] if device == "cpu" else [0]:
            for name, kv_dtype in FORMATS.items():
                gen = torch.Generator().manual_seed(1234)
                with torch_threads(threads) if threads else contextlib.nullcontext():
                    results = [trial(kv_dtype, device, gen) for _ in range(trials)]
                same = sum(r[0] for r in results)
                worst = max(r[1] for r in results)
                parts.append({"format": name, "threads": threads or None, "rows": trials * BATCH,
                              "bit_identical_rows": same, "max_abs_difference": worst})  # fmt: skip
                rows.append([name, threads or "-", f"{same}/{trials * BATCH}", f"{worst:.3g}"])
        print(
            f"\n{device}: one row alone vs in a batch of {BATCH} ({HEADS} heads / {KV_HEADS} kv heads, dim {HEAD_DIM})"
        )
        print_table(["K/V", "threads", "bit-identical rows", "max |diff|"], rows)
        write_json(
            f"batch_invariance_{device}.json",
            {
                "machine": machine(),
                "device": device,
                "batch": BATCH,
                "geometry": [HEADS, KV_HEADS, HEAD_DIM],
                "trials": trials,
                "parts": parts,
                "batch_invariant": all(p["bit_identical_rows"] == p["rows"] for p in parts),
            },  # fmt: skip
        )


if __name__ == "__main__":
    main()
