"""vpaged.kvcache: the KV caches on a page pool.

base.py holds what both caches share (KVCacheBase, the KVCache protocol), geometry.py the shape of a
token's K/V, config.py the record each cache kind is built from besides its geometry (VirtualCacheConfig,
PagedCacheConfig), records.py the plain records the caches hand out (CacheStats, PagedCacheStats, BatchedKV:
a leaf that imports no cache), accounting.py where mapped memory goes, eviction.py what a cache gives up
first when its pool runs short (the eviction policy of cached prefixes, the reclaim order). paged.py is the
block-table cache; virtual/ is the contiguous-range cache, whose only public faces are VirtualKVCache and Layout.
"""

from .base import KVCache, KVCacheBase
from .config import PagedCacheConfig, VirtualCacheConfig
from .eviction import EvictionPolicy, LFUEviction, LRUEviction, ReclaimOrder, ReclaimStage
from .geometry import KVGeometry
from .paged import PagedKVCache
from .records import BatchedKV, CacheStats, PagedCacheStats
from .virtual import Layout, VirtualKVCache

__all__ = [
    "KVCache",
    "KVCacheBase",
    "KVGeometry",
    "VirtualCacheConfig",
    "PagedCacheConfig",
    "VirtualKVCache",
    "PagedKVCache",
    "Layout",
    "CacheStats",
    "PagedCacheStats",
    "BatchedKV",
    "EvictionPolicy",
    "LRUEviction",
    "LFUEviction",
    "ReclaimOrder",
    "ReclaimStage",
]
