"""The records a cache is built from, besides its KVGeometry: one per cache kind.

A cache is `Cache(geometry, config)`: the geometry says what a token's K/V is (kvcache/geometry.py), the
config what the cache maps (sequences and their length), where it lives (device, pool size, page or block
size, a shared budget) and how it keeps what it stores (layout, fp8 scales, swap space, which kept pages go
first). Live objects a cache works with (a PagePool to share, a prefix hash function) are keywords of the
cache's constructor, not fields of the record, so a record stays a plain value that can be logged, compared
and rebuilt with dataclasses.replace().

Fields are checked when the record is made (a typed error names the field), so a bad value never reaches
the memory layers; what only the cache can check against the geometry (a layout that does not fit, a pool
on another device) is checked by the cache, which then builds nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InvalidArgumentError
from ..memory import SharedBudget
from .checks import check_positive_int, is_int
from .eviction import EvictionPolicy, ReclaimOrder

__all__ = ["BLOCK_SIZES", "LAYOUTS", "PagedCacheConfig", "VirtualCacheConfig"]

BLOCK_SIZES = (8, 16, 32)  # tokens per block the paged decode kernels take
LAYOUTS = ("per_layer", "interleaved", "head_major")  # of a VirtualKVCache: kvcache/virtual/layout.py


def check_optional_bytes(name: str, value) -> None:
    if value is not None and (not is_int(value) or value <= 0):
        raise InvalidArgumentError(f"{name} must be a positive int of bytes or None, got {value!r}")


def check_budget(shared_budget, min_bytes, member_name) -> None:
    if shared_budget is not None and not isinstance(shared_budget, (str, SharedBudget)):
        raise InvalidArgumentError(
            f"shared_budget must be a budget's name or a SharedBudget, got {type(shared_budget).__name__}"
        )
    if not is_int(min_bytes) or min_bytes < 0:
        raise InvalidArgumentError(f"min_bytes must be an int >= 0, got {min_bytes!r}")
    if not isinstance(member_name, str):
        raise InvalidArgumentError(f"member_name must be a str, got {type(member_name).__name__}")


@dataclass(frozen=True)
class VirtualCacheConfig:
    """How a VirtualKVCache is built (its geometry aside).

    What it maps:
        max_seqs: sequence slots (concurrent sequences). max_seq_len: tokens a sequence may hold.
    Where it lives:
        device: "cpu", "cuda" or "cuda:N"; default: the pool's device when a pool is given, else "cpu".
        capacity_bytes: a private pool of this size; None: the pool given to the cache, else the device's
            default pool. page_size: bytes per page of a private or default pool (must match a given pool).
        shared_budget: the name of a machine-wide budget (vpaged.memory.SharedBudget), or the budget, for the
            private pool to join: capacity_bytes (default: the budget's capacity) is its ceiling, min_bytes its
            guaranteed share, member_name its name in `vpaged budget show`. Idle, it gives back what others
            need; close() leaves the budget.
    How it keeps what it stores:
        layout: "per_layer" (dense [T, H, D] per-layer views), "interleaved" (all layers of a token together:
            finer fill granularity, one map per page for all layers) or "head_major" (dense [H, T, D] per
            layer, what SDPA prefers; a page per head). See kvcache/virtual/layout.py.
        kv_scales: fp8 only: the per-layer (K, V) scales: a float, a (k, v) pair, [num_layers, 2], or
            "calibrate" (set from each layer's first write). Default 1.0.
        swap_bytes: capacity of the host swap space for swap_out() (0: no swapping).
        eviction_policy: which cached prefix blocks go first when the pool runs low: "lru", "lfu", or an
            EvictionPolicy; reclaim_order: which kind of kept pages goes back first: "dormant_first" (freed
            slots, then prefix blocks, then spare tails), "prefix_first", or a ReclaimOrder
            (kvcache/eviction.py).
    Shared with other processes:
        prefix_store: a KV page store (vpaged.memory.store.PageStore) by name ("NAME": in /dev/shm; "dir:PATH":
            files under PATH, kept across restarts), made when missing with prefix_store_pages pages of this
            cache's page size (default 4096). cache_prefix() publishes full blocks there; allocate(tokens)
            fills the blocks after the local prefix hits from it (kvcache/virtual/store_link.py).
            prefix_store_weights: the model weights' identity (a name with its revision, or a digest), part
            of every page's key with the geometry, layout, page size and KV format: required with a store.
            prefix_store_map: map the store's pages into the range on a hit, no byte copied (True, the
            default; on the CPU), or copy each page into the sequence's own (False).
    """

    max_seqs: int = 64
    max_seq_len: int = 4096
    device: str | torch.device | None = None
    capacity_bytes: int | None = None
    page_size: int | None = None
    shared_budget: str | SharedBudget | None = None
    min_bytes: int = 0
    member_name: str = ""
    layout: str = "per_layer"
    kv_scales: object = None
    swap_bytes: int = 0
    eviction_policy: str | EvictionPolicy = "lru"
    reclaim_order: str | ReclaimOrder = "dormant_first"
    prefix_store: str | None = None
    prefix_store_weights: str = ""
    prefix_store_pages: int | None = None
    prefix_store_map: bool = True

    def __post_init__(self):
        if not isinstance(self.prefix_store_map, bool):
            raise InvalidArgumentError(f"prefix_store_map must be a bool, got {self.prefix_store_map!r}")
        check_positive_int("max_seqs", self.max_seqs)
        check_prefix_store(self.prefix_store, self.prefix_store_weights, self.prefix_store_pages)
        check_positive_int("max_seq_len", self.max_seq_len)
        check_optional_bytes("capacity_bytes", self.capacity_bytes)
        check_optional_bytes("page_size", self.page_size)
        if not is_int(self.swap_bytes) or self.swap_bytes < 0:
            raise InvalidArgumentError(f"swap_bytes must be an int >= 0, got {self.swap_bytes!r}")
        if self.layout not in LAYOUTS:
            raise InvalidArgumentError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        check_budget(self.shared_budget, self.min_bytes, self.member_name)


def check_prefix_store(store, weights, pages) -> None:
    if store is None:
        if weights or pages is not None:
            raise InvalidArgumentError("prefix_store_weights and prefix_store_pages go with a prefix_store")
        return
    if not isinstance(store, str) or not store:
        raise InvalidArgumentError(f'prefix_store is a store name or "dir:PATH", got {store!r}')
    if not isinstance(weights, str) or not weights:
        raise InvalidArgumentError(
            "prefix_store_weights names the model weights (a name with its revision, or a digest): pages of "
            "another model must never hit"
        )
    if pages is not None:
        check_positive_int("prefix_store_pages", pages)


@dataclass(frozen=True)
class PagedCacheConfig:
    """How a PagedKVCache (fixed-size blocks through block tables) is built (its geometry aside).

    What it maps:
        max_seqs: sequences that may be live at once. max_seq_len: tokens a sequence may hold (its block
            table is max_seq_len / block_size wide).
    Where it lives:
        num_blocks or capacity_bytes (exactly one): the block pool's size; a block holds block_size tokens of
            K and V in every layer, capacity_bytes is rounded down to whole blocks.
        device: "cpu", "cuda" or "cuda:N". block_size: tokens per block, 8, 16 or 32.
        accounting_only: keep the block tables and counts but allocate no block pools (the simulator's mode:
            any scale on any host); write(), kv() and kernels then raise InvalidArgumentError.
        shared_budget: a machine-wide budget's name (or the budget) that the block pools' bytes are reserved
            in for the cache's life (OutOfPagesError when it cannot grant them); member_name: how `vpaged
            budget show` names that reservation (default paged-kv).
    How it keeps what it stores:
        kv_scales: fp8 only, as VirtualCacheConfig's.
    """

    max_seqs: int = 64
    max_seq_len: int = 4096
    num_blocks: int | None = None
    capacity_bytes: int | None = None
    device: str | torch.device = "cpu"
    block_size: int = 16
    accounting_only: bool = False
    shared_budget: str | SharedBudget | None = None
    member_name: str = ""
    kv_scales: object = None

    def __post_init__(self):
        check_positive_int("max_seqs", self.max_seqs)
        check_positive_int("max_seq_len", self.max_seq_len)
        if self.block_size not in BLOCK_SIZES:
            raise InvalidArgumentError(f"block_size must be one of {BLOCK_SIZES}, got {self.block_size!r}")
        if (self.num_blocks is None) == (self.capacity_bytes is None):
            raise InvalidArgumentError("give exactly one of num_blocks and capacity_bytes")
        if self.num_blocks is not None and (not is_int(self.num_blocks) or self.num_blocks <= 0):
            raise InvalidArgumentError(f"num_blocks must be a positive int, got {self.num_blocks!r}")
        check_optional_bytes("capacity_bytes", self.capacity_bytes)
        check_budget(self.shared_budget, 0, self.member_name)
