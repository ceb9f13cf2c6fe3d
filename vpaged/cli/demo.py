"""A mixed serving workload on a VirtualKVCache: sequences arrive with random prompt and output lengths,
decode one token per step, and leave. Measures what the cache maps against what reserving max_seq_len
per sequence (static allocation) would need for the same sequences."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import torch

from ..errors import OutOfPagesError, SlotsExhaustedError
from ..kvcache import KVGeometry, VirtualCacheConfig, VirtualKVCache


@dataclass
class DemoConfig:
    num_layers: int = 8
    num_kv_heads: int = 8
    head_dim: int = 64
    dtype: torch.dtype = torch.bfloat16
    max_seqs: int = 64
    max_seq_len: int = 4096
    budget_bytes: int = 1 << 30
    layout: str = "per_layer"
    steps: int = 1500
    arrival_rate: float = 0.1  # expected new requests per decode step
    prompt_len: tuple[int, int] = (32, 1024)
    output_len: tuple[int, int] = (16, 768)
    seed: int = 0
    write_kv: bool = True  # write the new K/V of layer 0 so pages are really touched


@dataclass
class DemoResult:
    config: DemoConfig
    steps: int
    finished: int
    deferred: int  # arrivals that waited for slots or pages
    peak_sequences: int
    peak_live_tokens: int
    peak_live_bytes: int
    peak_mapped_bytes: int
    utilization_at_peak: float
    mean_utilization: float
    static_bytes_for_peak: int  # max_seq_len reserved for each of the peak concurrent sequences
    pages_mapped: int
    pages_unmapped: int
    map_calls: int
    seconds: float
    page_size: int = 0


def run_demo(cfg: DemoConfig | None = None) -> DemoResult:
    cfg = cfg or DemoConfig()
    rnd = random.Random(cfg.seed)
    cache = VirtualKVCache(
        KVGeometry(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.dtype),
        VirtualCacheConfig(
            max_seqs=cfg.max_seqs, max_seq_len=cfg.max_seq_len, capacity_bytes=cfg.budget_bytes, layout=cfg.layout
        ),
    )
    shape = (cfg.num_kv_heads, cfg.head_dim)
    waiting: list[tuple[int, int]] = []
    running: dict[int, int] = {}  # seq -> tokens still to generate
    finished = deferred = 0
    peak = dict(seqs=0, tokens=0, live=0, mapped=0, util=1.0)
    util_sum = 0.0
    t0 = time.perf_counter()
    with cache:
        for _step in range(cfg.steps):
            if rnd.random() < cfg.arrival_rate:
                waiting.append((rnd.randint(*cfg.prompt_len), rnd.randint(*cfg.output_len)))
            # Admit in arrival order while slots and pages allow (prefill = extend by the prompt).
            while waiting:
                prompt, out = waiting[0]
                try:
                    seq = cache.allocate()
                except SlotsExhaustedError:
                    deferred += 1
                    break
                try:
                    cache.extend(seq, prompt)
                except OutOfPagesError:
                    cache.free(seq)
                    deferred += 1
                    break
                if cfg.write_kv:
                    cache.write(
                        0, seq, torch.ones(prompt, *shape, dtype=cfg.dtype), torch.ones(prompt, *shape, dtype=cfg.dtype)
                    )
                waiting.pop(0)
                running[seq] = out
            # Decode: one token for every running sequence, as one all-or-nothing step.
            seqs = list(running)
            if seqs:
                try:
                    cache.extend_many(seqs, 1)
                except OutOfPagesError:
                    # Preempt the newest sequence (its tokens would be recomputed later) and retry next step.
                    victim = seqs[-1]
                    cache.free(victim)
                    del running[victim]
                    deferred += 1
                    continue
                if cfg.write_kv:
                    one = torch.ones(1, *shape, dtype=cfg.dtype)
                    for s in seqs:
                        cache.write(0, s, one, one)
                for s in seqs:
                    running[s] -= 1
                    if running[s] == 0 or cache.seq_len(s) == cfg.max_seq_len:
                        cache.free(s)
                        del running[s]
                        finished += 1
            st = cache.stats()
            live_mapped = st.mapped_bytes - st.dormant_pages * st.page_size
            util = st.live_bytes / live_mapped if live_mapped else 1.0
            util_sum += util
            if st.live_tokens > peak["tokens"]:
                peak.update(tokens=st.live_tokens, live=st.live_bytes, util=util)
            peak["seqs"] = max(peak["seqs"], st.sequences)
            peak["mapped"] = max(peak["mapped"], st.mapped_bytes)
        st = cache.stats()
    return DemoResult(
        config=cfg,
        steps=cfg.steps,
        finished=finished,
        deferred=deferred,
        peak_sequences=peak["seqs"],
        peak_live_tokens=peak["tokens"],
        peak_live_bytes=peak["live"],
        peak_mapped_bytes=peak["mapped"],
        utilization_at_peak=peak["util"],
        mean_utilization=util_sum / cfg.steps,
        static_bytes_for_peak=peak["seqs"] * cfg.max_seq_len * cache.bytes_per_token,
        pages_mapped=st.pages_mapped_total,
        pages_unmapped=st.pages_unmapped_total,
        map_calls=st.map_calls,
        seconds=time.perf_counter() - t0,
        page_size=cache.layout.page_size,
    )
