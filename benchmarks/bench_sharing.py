"""Costs and savings of sharing in a VirtualKVCache (host backend).

  python benchmarks/bench_sharing.py [--quick]

1. fork cost vs. sequence length: should grow with pages (one map per page per region), flat within a page.
2. copy-on-write cost per page (the first write of a child into a shared partly filled page).
3. swap out / swap in bandwidth vs. a plain torch copy of the same bytes.
   2 and 3 run twice: on a pool that gives a free page's memory back at once (the default), and on one that
   keeps the memory of recently freed pages (PagePool keep_freed_bytes), where the fresh page of a
   copy-on-write and the pages of a swap in are written in place instead of being allocated by the kernel.
4. memory saved: parallel sampling with n = 2..16 samples of a 2,000-token prompt generating 200 tokens, and
   32 requests sharing a 1,000-token system prompt, against the same workloads without sharing.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, median_time, print_table, write_json  # noqa: E402

import vpaged  # noqa: E402

GEOM = vpaged.KVGeometry(8, 8, 64, torch.bfloat16)  # 1 KiB/token/region


def make(max_seqs=64, max_len=8192, pages=4096, layout="per_layer", keep_freed_bytes=0, **kw):
    if keep_freed_bytes:
        pool = vpaged.PagePool("cpu", capacity_pages=pages, page_size=65536, keep_freed_bytes=keep_freed_bytes)
        config = vpaged.VirtualCacheConfig(max_seqs=max_seqs, max_seq_len=max_len, layout=layout, **kw)
        return vpaged.VirtualKVCache(GEOM, config, pool=pool)
    config = vpaged.VirtualCacheConfig(
        max_seqs=max_seqs, max_seq_len=max_len, capacity_bytes=pages * 65536, layout=layout, **kw
    )
    return vpaged.VirtualKVCache(GEOM, config)


def fork_cost(lengths, repeats):
    rows = []
    for layout in ("per_layer", "interleaved"):
        for n in lengths:
            cache = make(layout=layout)
            parent = cache.allocate()
            cache.extend(parent, n)
            pages = cache.stats().mapped_pages

            def once():
                child = cache.fork(parent)
                cache.free(child)  # shared pages are unmapped at once: the slot comes back clean

            t = median_time(once, repeats, inner=5)
            rows.append(
                {"layout": layout, "tokens": n, "pages": pages, "fork_free_us": t * 1e6, "us_per_page": t * 1e6 / pages}
            )
            cache.close()
    return rows


def cow_cost(repeats, keep_freed_bytes=0):
    cache = make(keep_freed_bytes=keep_freed_bytes)
    parent = cache.allocate()
    cache.extend(parent, 1000)  # partly filled last page in each of 16 regions
    regions = cache.layout.regions
    samples = []
    for _ in range(repeats):
        child = cache.fork(parent)
        t0 = time.perf_counter()
        cache.extend(child, 1)  # copies one page per region
        samples.append((time.perf_counter() - t0) / regions)
        cache.free(child)
    samples.sort()
    page = cache.layout.page_size
    plain = np.empty(page, dtype=np.uint8)
    src = np.random.randint(0, 255, page, dtype=np.uint8)
    t_copy = median_time(lambda: np.copyto(plain, src), repeats, inner=50)
    t_map = map_call_seconds(cache.pool, repeats)
    cache.close()
    return {
        "keep_freed_bytes": keep_freed_bytes,
        "cow_us_per_page": samples[len(samples) // 2] * 1e6,
        "plain_copy_us_per_page": t_copy * 1e6,
        "map_call_us": t_map * 1e6,
        "goal_us": (3 * t_copy + t_map) * 1e6,  # issue #40 item 4: <= 3x a memcpy of the page + one map call
    }


def map_call_seconds(pool, repeats) -> float:
    """One map call as a copy-on-write's remap makes it: a page shown at an index other than its own (one mmap),
    then that index's own page put back (one mmap), halved."""
    r = pool.new_range(2 * pool.page_size)
    (shared,) = r.map_new([0])

    def map_and_back():
        r.map_shared([1], [shared])
        r.unmap([1])

    t = median_time(map_and_back, repeats, inner=20) / 2
    r.unmap([0])
    return t


def swap_bandwidth(tokens, repeats, keep_freed_bytes=0):
    cache = make(pages=8192, swap_bytes=4096 * 65536, keep_freed_bytes=keep_freed_bytes)
    seq = cache.allocate()
    cache.extend(seq, tokens)
    for layer in range(cache.num_layers):
        k = torch.randn(tokens, 8, 64).to(torch.bfloat16)
        cache.write(layer, seq, k, k)
    out_t, in_t = [], []
    nbytes = 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        nbytes = cache.swap_out(seq)
        t1 = time.perf_counter()
        cache.swap_in(seq)
        t2 = time.perf_counter()
        out_t.append(t1 - t0)
        in_t.append(t2 - t1)
    out_t.sort()
    in_t.sort()
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    t_copy = median_time(lambda: dst.copy_(src), repeats)
    cache.close()
    gb = nbytes / 1e9
    return {
        "keep_freed_bytes": keep_freed_bytes,
        "bytes": nbytes,
        "swap_out_GBps": gb / out_t[len(out_t) // 2],
        "swap_in_GBps": gb / in_t[len(in_t) // 2],
        "plain_copy_GBps": gb / t_copy,
    }


def parallel_sampling(ns, prompt=2000, gen=200):
    rows = []
    for n in ns:
        used = {}
        for share in (True, False):
            cache = make(max_seqs=32, pages=16384)
            cache.pool.reset_high_water()
            if share:
                p = cache.allocate()
                cache.extend(p, prompt)
                seqs = cache.fork_many(p, n - 1) + [p]
            else:
                seqs = [cache.allocate() for _ in range(n)]
                cache.extend_many(seqs, prompt)
            for _ in range(gen):
                cache.extend_many(seqs, 1)
            used[share] = cache.pool.stats().high_water_bytes
            cache.close()
        rows.append(
            {
                "n": n,
                "shared_MiB": used[True] / 2**20,
                "unshared_MiB": used[False] / 2**20,
                "saved": 1 - used[True] / used[False],
            }
        )
    return rows


def system_prompt(requests=32, system=1024, user=200, gen=100):
    tokens = list(range(system))
    used = {}
    hits = 0
    for share in (True, False):
        cache = make(max_seqs=requests + 1, pages=16384)
        cache.pool.reset_high_water()
        seqs = []
        for r in range(requests):
            prompt = tokens + [10_000 + r * user + i for i in range(user)]
            seq = cache.allocate(tokens=prompt if share else None)
            cache.extend(seq, len(prompt) - cache.seq_len(seq))
            if share:
                cache.cache_prefix(seq, prompt)
            seqs.append(seq)
        for _ in range(gen):
            cache.extend_many(seqs, 1)
        used[share] = cache.pool.stats().high_water_bytes
        if share:
            hits = cache.stats().prefix_hit_tokens
        cache.close()
    return {
        "requests": requests,
        "system_tokens": system,
        "shared_MiB": used[True] / 2**20,
        "unshared_MiB": used[False] / 2**20,
        "saved": 1 - used[True] / used[False],
        "prefix_hit_tokens": hits,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    repeats = 5 if args.quick else 11
    res = {
        "machine": machine(),
        "geometry": {k: str(getattr(GEOM, k)) for k in ("num_layers", "num_kv_heads", "head_dim", "dtype")},
        "page_size": 65536,
    }
    res["fork"] = fork_cost([64, 1000, 2000, 4000, 8000] if not args.quick else [64, 1000, 4000], repeats)
    print("fork + free of a sequence (median)")
    print_table(
        ["layout", "tokens", "pages", "µs", "µs/page"],
        [
            [r["layout"], r["tokens"], r["pages"], f"{r['fork_free_us']:.0f}", f"{r['us_per_page']:.2f}"]
            for r in res["fork"]
        ],
    )
    # Kept: the 16 pages a fork's first write copies (CoW); the ~63 MiB a swap out frees (swap).
    for key, keep in (("cow", 0), ("cow_keep_freed", 16 * 65536)):
        res[key] = c = cow_cost(repeats * 2, keep)
        print(
            f"\ncopy-on-write ({'free pages keep ' + str(keep >> 10) + ' KiB' if keep else 'memory back at once'}): "
            f"{c['cow_us_per_page']:.1f} µs per 64 KiB page (plain memcpy of a page: {c['plain_copy_us_per_page']:.1f} "
            f"µs, one map call {c['map_call_us']:.1f} µs: 3 memcpy + a map = {c['goal_us']:.1f} µs)"
        )
    for key, keep in (("swap", 0), ("swap_keep_freed", 1024 * 65536)):
        res[key] = s = swap_bandwidth(4000, repeats, keep)
        print(
            f"\nswap {s['bytes'] / 2**20:.0f} MiB ({'free pages keep ' + str(keep >> 20) + ' MiB' if keep else 'memory back at once'}): "
            f"out {s['swap_out_GBps']:.2f} GB/s, in {s['swap_in_GBps']:.2f} GB/s, plain copy {s['plain_copy_GBps']:.2f} GB/s"
        )
    res["parallel_sampling"] = parallel_sampling([2, 4, 8, 16])
    print("\nparallel sampling, 2000-token prompt + 200 generated (peak pool bytes)")
    print_table(
        ["n", "shared MiB", "unshared MiB", "saved"],
        [
            [r["n"], f"{r['shared_MiB']:.0f}", f"{r['unshared_MiB']:.0f}", f"{r['saved']:.0%}"]
            for r in res["parallel_sampling"]
        ],
    )
    res["system_prompt"] = system_prompt()
    r = res["system_prompt"]
    print(
        f"\n{r['requests']} requests sharing a {r['system_tokens']}-token system prompt: {r['shared_MiB']:.0f} MiB "
        f"vs {r['unshared_MiB']:.0f} MiB unshared ({r['saved']:.0%} saved, {r['prefix_hit_tokens']} tokens reused)"
    )
    print(f"\nwrote {write_json('sharing_cpu.json', res)}")


def summary_rows(results: dict) -> list[dict]:
    """This script's comparisons as `vpaged bench` and docs/numbers.md show them, read from its JSON:
    copy-on-write and swap-out against plain copies, and the KV memory of shared pages against unshared ones.
    Builtins only: the suite compiles this function alone, without the imports above."""

    def row(comparison, vpaged, baseline, baseline_name, unit, better="lower"):
        return {
            "benchmark": "sharing",
            "comparison": comparison,
            "vpaged": vpaged,
            "baseline": baseline,
            "baseline_name": baseline_name,
            "unit": unit,
            "better": better,
        }

    rows = []
    cow = results.get("cow")
    if cow:
        rows.append(
            row(
                "copy-on-write of one page",
                cow["cow_us_per_page"],
                cow["plain_copy_us_per_page"],
                "memcpy of the page",
                "µs",
            )
        )
    swap = results.get("swap")
    if swap:
        rows.append(row("swap out", swap["swap_out_GBps"], swap["plain_copy_GBps"], "plain copy", "GB/s", "higher"))
    for p in results.get("parallel_sampling", []):
        rows.append(
            row(
                f"parallel sampling n={p['n']}: KV memory",
                p["shared_MiB"],
                p["unshared_MiB"],
                "without sharing",
                "MiB",
            )
        )
    sp = results.get("system_prompt")
    if sp:
        rows.append(
            row(
                f"{sp['requests']} requests, shared system prompt: KV memory",
                sp["shared_MiB"],
                sp["unshared_MiB"],
                "without prefix cache",
                "MiB",
            )
        )
    return rows


if __name__ == "__main__":
    main()
