"""SlotReclaim: what a VirtualKVCache can give back to its pool when the pool runs short, and giving it.

Three kinds of pages are kept only for reuse (deferred reclamation), given back in the cache's ReclaimOrder
(kvcache/eviction.py; by default in this order):
- the pages of freed (dormant) slots, oldest first, skipping slots a live view still reads;
- cached prefix blocks that nothing but the prefix index maps, in the index's eviction order (least
  recently used first by default);
- spare pages of live sequences past what their tokens need (a freed slot reused by a shorter sequence
  keeps the longer one's pages), except those of sequences an extend in progress is growing into.
The cache implements the pool's Reclaimable protocol by delegating here.

During a CUDA graph capture on one of the range's streams only the second kind is given back: unmapping
waits for those streams, which a capture forbids (the range refuses it, and a wait on the capturing stream
would invalidate the capture). An allocation that needs the other kinds then gets OutOfPagesError, with
nothing changed; it succeeds again after the capture.
"""

from __future__ import annotations

from collections.abc import Container
from typing import TYPE_CHECKING

from ..eviction import ReclaimOrder, ReclaimStage, resolve_reclaim_order

if TYPE_CHECKING:
    from .page_map import PageMap
    from .prefix import PrefixIndex


class SlotReclaim:
    def __init__(
        self, page_map: PageMap, prefix: PrefixIndex | None, swapped: Container[int], order: ReclaimOrder | None = None
    ):
        """page_map: the cache's mapping state; prefix: its prefix index (None without one); swapped: the slots
        of swapped-out sequences (their page lists have holes: never trimmed); order: which kind of pages goes
        back first (default: dormant slots, then prefix blocks, then spare tails)."""
        self.page_map, self.prefix, self.swapped = page_map, prefix, swapped
        self.order = order or resolve_reclaim_order()

    def unpinned_dormant_slots(self) -> list[int]:
        """Freed slots whose pages no live view reads (reclaim can unmap them), oldest first."""
        return [s for s in self.page_map.table.dormant_slots() if not self.page_map.pinned(s)]

    def spare_tails(self) -> list[tuple[int, int]]:
        """(slot, first spare page) of live sequences holding unpinned private pages past what their tokens
        (or the extend in progress) need. They are kept for the sequence to grow into."""
        t, out = self.page_map.table, []
        for slot in t.live_slots():
            length = max(t.length_tokens[slot], self.page_map.growing.get(slot, 0))
            first = max(self.page_map.layout.pages_for(length), t.shared_below_page[slot])
            if first < t.mapped_pages[slot] and slot not in self.swapped and not self.page_map.pinned(slot, first):
                out.append((slot, first))
        return out

    def spare_pages_of(self, slots: list[int]) -> int:
        """Pages of the spare tails of `slots` that reclaimable_pages() counts: an extend of those slots keeps
        them (it grows into them, and reclaim skips a slot while it grows), so they are not there for it."""
        mine = set(slots)
        t = self.page_map.table
        return (
            sum(t.mapped_pages[s] - first for s, first in self.spare_tails() if s in mine) * self.page_map.layout.runs
        )

    def evictable_blocks(self, dormant: list[int]):
        """Prefix blocks whose pages only the index holds once the given dormant slots let go of theirs."""
        if not self.prefix:
            return []
        releasable = {p for s in dormant for p in self.page_map.pages(s)}
        return self.prefix.evictable(releasable)

    def capturing(self) -> bool:
        """Whether a stream the range waits for is capturing a CUDA graph (no unmapping then)."""
        return self.page_map.range.capturing()

    def reclaimable_pages(self) -> int:
        """Pages reclaim_pages() could return to the pool now."""
        if self.capturing():
            return sum(len(b.pages) for b in self.evictable_blocks([]))
        t = self.page_map.table
        dormant = self.unpinned_dormant_slots()
        spare = sum(t.mapped_pages[s] - first for s, first in self.spare_tails())
        blocks = sum(len(b.pages) for b in self.evictable_blocks(dormant))
        return (t.total_mapped_pages(dormant) + spare) * self.page_map.layout.runs + blocks

    def reclaim_pages(self, pages: int) -> int:
        """Give back pages stage by stage in the reclaim order (dormant slots, prefix blocks, spare tails by
        default) until `pages` are freed. Returns the pages freed."""
        stages = list(self.order.stages)
        if stages.index(ReclaimStage.PREFIX) < stages.index(ReclaimStage.DORMANT):
            # Blocks that freed slots also map become evictable only once those slots are unmapped, and
            # reclaimable_pages() counts them: evict them after the dormant stage too.
            stages.insert(stages.index(ReclaimStage.DORMANT) + 1, ReclaimStage.PREFIX)
        freed = 0
        if self.capturing():  # prefix blocks only: evicting one drops references, it unmaps nothing
            return self._give_back(ReclaimStage.PREFIX, pages)
        for stage in stages:
            if freed >= pages:
                break
            freed += self._give_back(stage, pages - freed)
        return freed

    def _give_back(self, stage: ReclaimStage, pages: int) -> int:
        """Up to about `pages` pages of one kind (whole slots, blocks, tails: the last may overshoot)."""
        freed = 0
        if stage is ReclaimStage.DORMANT:
            for slot in self.page_map.table.dormant_slots():
                if freed >= pages:
                    break
                n = len(self.page_map.page_indices(slot))
                if self.page_map.unmap_slot(slot):
                    freed += n
        elif stage is ReclaimStage.PREFIX and self.prefix:
            for block in self.evictable_blocks([]):
                if freed >= pages:
                    break
                freed += self.prefix.evict(block)
        elif stage is ReclaimStage.SPARE:
            for slot, first in self.spare_tails():
                if freed >= pages:
                    break
                n = len(self.page_map.page_indices(slot, first))
                if self.page_map.unmap_tail(slot, first):  # unpinned (checked), private: nothing reads them
                    freed += n
        return freed
