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


def virtual_cache_breakdown(layout, slots, pages_at, prefix_pages, swapped) -> tuple[int, int, int]:
    """(stored, fragmentation, dormant) bytes of a VirtualKVCache.

    layout: its Layout; slots: its SlotTable; pages_at(page_indices) -> page ids (the range's lookup);
    prefix_pages: page ids the prefix index holds; swapped: slots of swapped-out sequences.

    A page of a live sequence holds bytes up to the sequence's length in its run; a page shared by several
    sequences counts once, with its fullest use. Dormant: pages of freed slots, of the prefix index that no
    live sequence maps, and live sequences' spare private pages past their tokens (all reclaimable).
    Pages at or past a slot's shared watermark are private to it, so they are counted
    by arithmetic; only the pages below it are looked up and deduplicated (this runs at simulator scale,
    10^5-10^6 pages)."""
    ps, runs = layout.page_size, layout.runs
    stored = fragmentation = spare = 0
    shared_pages, shared_fill = [], []
    for slot in slots.live_slots():
        m = slots.mapped_pages[slot]
        if not m or slot in swapped:
            continue
        used = slots.length_tokens[slot] * layout.token_bytes  # bytes of each run that hold tokens
        upto = min(slots.shared_below_page[slot], m)
        # Private pages past what the tokens need (a reused slot's spare pages) are kept only for reuse and
        # reclaimed on demand: dormant, like a freed slot's.
        need = max(layout.pages_for(slots.length_tokens[slot]), upto)
        if need < m:
            spare += (m - need) * runs
            m = need
        private = max(0, min(used, m * ps) - upto * ps) * runs
        stored += private
        fragmentation += (m - upto) * ps * runs - private
        if upto:
            shared_pages.append(np.asarray(pages_at(layout.page_indices(slot, 0, upto)), dtype=np.int64))
            per_run = np.clip(used - np.arange(upto, dtype=np.int64) * ps, 0, ps)
            shared_fill.append(np.tile(per_run, runs))  # page indices are run-major
    fill = page_fill(np.concatenate(shared_pages), np.concatenate(shared_fill)) if shared_pages else {}
    stored += sum(fill.values())
    fragmentation += len(fill) * ps - sum(fill.values())
    dormant_slots = slots.dormant_slots()
    dormant = sum(slots.mapped_pages[s] for s in dormant_slots if not slots.shared_below_page[s]) * runs
    kept = {
        p
        for s in dormant_slots
        if slots.shared_below_page[s]
        for p in pages_at(layout.page_indices(s, 0, slots.mapped_pages[s]))
    }
    kept.update(prefix_pages)
    num, den = layout.payload_fraction
    if num != den:  # rows padded to the larger of K's and V's head size: the padding holds no token
        payload = stored * num // den
        stored, fragmentation = payload, fragmentation + stored - payload
    return stored, fragmentation, (dormant + spare + len(kept - fill.keys())) * ps
