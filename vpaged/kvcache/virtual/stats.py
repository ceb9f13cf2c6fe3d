"""VirtualKVCache.stats(): its CacheStats, read from the mapping state, the prefix index and swap state.

Counts only, nothing changes. Where the bytes go (stored, fragmentation, dormant) is accounting.py's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..accounting import virtual_cache_breakdown
from ..records import CacheStats

if TYPE_CHECKING:
    from ...memory.pool import PagePool
    from .page_map import PageMap
    from .prefix import PrefixIndex
    from .swap import SwappedSlots


def virtual_cache_stats(
    page_map: PageMap,
    pool: PagePool,
    prefix: PrefixIndex | None,
    swapped: SwappedSlots,
    prefix_hit_tokens: int,
) -> CacheStats:
    t, lay = page_map.table, page_map.layout
    # Swapped-out sequences hold no tokens in memory, and their pages in swap space are not mapped. With
    # sharing, live bytes can exceed mapped bytes.
    live_tokens = sum(t.length_tokens[s] for s in t.live_slots() if s not in swapped)
    live_bytes = live_tokens * lay.bytes_per_token
    swapped_pages = swapped.page_count
    mapped = t.total_mapped_pages() * lay.runs - swapped_pages
    mapped_bytes = mapped * lay.page_size
    prefix_pages = [p for b in prefix.blocks() for p in b.pages] if prefix else []
    stored, fragmentation, dormant_bytes = virtual_cache_breakdown(
        lay, t, page_map.range.pages_at, prefix_pages, swapped
    )
    pool_stats = pool.stats()
    return CacheStats(
        layout=lay.kind,
        page_size=lay.page_size,
        sequences=len(t.sequences),
        live_tokens=live_tokens,
        live_bytes=live_bytes,
        mapped_pages=mapped,
        mapped_bytes=mapped_bytes,
        dormant_pages=t.total_mapped_pages(t.dormant_slots()) * lay.runs,
        utilization=live_bytes / mapped_bytes if mapped_bytes else 1.0,
        tokens_per_page=lay.tokens_per_page,
        pool_free_pages=pool_stats.free_pages,
        pool_used_pages=pool_stats.used_pages,
        pages_mapped_total=page_map.pages_mapped,
        pages_unmapped_total=page_map.pages_unmapped,
        map_calls=page_map.map_calls,
        shared_pages=page_map.shared_count(),
        cow_copies=page_map.cow_copies,
        prefix_hit_tokens=prefix_hit_tokens,
        prefix_cached_pages=prefix.pages if prefix else 0,
        swapped_sequences=len(swapped),
        swapped_bytes=swapped_pages * lay.page_size,
        stored_bytes=stored,
        fragmentation_bytes=fragmentation,
        reserved_bytes=0,
        dormant_bytes=dormant_bytes,
    )
