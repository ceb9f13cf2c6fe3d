"""vpaged.ops.write_kv (the K/V scatter of one layer) against torch writes into the cache's kv() views, on fresh
random data: every layout, fp32/bf16/fp16, values with their own head dim, strided sources; bad rows raise a
typed error and leave every byte of the cache as it was. The CUDA scatter is tested on a GPU in
tests/serve/test_serve_engine_gpu.py (the stage of scripts/gpu_check.sh that covers the engine's CUDA path)."""

import dataclasses

import pytest
import torch

from vpaged import KVGeometry, VirtualCacheConfig, VirtualKVCache, ops
from vpaged.errors import DTypeError, InvalidArgumentError, ShapeError
from vpaged.kvcache.virtual.cache import BatchedKV

LAYOUTS = ["per_layer", "interleaved", "head_major"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
LAYERS, HKV, D = 3, 2, 16


def make_cache(layout, dtype, v_head_dim=None, device="cpu", lengths=(5, 70, 1, 33)):
    cache = VirtualKVCache(
        KVGeometry(LAYERS, HKV, D, dtype, v_head_dim=v_head_dim),
        VirtualCacheConfig(
            max_seqs=6,
            max_seq_len=96,
            device=device,
            capacity_bytes=(8 << 20) if device == "cpu" else (256 << 20),
            page_size=4096 if device == "cpu" else None,
            layout=layout,
        ),
    )
    seqs = []
    for n in lengths:
        s = cache.allocate()
        cache.extend(s, n)
        seqs.append(s)
    return cache, seqs


def rand(shape, dtype, rng, device="cpu"):
    return torch.randn(shape, generator=rng, dtype=torch.float32).to(dtype).to(device)


def fill(cache, seqs, rng):
    for layer in range(LAYERS):
        for s in seqs:
            k, v = cache.kv(layer, s)
            k.copy_(rand(k.shape, k.dtype, rng, k.device))
            v.copy_(rand(v.shape, v.dtype, rng, v.device))


def snapshot(cache, seqs):
    return [[tuple(t.clone() for t in cache.kv(layer, s)) for s in seqs] for layer in range(LAYERS)]


def assert_same(cache, seqs, snap):
    for layer in range(LAYERS):
        for i, s in enumerate(seqs):
            k, v = cache.kv(layer, s)
            assert torch.equal(k, snap[layer][i][0]) and torch.equal(v, snap[layer][i][1]), (layer, i)


def random_rows(lengths, rng, n):
    """n distinct (sequence index, position) pairs inside the lengths, in random order."""
    pairs = [(i, t) for i, length in enumerate(lengths) for t in range(length)]
    pick = torch.randperm(len(pairs), generator=rng)[:n].tolist()
    rows, pos = zip(*(pairs[j] for j in pick))
    return torch.tensor(rows, dtype=torch.int32), torch.tensor(pos, dtype=torch.int32)


def strided_rows(n, heads, dim, dtype, rng, device="cpu"):
    """[n, heads, dim] with heads apart in memory (a transposed [heads, n, dim], as attention hands them)."""
    return rand((heads, n, dim), dtype, rng, device).transpose(0, 1)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("v_head_dim", [None, 8])
def test_scatter_matches_torch_writes(layout, dtype, v_head_dim, rng):
    cache, seqs = make_cache(layout, dtype, v_head_dim)
    fill(cache, seqs, rng)
    lengths = [cache.seq_len(s) for s in seqs]
    order = [2, 0, 3, 1]  # a descriptor whose sequences are not in slot order
    dseqs = [seqs[i] for i in order]
    dlens = [lengths[i] for i in order]
    vd = v_head_dim or D
    for layer in range(LAYERS):
        expect = snapshot(cache, seqs)
        rows, pos = random_rows(dlens, rng, 40)
        k = strided_rows(len(rows), HKV, D, dtype, rng)
        v = rand((len(rows), HKV, vd), dtype, rng)  # a dense source too
        for i, (r, t) in enumerate(zip(rows.tolist(), pos.tolist())):
            j = order[r]
            expect[layer][j][0][t] = k[i]
            expect[layer][j][1][t] = v[i]
        ops.write_kv(k, v, cache.batch(layer, dseqs), rows, pos)
        assert_same(cache, seqs, expect)


def test_scatter_of_one_step_rows_on_two_threads(rng):
    """A step's worth of rows (large enough for the threaded copy), written by several calls as the engine does."""
    cache, seqs = make_cache("per_layer", torch.float32, lengths=(90, 96, 64, 80))
    fill(cache, seqs, rng)
    lengths = [cache.seq_len(s) for s in seqs]
    rows = torch.repeat_interleave(torch.arange(4, dtype=torch.int32), torch.tensor(lengths))
    pos = torch.cat([torch.arange(n, dtype=torch.int32) for n in lengths])
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for layer in range(LAYERS):
            k = strided_rows(len(rows), HKV, D, torch.float32, rng)
            v = strided_rows(len(rows), HKV, D, torch.float32, rng)
            ops.write_kv(k, v, cache.batch(layer, seqs), rows, pos, check_mapped=False)
            at = 0
            for s, n in zip(seqs, lengths):
                ck, cv = cache.kv(layer, s)
                assert torch.equal(ck, k[at : at + n]) and torch.equal(cv, v[at : at + n])
                at += n
    finally:
        torch.set_num_threads(threads)


def test_scatter_into_ordinary_tensors(rng):
    """A BatchedKV over plain tensors ([B, T, H, D] and [B, H, T, D]) is written like a cache's."""
    for layout in ("bthd", "bhtd"):
        shape = (3, 20, HKV, D) if layout == "bthd" else (3, HKV, 20, D)
        kt, vt = rand(shape, torch.float32, rng), rand(shape, torch.float32, rng)
        lengths = [20, 7, 12]
        kv = BatchedKV.from_tensors(kt, vt, lengths, layout)
        rows, pos = random_rows(lengths, rng, 15)
        k, v = strided_rows(15, HKV, D, torch.float32, rng), rand((15, HKV, D), torch.float32, rng)
        ek, ev = kt.clone(), vt.clone()
        for i, (r, t) in enumerate(zip(rows.tolist(), pos.tolist())):
            if layout == "bthd":
                ek[r, t], ev[r, t] = k[i], v[i]
            else:
                ek[r, :, t], ev[r, :, t] = k[i], v[i]
        ops.write_kv(k, v, kv, rows, pos)
        assert torch.equal(kt, ek) and torch.equal(vt, ev)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bad_rows_write_nothing(layout, rng):
    cache, seqs = make_cache(layout, torch.float32)
    fill(cache, seqs, rng)
    lengths = [cache.seq_len(s) for s in seqs]
    snap = snapshot(cache, seqs)
    kv = cache.batch(1, seqs)
    n = 6
    k, v = rand((n, HKV, D), torch.float32, rng), rand((n, HKV, D), torch.float32, rng)
    good_rows = torch.tensor([0, 1, 1, 3, 3, 3], dtype=torch.int32)
    good_pos = torch.tensor([0, 5, 69, 0, 1, 32], dtype=torch.int32)
    for last in range(n):  # the bad row anywhere: earlier good rows must not have been written either
        for rows, pos in (
            (good_rows, good_pos.clone().index_fill_(0, torch.tensor([last]), lengths[good_rows[last]])),  # = length
            (good_rows, good_pos.clone().index_fill_(0, torch.tensor([last]), -1)),
            (good_rows.clone().index_fill_(0, torch.tensor([last]), len(seqs)), good_pos),  # no such sequence
            (good_rows.clone().index_fill_(0, torch.tensor([last]), -1), good_pos),
        ):
            with pytest.raises(InvalidArgumentError):
                ops.write_kv(k, v, kv, rows, pos)
    # below writable_from (tokens that may share pages)
    with pytest.raises(InvalidArgumentError, match="writable"):
        ops.write_kv(k, v, kv, good_rows, good_pos, writable_from=torch.tensor([0, 6, 0, 0], dtype=torch.int32))
    # a slot that is not one of the cache's (outside its memory)
    far = dataclasses.replace(kv, slots=torch.tensor([0, 1, 2, 10**6], dtype=torch.int32))
    with pytest.raises(InvalidArgumentError):
        ops.write_kv(k, v, far, good_rows, good_pos, check_mapped=False)
    # lengths edited past what is mapped
    longer = dataclasses.replace(kv, lengths=torch.tensor([96] * 4, dtype=torch.int32))
    with pytest.raises(InvalidArgumentError, match="unmapped"):
        ops.write_kv(k, v, longer, torch.tensor([0] * n, dtype=torch.int32), torch.arange(90, 96, dtype=torch.int32))
    # wrong tensors
    with pytest.raises(DTypeError):
        ops.write_kv(k.double(), v.double(), kv, good_rows, good_pos)
    with pytest.raises(ShapeError):
        ops.write_kv(k[:, :1], v[:, :1], kv, good_rows, good_pos)
    with pytest.raises(ShapeError):
        ops.write_kv(k, v[:-1], kv, good_rows, good_pos)
    with pytest.raises(ShapeError):
        ops.write_kv(k, v, kv, good_rows[:-1], good_pos)
    with pytest.raises(InvalidArgumentError, match="dense"):
        ops.write_kv(rand((n, HKV, 2 * D), torch.float32, rng)[:, :, ::2], v, kv, good_rows, good_pos)
    with pytest.raises(DTypeError):
        ops.write_kv(k, v, kv, good_rows.float(), good_pos)
    with pytest.raises(InvalidArgumentError):
        ops.write_kv(k, v, "not a descriptor", good_rows, good_pos)
    assert_same(cache, seqs, snap)
    ops.write_kv(k, v, kv, good_rows, good_pos)  # the good rows are fine
    assert torch.equal(cache.kv(1, seqs[3])[0][32], k[5])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_write_plan_writes_every_layer_as_write_kv_does(layout, dtype, rng):
    """One WritePlan over every layer's descriptor of the same sequences (as a serving step builds it) leaves the
    cache byte for byte as write_kv called per layer on a second cache with the same contents."""
    caches = [make_cache(layout, dtype) for _ in range(2)]
    for cache, seqs in caches:
        fill(cache, seqs, torch.Generator().manual_seed(7))
    (plan_cache, seqs), (ref_cache, ref_seqs) = caches
    lengths = [plan_cache.seq_len(s) for s in seqs]
    rows, pos = random_rows(lengths, rng, 30)
    first = torch.tensor([plan_cache.writable_range(s)[0] for s in seqs], dtype=torch.int32)
    plan = ops.WritePlan([plan_cache.batch(layer, seqs) for layer in range(LAYERS)], rows, pos, writable_from=first)
    for layer in reversed(range(LAYERS)):  # any order of layers
        k = strided_rows(len(rows), HKV, D, dtype, rng)
        v = rand((len(rows), HKV, D), dtype, rng)
        plan.write(layer, k, v)
        ops.write_kv(k, v, ref_cache.batch(layer, ref_seqs), rows, pos, writable_from=first)
    assert_same(plan_cache, seqs, snapshot(ref_cache, ref_seqs))


def test_a_write_plan_refuses_what_write_kv_refuses_and_writes_nothing(rng):
    cache, seqs = make_cache("per_layer", torch.float32)
    fill(cache, seqs, rng)
    snap = snapshot(cache, seqs)
    layers = [cache.batch(layer, seqs) for layer in range(LAYERS)]
    n = 4
    rows = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    pos = torch.tensor([4, 69, 0, 32], dtype=torch.int32)
    k, v = rand((n, HKV, D), torch.float32, rng), rand((n, HKV, D), torch.float32, rng)
    with pytest.raises(InvalidArgumentError, match="same slots and lengths"):
        ops.WritePlan([layers[0], cache.batch(1, seqs[::-1])], rows, pos)
    with pytest.raises(InvalidArgumentError):
        ops.WritePlan([], rows, pos)
    with pytest.raises(InvalidArgumentError):
        ops.WritePlan([layers[0], "not a descriptor"], rows, pos)
    with pytest.raises(ShapeError):
        ops.WritePlan(layers, rows.view(2, 2), pos)
    with pytest.raises(DTypeError):
        ops.WritePlan(layers, rows, pos.float())
    plan = ops.WritePlan(layers, rows, pos)
    with pytest.raises(ShapeError):
        plan.write(0, k[:-1], v[:-1])  # not the plan's rows
    with pytest.raises(DTypeError):
        plan.write(1, k.double(), v.double())
    bad = ops.WritePlan(layers, rows, pos.clone().index_fill_(0, torch.tensor([3]), 33))  # = the length: refused
    for layer in range(LAYERS):
        with pytest.raises(InvalidArgumentError):
            bad.write(layer, k, v)
    assert_same(cache, seqs, snap)
    plan.write(2, k, v)
    assert torch.equal(cache.kv(2, seqs[3])[0][32], k[3]) and torch.equal(cache.kv(2, seqs[1])[1][69], v[1])


def test_shared_tokens_are_refused_through_writable_range(rng):
    """After a fork the parent's tokens live in shared pages: writable_range() bounds keep the scatter off them."""
    cache, seqs = make_cache("per_layer", torch.float32, lengths=(64,))
    fill(cache, seqs, rng)
    child = cache.fork(seqs[0])
    both = [seqs[0], child]
    snap = snapshot(cache, both)
    first = torch.tensor([cache.writable_range(s)[0] for s in both], dtype=torch.int32)
    assert first.tolist() == [64, 64]
    k, v = rand((1, HKV, D), torch.float32, rng), rand((1, HKV, D), torch.float32, rng)
    with pytest.raises(InvalidArgumentError, match="writable"):
        ops.write_kv(
            k,
            v,
            cache.batch(0, both),
            torch.tensor([1], dtype=torch.int32),
            torch.tensor([63], dtype=torch.int32),
            writable_from=first,
        )
    assert_same(cache, both, snap)
    cache.extend(child, 1)  # its own copy of the last page, and a new token
    first = torch.tensor([cache.writable_range(s)[0] for s in both], dtype=torch.int32)
    ops.write_kv(
        k,
        v,
        cache.batch(0, both),
        torch.tensor([1], dtype=torch.int32),
        torch.tensor([64], dtype=torch.int32),
        writable_from=first,
    )
    assert torch.equal(cache.kv(0, child)[0][64], k[0])
    assert torch.equal(cache.kv(0, seqs[0])[0], snap[0][0][0])


def test_stale_descriptor_is_refused(rng):
    cache, seqs = make_cache("per_layer", torch.float32)
    kv = cache.batch(0, seqs)
    cache.free(seqs[1])
    cache.reclaim()
    k, v = rand((1, HKV, D), torch.float32, rng), rand((1, HKV, D), torch.float32, rng)
    with pytest.raises(InvalidArgumentError, match="stale"):
        ops.write_kv(k, v, kv, torch.tensor([1], dtype=torch.int32), torch.tensor([3], dtype=torch.int32))
