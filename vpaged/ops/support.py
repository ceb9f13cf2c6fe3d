"""What the decode kernels support, in one place for every caller (the transformers attention function,
the serving stores, the tests): a caller asks before it routes a step to a kernel, and falls back to SDPA
when the answer is no, instead of raising mid-forward.

The CPU kernel takes any head size in 1..256 (K and V may differ) and any element strides with dense head
rows. The CUDA kernels are compiled for (head_dim, v_head_dim) in CUDA_HEAD_DIMS only, and their lanes load
16-byte vectors, so q, out and every K/V row must start on a 16-byte boundary (csrc/kernels/decode_cuda.cu
refuses anything else with InvalidArgumentError).
"""

from __future__ import annotations

import torch

from ..kvcache.checks import KERNEL_DTYPES
from ..kvcache.formats import QUANTIZED_DTYPES
from ..memory.dtypes import itemsize

CUDA_HEAD_DIMS = frozenset({(64, 64), (128, 128), (256, 256), (192, 128)})
CUDA_ALIGNMENT = 16  # bytes
INT8_ALIGNMENT = 4  # bytes: an int8 row is head_dim + 4 bytes (its scale), read in 4-byte words


def decode_unsupported(
    device,
    dtype: torch.dtype,
    head_dim: int,
    v_head_dim: int | None = None,
    strides: tuple[int, ...] = (),
    kv_dtype: torch.dtype | None = None,
) -> str | None:
    """Why the decode kernel cannot take a layer on `device` with these sizes (None: it can). `strides` are
    the element strides of the K/V rows the kernel would step by (token, head and slot strides); each must
    keep rows on the CUDA kernels' alignment. kv_dtype: a quantized cache's stored format (strides then
    count bytes; int8 rows, head_dim + 4 bytes with their scale, need only 4-byte alignment)."""
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    quantized = kv_dtype is not None and kv_dtype != dtype
    if quantized and kv_dtype not in QUANTIZED_DTYPES:
        return f"the decode kernels read stored K/V of {dtype} or a quantized format, not {kv_dtype}"
    if dtype not in KERNEL_DTYPES:
        return f"the decode kernels read float32, float16 and bfloat16, not {dtype}"
    if not (1 <= head_dim <= 256 and 1 <= v_head_dim <= 256):
        return f"head sizes must be in 1..256, got {head_dim}/{v_head_dim}"
    if torch.device(device).type != "cuda":
        return None
    if (head_dim, v_head_dim) not in CUDA_HEAD_DIMS:
        dims = ", ".join(f"{k}/{v}" for k, v in sorted(CUDA_HEAD_DIMS))
        return f"the CUDA decode kernels are built for head sizes {dims}, not {head_dim}/{v_head_dim}"
    item = 1 if quantized else itemsize(dtype)
    align = INT8_ALIGNMENT if kv_dtype == torch.int8 else CUDA_ALIGNMENT
    if any((s * item) % align for s in strides):
        return f"the CUDA decode kernels need K/V rows on {align}-byte boundaries (strides {strides})"
    return None


def decode_supported(device, dtype, head_dim: int, v_head_dim: int | None = None, strides=(), kv_dtype=None) -> bool:
    return decode_unsupported(device, dtype, head_dim, v_head_dim, tuple(strides), kv_dtype) is None
