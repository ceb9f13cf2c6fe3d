"""Quantized K/V (kv_dtype = int8, fp8 e4m3, fp8 e5m2): the formats' error bounds against float64, caches of
every layout and the block-table cache keeping scales with their tokens through every operation, the decode
kernels on quantized K/V against "dequantize, then the float64 reference", and bad combinations refused.

Fresh random data every run; references are computed here, independently of vpaged's quantizer (int8 by its
definition, fp8 through torch's own float8 conversion).
"""

import math
import random

import pytest
import torch
from int8_contract_helpers import assert_within_contract, int8_dot_bound

from vpaged import _C, KVGeometry, PagedCacheConfig, PagedKVCache, VirtualCacheConfig, VirtualKVCache, ops
from vpaged.errors import DTypeError, InvalidArgumentError, ReadOnlyTokensError, ShapeError
from vpaged.kvcache.formats import FP8_MAX, KVFormat, QuantizedKV

FORMATS = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
LAYOUTS = ["per_layer", "interleaved", "head_major"]
MANTISSA = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}
MIN_NORMAL = {torch.float8_e4m3fn: 2.0**-6, torch.float8_e5m2: 2.0**-14}
HAS_QUANT_KERNEL = hasattr(_C.DecodeParams(), "kv_dtype")
needs_kernel = pytest.mark.skipif(not HAS_QUANT_KERNEL, reason="extension built without quantized decode kernels")


def samples(kind: str, n: int, heads: int, dim: int) -> torch.Tensor:
    if kind == "normal":
        return torch.randn(n, heads, dim)
    if kind == "heavy":  # Student-t with 2 degrees of freedom: outliers many times the typical size
        return torch.distributions.StudentT(2.0).sample((n, heads, dim))
    if kind == "zero_rows":
        x = torch.randn(n, heads, dim)
        x[::3] = 0.0
        x[:, 0] = 0.0
        return x
    raise ValueError(kind)


# --------------------------------------------------------------------------------------------- formats
@pytest.mark.parametrize("kind", ["normal", "heavy", "zero_rows"])
def test_int8_error_within_half_a_step_of_each_rows_scale(kind):
    x = samples(kind, 64, 4, 32).double()
    fmt = KVFormat.of(torch.float32, torch.int8)
    rows = fmt.quantize(x.float())
    assert rows.dtype == torch.uint8 and rows.shape == (64, 4, 36)
    back = fmt.dequantize(rows, 32).double()
    step = x.abs().amax(-1, keepdim=True) / 127.0  # the row's scale, by definition
    err = (back - x).abs()
    assert bool((err <= step / 2 + 1e-6 * x.abs() + 1e-30).all()), float((err - step / 2).max())
    zero = x.abs().amax(-1) == 0
    assert bool((back[zero] == 0).all()) and torch.isfinite(back).all()


@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("kind", ["normal", "heavy", "zero_rows"])
def test_fp8_error_within_half_an_ulp(kv_dtype, kind):
    x = samples(kind, 64, 4, 32).double()
    scale = float(x.abs().max()) / FP8_MAX[kv_dtype] * random.uniform(0.5, 1.0) or 1.0  # some values saturate
    fmt = KVFormat.of(torch.float32, kv_dtype)
    back = fmt.dequantize(fmt.quantize(x.float(), scale), 32, scale).double()
    limit = FP8_MAX[kv_dtype] * scale
    target = x.clamp(-limit, limit)
    # Round to nearest: half an ulp of the result, relative 2^-(m+1) for normals, absolute below them.
    ulp_half = torch.maximum(target.abs(), torch.tensor(MIN_NORMAL[kv_dtype] * scale)) * 2.0 ** -(
        MANTISSA[kv_dtype] + 1
    )
    assert bool(((back - target).abs() <= ulp_half * (1 + 1e-6) + 1e-12).all())
    assert torch.isfinite(back).all()


@pytest.mark.parametrize("kv_dtype", FP8)
def test_fp8_rows_are_torchs_own_float8_bytes(kv_dtype):
    """The stored bytes are exactly torch's float8 conversion of value / scale (an independent quantizer)."""
    x = torch.randn(10, 2, 16) * 3
    fmt = KVFormat.of(torch.bfloat16, kv_dtype)
    rows = fmt.quantize(x.bfloat16(), 0.25)
    want = (x.bfloat16().float() / 0.25).to(kv_dtype).view(torch.uint8)
    assert torch.equal(rows, want)


def test_bytes_per_token_with_scales_at_most_052_of_bf16():
    for dim in (64, 128, 256):
        bf16 = VirtualKVCache(
            KVGeometry(4, 8, dim, torch.bfloat16),
            VirtualCacheConfig(max_seqs=2, max_seq_len=64, capacity_bytes=1 << 22),
        )
        for kv_dtype in FORMATS:
            q = VirtualKVCache(
                KVGeometry(4, 8, dim, torch.bfloat16, kv_dtype=kv_dtype),
                VirtualCacheConfig(max_seqs=2, max_seq_len=64, capacity_bytes=1 << 22),
            )
            extra = 4 if kv_dtype == torch.int8 else 0
            assert q.bytes_per_token == 4 * 8 * 2 * (dim + extra)
            if dim >= 128:
                assert q.bytes_per_token <= 0.52 * bf16.bytes_per_token
            q.close()
        bf16.close()


# --------------------------------------------------------------------------------------------- caches
def make_cache(kind: str, kv_dtype, dtype=torch.float32, heads=2, dim=16, layers=2, max_seq_len=96, **kw):
    if kind == "paged":
        return PagedKVCache(
            KVGeometry(layers, heads, dim, dtype, kv_dtype=kv_dtype),
            PagedCacheConfig(max_seqs=8, max_seq_len=max_seq_len, num_blocks=64, block_size=16, **kw),
        )
    return VirtualKVCache(
        KVGeometry(layers, heads, dim, dtype, kv_dtype=kv_dtype),
        VirtualCacheConfig(
            max_seqs=8,
            max_seq_len=max_seq_len,
            capacity_bytes=1 << 22,
            page_size=64 << 10,
            layout=kind,
            swap_bytes=1 << 21,
            **kw,
        ),
    )


@pytest.mark.parametrize("kind", LAYOUTS + ["paged"])
@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_write_then_read_back_every_layout(kind, kv_dtype):
    cache = make_cache(kind, kv_dtype, kv_scales=None if kv_dtype == torch.int8 else 0.02)
    seq = cache.allocate()
    cache.extend(seq, 40)
    k, v = torch.randn(40, 2, 16), torch.randn(40, 2, 16)
    cache.write(1, seq, k, v)
    qk, qv = cache.kv(1, seq)
    assert isinstance(qk, QuantizedKV) and qk.data.dtype == kv_dtype and qk.shape == (40, 2, 16)
    fmt = KVFormat.of(torch.float32, kv_dtype)
    scale = None if kv_dtype == torch.int8 else 0.02
    for got, x in ((cache.dequantized_kv(1, seq)[0], k), (qv.dequantize(), v)):
        want = fmt.dequantize(fmt.quantize(x, scale), 16, scale)
        assert got.dtype == torch.float32 and torch.equal(got, want)
    cache.close()


@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn])
def test_scales_travel_with_their_tokens(kind, kv_dtype):
    """A stateful run of random operations: every live sequence's dequantized K/V stay what was written
    (bit-exact) through fork, copy-on-write, prefix hits, swap out / in, reorder and truncate."""
    rng = random.Random(torch.randint(0, 2**31, ()).item())
    cache = make_cache(kind, kv_dtype, kv_scales="calibrate" if kv_dtype != torch.int8 else None, max_seq_len=160)
    truth: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # seq -> per layer (K, V) values
    tokens: dict[int, list[int]] = {}

    def grow(seq, n):
        cache.extend(seq, n)
        length = cache.seq_len(seq)
        for layer in range(cache.num_layers):
            k, v = torch.randn(n, 2, 16) * rng.uniform(0.1, 4), torch.randn(n, 2, 16)
            cache.write(layer, seq, k, v)
            got = cache.dequantized_kv(layer, seq)
            old = truth[seq][layer] if seq in truth and truth[seq][layer] is not None else (got[0][:0], got[1][:0])
            assert torch.equal(got[0][: length - n], old[0]) and torch.equal(got[1][: length - n], old[1])
            truth.setdefault(seq, [None] * cache.num_layers)[layer] = (got[0].clone(), got[1].clone())
        tokens[seq] = tokens.get(seq, []) + [rng.randrange(100) for _ in range(n)]

    def verify():
        for seq in cache.sequences:
            if cache.is_swapped(seq):
                continue
            for layer in range(cache.num_layers):
                k, v = cache.dequantized_kv(layer, seq)
                assert torch.equal(k, truth[seq][layer][0]) and torch.equal(v, truth[seq][layer][1]), (seq, layer)

    first = cache.allocate()
    grow(first, 50)
    for _ in range(40):
        live = [s for s in cache.sequences if not cache.is_swapped(s)]
        op = rng.choice(["grow", "fork", "prefix", "swap", "reorder", "truncate", "free", "new"])
        if op == "grow" and live:
            seq = rng.choice(live)
            if cache.seq_len(seq) < 140:
                grow(seq, rng.randint(1, 12))
        elif op == "fork" and live and len(cache.sequences) < 7:
            parent = rng.choice(live)
            child = cache.fork(parent)
            truth[child], tokens[child] = list(truth[parent]), list(tokens[parent])
        elif op == "prefix" and live and len(cache.sequences) < 7:
            src = rng.choice(live)
            cache.cache_prefix(src, tokens[src])
            seq = cache.allocate(tokens=tokens[src])
            hit = cache.seq_len(seq)
            truth[seq] = [(k[:hit].clone(), v[:hit].clone()) for k, v in truth[src]]
            tokens[seq] = tokens[src][:hit]
            if hit:
                verify()
            grow(seq, 5)
        elif op == "swap" and live:
            seq = rng.choice(live)
            cache.swap_out(seq)
            if rng.random() < 0.7:
                cache.swap_in(seq)
        elif op == "reorder" and len(live) >= 2:
            seqs = rng.sample(live, 2)
            sources = [rng.randrange(2) for _ in seqs]
            before = [(truth[s], tokens[s]) for s in seqs]
            cache.reorder(seqs, sources)
            for s, i in zip(seqs, sources):
                truth[s], tokens[s] = list(before[i][0]), list(before[i][1])
        elif op == "truncate" and live:
            seq = rng.choice(live)
            n = rng.randint(0, cache.seq_len(seq))
            cache.truncate(seq, n)
            truth[seq] = [(k[:n], v[:n]) for k, v in truth[seq]]
            tokens[seq] = tokens[seq][:n]
        elif op == "free" and len(live) > 1:
            seq = rng.choice(live)
            cache.free(seq)
            truth.pop(seq), tokens.pop(seq)
        elif op == "new" and len(cache.sequences) < 7:
            grow(cache.allocate(), rng.randint(1, 30))
        for seq in list(cache.sequences):
            if cache.is_swapped(seq) and rng.random() < 0.5:
                cache.swap_in(seq)
        verify()
    for seq in cache.sequences:
        if cache.is_swapped(seq):
            cache.swap_in(seq)
    verify()
    cache.close()


def test_shared_tokens_stay_read_only_when_quantized():
    cache = make_cache("per_layer", torch.int8)
    seq = cache.allocate()
    cache.extend(seq, 20)
    cache.write(0, seq, torch.randn(20, 2, 16), torch.randn(20, 2, 16))
    cache.fork(seq)
    with pytest.raises(ReadOnlyTokensError):
        cache.write(0, seq, torch.randn(20, 2, 16), torch.randn(20, 2, 16), start=0)
    cache.close()


def test_calibration_sets_each_layers_scales_once():
    cache = make_cache("per_layer", torch.float8_e4m3fn, kv_scales="calibrate")
    assert bool(torch.isnan(cache.kv_scales).all())
    seq = cache.allocate()
    cache.extend(seq, 8)
    k, v = torch.randn(8, 2, 16) * 10, torch.randn(8, 2, 16)
    cache.write(0, seq, k, v)
    assert cache.kv_scales[0].tolist() == pytest.approx([float(k.abs().max()) / 448, float(v.abs().max()) / 448])
    assert bool(torch.isnan(cache.kv_scales[1]).all())
    before = cache.kv_scales[0].clone()
    cache.extend(seq, 4)
    cache.write(0, seq, torch.randn(4, 2, 16) * 100, torch.randn(4, 2, 16))  # saturates, does not recalibrate
    assert torch.equal(cache.kv_scales[0], before)
    cache.close()


def test_bad_combinations_are_refused_and_change_nothing():
    with pytest.raises(DTypeError):
        make_cache("per_layer", "int4")
    with pytest.raises(DTypeError):
        make_cache("per_layer", torch.int16)
    with pytest.raises(ShapeError):
        make_cache("per_layer", torch.int8, dim=18)  # the row's scale needs head dims that are multiples of 4
    with pytest.raises(InvalidArgumentError):
        make_cache("per_layer", torch.int8, kv_scales=0.5)  # int8 keeps a scale per token and head
    with pytest.raises(ShapeError):
        make_cache("per_layer", torch.float8_e4m3fn, kv_scales=torch.ones(3, 2))
    with pytest.raises(InvalidArgumentError):
        make_cache("paged", torch.float8_e5m2, kv_scales=-1.0)
    with pytest.raises(InvalidArgumentError):
        make_cache("per_layer", torch.float8_e5m2, kv_scales="max")
    cache = make_cache("per_layer", torch.int8)
    seq = cache.allocate()
    cache.extend(seq, 4)
    with pytest.raises(DTypeError):
        cache.write(0, seq, torch.randn(4, 2, 16).to(torch.int8), torch.randn(4, 2, 16).to(torch.int8))
    assert cache.stats().live_tokens == 4
    cache.close()


# --------------------------------------------------------------------------------------------- kernels
def reference(q, ks, vs):
    out = torch.empty(q.shape[0], q.shape[1], vs[0].shape[-1], dtype=torch.float64)
    for i, (k, v) in enumerate(zip(ks, vs)):
        g = q.shape[1] // k.shape[1]
        k = k.double().repeat_interleave(g, dim=1)
        v = v.double().repeat_interleave(g, dim=1)
        s = torch.einsum("hd,thd->ht", q[i].double(), k) / math.sqrt(q.shape[2])
        out[i] = torch.einsum("ht,thd->hd", s.softmax(-1), v)
    return out


ISAS = _C.decode_cpu_isas()


def force_isa(monkeypatch, isa):
    real, real_rows, real_tables = _C.decode_cpu, _C.decode_cpu_rows, _C.decode_cpu_tables
    monkeypatch.setattr(_C, "decode_cpu", lambda p, n=0, isa_=isa: real(p, n, isa_))
    monkeypatch.setattr(_C, "decode_cpu_rows", lambda *args, isa_=isa: real_rows(*args[:8], isa_))
    monkeypatch.setattr(_C, "decode_cpu_tables", lambda *args, isa_=isa: real_tables(*args[:8], isa_))


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", LAYOUTS + ["paged"])
@pytest.mark.parametrize("kv_dtype", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_on_quantized_kv_equals_dequantized_reference(isa, kind, kv_dtype, dtype, monkeypatch):
    force_isa(monkeypatch, isa)
    dim = 64 if kind != "interleaved" else 80
    cache = make_cache(kind, kv_dtype, dtype=dtype, dim=dim, max_seq_len=320, kv_scales="calibrate"
                       if kv_dtype != torch.int8 else None)  # fmt: skip
    lengths = [1, 37, 300, 129]
    seqs = []
    for n in lengths:
        seq = cache.allocate()
        cache.extend(seq, n)
        for layer in range(2):
            cache.write(layer, seq, torch.randn(n, 2, dim).to(dtype), torch.randn(n, 2, dim).to(dtype))
        seqs.append(seq)
    kvs = [cache.dequantized_kv(1, s) for s in seqs]
    for group in (1, 4):
        q = torch.randn(len(seqs), 2 * group, dim).to(dtype)
        out = ops.decode_attention(q, cache, seqs, 1)
        assert out.dtype == dtype and torch.isfinite(out).all()
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
        exact = reference(q.float(), *zip(*kvs))
        if kv_dtype == torch.int8 and _C.decode_cpu_int8_dot(isa):
            # int8 by integer products quantizes the query and the probabilities: its own contract's bound
            ks, vs = zip(*kvs)
            bound = int8_dot_bound(q.float(), ks, vs, 1 / math.sqrt(dim), _C.decode_cpu_int8_dot_prob_steps(isa))
            assert_within_contract(out, exact, bound, tol["atol"], tol["rtol"], isa)
            continue
        torch.testing.assert_close(out.double(), exact.to(out.dtype).double(), **tol)
        ref = ops.decode_attention_reference(q, cache, seqs, 1)
        torch.testing.assert_close(out.double(), ref.double(), **tol)
    cache.close()


@needs_kernel
@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_write_kv_quantizes_like_write(kv_dtype):
    """ops.write_kv (the engine's scatter) stores the same bytes as write() for the same values."""
    a = make_cache("per_layer", kv_dtype, kv_scales=None if kv_dtype == torch.int8 else 0.03)
    b = make_cache("per_layer", kv_dtype, kv_scales=None if kv_dtype == torch.int8 else 0.03)
    sa, sb = a.allocate(), b.allocate()
    a.extend(sa, 12)
    b.extend(sb, 12)
    k, v = torch.randn(12, 2, 16), torch.randn(12, 2, 16)
    a.write(0, sa, k, v)
    ops.write_kv(k, v, b.batch(0, [sb]), torch.zeros(12, dtype=torch.int32), torch.arange(12, dtype=torch.int32))
    for x, y in zip(a.dequantized_kv(0, sa), b.dequantized_kv(0, sb)):
        assert torch.equal(x, y)
    with pytest.raises(DTypeError):
        ops.write_kv(k.double(), v.double(), b.batch(0, [sb]), torch.zeros(12, dtype=torch.int32),
                     torch.arange(12, dtype=torch.int32))  # fmt: skip
    a.close()
    b.close()
