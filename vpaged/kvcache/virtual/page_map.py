"""PageMap: the mapping state of a VirtualKVCache's range, slot by slot.

Owns the C++ VirtualRange, the Layout that cuts it into slots and page runs, the SlotTable that records what
each slot has mapped, and the counters of mapping work (pages mapped / unmapped, map calls, copy-on-write
copies). Every map, unmap, remap and copy-on-write of a slot's pages goes through here, and the table is
updated only after the range call succeeded, so an error leaves both unchanged.

The cache decides which sequences share which pages (fork, reorder, prefix hits) and keeps the write
contract; this module carries the decisions out. The one rule it applies itself is copy-on-write in
plan_extend(): a page below a slot's shared watermark that new tokens land in is made private first.
The wait for kernels before any unmap or remap lives in the C++ range.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ...errors import (
    InvalidArgumentError,
    OutOfPagesError,
    SequenceTooLongError,
    SlotsExhaustedError,
    ViewsAliveError,
)
from .layout import Layout
from .slot_table import SlotTable

if TYPE_CHECKING:
    from ...memory.pool import PagePool
    from .swap import SwapSpace


@dataclass
class ExtendPlan:
    """What growing `slots` by n tokens takes: fresh page indices to map, and mapped page indices the new
    tokens land in that may be shared (copy-on-write: `copies` of them need a fresh page)."""

    slots: list[int]
    n: int
    fresh: list[int] = field(default_factory=list)
    grown: list[tuple[int, int]] = field(default_factory=list)  # (slot, pages mapped per run afterwards)
    to_privatize: list[int] = field(default_factory=list)
    copies: int = 0

    @property
    def pages(self) -> int:
        """Pages the plan takes from the pool."""
        return len(self.fresh) + self.copies


class PageMap:
    def __init__(self, vrange, layout: Layout, pool: PagePool):
        self.range, self.layout, self.pool = vrange, layout, pool
        self.table = SlotTable(layout.max_seqs)
        self.pages_mapped = self.pages_unmapped = self.map_calls = self.cow_copies = 0
        # slot -> length an extend in progress grows it to: reclaim, called by the pool while the extend
        # makes room, must leave the spare pages that the extend's plan counts on (see reclaim.py).
        self.growing: dict[int, int] = {}

    # ----------------------------------------------------------------------------------------- queries
    def page_indices(self, slot: int, first: int = 0, stop: int | None = None) -> list[int]:
        """Page indices of pages first..stop-1 (default: up to what is mapped) of every run of `slot`."""
        return self.layout.page_indices(slot, first, self.table.mapped_pages[slot] if stop is None else stop)

    def pages(self, slot: int, first: int = 0, stop: int | None = None) -> list[int]:
        """The page ids mapped at page_indices(slot, first, stop) (-1 where nothing is mapped)."""
        return self.range.pages_at(self.page_indices(slot, first, stop))

    def pinned(self, slot: int, first: int = 0) -> bool:
        """Whether a live view reads one of the slot's mapped pages from page `first` on."""
        return bool(self.range.pinned_count(self.page_indices(slot, first)))

    def shares_pages(self, slot: int) -> bool:
        """Whether another slot or the prefix index holds one of the slot's pages."""
        return any(c > 1 for c in self.range.refcounts_at(self.page_indices(slot)))

    def shared_count(self) -> int:
        """Distinct mapped page indices whose page is also held elsewhere. Only pages below a slot's shared
        watermark can be shared: just those are looked up (unmapped ones read 0)."""
        t = self.table
        maybe = [
            index
            for slot, upto in enumerate(t.shared_below_page)
            if upto
            for index in self.page_indices(slot, 0, min(upto, t.mapped_pages[slot]))
        ]
        return sum(1 for c in self.range.refcounts_at(maybe) if c > 1) if maybe else 0

    def page_of_next_token(self, slot: int) -> int:
        """The page (of each run) the slot's next token starts in."""
        return self.table.length_tokens[slot] * self.layout.token_bytes // self.layout.page_size

    def first_writable(self, slot: int) -> int:
        """The first token whose bytes all lie in pages at or past the shared watermark (private to the slot)."""
        lay, t = self.layout, self.table
        first = -(-t.shared_below_page[slot] * lay.page_size // lay.token_bytes)
        return min(first, t.length_tokens[slot])

    def exhausted(self, what: str, n: int = 1) -> SlotsExhaustedError:
        """The error for a cache with no room for `what`: says how many free slots live views pin."""
        t = self.table
        viewed = sum(1 for s in t.dormant_slots() if self.pinned(s))
        return SlotsExhaustedError(
            f"no room for {what if n == 1 else f'{n} {what}'}: {len(t.sequences)} of {t.max_seqs} slots hold "
            f"live sequences, {t.free_count} are free, {viewed} of them held by live tensor views of freed "
            "sequences (drop those views to reuse them)"
        )

    # ----------------------------------------------------------------------------------------- unmapping
    def unmap(self, page_indices: list[int]) -> None:
        """Unmap page indices (the range waits for the registered streams first); the caller updates the table."""
        self.range.unmap(page_indices)
        self.pages_unmapped += len(page_indices)

    def unmap_slot(self, slot: int) -> bool:
        """Unmap every page of the slot; False (nothing changed) while a live view reads one of them."""
        return self.unmap_tail(slot, 0)

    def unmap_tail(self, slot: int, first: int) -> bool:
        """Unmap the slot's pages from `first` on; False (nothing changed) while a live view reads one."""
        try:
            self.unmap(self.page_indices(slot, first))
        except ViewsAliveError:
            return False
        if first:
            self.table.truncate_pages(slot, first)
        else:
            self.table.set_unmapped(slot)
        return True

    def take_clean_slot(self) -> int | None:
        """A slot with nothing mapped (an empty one, else a freed slot whose pages are unmapped now); None
        when every free slot is read through a live view."""
        slot = self.table.take_empty()
        if slot is not None:
            return slot
        for slot in self.table.dormant_slots():
            if self.unmap_slot(slot):
                self.table.take(slot)
                return slot
        return None

    def take_run(self, first: int, n: int) -> None:
        """Take the free slots first..first+n-1. With the pool's zero_on_reuse, freed sequences' pages in them
        are zeroed first, before any slot is taken: an error leaves every slot free."""
        if self.pool.zero_on_reuse:
            for slot in range(first, first + n):
                if self.table.is_dormant(slot):
                    self.scrub_dormant(slot)
        for slot in range(first, first + n):
            self.table.take(slot)

    def clean_for_new_owner(self, slot: int) -> int | None:
        """A slot just taken for a new sequence: with the pool's zero_on_reuse, a freed sequence's pages in it
        are zeroed first. Returns the slot to use: this one, else (its pages cannot be given up while a view
        reads them) another clean one, else None."""
        t = self.table
        if not self.pool.zero_on_reuse or not t.mapped_pages[slot]:
            return slot
        t.release(slot)  # dormant again until it is clean
        try:
            self.scrub_dormant(slot)
        except ViewsAliveError:
            return self.take_clean_slot()
        t.take(slot)
        return slot

    def scrub_dormant(self, slot: int) -> None:
        """Zero a dormant slot's pages. Pages it still shares with others (free() kept them for a live view)
        cannot be zeroed: the slot gives them all up instead (ViewsAliveError while a view still reads them)."""
        if self.shares_pages(slot):
            if not self.unmap_slot(slot):
                raise ViewsAliveError(f"slot {slot}'s pages are still read through a live view")
            return
        self.range.wait_for_streams()  # kernels still writing the old sequence's K/V finish first
        self.pool.zero_pages(self.pages(slot))

    # ----------------------------------------------------------------------------------------- mapping
    def map_shared(self, slot: int, pages: list[int], npages: int) -> None:
        """Map `pages` (run-major, npages per run) into a slot just taken; on error the slot is free again."""
        try:
            self.range.map_shared(self.layout.page_indices(slot, 0, npages), pages)
        except BaseException:
            self.table.release(slot)
            raise
        self.table.mapped_pages[slot] = self.table.shared_below_page[slot] = npages

    def map_borrowed(self, slot: int, first: int, stop: int, pages: list[int]) -> None:
        """Map pages someone else holds a reference on (a page store's pages, held by the cache's StoreLink) at
        pages first..stop-1 of every run of a slot just taken (mapped up to `first`): shared, so the slot's shared
        watermark rises to `stop` and a write there copies the page first. All or nothing."""
        indices = self.layout.page_indices(slot, first, stop)
        if len(pages) != len(indices):
            raise InvalidArgumentError(f"{len(indices)} pages to map, {len(pages)} given")
        self.range.map_shared(indices, pages)
        t = self.table
        t.mapped_pages[slot] = stop
        t.shared_below_page[slot] = stop
        self.pages_mapped += len(indices)
        self.map_calls += 1

    def map_new_with(self, slot: int, first: int, stop: int, data: list) -> None:
        """Map fresh pages at pages first..stop-1 of every run of a slot (just taken, mapped up to `first`)
        and copy `data` into them (run-major, one page-sized bytes-like object each). All or nothing:
        OutOfPagesError (pool short) or a copy error leaves the slot mapped up to `first`."""
        indices = self.layout.page_indices(slot, first, stop)
        if len(data) != len(indices):
            raise InvalidArgumentError(f"{len(indices)} pages to fill, {len(data)} given")
        self.ensure_free(len(indices))
        pages = self.with_reclaim(lambda: self.range.map_new(indices), len(indices))
        try:
            buffers = [np.frombuffer(d, dtype=np.uint8) for d in data]
            self.pool.copy_pages_from_host(pages, [b.ctypes.data for b in buffers])
            self.pool.synchronize()
        except BaseException:
            self.range.unmap(indices)
            raise
        self.table.mapped_pages[slot] = stop
        self.pages_mapped += len(indices)
        self.map_calls += 1

    def ensure_free(self, pages: int) -> None:
        if not self.pool.ensure_free(pages):
            s = self.pool.stats()
            raise OutOfPagesError(
                f"out of pages: {pages} page(s) of {s.page_size} bytes needed, {s.free_pages} free "
                f"of {s.total_pages} (+{self.pool.reclaimable_pages()} reclaimable); nothing was changed"
            )

    def with_reclaim(self, call, pages: int):
        """Run a call that takes `pages` fresh pages. The pool counts pages it has not created yet as free;
        on CUDA creating them can fail first (the device ran out of memory before the pool's capacity, e.g.
        because torch holds the rest). The call then changed nothing: reclaim pages that exist and retry."""
        try:
            return call()
        except OutOfPagesError:
            if self.pool.reclaim(pages) == 0:
                raise
            return call()

    def plan_extend(self, seqs: list, slots: list[int], n: int) -> ExtendPlan:
        """What extend(plan) will map and copy to grow each slot by n tokens; changes nothing."""
        t, lay = self.table, self.layout
        plan = ExtendPlan(slots, n)
        for seq, slot in zip(seqs, slots):
            new_len = t.length_tokens[slot] + n
            if new_len > lay.max_seq_len:
                raise SequenceTooLongError(
                    f"sequence {seq} would hold {new_len} tokens, more than max_seq_len={lay.max_seq_len}"
                )
            if n and t.shared_below_page[slot]:
                # Every mapped page from the first new token's up to the watermark, not just those the new
                # length needs: after a truncate() or free() that could not unmap (a live view), pages past
                # it may still be shared, and the watermark drops to the first new token's page below.
                first = self.page_of_next_token(slot)
                stop = min(t.mapped_pages[slot], t.shared_below_page[slot])
                if first < stop:
                    plan.to_privatize += lay.page_indices(slot, first, stop)
            need = lay.pages_for(new_len)
            if need > t.mapped_pages[slot]:
                plan.fresh += lay.page_indices(slot, t.mapped_pages[slot], need)
                plan.grown.append((slot, need))
        plan.copies = self.range.copies_needed(plan.to_privatize) if plan.to_privatize else 0
        return plan

    def extend(self, plan: ExtendPlan) -> None:
        """Carry out a plan: all of it or, on error (out of pages, out of device memory), nothing."""
        t = self.table
        self.growing = {slot: t.length_tokens[slot] + plan.n for slot in plan.slots}
        try:
            if plan.pages:
                self.ensure_free(plan.pages)
            if plan.fresh:
                self.with_reclaim(lambda: self.range.map_new(plan.fresh), len(plan.fresh))
            if plan.copies:
                try:  # copy-on-write takes its pages first: out of pages (or device memory) changes nothing
                    copied = self.with_reclaim(lambda: self.range.make_private(plan.to_privatize), plan.copies)
                except BaseException:
                    if plan.fresh:
                        self.range.unmap(plan.fresh)  # nothing reads pages mapped a moment ago
                    raise
                self.cow_copies += copied
        finally:
            self.growing = {}
        if plan.fresh:
            self.pages_mapped += len(plan.fresh)
            self.map_calls += 1
            for slot, need in plan.grown:
                t.mapped_pages[slot] = need
        for slot in plan.slots:
            if plan.n and t.shared_below_page[slot]:
                t.mark_private_from(slot, self.page_of_next_token(slot))
            t.new_from_token[slot] = t.length_tokens[slot]
            t.length_tokens[slot] += plan.n

    def remap_rows(self, slots: list[int], sources: list[int]) -> None:
        """slots[i] maps the pages slots[sources[i]] held before the call: the full ones shared, the partly filled
        last one copied into the slot's own page where that page is private to it (else shared as well).

        One range call for every row and region (VirtualRange.reorder_runs): Python lists one entry per page run
        of a row, the range compares and remaps pages in C++ and leaves pages that do not change alone (rows that
        keep their own beam, and the prompt pages all beams share)."""
        t, lay = self.table, self.layout
        lens = [t.length_tokens[s] for s in slots]
        starts: dict[int, list[int]] = {}  # slot -> the first page index of each of its runs
        dst_runs: list[int] = []
        src_runs: list[int] = []
        counts: list[int] = []
        spans: list[int] = []
        tails: list[int] = []
        moves = []
        runs = lay.runs
        for dst, i in zip(slots, sources):
            src = slots[i]
            if src == dst:
                continue
            src_n = lay.pages_for(lens[i])
            span = max(src_n, t.mapped_pages[dst])
            tail = lens[i] * lay.token_bytes - (src_n - 1) * lay.page_size if src_n else 0
            for slot in (dst, src):
                if slot not in starts:
                    starts[slot] = lay.page_indices(slot, 0, 1)
            dst_runs += starts[dst]
            src_runs += starts[src]
            counts += [src_n] * runs
            spans += [span] * runs
            tails += [tail if tail < lay.page_size else 0] * runs
            moves.append((dst, src, src_n, lens[i]))
        if dst_runs:
            # Waits for the registered streams first; all or nothing.
            self.cow_copies += self.range.reorder_runs(dst_runs, src_runs, counts, spans, tails)
        for dst, src, src_n, length in moves:
            t.length_tokens[dst] = length
            t.mapped_pages[dst] = t.shared_below_page[dst] = src_n
            t.mark_shared(src, src_n)

    # ----------------------------------------------------------------------------------------- swapping
    def swap_out(self, seq: int, slot: int, space: SwapSpace) -> tuple[list[int], list[int]]:
        """Copy the slot's private pages to swap space and unmap them; returns (page indices, chunks).
        ViewsAliveError (nothing changed) while a live view reads one of them."""
        idx = self.page_indices(slot)
        private = [index for index, c in zip(idx, self.range.refcounts_at(idx)) if c == 1]
        if self.range.pinned_count(private):
            raise ViewsAliveError(f"sequence {seq} is read through a live tensor view; drop the view first")
        self.range.wait_for_streams()  # kernels writing this sequence's K/V finish before it is read out
        chunks = space.save(self.pool, self.range.pages_at(private))
        try:
            self.unmap(private)
        except BaseException:
            space.release(chunks)
            raise
        return private, chunks

    def swap_in(self, private: list[int], chunks: list[int], space: SwapSpace) -> None:
        """Map fresh pages at the swapped-out page indices and restore their data; the chunks stay allocated."""
        self.ensure_free(len(private))
        pages = self.with_reclaim(lambda: self.range.map_new(private), len(private))
        try:
            space.restore(self.pool, pages, chunks)
        except BaseException:
            self.range.unmap(private)  # after the copies already queued (the range waits for stream 0)
            raise
        self.pages_mapped += len(private)
        self.map_calls += 1

    def unmap_around_holes(self, slot: int, holes: list[int]) -> None:
        """Unmap a swapped-out slot's pages that are still mapped (all but `holes`): it cannot stay dormant.
        ViewsAliveError (nothing changed) while a view reads a shared one."""
        gone = set(holes)
        self.unmap([index for index in self.page_indices(slot) if index not in gone])
        self.table.set_unmapped(slot)
