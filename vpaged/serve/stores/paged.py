"""PagedStore (kv="paged"): a PagedKVCache of block_size-token blocks addressed through block tables.

The classic design the vpaged store is measured against. Decode rows run the block-table kernel; prefill
chunks run SDPA on K/V gathered from the blocks. No prefix caching and no swap space: a preempted sequence
is recomputed. A "page" of the KVStore contract is one block here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...errors import InvalidArgumentError, SwapSpaceFullError
from ...kvcache.geometry import KVGeometry
from ...kvcache.paged import PagedCacheConfig, PagedKVCache
from ...ops import DecodePlan, decode_unsupported
from .attention import StepAttention, decodes_as_prefills, prefill_rows
from .base import Allocation, StoreMemory

if TYPE_CHECKING:
    from ..config import EngineConfig


class PagedStep(StepAttention):
    """A step over a PagedKVCache: new K/V go to their pool rows (block * block_size + offset) by one
    index_copy per layer, decode rows run the step's DecodePlan (vpaged.ops) over the block tables, prefill
    chunks gather their prefix's rows."""

    def __init__(self, store: PagedStore, decodes, prefills, row_offsets, num_tokens):
        super().__init__(len(decodes), prefill_rows(row_offsets, prefills), num_tokens, store.device)
        cache, bs = store.cache, store.cache.block_size
        self._cache = cache
        rows: list[int] = []  # pool row (block * block_size + offset) of each new token
        for seq in decodes:
            t = seq.num_computed
            rows.append(cache.blocks(seq.handle)[t // bs] * bs + t % bs)
        self._prefill_rows = []
        for seq, start, n in prefills:
            table = torch.tensor(cache.blocks(seq.handle), dtype=torch.int64)
            pos = torch.arange(start + n)
            token_rows = (table[pos // bs] * bs + pos % bs).to(store.device)
            self._prefill_rows.append(token_rows)
            rows.extend(token_rows[start:].tolist())
        self._rows = torch.tensor(rows, dtype=torch.int64, device=store.device)
        # Decode rows: one plan for the step from the cache's own rows (block tables), run per layer.
        self._decode = None
        if decodes:  # each attends over its tokens and the new one (a static slot holds more)
            lengths = [seq.num_computed + 1 for seq in decodes]
            self._decode = DecodePlan.build(cache, [seq.handle for seq in decodes], lengths)

    def write(self, layer, k, v):
        self._cache.write_rows(layer, self._rows, k, v)  # quantized on the way in for a quantized format

    def decode(self, layer, q, scale, out):
        self._decode.run(layer, q, scale, out)

    def prefill_kv(self, layer, i):
        return self._cache.gather_rows(layer, self._prefill_rows[i])  # values, dequantized when stored so


class PagedStore:
    """kv="paged": a PagedKVCache (no prefix caching, no swap). `cache` is public for inspection."""

    kind = "paged"
    prefix_caching = False
    prefix_tokens_per_page = 0.0
    swap_capacity = 0

    def __init__(self, config: EngineConfig, geometry: KVGeometry, max_seq_len: int):
        options = config.store  # a PagedStoreConfig
        self.cache = PagedKVCache(
            geometry,
            PagedCacheConfig(
                max_seqs=config.scheduler.max_cache_seqs,
                max_seq_len=max_seq_len,
                device=config.model.device,
                capacity_bytes=options.kv_budget_bytes,
                block_size=options.block_size,
                kv_scales=options.kv_scales,
                shared_budget=options.shared_budget,
                member_name=options.shared_budget_member or "",
            ),
        )
        self.device = self.cache.device
        self.page_bytes = self.cache.block_bytes
        self.prefix_caching_off = "kv='paged' (the block-table baseline) does not cache prefixes"
        # Why decode rows cannot go to the kernel on this device (None: they do); SDPA serves them then.
        heads, dim, v_dim = geometry.num_kv_heads, geometry.head_dim, geometry.v_head_dim
        row, v_row, _ = geometry.storage_dims()  # the pools' rows (bytes of a quantized format)
        self.decode_unsupported = decode_unsupported(
            self.device, geometry.dtype, dim, v_dim, (heads * row, row, heads * v_row, v_row), geometry.kv_dtype
        )
        # The block pool is preallocated: the high water mark is of blocks taken, tracked as they are taken.
        self._high_water_blocks = 0

    # ---- capacity
    def total_pages(self) -> int:
        return self.cache.num_blocks

    def pages_for_tokens(self, tokens: int) -> int:
        return -(-tokens // self.cache.block_size)

    def pages_for_request(self, tokens: int, completions: int) -> int:
        return self.pages_for_tokens(tokens)  # forks share the prompt's blocks, as in VirtualStore

    def free_slots(self) -> int:
        return self.cache.max_seqs - len(self.cache.sequences)

    def pages_available(self, need: int) -> bool:
        return need <= self.cache.pages_available()

    def budget_figures(self):
        share = self.cache.budget_share  # an accounting-only member holding the block pools (or None)
        return share.budget_figures() if share is not None else None

    def label_budget_member(self, model: str) -> None:
        if self.cache.budget_share is not None:
            self.cache.budget_share.label_budget_member(model)

    def within_share(self, need: int) -> bool:
        return True  # its block pools are reserved up front: a fixed minimum in a budget, nothing to share

    def pages_needed(self, handles, n: int) -> int:
        return self.cache.pages_needed(handles, n)

    # ---- sequences
    def can_allocate(self, seats: int) -> bool:
        return self.free_slots() >= seats

    def allocate(self, tokens, seats: int = 1) -> Allocation:
        return Allocation(self.cache.allocate(), 0)  # no prefix cache: nothing is found

    def slot(self, handle: int) -> int:
        return -1  # block tables, no slots

    def extend(self, handles, n: int) -> None:
        if handles:
            self.cache.extend_many(handles, n)
            used = self.cache.num_blocks - self.cache.pages_available()
            self._high_water_blocks = max(self._high_water_blocks, used)

    def truncate(self, handle: int, length: int) -> None:
        self.cache.truncate(handle, length)

    def free(self, handle: int) -> None:
        self.cache.free(handle)

    def fork(self, handle: int, n: int, length: int) -> list[int]:
        """n sequences sharing every block of `handle` (copy-on-write); `length` is what it holds."""
        return [self.cache.fork(handle) for _ in range(n)]

    def cache_prefix(self, handle: int, tokens: list[int]) -> None:
        pass  # no prefix cache

    # ---- swapping: there is no swap space, so the scheduler recomputes instead (can_swap_out is False)
    def can_swap_out(self, handle: int) -> bool:
        return False

    def swap_out(self, handle: int) -> int:
        raise SwapSpaceFullError("the paged store has no swap space: can_swap_out() is always False")

    def swap_in(self, handle: int) -> None:
        raise InvalidArgumentError(f"sequence {handle} is not swapped out: the paged store has no swap space")

    # ---- a step
    def step_attention(self, decodes, prefills, row_offsets, num_tokens) -> StepAttention:
        if self.decode_unsupported is not None:
            decodes, prefills, row_offsets = decodes_as_prefills(decodes, prefills, row_offsets)
        return PagedStep(self, decodes, prefills, row_offsets, num_tokens)

    # ---- memory
    def memory(self) -> StoreMemory:
        c = self.cache
        used = c.num_blocks - c.pages_available()
        live = sum(c.seq_len(s) for s in c.sequences)
        return StoreMemory(
            live_tokens=live,
            live_bytes=live * c.bytes_per_token,
            held_bytes=used * c.block_bytes,
            high_water_bytes=self._high_water_blocks * c.block_bytes,
            budget_bytes=c.num_blocks * c.block_bytes,
            prefix_hit_tokens=0,
            swapped_bytes=0,
            free_pages=c.num_blocks - used,
            used_pages=used,
        )

    def close(self) -> None:
        self.cache.close()
