"""vpaged.kvcache.virtual: VirtualKVCache, each sequence's K/V in one contiguous virtual range.

cache.py (VirtualKVCache) is the only module of this folder that others import, through this package; the
rest are its parts: layout.py (how a range is cut into slots and page runs), slot_table.py (sequence <->
slot, lengths, watermarks), page_map.py (each slot's mapped pages and the mapping work), views.py,
prefix.py, swap.py, reclaim.py, stats.py and limits.py (address space and mappings of a layout).
"""

from .cache import VirtualKVCache
from .layout import LAYOUTS, Layout

__all__ = ["VirtualKVCache", "Layout", "LAYOUTS"]
