"""vpaged.ops: kernels over vpaged caches (decode attention, K/V scatter writes)."""

from .decode import (
    batched_kv_from_tensors,
    decode_attention,
    decode_attention_contiguous,
    decode_attention_paged,
    decode_attention_reference,
    plan_cuda_splits,
    write_kv,
)

__all__ = [
    "batched_kv_from_tensors",
    "decode_attention",
    "decode_attention_contiguous",
    "decode_attention_paged",
    "decode_attention_reference",
    "plan_cuda_splits",
    "write_kv",
]
