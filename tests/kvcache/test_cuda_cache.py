"""VirtualKVCache, sharing and the transformers cache on the CUDA backend (tests marked `gpu`).

They skip with the reason where CUDA is unusable (no driver, no device, built without CUDA, torch without
CUDA); scripts/gpu_check.sh runs them on a lent GPU. The references are ordinary torch CUDA tensors holding
the same data, cloned out of the cache before anything changes it.
"""

import gc
import os
import random

import pytest
import torch
import torch.nn.functional as F
from test_vllm_plugin import _reference_pages

import vpaged
from vpaged import _C, KVGeometry, PagedCacheConfig, VirtualCacheConfig
from vpaged.integrations.vllm.backing import BlockGeometry, KVBacking, make_pool

REASON = _C.cuda_unavailable_reason(0) or ("" if torch.cuda.is_available() else "torch has no CUDA")
# A mark, not a module-level skip: the fake-driver tests import this module to run its scenarios.
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(bool(REASON), reason=f"CUDA unusable: {REASON}")]

DEV = torch.device("cuda", 0)
GRAN = _C.cuda_granularity(0)  # 0 where CUDA is unusable (every test here is skipped then)
LAYOUTS = ["per_layer", "interleaved", "head_major"]


@pytest.fixture
def gen():
    g = torch.Generator(device=DEV)
    g.manual_seed(int.from_bytes(os.urandom(4), "little"))
    return g


def make(
    layout="per_layer", dtype=torch.bfloat16, pages=64, layers=2, heads=2, dim=128, max_seqs=8, max_len=16384, **kw
):
    return vpaged.VirtualKVCache(
        KVGeometry(layers, heads, dim, dtype),
        VirtualCacheConfig(
            max_seqs=max_seqs, max_seq_len=max_len, device=DEV, capacity_bytes=pages * GRAN, layout=layout, **kw
        ),
    )


def fill(cache, seq, n, gen):
    cache.extend(seq, n)
    for layer in range(cache.num_layers):
        shape = (n, cache.num_kv_heads, cache.head_dim)
        k = torch.randn(shape, device=DEV, generator=gen).to(cache.dtype)
        v = torch.randn(shape, device=DEV, generator=gen).to(cache.dtype)
        cache.write(layer, seq, k, v)


def clones(cache, seq):
    return [tuple(t.clone() for t in cache.kv(layer, seq)) for layer in range(cache.num_layers)]


def same(a, b):
    return all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_on_views_equals_sdpa_on_ordinary_tensors(layout, dtype, gen):
    cache = make(layout, dtype)
    seq = cache.allocate()
    # 9,001 tokens cross 2 MiB pages in every layout and dtype: a page holds at most 8,192 of them (bf16
    # head_major: one head's 128 elements per token in a run).
    for n in (1000, 3000, 5000, 1):
        fill(cache, seq, n, gen)
    assert cache.stats().tokens_per_page < 9001
    q = torch.randn(1, 8, 4, 128, device=DEV, generator=gen).to(dtype)  # GQA: 8 query heads on 2 kv heads
    for layer in range(cache.num_layers):
        k, v = cache.kv(layer, seq)
        assert k.device == DEV and k.shape == (9001, 2, 128)
        dense_k, dense_v = k.clone(), v.clone()
        out_view = F.scaled_dot_product_attention(q, k.transpose(0, 1)[None], v.transpose(0, 1)[None], enable_gqa=True)
        out_dense = F.scaled_dot_product_attention(
            q, dense_k.transpose(0, 1)[None], dense_v.transpose(0, 1)[None], enable_gqa=True
        )
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out_view, out_dense, rtol=tol, atol=tol)
    cache.close()


def test_growth_and_unmapping_wait_for_kernels_in_flight_on_a_side_stream(gen):
    cache = make("per_layer", torch.float32, pages=128)
    side = torch.cuda.Stream(device=DEV)
    cache.use_stream(side)
    seqs = [cache.allocate() for _ in range(3)]
    for s in seqs:
        fill(cache, s, 5000, gen)
    q = torch.randn(1, 2, 1, 128, device=DEV, generator=gen)
    expect = []
    outs = []
    for s in seqs:
        k, v = cache.kv(0, s)
        expect.append(
            F.scaled_dot_product_attention(q, k.transpose(0, 1)[None].clone(), v.transpose(0, 1)[None].clone())
        )
    torch.cuda.synchronize()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # keep the side stream busy well past the host calls below
        for s in seqs:
            k, v = cache.kv(0, s)
            outs.append(F.scaled_dot_product_attention(q, k.transpose(0, 1)[None], v.transpose(0, 1)[None]))
            del k, v  # the views go (their pages unpin) while the kernels reading them are still queued
    gc.collect()
    # Growth maps new pages (no wait needed); truncate and free + reclaim unmap pages the queued kernels
    # read: the cache must wait for the side stream first, or those kernels read unmapped memory.
    fill(cache, seqs[0], 3000, gen)
    cache.truncate(seqs[1], 10)
    cache.free(seqs[2])
    cache.reclaim()
    torch.cuda.synchronize()
    for out, ref in zip(outs, expect):
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    cache.close()


def test_out_of_pages_changes_nothing(gen):
    cache = make("per_layer", torch.bfloat16, pages=8)  # 4 regions: 2 pages each
    a = cache.allocate()
    fill(cache, a, 5000, gen)  # 2 MiB holds 4096 bf16 tokens of 2 x 128: 2 pages per region
    before = clones(cache, a)
    used = cache.pool.stats().used_pages
    with pytest.raises(vpaged.OutOfPagesError):
        cache.extend(a, 4000)
    assert cache.seq_len(a) == 5000 and cache.pool.stats().used_pages == used
    assert same(clones(cache, a), before)
    cache.close()


def test_fork_copy_on_write_and_swap(gen):
    cache = make("interleaved", torch.bfloat16, pages=64, swap_bytes=32 * GRAN)
    parent = cache.allocate()
    fill(cache, parent, 3000, gen)
    before = clones(cache, parent)
    used = cache.pool.stats().used_pages
    kids = cache.fork_many(parent, 4)
    assert cache.pool.stats().used_pages == used
    for c in kids:
        fill(cache, c, 7, gen)
    assert same(clones(cache, parent), before)
    assert cache.stats().cow_copies == 4
    snap = clones(cache, kids[0])
    addr = cache.kv(0, kids[0])[0].data_ptr()
    cache.swap_out(kids[0])
    other = cache.allocate()
    fill(cache, other, 6000, gen)
    cache.swap_in(kids[0])
    assert cache.kv(0, kids[0])[0].data_ptr() == addr
    assert same(clones(cache, kids[0]), snap)
    cache.close()


def close_scenario(device):
    """A cache on its own pool of 256 pages, 128 created up front (256 MiB of 2 MiB handles), grown to 60,000
    tokens and closed. Also run under the fake driver (tests/memory/test_cuda_backend_fake.py), where the pool
    and cache device arguments are checked without a GPU."""
    pool = vpaged.PagePool(device, capacity_pages=256, reserve_pages=128)
    cache = vpaged.VirtualKVCache(
        KVGeometry(2, 2, 128, torch.bfloat16),
        VirtualCacheConfig(max_seqs=4, max_seq_len=65536, device=device),
        pool=pool,
    )
    s = cache.allocate()
    cache.extend(s, 60000)
    assert pool.stats().used_pages > 0
    cache.close()
    assert pool.stats().used_pages == 0
    return pool


def test_close_returns_device_memory():
    torch.cuda.synchronize()
    gc.collect()
    free_before, _ = torch.cuda.mem_get_info(DEV)
    pool = close_scenario(DEV)
    del pool
    gc.collect()
    torch.cuda.synchronize()
    free_after, _ = torch.cuda.mem_get_info(DEV)
    assert free_after >= free_before - 64 * 2**20  # every handle released (slack for the driver's own use)


def test_transformers_generate_on_cuda_matches_dynamic_cache():
    transformers = pytest.importorskip("transformers")
    from vpaged.hf import VPagedCache, cache_kwargs

    config = transformers.LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(DEV).eval()
    ids = torch.randint(1, 256, (2, 12), device=DEV)  # no pad token (0) inside the prompts
    kw = dict(max_new_tokens=20, do_sample=False, pad_token_id=0)
    ref = model.generate(ids, **kw)
    for layout in LAYOUTS:
        cache = VPagedCache(config, max_cache_len=64, capacity_bytes=256 * GRAN, layout=layout)
        out = model.generate(ids, **cache_kwargs(cache), **kw)
        assert torch.equal(out, ref), layout
        cache.reset()


# --------------------------------------------------------------------------------------------- issue #36.5
FORMATS = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("kind", ["per_layer", "head_major", "paged"])
@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_quantized_cache_end_to_end_on_cuda(kind, kv_dtype, gen):
    """Quantized K/V on the GPU the way the engine runs them: 1-byte rows scattered by ops.write_kv (the
    CUDA scatter quantizes; the same bytes as write()), then a decode plan built by the cache
    (VirtualKVCache's record, or the paged pools through set_format) against float64 attention over the
    cache's own dequantized K/V."""
    from vpaged import PagedKVCache, ops

    heads, dim, layers, lengths = 2, 128, 2, [1, 37, 700, 129]
    scales = None if kv_dtype == torch.int8 else (0.02, 0.03)
    if kind == "paged":
        make_one = lambda: PagedKVCache(  # noqa: E731
            KVGeometry(layers, heads, dim, torch.float32, kv_dtype=kv_dtype),
            PagedCacheConfig(max_seqs=8, max_seq_len=1024, device=DEV, num_blocks=64, block_size=16, kv_scales=scales),
        )
    else:
        make_one = lambda: make(kind, torch.float32, layers=layers, heads=heads, dim=dim, max_len=1024,  # noqa: E731
                                kv_dtype=kv_dtype, kv_scales=scales)  # fmt: skip
    scattered, written = make_one(), make_one()
    seqs, wseqs = [scattered.allocate() for _ in lengths], [written.allocate() for _ in lengths]
    for s, w, n in zip(seqs, wseqs, lengths):
        scattered.extend(s, n)
        written.extend(w, n)
    for layer in range(layers):
        for s, w, n in zip(seqs, wseqs, lengths):
            k = torch.randn(n, heads, dim, device=DEV, generator=gen)
            v = torch.randn(n, heads, dim, device=DEV, generator=gen)
            written.write(layer, w, k, v)
            if kind == "paged":  # the block-table cache has no scatter entry: write() stores its bytes
                scattered.write(layer, s, k, v)
                continue
            rows = torch.zeros(n, dtype=torch.int32, device=DEV)
            ops.write_kv(k, v, scattered.batch(layer, [s]), rows, torch.arange(n, dtype=torch.int32, device=DEV))
    torch.cuda.synchronize()
    for layer in range(layers):
        for s, w in zip(seqs, wseqs):
            for a, b in zip(scattered.dequantized_kv(layer, s), written.dequantized_kv(layer, w)):
                assert torch.equal(a, b), "the CUDA scatter stored other bytes than write()"
    kvs = [scattered.dequantized_kv(1, s) for s in seqs]
    for group in (1, 4):
        q = torch.randn(len(seqs), heads * group, dim, device=DEV, generator=gen)
        out = ops.decode_attention(q, scattered, seqs, 1)
        torch.cuda.synchronize()
        assert out.is_cuda and torch.isfinite(out).all()
        ref = torch.stack(
            [
                F.scaled_dot_product_attention(
                    q[i].double()[:, None], *(t.double().transpose(0, 1) for t in kv), enable_gqa=True
                )[:, 0]
                for i, kv in enumerate(kvs)
            ]
        )
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    scattered.close()
    written.close()


def test_reclaim_during_a_real_graph_capture_skips_unmapping(gen):
    """Pool reclaim inside torch.cuda.graph: the pages another cache keeps for reuse would have to be
    unmapped, which waits for the caches' streams (one of them captures). The allocation gets
    OutOfPagesError with nothing changed, the capture stays valid (the graph replays), and after the
    capture the same allocation reclaims and succeeds."""
    first = make("per_layer", torch.float32, pages=8, layers=1, dim=128, max_len=8192)
    second = vpaged.VirtualKVCache(
        KVGeometry(1, 2, 128, torch.float32),
        VirtualCacheConfig(max_seqs=2, max_seq_len=8192, device=DEV),
        pool=first.pool,
    )
    page_tokens = GRAN // (2 * 128 * 4)
    seqs = [first.allocate() for _ in range(4)]
    first.extend_many(seqs, page_tokens)  # 4 sequences x 2 regions x 1 page: the whole pool
    for s in seqs:
        first.free(s)
    dormant = first.stats().dormant_pages
    seq = second.allocate()
    x = torch.randn(1 << 16, device=DEV, generator=gen)
    side = torch.cuda.Stream(DEV)
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        y = x * 2.0 + 1.0
        with pytest.raises(vpaged.OutOfPagesError):
            second.extend(seq, page_tokens)
    assert second.seq_len(seq) == 0 and first.stats().dormant_pages == dormant
    x.copy_(torch.randn(1 << 16, device=DEV, generator=gen))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, x * 2.0 + 1.0), "the capture was broken"
    second.extend(seq, page_tokens)
    assert second.seq_len(seq) == page_tokens and first.stats().dormant_pages < dormant
    second.close()
    first.close()


# ---- the vLLM plugin's KV buffer (vpaged.integrations.vllm.backing) on a CUDA range; vLLM itself is not needed
def test_vllm_plugin_blocks_on_a_gpu_keep_their_data_while_held():
    """The CUDA path: the tensor vLLM gets over a CUDA range, blocks mapped and released at random, data
    written and read through torch on the device (tests/integrations/test_vllm_plugin_fake.py checks the
    same bookkeeping without a GPU)."""
    rng = random.Random()
    seed = rng.randrange(2**32)
    rng.seed(seed)
    pool = make_pool(1, "cuda")  # one page, to learn the device's page size
    page = pool.page_size
    del pool
    blocks, layers, block_bytes = rng.randint(16, 48), rng.randint(1, 3), rng.choice([page // 4, page, page + 4096])
    geom = BlockGeometry(0, block_bytes * blocks, block_bytes, block_bytes, layers, blocks)
    nbytes = layers * blocks * block_bytes
    backing = KVBacking(nbytes, [geom], make_pool(nbytes, "cuda"), "cuda")
    t = backing.tensor
    assert t.is_cuda and t.numel() == nbytes
    held: dict[int, int] = {}
    for _ in range(30):
        if rng.random() < 0.6 or not held:
            new = rng.sample(range(blocks), rng.randint(1, 4))
            backing.map_blocks(new)
            for b in new:
                if b not in held:
                    held[b] = rng.randint(1, 100)
                    for start, end in geom.spans(b):
                        t[start:end] = held[b]
        else:
            gone = rng.sample(sorted(held), rng.randint(1, len(held)))
            backing.release_blocks(gone)  # waits for the current stream before unmapping
            for b in gone:
                del held[b]
        assert backing.stats().mapped_bytes == len(_reference_pages([geom], held, page)) * page, seed
        for b, value in held.items():
            for start, end in geom.spans(b):
                assert bool(torch.all(t[start:end] == value)), seed
    backing.release_blocks(range(blocks))
    torch.cuda.synchronize()
    assert backing.stats().mapped_bytes == 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_prefix_store_hits_copy_into_device_pages_bit_exact(layout, gen):
    """On CUDA the store is host memory: a cache publishes its full blocks (a device-to-host copy per page) and
    another cache's hit copies them into device pages of its own, bit for bit."""
    import uuid

    from vpaged.memory.store import PageStore

    name = f"test-cuda-{uuid.uuid4().hex[:10]}"
    store = dict(prefix_store=name, prefix_store_weights="model@1", prefix_store_pages=64)
    try:
        a = make(layout, **store)
        tokens = torch.randint(0, 50_000, (9000,)).tolist()
        seq = a.allocate(tokens=tokens)
        fill(a, seq, len(tokens), gen)
        cached = a.cache_prefix(seq, tokens)
        before = clones(a, seq)
        assert cached > 0 and a.prefix_store.stats.published_pages > 0
        a.close()
        b = make(layout, **store)
        got = b.allocate(tokens=tokens)
        assert b.seq_len(got) == cached
        for layer, (k, v) in enumerate(before):
            kb, vb = b.kv(layer, got)
            assert torch.equal(kb, k[:cached]) and torch.equal(vb, v[:cached])
        s = b.prefix_store.stats
        assert s.mapped_bytes == 0 and s.copied_bytes == s.hit_pages * b.pool.page_size > 0
        b.close()
    finally:
        PageStore.remove(name)
