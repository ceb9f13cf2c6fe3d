"""Prefill needs no vpaged kernel: torch SDPA runs on VirtualKVCache.kv() views as on any tensor.

A prompt is prefilled in two parts: the first part alone (plain causal attention), then a continuation
that attends over the cached prefix plus itself. The continuation's mask is causal with an offset: query i
sits at position P + i and sees keys 0..P+i. (SDPA's is_causal aligns the mask to the top-left corner when
queries are fewer than keys, which would hide most of the prefix, so the mask is spelled out.)
"""

import math

import pytest
import torch
import torch.nn.functional as F

from vpaged import KVGeometry, VirtualCacheConfig, VirtualKVCache

LAYERS, HKV, HEADS, D = 2, 2, 8, 64


def dense_causal(q, k, v):
    """float64 causal attention of q, k, v [T, heads, D] (GQA by repeating kv heads)."""
    g = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    t = q.shape[0]
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


def sdpa(q, k, v, mask=None, causal=False):
    """SDPA on [T, heads, D]-shaped tensors (cache views included), result [T, heads, D]."""
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, is_causal=causal, enable_gqa=True
    )
    return o.transpose(0, 1)


@pytest.mark.parametrize("layout", ["per_layer", "interleaved", "head_major"])
@pytest.mark.parametrize("prefix, rest", [(50, 20), (1, 63), (64, 1)])
def test_prefill_with_cached_prefix(layout, prefix, rest):
    total = prefix + rest
    cache = VirtualKVCache(
        KVGeometry(LAYERS, HKV, D, torch.float32),
        VirtualCacheConfig(max_seqs=2, max_seq_len=128, capacity_bytes=16 << 20, layout=layout),
    )
    other = cache.allocate()  # a neighbour, so the sequence under test is not in slot 0
    cache.extend(other, 5)
    seq = cache.allocate()
    q = torch.randn(total, HEADS, D)
    k = torch.randn(LAYERS, total, HKV, D)
    v = torch.randn(LAYERS, total, HKV, D)

    # Part 1: the prefix on its own.
    cache.extend(seq, prefix)
    for layer in range(LAYERS):
        cache.write(layer, seq, k[layer, :prefix], v[layer, :prefix])
        kc, vc = cache.kv(layer, seq)
        out = sdpa(q[:prefix], kc, vc, causal=True)
        torch.testing.assert_close(
            out.double(), dense_causal(q[:prefix], k[layer, :prefix], v[layer, :prefix]), rtol=1e-5, atol=1e-5
        )

    # Part 2: extend, write the new tokens' K/V, attend the new queries over every cached key.
    cache.extend(seq, rest)
    pos_q = torch.arange(prefix, total)[:, None]
    mask = torch.arange(total)[None, :] <= pos_q  # [rest, total], True = may attend
    for layer in range(LAYERS):
        cache.write(layer, seq, k[layer, prefix:], v[layer, prefix:])
        kc, vc = cache.kv(layer, seq)
        assert kc.shape == (total, HKV, D)
        out = sdpa(q[prefix:], kc, vc, mask=mask)
        full = dense_causal(q, k[layer], v[layer])
        torch.testing.assert_close(out.double(), full[prefix:], rtol=1e-5, atol=1e-5)
