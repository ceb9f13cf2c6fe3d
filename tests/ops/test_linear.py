"""vpaged.ops.linear: the small-batch panel product against a float64 reference and F.linear.

Every CPU code path this machine has is forced (the portable build and AVX2; AVX-512 CPUs run the AVX2 build), on
fresh random shapes: row counts around the 6-row tile and the row chunks, output counts that leave a partial last
panel, strided rows, float32 and bfloat16 rows and weights in every mix, with and without bias. An fp32 result is a
dot product of length K in fp32: held to K ulp-sized steps of the float64 sum of |x| |w| (the bound of any ordered
fp32 sum); a bf16 result adds one bf16 rounding. Splitting panels across threads changes no bit. Bad arguments
raise typed errors and write nothing."""

import random

import pytest
import torch
import torch.nn.functional as F

from vpaged import _C
from vpaged.errors import DTypeError, InvalidArgumentError, ShapeError
from vpaged.ops.linear import PANEL_WIDTH, pack_panels, panel_linear

ISAS = _C.decode_cpu_isas()
DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [(1, 1, 1), (1, 576, 192), (5, 64, 17), (6, 33, 16), (7, 100, 31), (13, 576, 576), (32, 96, 48), (257, 40, 50)]


def gen(seed):
    return torch.Generator().manual_seed(seed)


def reference(x, w, bias):
    """(float64 product, float64 sum of |x| |w| per output: the scale of an fp32 sum's error)."""
    ref = x.double() @ w.double().T
    mag = x.double().abs() @ w.double().abs().T
    if bias is not None:
        ref = ref + bias.double()
        mag = mag + bias.double().abs()
    return ref, mag


def assert_close(got, x, w, bias, dtype):
    ref, mag = reference(x, w, bias)
    k = x.shape[-1]
    bound = mag * (k + 2) * 2**-24 + 1e-30
    if dtype == torch.bfloat16:
        bound = bound + ref.abs() * 2**-8  # the result's one rounding to bf16
    err = (got.double() - ref).abs()
    assert got.dtype == dtype
    assert bool((err <= bound).all()), f"max error / bound {(err / bound).max().item():.3f}"


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("wdtype", DTYPES, ids=["w32", "w16"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["x32", "x16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_panel_product_matches_float64(shape, dtype, wdtype, isa):
    m, k, n = shape
    g = gen(m * 7919 + k * 31 + n)
    x = (torch.randn(m, k, generator=g) * 3).to(dtype)
    w = torch.randn(n, k, generator=g).to(wdtype)
    bias = torch.randn(n, generator=g).to(dtype) if n % 2 else None
    got = panel_linear(x, pack_panels(w), bias, isa=isa)
    assert got.shape == (m, n)
    assert_close(got, x, w, bias, dtype)


@pytest.mark.parametrize("isa", ISAS)
def test_fp32_product_agrees_with_f_linear_on_fresh_random_layers(isa):
    rng = random.Random()
    for _ in range(6):
        m, k, n = rng.randint(1, 70), rng.randint(1, 700), rng.randint(1, 300)
        x, w, b = torch.randn(m, k), torch.randn(n, k), torch.randn(n)
        got = panel_linear(x, pack_panels(w), b, isa=isa)
        assert_close(got, x, w, b, torch.float32)
        torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-4, atol=1e-4 * k**0.5)


def test_leading_dims_and_strided_rows():
    g = gen(3)
    x = torch.randn(2, 5, 80, generator=g)[:, :, 8:72]  # rows 80 apart, 64 wide
    w = torch.randn(40, 64, generator=g)
    got = panel_linear(x, pack_panels(w))
    assert got.shape == (2, 5, 40)
    assert_close(got.reshape(10, 40), x.reshape(10, 64), w, None, torch.float32)
    tcol = torch.randn(64, 7, generator=g).T  # last dim strided: copied first
    assert_close(panel_linear(tcol, pack_panels(w)), tcol, w, None, torch.float32)


def test_zero_rows_give_an_empty_result():
    w = torch.randn(20, 8)
    out = panel_linear(torch.empty(0, 8), pack_panels(w))
    assert out.shape == (0, 20)


def test_threads_change_no_bit():
    g = gen(11)
    x, w = torch.randn(37, 300, generator=g), torch.randn(500, 300, generator=g)
    packed = pack_panels(w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = panel_linear(x, packed)
        torch.set_num_threads(max(2, before))
        many = panel_linear(x, packed)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, many)


def test_pack_panels_layout():
    w = torch.randn(19, 5)
    packed = pack_panels(w)
    assert (packed.out_features, packed.in_features, packed.dtype) == (19, 5, torch.float32)
    p = packed.panels
    assert p.shape == (2, 5, PANEL_WIDTH) and p.is_contiguous()
    for n in range(19):
        assert torch.equal(p[n // PANEL_WIDTH, :, n % PANEL_WIDTH], w[n])
    assert bool((p[1, :, 3:] == 0).all())  # zero past out_features


def test_bad_arguments_raise_typed_errors():
    w = torch.randn(20, 8)
    packed = pack_panels(w)
    x = torch.randn(3, 8)
    with pytest.raises(ShapeError):
        panel_linear(torch.randn(3, 9), packed)  # in_features differ
    with pytest.raises(ShapeError):
        panel_linear(x, packed, torch.randn(19))
    with pytest.raises(DTypeError):
        panel_linear(x, packed, torch.randn(20, dtype=torch.float64))
    with pytest.raises(DTypeError):
        panel_linear(x.half(), packed)
    with pytest.raises(InvalidArgumentError):
        panel_linear(x, packed.panels)  # the raw tensor: sizes unknown
    with pytest.raises(InvalidArgumentError):
        panel_linear(x.clone().requires_grad_(), packed)
    with pytest.raises(InvalidArgumentError):
        panel_linear(x, packed, isa="sse9")
    with pytest.raises(InvalidArgumentError):
        panel_linear([[1.0] * 8], packed)
    with pytest.raises(AttributeError):
        packed.panels = torch.zeros(1, 8, 16)  # read-only: the kernel trusts the sizes
    with pytest.raises(DTypeError):
        pack_panels(w.half())
    with pytest.raises(ShapeError):
        pack_panels(torch.randn(4))
    with pytest.raises(ShapeError):
        pack_panels(torch.randn(0, 4))
    with pytest.raises(InvalidArgumentError):
        pack_panels([[1.0]])


def test_expanded_and_one_dim_inputs():
    g = gen(5)
    w = torch.randn(24, 16, generator=g)
    row = torch.randn(16, generator=g)
    got = panel_linear(row.expand(4, 16), pack_panels(w))  # rows 0 apart
    assert got.shape == (4, 24) and torch.equal(got[0], got[3])
    assert_close(got, row.expand(4, 16), w, None, torch.float32)
    one = panel_linear(row, pack_panels(w))
    assert one.shape == (24,) and torch.equal(one, got[0])


@pytest.mark.skipif("avx2" in ISAS, reason="this CPU has AVX2: the refusal of an absent path cannot be seen")
def test_an_absent_path_is_refused():
    with pytest.raises(InvalidArgumentError):
        panel_linear(torch.randn(2, 8), pack_panels(torch.randn(4, 8)), isa="avx2")


@pytest.mark.skipif("avx512" in ISAS, reason="this CPU has AVX-512: the refusal of an absent path cannot be seen")
def test_a_path_this_cpu_lacks_is_refused():
    with pytest.raises(InvalidArgumentError, match="cannot run"):
        panel_linear(torch.randn(2, 8), pack_panels(torch.randn(4, 8)), isa="avx512")
