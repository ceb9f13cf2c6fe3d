"""PagedKVCache: lifecycle, block accounting, copy-on-write after fork, all-or-nothing errors."""

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from vpaged import KVGeometry, PagedCacheConfig, PagedKVCache
from vpaged.errors import (
    DTypeError,
    InvalidArgumentError,
    LayerIndexError,
    OutOfPagesError,
    SequenceTooLongError,
    ShapeError,
    SlotsExhaustedError,
    UnknownSequenceError,
)

L, HKV, D = 2, 2, 8


def make(num_blocks=16, block_size=8, max_seqs=4, max_seq_len=64, dtype=torch.float32):
    return PagedKVCache(
        KVGeometry(L, HKV, D, dtype),
        PagedCacheConfig(max_seqs=max_seqs, max_seq_len=max_seq_len, num_blocks=num_blocks, block_size=block_size),
    )


def rand_kv(n, dtype=torch.float32):
    return torch.randn(n, HKV, D).to(dtype), torch.randn(n, HKV, D).to(dtype)


def snapshot(cache):
    """Everything an all-or-nothing call must leave unchanged."""
    seqs = cache.sequences
    data = {(layer, s): cache.kv(layer, s) for layer in range(cache.num_layers) for s in seqs}
    return (
        seqs,
        {s: cache.blocks(s) for s in seqs},
        {s: cache.seq_len(s) for s in seqs},
        cache.stats(),
        {k: (a.clone(), b.clone()) for k, (a, b) in data.items()},
    )


def bits(t):
    """Bytes of a tensor: rows never written hold arbitrary bits, NaN included, which torch.equal rejects."""
    return t.contiguous().view(torch.uint8)


def assert_same(a, b):
    assert a[:4] == b[:4]
    for key in a[4]:
        assert torch.equal(bits(a[4][key][0]), bits(b[4][key][0]))
        assert torch.equal(bits(a[4][key][1]), bits(b[4][key][1]))


def test_construction_and_geometry():
    c = make(num_blocks=10, block_size=16)
    assert c.key_caches[0].shape == (10, 16, HKV, D) and len(c.value_caches) == L
    assert c.bytes_per_token == 2 * L * HKV * D * 4 and c.block_bytes == 16 * c.bytes_per_token
    assert c.max_blocks_per_seq == 4
    by_bytes = PagedKVCache(
        KVGeometry(L, HKV, D, torch.float32),
        PagedCacheConfig(max_seqs=4, max_seq_len=64, capacity_bytes=3 * c.block_bytes + 5, block_size=16),
    )
    assert by_bytes.num_blocks == 3
    s = c.stats()
    assert (s.used_blocks, s.free_blocks, s.pool_bytes, s.utilization) == (0, 10, 10 * c.block_bytes, 1.0)


@pytest.mark.parametrize(
    "kwargs, error",
    [
        (dict(block_size=12, num_blocks=4), InvalidArgumentError),
        (dict(block_size=16), InvalidArgumentError),  # neither num_blocks nor capacity_bytes
        (dict(block_size=16, num_blocks=4, capacity_bytes=1 << 20), InvalidArgumentError),
        (dict(block_size=16, capacity_bytes=10), InvalidArgumentError),  # less than one block
        (dict(block_size=16, num_blocks=4, dtype=torch.int32), DTypeError),
    ],
)
def test_construction_errors(kwargs, error):
    dtype = kwargs.pop("dtype", torch.float32)
    with pytest.raises(error):
        PagedKVCache(KVGeometry(L, HKV, D, dtype), PagedCacheConfig(max_seqs=4, max_seq_len=64, **kwargs))


def test_lifecycle_blocks_and_stats():
    c = make(num_blocks=16, block_size=8)
    a, b = c.allocate(), c.allocate()
    c.extend(a, 13)  # 2 blocks, the second 5/8 full
    c.extend(b, 8)  # exactly 1 block
    assert (c.seq_len(a), len(c.blocks(a)), len(c.blocks(b))) == (13, 2, 1)
    c.extend(a, 3)  # fills the second block: no new block
    assert len(c.blocks(a)) == 2
    c.extend(a, 1)
    assert len(c.blocks(a)) == 3
    s = c.stats()
    assert (s.used_blocks, s.free_blocks, s.sequences, s.live_tokens, s.stored_tokens) == (4, 12, 2, 25, 25)
    assert s.allocated_bytes == 4 * c.block_bytes and s.live_bytes == 25 * c.bytes_per_token
    assert s.utilization == pytest.approx(25 / 32)
    bt = c.block_tables([b, a])
    assert bt.dtype == torch.int32 and bt.shape == (2, c.max_blocks_per_seq)
    assert bt[1, :3].tolist() == c.blocks(a) and bt[0, 1:].tolist() == [0] * (c.max_blocks_per_seq - 1)
    assert c.block_tables([a], width=3).shape == (1, 3)
    with pytest.raises(InvalidArgumentError):
        c.block_tables([a], width=2)
    assert c.lengths([a, b]).tolist() == [17, 8]
    c.free(a)
    assert c.stats().used_blocks == 1 and c.sequences == [b]
    with pytest.raises(UnknownSequenceError, match="freed"):
        c.seq_len(a)
    with pytest.raises(UnknownSequenceError):
        c.extend(12345, 1)


def test_write_and_kv_roundtrip():
    c = make(block_size=8)
    s = c.allocate()
    k, v = rand_kv(11)
    c.extend(s, 11)
    c.write(1, s, k, v)
    k2, v2 = c.kv(1, s)
    assert torch.equal(k2, k) and torch.equal(v2, v)
    k3, v3 = rand_kv(3)
    c.write(1, s, k3, v3, start=6)  # across the block boundary
    k[6:9], v[6:9] = k3, v3
    assert torch.equal(c.kv(1, s)[0], k) and torch.equal(c.kv(1, s)[1], v)
    # the block pool holds the rows where the block table says
    blk = c.blocks(s)[1]
    assert torch.equal(c.key_caches[1][blk, :3], k[8:11])
    # a decode step for two sequences at once
    t = c.allocate()
    c.extend(t, 5)
    c.extend_many([s, t], 1)
    kn, vn = rand_kv(2)
    c.write_many(0, [s, t], kn, vn)
    assert torch.equal(c.kv(0, s)[0][-1], kn[0]) and torch.equal(c.kv(0, t)[1][-1], vn[1])


def test_write_errors():
    c = make()
    s = c.allocate()
    c.extend(s, 4)
    k, v = rand_kv(4)
    with pytest.raises(LayerIndexError):
        c.write(L, s, k, v)
    with pytest.raises(DTypeError):
        c.write(0, s, k.double(), v.double())
    with pytest.raises(ShapeError):
        c.write(0, s, k[:, :1], v[:, :1])
    with pytest.raises(ShapeError):
        c.write(0, s, k, v[:3])
    with pytest.raises(InvalidArgumentError):
        c.write(0, s, *rand_kv(5))
    with pytest.raises(InvalidArgumentError):
        c.write(0, s, k[:2], v[:2], start=3)
    with pytest.raises(ShapeError):
        c.write_many(0, [s], *rand_kv(2))


def test_too_long_and_slots_exhausted():
    c = make(max_seqs=2, max_seq_len=20, num_blocks=16)
    a = c.allocate()
    c.extend(a, 20)
    with pytest.raises(SequenceTooLongError):
        c.extend(a, 1)
    c.allocate()
    with pytest.raises(SlotsExhaustedError):
        c.allocate()
    with pytest.raises(SlotsExhaustedError):
        c.fork(a)
    with pytest.raises(InvalidArgumentError):
        c.extend(a, -1)


def test_fork_copy_on_write():
    c = make(num_blocks=16, block_size=8)
    p = c.allocate()
    c.extend(p, 12)  # block 0 full, block 1 half full
    k, v = rand_kv(12)
    for layer in range(L):
        c.write(layer, p, k, v)
    child = c.fork(p)
    assert c.blocks(child) == c.blocks(p) and all(c.block_refcount(b) == 2 for b in c.blocks(p))
    s = c.stats()
    assert (s.used_blocks, s.shared_blocks, s.live_tokens, s.stored_tokens) == (2, 2, 24, 12)

    # The child extends into the shared half-full block: it gets a private copy first.
    c.extend(child, 2)
    assert c.blocks(child)[0] == c.blocks(p)[0] and c.blocks(child)[1] != c.blocks(p)[1]
    assert c.stats().cow_copies == 1
    kc, vc = rand_kv(2)
    c.write(0, child, kc, vc)
    assert torch.equal(c.kv(0, p)[0], k) and torch.equal(c.kv(0, p)[1], v)  # parent unchanged
    assert torch.equal(c.kv(0, child)[0][:12], k) and torch.equal(c.kv(0, child)[0][12:], kc)
    assert torch.equal(c.kv(1, child)[1][:12], v)  # the copy covers every layer

    # A write over tokens of the still shared full block copies it too, for the writer only.
    k0, v0 = rand_kv(1)
    c.write(1, p, k0, v0, start=3)
    assert c.blocks(p)[0] != c.blocks(child)[0] and c.stats().cow_copies == 2
    assert torch.equal(c.kv(1, child)[0][3], k[3]) and torch.equal(c.kv(1, p)[0][3], k0[0])

    # Extending at a block boundary needs no copy.
    q = c.fork(child)  # 14 tokens
    c.extend(q, 2)  # fills the shared block 1 of child/q: copy
    c.extend(q, 1)  # new block
    assert c.stats().cow_copies == 3

    # Blocks return to the free list only when the last sequence holding them is freed.
    used = c.stats().used_blocks
    c.free(child)
    c.free(q)
    c.free(p)
    assert used > 0 and c.stats().used_blocks == 0 and c.stats().free_blocks == 16


def test_out_of_blocks_changes_nothing():
    c = make(num_blocks=5, block_size=8)
    a, b = c.allocate(), c.allocate()
    c.extend(a, 12)
    c.write(0, a, *rand_kv(12))
    c.extend(b, 9)  # 4 of 5 blocks used
    before = snapshot(c)
    with pytest.raises(OutOfPagesError, match="nothing was changed"):
        c.extend(a, 20)
    assert_same(before, snapshot(c))
    with pytest.raises(OutOfPagesError):
        c.extend_many([a, b], 8)  # a would fit alone; all or nothing
    assert_same(before, snapshot(c))
    # copy-on-write needs a block as well: none left after the fork fills the pool
    child = c.fork(a)
    c.free(b)
    c.extend(child, 4)  # copies the half-full block: uses the 3rd block
    c.extend(a, 4)  # a's block 1 is private again (refcount 1): no copy, no new block
    fill = c.allocate()
    c.extend(fill, 16)  # takes the last two free blocks
    before = snapshot(c)
    with pytest.raises(OutOfPagesError):
        c.write(0, a, *rand_kv(1), start=0)  # block 0 still shared with child
    assert_same(before, snapshot(c))


class PagedCacheMachine(RuleBasedStateMachine):
    """Random allocate / extend / write / fork / free against a model that keeps each sequence's tokens
    (a model token is a random id; the cache stores it as the K row's first element)."""

    @initialize(block_size=st.sampled_from([8, 16]), num_blocks=st.integers(2, 12))
    def setup(self, block_size, num_blocks):
        self.cache = PagedKVCache(
            KVGeometry(1, 1, 2, torch.float32),
            PagedCacheConfig(max_seqs=4, max_seq_len=48, num_blocks=num_blocks, block_size=block_size),
        )
        self.model: dict[int, list[float]] = {}

    def _write(self, seq, start, values):
        k = torch.tensor(values, dtype=torch.float32).reshape(-1, 1, 1).expand(-1, 1, 2).contiguous()
        self.cache.write(0, seq, k, -k, start=start)
        self.model[seq][start : start + len(values)] = values

    @rule()
    def allocate(self):
        if len(self.model) < 4:
            self.model[self.cache.allocate()] = []

    @precondition(lambda self: self.model)
    @rule(data=st.data(), n=st.integers(0, 20))
    def extend(self, data, n):
        seq = data.draw(st.sampled_from(sorted(self.model)))
        before = snapshot(self.cache)
        try:
            self.cache.extend(seq, n)
        except (OutOfPagesError, SequenceTooLongError):
            assert_same(before, snapshot(self.cache))
            return
        start = len(self.model[seq])
        self.model[seq] += [0.0] * n
        if n:
            self._write(seq, start, [float(x) for x in torch.randint(1, 1000, (n,)).tolist()])

    @precondition(lambda self: any(self.model.values()))
    @rule(data=st.data())
    def overwrite(self, data):
        seq = data.draw(st.sampled_from([s for s, t in sorted(self.model.items()) if t]))
        pos = data.draw(st.integers(0, len(self.model[seq]) - 1))
        before = snapshot(self.cache)
        try:
            self._write(seq, pos, [float(torch.randint(1, 1000, ()).item())])
        except OutOfPagesError:
            assert_same(before, snapshot(self.cache))

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def fork(self, data):
        if len(self.model) < 4:
            seq = data.draw(st.sampled_from(sorted(self.model)))
            self.model[self.cache.fork(seq)] = list(self.model[seq])

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.model)))
        self.cache.free(seq)
        del self.model[seq]

    @invariant()
    def contents_match(self):
        for seq, tokens in self.model.items():
            k, v = self.cache.kv(0, seq)
            assert k[:, 0, 0].tolist() == tokens and (-v[:, 0, 1]).tolist() == tokens

    @invariant()
    def blocks_are_counted(self):
        c = self.cache
        refs = {}
        for seq in self.model:
            assert len(c.blocks(seq)) == -(-c.seq_len(seq) // c.block_size)
            for b in c.blocks(seq):
                refs[b] = refs.get(b, 0) + 1
        assert all(c.block_refcount(b) == n for b, n in refs.items())
        s = c.stats()
        assert s.used_blocks == len(refs) and s.free_blocks == c.num_blocks - len(refs)
        assert 0 < s.utilization <= 1.0


TestPagedCacheMachine = PagedCacheMachine.TestCase
TestPagedCacheMachine.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)


@pytest.mark.parametrize("kind", ["virtual", "paged"])
def test_a_cache_is_built_from_a_geometry_and_its_config_record(kind):
    import dataclasses
    import random

    from vpaged import KVGeometry, VirtualCacheConfig, VirtualKVCache
    from vpaged.errors import InvalidArgumentError

    rng = random.Random()
    layers, heads, dim = rng.randint(1, 4), rng.randint(1, 4), 4 * rng.randint(2, 8)
    make, record = (VirtualKVCache, VirtualCacheConfig) if kind == "virtual" else (PagedKVCache, PagedCacheConfig)
    size = dict(capacity_bytes=1 << 20) if kind == "virtual" else dict(num_blocks=4)
    geometry = KVGeometry(layers, heads, dim, torch.float32, kv_dtype="int8")
    config = record(max_seqs=2, max_seq_len=64, **size)
    with make(geometry, config) as c:
        assert c.geometry is geometry and c.config is config  # carried, not rebuilt
        assert (c.num_layers, c.num_kv_heads, c.head_dim, c.kv_dtype) == (layers, heads, dim, torch.int8)
        assert (c.max_seqs, c.max_seq_len) == (2, 64)
        assert c.bytes_per_token == geometry.bytes_per_token
    # The loose form of earlier releases is refused with the call that replaces it, building nothing.
    with pytest.raises(InvalidArgumentError, match=r"KVGeometry\(num_layers, num_kv_heads, head_dim, dtype\)"):
        make(layers, config)
    with pytest.raises(InvalidArgumentError, match="KVGeometry"):
        make((layers, heads, dim), config)
    with pytest.raises(InvalidArgumentError, match=f"config must be a {record.__name__}"):
        make(geometry, dict(max_seqs=2, max_seq_len=64, **size))
    with pytest.raises(TypeError):
        make(layers, heads, dim, torch.float32, config)
    # A record checks its fields when it is made, naming the field.
    with pytest.raises(InvalidArgumentError, match="max_seqs"):
        record(max_seqs=0, **size)
    with pytest.raises(InvalidArgumentError, match="max_seq_len"):
        dataclasses.replace(config, max_seq_len=-1)
