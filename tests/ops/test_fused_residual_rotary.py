"""vpaged.ops.fused's in-place ops: add_rms_norm (the residual add and the next RMSNorm in one pass) and rotary_
(the rotate-half rotary embedding of a fused q/k/v product's heads), against float64 and the eager formulas.

Every CPU code path this machine has is forced, on fresh random shapes (head dims whose half is and is not a
multiple of the vector width), both dtypes. The eager code's roundings are replicated: the residual equals eager
`residual + x` and the rotation eager `x * cos + rotate_half(x) * sin` bit for bit; the norm equals rms_norm of the
new residual. The lean entries for layer loops (add_rms_norm_rows, rotary_rows) give the checked ops' results, and
their errors outside the common case. Only what the op names is written (the product's v columns and the row
padding stay as they were). Bad arguments raise typed errors and change nothing."""

import pytest
import torch

from vpaged import _C
from vpaged.errors import DTypeError, InvalidArgumentError, ShapeError
from vpaged.ops.fused import add_rms_norm, add_rms_norm_rows, rms_norm, rotary_, rotary_rows

ISAS = _C.decode_cpu_isas()
DTYPES = [torch.float32, torch.bfloat16]


def rng(seed):
    return torch.Generator().manual_seed(seed)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def eager_rotary(x, cos, sin):
    """apply_rotary_pos_emb of Llama-family models, for x [rows, heads, dim] and cos / sin [rows, dim]."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


def rotary_f64(x, cos, sin):
    x, cos, sin = x.double(), cos.double(), sin.double()
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


def cos_sin(rows, dim, dtype, g):
    """cos / sin of random positions and the rotary frequencies, as a rotary module makes them."""
    positions = torch.randint(0, 4096, (rows, 1), generator=g).double()
    inv = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    freqs = positions * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (5, 8), (4, 33), (64, 576), (9, 1001), (300, 1024)])
def test_add_rms_norm_updates_the_residual_as_eager_and_normalises_it(shape, dtype, isa):
    g = rng(shape[0] * 31 + shape[1])
    x = (torch.randn(shape, generator=g) * 4).to(dtype)
    residual = (torch.randn(shape, generator=g) * 10).to(dtype)
    w = torch.randn(shape[1], generator=g).to(dtype)
    eps = float(torch.rand(1, generator=g)) * 1e-5
    expected_residual = residual + x
    x_before = x.clone()
    out = add_rms_norm(x, residual, w, eps, isa=isa)
    assert torch.equal(residual, expected_residual)
    assert torch.equal(x, x_before)
    assert out.shape == x.shape and out.dtype == dtype
    assert torch.equal(out, rms_norm(expected_residual, w, eps, isa=isa))
    ref = (
        w.double()
        * expected_residual.double()
        / torch.sqrt(expected_residual.double().pow(2).mean(-1, keepdim=True) + eps)
    )
    scale = ref.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    bound = 1e-6 if dtype == torch.float32 else 2**-6
    assert bool(((out.double() - ref).abs() <= bound * scale).all())


@pytest.mark.parametrize("isa", ISAS)
def test_add_rms_norm_takes_strided_rows_and_leading_dims(isa):
    g = rng(3)
    wide_x = torch.randn(2, 5, 700, generator=g)
    wide_r = torch.randn(2, 5, 650, generator=g)
    x, residual = wide_x[..., 20:620], wide_r[..., :600]  # rows 700 and 650 elements apart
    w = torch.randn(600, generator=g)
    expected = residual + x
    padding = wide_r[..., 600:].clone()
    out = add_rms_norm(x, residual, w, 1e-6, isa=isa)
    assert torch.equal(residual, expected) and torch.equal(wide_r[..., 600:], padding)
    assert torch.equal(out, rms_norm(expected, w, 1e-6, isa=isa))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("dim", [2, 6, 16, 64, 80, 96, 128, 256])
def test_rotary_rotates_in_place_as_eager_does(dim, dtype, isa):
    g = rng(dim * 7 + (dtype == torch.bfloat16))
    rows, heads = int(torch.randint(1, 40, (1,), generator=g)), int(torch.randint(1, 12, (1,), generator=g))
    x = (torch.randn(rows, heads, dim, generator=g) * 3).to(dtype)
    cos, sin = cos_sin(rows, dim, dtype, g)
    expected = eager_rotary(x, cos, sin)
    ref = rotary_f64(x, cos, sin)
    got = rotary_(x, cos, sin, isa=isa)
    assert got is x
    assert torch.equal(x, expected)
    scale = ref.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    bound = 1e-6 if dtype == torch.float32 else 2**-7
    assert bool(((x.double() - ref).abs() <= bound * scale).all())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_rotary_of_a_fused_products_q_and_k_heads_leaves_v_and_the_padding(dtype, isa):
    g = rng(11)
    rows, heads, kv_heads, dim = 37, 9, 3, 64
    width = (heads + 2 * kv_heads) * dim
    buffer = torch.randn(rows, width + 16, generator=g).to(dtype)  # each row padded: rows are apart
    qkv = buffer[:, :width]
    qk = qkv[:, : (heads + kv_heads) * dim].view(rows, heads + kv_heads, dim)
    cos, sin = cos_sin(rows, dim, dtype, g)
    expected = eager_rotary(qk.clone(), cos, sin)
    untouched = buffer[:, (heads + kv_heads) * dim :].clone()
    rotary_(qk, cos, sin, isa=isa)
    assert torch.equal(qk, expected)
    assert torch.equal(buffer[:, (heads + kv_heads) * dim :], untouched)


def test_threads_split_rows_without_changing_a_bit():
    g = rng(9)
    x, residual, w = (
        torch.randn(400, 900, generator=g),
        torch.randn(400, 900, generator=g),
        torch.randn(900, generator=g),
    )
    q = torch.randn(400, 12, 128, generator=g)
    cos, sin = cos_sin(400, 128, torch.float32, g)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, max(2, before)):
            torch.set_num_threads(threads)
            r = residual.clone()
            results.append((add_rms_norm(x, r, w, 1e-6), r, rotary_(q.clone(), cos, sin)))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_empty_rows():
    out = add_rms_norm(torch.empty(0, 8), torch.empty(0, 8), torch.ones(8), 1e-6)
    assert out.shape == (0, 8)
    assert rotary_(torch.empty(0, 2, 4), torch.empty(0, 4), torch.empty(0, 4)).shape == (0, 2, 4)


def test_bad_arguments_raise_typed_errors_and_change_nothing():
    g = rng(5)
    x, residual, w = torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g), torch.randn(16, generator=g)
    kept = residual.clone()
    bad_norm_calls = [
        (lambda: add_rms_norm(x, residual, torch.randn(15), 1e-6), ShapeError),
        (lambda: add_rms_norm(x, torch.randn(4, 17), w, 1e-6), ShapeError),
        (lambda: add_rms_norm(x, residual.bfloat16(), w, 1e-6), DTypeError),
        (lambda: add_rms_norm(x.half(), residual.half(), w.half(), 1e-6), DTypeError),
        (lambda: add_rms_norm(x, residual, w, -1.0), InvalidArgumentError),
        (lambda: add_rms_norm(x, x, w, 1e-6), InvalidArgumentError),  # the residual would overwrite x
        (lambda: add_rms_norm(x, residual, w, 1e-6, isa="sse9"), InvalidArgumentError),
        (lambda: add_rms_norm(x, residual.tolist(), w, 1e-6), InvalidArgumentError),
    ]
    for call, error in bad_norm_calls:
        with pytest.raises(error):
            call()
        assert torch.equal(residual, kept)
    strided = torch.randn(16, 4, generator=g).t()  # a residual only a copy could make rows of: refused
    kept_strided = strided.clone()
    with pytest.raises(InvalidArgumentError, match="in place"):
        add_rms_norm(x, strided, w, 1e-6)
    assert torch.equal(strided, kept_strided)

    q = torch.randn(5, 3, 8, generator=g)
    cos, sin = cos_sin(5, 8, torch.float32, g)
    kept_q = q.clone()
    bad_rotary_calls = [
        (lambda: rotary_(torch.randn(5, 3, 7), torch.randn(5, 7), torch.randn(5, 7)), ShapeError),
        (lambda: rotary_(q, cos[:4], sin[:4]), ShapeError),
        (lambda: rotary_(q, cos, sin.bfloat16()), DTypeError),
        (lambda: rotary_(q.view(5, 24), cos, sin), ShapeError),
        (lambda: rotary_(q.transpose(0, 1), cos[:3], sin[:3]), InvalidArgumentError),  # heads not dense
        (lambda: rotary_(q.as_strided((5, 3, 8), (8, 8, 1)), cos, sin), InvalidArgumentError),  # rows overlap
        (lambda: rotary_(q, q[:, 0], q[:, 1]), InvalidArgumentError),  # cos and sin inside x
        (lambda: rotary_(q, cos, sin, isa="sse9"), InvalidArgumentError),
        (lambda: rotary_(q.requires_grad_(), cos, sin), InvalidArgumentError),
    ]
    for call, error in bad_rotary_calls:
        with pytest.raises(error):
            call()
        q.requires_grad_(False)
        assert torch.equal(q, kept_q)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_the_lean_entries_give_the_checked_ops_results_and_errors(dtype):
    g = rng(17)
    x, residual = torch.randn(33, 96, generator=g).to(dtype), torch.randn(33, 96, generator=g).to(dtype)
    w = torch.randn(96, generator=g).to(dtype)
    r1, r2 = residual.clone(), residual.clone()
    assert torch.equal(add_rms_norm_rows(x, r1, w, 1e-6), add_rms_norm(x, r2, w, 1e-6)) and torch.equal(r1, r2)
    qkv = torch.randn(33, 7 * 64, generator=g).to(dtype)
    cos, sin = cos_sin(33, 64, dtype, g)
    a, b = qkv.clone(), qkv.clone()
    rotary_rows(a[:, : 5 * 64].view(33, 5, 64), cos, sin)
    rotary_(b[:, : 5 * 64].view(33, 5, 64), cos, sin)
    assert torch.equal(a, b)
    # outside the common case: the checked op's answer or its typed error
    strided = torch.randn(96, 33, generator=g).to(dtype).t()
    r1, r2 = residual.clone(), residual.clone()
    assert torch.equal(add_rms_norm_rows(strided, r1, w, 1e-6), add_rms_norm(strided, r2, w, 1e-6))
    with pytest.raises(InvalidArgumentError):
        add_rms_norm_rows(x, x, w, 1e-6)
    with pytest.raises(DTypeError):
        add_rms_norm_rows(x, residual.double(), w, 1e-6)
    with pytest.raises(ShapeError):
        rotary_rows(qkv.view(33, 7, 64), cos[:5], sin[:5])
    with pytest.raises(InvalidArgumentError):
        rotary_rows(qkv.view(33, 7, 64), qkv[:, :64], qkv[:, 64:128])  # cos and sin inside x
