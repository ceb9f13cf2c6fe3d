"""vpaged.ops.fused: RMSNorm and SiLU-and-multiply in one pass, against float64 references and eager PyTorch.

Every CPU code path this machine has is forced (the portable build and AVX2; AVX-512 CPUs run the AVX2 build),
on fresh random shapes whose widths are not multiples of the vector width (the tail path), strided rows,
both dtypes; bf16 results are held to two bf16 rounding steps of the eager formula and of float64, fp32 ones
to a few ulp of float64. Splitting rows across threads changes no bit. Bad arguments raise typed errors."""

import pytest
import torch
import torch.nn.functional as F

from vpaged import _C
from vpaged.errors import DTypeError, InvalidArgumentError, ShapeError
from vpaged.ops.fused import rms_norm, silu_mul

ISAS = _C.decode_cpu_isas()
DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [(1, 1), (3, 7), (5, 8), (4, 33), (64, 1024), (9, 1001), (2, 4099)]


def rng(seed):
    return torch.Generator().manual_seed(seed)


def eager_rms_norm(x, w, eps):
    """LlamaRMSNorm.forward, as transformers writes it."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def rms_norm_f64(x, w, eps):
    h = x.double()
    return w.double() * h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + eps)


def silu_mul_f64(g, u):
    g = g.double()
    return g / (1 + torch.exp(-g)) * u.double()


def assert_near(got, ref_f64, dtype, scale=None):
    """fp32: within a few ulp of float64 (relative to each row's magnitude; a row's sum of squares in fp32
    partial sums costs some); bf16: two rounding steps (the eager formula rounds twice, and a sum that differs
    in its last fp32 bit may round the normalised value the other way)."""
    assert got.dtype == dtype
    diff = (got.double() - ref_f64).abs()
    if scale is None:
        scale = ref_f64.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    rel = 1e-6 if dtype == torch.float32 else 2**-6
    assert bool((diff <= rel * scale + 1e-30).all()), f"max relative error {(diff / scale).max().item():.3e}"


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_rms_norm_matches_float64_and_the_eager_formula(shape, dtype, isa):
    g = rng(shape[0] * 7919 + shape[1])
    x = (torch.randn(shape, generator=g) * torch.rand(shape[0], 1, generator=g) * 10).to(dtype)
    w = torch.randn(shape[1], generator=g).to(dtype)
    eps = float(torch.rand(1, generator=g)) * 1e-5
    got = rms_norm(x, w, eps, isa=isa)
    assert got.shape == x.shape
    assert_near(got, rms_norm_f64(x, w, eps), dtype)
    eager = eager_rms_norm(x, w, eps)
    if dtype == torch.bfloat16:  # the eager code's roundings are replicated
        assert_near(got, eager.double(), dtype, scale=eager.double().abs().clamp_min(1e-30))
    else:
        torch.testing.assert_close(got, eager, atol=1e-6, rtol=2e-6)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_silu_mul_matches_float64_and_eager_on_separate_and_halved_inputs(shape, dtype, isa):
    g = rng(shape[0] * 104729 + shape[1])
    gate = (torch.randn(shape, generator=g) * 6).to(dtype)
    up = torch.randn(shape, generator=g).to(dtype)
    ref = silu_mul_f64(gate, up)
    scale = ref.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    got = silu_mul(gate, up, isa=isa)
    assert got.shape == gate.shape
    assert_near(got, ref, dtype, scale)
    halves = silu_mul(torch.cat([gate, up], dim=-1), isa=isa)  # a fused gate_up product's layout
    assert torch.equal(halves, got)
    eager = F.silu(gate) * up
    if dtype == torch.bfloat16:
        assert_near(got, eager.double(), dtype, scale=eager.double().abs().clamp_min(1e-30))
    else:
        torch.testing.assert_close(got, eager, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("isa", ISAS)
def test_strided_and_higher_dimensional_inputs(isa):
    g = rng(5)
    wide = torch.randn(2, 6, 1040, generator=g)
    x = wide[..., :1000]  # rows 1040 apart, the last dim dense
    w = torch.randn(1000, generator=g)
    torch.testing.assert_close(
        rms_norm(x, w, 1e-6, isa=isa), rms_norm(x.contiguous(), w, 1e-6, isa=isa), atol=0, rtol=0
    )
    xt = torch.randn(1000, 12, generator=g).t()  # a last dim with stride 12: copied first
    torch.testing.assert_close(rms_norm(xt, w, 1e-6, isa=isa), eager_rms_norm(xt, w, 1e-6), atol=1e-6, rtol=1e-6)
    gate, up = wide[..., :500], wide[..., 520:1020]
    assert_near(silu_mul(gate, up, isa=isa), silu_mul_f64(gate, up), torch.float32)


@pytest.mark.parametrize("isa", ISAS)
def test_extreme_values(isa):
    gate = torch.tensor([[-100.0, -30.0, -1e-30, 0.0, 1e-30, 30.0, 100.0, 80.0, float("nan"), float("inf"), 3.0]])
    up = torch.full_like(gate, 2.0)
    got = silu_mul(gate, up, isa=isa)
    ref = silu_mul_f64(gate, up)
    finite = torch.isfinite(ref)
    assert torch.isnan(got[0, 8]) and got[0, 9] == float("inf")
    assert torch.allclose(got[finite].double(), ref[finite], atol=1e-30, rtol=4e-7)
    zeros = torch.zeros(3, 20)
    assert torch.equal(rms_norm(zeros, torch.ones(20), 1e-6, isa=isa), zeros)  # eps keeps it finite
    x = torch.randn(2, 20, generator=rng(1))
    x[1, 3] = float("nan")
    out = rms_norm(x, torch.ones(20), 1e-6, isa=isa)
    assert torch.isfinite(out[0]).all() and torch.isnan(out[1]).all()
    big = torch.full((1, 64), 1e18)
    torch.testing.assert_close(rms_norm(big, torch.ones(64), 1e-6, isa=isa), torch.ones(1, 64))


def test_threads_split_rows_without_changing_a_bit():
    g = rng(9)
    x, w = torch.randn(300, 1000, generator=g), torch.randn(1000, generator=g)
    gate, up = torch.randn(300, 700, generator=g), torch.randn(300, 700, generator=g)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = rms_norm(x, w, 1e-6), silu_mul(gate, up)
        torch.set_num_threads(max(2, before))
        many = rms_norm(x, w, 1e-6), silu_mul(gate, up)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one[0], many[0]) and torch.equal(one[1], many[1])


def test_empty_rows_give_empty_results():
    assert rms_norm(torch.empty(0, 16), torch.ones(16), 1e-6).shape == (0, 16)
    assert silu_mul(torch.empty(2, 0, 8)).shape == (2, 0, 4)


def test_bad_arguments_raise_typed_errors():
    x, w = torch.randn(4, 16), torch.randn(16)
    with pytest.raises(DTypeError):
        rms_norm(x.half(), w.half(), 1e-6)
    with pytest.raises(DTypeError):
        rms_norm(x.double(), w.double(), 1e-6)
    with pytest.raises(DTypeError):
        rms_norm(x, w.bfloat16(), 1e-6)
    with pytest.raises(ShapeError):
        rms_norm(x, torch.randn(15), 1e-6)
    with pytest.raises(ShapeError):
        rms_norm(x, torch.randn(1, 16), 1e-6)
    with pytest.raises(ShapeError):
        rms_norm(torch.randn(4, 0), torch.randn(0), 1e-6)
    with pytest.raises(InvalidArgumentError):
        rms_norm(x, w, -1.0)
    with pytest.raises(InvalidArgumentError):
        rms_norm(x, w, "1e-6")
    with pytest.raises(InvalidArgumentError):
        rms_norm(x.to("meta"), w.to("meta"), 1e-6)
    with pytest.raises(InvalidArgumentError):
        rms_norm(x.tolist(), w, 1e-6)
    with pytest.raises(InvalidArgumentError):
        rms_norm(x, w, 1e-6, isa="sse9")
    with pytest.raises(ShapeError):
        silu_mul(torch.randn(3, 5))  # odd [gate | up]
    with pytest.raises(ShapeError):
        silu_mul(torch.randn(3, 4), torch.randn(3, 5))
    with pytest.raises(DTypeError):
        silu_mul(torch.randn(3, 4), torch.randn(3, 4).bfloat16())
    with pytest.raises(InvalidArgumentError):
        silu_mul(torch.randn(3, 4, requires_grad=True), torch.randn(3, 4))
    with torch.no_grad():  # no autograd recording: fine
        silu_mul(torch.randn(3, 4, requires_grad=True), torch.randn(3, 4))
