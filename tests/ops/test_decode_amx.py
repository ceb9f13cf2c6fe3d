"""The AMX code path of CPU decode attention (csrc/kernels/decode_cpu_amx.cpp), on CPUs that have AMX-BF16 and whose
OS grants the tile state; skipped elsewhere with the reason.

What the path covers (bf16 q/K/V/out, contiguous K/V, 4 to 16 query heads per kv head, head dims 64/64, 128/128,
256/256 and 192/128) is checked against a float64 reference within the bound its header states: probabilities
rounded to bf16 for P.V move an output by at most 2^-9 max|v|, on top of the bf16 output's own rounding. What it
does not cover (fewer than 4 or more than 16 query heads per kv head, a block table, other dtypes, quantized K/V)
runs the avx512bf16 build on this path: bit-identical outputs.
"""

import contextlib
import math

import pytest
import torch

from vpaged import _C, ops
from vpaged.errors import InvalidArgumentError
from vpaged.kvcache.records import BatchedKV

ISAS = _C.decode_cpu_isas()
needs_amx = pytest.mark.skipif(
    "amx" not in ISAS,
    reason=f"this CPU (or its OS) offers no AMX-BF16 tile state: its code paths are {ISAS}",
)


@contextlib.contextmanager
def code_path(isa):
    """Every descriptor call of the CPU kernel within the block on code path `isa`."""
    real = _C.decode_cpu
    _C.decode_cpu = lambda p, n=0: real(p, n, isa)
    try:
        yield
    finally:
        _C.decode_cpu = real


def decode_on(isa, q, kv, **kwargs):
    with code_path(isa):
        return ops.decode_attention_contiguous(q, kv, **kwargs)


def reference(q, k, v, lengths):
    """float64 attention of q [B, H, D] over k [B, T, HKV, D] / v [B, T, HKV, DV], sequence b over its first
    lengths[b] tokens."""
    batch, heads, dim = q.shape
    hkv = k.shape[2]
    out = torch.empty(batch, heads, v.shape[-1], dtype=torch.float64)
    for b in range(batch):
        n = int(lengths[b])
        grouped = q[b].double().view(hkv, heads // hkv, dim)
        s = torch.einsum("kgd,tkd->kgt", grouped, k[b, :n].double()) / math.sqrt(dim)
        out[b] = torch.einsum("kgt,tkd->kgd", s.softmax(-1), v[b, :n].double()).reshape(heads, -1)
    return out


def random_case(batch, tokens, hkv, group, dim, v_dim, layout="bthd", lengths=None):
    """Random bf16 K/V/q and a descriptor over them; lengths: the first sequence full, the others random (or as
    given)."""
    k = torch.randn(batch, tokens, hkv, dim).to(torch.bfloat16)
    v = torch.randn(batch, tokens, hkv, v_dim).to(torch.bfloat16)
    q = torch.randn(batch, hkv * group, dim).to(torch.bfloat16)
    if lengths is None:
        lengths = [tokens, *torch.randint(1, tokens + 1, (batch - 1,)).tolist()]
    lengths = torch.tensor(lengths, dtype=torch.int32)
    if layout == "bthd":
        kv = BatchedKV.from_tensors(k, v, lengths)
    else:
        kv = BatchedKV.from_tensors(k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous(), lengths, "bhtd")
    return q, k, v, lengths, kv


def assert_within_amx_bound(out, q, k, v, lengths):
    ref = reference(q, k, v, lengths)
    got = out.double()
    assert torch.isfinite(got).all()
    # The probabilities' bf16 rounding (2^-9 max|v| at most), the output's own (half an ulp of bf16: 2^-9 relative)
    # and the fp32 sums' (far below either).
    bound = 2.0**-9 * v.double().abs().amax() + 2.0**-8 * ref.abs() + 1e-5
    excess = (got - ref).abs() - bound
    assert excess.max() <= 0, f"off the reference by {excess.max().item():.3g} beyond the stated bound"


@needs_amx
@pytest.mark.parametrize("dims", [(64, 64), (128, 128), (256, 256), (192, 128)])
@pytest.mark.parametrize("group", [4, 5, 8, 16])
@pytest.mark.parametrize("layout", ["bthd", "bhtd"])
def test_amx_decode_within_its_bound(dims, group, layout):
    dim, v_dim = dims
    # Lengths at the kernel's boundaries (16-row tiles, 32-token chunks), and one long enough to be cut into items.
    q, k, v, lengths, kv = random_case(6, 700, 2, group, dim, v_dim, layout, [700, 1, 15, 17, 33, 300])
    out = decode_on("amx", q, kv, out=torch.full((6, 2 * group, v_dim), float("nan")).bfloat16())
    assert_within_amx_bound(out, q, k, v, lengths)


@needs_amx
@pytest.mark.parametrize("threads", [1, 2])
def test_amx_decode_long_contexts_split_and_merged(threads):
    """A 5,000-token sequence beside short ones: cut into items on several threads, partial results merged."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, k, v, lengths, kv = random_case(3, 5000, 4, 4, 128, 128)
        out = decode_on("amx", q, kv)
    finally:
        torch.set_num_threads(old)
    assert_within_amx_bound(out, q, k, v, lengths)


@needs_amx
def test_amx_rounds_probabilities_to_bf16_only():
    """Same inputs on avx512bf16 (fp32 probabilities) and amx: both within the amx bound of the reference, not
    identical (the amx item ran); attention over one token is exact on amx."""
    q, k, v, lengths, kv = random_case(4, 300, 2, 4, 128, 128)
    outs = {isa: decode_on(isa, q, kv) for isa in ("avx512bf16", "amx")}
    for out in outs.values():
        assert_within_amx_bound(out, q, k, v, lengths)
    # The tile products did run: over hundreds of tokens the probabilities' rounding shows in some output.
    assert not torch.equal(outs["avx512bf16"], outs["amx"])
    single = decode_on("amx", q, BatchedKV.from_tensors(k, v, torch.ones(4, dtype=torch.int32)))
    # Attention over one token is that token's V row: probability 1 is exact in bf16.
    expected = v[:, 0].repeat_interleave(4, dim=1)
    torch.testing.assert_close(single, expected, rtol=0, atol=0)


@needs_amx
@pytest.mark.parametrize(
    "case",
    ["group_of_2", "group_of_3", "group_of_32", "float32", "float16"],
)
def test_what_amx_does_not_cover_runs_the_avx512bf16_build(case):
    """Bit-identical to the avx512bf16 path where the AMX item does not apply."""
    group, dtype = (int(case.split("_")[-1]), torch.bfloat16) if case.startswith("group") else (4, getattr(torch, case))
    k = torch.randn(2, 200, 1, 128).to(dtype)
    v = torch.randn(2, 200, 1, 128).to(dtype)
    q = torch.randn(2, group, 128).to(dtype)
    kv = BatchedKV.from_tensors(k, v, torch.tensor([200, 77], dtype=torch.int32))
    torch.testing.assert_close(decode_on("avx512bf16", q, kv), decode_on("amx", q, kv), rtol=0, atol=0)


def test_amx_is_a_named_path_refused_where_absent():
    """'amx' is a code path name everywhere; a CPU (or OS) without it refuses it with the reason."""
    k = torch.randn(1, 8, 1, 64).to(torch.bfloat16)
    kv = BatchedKV.from_tensors(k, k.clone(), [8])
    q = torch.randn(1, 2, 64).to(torch.bfloat16)
    if "amx" in ISAS:
        assert torch.isfinite(decode_on("amx", q, kv)).all()
    else:
        with pytest.raises(InvalidArgumentError, match="AMX"):
            decode_on("amx", q, kv)
