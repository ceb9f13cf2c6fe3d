"""What VirtualKVCache and PagedKVCache share: the KVCache protocol and the KVCacheBase they build on.

KVCache is the contract every cache of vpaged keeps (the engine's stores, the simulator and the kernels in
vpaged.ops rely on nothing else): sequences are allocated, extended by tokens, written, read and freed, and
`decode_source(layer)` / `decode_rows(seqs)` describe one layer's memory and a step's sequences to a kernel
as plain records, so that vpaged.ops builds a step's DecodePlan from them without knowing the cache's class
(a new cache type adds a record and a plan, not a branch in ops). KVCacheBase holds the model's K/V geometry and the
sequence limits (checked here, once for both), what a token and a static cache of the same shape cost, the
per-layer kernel plans (built by vpaged.ops, kept on the cache so that they die with it), and closing as a
context manager.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar, runtime_checkable

import torch

from .config import PagedCacheConfig, VirtualCacheConfig
from .formats import QuantizedKV, check_scales
from .geometry import KVGeometry
from .records import BatchedKV, BlockPools, CacheStats, PagedCacheStats

C = TypeVar("C", bound="KVCacheBase")

# What the protocol's members take and give, named once (a cache may give one side of a union: its own kind).
KVPair = tuple[torch.Tensor, torch.Tensor] | tuple[QuantizedKV, QuantizedKV]  # QuantizedKV: quantized
DecodeSource = BatchedKV | BlockPools  # one layer's memory, as vpaged.ops reads it
DecodeRows = tuple[list[int], list[int]] | tuple[list[list[int]], list[int]]  # (slots | tables, lengths)
AnyCacheStats = CacheStats | PagedCacheStats
AnyCacheConfig = VirtualCacheConfig | PagedCacheConfig


@runtime_checkable
class KVCache(Protocol):
    """The operations every vpaged KV cache offers (VirtualKVCache, PagedKVCache). Each member's signature is
    the caches' own, annotations included: tests/kvcache/test_kvcache_protocol.py compares them with every cache. The
    geometry's fields (num_layers, num_kv_heads, head_dim, v_head_dim, dtype, kv_dtype) are read from
    `geometry`; KVCacheBase also keeps them as attributes of the cache."""

    geometry: KVGeometry  # what a token's K/V is: layers, heads, head sizes, dtype, what is stored
    config: AnyCacheConfig  # the record the cache was built from (kvcache/config.py)
    device: torch.device
    max_seqs: int
    max_seq_len: int
    kernel_plans: dict[int, object]  # layer -> the kernel plan vpaged.ops built from decode_source(layer)

    def allocate(self, tokens: Sequence[int] | None = None) -> int: ...  # a prompt: a cache may find its prefix
    def allocate_many(self, n: int) -> list[int]: ...
    def free(self, seq: int) -> None: ...
    def fork(self, seq: int) -> int: ...
    def extend(self, seq: int, n: int) -> None: ...
    def extend_many(self, seqs: Sequence[int], n: int = 1) -> None: ...
    def pages_needed(self, seqs: Sequence[int], n: int = 1) -> int: ...
    def pages_available(self) -> int: ...
    def truncate(self, seq: int, new_len: int) -> None: ...
    def seq_len(self, seq: int) -> int: ...
    @property
    def sequences(self) -> list[int]: ...
    def kv(self, layer: int, seq: int) -> KVPair: ...  # views; QuantizedKV records when quantized
    def dequantized_kv(self, layer: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]: ...
    def write(self, layer: int, seq: int, k: torch.Tensor, v: torch.Tensor, start: int | None = None) -> None: ...
    def decode_source(self, layer: int) -> DecodeSource: ...  # one layer's memory as a record (records.py)
    def decode_rows(self, seqs: Sequence[int]) -> DecodeRows: ...  # a step's sequences: (slots | tables, lengths)
    def stats(self) -> AnyCacheStats: ...
    def close(self) -> None: ...


def is_kvcache(obj) -> bool:
    """isinstance(obj, KVCache): any object that implements the protocol. The caches built on KVCacheBase
    pass at once (tests/kvcache/test_kvcache_protocol.py checks their members and signatures): a runtime protocol
    check walks every member on each call, 0.6-0.9 ms here on Python 3.11, too much for once per step."""
    return isinstance(obj, KVCacheBase) or isinstance(obj, KVCache)


class KVCacheBase:
    geometry: KVGeometry

    def _init_shape(self, geometry: KVGeometry, config: AnyCacheConfig) -> None:
        # Both arrive checked (kvcache/geometry.py: check_cache_args; the record's own __post_init__: the
        # sequence limits); only the scales, which need the geometry's layers and format, are checked here.
        self.geometry = geometry
        self.num_layers, self.num_kv_heads, self.head_dim = (
            geometry.num_layers,
            geometry.num_kv_heads,
            geometry.head_dim,
        )
        self.v_head_dim = geometry.v_head_dim  # V's head size: head_dim unless the model's differs
        self.dtype = geometry.dtype  # of the K/V written and read (the model's)
        self.kv_dtype = geometry.kv_dtype  # what is stored: dtype, or a quantized format (kvcache/formats.py)
        self.kv_format = geometry.format
        # fp8: each layer's (K, V) scales, [num_layers, 2] float32 (NaN: calibrated by the layer's first write).
        self.kv_scales = check_scales(config.kv_scales, geometry.num_layers, self.kv_format)
        self.max_seqs, self.max_seq_len = config.max_seqs, config.max_seq_len
        # layer -> the kernel plan vpaged.ops built for it (ops/plans.py); emptied by close().
        self.kernel_plans: dict = {}

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over all layers."""
        return self.geometry.bytes_per_token

    def static_bytes(self, num_seqs: int | None = None) -> int:
        """What reserving max_seq_len tokens for each of num_seqs sequences (default max_seqs) would take."""
        return self.geometry.static_bytes(self.max_seqs if num_seqs is None else num_seqs, self.max_seq_len)

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: C) -> C:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
