"""Regressions found in review: copy-on-write after view-blocked unmaps, new_kv over shared pages, free() of a
swapped sequence pinned by a view, reclaim through a closed cache, stale BatchedKV descriptors."""

import pytest
import torch

from vpaged import KVGeometry, VirtualCacheConfig
from vpaged.errors import InvalidArgumentError, ReadOnlyTokensError, ViewsAliveError
from vpaged.kvcache.virtual.cache import VirtualKVCache
from vpaged.memory.pool import PagePool
from vpaged.ops import decode_attention_contiguous

PS = 4096  # 4 KiB pages: 128 tokens of one fp32 head of 8 per page and region


def make(**kw):
    args = dict(max_seqs=4, max_seq_len=1024, capacity_bytes=PS * 256, page_size=PS)
    args.update(kw)
    live = {k: args.pop(k) for k in ("pool", "prefix_hash") if k in args}  # the cache's keywords, not the record's
    if "pool" in live:
        args.pop("capacity_bytes")
        args.pop("page_size")
    return VirtualKVCache(KVGeometry(1, 1, 8, torch.float32), VirtualCacheConfig(**args), **live)


def fill(cache, seq, value, start, n):
    k = torch.full((n, 1, 8), float(value))
    cache.write(0, seq, k, k, start=start)


def token(cache, seq, t):
    k, _ = cache.kv(0, seq)
    return float(k[t, 0, 0])


def pages_referenced(cache):
    lay, pages = cache.layout, set()
    for s in range(cache.max_seqs):
        pages.update(p for p in cache._range.pages_at(lay.page_indices(s, 0, lay.pages_per_run)) if p >= 0)
    if cache._prefix:
        for block in cache._prefix.blocks():
            pages.update(block.pages)
    return len(pages)


def test_extend_after_truncate_blocked_by_a_view_copies_every_shared_page():
    cache = make()
    a = cache.allocate()
    cache.extend(a, 300)
    fill(cache, a, 1.0, 0, 300)
    b = cache.fork(a)
    k, v = cache.kv(0, b)
    cache.truncate(b, 10)  # pages past token 10 stay mapped (and shared): a view reads them
    del k, v
    cache.extend(b, 1)
    cache.extend(b, 200)
    fill(cache, b, 9.0, 11, 200)
    assert token(cache, a, 150) == 1.0
    assert cache.pool.stats().used_pages == pages_referenced(cache)


def test_reused_slot_whose_free_was_blocked_by_a_view_never_writes_shared_pages():
    cache = make(max_seqs=2)
    a = cache.allocate()
    cache.extend(a, 300)
    fill(cache, a, 1.0, 0, 300)
    b = cache.fork(a)
    k, v = cache.kv(0, b)
    cache.free(b)  # slot kept with pages shared with a
    del k, v
    d = cache.allocate()
    cache.extend(d, 1)
    cache.extend(d, 200)
    fill(cache, d, 7.0, 0, 201)
    assert token(cache, a, 0) == 1.0 and token(cache, a, 150) == 1.0


def test_new_kv_never_covers_shared_pages():
    cache = make()
    a = cache.allocate()
    cache.extend(a, 10)
    fill(cache, a, 1.0, 0, 10)
    b = cache.fork(a)
    for seq in (a, b):
        k, _ = cache.new_kv(0, seq)
        assert k.shape[0] == 0
    cache.extend(b, 1)
    k, v = cache.new_kv(0, b)
    assert k.shape[0] == 1
    k.fill_(3.0)
    v.fill_(3.0)
    del k, v
    assert token(cache, a, 9) == 1.0

    tokens = list(range(128))
    s = cache.allocate()
    cache.extend(s, 128)
    fill(cache, s, 2.0, 0, 128)
    cache.cache_prefix(s, tokens)
    k, _ = cache.new_kv(0, s)
    assert k.shape[0] == 0
    del k
    hit = cache.allocate(tokens=tokens + [1])
    assert cache.seq_len(hit) == 128 and token(cache, hit, 0) == 2.0


def test_free_of_swapped_sequence_blocked_by_a_view_changes_nothing():
    cache = make(swap_bytes=PS * 16)
    a = cache.allocate()
    cache.extend(a, 128)
    fill(cache, a, 1.0, 0, 128)
    b = cache.fork(a)
    k, v = cache.kv(0, a)  # pins a's (shared) first page
    cache.extend(a, 100)
    fill(cache, a, 2.0, 128, 100)
    cache.swap_out(a)
    with pytest.raises(ViewsAliveError):
        cache.free(a)
    assert a in cache.sequences and cache.is_swapped(a)
    del k, v
    cache.free(a)
    assert cache.sequences == [b]
    assert cache._slots.free_count == cache.max_seqs - 1
    assert cache.pool.stats().used_pages == pages_referenced(cache)
    assert cache.stats().swapped_bytes == 0


def test_closed_cache_is_not_asked_to_reclaim():
    pool = PagePool("cpu", capacity_pages=8, page_size=PS)
    a = make(pool=pool, capacity_bytes=None)
    s = a.allocate()
    a.extend(s, 128)
    a.free(s)  # a dormant slot
    a.close()
    assert pool.reclaim(100) == 0
    b = make(pool=pool, capacity_bytes=None)
    x, y = b.allocate(), b.allocate()
    b.extend(x, 3 * 128)
    b.free(x)
    b.extend(y, 3 * 128)  # needs b's dormant pages back
    assert b.seq_len(y) == 384


def test_stale_batched_descriptor_is_refused_not_read():
    cache = make()
    a = cache.allocate()
    cache.extend(a, 300)
    fill(cache, a, 1.0, 0, 300)
    desc = cache.batch(0, [a])
    cache.free(a)
    cache.reclaim()
    with pytest.raises(InvalidArgumentError, match="unmapped"):
        decode_attention_contiguous(torch.randn(1, 1, 8), desc)


@pytest.mark.parametrize("layout", ["per_layer", "interleaved", "head_major"])
def test_fresh_batched_descriptor_passes_the_mapping_check(layout):
    cache = VirtualKVCache(
        KVGeometry(2, 2, 8, torch.float32),
        VirtualCacheConfig(max_seqs=3, max_seq_len=512, layout=layout, capacity_bytes=PS * 256, page_size=PS),
    )
    seqs = [cache.allocate() for _ in range(3)]
    for i, s in enumerate(seqs):
        cache.extend(s, 50 + 100 * i)
    q = torch.randn(3, 4, 8)
    out = decode_attention_contiguous(q, cache.batch(1, seqs))
    assert torch.isfinite(out).all()


def test_cache_prefix_cut_short_by_a_collision_keeps_the_cached_pages_read_only(rng):
    """Prefix keys whose deeper blocks ignore the tokens: the second sequence's first block is cached, its
    second collides. The cached block's page must not stay writable for the sequence."""
    cache = make(prefix_hash=lambda parent, block: b"deep" if parent else bytes(str(list(block)), "ascii"))
    a, b = cache.allocate(), cache.allocate()
    tokens_a = torch.randint(0, 1000, (256,), generator=rng).tolist()
    tokens_b = [t + 1000 for t in tokens_a]
    for seq in (a, b):
        cache.extend(seq, 256)
        fill(cache, seq, seq + 1, 0, 256)
    assert cache.cache_prefix(a, tokens_a) == 256
    assert cache.cache_prefix(b, tokens_b) == 128  # block 1's key is a's
    assert cache.writable_range(b)[0] >= 128
    with pytest.raises(ReadOnlyTokensError):
        fill(cache, b, 9.0, 0, 1)
    c = cache.allocate(tokens=tokens_b[:128] + [5])
    assert cache.seq_len(c) == 128 and token(cache, c, 0) == b + 1  # the cached block as b wrote it
