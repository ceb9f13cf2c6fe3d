"""Errors that tell the cause and calls that stay all-or-nothing: the slot-exhaustion message, extend_many when
copy-on-write fails after mapping, reclaim counts that leave out pages pinned by views, swap_out without swap
space, and a cache's device taken from its pool."""

import gc

import pytest
import torch

from vpaged import KVGeometry, PagePool, VirtualCacheConfig, VirtualKVCache
from vpaged.errors import InvalidArgumentError, OutOfPagesError, SlotsExhaustedError

PS = 4096  # 128 tokens of one fp32 head of 8 per page and region


def make(**kw):
    args = dict(max_seqs=4, max_seq_len=1024, capacity_bytes=PS * 64, page_size=PS)
    args.update(kw)
    live = {k: args.pop(k) for k in ("pool", "prefix_hash") if k in args}  # the cache's keywords, not the record's
    if "pool" in live:
        args.pop("capacity_bytes")
        args.pop("page_size")
    return VirtualKVCache(KVGeometry(1, 1, 8, torch.float32), VirtualCacheConfig(**args), **live)


def fill(cache, seq, rng):
    n = cache.seq_len(seq)
    k, v = torch.randn(n, 1, 8, generator=rng), torch.randn(n, 1, 8, generator=rng)
    cache.write(0, seq, k, v, start=0)
    return k, v


def test_slots_exhausted_says_how_many_slots_views_of_freed_sequences_hold(rng):
    cache = make()
    seqs = [cache.allocate() for _ in range(4)]
    for s in seqs:
        cache.extend(s, 100)
        fill(cache, s, rng)
    parent = seqs[0]
    views = [cache.kv(0, s) for s in seqs[1:3]]
    for s in seqs[1:3]:
        cache.free(s)  # dormant, pinned by the views
    with pytest.raises(
        SlotsExhaustedError,
        match=r"2 of 4 slots hold live sequences, 2 are free, 2 of them held "
        r"by live tensor views of freed sequences",
    ):
        cache.fork_many(parent, 1)  # a fork needs a slot with nothing mapped
    del views
    gc.collect()
    child = cache.fork(parent)
    assert torch.equal(cache.kv(0, child)[0], cache.kv(0, parent)[0])


class FailingCopies:
    """The cache's range, except that copy-on-write runs out of pages (as when the device runs out of memory
    between the mapping and the copy)."""

    def __init__(self, real):
        self.real = real

    def make_private(self, *args):
        raise OutOfPagesError("out of device memory (injected)")

    def __getattr__(self, name):
        return getattr(self.real, name)


def test_extend_many_is_all_or_nothing_when_copy_on_write_fails_after_mapping(rng):
    cache = make()
    a = cache.allocate()
    cache.extend(a, 100)  # page 0 partly filled
    data = fill(cache, a, rng)
    b = cache.fork(a)  # shares page 0: b's next extend copies it and maps page 1 for the rest
    other = cache.allocate()
    before = (cache.stats(), [cache.seq_len(s) for s in (a, b, other)], cache.pool.stats().used_pages)
    real = cache._page_map.range
    cache._page_map.range = FailingCopies(real)
    try:
        with pytest.raises(OutOfPagesError, match="injected"):
            cache.extend_many([other, b], 60)  # maps pages for other (1) and b (1), then copies b's page 0
    finally:
        cache._page_map.range = real
    assert (cache.stats(), [cache.seq_len(s) for s in (a, b, other)], cache.pool.stats().used_pages) == before
    cache.extend_many([other, b], 60)  # the same call works once copies succeed
    assert torch.equal(cache.kv(0, b)[0][:100], data[0]) and cache.stats().cow_copies == 2  # K and V pages


def test_reclaim_does_not_count_pages_pinned_by_views(rng):
    cache = make(capacity_bytes=PS * 16)
    tokens = torch.randint(0, 1000, (256,), generator=rng).tolist()
    a = cache.allocate()
    cache.extend(a, 256)  # 2 full pages = 2 prefix blocks
    fill(cache, a, rng)
    assert cache.cache_prefix(a, tokens) == 256
    view = cache.kv(0, a)
    cache.free(a)  # dormant, but the view pins its pages, and with them the index's blocks
    assert cache.reclaimable_pages() == 0 and cache.pool.reclaimable_pages() == 0
    assert cache.reclaim() == 0
    del view
    gc.collect()
    # Now the slot's 4 pages (2 per region) can go, and then the blocks' 4 pages that only the index holds.
    assert cache.reclaimable_pages() == 8
    assert cache.reclaim() == 8 and cache.pool.stats().used_pages == 0


def test_swap_out_without_swap_space_is_an_argument_error():
    cache = make()
    s = cache.allocate()
    cache.extend(s, 10)
    with pytest.raises(InvalidArgumentError, match="no swap space"):
        cache.swap_out(s)
    assert not cache.is_swapped(s)


def test_the_cache_device_comes_from_its_pool():
    pool = PagePool("cpu", capacity_pages=8, page_size=PS)
    cache = VirtualKVCache(
        KVGeometry(1, 1, 8, torch.float32), VirtualCacheConfig(max_seqs=2, max_seq_len=128), pool=pool
    )
    assert cache.device == pool.device == torch.device("cpu")
    with pytest.raises(InvalidArgumentError, match="pool is on cpu, device='cuda:1' asks for cuda:1"):
        VirtualKVCache(
            KVGeometry(1, 1, 8, torch.float32),
            VirtualCacheConfig(max_seqs=2, max_seq_len=128, device="cuda:1"),
            pool=pool,
        )
    assert (
        VirtualKVCache(
            KVGeometry(1, 1, 8, torch.float32), VirtualCacheConfig(capacity_bytes=PS * 4, page_size=PS)
        ).device.type
        == "cpu"
    )


def test_vpaged_cache_device_comes_from_its_pool():
    hf = pytest.importorskip("vpaged.hf")
    pool = PagePool("cpu", capacity_pages=8, page_size=PS)
    geometry = KVGeometry(1, 1, 8, torch.float32)
    cache = hf.VPagedCache(None, max_cache_len=64, pool=pool, geometry=geometry)
    assert cache.device == torch.device("cpu") and cache.pool is pool
    with pytest.raises(InvalidArgumentError, match="pool is on cpu"):
        hf.VPagedCache(None, max_cache_len=64, pool=pool, device="cuda", geometry=geometry)
