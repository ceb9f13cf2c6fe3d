"""Serving benchmark: the continuous-batching engine on kv=vpaged / paged / static, and transformers' own
continuous batching (`model.generate_batch`, paged cache), on the same requests.

  python benchmarks/bench_serve.py            # full: the workload below (tens of minutes on 2 cores)
  python benchmarks/bench_serve.py --quick    # CI smoke: a tiny model and workload, seconds

Model: random-weight Llama "bench-llama" (hidden 1024, 8 layers, 16 heads, 8 KV heads, head_dim 64,
intermediate 2816, vocab 32000), fp32, 2 threads. Sections:

1. throughput: 64 requests, prompts of 64..512 random token ids, 128 greedy output tokens each (EOS
   ignored), all at t=0, KV budget 1 GiB. Rows kv=vpaged / paged / static and generate_batch (cache sized to
   the same budget). Output and total tokens/s, peak KV bytes, preemptions, peak running requests, and
   whether each row's tokens equal the vpaged row's.
2. poisson: the same kind of requests arriving as a Poisson process: TTFT and time per output token (TPOT)
   p50/p99.
3. shared-prefix: every prompt starts with the same system prompt: prefix-hit tokens, peak KV bytes,
   throughput, with prefix caching on and off.
4. static-slots: a KV budget that holds exactly 16 static slots of the maximum length (512 + 128 tokens)
   (--static-slots): concurrency (peak running requests) and makespan of kv=vpaged against kv=static, which
   reserves one such slot per request as static batching does.
5. step-breakdown: decode steps at batch 32 (after every prefill is done): the step's time inside the model's
   forward (attention included) and outside it (scheduling, bookkeeping, sampling).

vLLM's CPU engine as a row (--vllm-python PATH: an interpreter whose venv has vLLM's CPU build, see
vllm_peer.py): the model is saved with save_pretrained (safetensors + config) so vLLM loads the same weights,
and benchmarks/vllm_runner.py serves the same token-id prompts on vllm.LLMEngine in a process of its own
(same thread count, greedy, EOS ignored, same max tokens / max_num_seqs / batched tokens; its KV space is
VLLM_CPU_KVCACHE_SPACE, --vllm-kv-space-gib). It joins the throughput rows (run in the order given, the whole
list --repeats times: vpaged, vllm, vpaged, vllm, ...; medians per row) and the poisson rows, and its greedy
outputs are compared with vpaged's (identical completions, mean common-prefix tokens).

  python benchmarks/bench_serve.py --sections throughput --rows vpaged,vllm --repeats 2 \
      --vllm-python /work/venv-vllm/bin/python

JSON to benchmarks/results/serve_cpu.json (serve_cpu_quick.json with --quick).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

# MKL's own worker threads keep spinning after each matrix product and slow down the element-wise ops that
# follow (a bench-llama forward of 512 tokens on the 2-core dev box: 975 ms -> 681 ms with this setting;
# the products still use every thread torch is given). Set before torch loads MKL; all rows run under it.
os.environ.setdefault("MKL_NUM_THREADS", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import common_prefix, machine, print_table, write_json  # noqa: E402
from vllm_peer import PeerError, peer_env, prepare_model_dir, probe, run_runner  # noqa: E402

from vpaged.hf.fused import unfuse  # noqa: E402
from vpaged.hf.prepack import unprepack  # noqa: E402
from vpaged.serve import LLMEngine, SamplingParams, load_model  # noqa: E402
from vpaged.serve.bench import Workload, percentile, poisson_arrivals, random_prompts, run_workload  # noqa: E402
from vpaged.serve.models import model_geometry  # noqa: E402

MIB = 2**20

FULL = dict(
    model="random:bench-llama",
    dtype="float32",  # the model's weights and activations, every row's (bfloat16: what AMX / AVX512-BF16 boxes serve)
    requests=64,
    min_prompt=64,
    max_prompt=512,
    max_tokens=128,
    budget_mib=1024,
    max_num_seqs=64,
    max_batched=512,
    page_size=None,
    poisson_requests=32,
    poisson_rate=0.5,
    prefix_requests=32,
    prefix_len=384,
    prefix_min=32,
    prefix_max=128,
    prefix_tokens=64,
    breakdown_batch=32,
    breakdown_prompt=256,
    breakdown_tokens=24,
    vllm_block_size=None,  # the vllm row's KV block in tokens (None: vLLM's default, 128 on its CPU build)
    vllm_enforce_eager=0,  # 1: the vllm row runs eager (no torch.compile of its model)
    vllm_inproc=0,  # 1: the vllm row's engine core runs in the runner's process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
)
QUICK = dict(
    model="random:llama-tiny",
    dtype="float32",
    requests=12,
    min_prompt=8,
    max_prompt=48,
    max_tokens=12,
    budget_mib=64,
    max_num_seqs=16,
    max_batched=64,
    page_size=4096,
    poisson_requests=8,
    poisson_rate=20.0,
    prefix_requests=8,
    prefix_len=64,
    prefix_min=4,
    prefix_max=16,
    prefix_tokens=8,
    breakdown_batch=8,
    breakdown_prompt=32,
    breakdown_tokens=8,
    vllm_block_size=None,
    vllm_enforce_eager=0,
    vllm_inproc=0,
)


def kv_bytes_per_token(model) -> int:
    cfg = model.config.get_text_config(decoder=True)
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    itemsize = next(model.parameters()).element_size()
    return cfg.num_hidden_layers * 2 * kv_heads * head_dim * itemsize


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def engine_row(model, workload, kv: str, budget: int, cfg: dict, label: str | None = None, **kw) -> dict:
    # A row with cpu_prepack=False runs the plain layers and modules: the model is shared by the rows and an
    # earlier row's engine prepared it in place, so it is unprepared and unfused first (the next prepacked row prepares it again).
    # A tensor-parallel row gets the model as a saved directory (each rank loads its shard) and the budget of
    # one rank: budget / N, so that the ranks hold the same tokens as one process.
    # Its ranks share the machine's threads: each runs threads / N (the spawned ranks take rank 0's count).
    tp = kw.get("tensor_parallel_size", 1)
    threads = torch.get_num_threads()
    if tp > 1:
        budget //= tp
        torch.set_num_threads(max(1, threads // tp))
    elif kw.get("cpu_prepack") is False:
        unprepack(model)
        unfuse(model)
    # Every row declares the workload's longest sequence as max_model_len (as a deployment sizes it for its
    # traffic): kv=static reserves exactly that per request, the others only bound their sequences by it.
    kw.setdefault("max_model_len", max(map(len, workload.prompts)) + workload.max_tokens)
    engine = LLMEngine(
        model,
        None,
        kv_budget_bytes=budget,
        max_num_seqs=cfg["max_num_seqs"],
        max_num_batched_tokens=cfg["max_batched"],
        kv=kv,
        page_size=cfg["page_size"],
        **kw,
    )
    try:
        r = run_workload(engine, workload, greedy(workload.max_tokens), kv=label or kv, keep_outputs=True)
        prepacked, fused = engine.prepacked_layers, engine.fused_modules
        per_rank = [m.high_water_bytes for m in engine.stats().ranks]
    finally:
        with contextlib.suppress(Exception):
            engine.close()
        del engine
        gc.collect()
        torch.set_num_threads(threads)
    return dict(
        r.as_dict(with_outputs=True),
        prepacked_layers=prepacked,
        fused_modules=fused,
        kv_high_water_bytes_per_rank=per_rank,
    )


def generate_batch_row(model, workload, budget: int) -> dict:
    """transformers' continuous batching with its paged cache sized to the same KV budget (its pages hold 256
    tokens of every layer; the cache is allocated whole up front, so its peak KV bytes are its size), on the
    model's plain layers (an engine row before it prepared them: undone here)."""
    unprepack(model)
    unfuse(model)
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    page = 256
    block_bytes = kv_bytes_per_token(model) * page
    num_blocks = max(1, budget // block_bytes)
    gen = GenerationConfig(max_new_tokens=workload.max_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(num_blocks=num_blocks, max_batch_tokens=512, page_size=page)
    model.set_attn_implementation("sdpa")  # an engine switched it to "vpaged"; generate_batch picks its paged one
    t0 = time.perf_counter()
    with warnings_quiet():
        outs = model.generate_batch(
            [list(p) for p in workload.prompts], generation_config=gen, continuous_batching_config=cb
        )
    seconds = time.perf_counter() - t0
    ordered = list(outs.values())
    tokens = [list(o.generated_tokens) for o in ordered]
    out_tokens = sum(map(len, tokens))
    return {
        "kv": "generate_batch",
        "requests": len(tokens),
        "seconds": seconds,
        "prompt_tokens": workload.prompt_tokens,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / seconds,
        "total_tokens_per_s": (out_tokens + workload.prompt_tokens) / seconds,
        "peak_kv_bytes": num_blocks * block_bytes,
        "peak_running": None,
        "preemptions_swap": None,
        "preemptions_recompute": None,
        "prefix_hit_tokens": None,
        "outputs": tokens,
    }


class VllmPeer:
    """vLLM's CPU engine in another interpreter: the model directory it loads and how its runs are made."""

    def __init__(self, python: str, model_dir: Path, threads: int, kv_space_gib: float, facts: dict):
        self.python = python
        self.model_dir = Path(model_dir)
        self.threads = threads
        self.kv_space_gib = kv_space_gib
        self.facts = facts

    def job(self, workload, cfg: dict) -> dict:
        return {
            "model_dir": str(self.model_dir),
            "prompts": [list(p) for p in workload.prompts],
            "arrivals": list(workload.arrivals),
            "max_tokens": workload.max_tokens,
            "max_model_len": max(map(len, workload.prompts)) + workload.max_tokens,
            "max_num_seqs": cfg["max_num_seqs"],
            "max_num_batched_tokens": cfg["max_batched"],
            "dtype": cfg["dtype"],
            "seed": 0,
            "block_size": cfg["vllm_block_size"],
            "enforce_eager": bool(cfg["vllm_enforce_eager"]),
            "api": cfg.get("vllm_api", "engine"),
        }

    def row(self, workload, cfg: dict, timeout: float | None = None, label: str = "vllm") -> dict:
        # vLLM's v1 engine core runs in a process of its own by default; in-process, its scheduler, the model and
        # the caller's loop share the cores without a second process polling for messages.
        inproc = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if cfg.get("vllm_inproc") else None
        env = peer_env(self.threads, self.kv_space_gib, extra=inproc)
        r = run_runner(self.python, "serve", self.job(workload, cfg), env=env, timeout=timeout)
        row = vllm_result_row(r, workload, int(self.kv_space_gib * 2**30))
        row["kv"] = label
        row["vllm_block_size"] = cfg["vllm_block_size"]
        row["vllm_enforce_eager"] = bool(cfg["vllm_enforce_eager"])
        row["vllm_inproc"] = bool(cfg.get("vllm_inproc"))
        row["vllm_api"] = cfg.get("vllm_api", "engine")
        return row


def vllm_row_settings(name: str, cfg: dict) -> dict | None:
    """The settings of a vllm row named vllm[-bs<N>][-eager|-compiled][-inproc][-generate] (e.g. vllm-bs32-eager):
    cfg with that row's block size, mode, engine-core process and API (-generate: vllm.LLM.generate, one call,
    instead of stepping an LLMEngine); None when the name is no such row. Several of them in
    one --rows list sweep vLLM's settings side by side, alternated with the vpaged rows."""
    base, *parts = name.split("-")
    if base != "vllm":
        return None
    out = dict(cfg)
    for part in parts:
        if part[:2] == "bs" and part[2:].isdigit():
            out["vllm_block_size"] = int(part[2:])
        elif part in ("eager", "compiled"):
            out["vllm_enforce_eager"] = int(part == "eager")
        elif part == "inproc":
            out["vllm_inproc"] = 1
        elif part == "generate":  # through vllm.LLM.generate, as its offline users run it
            out["vllm_api"] = "generate"
        else:
            return None
    return out


def vllm_result_row(r: dict, workload, kv_reserved_bytes: int) -> dict:
    """A bench_serve row (the keys engine_row's rows have) from vllm_runner.py's serve result."""
    seconds = float(r["seconds"])
    out_tokens = int(r["output_tokens"])
    ttft, tpot = r.get("ttft") or [], r.get("tpot") or []
    return {
        "kv": "vllm",
        "requests": int(r["requests"]),
        "seconds": seconds,
        "prompt_tokens": workload.prompt_tokens,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / seconds,
        "total_tokens_per_s": (out_tokens + workload.prompt_tokens) / seconds,
        "peak_kv_bytes": None,  # vLLM allocates its whole KV space up front
        "kv_reserved_bytes": kv_reserved_bytes,
        "peak_running": None,
        "preemptions_swap": None,
        "preemptions_recompute": None,
        "prefix_hit_tokens": None,
        "steps": r.get("steps"),
        "ttft_p50": percentile(ttft, 50),
        "ttft_p99": percentile(ttft, 99),
        "tpot_p50": percentile(tpot, 50),
        "tpot_p99": percentile(tpot, 99),
        "finish_reasons": r.get("finish_reasons", {}),
        "vllm_version": r.get("vllm_version"),
        "load_seconds": r.get("load_seconds"),
        "outputs": r["outputs"],
    }


@contextlib.contextmanager
def warnings_quiet():
    import logging
    import warnings

    loggers = [logging.getLogger(n) for n in ("ContinuousBatchingLogger", "transformers")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            yield
        finally:
            for lg, lv in zip(loggers, levels):
                lg.setLevel(lv)


def same_tokens(rows: list[dict], ref: dict) -> None:
    """Mark each row with how many requests produced exactly the reference row's tokens (and, for rows of
    another engine, the mean number of leading tokens they share with it)."""
    expected = ref["outputs"]
    for row in rows:
        outs = row.get("outputs")
        if outs is not None and row is not ref:
            row["same_tokens_as_vpaged"] = sum(a == b for a, b in zip(outs, expected))
            if row["kv"].startswith("vllm"):
                row["common_prefix_tokens_mean"] = statistics.mean(common_prefix(a, b) for a, b in zip(outs, expected))
    for row in rows:
        row.pop("outputs", None)


def fmt_row(r: dict) -> list:
    def f(x, spec):
        return "-" if x is None else format(x, spec)

    return [
        r["kv"],
        f(r["seconds"], ".1f"),
        f(r["output_tokens_per_s"], ".1f"),
        f(r["total_tokens_per_s"], ".1f"),
        f(r["peak_kv_bytes"] / MIB if r["peak_kv_bytes"] is not None else None, ".1f"),
        f(r.get("peak_running"), "d"),
        "-" if r.get("preemptions_swap") is None else f"{r['preemptions_swap']}/{r['preemptions_recompute']}",
        r.get("same_tokens_as_vpaged", "ref"),
    ]


HEAD = [
    "row",
    "seconds",
    "out tok/s",
    "total tok/s",
    "peak KV MiB",
    "peak running",
    "preempt swap/recomp",
    "same tokens",
]


# ------------------------------------------------------------------------------------------------ sections


def section_throughput(model, cfg, vocab, rows_wanted, log, save, repeats: int = 1, peer=None) -> dict:
    prompts = random_prompts(cfg["requests"], cfg["min_prompt"], cfg["max_prompt"], vocab, seed=0)
    wl = Workload(prompts, [0.0] * len(prompts), cfg["max_tokens"], "throughput")
    budget = cfg["budget_mib"] * MIB
    rows = []
    saved = None  # the model saved for tensor-parallel rows (<kv>-tp<N>), made at the first one
    for rep in range(repeats):
        for kv in rows_wanted:  # in the order given: lets a run check that the order does not matter
            base, _, variant = kv.partition("-")
            tp = int(variant[2:]) if variant[:2] == "tp" and variant[2:].isdigit() else 1
            vllm_cfg = vllm_row_settings(kv, cfg)
            if vllm_cfg is None and (
                base not in ("vpaged", "paged", "generate_batch", "static")
                or (variant not in ("", "noprepack") and tp == 1)
            ):
                continue
            if vllm_cfg is not None and peer is None:
                continue
            log(f"throughput: {kv}" + (f" (round {rep + 1}/{repeats})" if repeats > 1 else ""))
            if kv == "generate_batch":
                row = generate_batch_row(model, wl, budget)
            elif vllm_cfg is not None:
                row = peer.row(wl, vllm_cfg, label=kv)
            elif tp > 1:  # <kv>-tp<N>: N ranks spawned on this host (gloo), each on its shard's plain layers
                if saved is None:
                    saved = tempfile.mkdtemp(prefix="bench-serve-tp-")
                    model.save_pretrained(saved)
                row = engine_row(saved, wl, base, budget, cfg, label=kv, cpu_prepack=False, tensor_parallel_size=tp)
            elif variant:  # <kv>-noprepack: the engine on the model's plain linear layers (cpu_prepack=False)
                row = engine_row(model, wl, base, budget, cfg, label=kv, cpu_prepack=False)
            else:
                row = engine_row(model, wl, kv, budget, cfg)
            row["round"] = rep
            rows.append(row)
            log(f"  {fmt_row(rows[-1])}")
            save({"partial_rows": [{k: v for k, v in r.items() if k != "outputs"} for r in rows]})
    if saved is not None:
        shutil.rmtree(saved, ignore_errors=True)
    ref = next((r for r in rows if r["kv"] == "vpaged"), None) or next(
        (r for r in rows if r["kv"].startswith("vpaged")), None
    )
    if ref is not None:
        same_tokens(rows, ref)
    for r in rows:
        r.pop("outputs", None)
    print_table(HEAD, [fmt_row(r) for r in rows])
    # Repeated rows (--repeats, alternated): each ratio is of the medians of the rows' tokens/s.
    medians = {}
    for kv in dict.fromkeys(r["kv"] for r in rows):
        tps = [r["output_tokens_per_s"] for r in rows if r["kv"] == kv]
        medians[kv] = {"runs": len(tps), "output_tokens_per_s": statistics.median(tps), "all": tps}
    by = {kv: {"output_tokens_per_s": m["output_tokens_per_s"]} for kv, m in medians.items()}
    ratios = {}
    vllm_rows = [kv for kv in by if vllm_row_settings(kv, cfg) is not None]
    for other in ("generate_batch", "paged", "static", *vllm_rows):
        if "vpaged" in by and other in by:
            ratios[f"vpaged_over_{other}"] = by["vpaged"]["output_tokens_per_s"] / by[other]["output_tokens_per_s"]
    if "vpaged" in by and vllm_rows:  # the peer at the best of the settings run: the lead must hold there
        best = max(vllm_rows, key=lambda kv: by[kv]["output_tokens_per_s"])
        ratios["vpaged_over_best_vllm"] = by["vpaged"]["output_tokens_per_s"] / by[best]["output_tokens_per_s"]
        ratios["best_vllm_row"] = best
    for kv in ("vpaged", "paged", "static"):
        if kv in by and f"{kv}-noprepack" in by:
            ratios[f"{kv}_prepack_over_noprepack"] = (
                by[kv]["output_tokens_per_s"] / by[f"{kv}-noprepack"]["output_tokens_per_s"]
            )
    if repeats > 1:
        print("median output tok/s:", {k: round(m["output_tokens_per_s"], 1) for k, m in medians.items()})
    print("ratios:", {k: round(v, 2) if isinstance(v, float) else v for k, v in ratios.items()})
    for label in dict.fromkeys(r["kv"] for r in rows if r["kv"].startswith("vllm")):
        vr = next(r for r in rows if r["kv"] == label)
        print(
            f"{label} greedy outputs: {vr.get('same_tokens_as_vpaged')} of {len(prompts)} completions identical to "
            f"vpaged's, {vr.get('common_prefix_tokens_mean', 0):.1f} of {cfg['max_tokens']} leading tokens shared "
            "on average"
        )
    out = {
        "budget_bytes": budget,
        "requests": len(prompts),
        "prompt_tokens": wl.prompt_tokens,
        "repeats": repeats,
        "rows": rows,
        "medians": medians,
        "ratios": ratios,
    }
    if peer is not None:
        out["vllm"] = dict(peer.facts, kv_space_gib=peer.kv_space_gib, threads=peer.threads)
    return out


def section_poisson(model, cfg, vocab, kvs, log, peer=None) -> dict:
    prompts = random_prompts(cfg["poisson_requests"], cfg["min_prompt"], cfg["max_prompt"], vocab, seed=1)
    wl = Workload(prompts, poisson_arrivals(len(prompts), cfg["poisson_rate"], seed=1), cfg["max_tokens"], "poisson")
    rows = []
    if peer is not None:  # vpaged, vllm, then the other kinds
        kvs = list(kvs[:1]) + ["vllm"] + list(kvs[1:])
    for kv in kvs:
        log(f"poisson: kv={kv}")
        r = peer.row(wl, cfg) if kv == "vllm" else engine_row(model, wl, kv, cfg["budget_mib"] * MIB, cfg)
        rows.append(r)
    ref = next((r for r in rows if r["kv"] == "vpaged"), None)
    if ref is not None:
        same_tokens(rows, ref)
    for r in rows:
        r.pop("outputs", None)
    print_table(
        ["row", "seconds", "out tok/s", "TTFT p50 s", "TTFT p99 s", "TPOT p50 ms", "TPOT p99 ms"],
        [
            [
                r["kv"],
                f"{r['seconds']:.1f}",
                f"{r['output_tokens_per_s']:.1f}",
                f"{r['ttft_p50']:.2f}",
                f"{r['ttft_p99']:.2f}",
                f"{r['tpot_p50'] * 1e3:.0f}",
                f"{r['tpot_p99'] * 1e3:.0f}",
            ]
            for r in rows
        ],
    )
    return {"rate_per_s": cfg["poisson_rate"], "requests": len(prompts), "rows": rows}


def section_shared_prefix(model, cfg, vocab, kvs, log) -> dict:
    prompts = random_prompts(
        cfg["prefix_requests"], cfg["prefix_min"], cfg["prefix_max"], vocab, seed=2, shared_prefix=cfg["prefix_len"]
    )
    wl = Workload(prompts, [0.0] * len(prompts), cfg["prefix_tokens"], "shared-prefix")
    rows = []
    for kv, caching in kvs:
        log(f"shared-prefix: kv={kv} prefix caching {'on' if caching else 'off'}")
        r = engine_row(model, wl, kv, cfg["budget_mib"] * MIB, cfg, enable_prefix_caching=caching)
        r["kv"] = f"{kv}{'' if caching else ' (no prefix caching)'}"
        rows.append(r)
    same_tokens(rows, rows[0])
    print_table(HEAD + ["prefix-hit tokens"], [fmt_row(r) + [r["prefix_hit_tokens"]] for r in rows])
    return {"prefix_len": cfg["prefix_len"], "requests": len(prompts), "rows": rows}


def section_static_slots(model, cfg, vocab, log) -> dict:
    slot_tokens = cfg["max_prompt"] + cfg["max_tokens"]  # the longest request the workload may send
    budget = cfg["static_slots"] * slot_tokens * kv_bytes_per_token(model)
    prompts = random_prompts(cfg["requests"], cfg["min_prompt"], cfg["max_prompt"], vocab, seed=0)
    wl = Workload(prompts, [0.0] * len(prompts), cfg["max_tokens"], "static-slots")
    rows = []
    for kv in ("vpaged", "static"):
        log(f"static-slots: kv={kv}")
        rows.append(engine_row(model, wl, kv, budget, cfg, swap_bytes=budget // 2, max_model_len=slot_tokens))
    same_tokens(rows, rows[0])
    print_table(HEAD, [fmt_row(r) for r in rows])
    by = {r["kv"]: r for r in rows}
    out = {
        "budget_bytes": budget,
        "static_slots": cfg["static_slots"],
        "rows": rows,
        "concurrency_ratio": by["vpaged"]["peak_running"] / max(1, by["static"]["peak_running"]),
        "makespan_ratio_static_over_vpaged": by["static"]["seconds"] / by["vpaged"]["seconds"],
    }
    print(
        f"budget {budget / MIB:.0f} MiB: peak running vpaged/static = {out['concurrency_ratio']:.2f}x, "
        f"makespan static/vpaged = {out['makespan_ratio_static_over_vpaged']:.2f}x"
    )
    return out


class ForwardTimer:
    """Times the model's forward passes (outermost call only) by wrapping the forward of the model, its decoder
    and its LM head on the instance: whichever the engine calls, each step's model time is counted once."""

    def __init__(self, model):
        self.model = model
        self.depth = 0
        self.t0 = 0.0
        self.seconds = 0.0
        self.patched = []
        mods = [model]
        for name in ("model", "lm_head"):
            m = getattr(model, name, None)
            if isinstance(m, torch.nn.Module):
                mods.append(m)
        for m in mods:
            self._wrap(m)

    def _wrap(self, module):
        original = module.forward

        def forward(*a, **k):
            if self.depth == 0:
                self.t0 = time.perf_counter()
            self.depth += 1
            try:
                return original(*a, **k)
            finally:
                self.depth -= 1
                if self.depth == 0:
                    self.seconds += time.perf_counter() - self.t0

        module.forward = forward
        self.patched.append(module)

    def close(self):
        for m in self.patched:
            del m.forward  # back to the class's forward


def section_breakdown(model, cfg, vocab, log) -> dict:
    """Decode steps at batch `breakdown_batch`: every request's prompt is prefilled first (steps that carry a
    prefill chunk are not counted), then each step decodes one token for each of the requests."""
    log(f"step-breakdown: batch {cfg['breakdown_batch']}")
    b = cfg["breakdown_batch"]
    prompts = random_prompts(b, cfg["breakdown_prompt"], cfg["breakdown_prompt"], vocab, seed=3)
    engine = LLMEngine(
        model,
        None,
        kv_budget_bytes=cfg["budget_mib"] * MIB,
        max_num_seqs=max(b, cfg["max_num_seqs"]),
        max_num_batched_tokens=max(cfg["max_batched"], b),
        kv="vpaged",
        page_size=cfg["page_size"],
        record_steps=True,
    )
    timer = ForwardTimer(model)
    steps, forwards = [], []
    try:
        params = greedy(cfg["breakdown_tokens"])
        for p in prompts:
            engine.add_request(p, params)
        produced = {}
        while engine.has_unfinished():
            timer.seconds = 0.0
            t0 = time.perf_counter()
            outs = engine.step()
            dt = time.perf_counter() - t0
            all_decoding = (
                len(produced) == b
                and all(len(o.outputs[0].new_token_ids) == 1 for o in outs)
                and len(outs) == b
                and not any(o.finished for o in outs)
            )
            for o in outs:
                produced[o.request_id] = len(o.outputs[0].token_ids)
            if all_decoding:
                steps.append(dt)
                forwards.append(timer.seconds)
        # the engine's own split of the same steps: forward vs schedule + prepare + sample + output
        log_steps = [e.as_dict() for e in engine.step_log if e.decodes == b and e.prefill_tokens == 0]
    finally:
        timer.close()
        with contextlib.suppress(Exception):
            engine.close()
    if not steps:
        return {"batch": b, "error": "no pure decode step at this batch"}
    step = statistics.median(steps)
    fwd = statistics.median(forwards)
    outside = [s - f for s, f in zip(steps, forwards)]
    res = {
        "batch": b,
        "decode_steps": len(steps),
        "step_ms_p50": step * 1e3,
        "forward_ms_p50": fwd * 1e3,
        "outside_ms_p50": statistics.median(outside) * 1e3,
        "outside_fraction_p50": statistics.median(o / s for o, s in zip(outside, steps)),
        "step_ms_p90": percentile(steps, 90) * 1e3,
    }
    if log_steps:
        parts = ("schedule", "prepare", "forward", "sample", "output")
        res["engine_split_ms_p50"] = {k: statistics.median(e[k] for e in log_steps) * 1e3 for k in parts}
    print(
        f"decode step at batch {b}: {res['step_ms_p50']:.1f} ms, forward {res['forward_ms_p50']:.1f} ms, "
        f"outside {res['outside_ms_p50']:.2f} ms ({res['outside_fraction_p50']:.1%})"
    )
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model and workload (CI smoke, seconds)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sections", default="throughput,poisson,shared-prefix,static-slots,step-breakdown")
    ap.add_argument(
        "--rows",
        default=None,
        help="rows of the throughput section, run in this order (default vpaged,paged,static,generate_batch, "
        "and vllm with --vllm-python); <kv>-noprepack: the engine with cpu_prepack=False; <kv>-tp<N>: the engine "
        "tensor-parallel over N spawned ranks (gloo, cpu_prepack=False, each rank budget / N); vllm-bs<N>, "
        "vllm-eager, vllm-compiled, vllm-inproc, vllm-bs<N>-eager-inproc, ...: vLLM with that KV block size, mode "
        "and its engine core in the runner's process (vllm: the vllm_block_size / vllm_enforce_eager / "
        "vllm_inproc settings); ratios include vpaged over the best vllm row",
    )
    ap.add_argument("--repeats", type=int, default=1, help="run the throughput rows this many rounds, alternated")
    ap.add_argument(
        "--vllm-python",
        default=None,
        metavar="PATH",
        help="an interpreter with vLLM's CPU build: adds vLLM's engine as a row (throughput and poisson)",
    )
    ap.add_argument("--vllm-kv-space-gib", type=float, default=4, help="VLLM_CPU_KVCACHE_SPACE of the vllm row")
    ap.add_argument(
        "--vllm-model-dir",
        default=None,
        help="where to save the model for vLLM (default: a temporary folder, removed at the end)",
    )
    ap.add_argument("--requests", type=int, default=None, help="override: requests of sections 1 and 4")
    ap.add_argument("--max-tokens", type=int, default=None, help="override: output tokens of sections 1, 2, 4")
    ap.add_argument("--min-prompt", type=int, default=None, help="override: shortest prompt of sections 1, 2, 4")
    ap.add_argument("--max-prompt", type=int, default=None, help="override: longest prompt of sections 1, 2, 4")
    ap.add_argument(
        "--static-slots", type=int, default=16, help="section 4: the budget holds this many maximum-length requests"
    )
    ap.add_argument("--poisson-requests", type=int, default=None)
    ap.add_argument("--poisson-rate", type=float, default=None)
    ap.add_argument("--prefix-requests", type=int, default=None)
    ap.add_argument("--breakdown-tokens", type=int, default=None)
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any workload setting (see FULL), e.g. --set breakdown_prompt=64",
    )
    ap.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="the model's dtype for every row, vLLM's too (default float32; --set dtype=... does the same)",
    )
    ap.add_argument("--output", default=None, help="JSON file name under benchmarks/results/")
    args = ap.parse_args(argv)
    cfg = dict(QUICK if args.quick else FULL)
    for key in (
        "requests",
        "max_tokens",
        "min_prompt",
        "max_prompt",
        "poisson_requests",
        "poisson_rate",
        "prefix_requests",
        "breakdown_tokens",
    ):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    cfg["static_slots"] = args.static_slots
    if args.dtype is not None:
        cfg["dtype"] = args.dtype
    for item in args.set:
        key, _, value = item.partition("=")
        if key not in cfg:
            ap.error(f"--set: unknown setting {key!r}; settings: {sorted(cfg)}")
        cfg[key] = type(cfg[key])(value) if cfg[key] is not None else int(value)
    torch.set_num_threads(args.threads)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    rows_arg = args.rows or ("vpaged,paged,static,generate_batch" + (",vllm" if args.vllm_python else ""))
    rows_wanted = list(dict.fromkeys(s.strip() for s in rows_arg.split(",")))
    if any(vllm_row_settings(r, cfg) is not None for r in rows_wanted) and not args.vllm_python:
        ap.error("a vllm row needs --vllm-python PATH (an interpreter with vLLM's CPU build)")
    t_start = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - t_start:7.1f} s] {msg}", file=sys.stderr, flush=True)

    if cfg["dtype"] not in ("float32", "bfloat16"):
        ap.error(f"dtype must be float32 or bfloat16, got {cfg['dtype']!r}")
    model, _ = load_model(cfg["model"], dtype=getattr(torch, cfg["dtype"]))
    vocab = model.config.get_text_config(decoder=True).vocab_size
    with open("/proc/loadavg") as f:
        load_before = f.read().split()[:3]
    report = {
        "machine": machine(),
        "threads": torch.get_num_threads(),
        "mkl_num_threads": os.environ.get("MKL_NUM_THREADS"),
        "quick": args.quick,
        "config": cfg,
        "load_average_before": load_before,
        "kv_bytes_per_token": kv_bytes_per_token(model),
    }
    name = args.output or ("serve_cpu_quick.json" if args.quick else "serve_cpu.json")
    peer, model_tmp = None, None
    if args.vllm_python:
        facts, why = probe(args.vllm_python)
        head_dim = model_geometry(model.config)[2]
        sizes = (facts or {}).get("head_sizes")
        if facts is not None and sizes and head_dim not in sizes:
            facts, why = (
                None,
                (
                    f"vLLM's CPU attention takes head_dim {sizes}; {cfg['model']} has {head_dim}: "
                    "use --set model=random:bench-llama"
                ),
            )
        if facts is None:
            print(f"vllm row skipped: {why}", file=sys.stderr)
            report["vllm"] = {"python": args.vllm_python, "skipped": why}
        else:
            if args.vllm_model_dir:
                model_dir = Path(args.vllm_model_dir)
            else:
                model_dir = model_tmp = Path(tempfile.mkdtemp(prefix="vpaged-bench-model-"))
            log(f"vllm {facts.get('vllm_version')} at {args.vllm_python}: saving the model to {model_dir}")
            prepare_model_dir(model, model_dir)
            peer = VllmPeer(args.vllm_python, model_dir, torch.get_num_threads(), args.vllm_kv_space_gib, facts)
            report["vllm"] = dict(facts, python=args.vllm_python, kv_space_gib=args.vllm_kv_space_gib)

    def saver(section):
        def save(partial):
            report[section] = partial
            write_json(name, report)

        return save

    runs = {
        "throughput": lambda: section_throughput(
            model, cfg, vocab, rows_wanted, log, saver("throughput"), repeats=args.repeats, peer=peer
        ),
        "poisson": lambda: section_poisson(model, cfg, vocab, ["vpaged", "paged"], log, peer=peer),
        "shared-prefix": lambda: section_shared_prefix(model, cfg, vocab, [("vpaged", True), ("vpaged", False)], log),
        "static-slots": lambda: section_static_slots(model, cfg, vocab, log),
        "step-breakdown": lambda: section_breakdown(model, cfg, vocab, log),
    }
    try:
        for section in sections:
            try:
                report[section.replace("-", "_")] = runs[section]()
            except PeerError as e:  # the vllm row failed: say why, keep the other sections
                print(f"{section}: the vllm row failed: {e}", file=sys.stderr)
                report[section.replace("-", "_")] = {"error": f"vllm row: {e}"}
            with open("/proc/loadavg") as f:
                report["load_average_after"] = f.read().split()[:3]
            report["seconds"] = time.perf_counter() - t_start
            path = write_json(name, report)  # after every section: a long run keeps what it finished
    finally:
        if model_tmp is not None:
            shutil.rmtree(model_tmp, ignore_errors=True)
    print(f"wrote {path}")
    return 0


def summary_rows(results: dict) -> list[dict]:
    """This script's comparisons as `vpaged bench` and docs/numbers.md show them, read from the throughput
    section of its JSON: output tokens/s of each engine KV backend against transformers' generate_batch on the
    same requests, and kv=vpaged against vLLM's CPU engine when the run had that row (--vllm-python). With
    --repeats, each row's median. Builtins only: the suite compiles this function alone, without the imports
    above."""

    def row(comparison, vpaged, baseline, baseline_name):
        return {
            "benchmark": "serving",
            "comparison": comparison,
            "vpaged": vpaged,
            "baseline": baseline,
            "baseline_name": baseline_name,
            "unit": "tok/s",
            "better": "higher",
        }

    tp = results.get("throughput") or {}
    medians = tp.get("medians") or {}
    if medians:
        tps = {str(k): float(m["output_tokens_per_s"]) for k, m in medians.items() if m.get("output_tokens_per_s")}
    else:
        tps = {
            str(r.get("kv")): float(r["output_tokens_per_s"])
            for r in tp.get("rows") or []
            if r.get("output_tokens_per_s")
        }
    rows = []
    base = tps.get("generate_batch")
    if base:
        rows += [
            row(f"output tokens/s, engine kv={name}", value, base, "generate_batch")
            for name, value in tps.items()
            if name not in ("generate_batch", "vllm")
        ]
    if tps.get("vllm") and tps.get("vpaged"):
        rows.append(row("output tokens/s, engine kv=vpaged", tps["vpaged"], tps["vllm"], "vLLM CPU"))
    # Named vLLM rows (vllm-bs32-eager-generate, ...): each against vpaged, with the dtype and how vLLM was driven.
    dtype = str((results.get("config") or {}).get("dtype") or "float32")
    for name, value in tps.items():
        if not name.startswith("vllm-") or not tps.get("vpaged"):
            continue
        how = "LLM.generate" if name.endswith("-generate") else "LLMEngine stepped"
        rows.append(row(f"output tokens/s, engine kv=vpaged, {dtype}", tps["vpaged"], value, f"vLLM CPU {name}, {how}"))
    return rows


if __name__ == "__main__":
    sys.exit(main())
