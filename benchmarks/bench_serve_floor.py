"""The floor of bench_serve.py's throughput workload on this machine: the least time any engine could take.

Any engine, whatever its cache, must run the model's matrix products over every prompt token and every
decode token, and each decode token must read the K/V of its whole context. This script counts both for the
throughput workload (the same prompts as bench_serve.py: 64 requests of 64..512 random ids, 128 output tokens
each, bench-llama in --dtype: float32, or bfloat16 as bench_serve.py --dtype bfloat16 runs it) and prices them at
rates measured here, in this process, the way a forward meets them (bf16 products at the box's bf16 rate: oneDNN
runs them on AMX or AVX512_BF16 where the CPU has them, so a bf16 floor can be well below the fp32 one):

  products   the model's own linear layers (every decoder layer's, then the LM head), run in forward order on
             M rows with their real weights, so the weights stream from memory as in a step, at M = 512
             (bench_serve's token budget per step) and M = 64 (its batch), each at the faster of F.linear and
             oneDNN's matmul on weights packed once (the engine's cpu_prepack path); prompt attention
             (causal, every query head) counts as product flops
  K/V        bytes a decode token reads over every layer, at the rate of a large torch max reduction

The floor prices every product at the better of the two rates (a decode row may ride in a prompt step's
512-row products) and counts element-wise ops, norms, sampling, scheduling and cache bookkeeping as free:
no engine runs the workload faster on this machine. The estimate prices decode tokens at the 64-row rate
instead, the shape of a step of decodes alone. How far above them an engine runs (x floor) is comparable
across machines, where tokens/s are not. With --compare, the rows of a bench_serve JSON (each kv at the median
of its rounds) are set against both, and so is the time a row would need to run at 6x generate_batch's tokens/s.

  python benchmarks/bench_serve_floor.py
  python benchmarks/bench_serve_floor.py --compare serve_throughput-rows_epyc-avx2-2c.json
  python benchmarks/bench_serve_floor.py --dtype bfloat16 --compare serve_throughput-bfloat16-...json

Writes benchmarks/results/serve_floor_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("MKL_NUM_THREADS", "1")  # as bench_serve.py: the products still use every torch thread

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, machine, write_json  # noqa: E402

from vpaged.hf.prepack import pack_weight, packed_linear  # noqa: E402
from vpaged.serve import load_model  # noqa: E402
from vpaged.serve.bench import random_prompts  # noqa: E402
from vpaged.serve.models import model_geometry  # noqa: E402


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def products_rate(layer_linears: list, head, rows: int, repeats: int, packed: bool = False) -> float:
    """Flops per second of the model's linear layers in forward order on `rows` rows (LM head included):
    F.linear on the plain weights, or (packed) the products on weights packed once (prepack's plan: oneDNN for
    `rows` rows, or vpaged's panels), the engine's cpu_prepack path (0.0 where this torch / CPU cannot pack them)."""
    linears = [*layer_linears, head]
    dtype = head.weight.dtype  # a bf16 model's products are bf16 x bf16 (fp32 accumulation)
    inputs = {m.in_features: torch.randn(rows, m.in_features, dtype=dtype) for m in linears}
    if packed:
        weights = [pack_weight(m.weight, rows) for m in linears]
        if any(w is None for w in weights):
            return 0.0

        def forward_products():
            for m, w in zip(linears, weights):
                packed_linear(inputs[m.in_features], w, None, m.weight)
    else:

        def forward_products():
            for m in linears:
                torch.nn.functional.linear(inputs[m.in_features], m.weight)

    flops = sum(2 * rows * m.weight.numel() for m in linears)
    with torch.inference_mode():
        return flops / median_seconds(forward_products, repeats)


def read_rate(repeats: int) -> float:
    src = torch.ones(256 << 20, dtype=torch.int32)  # 1 GiB, beyond any last-level cache
    return 4 * src.numel() / median_seconds(src.max, repeats)


def workload_counts(model, prompts: list[list[int]], max_tokens: int) -> dict:
    """Flops and bytes the throughput workload needs, whatever runs it."""
    cfg = model.config.get_text_config(decoder=True)
    layers, kv_heads, head_dim = model_geometry(cfg)
    heads = cfg.num_attention_heads
    head = model.get_output_embeddings()
    layer_params = sum(m.weight.numel() for m in layer_linears(model))
    head_params = head.weight.numel()
    lengths = [len(p) for p in prompts]
    prompt_tokens, requests = sum(lengths), len(prompts)
    decode_tokens = requests * (max_tokens - 1)  # the first output token comes from the prompt's forward
    itemsize = next(model.parameters()).element_size()
    kv_bytes_per_token = 2 * layers * kv_heads * head_dim * itemsize
    # Decode token j (1..max_tokens-1) of a prompt of p tokens attends to p + j tokens.
    decode_context_tokens = sum(p * (max_tokens - 1) + max_tokens * (max_tokens - 1) // 2 for p in lengths)
    # Causal prompt attention: query i attends to i + 1 keys; QK and PV, 2 flops a multiply-add.
    prompt_attention_flops = sum(4 * heads * head_dim * layers * p * (p + 1) // 2 for p in lengths)
    return {
        "requests": requests,
        "prompt_tokens": prompt_tokens,
        "decode_tokens": decode_tokens,
        "layer_params": layer_params,
        "head_params": head_params,
        "prompt_product_flops": 2 * layer_params * prompt_tokens + 2 * head_params * requests,
        "prompt_attention_flops": prompt_attention_flops,
        "decode_product_flops": 2 * (layer_params + head_params) * decode_tokens,
        "kv_bytes_per_token": kv_bytes_per_token,
        "decode_kv_bytes": decode_context_tokens * kv_bytes_per_token,
    }


def layer_linears(model) -> list:
    head = model.get_output_embeddings()
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head]


def compare(floor_s: float, estimate_s: float, path: Path) -> dict:
    data = json.loads(path.read_text())
    rounds: dict[str, list[float]] = {}  # a run with --repeats has a row per round: each kv at its median
    for r in data["throughput"]["rows"]:
        rounds.setdefault(r["kv"], []).append(r["seconds"])

    def against(seconds: float, each: list[float] | None = None) -> dict:
        out = {"seconds": seconds, "x_floor": seconds / floor_s, "x_estimate": seconds / estimate_s}
        if each and len(each) > 1:
            out["rounds_seconds"] = each
            out["rounds_x_floor"] = [s / floor_s for s in each]
        return out

    out = {"file": path.name, "rows": {kv: against(statistics.median(s), s) for kv, s in rounds.items()}}
    gb = rounds.get("generate_batch")
    if gb:
        out["six_x_generate_batch"] = against(statistics.median(gb) / 6)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="random:bench-llama")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--min-prompt", type=int, default=64)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-rows", type=int, default=512, help="rows per product for prompt tokens (token budget)")
    ap.add_argument("--decode-rows", type=int, default=64, help="rows per product for decode tokens (batch)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the model's (as bench_serve)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--compare", action="append", default=[], help="a bench_serve JSON under benchmarks/results/")
    ap.add_argument("--output", default="serve_floor_cpu.json", help="JSON file name under benchmarks/results/")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, _ = load_model(args.model, dtype=getattr(torch, args.dtype))
    vocab = model.config.get_text_config(decoder=True).vocab_size
    # seed=0: bench_serve.py's throughput prompts
    prompts = random_prompts(args.requests, args.min_prompt, args.max_prompt, vocab, seed=0)
    counts = workload_counts(model, prompts, args.max_tokens)
    linears, head = layer_linears(model), model.get_output_embeddings()
    # Each product at the faster of the two GEMM paths an engine may take on CPU: F.linear (MKL, plain weights)
    # and oneDNN's matmul on weights packed once (the engine's default, cpu_prepack).
    paths = {
        f"{kind}_{path}_flops_per_s": products_rate(linears, head, rows, args.repeats, packed=path == "packed")
        for kind, rows in (("prompt", args.prompt_rows), ("decode", args.decode_rows))
        for path in ("f_linear", "packed")
    }
    rates = {
        "prompt_products_flops_per_s": max(paths["prompt_f_linear_flops_per_s"], paths["prompt_packed_flops_per_s"]),
        "decode_products_flops_per_s": max(paths["decode_f_linear_flops_per_s"], paths["decode_packed_flops_per_s"]),
        "read_bytes_per_s": read_rate(args.repeats),
        **paths,
    }
    # The floor: every product at the best rate measured (decode rows may ride in a prompt step's 512-row
    # products, so even they need not run at the 64-row rate). The estimate: prompt tokens at the 512-row rate,
    # decode tokens at the 64-row rate, bench_serve's shapes when decodes run in steps of their own.
    best = max(rates["prompt_products_flops_per_s"], rates["decode_products_flops_per_s"])
    kv_s = counts["decode_kv_bytes"] / rates["read_bytes_per_s"]
    parts = {
        "products_s": (
            counts["prompt_product_flops"] + counts["prompt_attention_flops"] + counts["decode_product_flops"]
        )
        / best,
        "decode_kv_read_s": kv_s,
    }
    estimate_parts = {
        "prompt_products_s": counts["prompt_product_flops"] / rates["prompt_products_flops_per_s"],
        "prompt_attention_s": counts["prompt_attention_flops"] / rates["prompt_products_flops_per_s"],
        "decode_products_s": counts["decode_product_flops"] / rates["decode_products_flops_per_s"],
        "decode_kv_read_s": kv_s,
    }
    floor_s, estimate_s = sum(parts.values()), sum(estimate_parts.values())
    output_tokens = args.requests * args.max_tokens
    report = {
        "machine": machine(),
        "threads": args.threads,
        "config": {k: v for k, v in vars(args).items() if k != "compare"},
        "counts": counts,
        "rates": rates,
        "parts_seconds": parts,
        "floor_seconds": floor_s,
        "floor_output_tokens_per_s": output_tokens / floor_s,
        "estimate_parts_seconds": estimate_parts,
        "estimate_seconds": estimate_s,
        "compared": [compare(floor_s, estimate_s, RESULTS / name) for name in args.compare],
    }
    print(
        f"{args.dtype} products: {rates['prompt_products_flops_per_s'] / 1e9:.0f} GFLOP/s at {args.prompt_rows} rows, "
        f"{rates['decode_products_flops_per_s'] / 1e9:.0f} at {args.decode_rows}; read {rates['read_bytes_per_s'] / 1e9:.1f} GB/s"
    )
    for name, sec in parts.items():
        print(f"  {name:20s} {sec:7.2f} s")
    print(f"floor {floor_s:.2f} s = {output_tokens / floor_s:.0f} output tok/s at most")
    print(
        "estimate at bench_serve's shapes (decode rows at the 64-row rate): "
        + ", ".join(f"{name} {sec:.2f} s" for name, sec in estimate_parts.items())
        + f" = {estimate_s:.2f} s"
    )
    for c in report["compared"]:
        print(c["file"] + ":")
        named = dict(c["rows"])
        if "six_x_generate_batch" in c:
            named["6x generate_batch"] = c["six_x_generate_batch"]
        for kv, r in named.items():
            print(f"  {kv:18s} {r['seconds']:7.2f} s  {r['x_floor']:.2f}x floor, {r['x_estimate']:.2f}x estimate")
    print(f"wrote {write_json(args.output, report)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
