"""VirtualKVCache on the host backend: views, growth, memory accounting, errors leave state unchanged."""

import gc
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from process_helpers import address_is_mapped

import vpaged
from vpaged import KVGeometry, VirtualCacheConfig, VirtualKVCache

LAYOUTS = ["per_layer", "interleaved", "head_major"]
PAGE = 64 * 1024


def make_cache(
    layout="per_layer",
    dtype=torch.float32,
    layers=3,
    heads=2,
    dim=64,
    max_seqs=8,
    max_len=1000,
    capacity=64 * PAGE,
    **kw,
):
    return VirtualKVCache(
        KVGeometry(layers, heads, dim, dtype),
        VirtualCacheConfig(max_seqs=max_seqs, max_seq_len=max_len, capacity_bytes=capacity, layout=layout, **kw),
    )


def fill(cache, seq, n, rng, reference=None):
    """Extend seq by n tokens and write random K/V into them in every layer; mirror into reference."""
    cache.extend(seq, n)
    for layer in range(cache.num_layers):
        k = torch.randn(n, cache.num_kv_heads, cache.head_dim, generator=rng).to(cache.dtype)
        v = torch.randn(n, cache.num_kv_heads, cache.head_dim, generator=rng).to(cache.dtype)
        cache.write(layer, seq, k, v)
        if reference is not None:
            ks, vs = reference.setdefault((seq, layer), ([], []))
            ks.append(k)
            vs.append(v)


def check_against(cache, reference):
    for (seq, layer), (ks, vs) in reference.items():
        k, v = cache.kv(layer, seq)
        assert torch.equal(k, torch.cat(ks)), (seq, layer)
        assert torch.equal(v, torch.cat(vs)), (seq, layer)


def snapshot(cache):
    """Everything a failed call must leave as it was: lengths, pages behind every slot, data, pool use."""
    seqs = sorted(cache.sequences)
    pages = cache._range.pages_at(list(range(cache._range.num_pages)))
    data = {(s, l): tuple(t.clone() for t in cache.kv(l, s)) for s in seqs for l in range(cache.num_layers)}
    return seqs, [cache.seq_len(s) for s in seqs], pages, data, cache.pool.stats().used_pages


def assert_same(before, after):
    assert before[:3] == after[:3]
    assert before[4] == after[4]
    for key, (k, v) in before[3].items():
        assert torch.equal(k, after[3][key][0]) and torch.equal(v, after[3][key][1])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gqa", [1, 4])
def test_sdpa_on_views_equals_sdpa_on_ordinary_tensors(layout, dtype, gqa, rng):
    heads, dim = 2, 64
    cache = make_cache(layout, dtype, heads=heads, dim=dim)
    seq = cache.allocate()
    ref = {}
    for n in (37, 200, 1):  # crosses page boundaries (128 fp32 tokens per page per layer)
        fill(cache, seq, n, rng, ref)
    length = cache.seq_len(seq)
    q = torch.randn(1, heads * gqa, 5, dim, generator=rng).to(dtype)
    for layer in range(cache.num_layers):
        k, v = cache.kv(layer, seq)
        assert k.shape == (length, heads, dim)
        dense_k, dense_v = torch.cat(ref[(seq, layer)][0]), torch.cat(ref[(seq, layer)][1])
        out_view = F.scaled_dot_product_attention(
            q, k.transpose(0, 1)[None], v.transpose(0, 1)[None], enable_gqa=gqa > 1
        )
        out_dense = F.scaled_dot_product_attention(
            q, dense_k.transpose(0, 1)[None], dense_v.transpose(0, 1)[None], enable_gqa=gqa > 1
        )
        if layout == "per_layer":
            assert torch.equal(out_view, out_dense)
        else:  # strided K/V may take another SDPA path; results agree to rounding
            tol = 1e-6 if dtype == torch.float32 else 1e-2
            torch.testing.assert_close(out_view, out_dense, rtol=tol, atol=tol)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_growth_across_pages_keeps_earlier_tokens(layout, rng):
    cache = make_cache(layout, max_len=2000, capacity=256 * PAGE)
    seqs = [cache.allocate() for _ in range(3)]
    ref = {}
    for step in range(12):
        for s in seqs:
            fill(cache, s, int(torch.randint(1, 90, (1,), generator=rng)), rng, ref)
        check_against(cache, ref)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_utilization_matches_hand_computation(layout):
    layers, heads, dim = 3, 2, 64
    cache = make_cache(layout, torch.float32, layers=layers, heads=heads, dim=dim)
    a, b = cache.allocate(), cache.allocate()
    cache.extend(a, 100)
    cache.extend(b, 300)
    per_layer_token = heads * dim * 4  # bytes of K (or V) of one layer
    if layout == "per_layer":  # 2·layers regions, 128 tokens per page
        token_bytes = per_layer_token
        pages = 2 * layers * (-(-100 // 128) + -(-300 // 128))  # 6 * (1 + 3)
    elif layout == "interleaved":  # one region, 21.33 tokens per page: pages hold fractional tokens
        token_bytes = 2 * layers * per_layer_token
        pages = -(-100 * token_bytes // PAGE) + -(-300 * token_bytes // PAGE)
    else:  # head_major: a run of pages per head in each of 2·layers regions, 256 tokens per page
        token_bytes = dim * 4
        pages = 2 * layers * heads * (-(-100 // 256) + -(-300 // 256))  # 12 * (1 + 2)
    s = cache.stats()
    assert s.tokens_per_page == pytest.approx(PAGE / token_bytes)
    live = 400 * 2 * layers * per_layer_token
    assert (s.mapped_pages, s.mapped_bytes, s.live_tokens, s.live_bytes) == (pages, pages * PAGE, 400, live)
    assert s.utilization == pytest.approx(live / (pages * PAGE))
    assert s.pool_used_pages == pages
    assert cache.static_bytes(2) == 2 * 1000 * 2 * layers * per_layer_token


def test_free_keeps_pages_for_the_next_allocate_and_the_pool_takes_them_back(rng):
    cache = make_cache(capacity=24 * PAGE)  # 3 layers: 6 regions
    a = cache.allocate()
    cache.extend(a, 256)  # 2 pages per region: 12 pages
    mapped = cache.stats().pages_mapped_total
    cache.free(a)
    s = cache.stats()
    assert (s.mapped_pages, s.dormant_pages, s.live_tokens) == (12, 12, 0)
    b = cache.allocate()  # reuses the slot with its pages: no map work
    cache.extend(b, 200)
    assert cache.stats().pages_mapped_total == mapped
    assert cache.stats().map_calls == 1
    c = cache.allocate()
    cache.extend(c, 256)  # needs the other 12 pages
    cache.free(b)
    d = cache.allocate()  # takes b's dormant slot
    cache.free(d)
    e = cache.allocate()
    cache.free(c)  # now two dormant slots, 24 pages, pool empty
    assert cache.pool.free_pages() == 0
    cache.extend(e, 300)  # e's slot has 12 pages, needs 18: the pool reclaims c's dormant pages
    s = cache.stats()
    assert s.pages_unmapped_total == 12 and s.dormant_pages == 0 and s.mapped_pages == 18
    assert cache.reclaim() == 0


def test_shared_pool_reclaims_across_caches():
    pool = vpaged.PagePool("cpu", capacity_pages=12)
    a = VirtualKVCache(KVGeometry(3, 2, 64, torch.float32), VirtualCacheConfig(max_seqs=2, max_seq_len=512), pool=pool)
    b = VirtualKVCache(KVGeometry(3, 2, 64, torch.float32), VirtualCacheConfig(max_seqs=2, max_seq_len=512), pool=pool)
    s = a.allocate()
    a.extend(s, 256)
    a.free(s)  # 12 dormant pages in a
    t = b.allocate()
    b.extend(t, 128)  # b needs 6: a gives its dormant pages back
    assert a.stats().mapped_pages == 0 and b.stats().mapped_pages == 6


def test_kv_batch_and_batched_descriptor(rng):
    cache = make_cache(max_seqs=6)
    cache.allocate()
    seqs = cache.allocate_many(3)
    slots = [cache.slot(s) for s in seqs]
    assert slots == list(range(slots[0], slots[0] + 3))
    ref = {}
    for s in seqs:
        fill(cache, s, 150, rng, ref)
    for layer in range(cache.num_layers):
        k, v = cache.kv_batch(layer, seqs)
        assert k.shape == (3, 150, 2, 64)
        for i, s in enumerate(seqs):
            assert torch.equal(k[i], torch.cat(ref[(s, layer)][0]))
            assert torch.equal(v[i], torch.cat(ref[(s, layer)][1]))
    fill(cache, seqs[1], 10, rng, ref)
    with pytest.raises(vpaged.InvalidArgumentError, match="differ in length"):
        cache.kv_batch(0, seqs)
    assert cache.kv_batch(0, seqs, length=150)[0].shape[1] == 150
    with pytest.raises(vpaged.InvalidArgumentError, match="evenly spaced"):
        cache.kv_batch(0, [seqs[2], seqs[0]])
    d = cache.batch(2, [seqs[2], seqs[0]])
    assert d.lengths.tolist() == [150, 150] and d.slots.tolist() == [slots[2], slots[0]]
    k, _ = cache.kv(2, seqs[2])
    assert d.k_ptr + slots[2] * d.slot_stride * 4 == k.data_ptr()
    assert d.token_stride == k.stride(0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_errors_are_typed_and_change_nothing(layout, rng):
    cache = make_cache(layout, max_seqs=3, capacity=40 * PAGE)
    a, b = cache.allocate(), cache.allocate()
    fill(cache, a, 130, rng)
    fill(cache, b, 20, rng)
    before = snapshot(cache)
    cases = [
        (vpaged.OutOfPagesError, lambda: cache.extend(b, 900)),
        (vpaged.OutOfPagesError, lambda: cache.extend_many([a, b], 400)),
        (vpaged.SequenceTooLongError, lambda: cache.extend(a, 871)),
        (vpaged.InvalidArgumentError, lambda: cache.extend(a, -1)),
        (vpaged.InvalidArgumentError, lambda: cache.extend(a, 1.5)),
        (vpaged.UnknownSequenceError, lambda: cache.extend(99, 1)),
        (vpaged.UnknownSequenceError, lambda: cache.kv(0, "a")),
        (vpaged.InvalidArgumentError, lambda: cache.extend_many([a, a], 1)),
        (vpaged.LayerIndexError, lambda: cache.kv(3, a)),
        (vpaged.LayerIndexError, lambda: cache.kv(-1, a)),
        (
            vpaged.DTypeError,
            lambda: cache.write(
                0, a, torch.zeros(1, 2, 64, dtype=torch.float64), torch.zeros(1, 2, 64, dtype=torch.float64)
            ),
        ),
        (vpaged.ShapeError, lambda: cache.write(0, a, torch.zeros(1, 3, 64), torch.zeros(1, 3, 64))),
        (vpaged.ShapeError, lambda: cache.write(0, a, torch.zeros(1, 2, 64), torch.zeros(2, 2, 64))),
        (
            vpaged.InvalidArgumentError,
            lambda: cache.write(0, a, torch.zeros(1, 2, 64), torch.zeros(1, 2, 64), start=130),
        ),
        (vpaged.InvalidArgumentError, lambda: cache.kv_batch(0, [])),
    ]
    for error, call in cases:
        with pytest.raises(error):
            call()
        assert_same(before, snapshot(cache))
    assert isinstance(vpaged.OutOfPagesError(), MemoryError)
    c = cache.allocate()
    with pytest.raises(vpaged.SlotsExhaustedError):
        cache.allocate()
    cache.free(c)
    with pytest.raises(vpaged.UnknownSequenceError, match="freed"):
        cache.free(c)
    with pytest.raises(vpaged.UnknownSequenceError, match="freed"):
        cache.kv(0, c)
    assert_same(before, snapshot(cache))


def test_constructor_errors():
    with pytest.raises(vpaged.InvalidArgumentError):
        VirtualKVCache(KVGeometry(0, 2, 64, torch.bfloat16), VirtualCacheConfig(capacity_bytes=PAGE))
    with pytest.raises(vpaged.InvalidArgumentError, match="layout"):
        VirtualKVCache(KVGeometry(2, 2, 64, torch.bfloat16), VirtualCacheConfig(capacity_bytes=PAGE, layout="blocked"))
    with pytest.raises(vpaged.DTypeError):
        VirtualKVCache(KVGeometry(2, 2, 64, torch.int64), VirtualCacheConfig(capacity_bytes=PAGE))
    with pytest.raises(vpaged.InvalidArgumentError, match="device"):
        VirtualKVCache(KVGeometry(2, 2, 64, torch.bfloat16), VirtualCacheConfig(capacity_bytes=PAGE, device="meta"))
    with pytest.raises(vpaged.InvalidArgumentError, match="at least one page"):
        VirtualKVCache(KVGeometry(2, 2, 64, torch.bfloat16), VirtualCacheConfig(capacity_bytes=100))


def test_close_returns_every_page_and_the_address_range(rng):
    pool = vpaged.PagePool("cpu", capacity_pages=64)
    with VirtualKVCache(
        KVGeometry(3, 2, 64, torch.float32), VirtualCacheConfig(max_seqs=4, max_seq_len=700), pool=pool
    ) as cache:
        seqs = [cache.allocate() for _ in range(3)]
        for s in seqs:
            fill(cache, s, 300, rng)
        cache.free(seqs[0])
        addr = cache._range.address
        kept = cache.kv(1, seqs[1])[0]  # a view that outlives the cache
        expect = kept.clone()
        assert pool.stats().used_pages > 0
    with pytest.raises(vpaged.CacheClosedError):
        cache.allocate()
    assert torch.equal(kept, expect)  # still mapped while the view lives
    assert pool.stats().used_pages == 3  # the pages under that one view
    del kept
    gc.collect()
    assert pool.stats().used_pages == 0
    assert not address_is_mapped(addr)


def test_views_keep_their_pages_when_the_pool_reclaims(rng):
    cache = make_cache(capacity=12 * PAGE)
    a = cache.allocate()
    fill(cache, a, 256, rng)
    k, _ = cache.kv(0, a)
    expect = k.clone()
    cache.free(a)  # dormant, but read through a live view
    b = cache.allocate()
    other = cache.allocate()
    with pytest.raises(vpaged.OutOfPagesError):
        cache.extend(other, 256)  # the only reclaimable pages are pinned by the view
    assert torch.equal(k, expect)
    del k, _
    gc.collect()
    cache.free(b)
    cache.extend(other, 256)


def test_hitting_the_host_mapping_limit_is_a_clean_error():
    # Private pages cost no mapping (host_backend.cpp); a fork maps the parent's pages into the child's slot
    # with a mapping per region (2 with the gap after it), so a few hundred forks of a 64-layer cache exhaust
    # vm.max_map_count. Run in a child process to keep this one's map count.
    code = textwrap.dedent("""
        import warnings
        import torch, vpaged
        warnings.simplefilter("ignore", vpaged.MappingLimitWarning)
        cache = vpaged.VirtualKVCache(vpaged.KVGeometry(64, 1, 16, torch.float32),
                                      vpaged.VirtualCacheConfig(max_seqs=1200, max_seq_len=128,
                                                                capacity_bytes=1200 * 128 * 4096, page_size=4096))
        parent = cache.allocate()
        cache.extend(parent, 1)
        forks = []
        try:
            while True:
                before = (cache.pool.stats().used_pages, cache.stats().mapped_pages, len(cache.sequences))
                forks.append(cache.fork(parent))
        except vpaged.MappingLimitError as e:
            assert isinstance(e, OSError) and "max_map_count" in str(e), e
            assert (cache.pool.stats().used_pages, cache.stats().mapped_pages, len(cache.sequences)) == before
            for t in forks:
                assert cache.seq_len(t) == 1
            for t in forks[:10]:
                cache.free(t)
            cache.reclaim()
            cache.fork(parent)  # works again once mappings are returned
            print("OK", len(forks))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("OK")
    assert 100 < int(out.stdout.split()[1]) < 1200  # forks, not private pages, ran into the limit
