"""A prefill chunk after a cached prefix (stores/attention.py, prefix_then_causal): its queries at positions start..
attend over every cached key (a K/V head's query heads in one call) and causally over the chunk's own, by two
unmasked calls of SDPA's fused CPU kernel merged by their log-sum-exps. Checked against attention written from the
definition in float64 (softmax of q.k over the keys at or before each query's position, times V), for chunks of one
token and of many, short and long prefixes, fp32 and bf16, one K/V head per query head and grouped ones; and the
step's attend() gives the same answer for a chunk with or without the split."""

import math

import pytest
import torch

from vpaged.serve.stores.attention import FLASH_CPU, StepAttention, chunk_mask, heads_first, prefix_then_causal

pytestmark = pytest.mark.skipif(FLASH_CPU is None, reason="this torch has no fused CPU SDPA op to call directly")


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """q [1, H, n, D], k/v [1, H, start + n, D] -> [1, H, n, D] in float64: query i sees keys 0..start + i."""
    q, k, v = q.double(), k.double(), v.double()
    n, total = q.shape[2], k.shape[2]
    scores = (q @ k.transpose(-1, -2)) * scale
    visible = torch.arange(total)[None, :] <= torch.arange(start, start + n)[:, None]
    return scores.masked_fill(~visible, -math.inf).softmax(dim=-1) @ v


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("start,n", [(1, 1), (7, 1), (1, 9), (40, 3), (257, 64), (100, 300)])
@pytest.mark.parametrize("heads,kv_heads", [(6, 6), (6, 2), (9, 3)])
def test_the_split_chunk_matches_the_definition(rng, dtype, tol, start, n, heads, kv_heads):
    dim = 32
    q = torch.randn(1, heads, n, dim, generator=rng).to(dtype)
    k = (torch.randn(start + n, kv_heads, dim, generator=rng) * 2).to(dtype)
    v = torch.randn(start + n, kv_heads, dim, generator=rng).to(dtype)
    scale = 1 / math.sqrt(dim)
    got = prefix_then_causal(q, k, v, start, scale)
    assert got.dtype == dtype and got.shape == q.shape
    want = reference(q, heads_first(k, heads), heads_first(v, heads), start, scale)
    err = (got.double() - want).abs().max().item()
    assert err <= tol, f"max error {err} against the float64 definition"


class _Chunk(StepAttention):
    """One prefill chunk over K/V given up front: the store's hooks reduced to returning them."""

    def __init__(self, k, v, start, n):
        super().__init__(0, [(0, start, n)], n)
        self.k, self.v = k, v

    def write(self, layer, k, v):
        pass

    def decode(self, layer, q, scale, out):
        raise AssertionError("no decode rows")

    def prefill_kv(self, layer, i):
        return self.k, self.v


@pytest.mark.parametrize("start,n", [(0, 17), (33, 1), (33, 20)])
def test_attend_gives_the_same_chunk_split_or_masked(rng, start, n):
    heads, kv_heads, dim = 8, 2, 16  # grouped query heads, as the models have them
    k = torch.randn(start + n, kv_heads, dim, generator=rng)
    v = torch.randn(start + n, kv_heads, dim, generator=rng)
    query = torch.randn(1, heads, n, dim, generator=rng)
    step = _Chunk(k, v, start, n)
    assert step.split_chunks
    own_k, own_v = k[start:].transpose(0, 1).unsqueeze(0), v[start:].transpose(0, 1).unsqueeze(0)  # [1, KVH, n, D]
    split = step.attend(0, query, own_k, own_v, 0.25)[0]  # [n, H, D]
    want = reference(query, heads_first(k, heads), heads_first(v, heads), start, 0.25)[0].transpose(0, 1)
    assert (split.double() - want).abs().max().item() <= 2e-5
    step.split_chunks = False  # the masked call, as on a torch without the op
    step.causal_masks = [chunk_mask(start, n, None)]
    masked = step.attend(0, query, own_k, own_v, 0.25)[0]
    assert (masked.double() - want).abs().max().item() <= 2e-5
