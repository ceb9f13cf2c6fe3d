"""Plain records the KV caches hand out: CacheStats (what a VirtualKVCache holds), PagedCacheStats (what a
PagedKVCache holds) and BatchedKV (one layer of several sequences, for decode kernels). A leaf of the cache
layer: it imports no cache and no kernel."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InvalidArgumentError, ShapeError
from .checks import check_kernel_dtype, check_lengths, index_tensor
from .formats import KVFormat


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


class StoredValues:
    """What BatchedKV and BlockPools say of the values behind their stored rows (dtype, head_dim, v_head_dim,
    kv_format): for a quantized cache the records count bytes of the rows; these give the values' side."""

    @property
    def value_dtype(self) -> torch.dtype:
        """The dtype of the values K/V stand for (the model's): what q, out and written K/V have."""
        return self.kv_format.dtype if self.kv_format is not None else self.dtype

    @property
    def value_head_dims(self) -> tuple[int, int]:
        """(head_dim, v_head_dim) of the values (the storage dims less an int8 row's scale)."""
        extra = self.kv_format.scale_bytes if self.kv_format is not None else 0
        return self.head_dim - extra, self.v_head_dim - extra


@dataclass(frozen=True)
class BatchedKV(StoredValues):
    """One layer's K and V of several sequences, for decode kernels that take per-sequence lengths.

    k_ptr / v_ptr address token 0 of slot 0; sequence i starts `slots[i] * slot_stride` elements further
    and holds `lengths[i]` valid tokens with `token_stride` elements between tokens, `head_stride` between
    heads (head_dim except for the head_major layout). V may have its own head dim and strides (v_head_dim,
    v_slot_stride, v_token_stride, v_head_stride; None: the same as K's, filled in on construction).
    Only memory below each length is guaranteed mapped: a kernel must not read past it. Valid until one of
    the sequences is freed, truncated or swapped out. A quantized cache describes its stored bytes (see
    kv_format below).
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
    # A quantized cache (formats.py): dtype is torch.uint8 and the dims and strides count bytes of its stored
    # rows (an int8 head's row: head_dim values, then the 4-byte scale); kv_format tells what they hold and
    # kv_scales (fp8) is the layer's (k, v) scales, a view of the cache's. None: plain values of dtype.
    kv_format: KVFormat | None = None
    kv_scales: torch.Tensor | None = None

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
        and strides. Also vpaged.ops.batched_kv_from_tensors."""
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise InvalidArgumentError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 4:
                raise ShapeError(f"{name} must be 4-d ([B, T, H, D] or [B, H, T, D]), got {list(t.shape)}")
        if layout not in ("bthd", "bhtd"):
            raise InvalidArgumentError(f"layout must be 'bthd' ([B, T, H, D]) or 'bhtd' ([B, H, T, D]), got {layout!r}")
        if k.shape[:3] != v.shape[:3] or k.dtype != v.dtype or k.device != v.device:
            raise ShapeError(
                f"k {list(k.shape)} {k.dtype} {k.device} and v {list(v.shape)} {v.dtype} {v.device} differ "
                "(only the head dim, the last dimension, may)"
            )
        check_kernel_dtype(k.dtype, "k")
        batch, tokens, heads, dim, slot_stride, token_stride, head_stride = _dense_strides("k", k, layout)
        *_, v_dim, v_slot_stride, v_token_stride, v_head_stride = _dense_strides("v", v, layout)
        if isinstance(lengths, torch.Tensor):
            lengths = index_tensor(lengths, "lengths", (batch,), k.device)
            if k.device.type == "cpu":
                check_lengths(lengths, tokens)
        else:
            if isinstance(lengths, int) and not isinstance(lengths, bool):
                lengths = [lengths] * batch
            lengths = list(lengths)
            if len(lengths) != batch:
                raise ShapeError(f"lengths has {len(lengths)} entries for {batch} sequences")
            if not all(isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= tokens for n in lengths):
                raise InvalidArgumentError(f"lengths must be ints in 1..{tokens}, got {lengths}")
            lengths = torch.tensor(lengths, dtype=torch.int32, device=k.device)
        slots = torch.arange(batch, dtype=torch.int32, device=k.device)
        return cls(
            k.data_ptr(),
            v.data_ptr(),
            slots,
            lengths,
            slot_stride,
            token_stride,
            head_stride,
            heads,
            dim,
            k.dtype,
            k.device,
            layout,
            (k, v),
            v_head_dim=v_dim,
            v_slot_stride=v_slot_stride,
            v_token_stride=v_token_stride,
            v_head_stride=v_head_stride,
        )


def _dense_strides(name: str, t: torch.Tensor, layout: str) -> tuple[int, int, int, int, int, int, int]:
    """(batch, tokens, heads, dim, slot_stride, token_stride, head_stride) of a [B, T, H, D] / [B, H, T, D]
    tensor whose heads' rows are dense and whose tokens and heads do not overlap."""
    if layout == "bthd":
        batch, tokens, heads, dim = t.shape
        slot_stride, token_stride, head_stride, row_stride = t.stride()
    else:
        batch, heads, tokens, dim = t.shape
        slot_stride, head_stride, token_stride, row_stride = t.stride()
    if min(t.shape) == 0:
        raise ShapeError(f"{name} must not be empty, got {list(t.shape)}")
    if not 1 <= dim <= 256:
        raise ShapeError(f"{name}'s head dim must be in 1..256, got {dim}")
    if (row_stride != 1 and dim > 1) or min(t.stride()) < 0:
        raise InvalidArgumentError(
            f"each head's row of {name} ({dim} elements) must be dense, got strides {t.stride()}"
        )
    if heads == 1:
        head_stride = dim  # one head: its stride is never used
    if tokens == 1:
        token_stride = max(token_stride, heads * dim if head_stride == dim else dim)  # one token: likewise
    if head_stride == dim:
        if token_stride < heads * dim:
            raise InvalidArgumentError(f"tokens of {name} overlap: token stride {token_stride} < {heads} heads x {dim}")
    elif head_stride < tokens * token_stride or token_stride < dim:
        raise InvalidArgumentError(
            f"the strides {t.stride()} of {name} do not give every head a run of {tokens} tokens"
        )
    return batch, tokens, heads, dim, slot_stride, token_stride, head_stride


@dataclass(frozen=True)
class BlockPools(StoredValues):
    """One layer of a PagedKVCache as a block-table kernel reads it: the two dense block pools
    key_cache [num_blocks, block_size, num_kv_heads, head_dim] and value_cache (its own head dim), and what the
    cache says they hold, which a kernel plan checks the pools against (pools of another dtype or fewer blocks
    would let a kernel read and write past its buffers)."""

    key_cache: torch.Tensor
    value_cache: torch.Tensor
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    dtype: torch.dtype
    device: torch.device
    max_seq_len: int  # tokens a sequence may hold: the capacity a length is checked against
    # A quantized cache: the pools hold bytes (dtype uint8, head dims of the stored rows), as in BatchedKV.
    kv_format: KVFormat | None = None
    kv_scales: torch.Tensor | None = None
