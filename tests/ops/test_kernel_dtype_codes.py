"""The kernels' dtype codes: vpaged/ops/launch.py reads them from the extension (_C.dtype_codes(), decode.h's
DType) instead of keeping a copy, and each code means its dtype to the C++ side: the parameter check accepts
and refuses by it, and a kernel run on raw tensors of that dtype matches a float64 reference."""

import math

import pytest
import torch

from vpaged import _C
from vpaged.errors import InvalidArgumentError
from vpaged.ops import launch

MODEL = (torch.float32, torch.float16, torch.bfloat16)
QUANTIZED = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)


def test_codes_come_from_the_extension_and_name_torch_dtypes():
    codes = _C.dtype_codes()
    assert {getattr(torch, name) for name in codes} == set(MODEL + QUANTIZED)
    assert len(set(codes.values())) == len(codes), "codes are distinct"
    assert launch.DTYPE_CODES == {d: codes[str(d).removeprefix("torch.")] for d in MODEL}
    assert launch.KV_DTYPE_CODES == {d: codes[str(d).removeprefix("torch.")] for d in QUANTIZED}


def params(dtype_code: int, kv_dtype_code: int = -1) -> _C.DecodeParams:
    """Parameters the check can judge without memory: no sequences."""
    p = _C.DecodeParams()
    p.dtype, p.kv_dtype = dtype_code, kv_dtype_code
    p.num_seqs, p.num_heads, p.num_kv_heads, p.head_dim = 0, 2, 1, 16
    p.token_stride = 20  # room for an int8 row's scale too
    return p


def test_the_check_reads_the_codes_as_their_dtypes():
    f32 = launch.DTYPE_CODES[torch.float32]
    for code in launch.DTYPE_CODES.values():
        _C.decode_check(params(code))
    for code in launch.KV_DTYPE_CODES.values():
        _C.decode_check(params(f32, code))  # a quantized format with float32 q and out
        with pytest.raises(InvalidArgumentError, match="float32 q and out"):
            _C.decode_check(params(launch.DTYPE_CODES[torch.bfloat16], code))
        with pytest.raises(InvalidArgumentError, match="unsupported dtype"):
            _C.decode_check(params(code))  # not a q / out type
    unknown = max(_C.dtype_codes().values()) + 1
    with pytest.raises(InvalidArgumentError, match="unsupported dtype"):
        _C.decode_check(params(unknown))
    with pytest.raises(InvalidArgumentError, match="unsupported kv_dtype"):
        _C.decode_check(params(f32, unknown))


@pytest.mark.parametrize("dtype", MODEL)
def test_a_kernel_reads_each_model_dtype_by_its_code(dtype):
    heads, dim, n = 2, 24, 5  # a head dim no tile loop is compiled for: the generic loop's element loads
    q, k, v = torch.randn(1, heads, dim), torch.randn(n, 1, dim), torch.randn(n, 1, dim)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    out = torch.full((1, heads, dim), float("nan"), dtype=dtype)
    lengths, slots = torch.tensor([n], dtype=torch.int32), torch.tensor([0], dtype=torch.int32)
    p = params(launch.DTYPE_CODES[dtype])
    p.num_seqs, p.num_heads, p.head_dim, p.v_head_dim = 1, heads, dim, dim
    p.token_stride, p.head_stride, p.slot_stride, p.max_tokens = dim, dim, n * dim, n
    p.q, p.out, p.k, p.v = q.data_ptr(), out.data_ptr(), k.data_ptr(), v.data_ptr()
    p.lengths, p.slots = lengths.data_ptr(), slots.data_ptr()
    p.scale = 1.0 / math.sqrt(dim)
    _C.decode_cpu(p, 1)
    scores = torch.einsum("hd,td->ht", q[0].double(), k[:, 0].double()) * p.scale
    want = torch.softmax(scores, -1) @ v[:, 0].double()
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # the output's own rounding
    torch.testing.assert_close(out[0].double(), want, atol=tol, rtol=tol)
