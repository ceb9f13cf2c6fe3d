"""vpaged.ops: kernels over vpaged caches.

    DecodePlan.build(cache, seqs).run(layer, q)        a step's plan, built once, run per layer (plans.py)
    decode_attention(q, cache, seqs, layer)            one layer of a cache through a one-layer DecodePlan
    decode_attention_contiguous(q, batched_kv)         contiguous-with-lengths kernel (VirtualKVCache.batch())
    decode_attention_paged(q, key_cache, value_cache, block_tables, lengths)   block-table kernel
    decode_attention_reference(q, cache, seqs, layer)  torch SDPA per sequence
    batched_kv_from_tensors(k, v, lengths)             BatchedKV over ordinary dense tensors
    write_kv(k, v, batched_kv, rows, positions)        scatter new tokens' K/V into a cache (write.py)
    WritePlan(descriptors, rows, positions).write(i, k, v)   the same for every layer of a step, checked once
    panel_linear(x, pack_panels(weight), bias)         a linear product of few rows on a packed weight (linear.py)

decode.py holds the tensor-level entry points, plans.py the step plan (DecodePlan) and the per-layer plans
a cache's memory gets, checks.py the argument checks, launch.py the kernel parameters and launches, write.py
the K/V scatter, support.py what the kernels take on each device, linear.py the panel product (CPU).
"""

from .decode import (
    batched_kv_from_tensors,
    decode_attention_contiguous,
    decode_attention_paged,
    decode_attention_reference,
)
from .launch import plan_cuda_splits
from .linear import PanelWeight, pack_panels, panel_linear
from .plans import DecodePlan, decode_attention
from .support import decode_supported, decode_unsupported
from .write import WritePlan, write_kv

__all__ = [
    "DecodePlan",
    "PanelWeight",
    "WritePlan",
    "batched_kv_from_tensors",
    "decode_attention",
    "decode_attention_contiguous",
    "decode_attention_paged",
    "decode_attention_reference",
    "decode_supported",
    "decode_unsupported",
    "pack_panels",
    "panel_linear",
    "plan_cuda_splits",
    "write_kv",
]
