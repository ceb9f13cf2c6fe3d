"""Memory accounting shared by the caches and the simulator: where the bytes of a KV cache go.

Four causes, kept apart because they call for different fixes:
- stored: bytes holding tokens of live sequences (each physical copy once, so sharing lowers it);
- fragmentation: bytes a live sequence holds that carry no token (the partly filled last page or block);
- reserved: bytes set aside for tokens that are not there yet (static max-length slots);
- dormant: pages kept only for reuse (freed slots under deferred reclamation, the prefix cache); the pool
  takes them back on demand, so they are reported beside the waste, not in it.
Waste = fragmentation + reserved.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class MemoryBreakdown:
    stored_bytes: int
    fragmentation_bytes: int
    reserved_bytes: int
    dormant_bytes: int

    @property
    def waste_bytes(self) -> int:
        return self.fragmentation_bytes + self.reserved_bytes

    @property
    def held_bytes(self) -> int:
        """Everything the cache holds: what the budget pays for."""
        return self.stored_bytes + self.waste_bytes + self.dormant_bytes

    def as_dict(self) -> dict:
        return {**asdict(self), "waste_bytes": self.waste_bytes, "held_bytes": self.held_bytes}


def breakdown_of(stats) -> MemoryBreakdown:
    """The breakdown reported by a cache's stats() (VirtualKVCache, PagedKVCache or a simulated policy)."""
    return MemoryBreakdown(stats.stored_bytes, stats.fragmentation_bytes, stats.reserved_bytes, stats.dormant_bytes)


def page_fill(pages, fill) -> dict[int, int]:
    """{page: bytes used} from parallel lists of page ids and the bytes each mapping uses; a page mapped
    several times (shared) keeps its largest use."""
    if len(pages) == 0:
        return {}
    p = np.asarray(pages, dtype=np.int64)
    f = np.asarray(fill, dtype=np.int64)
    order = np.lexsort((f, p))  # by page, then by use: the last entry of each page is its largest
    p, f = p[order], f[order]
    last = np.r_[p[1:] != p[:-1], True]
    return dict(zip(p[last].tolist(), f[last].tolist()))
