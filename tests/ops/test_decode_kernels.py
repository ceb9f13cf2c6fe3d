"""Decode attention kernels (vpaged.ops) against a float64 reference, on fresh random data every run.

Outputs are poisoned with NaN before each call and must come back fully written. Lengths are mixed in a
batch, include 1 and the cache's maximum, and are not multiples of pages or blocks.
"""

import contextlib
import dataclasses
import math
import os
import subprocess
import sys

import pytest
import torch

import vpaged
from vpaged import _C, KVGeometry, PagedCacheConfig, PagedKVCache, VirtualCacheConfig, VirtualKVCache, ops
from vpaged.errors import BackendError, DTypeError, InvalidArgumentError, ShapeError
from vpaged.kvcache.virtual.cache import BatchedKV
from vpaged.kvcache.virtual.layout import Layout
from vpaged.memory.device import default_page_size, normalize_device
from vpaged.ops.plans import layer_plan

HKV = 2
LENGTHS = [1, 37, 300, 129, 17]  # 300 is max_seq_len
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=1e-2, atol=1e-2),
    torch.bfloat16: dict(rtol=1e-2, atol=1e-2),
}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
KINDS = ["per_layer", "interleaved", "head_major", "paged8", "paged16", "paged32"]
HAS_CUDA = torch.cuda.is_available()


def reference(q, ks, vs, scale=None):
    """Attention of q[i] over ks[i], vs[i] in float64; V may be narrower or wider than K. GQA by grouping the
    query heads of each kv head rather than by repeating K/V (2-6x cheaper here, which the GPU check's cap
    needs)."""
    num_seqs, num_heads, head_dim = q.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.empty(num_seqs, num_heads, vs[0].shape[-1], dtype=torch.float64)
    q = q.cpu().double()
    for i, (k, v) in enumerate(zip(ks, vs)):
        hkv = k.shape[1]
        grouped = q[i].view(hkv, num_heads // hkv, head_dim)
        s = torch.einsum("kgd,tkd->kgt", grouped, k.cpu().double()) * scale
        out[i] = torch.einsum("kgt,tkd->kgd", s.softmax(-1), v.cpu().double()).reshape(num_heads, -1)
    return out


def check(out, q, ks, vs, scale=None):
    assert torch.isfinite(out).all(), "output not fully written (NaN poison left) or not finite"
    torch.testing.assert_close(out.cpu().double(), reference(q, ks, vs, scale), **TOL[out.dtype])


def poisoned(q):
    return torch.full_like(q, float("nan"))


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's thread count (which the CPU kernels use) set to n for the block, restored afterwards."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def build(kind, dtype, head_dim, lengths, device="cpu", layers=2, hkv=HKV, page_size=None):
    """A cache of `kind` holding random K/V for sequences of `lengths`; returns (cache, seqs, K/V of layer 1).
    A VirtualKVCache's pool is sized from its layout and page size (the device's default, e.g. 2 MiB on
    CUDA, where head_major takes a page per head, layer and K/V even for short sequences)."""
    max_len = max(lengths)
    if kind in ("per_layer", "interleaved", "head_major"):
        page = page_size or default_page_size(normalize_device(device))
        lay = Layout(kind, layers, hkv, head_dim, dtype.itemsize, len(lengths) + 1, max_len, page)
        needed = sum(lay.runs * lay.pages_for(n) for n in lengths) * page
        cache = VirtualKVCache(
            KVGeometry(layers, hkv, head_dim, dtype),
            VirtualCacheConfig(
                max_seqs=len(lengths) + 1,
                max_seq_len=max_len,
                device=device,
                capacity_bytes=max(64 << 20, needed),
                layout=kind,
                page_size=page,
            ),
        )
    else:
        bs = int(kind.removeprefix("paged"))
        blocks = sum(-(-n // bs) for n in lengths)
        cache = PagedKVCache(
            KVGeometry(layers, hkv, head_dim, dtype),
            PagedCacheConfig(
                max_seqs=len(lengths) + 1, max_seq_len=max_len, device=device, num_blocks=blocks + 3, block_size=bs
            ),
        )
    seqs = [cache.allocate() for _ in lengths]
    # Two rounds of extends interleave the blocks of different sequences in a PagedKVCache.
    for s, n in zip(seqs, lengths):
        cache.extend(s, n // 2)
    for s, n in zip(seqs, lengths):
        cache.extend(s, n - n // 2)
    kvs = []
    for s, n in zip(seqs, lengths):
        for layer in range(layers):
            k = torch.randn(n, hkv, head_dim, device=device).to(dtype)
            v = torch.randn(n, hkv, head_dim, device=device).to(dtype)
            cache.write(layer, s, k, v)
        kvs.append((k, v))
    return cache, seqs, kvs


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_matches_reference(kind, group, head_dim, dtype):
    cache, seqs, kvs = build(kind, dtype, head_dim, LENGTHS)
    q = torch.randn(len(seqs), HKV * group, head_dim).to(dtype)
    out = ops.decode_attention(q, cache, seqs, 1, out=poisoned(q))
    check(out, q, *zip(*kvs))
    # The kernel entry points with their own length checks (no max_len hint), in another batch order.
    order = [3, 0, 4, 2]
    qs = q[order]
    if isinstance(cache, VirtualKVCache):
        out = ops.decode_attention_contiguous(qs, cache.batch(1, [seqs[i] for i in order]), out=poisoned(qs))
    else:
        sub = [seqs[i] for i in order]
        out = ops.decode_attention_paged(
            qs,
            cache.key_caches[1],
            cache.value_caches[1],
            cache.block_tables(sub),
            cache.lengths(sub),
            out=poisoned(qs),
        )
    check(out, qs, *zip(*[kvs[i] for i in order]))


@pytest.mark.parametrize("layout", ["per_layer", "interleaved", "head_major"])
def test_virtual_cache_sizing_with_two_mib_pages(layout):
    """What test_cuda_virtual_cache builds, on the host backend with the CUDA page size (2 MiB): the pool
    must hold every sequence of the batch (head_major takes 8 pages per sequence here)."""
    cache, seqs, kvs = build(layout, torch.bfloat16, 128, LENGTHS, page_size=2 << 20)
    assert cache.pool.page_size == 2 << 20
    q = torch.randn(len(seqs), HKV * 4, 128).to(torch.bfloat16)
    check(ops.decode_attention(q, cache, seqs, 1, out=poisoned(q)), q, *zip(*kvs))


@pytest.mark.parametrize("kind", ["interleaved", "paged16"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_sdpa_and_scale(kind, dtype):
    cache, seqs, kvs = build(kind, dtype, 64, LENGTHS)
    q = torch.randn(len(seqs), HKV * 4, 64).to(dtype)
    check(ops.decode_attention_reference(q, cache, seqs, 1, out=poisoned(q)), q, *zip(*kvs))
    check(ops.decode_attention(q, cache, seqs, 1, scale=0.3), q, *zip(*kvs), scale=0.3)


@pytest.mark.parametrize("kind", ["per_layer", "paged8"])
@pytest.mark.parametrize("head_dim", [80, 33, 256])
def test_any_head_dim_on_cpu(kind, head_dim):
    cache, seqs, kvs = build(kind, torch.float32, head_dim, [5, 70, 3])
    q = torch.randn(3, HKV * 3, head_dim)  # GQA ratio 3: a group that is not a multiple of 4
    check(ops.decode_attention(q, cache, seqs, 1, out=poisoned(q)), q, *zip(*kvs))


ISAS = _C.decode_cpu_isas()  # the CPU code paths this machine can run, "baseline" (the reference) first


def force_isa(monkeypatch, isa):
    """Every CPU entry point (descriptor calls, and the per-step path of caches) on code path `isa`."""
    real, real_rows, real_tables = _C.decode_cpu, _C.decode_cpu_rows, _C.decode_cpu_tables
    monkeypatch.setattr(_C, "decode_cpu", lambda p, n=0, isa_=isa: real(p, n, isa_))
    monkeypatch.setattr(_C, "decode_cpu_rows", lambda *args, isa_=isa: real_rows(*args[:8], isa_))
    monkeypatch.setattr(_C, "decode_cpu_tables", lambda *args, isa_=isa: real_tables(*args[:8], isa_))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", ["interleaved", "head_major", "paged32"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_cpu_code_path(isa, kind, head_dim, dtype, monkeypatch):
    """Each code path the CPU has, forced (baseline: what CPUs without AVX2 run), on every dtype, compiled
    head_dim and GQA group (3: not a multiple of the 4-head tiles; 8: two tiles)."""
    force_isa(monkeypatch, isa)
    cache, seqs, kvs = build(kind, dtype, head_dim, LENGTHS)
    for group in (1, 3, 4, 8):
        q = torch.randn(len(seqs), HKV * group, head_dim).to(dtype)
        check(ops.decode_attention(q, cache, seqs, 1, out=poisoned(q)), q, *zip(*kvs))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("threads", [1, 2])
def test_every_cpu_code_path_long_split(isa, threads, monkeypatch):
    """Split contexts (partial results merged) and chunks cut at every offset, on each code path."""
    force_isa(monkeypatch, isa)
    with torch_threads(threads):
        cache, seqs, kvs = build("per_layer", torch.bfloat16, 128, [1500, 33, 1, 1023], layers=1)
        q = torch.randn(4, HKV * 4, 128).to(torch.bfloat16)
        check(ops.decode_attention(q, cache, seqs, 0, out=poisoned(q)), q, *zip(*kvs))


def test_unknown_or_unsupported_code_path():
    cache, seqs, _ = build("per_layer", torch.float32, 64, [5])
    kv = cache.batch(1, seqs)
    p = _C.DecodeParams()
    p.num_seqs, p.num_heads, p.num_kv_heads, p.head_dim, p.dtype = 1, HKV, HKV, 64, 0
    q = torch.randn(1, HKV, 64)
    out = torch.empty_like(q)
    p.q, p.out, p.k, p.v = q.data_ptr(), out.data_ptr(), kv.k_ptr, kv.v_ptr
    p.lengths, p.slots, p.slot_stride, p.token_stride, p.max_tokens = (
        kv.lengths.data_ptr(),
        kv.slots.data_ptr(),
        kv.slot_stride,
        kv.token_stride,
        5,
    )
    with pytest.raises(InvalidArgumentError, match="isa"):
        _C.decode_cpu(p, 1, "sse9")
    for isa in ("avx2", "avx512", "avx512bf16", "amx"):
        if isa not in ISAS:
            with pytest.raises(InvalidArgumentError, match="cannot run"):
                _C.decode_cpu(p, 1, isa)


def test_cpu_isa_cap_from_the_environment():
    """VPAGED_CPU_ISA caps what isa='auto' runs for the whole process (read once); a path the CPU lacks is no
    cap above it, and a name of no path is refused with the variable named."""
    code = "from vpaged import _C; print(_C.cpu_auto_isa())"

    def auto_isa(value):
        env = dict(os.environ, VPAGED_CPU_ISA=value)
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)

    assert _C.cpu_auto_isa() in ISAS
    for isa in ("baseline", "avx2", "avx512", "avx512bf16", "amx"):
        got = auto_isa(isa)
        assert got.returncode == 0, got.stderr
        expected = isa if isa in ISAS else ISAS[-1]
        assert got.stdout.strip() == expected
    got = auto_isa("avx3")
    assert got.returncode != 0 and "VPAGED_CPU_ISA" in got.stderr and "avx3" in got.stderr


def test_cpu_isa_cap_reaches_the_kernels():
    """Under VPAGED_CPU_ISA=baseline an 'auto' decode call runs the portable path: its output is bit-identical to
    a call forcing baseline on every input, also on inputs where the best path's output differs from the
    portable one's (how often the two round differently depends on the build: the sanitizer build's paths
    agree more often), and the resolution every 'auto' call makes (cpu_auto_isa) names the portable path."""
    if len(ISAS) < 2:
        pytest.skip("this CPU has only the portable path")
    script = """
import torch
from vpaged import _C
print(_C.cpu_auto_isa())
for seed, D, T in ((0, 64, 300), (1, 128, 300), (2, 64, 1000), (3, 128, 1000), (4, 256, 77), (5, 64, 5)):
    torch.manual_seed(seed)
    B, H, HKV = 2, 8, 2
    q = torch.randn(B, H, D)
    k = torch.randn(B, T, HKV, D) * 3
    v = torch.randn(B, T, HKV, D)
    lengths = torch.tensor([T, max(1, T // 3)], dtype=torch.int32)
    slots = torch.arange(B, dtype=torch.int64)
    outs = []
    for isa in ("auto", "baseline", "BEST"):
        out = torch.full_like(q, float("nan"))
        p = _C.DecodeParams()
        p.num_seqs, p.num_heads, p.num_kv_heads, p.head_dim, p.dtype = B, H, HKV, D, 0
        p.q, p.out, p.k, p.v = q.data_ptr(), out.data_ptr(), k.data_ptr(), v.data_ptr()
        p.lengths, p.slots, p.slot_stride, p.token_stride, p.max_tokens = (
            lengths.data_ptr(), slots.data_ptr(), T * HKV * D, HKV * D, T)
        p.head_stride = D
        p.scale = D ** -0.5
        _C.decode_cpu(p, 1, isa)
        outs.append(out)
    print(torch.equal(outs[0], outs[1]), torch.equal(outs[1], outs[2]))
""".replace("BEST", ISAS[-1])
    env = dict(os.environ, VPAGED_CPU_ISA="baseline")
    got = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr
    resolved, *cases = got.stdout.splitlines()
    assert resolved == "baseline"
    assert len(cases) == 6
    for case in cases:
        auto_is_baseline, _baseline_is_best = case.split()
        assert auto_is_baseline == "True"  # where the best path differs, 'auto' differs from it too


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_long_context_split(threads):
    """A long sequence next to short ones: the CPU kernel cuts it into pieces and merges them."""
    with torch_threads(threads):
        cache, seqs, kvs = build("paged16", torch.float32, 64, [2100, 1, 700], layers=1)
        q = torch.randn(3, HKV * 2, 64)
        kvs = [cache.kv(0, s) for s in seqs]
        check(ops.decode_attention(q, cache, seqs, 0, out=poisoned(q)), q, *zip(*kvs))


def descriptor(kv, lengths, slots, layout):
    """A BatchedKV over a plain tensor kv [slots, max_len, 2 (K, V), kv_heads, head_dim] ("interleaved":
    K and V of a token side by side), [2, slots, max_len, kv_heads, head_dim] ("per_layer") or
    [2, slots, kv_heads, max_len, head_dim] ("head_major"). Returns K, V as [slots, max_len, heads, dim]."""
    if layout == "interleaved":
        k, v = kv[:, :, 0], kv[:, :, 1]
        slot_stride, token_stride, head_stride = kv.stride(0), kv.stride(1), kv.stride(3)
    elif layout == "head_major":
        k, v = kv[0].transpose(1, 2), kv[1].transpose(1, 2)
        slot_stride, token_stride, head_stride = kv.stride(1), kv.stride(3), kv.stride(2)
    else:
        k, v = kv[0], kv[1]
        slot_stride, token_stride, head_stride = kv.stride(1), kv.stride(2), kv.stride(3)
    dev = kv.device
    return (
        BatchedKV(
            k.data_ptr(),
            v.data_ptr(),
            torch.tensor(slots, dtype=torch.int32, device=dev),
            torch.tensor(lengths, dtype=torch.int32, device=dev),
            slot_stride,
            token_stride,
            head_stride,
            kv.shape[-2] if layout != "head_major" else kv.shape[2],
            kv.shape[-1],
            kv.dtype,
            dev,
            layout,
            kv,
        ),
        k,
        v,
    )


def run_descriptor_case(dtype, layout, lengths, device, head_dim=128, group=4):
    slots = [3, 0, 2, 1][: len(lengths)]
    max_len = max(lengths)
    shape = {
        "interleaved": (4, max_len, 2, HKV, head_dim),
        "per_layer": (2, 4, max_len, HKV, head_dim),
        "head_major": (2, 4, HKV, max_len, head_dim),
    }[layout]
    kv = torch.randn(shape, device=device).to(dtype)
    bkv, k, v = descriptor(kv, lengths, slots, layout)
    q = torch.randn(len(lengths), HKV * group, head_dim, device=device).to(dtype)
    out = ops.decode_attention_contiguous(q, bkv, out=poisoned(q))
    ks = [k[s, :n] for s, n in zip(slots, lengths)]
    vs = [v[s, :n] for s, n in zip(slots, lengths)]
    check(out, q, ks, vs)


@pytest.mark.parametrize("layout", ["per_layer", "interleaved", "head_major"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_contiguous_descriptor_over_tensors(dtype, layout):
    run_descriptor_case(dtype, layout, [1, 77, 640, 5], "cpu")


@pytest.mark.parametrize("layout", ["bthd", "bhtd"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_from_tensors(dtype, layout):
    """Dense K/V tensors of a user's own cache, lengths below their capacity (a StaticCache-like buffer of
    320 tokens, of which only the first 300 are viewed)."""
    lengths = [1, 77, 300, 5]
    full = (4, 320, HKV, 128) if layout == "bthd" else (4, HKV, 320, 128)
    kbuf, vbuf = torch.randn(full).to(dtype), torch.randn(full).to(dtype)
    k, v = (kbuf[:, :300], vbuf[:, :300]) if layout == "bthd" else (kbuf[:, :, :300], vbuf[:, :, :300])
    bkv = BatchedKV.from_tensors(k, v, lengths, layout=layout)
    assert bkv.owner == (k, v) and bkv.lengths.tolist() == lengths
    kt, vt = (k, v) if layout == "bthd" else (k.transpose(1, 2), v.transpose(1, 2))
    q = torch.randn(4, HKV * 4, 128).to(dtype)
    out = ops.decode_attention_contiguous(q, bkv, out=poisoned(q))
    check(out, q, [kt[i, :n] for i, n in enumerate(lengths)], [vt[i, :n] for i, n in enumerate(lengths)])
    # Lengths as a tensor, and as one int for every row.
    bkv = BatchedKV.from_tensors(k, v, torch.tensor(lengths), layout=layout)
    torch.testing.assert_close(ops.decode_attention_contiguous(q, bkv), out, rtol=0, atol=0)
    bkv = BatchedKV.from_tensors(k, v, 300, layout=layout)
    check(ops.decode_attention_contiguous(q, bkv), q, list(kt), list(vt))


def test_from_tensors_matches_virtual_cache():
    """Identical K/V in a VirtualKVCache and in plain tensors: bit-identical outputs (same kernel, same order)."""
    lengths = [3, 200, 64]
    cache, seqs, _ = build("per_layer", torch.bfloat16, 128, lengths)
    k = torch.zeros(3, max(lengths), HKV, 128, dtype=torch.bfloat16)
    v = torch.zeros_like(k)
    for i, (s, n) in enumerate(zip(seqs, lengths)):
        k[i, :n], v[i, :n] = cache.kv(1, s)
    q = torch.randn(3, HKV * 4, 128).to(torch.bfloat16)
    a = ops.decode_attention(q, cache, seqs, 1)
    b = ops.decode_attention_contiguous(q, BatchedKV.from_tensors(k, v, lengths))
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_from_tensors_errors():
    k = torch.randn(2, 16, HKV, 64)
    with pytest.raises(InvalidArgumentError):
        BatchedKV.from_tensors(k, k.numpy(), 4)
    with pytest.raises(ShapeError):
        BatchedKV.from_tensors(k, k[:, :8], 4)
    with pytest.raises(ShapeError):
        BatchedKV.from_tensors(k[0], k[0], 4)
    with pytest.raises(DTypeError):
        BatchedKV.from_tensors(k.double(), k.double(), 4)
    with pytest.raises(InvalidArgumentError, match="layout"):
        BatchedKV.from_tensors(k, k, 4, layout="tbhd")
    with pytest.raises(ShapeError):  # only the head dim may differ
        BatchedKV.from_tensors(k, torch.randn(2, 16, HKV * 2, 32), 4)
    with pytest.raises(InvalidArgumentError, match="overlap"):  # V's tokens overlap
        BatchedKV.from_tensors(k, torch.randn(4096).as_strided((2, 16, HKV, 48), (2048, 64, 48, 1)), 4)
    with pytest.raises(InvalidArgumentError, match="dense"):
        BatchedKV.from_tensors(k[..., ::2], k[..., ::2], 4)
    shared_heads = torch.randn(2, 16, 1, 64).expand(2, 16, HKV, 64)  # every head the same memory
    with pytest.raises(InvalidArgumentError, match="head"):
        BatchedKV.from_tensors(shared_heads, shared_heads, 4)
    for bad in ([4, 17], [0, 3], [4, 2.0], 99):
        with pytest.raises(InvalidArgumentError):
            BatchedKV.from_tensors(k, k, bad)
    with pytest.raises(ShapeError):
        BatchedKV.from_tensors(k, k, [4, 4, 4])
    with pytest.raises(InvalidArgumentError):
        BatchedKV.from_tensors(k, k, torch.tensor([4, 17]))


# ------------------------------------------------------------------------- values with their own head dim
KV_DIMS = [(192, 128), (64, 128), (128, 64), (80, 48)]  # 192/128 has its own AVX-512 and CUDA build


def test_batched_kv_v_fields_default_to_k():
    k = torch.randn(2, 8, HKV, 64)
    a = BatchedKV(k.data_ptr(), k.data_ptr(), None, None, 4096, 128, 64, HKV, 64, k.dtype, k.device, "x", k)
    assert (a.v_head_dim, a.v_slot_stride, a.v_token_stride, a.v_head_stride) == (64, 4096, 128, 64)
    b = BatchedKV(
        k.data_ptr(), k.data_ptr(), None, None, 4096, 128, 64, HKV, 64, k.dtype, k.device, "x", k, v_head_dim=32
    )
    assert (b.v_head_dim, b.v_slot_stride, b.v_token_stride, b.v_head_stride) == (32, 4096, 128, 32)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dims", KV_DIMS, ids=lambda d: f"{d[0]}-{d[1]}")
@pytest.mark.parametrize("layout", ["bthd", "bhtd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_from_tensors_values_with_own_head_dim(isa, dims, layout, dtype, monkeypatch):
    """K and V of different head dims (and so different strides), GQA groups 1, 3 and 4, a long sequence
    (split across threads and merged) next to short ones, on every CPU code path."""
    force_isa(monkeypatch, isa)
    d, dv = dims
    lengths = [1, 77, 1300, 5]
    shape = (4, 1310, HKV) if layout == "bthd" else (4, HKV, 1310)
    kbuf, vbuf = torch.randn(*shape, d).to(dtype), torch.randn(*shape, dv).to(dtype)
    bkv = BatchedKV.from_tensors(kbuf, vbuf, lengths, layout=layout)
    assert (bkv.head_dim, bkv.v_head_dim) == (d, dv)
    kt, vt = (kbuf, vbuf) if layout == "bthd" else (kbuf.transpose(1, 2), vbuf.transpose(1, 2))
    ks, vs = [kt[i, :n] for i, n in enumerate(lengths)], [vt[i, :n] for i, n in enumerate(lengths)]
    with torch_threads(2):
        for group in (1, 3, 4):
            q = torch.randn(4, HKV * group, d).to(dtype)
            out = ops.decode_attention_contiguous(
                q, bkv, out=torch.full((4, HKV * group, dv), float("nan"), dtype=dtype)
            )
            assert out.shape == (4, HKV * group, dv)
            check(out, q, ks, vs)


def paged_pools(dtype, d, dv, lengths, block_size=16, device="cpu"):
    """Block pools of K (head dim d) and V (dv) with each sequence's blocks scattered at random; returns
    (key_cache, value_cache, block_tables, lengths tensor, per-sequence K, per-sequence V)."""
    need = [-(-n // block_size) for n in lengths]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks).tolist()
    kc = torch.randn(num_blocks, block_size, HKV, d, device=device).to(dtype)
    vc = torch.randn(num_blocks, block_size, HKV, dv, device=device).to(dtype)
    tables = torch.full((len(lengths), max(need) + 1), -1, dtype=torch.int32)
    ks, vs, used = [], [], 0
    for i, (n, b) in enumerate(zip(lengths, need)):
        ids = perm[used : used + b]
        used += b
        tables[i, :b] = torch.tensor(ids, dtype=torch.int32)
        ks.append(kc[ids].reshape(-1, HKV, d)[:n])
        vs.append(vc[ids].reshape(-1, HKV, dv)[:n])
    lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    return kc, vc, tables.to(device), lens, ks, vs


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dims", KV_DIMS, ids=lambda d: f"{d[0]}-{d[1]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_values_with_own_head_dim(isa, dims, dtype, monkeypatch):
    force_isa(monkeypatch, isa)
    d, dv = dims
    kc, vc, tables, lens, ks, vs = paged_pools(dtype, d, dv, [1, 40, 700, 17])
    for group in (1, 4):
        q = torch.randn(4, HKV * group, d).to(dtype)
        out = ops.decode_attention_paged(q, kc, vc, tables, lens)
        assert out.shape == (4, HKV * group, dv)
        check(out, q, ks, vs)
    with pytest.raises(ShapeError, match="v_head_dim"):  # an output of K's head dim
        ops.decode_attention_paged(q, kc, vc, tables, lens, out=torch.empty(4, HKV * 4, d, dtype=dtype))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_contiguous_descriptor_values_with_own_strides(isa, dtype, monkeypatch):
    """One buffer [slots, max_len, HKV * 192 + HKV * 128]: each token row holds its K heads then its V heads,
    described by the V fields of a BatchedKV (what a cache with interleaved K/V of two head dims hands out)."""
    force_isa(monkeypatch, isa)
    d, dv, max_len = 192, 128, 400
    buf = torch.randn(4, max_len, HKV * (d + dv)).to(dtype)
    k = buf[..., : HKV * d].unflatten(-1, (HKV, d))
    v = buf[..., HKV * d :].unflatten(-1, (HKV, dv))
    slots, lengths = [2, 0, 3], [400, 1, 129]
    row = HKV * (d + dv)
    bkv = BatchedKV(
        k.data_ptr(),
        v.data_ptr(),
        torch.tensor(slots, dtype=torch.int32),
        torch.tensor(lengths, dtype=torch.int32),
        max_len * row,
        row,
        d,
        HKV,
        d,
        dtype,
        buf.device,
        "interleaved",
        buf,
        v_head_dim=dv,
        v_token_stride=row,
    )
    assert (bkv.v_slot_stride, bkv.v_head_stride) == (max_len * row, dv)
    q = torch.randn(3, HKV * 4, d).to(dtype)
    out = ops.decode_attention_contiguous(q, bkv, out=torch.full((3, HKV * 4, dv), float("nan"), dtype=dtype))
    check(out, q, [k[s, :n] for s, n in zip(slots, lengths)], [v[s, :n] for s, n in zip(slots, lengths)])
    # V rows reaching past the buffer (a V slot stride too large for it) are refused before any read.
    bad = dataclasses.replace(bkv, v_slot_stride=max_len * row * 2)
    with pytest.raises(InvalidArgumentError, match="V rows"):
        ops.decode_attention_contiguous(q, bad)
    overlapping = dataclasses.replace(bkv, v_token_stride=dv)  # V tokens overlap each other
    with pytest.raises(InvalidArgumentError, match="V's token_stride"):
        ops.decode_attention_contiguous(q, overlapping)


def test_noncontiguous_query_and_new_output():
    cache, seqs, kvs = build("paged16", torch.float32, 64, [9, 40])
    q = torch.randn(HKV * 4, 2, 64).transpose(0, 1)  # a strided view
    assert not q.is_contiguous()
    check(ops.decode_attention(q, cache, seqs, 1), q, *zip(*kvs))


# --------------------------------------------------------------------------------------------- errors
@pytest.fixture
def paged():
    cache, seqs, _ = build("paged16", torch.float32, 64, [9, 40])
    return cache, seqs


def paged_args(cache, seqs, **over):
    args = dict(
        q=torch.randn(len(seqs), HKV * 2, 64),
        key_cache=cache.key_caches[0],
        value_cache=cache.value_caches[0],
        block_tables=cache.block_tables(seqs),
        lengths=cache.lengths(seqs),
    )
    args.update(over)
    return args


@pytest.mark.parametrize(
    "change, error",
    [
        (dict(q=torch.randn(2, 4, 32)), ShapeError),  # head_dim differs
        (dict(q=torch.randn(2, 3, 64)), ShapeError),  # heads not a multiple of kv heads
        (dict(q=torch.randn(2, 4, 64).double()), DTypeError),
        (dict(q=torch.randn(2, 4, 64).half()), DTypeError),  # differs from the cache
        (dict(lengths=torch.tensor([9, 0])), InvalidArgumentError),
        (dict(lengths=torch.tensor([9, 10**6])), InvalidArgumentError),
        (dict(lengths=torch.tensor([9])), ShapeError),
        (dict(lengths=torch.tensor([9.0, 4.0])), DTypeError),
        (dict(block_tables=torch.full((2, 4), 999, dtype=torch.int32)), InvalidArgumentError),
        (dict(block_tables=torch.zeros(3, 4, dtype=torch.int32)), ShapeError),
        (dict(out=torch.empty(2, 4, 63)), ShapeError),
        (dict(out=torch.empty(4, 2, 64).transpose(0, 1)), InvalidArgumentError),
        (dict(max_len=0), InvalidArgumentError),
    ],
)
def test_paged_argument_errors(paged, change, error):
    cache, seqs = paged
    with pytest.raises(error):
        ops.decode_attention_paged(**paged_args(cache, seqs, **change))


def test_cache_argument_errors(paged):
    cache, seqs = paged
    q = torch.randn(2, HKV, 64)
    with pytest.raises(vpaged.LayerIndexError):
        ops.decode_attention(q, cache, seqs, 2)
    with pytest.raises(vpaged.UnknownSequenceError):
        ops.decode_attention(q, cache, [seqs[0], 99], 0)
    with pytest.raises(ShapeError, match="rows for"):
        ops.decode_attention(q, cache, seqs[:1], 0)
    empty = cache.allocate()
    with pytest.raises(InvalidArgumentError, match="no tokens"):
        ops.decode_attention(q, cache, [seqs[0], empty], 0)
    with pytest.raises(InvalidArgumentError):
        ops.decode_attention(q, object(), seqs, 0)
    with pytest.raises(ShapeError):
        ops.decode_attention_paged(
            q,
            cache.key_caches[0],
            cache.value_caches[0][:, :8].contiguous(),
            cache.block_tables(seqs),
            cache.lengths(seqs),
        )
    with pytest.raises(InvalidArgumentError):
        ops.decode_attention_paged(
            q, cache.key_caches[0][:, :8], cache.value_caches[0][:, :8], cache.block_tables(seqs), cache.lengths(seqs)
        )  # not a dense pool
    f64 = VirtualKVCache(
        KVGeometry(1, HKV, 64, torch.float64), VirtualCacheConfig(max_seqs=2, max_seq_len=16, capacity_bytes=4 << 20)
    )
    s = f64.allocate()
    f64.extend(s, 3)
    with pytest.raises(DTypeError):
        ops.decode_attention(q[:1].double(), f64, [s], 0)


def test_contiguous_descriptor_errors():
    kv = torch.randn(2, 2, 16, HKV, 64)
    bkv, _, _ = descriptor(kv, [4, 16], [0, 1], "per_layer")
    q = torch.randn(2, HKV, 64)
    ops.decode_attention_contiguous(q, bkv)
    too_long, _, _ = descriptor(kv, [4, 17], [0, 1], "per_layer")
    with pytest.raises(InvalidArgumentError):
        ops.decode_attention_contiguous(q, too_long)
    outside, _, _ = descriptor(kv, [4, 16], [0, 2], "per_layer")  # slot 2 lies past the tensor
    with pytest.raises(InvalidArgumentError, match="outside"):
        ops.decode_attention_contiguous(q, outside)
    with pytest.raises(InvalidArgumentError):
        ops.decode_attention_contiguous(q, (kv, kv))


@pytest.mark.skipif(HAS_CUDA, reason="checks the error raised where no CUDA device is usable")
def test_cuda_entry_point_without_gpu_raises_backend_error():
    p = _C.DecodeParams()
    p.num_seqs, p.num_heads, p.num_kv_heads, p.head_dim = 1, 2, 2, 64
    p.q = p.out = p.k = p.v = p.lengths = p.slots = 4096  # never dereferenced: no device is reached
    p.token_stride, p.max_tokens = 128, 1
    launch = _C.CudaLaunch()
    launch.split_tokens = 1
    # Built without CUDA: BackendUnavailableError saying so; built with CUDA but no driver/device: BackendError.
    with pytest.raises(BackendError, match=None if _C.kernels_built_with_cuda() else "without CUDA"):
        _C.decode_cuda(p, launch)
    if _C.kernels_built_with_cuda():
        p.head_dim = 80  # the CUDA kernels take 64, 128, 256: refused before any device is touched
        with pytest.raises(InvalidArgumentError):
            _C.decode_cuda(p, launch)


# --------------------------------------------------------------------------------------------- CUDA
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="torch.cuda is not available (no CUDA GPU)")
@pytest.mark.parametrize("lengths", [[1, 37, 300, 129], [3000, 1, 4097, 513]], ids=["one_pass", "split"])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_paged(dtype, head_dim, group, lengths):
    cache, seqs, kvs = build("paged16", dtype, head_dim, lengths, device="cuda", layers=1)
    q = torch.randn(len(seqs), HKV * group, head_dim, device="cuda").to(dtype)
    out = ops.decode_attention(q, cache, seqs, 0, out=poisoned(q))
    check(out, q, *zip(*kvs))
    out = ops.decode_attention_paged(
        q, cache.key_caches[0], cache.value_caches[0], cache.block_tables(seqs), cache.lengths(seqs), out=poisoned(q)
    )
    check(out, q, *zip(*kvs))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="torch.cuda is not available (no CUDA GPU)")
@pytest.mark.parametrize("lengths", [[1, 77, 300, 5], [1, 2900, 4000]], ids=["one_pass", "split"])
@pytest.mark.parametrize("layout", ["per_layer", "interleaved", "head_major"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_contiguous(dtype, layout, lengths):
    run_descriptor_case(dtype, layout, lengths, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="torch.cuda is not available (no CUDA GPU)")
@pytest.mark.parametrize("lengths", [[1, 77, 300, 5], [1, 2900, 4000]], ids=["one_pass", "split"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_values_with_own_head_dim(dtype, lengths):
    """K 192 / V 128 on CUDA: dense tensors (from_tensors) and block pools, GQA groups 1 and 4."""
    for layout in ("bthd", "bhtd"):
        shape = (len(lengths), max(lengths), HKV) if layout == "bthd" else (len(lengths), HKV, max(lengths))
        k = torch.randn(*shape, 192, device="cuda").to(dtype)
        v = torch.randn(*shape, 128, device="cuda").to(dtype)
        bkv = BatchedKV.from_tensors(k, v, lengths, layout=layout)
        kt, vt = (k, v) if layout == "bthd" else (k.transpose(1, 2), v.transpose(1, 2))
        for group in (1, 4):
            q = torch.randn(len(lengths), HKV * group, 192, device="cuda").to(dtype)
            out = ops.decode_attention_contiguous(q, bkv)
            check(out, q, [kt[i, :n] for i, n in enumerate(lengths)], [vt[i, :n] for i, n in enumerate(lengths)])
    kc, vc, tables, lens, ks, vs = paged_pools(dtype, 192, 128, lengths, device="cuda")
    q = torch.randn(len(lengths), HKV * 4, 192, device="cuda").to(dtype)
    check(ops.decode_attention_paged(q, kc, vc, tables, lens), q, ks, vs)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="torch.cuda is not available (no CUDA GPU)")
@pytest.mark.parametrize("layout", ["per_layer", "interleaved", "head_major"])
def test_cuda_virtual_cache(layout):
    info = vpaged.backends()["cuda"]
    if not info.usable:
        pytest.skip(f"VirtualKVCache cannot use CUDA here: {info.reason}")
    cache, seqs, kvs = build(layout, torch.bfloat16, 128, LENGTHS, device="cuda")
    q = torch.randn(len(seqs), HKV * 4, 128, device="cuda").to(torch.bfloat16)
    check(ops.decode_attention(q, cache, seqs, 1, out=poisoned(q)), q, *zip(*kvs))


def test_cache_steps_follow_lengths_and_slots():
    """The per-step path of a CPU VirtualKVCache builds a layer's parameters once: later steps must still see
    every length change, a slot freed and reused, and each layer's own K/V."""
    cache, seqs, kvs = build("per_layer", torch.float32, 64, [5, 40])
    q = torch.randn(2, HKV * 4, 64)
    check(ops.decode_attention(q, cache, seqs, 1, out=poisoned(q)), q, *zip(*kvs))
    k0, v0 = cache.kv(0, seqs[0])
    check(ops.decode_attention(q[:1], cache, seqs[:1], 0, out=poisoned(q[:1])), q[:1], [k0], [v0])
    # A step later: one sequence grew, the other was freed and its slot reused by a new one.
    cache.extend(seqs[0], 7)
    k, v = torch.randn(7, HKV, 64), torch.randn(7, HKV, 64)
    cache.write(1, seqs[0], k, v)
    grown = (torch.cat([kvs[0][0], k]), torch.cat([kvs[0][1], v]))
    cache.free(seqs[1])
    new = cache.allocate()
    cache.extend(new, 3)
    nk, nv = torch.randn(3, HKV, 64), torch.randn(3, HKV, 64)
    cache.write(1, new, nk, nv)
    got = ops.decode_attention(q, cache, [new, seqs[0]], 1, out=poisoned(q))
    check(got, q, [nk, grown[0]], [nv, grown[1]])


def test_cache_steps_refuse_what_the_kernel_must_not_read():
    cache = VirtualKVCache(
        KVGeometry(2, HKV, 64, torch.bfloat16),
        VirtualCacheConfig(max_seqs=2, max_seq_len=40, capacity_bytes=8 << 20, swap_bytes=4 << 20),
    )
    seqs = cache.allocate_many(2)
    for s, n in zip(seqs, (5, 40)):
        cache.extend(s, n)
        cache.write(1, s, torch.randn(n, HKV, 64).to(torch.bfloat16), torch.randn(n, HKV, 64).to(torch.bfloat16))
    q = torch.randn(2, HKV, 64).to(torch.bfloat16)
    ops.decode_attention(q, cache, seqs, 1)  # the layer's parameters now exist
    base = layer_plan(cache, 1).params
    out = poisoned(q)
    rows = dict(q=q.data_ptr(), out=out.data_ptr(), num_heads=HKV, scale=0.125)
    capacity = base.max_tokens  # tokens a slot can hold: the entry refuses longer lengths
    assert 40 <= capacity < 10**6
    for slots, lengths in (([0, 1], [5, capacity + 1]), ([0, 1], [5, 0]), ([0, 1], [5]), ([0], [-1])):
        with pytest.raises(InvalidArgumentError):
            _C.decode_cpu_rows(base, slots=slots, lengths=lengths, **rows)
        assert torch.isnan(out).all()  # nothing was written
    cache.swap_out(seqs[1])
    with pytest.raises(vpaged.SequenceSwappedError):
        ops.decode_attention(q, cache, seqs, 1)
    cache.close()
    with pytest.raises(vpaged.VPagedError):
        ops.decode_attention(q, cache, seqs, 1)
