"""SlotTable: which sequence sits in which slot (row) of a VirtualKVCache, and what each slot holds.

A slot is one sequence's row in every region of the cache's layout (layout.py); the pages of a slot are
addressed through Layout.page_indices(). Per slot the table keeps, in the units its names say:

  length_tokens       tokens the sequence holds
  new_from_token      first token the last extend() added (new_kv()'s window)
  mapped_pages        pages mapped per page run, from page 0 up (the slot's pages below it are all mapped,
                      except the ones a swapped-out sequence has in swap space)
  shared_below_page   watermark: pages below it may be shared with other slots or the prefix index; pages at
                      or above it are private to the slot. Only raised by sharing, lowered by copy-on-write
                      and unmapping (the invariant the cache's write contract rests on)

A slot without a live sequence is either empty (nothing mapped) or dormant (a freed sequence's pages kept
mapped for reuse, oldest first). The table knows nothing of pages or the range: the cache maps and unmaps,
then records the result here.
"""

from __future__ import annotations

from collections import OrderedDict

from ..checks import lookup_sequence


class SlotTable:
    def __init__(self, max_seqs: int):
        self.max_seqs = max_seqs
        self.length_tokens = [0] * max_seqs
        self.new_from_token = [0] * max_seqs
        self.mapped_pages = [0] * max_seqs
        self.shared_below_page = [0] * max_seqs
        self._slot_of: dict[int, int] = {}  # live sequence id -> slot
        self._empty = list(range(max_seqs - 1, -1, -1))  # pop() gives the lowest
        self._dormant: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._next_id = 0

    # ----------------------------------------------------------------------------------------- sequences
    def slot_of(self, seq) -> int:
        """The slot of a live sequence (UnknownSequenceError for a freed or foreign id)."""
        return lookup_sequence(self._slot_of, seq, self._next_id)

    @property
    def sequences(self) -> list[int]:
        return list(self._slot_of)

    def live_slots(self) -> list[int]:
        return list(self._slot_of.values())

    def bind(self, slot: int) -> int:
        """A new sequence id in `slot` (taken with take()/take_reusable()), holding no tokens yet."""
        seq = self._next_id
        self._next_id += 1
        self._slot_of[seq] = slot
        self.length_tokens[slot] = 0
        self.new_from_token[slot] = 0
        return seq

    def unbind(self, seq: int) -> int:
        """End a sequence; its slot is neither live nor free until release()."""
        slot = self._slot_of.pop(seq)
        self.length_tokens[slot] = 0
        self.new_from_token[slot] = 0
        return slot

    # ----------------------------------------------------------------------------------------- free slots
    @property
    def free_count(self) -> int:
        return len(self._empty) + len(self._dormant)

    def dormant_slots(self) -> list[int]:
        """Freed slots that keep pages mapped, oldest first."""
        return list(self._dormant)

    def is_dormant(self, slot: int) -> bool:
        return slot in self._dormant

    def take_reusable(self) -> int | None:
        """The most recently freed slot (its pages are warmest), else an empty one; None when none is free."""
        if self._dormant:
            return self._dormant.popitem(last=True)[0]
        return self._empty.pop() if self._empty else None

    def take_empty(self) -> int | None:
        return self._empty.pop() if self._empty else None

    def take(self, slot: int) -> None:
        """Take a given free slot (empty or dormant)."""
        if slot in self._dormant:
            del self._dormant[slot]
        else:
            self._empty.remove(slot)

    def release(self, slot: int) -> None:
        """A slot no sequence uses: dormant when pages are still mapped in it, else empty."""
        if self.mapped_pages[slot]:
            self._dormant[slot] = None
        else:
            self.shared_below_page[slot] = 0
            self._empty.append(slot)

    def free_run(self, n: int) -> int | None:
        """The first slot of the lowest run of n consecutive free slots, or None."""
        free = set(self._empty) | set(self._dormant)
        run = 0
        for slot in range(self.max_seqs):
            run = run + 1 if slot in free else 0
            if run == n:
                return slot - n + 1
        return None

    # ----------------------------------------------------------------------------------------- pages
    def set_unmapped(self, slot: int) -> None:
        """Every page of the slot was unmapped; a dormant slot becomes empty."""
        self.mapped_pages[slot] = 0
        self.shared_below_page[slot] = 0
        if slot in self._dormant:
            del self._dormant[slot]
            self._empty.append(slot)

    def truncate_pages(self, slot: int, keep: int) -> None:
        """The slot's pages from `keep` on were unmapped."""
        self.mapped_pages[slot] = min(self.mapped_pages[slot], keep)
        self.shared_below_page[slot] = min(self.shared_below_page[slot], keep)

    def mark_shared(self, slot: int, pages: int) -> None:
        """The slot's first `pages` pages may now be shared."""
        self.shared_below_page[slot] = max(self.shared_below_page[slot], min(pages, self.mapped_pages[slot]))

    def mark_private_from(self, slot: int, page: int) -> None:
        """Copy-on-write made every page of the slot from `page` on private."""
        self.shared_below_page[slot] = min(self.shared_below_page[slot], page)

    def total_mapped_pages(self, slots=None) -> int:
        return sum(self.mapped_pages[s] for s in (range(self.max_seqs) if slots is None else slots))
