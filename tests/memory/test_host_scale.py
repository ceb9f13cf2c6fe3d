"""The host backend at production scale: Llama-2-7B geometry (32 layers, 32 KV heads of 128, bf16), a 16 GiB
budget, 64 sequences growing together. The budget must bind (OutOfPagesError), never vm.max_map_count.

K/V are never written, so no RAM is needed: pages are counted by the pool and backed only when written.
The random-operation test runs 10,000 operations in all, 2,500 per layout (about a minute on a busy 2-core
machine); VPAGED_SCALE_OPS=N runs N per layout (a longer soak: VPAGED_SCALE_OPS=100000).
"""

import os
import random
import time
import warnings

import pytest
import torch

import vpaged
from vpaged import KVGeometry, VirtualCacheConfig
from vpaged.errors import MappingLimitWarning
from vpaged.memory.limits import mapping_count, mapping_limit

GIB = 2**30
LAYERS, HEADS, DIM = 32, 32, 128
BUDGET = 16 * GIB
SEQS = 64
MAX_LEN = 4096
STEP = 16  # tokens per extend


def range_mappings(cache) -> int:
    """Mappings (lines of /proc/self/maps) inside the cache's reserved range: what its pages cost."""
    lo = cache._range.address
    hi = lo + cache._range.bytes
    n = 0
    with open("/proc/self/maps") as f:
        for line in f:
            a, b = (int(x, 16) for x in line.split(None, 1)[0].split("-"))
            n += a < hi and b > lo
    return n


def make_cache(layout, page_size, max_len=MAX_LEN):
    pool = vpaged.PagePool("cpu", capacity_bytes=BUDGET, page_size=page_size, overcommit=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MappingLimitWarning)  # sharing's worst case; this fill shares nothing
        return vpaged.VirtualKVCache(
            KVGeometry(LAYERS, HEADS, DIM, torch.bfloat16),
            VirtualCacheConfig(max_seqs=SEQS, max_seq_len=max_len, layout=layout),
            pool=pool,
        )


@pytest.mark.parametrize("page_size", [64 * 1024, 2 * 2**20], ids=["64KiB", "2MiB"])
@pytest.mark.parametrize("layout", ["per_layer", "head_major", "interleaved"])
def test_sequences_growing_together_fill_the_budget_not_the_mapping_table(layout, page_size):
    cache = make_cache(layout, page_size)
    assert range_mappings(cache) == 1  # the whole cache range is one mapping
    seqs = [cache.allocate() for _ in range(SEQS)]
    peak, short = 0, None
    try:
        with pytest.raises(vpaged.OutOfPagesError):
            while True:
                for s in seqs:
                    before = (cache.seq_len(s), cache.pool.stats().used_pages)
                    try:
                        cache.extend(s, STEP)
                    except vpaged.OutOfPagesError:
                        assert (cache.seq_len(s), cache.pool.stats().used_pages) == before  # nothing changed
                        # The budget binds: this extend needed more pages than were left.
                        need = cache.layout.pages_for(before[0] + STEP) - cache.layout.pages_for(before[0])
                        short = need * cache.layout.runs
                        assert short > cache.pool.free_pages()
                        raise
                    peak = max(peak, range_mappings(cache))
        stats = cache.pool.stats()
        lens = [cache.seq_len(s) for s in seqs]
        used = stats.used_pages * page_size
        print(
            f"\n{layout}, {page_size // 1024} KiB: OutOfPagesError at {used / GIB:.2f} GiB mapped, "
            f"{min(lens)}..{max(lens)} tokens per sequence, {peak} mapping(s) in the range, "
            f"{mapping_count()} in the process (vm.max_map_count {mapping_limit()})"
        )
        # Filled to the budget, short of it only by less than the failed extend needed.
        assert BUDGET - short * page_size < used <= BUDGET
        assert peak == 1
        assert sum(lens) * cache.bytes_per_token <= used
    finally:
        cache.close()


def non_home_segments(cache) -> int:
    """Runs of page indices showing a page other than their home page (consecutive indices showing consecutive
    pages are one run): what costs the host backend mappings. Computed from the range's page table alone."""
    r = cache._range
    home0 = cache.pool.backend.home_page(r.address)
    lay = cache.layout
    indices = [i for slot in range(cache.max_seqs) for i in lay.page_indices(slot, 0, cache._slots.mapped_pages[slot])]
    pages = r.pages_at(indices)
    segs, prev_index, prev_page = 0, -2, -2
    for i, p in zip(indices, pages):
        if p >= 0 and p != home0 + i:
            if not (i == prev_index + 1 and p == prev_page + 1):
                segs += 1
        else:
            p = -2
        prev_index, prev_page = i, p
    return segs


def referenced_pages(cache) -> int:
    """Distinct pages the cache holds (mapped slots, swapped aside, and the prefix index): what the pool must
    count as used."""
    lay = cache.layout
    indices = [i for slot in range(cache.max_seqs) for i in lay.page_indices(slot, 0, cache._slots.mapped_pages[slot])]
    pages = {p for p in cache._range.pages_at(indices) if p >= 0}
    if cache._prefix:
        for block in cache._prefix.eviction_order():
            pages.update(block.pages)
    return len(pages)


OPS = int(os.environ.get("VPAGED_SCALE_OPS", "2500"))


@pytest.mark.parametrize(
    "layout,page_size",
    [("per_layer", 64 * 1024), ("head_major", 64 * 1024), ("interleaved", 64 * 1024), ("interleaved", 2 * 2**20)],
)
def test_random_operations_at_scale_keep_mappings_bounded(layout, page_size):
    """Random operations (allocate with prefix hits, extend, fork, reorder, truncate, free) on the 7B cache.
    Formula: mappings in the cache's range <= 1 + 2 * S, where S is the number of runs of page indices
    showing a page other than their home page (non_home_segments): private pages cost nothing, and S grows
    with shared runs, never with pages. The pool's count equals the distinct pages the cache holds."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    rng = random.Random(seed)
    baseline = mapping_count()
    cache = make_cache(layout, page_size, max_len=1024)
    try:
        run_random_operations(cache, rng, layout, page_size)
    finally:
        cache.close()
    assert mapping_count() <= baseline + 16  # the range is gone (allocator arenas may come and go)


def run_random_operations(cache, rng, layout, page_size):
    prefix = cache._prefix is not None
    block = cache._prefix.block_tokens if prefix else 0
    prompts = [[rng.randrange(32000) for _ in range(max(block, 1) * 3)] for _ in range(4)]
    live: list[int] = []
    tokens: dict[int, list[int]] = {}
    counts = {"oom": 0}
    max_segments = 0
    t0 = time.time()

    def check():
        nonlocal max_segments
        segs = non_home_segments(cache)
        max_segments = max(max_segments, segs)
        added = range_mappings(cache)
        assert added <= 1 + 2 * segs, (added, segs)
        assert cache.pool.stats().used_pages == referenced_pages(cache)

    # Sharing ops stop short of vm.max_map_count (head_major: up to 2 mappings per head and region of each
    # sharing sequence); reaching the limit itself is tested in test_cache.py, in a child process.
    room = 16 * cache.layout.runs + 1024

    for i in range(OPS):
        op = rng.choice(
            ["alloc", "alloc", "extend", "extend", "extend", "fork", "reorder", "truncate", "free", "cache_prefix"]
        )
        if op in ("alloc", "fork", "reorder") and mapping_count() + room > mapping_limit():
            op = "free"
        try:
            if op == "alloc" and len(live) < SEQS:
                if prefix and rng.random() < 0.7:
                    t = list(rng.choice(prompts))
                    s = cache.allocate(t)  # maps the cached blocks of the prompt in shared
                    live.append(s)
                    tokens[s] = t[: cache.seq_len(s)]
                    cache.extend(s, len(t) - cache.seq_len(s))  # "prefill" the rest
                    tokens[s] = t
                    continue
                else:
                    s = cache.allocate()
                    tokens[s] = []
                live.append(s)
            elif op == "extend" and live:
                s = rng.choice(live)
                n = rng.randrange(1, 3 * max(block, 8))
                if cache.seq_len(s) + n <= cache.max_seq_len:
                    cache.extend(s, n)
                    tokens[s] += [rng.randrange(32000) for _ in range(n)]
            elif op == "fork" and live and len(live) < SEQS:
                s = rng.choice(live)
                c = cache.fork(s)
                live.append(c)
                tokens[c] = list(tokens[s])
            elif op == "reorder" and len(live) >= 2:
                group = rng.sample(live, rng.randrange(2, min(4, len(live)) + 1))
                src = [rng.randrange(len(group)) for _ in group]
                cache.reorder(group, src)
                old = [tokens[s] for s in group]
                for s, j in zip(group, src):
                    tokens[s] = list(old[j])
            elif op == "truncate" and live:
                s = rng.choice(live)
                new_len = rng.randrange(cache.seq_len(s) + 1)
                cache.truncate(s, new_len)
                tokens[s] = tokens[s][:new_len]
            elif op == "free" and live:
                s = live.pop(rng.randrange(len(live)))
                cache.free(s)
                del tokens[s]
            elif op == "cache_prefix" and prefix and live:
                s = rng.choice(live)
                cache.cache_prefix(s, tokens[s])
        except vpaged.OutOfPagesError:
            counts["oom"] += 1
        if i % 500 == 499:
            check()
    check()
    print(
        f"\n{layout} {page_size // 1024} KiB: {OPS} ops in {time.time() - t0:.1f}s, live {len(live)}, "
        f"pool {cache.pool.stats().used_pages * page_size / GIB:.2f} GiB, max non-home runs {max_segments}, "
        f"out-of-pages {counts['oom']}"
    )
