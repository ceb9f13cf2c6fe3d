"""Sharing on the host backend: fork with copy-on-write, truncate, reorder, prefix caching, swap."""

import gc

import pytest
import torch
from test_cache import assert_same, fill, snapshot

import vpaged
from vpaged import KVGeometry, VirtualCacheConfig, VirtualKVCache

PAGE = 64 * 1024
LAYOUTS = ["per_layer", "interleaved", "head_major"]


def make(layout="per_layer", layers=2, capacity_pages=200, max_seqs=16, max_len=1200, prefix_hash=None, **kw):
    # 2 heads x 64 dims fp32: 512 B per token per region, 128 tokens per page (per_layer), 32 (interleaved)
    return VirtualKVCache(
        KVGeometry(layers, 2, 64, torch.float32),
        VirtualCacheConfig(
            max_seqs=max_seqs, max_seq_len=max_len, capacity_bytes=capacity_pages * PAGE, layout=layout, **kw
        ),
        prefix_hash=prefix_hash,
    )


def data(cache, seq):
    return [tuple(t.clone() for t in cache.kv(layer, seq)) for layer in range(cache.num_layers)]


def same(a, b):
    return all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fork_1000_tokens_eight_times_costs_no_page_until_children_write(layout, rng):
    cache = make(layout)
    parent = cache.allocate()
    fill(cache, parent, 1000, rng)
    before = data(cache, parent)
    used = cache.pool.stats().used_pages
    runs = cache.layout.runs  # page runs of a slot: regions, times heads for head_major
    children = cache.fork_many(parent, 8)
    assert cache.pool.stats().used_pages == used  # at most one extra page per region per child: here none
    for c in children:
        assert cache.seq_len(c) == 1000 and same(data(cache, c), before)
    assert cache.stats().shared_pages == 9 * used  # every page of the 9 sequences is shared
    for i, c in enumerate(children):
        copies = cache.stats().cow_copies
        fill(cache, c, 1, rng)  # the first write lands in the shared, partly filled last page
        assert cache.stats().cow_copies - copies == runs  # exactly one page copy per run
        assert cache.pool.stats().used_pages == used + (i + 1) * runs
        fill(cache, c, 3, rng)  # later writes to the now private page copy nothing
        assert cache.stats().cow_copies - copies == runs
    assert same(data(cache, parent), before)  # no child write is visible in the parent
    for i, c in enumerate(children):
        for j, d in enumerate(children):
            if i != j:
                assert not torch.equal(cache.kv(0, c)[0][1000:], cache.kv(0, d)[0][1000:])


def test_children_of_children_and_parent_writes(rng):
    cache = make()
    a = cache.allocate()
    fill(cache, a, 300, rng)
    b = cache.fork(a)
    fill(cache, b, 50, rng)
    c = cache.fork(b)
    d = cache.fork(c)
    snap_b = data(cache, b)
    fill(cache, a, 10, rng)
    fill(cache, d, 10, rng)
    assert same(data(cache, b), snap_b) and same(data(cache, c), snap_b)
    assert torch.equal(cache.kv(1, d)[1][:350], snap_b[1][1])
    for s in (a, b, c, d):
        cache.free(s)
    assert cache.stats().shared_pages == 0


def test_write_contract_is_enforced(rng):
    cache = make()
    a = cache.allocate()
    fill(cache, a, 100, rng)
    assert cache.writable_range(a) == (0, 100)
    b = cache.fork(a)
    for s in (a, b):
        assert cache.writable_range(s) == (100, 100)
        with pytest.raises(vpaged.ReadOnlyTokensError):
            cache.write(0, s, torch.zeros(1, 2, 64), torch.zeros(1, 2, 64), start=99)
    cache.extend(b, 5)
    assert cache.writable_range(b) == (0, 105)  # its only page was copied: all of it is b's own now
    assert cache.writable_range(a) == (100, 100)  # a still counts its page as shared
    k, v = cache.new_kv(0, b)
    assert k.shape == (5, 2, 64)
    k.fill_(3.0)  # the window's pages are private to b
    assert not torch.equal(cache.kv(0, a)[0][96:100], torch.full((4, 2, 64), 3.0))
    assert torch.equal(cache.kv(0, b)[0][100:], torch.full((5, 2, 64), 3.0))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_truncate_then_rewrite_copies_a_shared_page(layout, rng):
    cache = make(layout)
    a = cache.allocate()
    fill(cache, a, 200, rng)
    b = cache.fork(a)
    snap = data(cache, a)
    cache.truncate(b, 150)
    assert cache.seq_len(b) == 150
    fill(cache, b, 60, rng)  # rewrites tokens 150..209 of b, a's 150..199 must stay
    assert same(data(cache, a), snap)
    assert torch.equal(cache.kv(0, b)[0][:150], snap[0][0][:150])
    with pytest.raises(vpaged.InvalidArgumentError):
        cache.truncate(b, 211)
    used = cache.pool.stats().used_pages
    cache.truncate(b, 0)
    assert cache.pool.stats().used_pages < used


def test_reorder_remaps_beams(rng):
    cache = make(max_seqs=8)
    beams = cache.allocate_many(4)
    for s in beams:
        fill(cache, s, 150 + 10 * s, rng)
    before = [data(cache, s) for s in beams]
    lens = [cache.seq_len(s) for s in beams]
    used = cache.pool.stats().used_pages
    cache.reorder(beams, [2, 2, 0, 1])
    for s, src in zip(beams, [2, 2, 0, 1]):
        assert cache.seq_len(s) == lens[src] and same(data(cache, s), before[src])
    assert cache.pool.stats().used_pages < used  # beam 3's old pages are gone, the rest shared
    fill(cache, beams[0], 1, rng)
    fill(cache, beams[1], 1, rng)
    assert same([(k[: lens[2]], v[: lens[2]]) for k, v in data(cache, beams[0])], before[2])
    assert not torch.equal(cache.kv(0, beams[0])[0][-1], cache.kv(0, beams[1])[0][-1])
    with pytest.raises(vpaged.InvalidArgumentError):
        cache.reorder(beams, [0, 1])
    k = cache.kv(0, beams[3])  # a live view pins the target's pages: nothing changes
    snap = snapshot(cache)
    with pytest.raises(vpaged.ViewsAliveError):
        cache.reorder(beams, [3, 3, 3, 0])
    assert_same(snap, snapshot(cache))
    del k


@pytest.mark.parametrize("layout", LAYOUTS)
def test_prefix_hit_maps_shared_pages_and_saves_tokens(layout, rng):
    cache = make(layout)
    tpp = int(cache.stats().tokens_per_page)
    prompt = torch.randint(0, 1000, (3 * tpp + 17,), generator=rng).tolist()
    a = cache.allocate(tokens=prompt)
    assert cache.seq_len(a) == 0
    fill(cache, a, len(prompt), rng)
    assert cache.cache_prefix(a, prompt) == 3 * tpp
    used = cache.pool.stats().used_pages
    other = prompt[: 2 * tpp] + [t + 1 for t in prompt[2 * tpp :]]
    b = cache.allocate(tokens=other)  # shares the first two pages only
    assert cache.seq_len(b) == 2 * tpp
    assert cache.pool.stats().used_pages == used
    for layer in range(cache.num_layers):
        assert torch.equal(cache.kv(layer, b)[0], cache.kv(layer, a)[0][: 2 * tpp])
    fill(cache, b, len(other) - 2 * tpp, rng)
    assert cache.stats().prefix_hit_tokens == 2 * tpp
    cache.free(a)
    c = cache.allocate(tokens=prompt)  # a is gone, its full pages are still cached
    assert cache.seq_len(c) == 3 * tpp


def test_hash_collision_with_different_tokens_is_not_a_hit(rng):
    cache = make(prefix_hash=lambda parent, tokens: b"same key for every block")
    tpp = int(cache.stats().tokens_per_page)
    prompt = list(range(2 * tpp))
    a = cache.allocate(tokens=prompt)
    fill(cache, a, len(prompt), rng)
    cache.cache_prefix(a, prompt)
    b = cache.allocate(tokens=[t + 1 for t in prompt])  # same key, different tokens
    assert cache.seq_len(b) == 0
    c = cache.allocate(tokens=prompt)  # the real prefix still hits its first block
    assert cache.seq_len(c) == tpp


def test_cached_prefix_pages_are_evicted_before_out_of_pages(rng):
    cache = make(capacity_pages=8)  # 4 regions: 2 pages each
    tpp = int(cache.stats().tokens_per_page)
    prompt = list(range(tpp))
    a = cache.allocate(tokens=prompt)
    fill(cache, a, tpp, rng)
    cache.cache_prefix(a, prompt)
    cache.free(a)
    b = cache.allocate()
    fill(cache, b, 2 * tpp, rng)  # needs all 8 pages: the cached prefix is evicted
    assert cache.stats().prefix_cached_pages == 0
    assert cache.seq_len(cache.allocate(tokens=prompt)) == 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_swap_out_and_in_restores_data_at_the_same_addresses(layout, rng):
    cache = make(layout, swap_bytes=40 * PAGE)
    a = cache.allocate()
    fill(cache, a, 500, rng)
    b = cache.fork(a)
    fill(cache, b, 100, rng)  # b: shared pages + private ones
    snap = data(cache, b)
    addr = cache.kv(0, b)[0].data_ptr()
    used = cache.pool.stats().used_pages
    swapped = cache.swap_out(b)
    assert swapped > 0 and cache.stats().swapped_bytes == swapped
    assert cache.pool.stats().used_pages == used - swapped // PAGE  # shared pages stay
    assert cache.is_swapped(b)
    with pytest.raises(vpaged.SequenceSwappedError):
        cache.kv(0, b)
    with pytest.raises(vpaged.SequenceSwappedError):
        cache.extend(b, 1)
    c = cache.allocate()
    fill(cache, c, 300, rng)  # reuses the swapped pages' memory
    cache.swap_in(b)
    assert cache.kv(0, b)[0].data_ptr() == addr
    assert same(data(cache, b), snap)
    assert cache.stats().swapped_bytes == 0


def test_swap_errors_change_nothing(rng):
    cache = make(capacity_pages=12, swap_bytes=2 * PAGE)
    a = cache.allocate()
    fill(cache, a, 300, rng)  # 3 pages per region: 12 pages
    snap = snapshot(cache)
    with pytest.raises(vpaged.SwapSpaceFullError):
        cache.swap_out(a)
    assert_same(snap, snapshot(cache))
    k = cache.kv(0, a)
    with pytest.raises(vpaged.ViewsAliveError):
        cache.swap_out(a)
    del k
    gc.collect()
    small = make(capacity_pages=12, swap_bytes=12 * PAGE)
    s = small.allocate()
    fill(small, s, 200, rng)
    small.swap_out(s)
    t = small.allocate()
    fill(small, t, 300, rng)  # takes every page
    with pytest.raises(vpaged.OutOfPagesError):
        small.swap_in(s)
    assert small.is_swapped(s) and small.seq_len(t) == 300
    small.free(t)
    small.swap_in(s)
    small.free(s)
    assert small.pool.stats().used_pages == small.stats().dormant_pages


def test_out_of_pages_during_copy_on_write_changes_nothing(rng):
    cache = make(capacity_pages=8)
    a = cache.allocate()
    fill(cache, a, 200, rng)  # 2 pages per region, 8 pages: the pool is full
    b = cache.fork(a)
    snap = snapshot(cache)
    with pytest.raises(vpaged.OutOfPagesError):
        cache.extend(b, 1)  # needs a copy of b's last page in each region
    assert_same(snap, snapshot(cache))
    assert cache.stats().cow_copies == 0


def test_fork_without_free_slots_changes_nothing(rng):
    cache = make(max_seqs=3)
    a = cache.allocate()
    fill(cache, a, 100, rng)
    snap = snapshot(cache)
    with pytest.raises(vpaged.SlotsExhaustedError):
        cache.fork_many(a, 3)
    assert_same(snap, snapshot(cache))


# Geometries whose pages hold part tokens (page / token row bytes, per run): interleaved 3 layers x 2 heads x 64
# fp32 (3 KiB rows: 21.33 tokens per 64 KiB page), 3 KV heads x 64 fp32 per_layer (768-byte rows, SmolLM2:
# 85.33), head_major 5 heads... (1 head's 96 fp32 = 384 bytes: 170.67), and a token row longer than a page
# (interleaved 24 layers x 4 heads x 96 fp32 = 72 KiB: 0.89 tokens per page).
PART_TOKEN_GEOMETRIES = [
    dict(layout="interleaved", num_layers=3, num_kv_heads=2, head_dim=64),
    dict(layout="per_layer", num_layers=2, num_kv_heads=3, head_dim=64),
    dict(layout="head_major", num_layers=2, num_kv_heads=5, head_dim=96),
    dict(layout="interleaved", num_layers=24, num_kv_heads=4, head_dim=96),
]


@pytest.mark.parametrize(
    "geometry", PART_TOKEN_GEOMETRIES, ids=lambda g: f"{g['layout']}-{g['num_kv_heads']}x{g['head_dim']}"
)
def test_prefix_caching_with_pages_that_hold_part_tokens(geometry, rng):
    """A second identical prompt maps every full page of the first one's K/V shared and starts with the
    tokens wholly inside them; the token straddling the last shared page is computed again, and writing it
    copies that page, so the cached K/V never change. Data end to end equals a sequence computed alone."""
    g = dict(geometry)
    cache = VirtualKVCache(
        KVGeometry(g.pop("num_layers"), g.pop("num_kv_heads"), g.pop("head_dim"), torch.float32),
        VirtualCacheConfig(max_seqs=6, max_seq_len=4096, capacity_bytes=600 * PAGE, **g),
    )
    lay = cache.layout
    tpp = lay.page_size / lay.token_bytes
    assert not tpp.is_integer()
    prompt = torch.randint(0, 1000, (int(7.5 * max(tpp, 1)) + 3,), generator=rng).tolist()
    full_pages = len(prompt) * lay.token_bytes // lay.page_size
    a = cache.allocate(tokens=prompt)
    fill(cache, a, len(prompt), rng)
    original = data(cache, a)
    cached = cache.cache_prefix(a, prompt)
    assert cached == int(full_pages * lay.page_size // lay.token_bytes) or tpp < 1
    before = cache.stats()
    b = cache.allocate(tokens=prompt)
    hit = cache.seq_len(b)
    after = cache.stats()
    shared_pages = -(-hit * lay.token_bytes // lay.page_size) if tpp < 1 else full_pages
    assert hit == int(shared_pages * lay.page_size // lay.token_bytes)
    assert hit >= 0.9 * full_pages * lay.page_size // lay.token_bytes - (1 if tpp < 1 else 0)
    assert after.pool_used_pages == before.pool_used_pages  # everything it holds is shared
    assert after.prefix_hit_tokens == hit and hit > 0
    for layer in range(cache.num_layers):
        for x, y in zip(cache.kv(layer, b), original[layer]):
            assert torch.equal(x, y[:hit])
    # The rest of the prompt computed again (the straddling token first): its K/V as the first sequence had.
    cache.extend(b, len(prompt) - hit)
    first, _ = cache.writable_range(b)
    assert first <= hit  # from the copied page on
    for layer in range(cache.num_layers):
        k, v = original[layer]
        cache.write(layer, b, k[hit:], v[hit:])
    straddles = hit * lay.token_bytes % lay.page_size != 0
    assert cache.stats().cow_copies - before.cow_copies == (lay.runs if straddles else 0)  # that page, each run
    assert same(data(cache, a), original) and same(data(cache, b), original)
    cache.free(a)
    c = cache.allocate(tokens=prompt + [5, 6])  # a is gone: its pages are still cached
    assert cache.seq_len(c) == hit
