"""Kernel parameters and launches: the one place a _C.DecodeParams is filled from checked inputs and handed to
the CPU or CUDA decode kernel."""

from __future__ import annotations

import math

import torch

from .. import _C
from ..kvcache.records import BatchedKV


def _kernel_dtype_codes() -> dict[torch.dtype, int]:
    """The kernels' element type codes (decode.h's DType, bound by _C.dtype_codes()) by torch dtype."""
    return {getattr(torch, name): code for name, code in _C.dtype_codes().items()}


_CODES = _kernel_dtype_codes()
# q / out (and K/V of a plain cache): the model dtypes the kernels take.
DTYPE_CODES = {d: _CODES[d] for d in (torch.float32, torch.float16, torch.bfloat16)}
# Stored formats of a quantized cache (kvcache/formats.py); the kernels then take q and out in float32.
KV_DTYPE_CODES = {d: _CODES[d] for d in (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)}


def kernel_params(
    q, out, k_ptr: int, v_ptr: int, num_kv_heads: int, token_stride: int, lengths, max_len: int, scale
) -> _C.DecodeParams:
    p = _C.DecodeParams()
    p.dtype = DTYPE_CODES[q.dtype]
    p.num_seqs, p.num_heads, p.head_dim = q.shape
    p.v_head_dim = out.shape[2]
    p.num_kv_heads = num_kv_heads
    p.q, p.out, p.k, p.v = q.data_ptr(), out.data_ptr(), k_ptr, v_ptr
    p.token_stride = token_stride
    p.lengths = lengths.data_ptr()
    p.max_tokens = max_len
    p.scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else float(scale)
    return p


def describe_contiguous(p: _C.DecodeParams, kv: BatchedKV) -> None:
    """The descriptor's addresses and strides into the kernel parameters (contiguous, not block tables)."""
    p.paged = False
    p.num_kv_heads = kv.num_kv_heads
    p.k, p.v = kv.k_ptr, kv.v_ptr
    p.token_stride, p.v_token_stride = kv.token_stride, kv.v_token_stride
    p.head_stride, p.v_head_stride = kv.head_stride, kv.v_head_stride
    p.slot_stride, p.v_slot_stride = kv.slot_stride, kv.v_slot_stride


def describe_format(p: _C.DecodeParams, kv: BatchedKV) -> None:
    """A quantized cache's format into the parameters (nothing for plain values): K/V as stored (bytes,
    strides in bytes), the value head dims, the layer's fp8 scales (read now: calibration sets them at the
    layer's first write), q and out in float32."""
    if kv.kv_format is not None:
        set_format(p, kv.kv_format, kv.kv_scales, *kv.value_head_dims)


def set_format(p: _C.DecodeParams, fmt, scales, head_dim: int, v_head_dim: int) -> None:
    """describe_format() from its parts, for entries given pools rather than a record."""
    p.dtype = DTYPE_CODES[torch.float32]
    p.kv_dtype = KV_DTYPE_CODES[fmt.kv_dtype]
    p.head_dim, p.v_head_dim = head_dim, v_head_dim
    p.k_scale, p.v_scale = fmt.kernel_scales(scales)


def float32_io(q: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q and an output buffer in float32 for a kernel over quantized K/V (the given ones when already so)."""
    if q.dtype == torch.float32:
        return q, out
    return q.float().contiguous(), torch.empty(out.shape, dtype=torch.float32, device=out.device)


def describe_paged(p: _C.DecodeParams, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """Checked block pools' addresses and strides into the kernel parameters (block tables, not slots)."""
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    v_head_dim = value_cache.shape[3]
    p.paged = True
    p.num_kv_heads = num_kv_heads
    p.k, p.v = key_cache.data_ptr(), value_cache.data_ptr()
    p.token_stride, p.v_token_stride = num_kv_heads * head_dim, num_kv_heads * v_head_dim
    p.head_stride, p.v_head_stride = head_dim, v_head_dim
    p.block_size, p.num_blocks = block_size, num_blocks


def launch(p: _C.DecodeParams, q: torch.Tensor) -> None:
    if q.device.type == "cpu":
        _C.decode_cpu(p, torch.get_num_threads())
        return
    launch = _C.CudaLaunch()
    launch.device = q.device.index
    launch.stream = torch.cuda.current_stream(q.device).cuda_stream
    launch.num_splits, launch.split_tokens = plan_cuda_splits(p.num_seqs, p.num_kv_heads, p.max_tokens, q.device)
    if launch.num_splits > 1:
        # Freed tensors return to torch's caching allocator for this stream: later work on the same stream
        # runs after the kernels, so reuse is safe without a sync.
        acc = torch.empty(
            (p.num_seqs, p.num_heads, launch.num_splits, p.v_head_dim), dtype=torch.float32, device=q.device
        )
        ml = torch.empty((p.num_seqs, p.num_heads, launch.num_splits, 2), dtype=torch.float32, device=q.device)
        launch.partial_acc, launch.partial_ml = acc.data_ptr(), ml.data_ptr()
    _C.decode_cuda(p, launch)


def plan_cuda_splits(num_seqs: int, num_kv_heads: int, max_len: int, device) -> tuple[int, int]:
    """(num_splits, split_tokens) for the CUDA kernels: one pass when the batch alone gives every SM a few
    blocks (or contexts are short); otherwise cut contexts into pieces of >= 256 tokens until it does."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    blocks = num_seqs * num_kv_heads  # thread blocks per piece (at least)
    target = 4 * sms
    if max_len <= 512 or blocks >= target:
        return 1, max_len
    pieces = min(-(-target // blocks), -(-max_len // 256))
    split_tokens = -(-max_len // pieces)
    split_tokens = -(-split_tokens // 64) * 64
    return -(-max_len // split_tokens), split_tokens
