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

State lives where its invariant is kept: the range's mapping state slot by slot (map, unmap, remap,
copy-on-write copies, counters) in PageMap (page_map.py) over a SlotTable of slots and watermarks
(slot_table.py); cached prefixes and their page references in PrefixIndex (prefix.py); swapped-out slots and
their host copies in SwappedSlots / SwapSpace (swap.py); what the pool may take back in SlotReclaim
(reclaim.py); stats in stats.py; views in SlotViews (views.py); pins and the wait for streams before
any unmap in the C++ VirtualRange. Which sequences share which pages, and the write contract, stay here.

Not thread-safe: one cache belongs to one scheduler thread. The pool under it is thread-safe.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...errors import (
    CacheClosedError,
    InvalidArgumentError,
    ReadOnlyTokensError,
    SequenceSwappedError,
)
from ...memory.pool import PagePool, pool_serialized, resolve_pool
from ..base import KVCacheBase, KVPair
from ..checks import check_kv, check_layer, check_positive_int, check_token_count, check_token_span, is_int, write_start
from ..config import VirtualCacheConfig
from ..eviction import resolve_eviction_policy, resolve_reclaim_order
from ..geometry import KVGeometry, check_cache_args
from ..records import BatchedKV, CacheStats
from .layout import Layout
from .limits import check_cache
from .page_map import PageMap
from .prefix import HashFn, PrefixIndex
from .reclaim import SlotReclaim
from .stats import virtual_cache_stats
from .store_link import StoreLink, cache_fingerprint
from .swap import SwappedSlots, SwapSpace
from .views import SlotViews

__all__ = ["BatchedKV", "CacheStats", "VirtualCacheConfig", "VirtualKVCache"]


@pool_serialized  # the pool's shared-budget thread may reclaim from it between calls, never during one
class VirtualKVCache(KVCacheBase):
    """KV cache with one contiguous virtual range per sequence slot.

    VirtualKVCache(geometry, config): the model's KVGeometry (layers, heads, head sizes, dtype, what is
    stored: kvcache/geometry.py) and a VirtualCacheConfig (what it maps, where it lives, how it keeps what it
    stores: kvcache/config.py; default VirtualCacheConfig()).

    Keywords, for live objects the cache works with:
        pool: a PagePool to share (then the config gives no capacity_bytes and no shared_budget; its device and
            page size must agree with the config's when the config names them). Without one, the config's
            capacity_bytes makes a private pool, else the device's default pool serves.
        prefix_hash: hash(parent_key, block_token_ids) -> bytes for the prefix index (default: blake2b chain).

    A quantized kv_dtype in the geometry (torch.int8: a scale per token and KV head, beside it; float8 e4m3 /
    e5m2: per-layer K and V scales): write() takes values in dtype and quantizes, kv() returns QuantizedKV
    records, dequantized_kv() values. See kvcache/formats.py.
    """

    def __init__(
        self,
        geometry: KVGeometry,
        config: VirtualCacheConfig | None = None,
        *,
        pool: PagePool | None = None,
        prefix_hash: HashFn | None = None,
    ):
        geometry, config = check_cache_args(self, geometry, config, VirtualCacheConfig)
        self.config = config
        # Policies first: a bad name raises before anything is created.
        self.eviction_policy = resolve_eviction_policy(config.eviction_policy)
        self.reclaim_order = resolve_reclaim_order(config.reclaim_order)
        self._init_shape(geometry, config)
        c = config
        budget = dict(shared_budget=c.shared_budget, min_bytes=c.min_bytes, member_name=c.member_name)
        self.device, self.pool = resolve_pool(c.device, pool, c.capacity_bytes, c.page_size, **budget)
        # A pool made here for a shared budget is this cache's membership: close() (or a failed build) leaves
        # the budget at once, rather than when the pool is collected, so the others get its grant back.
        self._owns_membership = pool is None and c.shared_budget is not None
        try:
            self.layout = lay = Layout.of(c.layout, self.geometry, c.max_seqs, c.max_seq_len, self.pool.page_size)
            if not self.pool.accounting_only:  # address space and mapping limit: said now, not mid-serving
                check_cache(lay, self.device)
            self._page_map = PageMap(self.pool.new_range(lay.total_bytes), lay, self.pool)
        except BaseException:
            if self._owns_membership:
                self.pool.leave_budget()
            raise
        self._range, self._slots = self._page_map.range, self._page_map.table
        self._views = SlotViews(self._range, lay, self.kv_format, self.device, self.kv_scales)
        self._prefix_hits = 0
        self._prefix = PrefixIndex.for_layout(lay, self.pool, prefix_hash, self.eviction_policy)
        pin = self.device.type == "cuda" and torch.cuda.is_available()
        swap = SwapSpace(c.swap_bytes, self.pool.page_size, pin=pin) if c.swap_bytes else None
        self._swapped = SwappedSlots(swap)
        self._reclaim = SlotReclaim(self._page_map, self._prefix, self._swapped, self.reclaim_order)
        self._store = self._open_store(c, lay)
        self._streams: list = []  # stream objects given to use_stream(), kept alive while registered
        self._on_cuda = self.device.type == "cuda"
        if self._on_cuda:
            self._range.add_stream(0)  # the legacy default stream: torch's default, and vpaged's own copies
        self._closed = False
        self.pool.register(self)

    def _open_store(self, c: VirtualCacheConfig, lay: Layout) -> StoreLink | None:
        if c.prefix_store is None:
            return None
        if self.pool.accounting_only:
            self._release_membership()
            raise InvalidArgumentError(
                "a prefix_store needs a cache with memory: this one's pool counts pages only (accounting_only)"
            )
        try:
            fp = cache_fingerprint(
                c.prefix_store_weights, self.geometry, lay.kind, lay.page_size, self.kv_format, self.kv_scales
            )
            return StoreLink.open(
                c.prefix_store, fp, lay.runs, lay.page_size, c.prefix_store_pages, self.pool, c.prefix_store_map
            )
        except BaseException:
            self._release_membership()
            raise

    def _release_membership(self) -> None:
        self._range.unmap_all_unpinned()
        if self._owns_membership:
            self.pool.leave_budget()

    @property
    def prefix_store(self) -> StoreLink | None:
        """The link to the shared page store (config.prefix_store), None without one: .store is the
        PageStore, .stats its StoreLinkStats."""
        return self._store

    # ----------------------------------------------------------------------------------------- lifecycle
    def allocate(self, tokens: Sequence[int] | None = None) -> int:
        """A new sequence; returns its id. Reuses a freed slot's pages when one has them.

        tokens: the prompt's token ids. The longest run of cached full pages whose tokens match is mapped in
        shared, and the sequence starts with those tokens present: seq_len(seq) tells how many, so the caller
        computes (extends by) only the rest. Pages become reusable through cache_prefix()."""
        self._check_open()
        t = self._slots
        if tokens is None:
            slot = t.take_reusable()
            if slot is None:
                raise self._page_map.exhausted("a free sequence slot")
            return t.bind(self._take_clean_slot(slot))
        index = self._prefix
        hits = index.match(tokens)
        slot = self._take_clean_slot()
        if hits:
            pages = [b.pages[r] for r in range(self.layout.runs) for b in hits]  # run-major, like page_indices
            self._page_map.map_shared(slot, pages, len(hits))
        blocks = len(hits)
        if self._store is not None:
            try:
                blocks = self._store.fetch(index, self._page_map, slot, tokens, blocks)
            except BaseException:
                if hits:
                    self._page_map.unmap_slot(slot)
                t.release(slot)
                raise
        seq = t.bind(slot)
        # The tokens wholly in the shared pages; one that straddles the last of them is computed again, and
        # writing it copies that page first (it is below the shared watermark, store pages mapped in too; pages
        # the store's hit copied are the sequence's own, written in place).
        t.length_tokens[slot] = t.new_from_token[slot] = n = index.tokens_in(blocks)
        self._prefix_hits += n
        return seq

    def _take_clean_slot(self, taken: int | None = None) -> int:
        """A slot with nothing mapped, or a slot just `taken` made clean for a new owner (see PageMap)."""
        slot = self._page_map.take_clean_slot() if taken is None else self._page_map.clean_for_new_owner(taken)
        if slot is None:
            raise self._page_map.exhausted("a free sequence slot with nothing mapped")
        return slot

    def allocate_many(self, n: int) -> list[int]:
        """n new sequences in consecutive slots, so that kv_batch() can view them as one tensor."""
        self._check_open()
        check_positive_int("n", n)
        first = self._slots.free_run(n)
        if first is None:
            raise self._page_map.exhausted("consecutive free sequence slots", n)
        self._page_map.take_run(first, n)
        return [self._slots.bind(slot) for slot in range(first, first + n)]

    def free(self, seq: int) -> None:
        """End a sequence. Its private pages stay mapped for the next allocate() until the pool needs them;
        pages it shares with others are unmapped at once (so a reused slot never starts with shared pages)."""
        slot = self._slot(seq)
        t = self._slots
        if slot in self._swapped:
            # The slot has holes where pages were swapped out, so it cannot stay dormant: unmap what is left
            # first (ViewsAliveError when a view still reads a shared page: then nothing has changed).
            self._page_map.unmap_around_holes(slot, self._swapped[slot][0])
            self._swapped.drop(slot)
        t.unbind(seq)
        if t.shared_below_page[slot]:
            if self._page_map.shares_pages(slot):
                self._page_map.unmap_slot(slot)  # kept while a view reads it; a later extend copies before writing
            else:
                t.shared_below_page[slot] = 0
        t.release(slot)

    def extend(self, seq: int, n: int) -> None:
        """Grow a sequence by n tokens, mapping the pages they need. Their K/V are then to be written
        (write() or the views of kv()). Raises OutOfPagesError with nothing changed when the pool is short."""
        self.extend_many([seq], n)

    def extend_many(self, seqs: Sequence[int], n: int = 1) -> None:
        """extend() for several sequences at once (a decode step): all of them or, on error, none. New tokens
        that land in pages the sequence may share get a private copy of those pages first (copy-on-write)."""
        self._check_open()
        check_token_count(n)
        seqs = list(seqs)
        self._page_map.extend(self._page_map.plan_extend(seqs, self._distinct_live_slots(seqs), n))

    def pages_needed(self, seqs: Sequence[int], n: int = 1) -> int:
        """Pages that extend_many(seqs, n) would take from the pool: new pages plus the copy-on-write copies
        of shared pages the new tokens land in; for a swapped-out sequence also the pages swap_in() maps back;
        plus the sequences' own spare pages that pages_available() counts as reclaimable (an extend keeps them).
        Changes nothing: a scheduler compares it with pages_available() before it extends, and preempts
        instead of catching OutOfPagesError. The same plan as extend_many()'s."""
        self._check_open()
        check_token_count(n)
        seqs = list(seqs)
        slots = [self._slots.slot_of(s) for s in seqs]
        swapped_in = sum(len(self._swapped[s][0]) for s in slots if s in self._swapped)
        # Their own spare pages count in pages_available() but are not reclaimed while they grow: count them here
        # too, so that "needed <= available" holds exactly when the extend succeeds.
        own_spare = self._reclaim.spare_pages_of(slots)
        return swapped_in + own_spare + self._page_map.plan_extend(seqs, slots, n).pages

    def pages_available(self) -> int:
        """Pages an extend could take now: the pool's free pages plus those freed slots and unused prefix
        pages would give back (shared with the other caches on the same pool) and, in a shared budget, what
        the budget would grant without anyone giving back (PagePool.available_pages)."""
        self._check_open()
        return self.pool.available_pages()

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
        return self._slots.sequences if not self._closed else []

    # ----------------------------------------------------------------------------------------- views
    def kv(self, layer: int, seq: int) -> KVPair:
        """Zero-copy (K, V) views of shape [seq_len, num_kv_heads, head_dim] covering exactly the tokens
        present (strided for the interleaved layout). While a view lives, its pages stay mapped. A quantized
        cache gives two QuantizedKV records (stored data and scales, views); dequantized_kv() gives values."""
        check_layer(layer, self.num_layers)
        slot = self._live_slot(seq)
        n = self._slots.length_tokens[slot]
        return self._views.values(layer, 0, slot, 0, n), self._views.values(layer, 1, slot, 0, n)

    def dequantized_kv(self, layer: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of the tokens present as values in the model dtype: copies for a quantized cache, kv()'s
        views otherwise."""
        k, v = self.kv(layer, seq)
        return (k.dequantize(), v.dequantize()) if self.kv_format.quantized else (k, v)

    def new_kv(self, layer: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Writable (K, V) views of the tokens the sequence's last extend() added (extend() made their pages
        private to this sequence, so writing through these views is safe)."""
        check_layer(layer, self.num_layers)
        slot = self._live_slot(seq)
        t = self._slots
        # Never before the first writable token: after fork(), reorder() or cache_prefix() the tokens of the
        # last extend() may lie in pages shared with other sequences or the prefix index.
        start = max(min(t.new_from_token[slot], t.length_tokens[slot]), self._page_map.first_writable(slot))
        n = t.length_tokens[slot] - start
        return self._views.values(layer, 0, slot, start, n), self._views.values(layer, 1, slot, start, n)

    def writable_range(self, seq: int) -> tuple[int, int]:
        """(first, end): the tokens write() may write. Tokens in pages the sequence may share with others
        (after fork, reorder, a prefix hit or cache_prefix) are read-only until extend() or truncate()
        gives the sequence its own copy; the tokens the last extend() added are always writable."""
        slot = self._live_slot(seq)
        return self._page_map.first_writable(slot), self._slots.length_tokens[slot]

    def kv_batch(self, layer: int, seqs, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of several sequences as [B, length, num_kv_heads, head_dim] views (QuantizedKV records on a
        quantized cache). The sequences must sit in evenly spaced slots (allocate_many gives consecutive
        ones); length defaults to their common length and may not exceed the shortest."""
        check_layer(layer, self.num_layers)
        seqs = list(seqs)
        if not seqs:
            raise InvalidArgumentError("kv_batch needs at least one sequence")
        slots = [self._live_slot(s) for s in seqs]
        k, v = self._views.rows(layer, slots, [self._slots.length_tokens[s] for s in slots], length)
        return self._views.as_values(k, layer, 0), self._views.as_values(v, layer, 1)

    def batch(self, layer: int, seqs) -> BatchedKV:
        """Descriptor of one layer's K/V of `seqs` for decode kernels with per-sequence lengths."""
        self._check_open()
        check_layer(layer, self.num_layers)
        if self.pool.accounting_only:
            raise InvalidArgumentError(
                "batch(): the cache is on an accounting-only pool, which holds no K/V for kernels to read"
            )
        return self._views.descriptor(layer, *self.slots_and_lengths(seqs))

    def slots_and_lengths(self, seqs) -> tuple[list[int], list[int]]:
        """(slots, lengths) of live sequences: the rows batch() describes, as plain lists (decode kernels on
        the CPU take them so, without building tensors per step)."""
        slots = [self._live_slot(s) for s in seqs]
        lengths = self._slots.length_tokens
        return slots, [lengths[s] for s in slots]

    def decode_source(self, layer: int) -> BatchedKV:
        """The layer's K/V of every slot (no sequence yet) for a decode kernel's plan (vpaged.ops): addresses
        and strides never change while the cache is open."""
        return self.batch(layer, [])

    def decode_rows(self, seqs: Sequence[int]) -> tuple[list[int], list[int]]:
        """Where a step's sequences are for the contiguous kernel: (slots, lengths)."""
        return self.slots_and_lengths(seqs)

    def kv_layers(self, seq: int, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """K/V of tokens start..stop-1 (default: all present) in every layer, as one zero-copy view of shape
        [num_layers, 2, stop - start, num_kv_heads, head_dim] ([:, 0] is K, [:, 1] is V). One view per
        sequence and step instead of two per layer. For reading; the tokens of writable_range() may also be
        written through it (after extend(), the tokens it added). A quantized cache's rows are its stored
        bytes (uint8, an int8 row's scale included): kv_format.dequantize() turns them into values."""
        slot = self._live_slot(seq)
        length = self._slots.length_tokens[slot]
        stop = length if stop is None else stop
        check_token_span(start, stop, length)
        return self._views.layers(slot, start, stop - start)

    def write(self, layer: int, seq: int, k: torch.Tensor, v: torch.Tensor, start: int | None = None) -> None:
        """Copy k, v of shape [n, num_kv_heads, head_dim] into tokens start..start+n-1 of the sequence
        (default: its last n tokens; values in the cache's dtype, quantized when kv_dtype is a quantized
        format). Only writable_range() may be written: tokens in pages the sequence may share with others
        raise ReadOnlyTokensError."""
        check_layer(layer, self.num_layers)
        slot = self._live_slot(seq)
        check_kv(k, v, self.dtype, self.num_kv_heads, self.head_dim, self.device, self.v_head_dim)
        n = k.shape[0]
        start = write_start(start, n, self._slots.length_tokens[slot])
        first = self._page_map.first_writable(slot)
        if start < first:
            raise ReadOnlyTokensError(
                f"tokens before {first} are read-only (they may share pages with other "
                f"sequences); write the tokens the last extend() added, or truncate() and extend() again"
            )
        self._views.write(layer, slot, start, k, v)  # quantized on the way in for a quantized format

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
            raise self._page_map.exhausted("forks", n)
        npages = self.layout.pages_for(t.length_tokens[parent])
        pages = self._page_map.pages(parent, 0, npages)
        children: list[int] = []
        try:
            for _ in range(n):
                slot = self._take_clean_slot()
                if npages:
                    self._page_map.map_shared(slot, pages, npages)
                children.append(t.bind(slot))
                t.length_tokens[slot] = t.length_tokens[parent]
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
            self._page_map.unmap_tail(slot, keep)  # False (kept) while a live view reads them
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
        self._page_map.remap_rows(self._distinct_live_slots(seqs), sources)

    def cache_prefix(self, seq: int, tokens) -> int:
        """Offer the full pages of `seq` for reuse by later allocate(tokens=...) calls. tokens: the token ids
        of the sequence (at least its full pages' worth); their K/V must be written. Returns the number of
        tokens now cached for this prefix."""
        slot = self._live_slot(seq)
        index = self._prefix
        tokens = list(tokens)[: self._slots.length_tokens[slot]]  # only tokens the sequence holds
        blocks = index.insert_blocks(tokens, lambda d: self._page_map.pages(slot, d, d + 1))
        # Its pages the index now holds are read-only for the sequence too (also when a collision cut it short).
        self._slots.mark_shared(slot, blocks)
        if self._store is not None:
            self._store.publish(index, self._page_map, slot, tokens, blocks)
        return index.tokens_in(blocks)

    # ----------------------------------------------------------------------------------------- swapping
    def swap_out(self, seq: int) -> int:
        """Copy the sequence's private pages to swap space and return them to the pool; pages it shares stay
        mapped. The sequence keeps its id and addresses; returns the bytes swapped."""
        slot = self._live_slot(seq)
        if self._swapped.space is None:
            raise InvalidArgumentError("this cache has no swap space (build it with VirtualCacheConfig(swap_bytes=N))")
        private, chunks = self._page_map.swap_out(seq, slot, self._swapped.space)
        self._swapped.add(slot, private, chunks)
        return len(private) * self.layout.page_size

    def swap_in(self, seq: int) -> None:
        """Map fresh pages where the swapped ones were and restore their data bit-exactly."""
        slot = self._slot(seq)
        if slot not in self._swapped:
            raise InvalidArgumentError(f"sequence {seq} is not swapped out")
        self._page_map.swap_in(*self._swapped[slot], self._swapped.space)
        self._swapped.drop(slot)

    # ----------------------------------------------------------------------------------------- memory
    def stats(self) -> CacheStats:
        self._check_open()
        return virtual_cache_stats(self._page_map, self.pool, self._prefix, self._swapped, self._prefix_hits)

    def reclaim(self) -> int:
        """Unmap the pages of every freed slot now; returns pages returned to the pool."""
        self._check_open()
        return self.reclaim_pages(self.reclaimable_pages())

    def reclaimable_pages(self) -> int:
        """Pages reclaim_pages() could return to the pool now (Reclaimable): unpinned freed slots' pages,
        cached prefix blocks that nothing else maps, and live sequences' spare pages past their tokens."""
        return 0 if self._closed else self._reclaim.reclaimable_pages()

    def reclaim_pages(self, pages: int) -> int:
        """Give back kept pages in the reclaim order (by default freed slots' pages, oldest first, then cached
        prefix blocks in the eviction order, then spare tails) until `pages` are freed (Reclaimable). Slots
        still read through a live view are skipped. Returns the pages freed."""
        # A closed cache holds nothing to reclaim (its pool may still list it).
        return 0 if self._closed else self._reclaim.reclaim_pages(pages)

    def close(self) -> None:
        """Free every sequence and return every page to the pool (pages still read through live views
        return when the last such view is gone), then release the address range."""
        if self._closed:
            return
        if self._prefix:
            self._prefix.clear()
        self._swapped.clear()
        self._range.unmap_all_unpinned()  # waits for the cache's streams first
        if self._store is not None:
            self._store.close()  # after the unmap: it gives back the store pages the range mapped
        self._page_map = self._range = self._views = self._reclaim = None
        self.kernel_plans.clear()  # their parameters address memory that is gone
        self._closed = True
        self.pool.unregister(self)
        if self._owns_membership:
            self.pool.leave_budget()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._slots.sequences)} sequences"
        return f"VirtualKVCache({self.geometry.describe()}, layout={self.layout.kind}, device={self.device}, {state})"

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
