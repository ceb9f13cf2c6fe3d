"""The "vpaged" attention implementation for transformers models (attn_implementation="vpaged").

Registered through transformers' public AttentionInterface (no model code is patched). It serves two
callers:

- The serving engine runs one packed forward per step: every scheduled sequence's new tokens are one batch
  row, with position_ids, and the engine passes `vpaged_step=<a StepAttention>` as a forward kwarg, which
  transformers hands through every decoder layer to this function. The StepAttention (built once per step,
  see serve/stores/attention.py) writes the layer's new K/V into the cache and attends per sequence: decode
  rows through the vpaged.ops decode kernel, prefill chunks with SDPA over the cached K/V.
- Anything else, e.g. `model.generate(**cache_kwargs(VPagedCache(...)))`: a decode step (one query token, no mask)
  runs the contiguous decode kernel through a one-layer DecodePlan over the K/V tensors the cache returned
  (for a VPagedCache, views of each row's contiguous range); everything else (prefill, padded batches,
  sliding windows) goes to transformers' own SDPA function, so results match attn_implementation="sdpa".

Which K/V the current token attends to: what the cache returned from update(), which on a quantized
VPagedCache is what it stored (the new tokens' K/V quantized, then dequantized with the rest), as in the
engine, where new K/V are written before the step's attention reads the cache (vLLM does the same). So
"vpaged" and "sdpa" read the same values; they differ by the kernels' fp32 rounding only.

Masks: for "vpaged" transformers builds the same masks as for "sdpa" (None when plain causal attention is
enough). The engine passes a prebuilt placeholder 4D mask, which transformers hands on untouched, so no
[T, T] mask is built for a packed step: the StepAttention knows each sequence's extent.
"""

from __future__ import annotations

import torch

from ..kvcache import BatchedKV
from ..ops import DecodePlan
from ..ops.support import decode_supported

NAME = "vpaged"


def vpaged_attention(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
):
    """transformers attention function: query [B, H, Tq, D], key/value [B, KVH, Tk, D] -> ([B, Tq, H, D], None)."""
    step = kwargs.get("vpaged_step")
    if step is not None:
        return step.attend(module.layer_idx, query, key, value, scaling), None
    if _kernel_decodes(query, key, value, attention_mask, dropout, kwargs):
        return _decode_on_tensors(query, key, value, scaling), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def _kernel_decodes(query, key, value, attention_mask, dropout, kwargs) -> bool:
    """A plain decode step the kernel computes exactly like SDPA: one query token, no mask (no padding, no
    window), no dropout or softcap, K and V laid out alike with dense head rows."""
    return (
        query.shape[2] == 1
        and attention_mask is None
        and not dropout
        and kwargs.get("softcap") is None
        and query.dtype == key.dtype == value.dtype
        and key.device == query.device
        and key.shape == value.shape
        and key.stride() == value.stride()
        and key.stride(-1) == 1
        and key.shape[2] > 0
        and query.shape[1] % key.shape[1] == 0
        and _kernel_layout_ok(key)
        and _kernel_takes(query, key, value)
    )


def _kernel_takes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """The kernel's own limits on this device (ops.support): on CUDA, the head sizes it is built for and K/V
    rows on 16-byte boundaries (q is made contiguous and out is fresh, so theirs hold); otherwise SDPA serves
    the step."""
    if key.device.type == "cuda" and (key.data_ptr() % 16 or value.data_ptr() % 16):
        return False
    return decode_supported(key.device, key.dtype, key.shape[3], value.shape[3], key.stride()[:3])


def _kernel_layout_ok(key: torch.Tensor) -> bool:
    # The kernel walks either whole token rows of all heads (head stride == head_dim) or one run of tokens
    # per head; each must fit between consecutive rows / runs / slots.
    batch, kv_heads, length, head_dim = key.shape
    heads_apart = key.stride(1) != head_dim
    row = head_dim if heads_apart else kv_heads * head_dim
    span = key.stride(1) if heads_apart else key.stride(0)
    if key.stride(2) < row or key.stride(1) < head_dim:
        return False
    return span >= length * key.stride(2)


def _decode_on_tensors(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling) -> torch.Tensor:
    """Decode attention of query [B, H, 1, D] over key/value [B, KVH, T, D] (any strides with dense head
    rows, e.g. a VPagedCache's views of each row's contiguous range): row b is slot b of a descriptor whose
    slot/token/head strides are the tensors' own, every row T tokens long."""
    batch, kv_heads, length, head_dim = key.shape
    rows = torch.arange(batch, dtype=torch.int32, device=key.device)
    kv = BatchedKV(
        k_ptr=key.data_ptr(),
        v_ptr=value.data_ptr(),
        slots=rows,
        lengths=torch.full((batch,), length, dtype=torch.int32, device=key.device),
        slot_stride=key.stride(0),
        token_stride=key.stride(2),
        head_stride=key.stride(1),
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=key.dtype,
        device=key.device,
        layout="tensor",
        owner=(key, value),  # keeps both alive; the plan checks each row against its own tensor
    )
    out = DecodePlan.over_tensors(kv, [length] * batch).run(0, query[:, :, 0, :], scaling)
    return out.unsqueeze(1)  # [B, 1, H, D], what transformers expects from an attention function


def register() -> None:
    """Make attn_implementation="vpaged" known to transformers (idempotent), with SDPA's mask function so
    that left-padded batches outside the engine keep their padding. Through vpaged.hf.compat, which
    registers the same way on every supported transformers release."""
    from .compat import register_attention

    register_attention(NAME, vpaged_attention, mask="sdpa")


register()
