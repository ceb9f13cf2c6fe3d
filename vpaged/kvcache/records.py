"""Plain records the KV caches hand out: CacheStats (what a VirtualKVCache holds), PagedCacheStats (what a
PagedKVCache holds) and BatchedKV (one layer of several sequences, for decode kernels). A leaf of the cache
layer: it imports no cache and no kernel."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CacheStats:
    layout: str
    page_size: int
    sequences: int
    live_tokens: int
    live_bytes: int  # bytes holding K/V of live tokens (all layers)
    mapped_pages: int  # pages this cache has mapped, dormant ones included
    mapped_bytes: int
    dormant_pages: int  # pages of freed slots kept for reuse (reclaimable)
    utilization: float  # live_bytes / mapped_bytes (1.0 when nothing is mapped; > 1 when pages are shared)
    tokens_per_page: float  # fill granularity: tokens one page of one region holds
    pool_free_pages: int
    pool_used_pages: int
    pages_mapped_total: int  # pages mapped since creation (map work done)
    pages_unmapped_total: int
    map_calls: int  # calls into the range that mapped pages (one per extend that needed pages)
    shared_pages: int  # pages this cache maps that are mapped more than once (or held by the prefix index)
    cow_copies: int  # pages copied on write since creation
    prefix_hit_tokens: int  # tokens reused from the prefix index since creation
    prefix_cached_pages: int  # pages held by the prefix index
    swapped_sequences: int
    swapped_bytes: int  # bytes in swap space
    # Where the mapped memory goes (see vpaged/kvcache/accounting.py). Each physical page counts once, so with
    # sharing stored_bytes <= live_bytes.
    stored_bytes: int  # bytes of live sequences' tokens held in pages, each physical copy once
    fragmentation_bytes: int  # bytes of live sequences' pages holding no token (partly filled pages)
    reserved_bytes: int  # reserved for tokens not yet present (0: vpaged maps on demand)
    dormant_bytes: int  # pages kept only for reuse: freed slots and the prefix cache (reclaimable)

    @property
    def waste_bytes(self) -> int:
        """Memory that holds no live token and cannot be handed out: fragmentation plus reservation."""
        return self.fragmentation_bytes + self.reserved_bytes


@dataclass(frozen=True)
class PagedCacheStats:
    block_size: int
    block_bytes: int  # K and V of block_size tokens over all layers
    num_blocks: int
    used_blocks: int  # blocks referenced by at least one sequence
    free_blocks: int
    shared_blocks: int  # blocks referenced by more than one sequence
    sequences: int
    live_tokens: int  # sum of sequence lengths (a token shared by a fork counts once per sequence)
    stored_tokens: int  # token rows holding data (a shared token counts once)
    live_bytes: int  # K/V bytes of the stored tokens, all layers
    allocated_bytes: int  # used_blocks * block_bytes: what the sequences hold
    pool_bytes: int  # num_blocks * block_bytes: preallocated at construction
    utilization: float  # live_bytes / allocated_bytes (1.0 when nothing is allocated)
    cow_copies: int  # blocks copied by copy-on-write since creation
    # Where the allocated memory goes (see vpaged/kvcache/accounting.py).
    stored_bytes: int  # == live_bytes: each stored token row once
    fragmentation_bytes: int  # rows of allocated blocks that hold no token (partly filled last blocks)
    reserved_bytes: int  # 0: blocks are taken as tokens arrive
    dormant_bytes: int  # 0: freed blocks go straight back to the free list

    @property
    def waste_bytes(self) -> int:
        """Allocated memory that holds no live token: fragmentation plus reservation."""
        return self.fragmentation_bytes + self.reserved_bytes


@dataclass(frozen=True)
class BatchedKV:
    """One layer's K and V of several sequences, for decode kernels that take per-sequence lengths.

    k_ptr / v_ptr address token 0 of slot 0; sequence i starts `slots[i] * slot_stride` elements further
    and holds `lengths[i]` valid tokens with `token_stride` elements between tokens, `head_stride` between
    heads (head_dim except for the head_major layout). V may have its own head dim and strides (v_head_dim,
    v_slot_stride, v_token_stride, v_head_stride; None: the same as K's, filled in on construction).
    Only memory below each length is guaranteed mapped: a kernel must not read past it. Valid until one of
    the sequences is freed, truncated or swapped out.
    """

    k_ptr: int
    v_ptr: int
    slots: torch.Tensor  # int32 [B] on the cache's device
    lengths: torch.Tensor  # int32 [B] on the cache's device
    slot_stride: int
    token_stride: int
    head_stride: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    layout: str
    owner: object  # the cache's range: keeps the memory reserved while this descriptor lives
    v_head_dim: int | None = None
    v_slot_stride: int | None = None
    v_token_stride: int | None = None
    v_head_stride: int | None = None

    def __post_init__(self) -> None:
        # Frozen: fill the "same as K" defaults through object.__setattr__.
        same = self.v_head_dim is None or self.v_head_dim == self.head_dim
        defaults = dict(
            v_head_dim=self.head_dim,
            v_slot_stride=self.slot_stride,
            v_token_stride=self.token_stride,
            # A different V head dim with no stride given: V's heads are dense in its rows.
            v_head_stride=self.head_stride if same else self.v_head_dim,
        )
        for name, value in defaults.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)

    @classmethod
    def from_tensors(cls, k: torch.Tensor, v: torch.Tensor, lengths, layout: str = "bthd") -> BatchedKV:
        """A descriptor over ordinary dense K/V tensors, [B, T, H, D] ("bthd") or [B, H, T, D] ("bhtd"), e.g.
        a StaticCache's, with lengths[i] valid tokens in row i; V may have its own head dim (last dimension)
        and strides. See vpaged.ops.batched_kv_from_tensors."""
        from ..ops import batched_kv_from_tensors  # ops imports the caches, which import this module

        return batched_kv_from_tensors(k, v, lengths, layout)
