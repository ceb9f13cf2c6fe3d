"""Decode attention over vpaged caches: one query token per sequence against its cached K/V.

    decode_attention(q, cache, seqs, layer)            picks the kernel for a KVCache (plans.py: DecodePlan)
    decode_attention_contiguous(q, batched_kv)         contiguous-with-lengths kernel (VirtualKVCache.batch())
    decode_attention_paged(q, key_cache, value_cache, block_tables, lengths)   block-table kernel
    decode_attention_reference(q, cache, seqs, layer)  torch SDPA per sequence (views / gathered blocks)
    batched_kv_from_tensors(k, v, lengths)             BatchedKV over ordinary dense [B, T, H, D] / [B, H, T, D]
                                                       tensors (BatchedKV.from_tensors), for the contiguous kernel
    write_kv(k, v, batched_kv, rows, positions)        scatter new tokens' K/V into the cache through a BatchedKV
                                                       (one call per layer for every sequence of a step)

q is [num_seqs, num_heads, head_dim] with num_heads a multiple of num_kv_heads (GQA); the result is
[num_seqs, num_heads, v_head_dim] (V's head dim, which may differ from K's) in q's dtype (float32, float16
or bfloat16; scores and sums are float32 inside). scale defaults to
1/sqrt(head_dim). `out`, when given, is written in place and returned.

Lengths are checked (each in 1..capacity) before any kernel reads memory. On CUDA that check reads them
back to the host, a synchronisation; a caller that knows the longest length (a scheduler does) passes
max_len=..., which skips the read-back: lengths are then clamped to max_len inside the kernels, so a wrong
hint gives wrong numbers but never a read outside the cache. CUDA kernels run asynchronously on
torch.cuda.current_stream().
"""

from __future__ import annotations

import torch

from ..errors import DTypeError, InvalidArgumentError, ShapeError
from ..kvcache.base import is_kvcache
from ..kvcache.checks import check_kernel_dtype, check_lengths, index_tensor
from ..kvcache.records import BatchedKV
from .checks import cache_max_len, check_extent, check_max_len, check_out, check_pools, check_q, kv_capacity
from .launch import describe_contiguous, describe_format, describe_paged, float32_io, kernel_params, launch, set_format


def decode_attention_contiguous(
    q: torch.Tensor,
    batched_kv: BatchedKV,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    *,
    max_len: int | None = None,
) -> torch.Tensor:
    """Decode attention over a BatchedKV descriptor (VirtualKVCache.batch(layer, seqs)): sequence i reads
    tokens 0..lengths[i]-1 of its slot, never past them. Every cache layout (they differ in token_stride and
    head_stride)."""
    kv = batched_kv
    if not isinstance(kv, BatchedKV):
        raise InvalidArgumentError(f"batched_kv must be a BatchedKV (VirtualKVCache.batch()), got {type(kv).__name__}")
    check_kernel_dtype(kv.value_dtype, "the cache")
    head_dim, v_head_dim = kv.value_head_dims  # a quantized cache's descriptor counts bytes of its rows
    q = check_q(q, kv.num_kv_heads, head_dim, kv.value_dtype, kv.device)
    if not isinstance(v_head_dim, int) or not 1 <= v_head_dim <= 256:
        raise ShapeError(f"v_head_dim must be an int in 1..256, got {v_head_dim!r}")
    out = check_out(out, q, v_head_dim)
    num_seqs = q.shape[0]
    slots = index_tensor(kv.slots, "slots", (num_seqs,), q.device)
    lengths = index_tensor(kv.lengths, "lengths", (num_seqs,), q.device)
    capacity = kv_capacity(kv)
    if max_len is None:
        max_len = check_lengths(lengths, capacity)
        check_extent(kv, slots.tolist(), lengths.tolist())
    else:
        max_len = check_max_len(max_len, capacity)
    if num_seqs == 0:
        return out
    qk, outk = float32_io(q, out) if kv.kv_format is not None else (q, out)
    p = kernel_params(qk, outk, kv.k_ptr, kv.v_ptr, kv.num_kv_heads, kv.token_stride, lengths, max_len, scale)
    describe_contiguous(p, kv)
    describe_format(p, kv)
    p.slots = slots.data_ptr()
    launch(p, qk)
    if outk is not out:
        out.copy_(outk)
    return out


def decode_attention_paged(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    *,
    max_len: int | None = None,
    kv_format=None,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention over block pools key_cache [num_blocks, block_size, num_kv_heads, head_dim] and
    value_cache [num_blocks, block_size, num_kv_heads, v_head_dim] (dense; block_size a power of two) through
    block_tables [num_seqs, width] (block ids) and lengths [num_seqs]; token t of sequence i is row
    t % block_size of block block_tables[i, t // block_size]. The result is [num_seqs, num_heads, v_head_dim].
    kv_format / kv_scales: the pools of a quantized PagedKVCache (its BlockPools record): bytes of stored
    rows, read by the kernel as that format."""
    check_pools(key_cache, value_cache)
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    v_head_dim = value_cache.shape[3]
    value_dtype = key_cache.dtype
    if kv_format is not None:
        if key_cache.dtype != kv_format.storage_dtype:
            raise DTypeError(f"the pools of a {kv_format.name} cache hold bytes, got {key_cache.dtype}")
        value_dtype = kv_format.dtype
        head_dim, v_head_dim = head_dim - kv_format.scale_bytes, v_head_dim - kv_format.scale_bytes
    check_kernel_dtype(value_dtype, "key_cache")
    q = check_q(q, num_kv_heads, head_dim, value_dtype, key_cache.device)
    out = check_out(out, q, v_head_dim)
    num_seqs = q.shape[0]
    if not isinstance(block_tables, torch.Tensor) or block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ShapeError(
            f"block_tables must be a [{num_seqs}, width] tensor, got "
            f"{list(block_tables.shape) if isinstance(block_tables, torch.Tensor) else type(block_tables)}"
        )
    tables = index_tensor(block_tables, "block_tables", tuple(block_tables.shape), q.device)
    lengths = index_tensor(lengths, "lengths", (num_seqs,), q.device)
    capacity = tables.shape[1] * block_size
    if max_len is None:
        max_len = check_lengths(lengths, capacity, tables, block_size, num_blocks)
    else:
        max_len = check_max_len(max_len, capacity)
    if num_seqs == 0:
        return out
    qk, outk = float32_io(q, out) if kv_format is not None else (q, out)
    p = kernel_params(qk, outk, key_cache.data_ptr(), value_cache.data_ptr(), num_kv_heads, 0, lengths, max_len, scale)
    describe_paged(p, key_cache, value_cache)
    if kv_format is not None:
        set_format(p, kv_format, kv_scales, head_dim, v_head_dim)  # float32 q and out, K/V as stored
    p.block_tables = tables.data_ptr()
    p.bt_stride = tables.stride(0)
    launch(p, qk)
    if outk is not out:
        out.copy_(outk)
    return out


def decode_attention_reference(
    q: torch.Tensor, cache, seqs, layer: int, scale: float | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The same result by torch's scaled_dot_product_attention, one sequence at a time, over cache.kv()
    (zero-copy views of a VirtualKVCache, blocks gathered into copies for a PagedKVCache)."""
    if not is_kvcache(cache):
        raise InvalidArgumentError(f"cache must be a vpaged KVCache, got {type(cache).__name__}")
    seqs = list(seqs)
    q = check_q(q, cache.num_kv_heads, cache.head_dim, cache.dtype, cache.device)
    if q.shape[0] != len(seqs):
        raise ShapeError(f"q has {q.shape[0]} rows for {len(seqs)} sequences")
    out = check_out(out, q, cache.v_head_dim)
    cache_max_len(cache, seqs)  # every sequence holds at least one token
    for i, seq in enumerate(seqs):
        k, v = cache.dequantized_kv(layer, seq)  # [T, kv_heads, D]: views, or values of a quantized cache
        o = torch.nn.functional.scaled_dot_product_attention(
            q[i].unsqueeze(1), k.transpose(0, 1), v.transpose(0, 1), scale=scale, enable_gqa=True
        )
        out[i].copy_(o.squeeze(1))
    return out


def batched_kv_from_tensors(k: torch.Tensor, v: torch.Tensor, lengths, layout: str = "bthd") -> BatchedKV:
    """A BatchedKV over ordinary tensors (e.g. a StaticCache's), for decode_attention_contiguous.

    k: [B, T, H, D] (layout="bthd") or [B, H, T, D] (layout="bhtd"); v the same layout with the same B, T and
    H but its own head dim (last dimension) and strides, e.g. MLA-style K 192 / V 128. Same dtype and device;
    each head's row dense (views of a larger buffer, e.g. the first T tokens of a longer cache, are fine).
    lengths: valid tokens of each of the B sequences (an int for all, a sequence of ints, or an integer
    tensor), each in 1..T; sequence i is row i. The descriptor keeps k and v alive."""
    return BatchedKV.from_tensors(k, v, lengths, layout)
