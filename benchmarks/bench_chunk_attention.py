"""A prefill chunk after cached tokens: its attention split in two unmasked calls of SDPA's fused CPU kernel
(vpaged/serve/stores/attention.py, prefix_then_causal) against the one masked call it replaced, side by side in
one run, alternated.

- kernel: one layer's attention of a chunk of N queries after START cached tokens (9 query heads over 3 K/V
  heads of 64, SmolLM2-135M's geometry; K/V as a store holds them, [START + N, 3, 64]), fp32 and bf16: median
  milliseconds of each arm (the masked arm includes its copy of the K/V per query head, as the engine made it),
  their ratio, and the largest difference between the arms' outputs.
- engine (with --engine, SmolLM2-135M-Instruct fp32, benchmarks/real_model.py): the time to the first token of
  (a) a PROMPT-token prompt prefilled in chunks of 512 (every chunk after the first attends over cached tokens)
  and (b) a DOC-token document served before, then the same document with TAIL new tokens (a prefix-cache hit:
  the new tokens' chunk after the document), with the split on and off (`attention.FLASH_CPU` set to None, the
  path a torch without the op takes).

    .venv/bin/python benchmarks/bench_chunk_attention.py [--threads 1] [--repeats 7] [--engine]

Writes benchmarks/results/OUTPUT (default chunk-attention.json).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_model  # noqa: E402
from common import machine, print_table, write_json  # noqa: E402

from vpaged.serve.stores import attention  # noqa: E402

HEADS, KV_HEADS, DIM = 9, 3, 64
CELLS = [(3036, 464), (1000, 2000), (3500, 512), (7000, 512), (4000, 64)]  # (START, N)


def masked(q, k, v, start, scale):
    """The call of before, as StepAttention.attend made it: K/V [start + n, KVH, D] copied once per query head,
    the chunk's mask."""
    heads = q.shape[1]
    k, v = attention.heads_first(k, heads), attention.heads_first(v, heads)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attention.chunk_mask(start, q.shape[2], None), scale=scale)


def median_ms(fn, repeats: int) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def kernel_cells(repeats: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    cells = []
    for dtype in (torch.float32, torch.bfloat16):
        for start, n in CELLS:
            q = torch.randn(1, HEADS, n, DIM, generator=gen).to(dtype)
            k = torch.randn(start + n, KV_HEADS, DIM, generator=gen).to(dtype)  # as a store holds them
            v = torch.randn(start + n, KV_HEADS, DIM, generator=gen).to(dtype)
            scale = 1 / math.sqrt(DIM)
            arms = {"split": attention.prefix_then_causal, "masked": masked}
            best = {name: math.inf for name in arms}
            for _ in range(2):  # alternated, twice: each arm's figure is the lower of its two medians
                for name, fn in arms.items():
                    best[name] = min(best[name], median_ms(lambda fn=fn: fn(q, k, v, start, scale), repeats))
            diff = (arms["split"](q, k, v, start, scale).float() - masked(q, k, v, start, scale).float()).abs().max()
            cells.append(dict(dtype=str(dtype).removeprefix("torch."), start=start, tokens=n, split_ms=best["split"],
                              masked_ms=best["masked"], ratio=best["split"] / best["masked"],
                              max_abs_diff=float(diff)))  # fmt: skip
    return cells


def engine_cells(args) -> list[dict]:
    from transformers import AutoTokenizer

    from vpaged.serve import LLM, SamplingParams

    model = str(real_model.model_dir())
    tok = AutoTokenizer.from_pretrained(model)
    prose = real_model.prose_ids(tok, 4096)
    prose = (prose * (max(args.prompt, args.doc + args.tail) // len(prose) + 2))[
        : max(args.prompt, args.doc + args.tail)
    ]
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    real_op = attention.FLASH_CPU
    cells = []
    for case in ("chunked prompt", "prefix hit"):
        times: dict[str, list[float]] = {"split": [], "masked": []}
        for rep in range(args.engine_repeats):
            for arm in ("split", "masked"):
                attention.FLASH_CPU = real_op if arm == "split" else None
                try:
                    llm = LLM(model, kv_budget_bytes=1 << 30, max_num_batched_tokens=512)
                    llm.generate([prose[-600:]], first)  # a warm-up: the first step's one-time costs
                    if case == "chunked prompt":
                        prompt = prose[rep : rep + args.prompt]  # a prompt of its own each time: nothing cached
                    else:
                        llm.generate([prose[: args.doc]], first)  # the document, cached
                        prompt = prose[: args.doc] + prose[args.doc + rep : args.doc + rep + args.tail]
                    t0 = time.perf_counter()
                    llm.generate([prompt], first)
                    times[arm].append(time.perf_counter() - t0)
                    llm.engine.close()
                finally:
                    attention.FLASH_CPU = real_op
        split, mask = statistics.median(times["split"]), statistics.median(times["masked"])
        cells.append(dict(case=case, split_s=split, masked_s=mask, ratio=split / mask, runs=times))
    return cells


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--repeats", type=int, default=7, help="calls per median (kernel)")
    ap.add_argument("--engine", action="store_true", help="also time SmolLM2's first token through the engine")
    ap.add_argument("--engine-repeats", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=4096, help="tokens of the chunked prompt (engine)")
    ap.add_argument("--doc", type=int, default=3036, help="tokens of the cached document (engine)")
    ap.add_argument("--tail", type=int, default=464, help="new tokens after the document (engine)")
    ap.add_argument("--output", default="chunk-attention.json", help="results file name under benchmarks/results/")
    args = ap.parse_args()
    if attention.FLASH_CPU is None:
        print("this torch has no fused CPU SDPA op to call: every chunk takes the masked call")
        return 1
    torch.set_num_threads(args.threads)
    result = dict(machine=machine(), threads=torch.get_num_threads(), args=vars(args))
    result["kernel"] = kernel_cells(args.repeats)
    print_table(
        ["dtype", "start", "tokens", "split ms", "masked ms", "ratio", "max diff"],
        [[c["dtype"], c["start"], c["tokens"], f"{c['split_ms']:.1f}", f"{c['masked_ms']:.1f}", f"{c['ratio']:.2f}",
          f"{c['max_abs_diff']:.1e}"] for c in result["kernel"]],
    )  # fmt: skip
    write_json(args.output, result)
    if args.engine:
        why = real_model.why_unavailable()
        if why:
            print(f"SmolLM2 is not available: {why}")
            return 1
        result["engine"] = engine_cells(args)
        print_table(
            ["case", "split s", "masked s", "ratio"],
            [[c["case"], f"{c['split_s']:.2f}", f"{c['masked_s']:.2f}", f"{c['ratio']:.2f}"] for c in result["engine"]],
        )
    path = write_json(args.output, result)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
