"""The per-step decode path of a CPU PagedKVCache (ops.decode_attention -> _C.decode_cpu_tables): prebuilt
per-layer parameters, block tables and lengths handed over as lists and checked in C++.

Against the float64 reference on fresh random K/V (kept independently of the cache, step by step) and
against decode_attention_paged, the tensor API over the same pools, which must give identical numbers.
"""

import gc
import weakref

import pytest
import torch
from test_decode_kernels import DTYPES, HKV, ISAS, build, check, force_isa, poisoned, torch_threads

import vpaged
from vpaged import _C, KVGeometry, PagedCacheConfig, PagedKVCache, VirtualCacheConfig, VirtualKVCache, ops
from vpaged.errors import CacheClosedError, DTypeError, InvalidArgumentError, ShapeError
from vpaged.ops.plans import layer_plan


@pytest.fixture
def calls(monkeypatch):
    """Counts the calls that reach the per-step entry (the tests must exercise it, not the tensor API)."""
    seen = []
    real = _C.decode_cpu_tables

    def spy(*args, **kwargs):
        seen.append(len(args[6]))
        return real(*args, **kwargs)

    monkeypatch.setattr(_C, "decode_cpu_tables", spy)
    return seen


def tensor_api(q, cache, seqs, layer):
    return ops.decode_attention_paged(
        q, cache.key_caches[layer], cache.value_caches[layer], cache.block_tables(seqs), cache.lengths(seqs)
    )


class Mirror:
    """A PagedKVCache with every sequence's K/V per layer also kept as plain tensors (the reference's input)."""

    def __init__(self, cache: PagedKVCache):
        self.cache = cache
        self.kv = {}  # seq -> [[k, v] per layer]

    def new(self) -> int:
        seq = self.cache.allocate()
        c = self.cache
        self.kv[seq] = [
            [
                torch.empty(0, c.num_kv_heads, c.head_dim, dtype=c.dtype),
                torch.empty(0, c.num_kv_heads, c.v_head_dim, dtype=c.dtype),
            ]
            for _ in range(c.num_layers)
        ]
        return seq

    def grow(self, seqs, n: int) -> None:
        """extend_many(seqs, n), then random K/V for the new tokens in every layer."""
        c = self.cache
        c.extend_many(seqs, n)
        for layer in range(c.num_layers):
            for s in seqs:
                k = torch.randn(n, c.num_kv_heads, c.head_dim).to(c.dtype)
                v = torch.randn(n, c.num_kv_heads, c.v_head_dim).to(c.dtype)
                c.write(layer, s, k, v)
                kv = self.kv[s][layer]
                kv[0], kv[1] = torch.cat([kv[0], k]), torch.cat([kv[1], v])

    def fork(self, seq: int) -> int:
        child = self.cache.fork(seq)
        self.kv[child] = [[k.clone(), v.clone()] for k, v in self.kv[seq]]
        return child

    def free(self, seq: int) -> None:
        self.cache.free(seq)
        del self.kv[seq]

    def check(self, seqs, group: int = 2, layers=None) -> None:
        """The per-step path on every layer against the reference and, bit for bit, the tensor API."""
        c = self.cache
        for layer in range(c.num_layers) if layers is None else layers:
            q = torch.randn(len(seqs), c.num_kv_heads * group, c.head_dim).to(c.dtype)
            out = ops.decode_attention(
                q, c, seqs, layer, out=poisoned(q.new_empty(len(seqs), q.shape[1], c.v_head_dim))
            )
            check(out, q, [self.kv[s][layer][0] for s in seqs], [self.kv[s][layer][1] for s in seqs])
            assert torch.equal(out, tensor_api(q, c, seqs, layer))


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_step_path_matches_reference_and_tensor_api(dtype, head_dim, group, block_size, calls):
    cache, seqs, kvs = build(f"paged{block_size}", dtype, head_dim, [1, 37, 300, 129, 17, block_size])
    q = torch.randn(len(seqs), HKV * group, head_dim).to(dtype)
    out = ops.decode_attention(q, cache, seqs, 1, out=poisoned(q))
    check(out, q, *zip(*kvs))
    assert torch.equal(out, tensor_api(q, cache, seqs, 1))
    order = [4, 2, 0]  # another batch order and a subset; default scale, then an explicit one, new output
    sub = [seqs[i] for i in order]
    got = ops.decode_attention(q[order], cache, sub, 1, scale=0.3)
    check(got, q[order], *zip(*[kvs[i] for i in order]), scale=0.3)
    assert calls == [6, 3]


@pytest.mark.parametrize("dims", [(80, 80), (33, 33), (256, 256), (192, 128), (64, 96)], ids=lambda d: f"{d[0]}-{d[1]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_dims_and_value_head_dims(dtype, dims, calls):
    d, dv = dims
    m = Mirror(
        PagedKVCache(
            KVGeometry(2, HKV, d, dtype, v_head_dim=dv),
            PagedCacheConfig(max_seqs=4, max_seq_len=200, num_blocks=40, block_size=16),
        )
    )
    seqs = [m.new() for _ in range(3)]
    m.grow(seqs, 5)
    m.grow(seqs[1:], 130)
    m.check(seqs, group=4)
    assert calls == [3, 3]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("threads", [1, 2])
def test_every_code_path_with_long_split_contexts(isa, threads, monkeypatch):
    """Long contexts through the block tables on each code path: with 2 threads cut into pieces (partial
    results merged), with 1 thread read whole (one thread has nothing to balance)."""
    force_isa(monkeypatch, isa)
    with torch_threads(threads):
        cache, seqs, kvs = build("paged16", torch.bfloat16, 128, [1500, 33, 1, 1023], layers=1)
        q = torch.randn(4, HKV * 4, 128).to(torch.bfloat16)
        out = ops.decode_attention(q, cache, seqs, 0, out=poisoned(q))
        check(out, q, *zip(*kvs))
        assert torch.equal(out, tensor_api(q, cache, seqs, 0))


@pytest.mark.parametrize("dtype", DTYPES)
def test_steps_across_block_boundaries_forks_frees_and_reuse(dtype, calls):
    """A decode loop: one token per step (crossing block boundaries at different steps), forks sharing
    blocks (copy-on-write of a shared last block on the next extend), a sequence freed and its blocks
    reused by a new one; every step checked on every layer."""
    m = Mirror(
        PagedKVCache(
            KVGeometry(2, HKV, 64, dtype), PagedCacheConfig(max_seqs=8, max_seq_len=64, num_blocks=30, block_size=8)
        )
    )
    a, b, c = (m.new() for _ in range(3))
    m.grow([a], 7)
    m.grow([b], 15)
    m.grow([c], 1)
    live = [a, b, c]
    for step in range(12):
        m.grow(live, 1)
        m.check(live)
        if step == 2:
            child = m.fork(a)  # shares a's blocks, including its partly filled last one
            assert m.cache.blocks(child) == m.cache.blocks(a)
            m.check([child, a])
            live.append(child)
        if step == 5:
            freed = set(m.cache.blocks(b))
            m.free(b)
            live.remove(b)
            new = m.new()
            m.grow([new], 20)  # takes (some of) b's blocks, with new data in them
            assert freed & set(m.cache.blocks(new))
            live.append(new)
            m.check(live)
    assert m.cache.stats().cow_copies >= 1
    assert len(calls) >= 12 * 2


def test_plan_follows_replaced_pools_and_dies_with_the_cache():
    m = Mirror(
        PagedKVCache(
            KVGeometry(2, HKV, 64, torch.float32),
            PagedCacheConfig(max_seqs=2, max_seq_len=32, num_blocks=8, block_size=8),
        )
    )
    seqs = [m.new(), m.new()]
    m.grow(seqs, 11)
    m.check(seqs)
    plan = layer_plan(m.cache, 1)
    assert plan.params.paged and plan.params.max_tokens == 32
    # New pools for layer 1 (the attribute is public): the step path must read them, not the old memory.
    for pools in (m.cache.key_caches, m.cache.value_caches):
        pools[1] = torch.randn_like(pools[1])
    for s in seqs:
        m.kv[s][1] = list(m.cache.kv(1, s))
    m.check(seqs, layers=[1])
    assert layer_plan(m.cache, 1) is not plan
    # New storage under the same tensor objects (`.data =`): the plan must follow the storage, not the object.
    plan = layer_plan(m.cache, 1)
    for pools in (m.cache.key_caches, m.cache.value_caches):
        pools[1].data = torch.randn_like(pools[1])
    for s in seqs:
        m.kv[s][1] = list(m.cache.kv(1, s))
    m.check(seqs, layers=[1])
    assert layer_plan(m.cache, 1) is not plan
    # close() releases the pools (the plans keep no reference to them), and the plans go with the cache.
    pool = weakref.ref(m.cache.key_caches[0])
    cache = weakref.ref(m.cache)
    m.cache.close()
    gc.collect()
    assert pool() is None
    del m
    gc.collect()
    assert cache() is None


@pytest.mark.parametrize("swap", ["dtype", "fewer_blocks", "head_dim", "none"])
def test_pools_unlike_the_cache_are_refused_before_any_read(swap):
    """Pools that are not what the cache says it holds (q and out are checked against the cache's dtype,
    tables against its num_blocks) are a typed error; out is not written and the old plan is not used."""
    cache, seqs, _ = build("paged8", torch.float16, 64, [9, 20], layers=2)
    q = torch.randn(2, HKV * 2, 64).to(torch.float16)
    ops.decode_attention(q, cache, seqs, 1)  # a plan for layer 1 exists
    k, v = cache.key_caches[1], cache.value_caches[1]
    if swap == "dtype":
        new_k, new_v = k.float(), v.float()
    elif swap == "fewer_blocks":
        new_k, new_v = k[:2].clone(), v[:2].clone()
    elif swap == "head_dim":
        new_k, new_v = torch.zeros(*k.shape[:3], 32, dtype=k.dtype), torch.zeros(*v.shape[:3], 32, dtype=v.dtype)
    else:
        new_k = new_v = None
    cache.key_caches[1], cache.value_caches[1] = new_k, new_v
    buf = torch.full((2 * q.numel() + 64,), 7.0, dtype=torch.float16)
    out = buf[: q.numel()].view(q.shape)
    with pytest.raises((DTypeError, ShapeError, InvalidArgumentError)):
        ops.decode_attention(q, cache, seqs, 1, out=out)
    assert torch.all(buf == 7.0)  # neither out nor the bytes past it were written
    cache.key_caches[1], cache.value_caches[1] = k, v  # the real pools back: the path works again
    ops.decode_attention(q, cache, seqs, 1, out=out)
    assert torch.equal(out, tensor_api(q, cache, seqs, 1))


def test_empty_batch():
    cache, seqs, _ = build("paged8", torch.float32, 64, [3])
    q = torch.randn(0, HKV, 64)
    assert ops.decode_attention(q, cache, [], 0).shape == (0, HKV, 64)


# --------------------------------------------------------------------------------------------- errors
def snapshot(cache: PagedKVCache):
    seqs = cache.sequences
    return (
        seqs,
        [cache.blocks(s) for s in seqs],
        [cache.seq_len(s) for s in seqs],
        cache.stats(),
        [t.clone() for t in (*cache.key_caches, *cache.value_caches)],
    )


def assert_same(a, b):
    assert a[:4] == b[:4]
    # Bytes, not values: unwritten rows of the pools may hold NaN patterns.
    assert all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a[4], b[4]))


def test_bad_calls_are_typed_errors_that_change_nothing():
    cache, seqs, _ = build("paged16", torch.bfloat16, 64, [9, 40])
    q = torch.randn(2, HKV * 2, 64).to(torch.bfloat16)
    ops.decode_attention(q, cache, seqs, 1)  # the layer's parameters exist: later calls take the fast path
    freed = cache.allocate()
    cache.free(freed)
    empty = cache.allocate()
    before = snapshot(cache)
    cases = [
        (dict(seqs=[seqs[0], 999]), vpaged.UnknownSequenceError),
        (dict(seqs=[seqs[0], freed]), vpaged.UnknownSequenceError),
        (dict(seqs=[seqs[0], "x"]), vpaged.UnknownSequenceError),
        (dict(seqs=[seqs[0], empty]), InvalidArgumentError),  # holds no tokens
        (dict(layer=2), vpaged.LayerIndexError),
        (dict(layer=-1), vpaged.LayerIndexError),
        (dict(layer=True), vpaged.LayerIndexError),
        (dict(q=torch.randn(2, HKV * 2, 32).to(torch.bfloat16)), ShapeError),  # head dim
        (dict(q=torch.randn(2, 3, 64).to(torch.bfloat16)), ShapeError),  # heads not a multiple of kv heads
        (dict(q=torch.randn(3, HKV * 2, 64).to(torch.bfloat16)), ShapeError),  # rows for 2 sequences
        (dict(q=torch.randn(2, HKV * 2, 64)), DTypeError),
        (dict(q=torch.randn(2, HKV * 2, 64).half()), DTypeError),
        (dict(q=[[1.0]]), InvalidArgumentError),
        (dict(out=torch.empty(2, HKV * 2, 63, dtype=torch.bfloat16)), ShapeError),
        (dict(out=torch.empty(2, HKV * 2, 64)), DTypeError),
    ]
    for change, error in cases:
        args = dict(q=q, seqs=seqs, layer=1, out=None, **{})
        args.update(change)
        with pytest.raises(error):
            ops.decode_attention(args["q"], cache, args["seqs"], args["layer"], out=args["out"])
        assert_same(snapshot(cache), before)
    out = poisoned(q)
    with pytest.raises(ShapeError):
        ops.decode_attention(q[:, :3], cache, seqs, 1, out=out)
    assert torch.isnan(out.float()).all()  # not written


def test_cache_states_that_hold_no_readable_kv():
    acct = PagedKVCache(
        KVGeometry(2, HKV, 64, torch.float32),
        PagedCacheConfig(max_seqs=2, max_seq_len=32, num_blocks=8, accounting_only=True),
    )
    s = acct.allocate()
    acct.extend(s, 5)
    with pytest.raises(InvalidArgumentError, match="accounting-only"):
        ops.decode_attention(torch.randn(1, HKV, 64), acct, [s], 0)
    assert acct.seq_len(s) == 5 and acct.blocks(s) == [0]
    f64 = PagedKVCache(
        KVGeometry(1, HKV, 64, torch.float64), PagedCacheConfig(max_seqs=2, max_seq_len=32, num_blocks=8)
    )
    s = f64.allocate()
    f64.extend(s, 3)
    with pytest.raises(DTypeError):
        ops.decode_attention(torch.randn(1, HKV, 64).double(), f64, [s], 0)
    cache, seqs, _ = build("paged8", torch.float32, 64, [9, 4])
    q = torch.randn(2, HKV, 64)
    ops.decode_attention(q, cache, seqs, 0)
    cache.close()
    out = poisoned(q)
    for batch in (seqs, []):
        with pytest.raises(CacheClosedError):
            ops.decode_attention(q[: len(batch)], cache, batch, 0, out=out[: len(batch)])
    assert torch.isnan(out).all()


def test_entry_checks_every_length_and_block_before_reading():
    """_C.decode_cpu_tables on its own: a bad table or length raises InvalidArgumentError and writes nothing
    (never clamped to some block in the pool)."""
    cache, seqs, _ = build("paged8", torch.float32, 64, [9, 20], layers=1)
    q = torch.randn(2, HKV, 64)
    base = layer_plan(cache, 0).params
    tables, lengths = cache.tables_and_lengths(seqs)
    assert tables == [cache.blocks(s) for s in seqs] and lengths == [9, 20]
    n = cache.num_blocks
    out = poisoned(q)
    call = dict(base=base, q=q.data_ptr(), out=out.data_ptr(), num_heads=HKV, scale=0.125)
    t0, t1 = tables
    bad = [
        ([t0, [t1[0], n, t1[2]]], lengths),  # one past the pool
        ([t0, [t1[0], -1, t1[2]]], lengths),
        ([t0, [t1[0], 2**40, t1[2]]], lengths),
        ([t0, t1[:2]], lengths),  # 20 tokens need 3 blocks
        ([t0, []], lengths),
        ([t0, t1], [9, 0]),
        ([t0, t1], [9, -3]),
        ([t0, t1 + [0] * 3], [9, base.max_tokens + 1]),  # beyond the capacity, even with blocks for it
        ([t0], lengths),
        ([t0, t1], [9]),
    ]
    for tbl, lens in bad:
        with pytest.raises(InvalidArgumentError):
            _C.decode_cpu_tables(block_tables=tbl, lengths=lens, **call)
        assert torch.isnan(out).all()
    contiguous = VirtualKVCache(
        KVGeometry(1, HKV, 64, torch.float32), VirtualCacheConfig(max_seqs=2, max_seq_len=16, capacity_bytes=4 << 20)
    )
    s = contiguous.allocate()
    contiguous.extend(s, 3)
    with pytest.raises(InvalidArgumentError, match="block pools"):
        _C.decode_cpu_tables(**{**call, "base": layer_plan(contiguous, 0).params}, block_tables=[[0]], lengths=[3])
    assert torch.isnan(out).all()
    # Entries past the blocks a length reaches are not read, so not checked (the cache keeps none).
    _C.decode_cpu_tables(block_tables=[t0 + [n + 5], t1], lengths=lengths, **call)
    assert torch.equal(out, tensor_api(q, cache, seqs, 0))
    # A table corrupted inside the cache is refused through decode_attention as well.
    cache._blocks[seqs[1]][2] = n
    out = poisoned(q)
    with pytest.raises(InvalidArgumentError, match="outside"):
        ops.decode_attention(q, cache, seqs, 0, out=out)
    assert torch.isnan(out).all()
