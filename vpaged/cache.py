"""VirtualKVCache: every sequence's KV in one contiguous virtual range, pages mapped on demand.

A sequence is a slot of max_seq_len tokens in each region (see layout.py). extend() maps the pages its
new tokens need; kv() hands out zero-copy torch views of exactly the tokens present, so standard kernels
(SDPA, FlashAttention) run on them unchanged. free() keeps the slot's pages mapped for the next allocate()
(deferred reclamation: no map calls in a steady workload); the pool takes them back when it runs low.

Sharing: fork() maps a sequence's physical pages into another slot (no data copied); prefix caching maps
full pages of an identical token prefix into a new sequence; reorder() remaps whole sequences (beam search).
A shared page is never written: extend() first gives the sequence a private copy of any shared page its new
tokens land in (copy-on-write). The write contract: a sequence may write its tokens that lie in pages it does
not share (writable_range(): all of them until it shares pages, and always the tokens its last extend()
added); write() and new_kv() enforce it, kv() views are for reading.

Swapping: swap_out() copies a sequence's private pages to host swap space and returns them to the pool;
swap_in() maps fresh pages at the same virtual addresses and restores the data bit-exactly.

State lives where its invariant is kept: slots and their watermarks in SlotTable (slot_table.py), cached
prefixes and their page references in PrefixIndex (prefix.py), swapped pages in SwapSpace (swap.py), pins and
the wait for streams before any unmap in the C++ VirtualRange. Sharing and copy-on-write stay here.

Not thread-safe: one cache belongs to one scheduler thread. The pool under it is thread-safe.
"""

from __future__ import annotations

import torch

from ._checks import check_kv, check_layer, check_positive_int, check_token_count, is_int
from .accounting import virtual_cache_breakdown
from .device import normalize_device
from .errors import (
    CacheClosedError,
    InvalidArgumentError,
    OutOfPagesError,
    ReadOnlyTokensError,
    SequenceSwappedError,
    SequenceTooLongError,
    SlotsExhaustedError,
    ViewsAliveError,
)
from .geometry import KVGeometry
from .layout import Layout
from .limits import check_cache
from .pool import PagePool, default_pool
from .prefix import HashFn, PrefixIndex
from .records import BatchedKV, CacheStats
from .slot_table import SlotTable
from .swap import SwapSpace
from .views import SlotViews

__all__ = ["BatchedKV", "CacheStats", "VirtualKVCache"]


class VirtualKVCache:
    """KV cache with one contiguous virtual range per sequence slot.

    Args:
        num_layers, num_kv_heads, head_dim: model geometry.
        v_head_dim: head size of V when it differs from K's (multi-head latent attention); see layout.py.
        dtype: element type of K and V (float32, float16, bfloat16, float64).
        max_seqs: sequence slots (concurrent sequences).
        max_seq_len: tokens a sequence may hold.
        device: "cpu", "cuda" or "cuda:N"; default: the pool's device when a pool is given, else "cpu".
        pool: a PagePool to share; or capacity_bytes for a private pool; neither: the device's default pool.
        layout: "per_layer" (dense [T, H, D] per-layer views), "interleaved" (all layers of a token together:
            finer fill granularity, one map per page for all layers) or "head_major" (dense [H, T, D] per
            layer, what SDPA prefers; a page per head). See layout.py.
        page_size: bytes per page for a private/default pool (must match a given pool).
        swap_bytes: capacity of the host swap space for swap_out() (0: no swapping).
        prefix_hash: hash(parent_key, block_token_ids) -> bytes for the prefix index (default: blake2b chain).
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.bfloat16,
        max_seqs: int = 64,
        max_seq_len: int = 4096,
        device=None,
        pool: PagePool | None = None,
        capacity_bytes: int | None = None,
        layout: str = "per_layer",
        page_size: int | None = None,
        swap_bytes: int = 0,
        prefix_hash: HashFn | None = None,
        v_head_dim: int | None = None,
    ):
        self.geometry = KVGeometry(num_layers, num_kv_heads, head_dim, dtype, v_head_dim)
        self.v_head_dim = self.geometry.v_head_dim
        check_positive_int("max_seqs", max_seqs)
        check_positive_int("max_seq_len", max_seq_len)
        self.device = normalize_device(device if device is not None else pool.device if pool else "cpu")
        self.dtype = dtype
        self.pool = pool = self._resolve_pool(pool, capacity_bytes, page_size, device)
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.max_seqs, self.max_seq_len = max_seqs, max_seq_len
        self.layout = Layout(
            layout,
            num_layers,
            num_kv_heads,
            head_dim,
            self.geometry.itemsize,
            max_seqs,
            max_seq_len,
            pool.page_size,
            self.v_head_dim,
        )
        if not pool.accounting_only:  # address space and mapping limit: said now, not mid-serving
            check_cache(self.layout, self.device)
        self._range = pool.new_range(self.layout.total_bytes)
        self._views = SlotViews(self._range, self.layout, dtype, self.device)
        self._slots = SlotTable(max_seqs)
        self._swapped: dict[int, tuple[list[int], list[int]]] = {}  # slot -> (page slots swapped, chunks)
        self._pages_mapped = self._pages_unmapped = self._map_calls = self._cow_copies = self._prefix_hits = 0
        tpp = self.layout.page_size / self.layout.token_bytes
        self._prefix = PrefixIndex(int(tpp), pool, prefix_hash) if tpp == int(tpp) else None
        self._swap = (
            SwapSpace(swap_bytes, pool.page_size, pin=self.device.type == "cuda" and torch.cuda.is_available())
            if swap_bytes
            else None
        )
        self._streams: list = []  # stream objects given to use_stream(), kept alive while registered
        self._on_cuda = self.device.type == "cuda"
        if self._on_cuda:
            self._range.add_stream(0)  # the legacy default stream: torch's default, and vpaged's own copies
        self._closed = False
        self._growing: dict[int, int] = {}  # slot -> length an extend in progress grows it to (see _spare_tails)
        pool.register(self)

    def _resolve_pool(self, pool, capacity_bytes, page_size, device) -> PagePool:
        if pool is not None:
            if capacity_bytes is not None:
                raise InvalidArgumentError("give either pool or capacity_bytes, not both")
            if pool.device != self.device:
                raise InvalidArgumentError(f"pool is on {pool.device}, device={device!r} asks for {self.device}")
            if page_size is not None and page_size != pool.page_size:
                raise InvalidArgumentError(f"page_size {page_size} differs from the pool's {pool.page_size}")
            return pool
        if capacity_bytes is not None:
            return PagePool(self.device, capacity_bytes=capacity_bytes, page_size=page_size)
        pool = default_pool(self.device)
        if page_size is not None and page_size != pool.page_size:
            raise InvalidArgumentError(
                f"page_size {page_size} differs from the default pool's {pool.page_size}; "
                "pass capacity_bytes or a pool of that page size"
            )
        return pool

    # ----------------------------------------------------------------------------------------- lifecycle
    def allocate(self, tokens=None) -> int:
        """A new sequence; returns its id. Reuses a freed slot's pages when one has them.

        tokens: the prompt's token ids. The longest run of cached full pages whose tokens match is mapped in
        shared, and the sequence starts with those tokens present: seq_len(seq) tells how many, so the caller
        computes (extends by) only the rest. Pages become reusable through cache_prefix()."""
        self._check_open()
        t = self._slots
        if tokens is None:
            slot = t.take_reusable()
            if slot is None:
                raise self._slots_exhausted("a free sequence slot")
            return t.bind(self._scrub_for_new_owner(slot))
        index = self._prefix_index()
        hits = index.match(tokens)
        slot = self._take_clean_slot()
        if hits:
            pages = [b.pages[r] for r in range(self.layout.runs) for b in hits]  # run-major, like page_slots
            self._map_shared_or_release(slot, pages, len(hits))
        seq = t.bind(slot)
        n = len(hits) * index.block_tokens
        t.length_tokens[slot] = t.new_from_token[slot] = n
        t.mapped_pages[slot] = t.shared_below_page[slot] = len(hits)
        self._prefix_hits += n
        return seq

    def _map_shared_or_release(self, slot: int, pages: list[int], npages: int) -> None:
        try:
            self._range.map_shared(self.layout.page_slots(slot, 0, npages), pages)
        except BaseException:
            self._slots.release(slot)
            raise

    def _take_clean_slot(self) -> int:
        """A slot with nothing mapped (an empty one, else a freed slot whose pages are unmapped now)."""
        slot = self._slots.take_empty()
        if slot is not None:
            return slot
        for slot in self._slots.dormant_slots():
            if self._unmap_slot(slot):
                self._slots.take(slot)
                return slot
        raise self._slots_exhausted("a free sequence slot with nothing mapped")

    def _slots_exhausted(self, what: str, n: int = 1) -> SlotsExhaustedError:
        t = self._slots
        viewed = sum(1 for s in t.dormant_slots() if self._range.pinned_count(self._page_slots_of(s)))
        return SlotsExhaustedError(
            f"no room for {what if n == 1 else f'{n} {what}'}: {len(t.sequences)} of {self.max_seqs} slots hold "
            f"live sequences, {t.free_count} are free, {viewed} of them held by live tensor views of freed "
            "sequences (drop those views to reuse them)"
        )

    def _page_slots_of(self, slot: int, first: int = 0, stop: int | None = None) -> list[int]:
        return self.layout.page_slots(slot, first, self._slots.mapped_pages[slot] if stop is None else stop)

    def _unmap_slot(self, slot: int) -> bool:
        """Unmap every page of the slot; False (nothing changed) while a live view reads one of them."""
        idx = self._page_slots_of(slot)
        try:
            self._range.unmap(idx)  # waits for the cache's streams first
        except ViewsAliveError:
            return False
        self._pages_unmapped += len(idx)
        self._slots.set_unmapped(slot)
        return True

    def allocate_many(self, n: int) -> list[int]:
        """n new sequences in consecutive slots, so that kv_batch() can view them as one tensor."""
        self._check_open()
        check_positive_int("n", n)
        first = self._slots.free_run(n)
        if first is None:
            raise self._slots_exhausted("consecutive free sequence slots", n)
        if self.pool.zero_on_reuse:
            for slot in range(first, first + n):  # before any is taken: an error here leaves every slot free
                if self._slots.is_dormant(slot):
                    self._scrub_dormant(slot)
        for slot in range(first, first + n):
            self._slots.take(slot)
        return [self._slots.bind(slot) for slot in range(first, first + n)]

    def _scrub_for_new_owner(self, slot: int) -> int:
        """A slot just taken for a new sequence: with the pool's zero_on_reuse, a freed sequence's pages in it
        are zeroed first. Returns the slot to use (another, clean one if this one's pages cannot be given up
        while a view still reads them)."""
        t = self._slots
        if not self.pool.zero_on_reuse or not t.mapped_pages[slot]:
            return slot
        t.release(slot)  # dormant again until it is clean
        try:
            self._scrub_dormant(slot)
        except ViewsAliveError:
            return self._take_clean_slot()
        t.take(slot)
        return slot

    def _scrub_dormant(self, slot: int) -> None:
        """Zero a dormant slot's pages. Pages it still shares with others (free() kept them for a live view)
        cannot be zeroed: the slot gives them all up instead (ViewsAliveError while a view still reads them)."""
        idx = self._page_slots_of(slot)
        if any(c > 1 for c in self._range.refcounts_at(idx)):
            if not self._unmap_slot(slot):
                raise ViewsAliveError(f"slot {slot}'s pages are still read through a live view")
            return
        self._range.wait_for_streams()  # kernels still writing the old sequence's K/V finish first
        self.pool.zero_pages(self._range.pages_at(idx))

    def free(self, seq: int) -> None:
        """End a sequence. Its private pages stay mapped for the next allocate() until the pool needs them;
        pages it shares with others are unmapped at once (so a reused slot never starts with shared pages)."""
        slot = self._slot(seq)
        t = self._slots
        if slot in self._swapped:
            # The slot has holes where pages were swapped out, so it cannot stay dormant: unmap what is left
            # first (ViewsAliveError when a view still reads a shared page: then nothing has changed).
            swapped_slots, chunks = self._swapped[slot]
            gone = set(swapped_slots)
            keep = [ps for ps in self._page_slots_of(slot) if ps not in gone]
            self._range.unmap(keep)
            del self._swapped[slot]
            self._swap.release(chunks)
            self._pages_unmapped += len(keep)
            t.set_unmapped(slot)
        t.unbind(seq)
        if t.shared_below_page[slot]:
            if any(c > 1 for c in self._range.refcounts_at(self._page_slots_of(slot))):
                self._unmap_slot(slot)  # kept while a view reads it; a later extend copies before writing
            else:
                t.shared_below_page[slot] = 0
        t.release(slot)

    def extend(self, seq: int, n: int) -> None:
        """Grow a sequence by n tokens, mapping the pages they need. Their K/V are then to be written
        (write() or the views of kv()). Raises OutOfPagesError with nothing changed when the pool is short."""
        self.extend_many([seq], n)

    def extend_many(self, seqs, n: int = 1) -> None:
        """extend() for several sequences at once (a decode step): all of them or, on error, none."""
        self._check_open()
        check_token_count(n)
        seqs = list(seqs)
        slots = self._distinct_live_slots(seqs)
        t, lay = self._slots, self.layout
        fresh: list[int] = []  # page slots to map
        grown = []
        to_privatize: list[int] = []  # mapped page slots the new tokens land in that may be shared
        for seq, slot in zip(seqs, slots):
            new_len = t.length_tokens[slot] + n
            if new_len > self.max_seq_len:
                raise SequenceTooLongError(
                    f"sequence {seq} would hold {new_len} tokens, more than max_seq_len={self.max_seq_len}"
                )
            need = lay.pages_for(new_len)
            if n and t.shared_below_page[slot]:
                # Every mapped page from the first new token's up to the watermark, not just those below
                # `need`: after a truncate() or free() that could not unmap (a live view), pages past `need`
                # may still be shared, and the watermark drops to the first new token's page below.
                first = self._page_of_next_token(slot)
                stop = min(t.mapped_pages[slot], t.shared_below_page[slot])
                if first < stop:
                    to_privatize += lay.page_slots(slot, first, stop)
            if need > t.mapped_pages[slot]:
                fresh += lay.page_slots(slot, t.mapped_pages[slot], need)
                grown.append((slot, need))
        copies = self._range.copies_needed(to_privatize) if to_privatize else 0
        # Reclaim must not take the spare pages of the sequences this plan counts on (see _spare_tails).
        self._growing = {slot: t.length_tokens[slot] + n for slot in slots}
        try:
            if fresh or copies:
                self._ensure_free(len(fresh) + copies)
            if fresh:
                self._with_reclaim(lambda: self._range.map_new(fresh), len(fresh))
            if copies:
                try:  # copy-on-write takes its pages first: out of pages (or device memory) changes nothing
                    self._cow_copies += self._with_reclaim(lambda: self._range.make_private(to_privatize), copies)
                except BaseException:
                    if fresh:
                        self._range.unmap(fresh)  # nothing reads pages mapped a moment ago
                    raise
        finally:
            self._growing = {}
        if fresh:
            self._pages_mapped += len(fresh)
            self._map_calls += 1
            for slot, need in grown:
                t.mapped_pages[slot] = need
        for slot in slots:
            if n and t.shared_below_page[slot]:
                t.mark_private_from(slot, self._page_of_next_token(slot))
            t.new_from_token[slot] = t.length_tokens[slot]
            t.length_tokens[slot] += n

    def _page_of_next_token(self, slot: int) -> int:
        return self._slots.length_tokens[slot] * self.layout.token_bytes // self.layout.page_size

    def _with_reclaim(self, call, pages: int):
        """Run a call that takes `pages` fresh pages. The pool counts pages it has not created yet as free;
        on CUDA creating them can fail first (the device ran out of memory before the pool's capacity, e.g.
        because torch holds the rest). The call then changed nothing: reclaim pages that exist and retry."""
        try:
            return call()
        except OutOfPagesError:
            if self.pool.reclaim(pages) == 0:
                raise
            return call()

    def _ensure_free(self, pages: int) -> None:
        if not self.pool.ensure_free(pages):
            s = self.pool.stats()
            raise OutOfPagesError(
                f"out of pages: {pages} page(s) of {s.page_size} bytes needed, {s.free_pages} free "
                f"of {s.total_pages} (+{self.pool.reclaimable_pages()} reclaimable); nothing was changed"
            )

    # ----------------------------------------------------------------------------------------- planning
    def pages_needed(self, seqs, n: int = 1) -> int:
        """Pages that extend_many(seqs, n) would take from the pool: new pages plus the copy-on-write copies
        of shared pages the new tokens land in; for a swapped-out sequence also the pages swap_in() maps back.
        Changes nothing: a scheduler compares it with pages_available() before it extends, and preempts
        instead of catching OutOfPagesError. Kept in step with extend_many()'s own planning."""
        self._check_open()
        check_token_count(n)
        t, lay = self._slots, self.layout
        total = 0
        to_privatize: list[int] = []
        for seq in seqs:
            slot = t.slot_of(seq)
            swapped = self._swapped.get(slot)
            if swapped is not None:
                total += len(swapped[0])
            old_len = t.length_tokens[slot]
            if old_len + n > self.max_seq_len:
                raise SequenceTooLongError(
                    f"sequence {seq} would hold {old_len + n} tokens, more than max_seq_len={self.max_seq_len}"
                )
            need = lay.pages_for(old_len + n)
            if need > t.mapped_pages[slot]:
                total += (need - t.mapped_pages[slot]) * lay.runs
            if n and t.shared_below_page[slot]:
                first = self._page_of_next_token(slot)
                stop = min(t.mapped_pages[slot], t.shared_below_page[slot])
                if first < stop:
                    to_privatize += lay.page_slots(slot, first, stop)
        if to_privatize:
            total += self._range.copies_needed(to_privatize)
        return total

    def pages_available(self) -> int:
        """Pages an extend could take now: the pool's free pages plus those freed slots and unused prefix
        pages would give back (shared with the other caches on the same pool)."""
        self._check_open()
        return self.pool.free_pages() + self.pool.reclaimable_pages()

    def kv_layers(self, seq: int, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """K/V of tokens start..stop-1 (default: all present) in every layer, as one zero-copy view of shape
        [num_layers, 2, stop - start, num_kv_heads, head_dim] ([:, 0] is K, [:, 1] is V). One view per
        sequence and step instead of two per layer. For reading; the tokens of writable_range() may also be
        written through it (after extend(), the tokens it added)."""
        slot = self._live_slot(seq)
        length = self._slots.length_tokens[slot]
        stop = length if stop is None else stop
        for name, value in (("start", start), ("stop", stop)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise InvalidArgumentError(f"{name} must be an int, got {value!r}")
        if not 0 <= start <= stop <= length:
            raise InvalidArgumentError(f"tokens {start}..{stop - 1} outside the sequence's 0..{length - 1}")
        lay = self.layout
        if lay.v_head_dim != lay.head_dim:
            raise InvalidArgumentError("kv_layers(): K and V differ in head size here; use kv() per layer")
        shape, strides, perm = lay.view_dims(stop - start)
        # K and V of layer l start at base_offset(l, 0) and base_offset(l, 1): whole regions apart (per_layer,
        # head_major) or columns of one token row (interleaved); kv_stride apart in every layout.
        kv_stride = (lay.base_offset(0, 1) - lay.base_offset(0, 0)) // lay.itemsize
        dims = [(2 * kv_stride, self.num_layers, 0), (kv_stride, 2, 1)]
        dims += [(strides[i], shape[i], 2 + perm.index(i)) for i in range(len(shape))]
        dims.sort(key=lambda d: -d[0])  # the core takes dims in memory order, largest stride first
        view = self._views.raw(lay.offset(0, 0, slot, start), [d[1] for d in dims], [d[0] for d in dims])
        order = [d[2] for d in dims]
        return view.permute([order.index(j) for j in range(len(order))])

    # ----------------------------------------------------------------------------------------- sharing
    def fork(self, seq: int) -> int:
        """A new sequence with the same tokens, sharing every page of `seq` (no KV data is copied). Whichever
        of the two writes first into a shared page gets a private copy of that page (in extend)."""
        return self.fork_many(seq, 1)[0]

    def fork_many(self, seq: int, n: int) -> list[int]:
        """n forks of `seq` (parallel sampling); all or none."""
        parent = self._live_slot(seq)
        check_positive_int("n", n)
        t = self._slots
        if t.free_count < n:
            raise self._slots_exhausted("forks", n)
        npages = self.layout.pages_for(t.length_tokens[parent])
        pages = self._range.pages_at(self._page_slots_of(parent, 0, npages))
        children: list[int] = []
        try:
            for _ in range(n):
                slot = self._take_clean_slot()
                if npages:
                    self._map_shared_or_release(slot, pages, npages)
                children.append(t.bind(slot))
                t.length_tokens[slot] = t.length_tokens[parent]
                t.mapped_pages[slot] = t.shared_below_page[slot] = npages
        except BaseException:
            for child in children:
                self.free(child)
            raise
        t.mark_shared(parent, npages)
        return children

    def truncate(self, seq: int, new_len: int) -> None:
        """Drop the tokens from new_len on (speculative decoding, beam search). Pages wholly past the new
        length are unmapped (kept while a live view reads them)."""
        slot = self._live_slot(seq)
        t = self._slots
        if not is_int(new_len) or not 0 <= new_len <= t.length_tokens[slot]:
            raise InvalidArgumentError(f"new_len must be an int in 0..{t.length_tokens[slot]}, got {new_len!r}")
        keep = self.layout.pages_for(new_len)
        if t.mapped_pages[slot] > keep:
            idx = self._page_slots_of(slot, keep)
            try:
                self._range.unmap(idx)
                self._pages_unmapped += len(idx)
                t.truncate_pages(slot, keep)
            except ViewsAliveError:
                pass
        t.length_tokens[slot] = new_len
        t.new_from_token[slot] = min(t.new_from_token[slot], new_len)

    def reorder(self, seqs, sources) -> None:
        """seqs[i] takes the tokens and K/V that seqs[sources[i]] held before the call (beam search).

        Done by remapping pages: the sequences share every page afterwards; the partly filled last page is
        copied when one of them writes to it. No KV data is copied here."""
        seqs = list(seqs)
        sources = [int(i) for i in sources]
        if len(sources) != len(seqs):
            raise InvalidArgumentError(f"{len(seqs)} sequences but {len(sources)} sources")
        if any(not 0 <= i < len(seqs) for i in sources):
            raise InvalidArgumentError(f"sources must index 0..{len(seqs) - 1}, got {sources}")
        slots = self._distinct_live_slots(seqs)
        t, lay = self._slots, self.layout
        lens = [t.length_tokens[s] for s in slots]
        old_pages = {s: self._range.pages_at(self._page_slots_of(s)) for s in set(slots)}
        assign_slots: list[int] = []
        assign_pages: list[int] = []
        moves = []
        for dst, i in zip(slots, sources):
            src = slots[i]
            if src == dst:
                continue
            src_n = lay.pages_for(lens[i])
            span = max(src_n, t.mapped_pages[dst])
            # page_slots(slot, 0, n) lists run by run, so page p of run r is entry r * n + p. Built once per
            # row: a call per page made a beam-search reorder O(runs^2 * pages) in Python.
            src_pages, src_mapped = old_pages[src], t.mapped_pages[src]
            assign_slots += lay.page_slots(dst, 0, span)
            for r in range(lay.runs):
                assign_pages += src_pages[r * src_mapped : r * src_mapped + src_n]
                assign_pages += [-1] * (span - src_n)
            moves.append((dst, src, src_n, lens[i]))
        if assign_slots:
            self._range.assign(assign_slots, assign_pages)  # waits for the cache's streams first
        for dst, src, src_n, length in moves:
            t.length_tokens[dst] = length
            t.mapped_pages[dst] = t.shared_below_page[dst] = src_n
            t.mark_shared(src, src_n)

    def cache_prefix(self, seq: int, tokens) -> int:
        """Offer the full pages of `seq` for reuse by later allocate(tokens=...) calls. tokens: the token ids
        of the sequence (at least its full pages' worth); their K/V must be written. Returns the number of
        tokens now cached for this prefix."""
        slot = self._live_slot(seq)
        index = self._prefix_index()
        tokens = list(tokens)
        nblocks = min(len(tokens), self._slots.length_tokens[slot]) // index.block_tokens
        for depth, (key, block) in enumerate(index.keys(tokens[: nblocks * index.block_tokens])):
            found = index.lookup(key)
            if found is not None:
                if found.tokens != block or found.depth != depth:
                    return depth * index.block_tokens  # a different prefix owns this key: stop here
                continue
            index.insert(key, depth, block, self._range.pages_at(self._page_slots_of(slot, depth, depth + 1)))
        self._slots.mark_shared(slot, nblocks)
        return nblocks * index.block_tokens

    def _prefix_index(self) -> PrefixIndex:
        if self._prefix is None:
            raise InvalidArgumentError(
                f"prefix caching needs pages that hold a whole number of tokens; a page of {self.layout.page_size} "
                f"bytes holds {self.layout.tokens_per_page:.3f} (choose a page size that is a multiple of "
                f"{self.layout.token_bytes} bytes)"
            )
        return self._prefix

    # ----------------------------------------------------------------------------------------- swapping
    def swap_out(self, seq: int) -> int:
        """Copy the sequence's private pages to swap space and return them to the pool; pages it shares stay
        mapped. The sequence keeps its id and addresses; returns the bytes swapped."""
        slot = self._live_slot(seq)
        if self._swap is None:
            raise InvalidArgumentError("this cache has no swap space (create it with swap_bytes=...)")
        idx = self._page_slots_of(slot)
        private = [ps for ps, c in zip(idx, self._range.refcounts_at(idx)) if c == 1]
        if self._range.pinned_count(private):
            raise ViewsAliveError(f"sequence {seq} is read through a live tensor view; drop the view first")
        self._range.wait_for_streams()  # kernels writing this sequence's K/V finish before it is read out
        chunks = self._swap.save(self.pool, self._range.pages_at(private))
        try:
            self._range.unmap(private)
        except BaseException:
            self._swap.release(chunks)
            raise
        self._pages_unmapped += len(private)
        self._swapped[slot] = (private, chunks)
        return len(private) * self.layout.page_size

    def swap_in(self, seq: int) -> None:
        """Map fresh pages where the swapped ones were and restore their data bit-exactly."""
        slot = self._slot(seq)
        if slot not in self._swapped:
            raise InvalidArgumentError(f"sequence {seq} is not swapped out")
        private, chunks = self._swapped[slot]
        self._ensure_free(len(private))
        pages = self._with_reclaim(lambda: self._range.map_new(private), len(private))
        try:
            self._swap.restore(self.pool, pages, chunks)
        except BaseException:
            self._range.unmap(private)  # after the copies already queued (the range waits for stream 0)
            raise
        self._pages_mapped += len(private)
        self._map_calls += 1
        del self._swapped[slot]
        self._swap.release(chunks)

    def is_swapped(self, seq: int) -> bool:
        return self._slot(seq) in self._swapped

    def seq_len(self, seq: int) -> int:
        return self._slots.length_tokens[self._slot(seq)]

    def slot(self, seq: int) -> int:
        """The slot (row of the batched view) that holds a sequence."""
        return self._slot(seq)

    @property
    def sequences(self) -> list[int]:
        """Ids of the live sequences."""
        return self._slots.sequences

    # ----------------------------------------------------------------------------------------- views
    def kv(self, layer: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero-copy (K, V) views of shape [seq_len, num_kv_heads, head_dim] covering exactly the tokens
        present (strided for the interleaved layout). While a view lives, its pages stay mapped."""
        check_layer(layer, self.num_layers)
        slot = self._live_slot(seq)
        n = self._slots.length_tokens[slot]
        return self._views.tokens(layer, 0, slot, 0, n), self._views.tokens(layer, 1, slot, 0, n)

    def new_kv(self, layer: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Writable (K, V) views of the tokens the sequence's last extend() added (extend() made their pages
        private to this sequence, so writing through these views is safe)."""
        check_layer(layer, self.num_layers)
        slot = self._live_slot(seq)
        t = self._slots
        # Never before the first writable token: after fork(), reorder() or cache_prefix() the tokens of the
        # last extend() may lie in pages shared with other sequences or the prefix index.
        start = max(min(t.new_from_token[slot], t.length_tokens[slot]), self._first_writable(slot))
        n = t.length_tokens[slot] - start
        return self._views.tokens(layer, 0, slot, start, n), self._views.tokens(layer, 1, slot, start, n)

    def writable_range(self, seq: int) -> tuple[int, int]:
        """(first, end): the tokens write() may write. Tokens in pages the sequence may share with others
        (after fork, reorder, a prefix hit or cache_prefix) are read-only until extend() or truncate()
        gives the sequence its own copy; the tokens the last extend() added are always writable."""
        slot = self._live_slot(seq)
        return self._first_writable(slot), self._slots.length_tokens[slot]

    def _first_writable(self, slot: int) -> int:
        # The first token whose bytes all lie in pages at or past the shared watermark (private to this slot).
        lay, t = self.layout, self._slots
        first = -(-t.shared_below_page[slot] * lay.page_size // lay.token_bytes)
        return min(first, t.length_tokens[slot])

    def kv_batch(self, layer: int, seqs, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of several sequences as [B, length, num_kv_heads, head_dim] views. The sequences must sit
        in evenly spaced slots (allocate_many gives consecutive ones); length defaults to their common length
        and may not exceed the shortest."""
        check_layer(layer, self.num_layers)
        seqs = list(seqs)
        if not seqs:
            raise InvalidArgumentError("kv_batch needs at least one sequence")
        slots = [self._live_slot(s) for s in seqs]
        return self._views.rows(layer, slots, [self._slots.length_tokens[s] for s in slots], length)

    def batch(self, layer: int, seqs) -> BatchedKV:
        """Descriptor of one layer's K/V of `seqs` for decode kernels with per-sequence lengths."""
        check_layer(layer, self.num_layers)
        if self.pool.accounting_only:
            raise InvalidArgumentError(
                "batch(): the cache is on an accounting-only pool, which holds no K/V for kernels to read"
            )
        slots = [self._live_slot(s) for s in seqs]
        return self._views.descriptor(layer, slots, [self._slots.length_tokens[s] for s in slots])

    def write(self, layer: int, seq: int, k: torch.Tensor, v: torch.Tensor, start: int | None = None) -> None:
        """Copy k, v of shape [n, num_kv_heads, head_dim] into tokens start..start+n-1 of the sequence
        (default: its last n tokens). Only writable_range() may be written: tokens in pages the sequence
        may share with others raise ReadOnlyTokensError."""
        check_layer(layer, self.num_layers)
        slot = self._live_slot(seq)
        check_kv(k, v, self.dtype, self.num_kv_heads, self.head_dim, self.device, self.v_head_dim)
        n, length = k.shape[0], self._slots.length_tokens[slot]
        if start is None:
            start = length - n
        if start < 0 or start + n > length:
            raise InvalidArgumentError(
                f"tokens {start}..{start + n - 1} outside the sequence's 0..{length - 1}; extend() first"
            )
        if start < self._first_writable(slot):
            raise ReadOnlyTokensError(
                f"tokens before {self._first_writable(slot)} are read-only (they may share pages with other "
                f"sequences); write the tokens the last extend() added, or truncate() and extend() again"
            )
        self._views.tokens(layer, 0, slot, start, n).copy_(k)
        self._views.tokens(layer, 1, slot, start, n).copy_(v)

    # ----------------------------------------------------------------------------------------- memory
    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over all layers."""
        return self.geometry.bytes_per_token

    def static_bytes(self, num_seqs: int | None = None) -> int:
        """What reserving max_seq_len tokens for each of num_seqs sequences (default max_seqs) would take."""
        return self.geometry.static_bytes(self.max_seqs if num_seqs is None else num_seqs, self.max_seq_len)

    def stats(self) -> CacheStats:
        self._check_open()
        t, runs = self._slots, self.layout.runs
        mapped = t.total_mapped_pages() * runs
        dormant = t.total_mapped_pages(t.dormant_slots()) * runs
        # Tokens in memory: swapped-out sequences do not count. With sharing, live can exceed mapped.
        live_tokens = sum(t.length_tokens[s] for s in t.live_slots() if s not in self._swapped)
        live_bytes = live_tokens * self.bytes_per_token
        pool = self.pool.stats()
        # Only pages below a slot's shared watermark can be shared: count just those (unmapped ones read 0).
        maybe = [
            ps
            for slot, upto in enumerate(t.shared_below_page)
            if upto
            for ps in self._page_slots_of(slot, 0, min(upto, t.mapped_pages[slot]))
        ]
        shared = sum(1 for c in self._range.refcounts_at(maybe) if c > 1) if maybe else 0
        swapped_pages = sum(len(p) for p, _ in self._swapped.values())
        mapped -= swapped_pages
        mapped_bytes = mapped * self.layout.page_size
        prefix_pages = [p for b in self._prefix.blocks() for p in b.pages] if self._prefix else []
        stored, fragmentation, dormant_bytes = virtual_cache_breakdown(
            self.layout, t, self._range.pages_at, prefix_pages, self._swapped
        )
        return CacheStats(
            layout=self.layout.kind,
            page_size=self.layout.page_size,
            sequences=len(t.sequences),
            live_tokens=live_tokens,
            live_bytes=live_bytes,
            mapped_pages=mapped,
            mapped_bytes=mapped_bytes,
            dormant_pages=dormant,
            utilization=live_bytes / mapped_bytes if mapped_bytes else 1.0,
            tokens_per_page=self.layout.tokens_per_page,
            pool_free_pages=pool.free_pages,
            pool_used_pages=pool.used_pages,
            pages_mapped_total=self._pages_mapped,
            pages_unmapped_total=self._pages_unmapped,
            map_calls=self._map_calls,
            shared_pages=shared,
            cow_copies=self._cow_copies,
            prefix_hit_tokens=self._prefix_hits,
            prefix_cached_pages=self._prefix.pages if self._prefix else 0,
            swapped_sequences=len(self._swapped),
            swapped_bytes=swapped_pages * self.layout.page_size,
            stored_bytes=stored,
            fragmentation_bytes=fragmentation,
            reserved_bytes=0,
            dormant_bytes=dormant_bytes,
        )

    def reclaim(self) -> int:
        """Unmap the pages of every freed slot now; returns pages returned to the pool."""
        self._check_open()
        return self.reclaim_pages(self.reclaimable_pages())

    def _unpinned_dormant_slots(self) -> list[int]:
        """Freed slots whose pages no live view reads (reclaim can unmap them), oldest first."""
        return [s for s in self._slots.dormant_slots() if not self._range.pinned_count(self._page_slots_of(s))]

    def _spare_tails(self) -> list[tuple[int, int]]:
        """(slot, first spare page) of live sequences holding private pages past what their tokens need: a
        freed slot reused by a shorter sequence keeps the longer one's pages mapped (deferred reclamation).
        They are kept for the sequence to grow into, and given back when the pool runs short."""
        t, out = self._slots, []
        for slot in t.live_slots():
            length = max(t.length_tokens[slot], self._growing.get(slot, 0))  # an extend in progress: its new length
            first = max(self.layout.pages_for(length), t.shared_below_page[slot])
            if first < t.mapped_pages[slot] and slot not in self._swapped:
                if not self._range.pinned_count(self._page_slots_of(slot, first)):
                    out.append((slot, first))
        return out

    def reclaimable_pages(self) -> int:
        """Pages reclaim_pages() could return to the pool now (Reclaimable): unpinned freed slots' pages,
        cached prefix blocks that nothing else maps, and live sequences' spare pages past their tokens."""
        if self._closed:
            return 0
        dormant = self._unpinned_dormant_slots()
        spare = sum(self._slots.mapped_pages[s] - first for s, first in self._spare_tails())
        return (self._slots.total_mapped_pages(dormant) + spare) * self.layout.runs + sum(
            len(b.pages) for b in self._evictable_blocks(dormant)
        )

    def _evictable_blocks(self, dormant: list[int]):
        """Prefix blocks whose pages only the index holds once the given dormant slots let go of theirs."""
        if not self._prefix:
            return []
        releasable = {p for s in dormant for p in self._range.pages_at(self._page_slots_of(s))}
        return self._prefix.evictable(releasable)

    def reclaim_pages(self, pages: int) -> int:
        """Unmap freed slots' pages, oldest first, then evict cached prefix blocks, until `pages` are freed
        (Reclaimable). Slots still read through a live view are skipped. Returns the pages freed."""
        if self._closed:  # a closed cache holds nothing to reclaim (its pool may still list it)
            return 0
        freed = 0
        for slot in self._slots.dormant_slots():
            if freed >= pages:
                break
            n = len(self._page_slots_of(slot))
            if self._unmap_slot(slot):
                freed += n
        if freed < pages and self._prefix:
            for block in self._evictable_blocks([]):
                if freed >= pages:
                    break
                freed += self._prefix.evict(block)
        if freed < pages:
            for slot, first in self._spare_tails():
                if freed >= pages:
                    break
                idx = self._page_slots_of(slot, first)
                self._range.unmap(idx)  # unpinned (checked), private: nothing reads them
                self._pages_unmapped += len(idx)
                self._slots.truncate_pages(slot, first)
                freed += len(idx)
        return freed

    def close(self) -> None:
        """Free every sequence and return every page to the pool (pages still read through live views
        return when the last such view is gone), then release the address range."""
        if self._closed:
            return
        if self._prefix:
            self._prefix.clear()
        self._swapped.clear()
        self._swap = None
        self._range.unmap_all_unpinned()  # waits for the cache's streams first
        self._range = self._views = None
        self._slots = SlotTable(self.max_seqs)
        self._closed = True
        self.pool.unregister(self)

    def __enter__(self) -> VirtualKVCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._slots.sequences)} sequences"
        return (
            f"VirtualKVCache(layers={self.num_layers}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"dtype={self.dtype}, layout={self.layout.kind}, device={self.device}, {state})"
        )

    # ----------------------------------------------------------------------------------------- streams
    def use_stream(self, stream) -> None:
        """Declare a CUDA stream that runs kernels on this cache's views. Every unmap and remap of the
        cache's pages first waits for the declared streams, for torch's current stream at each call into the
        cache, and for the default stream (the wait lives in the C++ VirtualRange). On the host, kernels are
        synchronous and nothing waits."""
        if self._on_cuda and stream not in self._streams:
            self._streams.append(stream)
            self._range.add_stream(stream.cuda_stream)

    # ----------------------------------------------------------------------------------------- checks
    def _check_open(self) -> None:
        if self._closed:
            raise CacheClosedError("the cache is closed")
        if self._on_cuda:
            # Kernels on the current stream may read what the next unmap removes: the range waits for it.
            self._range.add_stream(torch.cuda.current_stream(self.device).cuda_stream)

    def _slot(self, seq) -> int:
        self._check_open()
        return self._slots.slot_of(seq)

    def _live_slot(self, seq) -> int:
        slot = self._slot(seq)
        if slot in self._swapped:
            raise SequenceSwappedError(f"sequence {seq} is swapped out; swap_in() first")
        return slot

    def _distinct_live_slots(self, seqs: list) -> list[int]:
        slots = [self._live_slot(s) for s in seqs]
        if len(set(slots)) != len(slots):
            raise InvalidArgumentError("a sequence is listed twice")
        return slots
