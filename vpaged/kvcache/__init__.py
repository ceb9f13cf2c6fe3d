"""vpaged.kvcache: the KV caches on a page pool.

base.py holds what both caches share (KVCacheBase, the KVCache protocol), geometry.py the shape of a
token's K/V, records.py the plain records the caches hand out (CacheStats, PagedCacheStats, BatchedKV: a
leaf that imports no cache), accounting.py where mapped memory goes. paged.py is the block-table cache;
virtual/ is the contiguous-range cache, whose only public faces are VirtualKVCache and Layout.
"""

from .base import KVCache, KVCacheBase
from .geometry import KVGeometry
from .paged import PagedKVCache
from .records import BatchedKV, CacheStats, PagedCacheStats
from .virtual import Layout, VirtualKVCache

__all__ = [
    "KVCache",
    "KVCacheBase",
    "KVGeometry",
    "VirtualKVCache",
    "PagedKVCache",
    "Layout",
    "CacheStats",
    "PagedCacheStats",
    "BatchedKV",
]
