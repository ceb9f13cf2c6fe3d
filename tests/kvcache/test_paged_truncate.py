"""PagedKVCache.truncate: the tokens kept read back unchanged, blocks past the new length go back to the pool
(unless a fork still shares them), and the sequence grows again from its new length."""

import pytest
import torch

from vpaged import KVGeometry, PagedCacheConfig
from vpaged.errors import InvalidArgumentError, UnknownSequenceError
from vpaged.kvcache.paged import PagedKVCache

BS = 8


def cache(num_blocks=16):
    return PagedKVCache(
        KVGeometry(2, 2, 4, torch.float32),
        PagedCacheConfig(max_seqs=4, max_seq_len=64, num_blocks=num_blocks, block_size=BS),
    )


def filled(c, n, seed=0):
    """A sequence of n tokens with random K/V in every layer; returns (id, [(k, v) per layer])."""
    g = torch.Generator().manual_seed(seed)
    seq = c.allocate()
    c.extend(seq, n)
    data = []
    for layer in range(c.num_layers):
        k, v = torch.randn(n, 2, 4, generator=g), torch.randn(n, 2, 4, generator=g)
        c.write(layer, seq, k, v)
        data.append((k, v))
    return seq, data


@pytest.mark.parametrize("new_len", [0, 1, 7, 8, 9, 16, 20, 21])
def test_truncate_keeps_the_first_tokens_and_frees_the_blocks_past_them(new_len):
    c = cache()
    seq, data = filled(c, 21)  # 3 blocks of 8
    assert c.pages_available() == 16 - 3
    c.truncate(seq, new_len)
    keep = -(-new_len // BS)
    assert c.seq_len(seq) == new_len
    assert len(c.blocks(seq)) == keep
    assert c.pages_available() == 16 - keep
    assert c.stats().used_blocks == keep and c.stats().live_tokens == new_len
    for layer, (k, v) in enumerate(data):
        got_k, got_v = c.kv(layer, seq)
        assert torch.equal(got_k, k[:new_len]) and torch.equal(got_v, v[:new_len])


def test_a_truncated_sequence_grows_again_and_new_writes_land_after_the_kept_tokens():
    c = cache()
    seq, data = filled(c, 20)
    c.truncate(seq, 10)
    c.extend(seq, 5)
    assert c.seq_len(seq) == 15 and len(c.blocks(seq)) == 2 and c.pages_available() == 14
    k, v = torch.full((5, 2, 4), 7.0), torch.full((5, 2, 4), -7.0)
    c.write(0, seq, k, v)
    got_k, got_v = c.kv(0, seq)
    assert torch.equal(got_k[:10], data[0][0][:10]) and torch.equal(got_k[10:], k)
    assert torch.equal(got_v[:10], data[0][1][:10]) and torch.equal(got_v[10:], v)


def test_truncating_a_fork_keeps_the_blocks_the_parent_still_holds():
    c = cache()
    parent, data = filled(c, 24)  # 3 full blocks
    child = c.fork(parent)
    assert c.pages_available() == 13
    c.truncate(child, 12)  # keeps 2 blocks, both still shared; the third stays the parent's
    assert c.pages_available() == 13
    assert [c.block_refcount(b) for b in c.blocks(parent)] == [2, 2, 1]
    c.extend(child, 1)  # into the shared, partly kept second block: copied first
    assert c.blocks(child)[1] != c.blocks(parent)[1] and c.pages_available() == 12
    for layer, (k, _v) in enumerate(data):
        assert torch.equal(c.kv(layer, parent)[0], k)
        assert torch.equal(c.kv(layer, child)[0][:12], k[:12])
    c.free(parent)
    assert c.pages_available() == 14  # the child's two blocks remain
    c.free(child)
    assert c.pages_available() == 16


@pytest.mark.parametrize("bad", [-1, 22, 1.5, True, None])
def test_truncate_refuses_lengths_outside_the_sequence(bad):
    c = cache()
    seq, _ = filled(c, 21)
    with pytest.raises(InvalidArgumentError):
        c.truncate(seq, bad)
    assert c.seq_len(seq) == 21 and len(c.blocks(seq)) == 3


def test_truncate_of_a_freed_sequence_raises():
    c = cache()
    seq, _ = filled(c, 3)
    c.free(seq)
    with pytest.raises(UnknownSequenceError):
        c.truncate(seq, 0)
