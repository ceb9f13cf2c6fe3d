"""Keys and values of different head sizes (v_head_dim != head_dim, as in multi-head latent attention) in
VirtualKVCache (every layout), PagedKVCache, their memory accounting and the decode kernels."""

import dataclasses

import pytest
import torch

from vpaged import KVGeometry, PagedCacheConfig, PagedKVCache, VirtualCacheConfig, VirtualKVCache
from vpaged.errors import InvalidArgumentError, ShapeError
from vpaged.kvcache.records import BatchedKV

LAYOUTS = ["per_layer", "interleaved", "head_major"]
DIMS = [(24, 8), (8, 24)]  # K larger than V (DeepSeek), and the other way round


def _vcache(layout, dk, dv, dtype=torch.float32, **kw):
    kw.setdefault("max_seqs", 4)
    kw.setdefault("max_seq_len", 64)
    return VirtualKVCache(
        KVGeometry(2, 2, dk, dtype, v_head_dim=dv),
        VirtualCacheConfig(layout=layout, capacity_bytes=4 << 20, page_size=4096, **kw),
    )


@pytest.mark.parametrize("dk,dv", DIMS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_write_and_read_back(layout, dk, dv, rng):
    with _vcache(layout, dk, dv) as c:
        seqs = c.allocate_many(3)
        want = {}
        for n, seq in zip((5, 40, 17), seqs):
            c.extend(seq, n)
            for layer in range(2):
                k = torch.randn(n, 2, dk, generator=rng)
                v = torch.randn(n, 2, dv, generator=rng)
                c.write(layer, seq, k, v)
                want[layer, seq] = (k, v)
        for (layer, seq), (k, v) in want.items():
            gk, gv = c.kv(layer, seq)
            assert gk.shape == k.shape and gv.shape == v.shape
            assert torch.equal(gk, k) and torch.equal(gv, v)
        # Batched views: the shortest length of the three.
        bk, bv = c.kv_batch(1, seqs, 5)
        assert list(bk.shape) == [3, 5, 2, dk] and list(bv.shape) == [3, 5, 2, dv]
        for i, seq in enumerate(seqs):
            assert torch.equal(bv[i], want[1, seq][1][:5])
        # A write with V of K's size is refused, nothing changed.
        c.extend(seqs[0], 1)
        with pytest.raises(ShapeError):
            c.write(0, seqs[0], torch.randn(1, 2, dk), torch.randn(1, 2, dk))
        assert torch.equal(c.kv(0, seqs[0])[1][:5], want[0, seqs[0]][1])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_memory_counts_both_head_sizes(layout):
    dk, dv = 24, 8
    with _vcache(layout, dk, dv) as c:
        assert c.bytes_per_token == 2 * 2 * (dk + dv) * 4
        assert c.static_bytes(1) == 64 * c.bytes_per_token
        seq = c.allocate()
        c.extend(seq, 30)
        s = c.stats()
        assert s.live_bytes == 30 * c.bytes_per_token
        # Every mapped byte is accounted for once: stored K/V, or fragmentation (partly filled pages, and in
        # per_layer / head_major the unused part of V's rows, which are sized for K).
        assert s.stored_bytes == s.live_bytes
        assert s.stored_bytes + s.fragmentation_bytes == s.mapped_bytes


@pytest.mark.parametrize("layout", LAYOUTS)
def test_beam_reorder_and_fork_keep_values(layout, rng):
    with _vcache(layout, 24, 8) as c:
        a, b = c.allocate_many(2)
        c.extend_many([a, b], 20)
        vals = {}
        for seq in (a, b):
            v = torch.randn(20, 2, 8, generator=rng)
            c.write(0, seq, torch.randn(20, 2, 24, generator=rng), v)
            vals[seq] = v
        c.reorder([a, b], [1, 1])
        c.extend_many([a, b], 1)
        c.write(0, a, torch.zeros(1, 2, 24), torch.zeros(1, 2, 8))
        assert torch.equal(c.kv(0, a)[1][:20], vals[b]) and torch.equal(c.kv(0, b)[1][:20], vals[b])
        child = c.fork(b)
        assert torch.equal(c.kv(0, child)[1][:20], vals[b])


def test_kv_layers_refuses_mixed_head_sizes():
    with _vcache("per_layer", 24, 8) as c:
        seq = c.allocate()
        c.extend(seq, 3)
        with pytest.raises(InvalidArgumentError):
            c.kv_layers(seq)


@pytest.mark.parametrize("dk,dv", DIMS)
def test_paged_cache_write_read_fork(dk, dv, rng):
    with PagedKVCache(
        KVGeometry(2, 2, dk, torch.float32, v_head_dim=dv), PagedCacheConfig(num_blocks=16, block_size=8)
    ) as c:
        assert c.bytes_per_token == 2 * 2 * (dk + dv) * 4
        seq = c.allocate()
        c.extend(seq, 13)
        k, v = torch.randn(13, 2, dk, generator=rng), torch.randn(13, 2, dv, generator=rng)
        c.write(1, seq, k, v)
        gk, gv = c.kv(1, seq)
        assert torch.equal(gk, k) and torch.equal(gv, v)
        child = c.fork(seq)
        c.write(1, child, torch.zeros(1, 2, dk), torch.zeros(1, 2, dv), start=12)  # copy-on-write
        assert torch.equal(c.kv(1, seq)[1], v)
        assert torch.equal(c.kv(1, child)[1][:12], v[:12])
        assert c.stats().live_bytes == (8 + 5 + 5) * c.bytes_per_token  # shared block once, the copied one apart
        with pytest.raises(ShapeError):
            c.write(1, seq, k, torch.randn(13, 2, dk))


# ------------------------------------------------------------------------------------------ decode kernels
def _kernels_take_value_head_dim() -> bool:
    return "v_head_dim" in {f.name for f in dataclasses.fields(BatchedKV)}


kernels = pytest.mark.skipif(
    not _kernels_take_value_head_dim(), reason="the decode kernels of this build take K and V of one head size only"
)


def _reference(q, cache, seqs, layer):
    """float64 attention of q [B, heads, dk] over each sequence's K/V (GQA), scale 1/sqrt(dk)."""
    out = []
    for i, seq in enumerate(seqs):
        k, v = (t.double() for t in cache.kv(layer, seq))  # [T, kv_heads, d]
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("hd,thd->ht", q[i].double(), k) / q.shape[2] ** 0.5
        out.append(torch.einsum("ht,thd->hd", scores.softmax(-1), v))
    return torch.stack(out)


@kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", LAYOUTS + ["paged"])
def test_decode_kernels_match_float64_reference(layout, dtype, rng):
    from vpaged.ops import decode_attention

    dk, dv, heads = 24, 8, 4  # 2 kv heads: GQA
    if layout == "paged":
        cache = PagedKVCache(KVGeometry(2, 2, dk, dtype, v_head_dim=dv), PagedCacheConfig(num_blocks=32, block_size=8))
        seqs = [cache.allocate() for _ in range(3)]
    else:
        cache = _vcache(layout, dk, dv, dtype=dtype)
        seqs = cache.allocate_many(3)
    with cache:
        for n, seq in zip((1, 37, 20), seqs):
            cache.extend(seq, n)
            for layer in range(2):
                cache.write(
                    layer,
                    seq,
                    torch.randn(n, 2, dk, generator=rng).to(dtype),
                    torch.randn(n, 2, dv, generator=rng).to(dtype),
                )
        q = torch.randn(3, heads, dk, generator=rng).to(dtype)
        got = decode_attention(q, cache, seqs, 1)
        assert list(got.shape) == [3, heads, dv]
        want = _reference(q, cache, seqs, 1)
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
