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

Writes benchmarks/results/OUTPUT (default linear.json). Time it on a quiet machine.
"""

from __future__ import annotations

import argparse
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
    ap.add_argument("--output", default="linear.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
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
        for li, layer in enumerate(arms[arm]):
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
                "ms": round(med * 1e3, 2),
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
            args.output,
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
