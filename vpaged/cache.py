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

Not thread-safe: one cache belongs to one scheduler thread. The pool under it is thread-safe.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from . import _C
from ._checks import check_kv, check_layer, check_token_count, lookup_sequence
from ._dtypes import dlpack_code, itemsize
from .device import normalize_device
from .errors import (CacheClosedError, InvalidArgumentError, OutOfPagesError, ReadOnlyTokensError,
                     SequenceSwappedError, SequenceTooLongError, SlotsExhaustedError, SwapSpaceFullError,
                     ViewsAliveError)
from .layout import Layout
from .pool import PagePool, default_pool
from .prefix import HashFn, PrefixIndex
from .swap import SwapSpace


@dataclass(frozen=True)
class CacheStats:
    layout: str
    page_size: int
    sequences: int
    live_tokens: int
    live_bytes: int  # bytes holding K/V of live tokens (all layers)
    mapped_pages: int  # pages this cache has mapped, dormant ones included
    mapped_bytes: int
    dormant_pages: int  # pages of freed slots kept for reuse (reclaimable)
    utilization: float  # live_bytes / mapped_bytes (1.0 when nothing is mapped; > 1 when pages are shared)
    tokens_per_page: float  # fill granularity: tokens one page of one region holds
    pool_free_pages: int
    pool_used_pages: int
    pages_mapped_total: int  # pages mapped since creation (map work done)
    pages_unmapped_total: int
    map_calls: int  # calls into the range that mapped pages (one per extend that needed pages)
    shared_pages: int  # pages this cache maps that are mapped more than once (or held by the prefix index)
    cow_copies: int  # pages copied on write since creation
    prefix_hit_tokens: int  # tokens reused from the prefix index since creation
    prefix_cached_pages: int  # pages held by the prefix index
    swapped_sequences: int
    swapped_bytes: int  # bytes in swap space


@dataclass(frozen=True)
class BatchedKV:
    """One layer's K and V of several sequences, for decode kernels that take per-sequence lengths.

    k_ptr / v_ptr address token 0 of slot 0; sequence i starts `slots[i] * slot_stride` elements further
    and holds `lengths[i]` valid tokens with `token_stride` elements between tokens, `head_stride` between
    heads (head_dim except for the head_major layout). Only memory below each length is guaranteed mapped: a kernel must not read past it. Valid until
    one of the sequences is freed, truncated or swapped out.
    """

    k_ptr: int
    v_ptr: int
    slots: torch.Tensor  # int32 [B] on the cache's device
    lengths: torch.Tensor  # int32 [B] on the cache's device
    slot_stride: int
    token_stride: int
    head_stride: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    layout: str
    owner: object  # the cache's range: keeps the memory reserved while this descriptor lives


class VirtualKVCache:
    """KV cache with one contiguous virtual range per sequence slot.

    Args:
        num_layers, num_kv_heads, head_dim: model geometry.
        dtype: element type of K and V (float32, float16, bfloat16, float64).
        max_seqs: sequence slots (concurrent sequences).
        max_seq_len: tokens a sequence may hold.
        device: "cpu", "cuda" or "cuda:N".
        pool: a PagePool to share; or capacity_bytes for a private pool; neither: the device's default pool.
        layout: "per_layer" (dense [T, H, D] per-layer views), "interleaved" (all layers of a token together:
            finer fill granularity, one map per page for all layers) or "head_major" (dense [H, T, D] per
            layer, what SDPA prefers; a page per head). See layout.py.
        page_size: bytes per page for a private/default pool (must match a given pool).
        swap_bytes: capacity of the host swap space for swap_out() (0: no swapping).
        prefix_hash: hash(parent_key, block_token_ids) -> bytes for the prefix index (default: blake2b chain).
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype = torch.bfloat16,
                 max_seqs: int = 64, max_seq_len: int = 4096, device="cpu", pool: PagePool | None = None,
                 capacity_bytes: int | None = None, layout: str = "per_layer", page_size: int | None = None,
                 swap_bytes: int = 0, prefix_hash: HashFn | None = None):
        for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                            ("max_seqs", max_seqs), ("max_seq_len", max_seq_len)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")
        self.device = normalize_device(device)
        self.dtype = dtype
        self._dl_code, self._dl_bits = dlpack_code(dtype)
        if pool is not None:
            if capacity_bytes is not None:
                raise InvalidArgumentError("give either pool or capacity_bytes, not both")
            if pool.device != self.device:
                raise InvalidArgumentError(f"pool is on {pool.device}, cache on {self.device}")
            if page_size is not None and page_size != pool.page_size:
                raise InvalidArgumentError(f"page_size {page_size} differs from the pool's {pool.page_size}")
        elif capacity_bytes is not None:
            pool = PagePool(self.device, capacity_bytes=capacity_bytes, page_size=page_size)
        else:
            pool = default_pool(self.device)
            if page_size is not None and page_size != pool.page_size:
                raise InvalidArgumentError(
                    f"page_size {page_size} differs from the default pool's {pool.page_size}; "
                    "pass capacity_bytes or a pool of that page size")
        self.pool = pool
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.max_seqs, self.max_seq_len = max_seqs, max_seq_len
        self.layout = Layout(layout, num_layers, num_kv_heads, head_dim, itemsize(dtype), max_seqs, max_seq_len,
                             pool.page_size)
        self._range = _C.VirtualRange(pool._pool, self.layout.total_bytes)
        self._slot_of: dict[int, int] = {}  # live sequence id -> slot
        self._len = [0] * max_seqs  # tokens held by the sequence in each slot
        self._mapped = [0] * max_seqs  # pages mapped per region in each slot
        self._empty = list(range(max_seqs - 1, -1, -1))  # slots without pages; pop() gives the lowest
        self._dormant: OrderedDict[int, None] = OrderedDict()  # freed slots that keep their pages, oldest first
        self._shared_upto = [0] * max_seqs  # pages below this index of a slot may be shared
        self._new_from = [0] * max_seqs  # first token the last extend() added (new_kv's window)
        self._swapped: dict[int, tuple[list[int], list[int]]] = {}  # slot -> (page slots swapped, chunks)
        self._next_id = 0
        self._pages_mapped = 0
        self._pages_unmapped = 0
        self._map_calls = 0
        self._cow_copies = 0
        self._prefix_hits = 0
        tpp = self.layout.page_size / self.layout.token_bytes
        self._prefix = PrefixIndex(int(tpp), prefix_hash) if tpp == int(tpp) else None
        self._swap = (SwapSpace(swap_bytes, pool.page_size, pin=self.device.type == "cuda")
                      if swap_bytes else None)
        self._streams: list = []  # extra CUDA streams kernels use on this cache (see _quiesce)
        self._closed = False
        pool._register(self)

    # ----------------------------------------------------------------------------------------- lifecycle
    def allocate(self, tokens=None) -> int:
        """A new sequence; returns its id. Reuses a freed slot's pages when one has them.

        tokens: the prompt's token ids. The longest run of cached full pages whose tokens match is mapped in
        shared, and the sequence starts with those tokens present: seq_len(seq) tells how many, so the caller
        computes (extends by) only the rest. Pages become reusable through cache_prefix()."""
        self._check_open()
        if tokens is None:
            if self._dormant:
                slot, _ = self._dormant.popitem(last=True)  # most recently freed: its pages are warmest
            elif self._empty:
                slot = self._empty.pop()
            else:
                raise SlotsExhaustedError(f"all {self.max_seqs} sequence slots are in use")
            return self._bind(slot)
        index = self._prefix_index()
        hits = index.match(tokens)
        slot = self._take_clean_slot()
        if hits:
            page_slots = self.layout.page_slots(slot, 0, len(hits))  # region-major, like the pages below
            pages = [b.pages[r] for r in range(self.layout.runs) for b in hits]
            try:
                self._range.map_shared(page_slots, pages)
            except BaseException:
                self._empty.append(slot)
                raise
        seq = self._bind(slot)
        n = len(hits) * index.block_tokens
        self._len[slot] = n
        self._new_from[slot] = n
        self._mapped[slot] = len(hits)
        self._shared_upto[slot] = len(hits)
        self._prefix_hits += n
        return seq

    def _take_clean_slot(self) -> int:
        """A slot with nothing mapped (an empty one, else a freed slot whose pages are unmapped now)."""
        if self._empty:
            return self._empty.pop()
        for slot in list(self._dormant):
            try:
                self._unmap_slot(slot)
            except ViewsAliveError:
                continue
            del self._dormant[slot]
            return slot
        raise SlotsExhaustedError(f"all {self.max_seqs} sequence slots are in use")

    def _unmap_slot(self, slot: int) -> None:
        if self._mapped[slot]:
            idx = self.layout.page_slots(slot, 0, self._mapped[slot])
            self._quiesce()
            self._range.unmap(idx)
            self._pages_unmapped += len(idx)
        self._mapped[slot] = 0
        self._shared_upto[slot] = 0

    def allocate_many(self, n: int) -> list[int]:
        """n new sequences in consecutive slots, so that kv_batch() can view them as one tensor."""
        self._check_open()
        if not isinstance(n, int) or n <= 0:
            raise InvalidArgumentError(f"n must be a positive int, got {n!r}")
        free = set(self._empty) | set(self._dormant)
        run_start, best = 0, None
        for s in range(self.max_seqs + 1):
            if s < self.max_seqs and s in free:
                if s - run_start + 1 >= n:
                    best = s - n + 1
                    break
            else:
                run_start = s + 1
        if best is None:
            raise SlotsExhaustedError(f"no {n} consecutive free sequence slots (of {self.max_seqs})")
        ids = []
        for slot in range(best, best + n):
            if slot in self._dormant:
                del self._dormant[slot]
            else:
                self._empty.remove(slot)
            ids.append(self._bind(slot))
        return ids

    def _bind(self, slot: int) -> int:
        seq = self._next_id
        self._next_id += 1
        self._slot_of[seq] = slot
        self._len[slot] = 0
        self._new_from[slot] = 0
        return seq

    def free(self, seq: int) -> None:
        """End a sequence. Its private pages stay mapped for the next allocate() until the pool needs them;
        pages it shares with others are unmapped at once (so a reused slot never starts with shared pages)."""
        slot = self._slot(seq)
        if slot in self._swapped:
            # The slot has holes where pages were swapped out, so it cannot stay dormant: unmap what is left
            # first (ViewsAliveError when a view still reads a shared page: then nothing has changed).
            swapped_slots, chunks = self._swapped[slot]
            gone = set(swapped_slots)
            keep = [ps for ps in self.layout.page_slots(slot, 0, self._mapped[slot]) if ps not in gone]
            self._quiesce()
            self._range.unmap(keep)
            del self._swapped[slot]
            self._swap.release(chunks)
            self._pages_unmapped += len(keep)
            self._mapped[slot] = 0
            self._shared_upto[slot] = 0
        del self._slot_of[seq]
        self._len[slot] = 0
        if self._shared_upto[slot]:
            idx = self.layout.page_slots(slot, 0, self._mapped[slot])
            if any(c > 1 for c in self._range.refcounts_at(idx)):
                try:
                    self._unmap_slot(slot)
                except ViewsAliveError:
                    pass  # kept; a later extend of the slot copies before writing
            else:
                self._shared_upto[slot] = 0
        if self._mapped[slot]:
            self._dormant[slot] = None
        else:
            self._empty.append(slot)

    def extend(self, seq: int, n: int) -> None:
        """Grow a sequence by n tokens, mapping the pages they need. Their K/V are then to be written
        (write() or the views of kv()). Raises OutOfPagesError with nothing changed when the pool is short."""
        self.extend_many([seq], n)

    def extend_many(self, seqs, n: int = 1) -> None:
        """extend() for several sequences at once (a decode step): all of them or, on error, none."""
        self._check_open()
        check_token_count(n)
        slots = [self._live_slot(s) for s in seqs]
        if len(set(slots)) != len(slots):
            raise InvalidArgumentError("a sequence is listed twice")
        lay = self.layout
        page_slots: list[int] = []
        grown = []
        to_privatize: list[int] = []  # mapped page slots the new tokens land in that may be shared
        for seq, slot in zip(seqs, slots):
            old_len = self._len[slot]
            new_len = old_len + n
            if new_len > self.max_seq_len:
                raise SequenceTooLongError(
                    f"sequence {seq} would hold {new_len} tokens, more than max_seq_len={self.max_seq_len}")
            need = lay.pages_for(new_len)
            if n and self._shared_upto[slot]:
                first = old_len * lay.token_bytes // lay.page_size  # page of the first new token
                # Every mapped page from `first` up to the watermark, not just those below `need`: after a
                # truncate() or free() that could not unmap (a live view), pages past `need` may still be
                # shared, and the watermark drops to `first` below, so they must be private by then.
                stop = min(self._mapped[slot], self._shared_upto[slot])
                if first < stop:
                    to_privatize += lay.page_slots(slot, first, stop)
            if need > self._mapped[slot]:
                page_slots += lay.page_slots(slot, self._mapped[slot], need)
                grown.append((slot, need))
        copies = sum(1 for c in self._range.refcounts_at(to_privatize) if c > 1) if to_privatize else 0
        if page_slots or copies:
            self._ensure_free(len(page_slots) + copies)
        if page_slots:
            self._with_reclaim(lambda: self._range.map_new(page_slots), len(page_slots))
            self._pages_mapped += len(page_slots)
            self._map_calls += 1
            for slot, need in grown:
                self._mapped[slot] = need
        if copies:
            self._quiesce()
            self._cow_copies += self._with_reclaim(lambda: self._range.make_private(to_privatize), copies)
            self.pool.backend.synchronize(0)  # the copies (async on CUDA) land before kernels read the pages
        for slot in slots:
            if n and self._shared_upto[slot]:
                # Every page from the first new token's on is private now.
                first = self._len[slot] * lay.token_bytes // lay.page_size
                self._shared_upto[slot] = min(self._shared_upto[slot], first)
            self._new_from[slot] = self._len[slot]
            self._len[slot] += n

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
                f"of {s.total_pages} (+{self.pool.reclaimable_pages()} reclaimable); nothing was changed")

    # ----------------------------------------------------------------------------------------- planning
    def pages_needed(self, seqs, n: int = 1) -> int:
        """Pages that extend_many(seqs, n) would take from the pool: new pages plus the copy-on-write copies
        of shared pages the new tokens land in; for a swapped-out sequence also the pages swap_in() maps back.
        Changes nothing: a scheduler compares it with pages_available() before it extends, and preempts
        instead of catching OutOfPagesError. Kept in step with extend_many()'s own planning."""
        self._check_open()
        check_token_count(n)
        lay = self.layout
        total = 0
        to_privatize: list[int] = []
        for seq in seqs:
            slot = self._slot(seq)
            swapped = self._swapped.get(slot)
            if swapped is not None:
                total += len(swapped[0])
            old_len = self._len[slot]
            if old_len + n > self.max_seq_len:
                raise SequenceTooLongError(
                    f"sequence {seq} would hold {old_len + n} tokens, more than max_seq_len={self.max_seq_len}")
            need = lay.pages_for(old_len + n)
            if need > self._mapped[slot]:
                total += (need - self._mapped[slot]) * lay.runs
            if n and self._shared_upto[slot]:
                first = old_len * lay.token_bytes // lay.page_size
                stop = min(self._mapped[slot], self._shared_upto[slot])
                if first < stop:
                    to_privatize += lay.page_slots(slot, first, stop)
        if to_privatize:
            total += sum(1 for c in self._range.refcounts_at(to_privatize) if c > 1)
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
        length = self._len[slot]
        stop = length if stop is None else stop
        for name, value in (("start", start), ("stop", stop)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise InvalidArgumentError(f"{name} must be an int, got {value!r}")
        if not 0 <= start <= stop <= length:
            raise InvalidArgumentError(f"tokens {start}..{stop - 1} outside the sequence's 0..{length - 1}")
        lay = self.layout
        shape, strides, perm = lay.view_dims(stop - start)
        # K and V of layer l start at base_offset(l, 0) and base_offset(l, 1): whole regions apart (per_layer,
        # head_major) or columns of one token row (interleaved); kv_stride apart in every layout.
        kv_stride = (lay.base_offset(0, 1) - lay.base_offset(0, 0)) // lay.itemsize
        dims = [(2 * kv_stride, self.num_layers, 0), (kv_stride, 2, 1)]
        dims += [(strides[i], shape[i], 2 + perm.index(i)) for i in range(len(shape))]
        dims.sort(key=lambda d: -d[0])  # the core takes dims in memory order, largest stride first
        view = self._make_view(lay.offset(0, 0, slot, start), [d[1] for d in dims], [d[0] for d in dims])
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
        if not isinstance(n, int) or n <= 0:
            raise InvalidArgumentError(f"n must be a positive int, got {n!r}")
        if len(self._empty) + len(self._dormant) < n:
            raise SlotsExhaustedError(f"{n} fork(s) need free slots; {len(self._empty) + len(self._dormant)} free")
        npages = self.layout.pages_for(self._len[parent])
        pages = self._range.pages_at(self.layout.page_slots(parent, 0, npages))
        children: list[int] = []
        try:
            for _ in range(n):
                slot = self._take_clean_slot()
                try:
                    if npages:
                        self._range.map_shared(self.layout.page_slots(slot, 0, npages), pages)
                except BaseException:
                    self._empty.append(slot)
                    raise
                child = self._bind(slot)
                children.append(child)
                self._len[slot] = self._len[parent]
                self._mapped[slot] = npages
                self._shared_upto[slot] = npages
        except BaseException:
            for child in children:
                self.free(child)
            raise
        self._shared_upto[parent] = max(self._shared_upto[parent], npages)
        return children

    def truncate(self, seq: int, new_len: int) -> None:
        """Drop the tokens from new_len on (speculative decoding, beam search). Pages wholly past the new
        length are unmapped (kept while a live view reads them)."""
        slot = self._live_slot(seq)
        if not isinstance(new_len, int) or isinstance(new_len, bool) or not 0 <= new_len <= self._len[slot]:
            raise InvalidArgumentError(f"new_len must be an int in 0..{self._len[slot]}, got {new_len!r}")
        keep = self.layout.pages_for(new_len)
        if self._mapped[slot] > keep:
            idx = self.layout.page_slots(slot, keep, self._mapped[slot])
            try:
                self._quiesce()
                self._range.unmap(idx)
                self._pages_unmapped += len(idx)
                self._mapped[slot] = keep
                self._shared_upto[slot] = min(self._shared_upto[slot], keep)
            except ViewsAliveError:
                pass
        self._len[slot] = new_len
        self._new_from[slot] = min(self._new_from[slot], new_len)

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
        slots = [self._live_slot(s) for s in seqs]
        if len(set(slots)) != len(slots):
            raise InvalidArgumentError("a sequence is listed twice")
        lay = self.layout
        lens = [self._len[s] for s in slots]
        old_pages = {s: self._range.pages_at(lay.page_slots(s, 0, self._mapped[s])) for s in set(slots)}
        assign_slots: list[int] = []
        assign_pages: list[int] = []
        moves = []
        for dst, i in zip(slots, sources):
            src = slots[i]
            if src == dst:
                continue
            src_n = lay.pages_for(lens[i])
            span = max(src_n, self._mapped[dst])
            # page_slots(slot, 0, n) lists run by run, so page p of run r is entry r * n + p. Built once per
            # row: a call per page made a beam-search reorder O(runs^2 * pages) in Python.
            src_pages, src_mapped = old_pages[src], self._mapped[src]
            dst_slots = lay.page_slots(dst, 0, span)
            assign_slots += dst_slots
            for r in range(lay.runs):
                assign_pages += src_pages[r * src_mapped:r * src_mapped + src_n]
                assign_pages += [-1] * (span - src_n)
            moves.append((dst, src, src_n, lens[i]))
        if assign_slots:
            self._quiesce()
            self._range.assign(assign_slots, assign_pages)
        for dst, src, src_n, length in moves:
            self._len[dst] = length
            self._mapped[dst] = src_n
            self._shared_upto[dst] = src_n
            self._shared_upto[src] = max(self._shared_upto[src], min(src_n, self._mapped[src]))

    def cache_prefix(self, seq: int, tokens) -> int:
        """Offer the full pages of `seq` for reuse by later allocate(tokens=...) calls. tokens: the token ids
        of the sequence (at least its full pages' worth); their K/V must be written. Returns the number of
        tokens now cached for this prefix."""
        slot = self._live_slot(seq)
        index = self._prefix_index()
        tokens = list(tokens)
        nblocks = min(len(tokens), self._len[slot]) // index.block_tokens
        for depth, (key, block) in enumerate(index.keys(tokens[:nblocks * index.block_tokens])):
            found = index.lookup(key)
            if found is not None:
                if found.tokens != block or found.depth != depth:
                    return depth * index.block_tokens  # a different prefix owns this key: stop here
                continue
            pages = self._range.pages_at(self.layout.page_slots(slot, depth, depth + 1))
            for p in pages:
                self.pool._pool.incref(p)
            index.insert(key, depth, block, pages)
        self._shared_upto[slot] = max(self._shared_upto[slot], nblocks)
        return nblocks * index.block_tokens

    def _prefix_index(self) -> PrefixIndex:
        if self._prefix is None:
            raise InvalidArgumentError(
                f"prefix caching needs pages that hold a whole number of tokens; a page of {self.layout.page_size} "
                f"bytes holds {self.layout.tokens_per_page:.3f} (choose a page size that is a multiple of "
                f"{self.layout.token_bytes} bytes)")
        return self._prefix

    # ----------------------------------------------------------------------------------------- swapping
    def swap_out(self, seq: int) -> int:
        """Copy the sequence's private pages to swap space and return them to the pool; pages it shares stay
        mapped. The sequence keeps its id and addresses; returns the bytes swapped."""
        slot = self._live_slot(seq)
        if self._swap is None:
            raise SwapSpaceFullError("this cache has no swap space (create it with swap_bytes=...)")
        idx = self.layout.page_slots(slot, 0, self._mapped[slot])
        counts = self._range.refcounts_at(idx)
        private = [ps for ps, c in zip(idx, counts) if c == 1]
        if any(self._range.pins_at(ps) for ps in private):
            raise ViewsAliveError(f"sequence {seq} is read through a live tensor view; drop the view first")
        chunks = self._swap.alloc(len(private))
        pages = self._range.pages_at(private)
        try:
            self._quiesce()  # kernels writing this sequence's K/V finish before the pages are read out
            for page, chunk in zip(pages, chunks):
                self.pool._pool.copy_to_host(page, self._swap.address(chunk))
            self.pool.backend.synchronize(0)  # the copies must land before the pages go back to the pool
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
            for page, chunk in zip(pages, chunks):
                self.pool._pool.copy_from_host(page, self._swap.address(chunk))
            self.pool.backend.synchronize(0)
        except BaseException:
            self._range.unmap(private)
            raise
        self._pages_mapped += len(private)
        self._map_calls += 1
        del self._swapped[slot]
        self._swap.release(chunks)

    def is_swapped(self, seq: int) -> bool:
        return self._slot(seq) in self._swapped

    def seq_len(self, seq: int) -> int:
        return self._len[self._slot(seq)]

    def slot(self, seq: int) -> int:
        """The slot (row of the batched view) that holds a sequence."""
        return self._slot(seq)

    @property
    def sequences(self) -> list[int]:
        """Ids of the live sequences."""
        return list(self._slot_of)

    # ----------------------------------------------------------------------------------------- views
    def kv(self, layer: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero-copy (K, V) views of shape [seq_len, num_kv_heads, head_dim] covering exactly the tokens
        present (strided for the interleaved layout). While a view lives, its pages stay mapped."""
        self._check_layer(layer)
        slot = self._live_slot(seq)
        n = self._len[slot]
        return self._view(layer, 0, slot, 0, n), self._view(layer, 1, slot, 0, n)

    def new_kv(self, layer: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Writable (K, V) views of the tokens the sequence's last extend() added (extend() made their pages
        private to this sequence, so writing through these views is safe)."""
        self._check_layer(layer)
        slot = self._live_slot(seq)
        # Never before the first writable token: after fork(), reorder() or cache_prefix() the tokens of the
        # last extend() may lie in pages shared with other sequences or the prefix index.
        start = max(min(self._new_from[slot], self._len[slot]), self._first_writable(slot))
        n = self._len[slot] - start
        return self._view(layer, 0, slot, start, n), self._view(layer, 1, slot, start, n)

    def writable_range(self, seq: int) -> tuple[int, int]:
        """(first, end): the tokens write() may write. Tokens in pages the sequence may share with others
        (after fork, reorder, a prefix hit or cache_prefix) are read-only until extend() or truncate()
        gives the sequence its own copy; the tokens the last extend() added are always writable."""
        slot = self._live_slot(seq)
        return self._first_writable(slot), self._len[slot]

    def _first_writable(self, slot: int) -> int:
        # The first token whose bytes all lie in pages at or past _shared_upto (private to this slot).
        lay = self.layout
        first = -(-self._shared_upto[slot] * lay.page_size // lay.token_bytes)
        return min(first, self._len[slot])

    def kv_batch(self, layer: int, seqs, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of several sequences as [B, length, num_kv_heads, head_dim] views. The sequences must sit
        in evenly spaced slots (allocate_many gives consecutive ones); length defaults to their common length
        and may not exceed the shortest."""
        self._check_layer(layer)
        seqs = list(seqs)
        if not seqs:
            raise InvalidArgumentError("kv_batch needs at least one sequence")
        slots = [self._live_slot(s) for s in seqs]
        step = slots[1] - slots[0] if len(slots) > 1 else 1
        if step <= 0 or any(b - a != step for a, b in zip(slots, slots[1:])):
            raise InvalidArgumentError(f"kv_batch needs sequences in evenly spaced increasing slots, got {slots}")
        lens = [self._len[s] for s in slots]
        if length is None:
            if len(set(lens)) != 1:
                raise InvalidArgumentError(f"sequences differ in length {lens}; pass length <= {min(lens)}")
            length = lens[0]
        if not 0 <= length <= min(lens):
            raise InvalidArgumentError(f"length {length} outside 0..{min(lens)} (shortest sequence)")
        lay = self.layout
        shape, strides, perm = lay.view_dims(length)
        shape, strides = [len(slots)] + shape, [step * lay.slot_stride] + strides
        perm = (0,) + tuple(p + 1 for p in perm)
        return tuple(self._make_view(lay.offset(layer, kv, slots[0]), shape, strides).permute(perm)
                     for kv in (0, 1))

    def batch(self, layer: int, seqs) -> BatchedKV:
        """Descriptor of one layer's K/V of `seqs` for decode kernels with per-sequence lengths."""
        self._check_layer(layer)
        slots = [self._live_slot(s) for s in seqs]
        lay = self.layout
        base = self._range.address
        return BatchedKV(
            k_ptr=base + lay.base_offset(layer, 0), v_ptr=base + lay.base_offset(layer, 1),
            slots=torch.tensor(slots, dtype=torch.int32, device=self.device),
            lengths=torch.tensor([self._len[s] for s in slots], dtype=torch.int32, device=self.device),
            slot_stride=lay.slot_stride, token_stride=lay.token_stride, head_stride=lay.head_stride,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, dtype=self.dtype, device=self.device, layout=lay.kind, owner=self._range)

    def write(self, layer: int, seq: int, k: torch.Tensor, v: torch.Tensor, start: int | None = None) -> None:
        """Copy k, v of shape [n, num_kv_heads, head_dim] into tokens start..start+n-1 of the sequence
        (default: its last n tokens). Only writable_range() may be written: tokens in pages the sequence
        may share with others raise ReadOnlyTokensError."""
        self._check_layer(layer)
        slot = self._live_slot(seq)
        check_kv(k, v, self.dtype, self.num_kv_heads, self.head_dim, self.device)
        n, length = k.shape[0], self._len[slot]
        if start is None:
            start = length - n
        if start < 0 or start + n > length:
            raise InvalidArgumentError(f"tokens {start}..{start + n - 1} outside the sequence's 0..{length - 1}; "
                                       "extend() first")
        if start < self._first_writable(slot):
            raise ReadOnlyTokensError(
                f"tokens before {self._first_writable(slot)} are read-only (they may share pages with other "
                f"sequences); write the tokens the last extend() added, or truncate() and extend() again")
        self._view(layer, 0, slot, start, n).copy_(k)
        self._view(layer, 1, slot, start, n).copy_(v)

    def _view(self, layer: int, kv: int, slot: int, start: int, n: int) -> torch.Tensor:
        shape, strides, perm = self.layout.view_dims(n)
        return self._make_view(self.layout.offset(layer, kv, slot, start), shape, strides).permute(perm)

    def _make_view(self, offset: int, shape, strides) -> torch.Tensor:
        self._check_open()
        return torch.from_dlpack(self._range.view(offset, shape, strides, self._dl_code, self._dl_bits))

    # ----------------------------------------------------------------------------------------- memory
    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over all layers."""
        return self.layout.bytes_per_token

    def static_bytes(self, num_seqs: int | None = None) -> int:
        """What reserving max_seq_len tokens for each of num_seqs sequences (default max_seqs) would take."""
        return (self.max_seqs if num_seqs is None else num_seqs) * self.max_seq_len * self.bytes_per_token

    def stats(self) -> CacheStats:
        self._check_open()
        runs = self.layout.runs
        mapped = sum(self._mapped) * runs
        dormant = sum(self._mapped[s] for s in self._dormant) * runs
        # Tokens in memory: swapped-out sequences do not count. With sharing, live can exceed mapped.
        live_tokens = sum(self._len[s] for s in self._slot_of.values() if s not in self._swapped)
        live_bytes = live_tokens * self.bytes_per_token
        pool = self.pool.stats()
        # Only pages below a slot's _shared_upto can be shared: count just those (unmapped ones read 0).
        maybe = [ps for slot, upto in enumerate(self._shared_upto) if upto
                 for ps in self.layout.page_slots(slot, 0, min(upto, self._mapped[slot]))]
        shared = sum(1 for c in self._range.refcounts_at(maybe) if c > 1) if maybe else 0
        swapped_pages = sum(len(p) for p, _ in self._swapped.values())
        mapped -= swapped_pages
        mapped_bytes = mapped * self.layout.page_size
        return CacheStats(
            layout=self.layout.kind, page_size=self.layout.page_size, sequences=len(self._slot_of),
            live_tokens=live_tokens, live_bytes=live_bytes, mapped_pages=mapped, mapped_bytes=mapped_bytes,
            dormant_pages=dormant, utilization=live_bytes / mapped_bytes if mapped_bytes else 1.0,
            tokens_per_page=self.layout.tokens_per_page, pool_free_pages=pool.free_pages,
            pool_used_pages=pool.used_pages, pages_mapped_total=self._pages_mapped,
            pages_unmapped_total=self._pages_unmapped, map_calls=self._map_calls, shared_pages=shared,
            cow_copies=self._cow_copies, prefix_hit_tokens=self._prefix_hits,
            prefix_cached_pages=len(self._prefix) * self.layout.runs if self._prefix else 0,
            swapped_sequences=len(self._swapped), swapped_bytes=swapped_pages * self.layout.page_size)

    def reclaim(self) -> int:
        """Unmap the pages of every freed slot now; returns pages returned to the pool."""
        self._check_open()
        return self._reclaim(self._reclaimable_pages())

    def _reclaimable_pages(self) -> int:
        if self._closed:
            return 0
        dormant = sum(self._mapped[s] for s in self._dormant) * self.layout.runs
        return dormant + sum(len(b.pages) for b in self._evictable_blocks())

    def _evictable_blocks(self):
        """Prefix blocks whose pages only the index holds (after dormant slots let go of theirs)."""
        if not self._prefix:
            return []
        refcount = self.pool._pool.refcount
        dormant = {p for s in self._dormant for p in self._range.pages_at(self.layout.page_slots(s, 0, self._mapped[s]))}
        return [b for b in self._prefix.eviction_order()
                if all(refcount(p) == 1 + (p in dormant) for p in b.pages)]

    def _reclaim(self, pages: int) -> int:
        """Unmap freed slots' pages, oldest first, until `pages` are freed. Slots still read through a
        live view are skipped."""
        if self._closed:  # a closed cache holds nothing to reclaim (its pool may still list it)
            return 0
        freed = 0
        for slot in list(self._dormant):
            if freed >= pages:
                break
            idx = self.layout.page_slots(slot, 0, self._mapped[slot])
            try:
                self._quiesce()
                self._range.unmap(idx)
            except ViewsAliveError:
                continue
            del self._dormant[slot]
            self._mapped[slot] = 0
            self._shared_upto[slot] = 0
            self._empty.append(slot)
            self._pages_unmapped += len(idx)
            freed += len(idx)
        if freed < pages and self._prefix:
            for block in self._evictable_blocks():
                if freed >= pages:
                    break
                self._prefix.remove(block)
                for p in block.pages:
                    self.pool._pool.decref(p)
                freed += len(block.pages)
        return freed

    def close(self) -> None:
        """Free every sequence and return every page to the pool (pages still read through live views
        return when the last such view is gone), then release the address range."""
        if self._closed:
            return
        if self._prefix:
            for block in self._prefix.clear():
                for p in block.pages:
                    self.pool._pool.decref(p)
        self._swapped.clear()
        self._swap = None
        self._quiesce()
        self._range.unmap_all_unpinned()
        self._range = None
        self._slot_of.clear()
        self._dormant.clear()
        self._closed = True
        self.pool._clients.discard(self)

    def __enter__(self) -> VirtualKVCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._slot_of)} sequences"
        return (f"VirtualKVCache(layers={self.num_layers}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"dtype={self.dtype}, layout={self.layout.kind}, device={self.device}, {state})")

    # ----------------------------------------------------------------------------------------- streams
    def use_stream(self, stream) -> None:
        """Declare a CUDA stream that runs kernels on this cache's views (the current stream is always
        included). Unmapping and remapping wait for every declared stream; see _quiesce."""
        if self.device.type == "cuda" and stream not in self._streams:
            self._streams.append(stream)

    def _quiesce(self) -> None:
        """Stream-safety protocol, enforced here: a page that kernels may still read is unmapped, remapped or
        handed to another sequence only after the work queued on the streams that use the cache completed.
        cuMemUnmap does not reliably wait for kernels still reading a page, so every path that unmaps or
        remaps (reclaim, truncate, free of shared pages, copy-on-write, reorder, swap out, close) calls this
        first. Mapping fresh pages (extend, swap in) needs no wait: no kernel can be reading them. Deferred
        reclamation keeps free() and the decode loop off this path. On the host, kernels are synchronous."""
        if self.device.type != "cuda":
            return
        torch.cuda.current_stream(self.device).synchronize()
        for stream in self._streams:
            stream.synchronize()

    # ----------------------------------------------------------------------------------------- checks
    def _check_open(self) -> None:
        if self._closed:
            raise CacheClosedError("the cache is closed")

    def _slot(self, seq) -> int:
        self._check_open()
        return lookup_sequence(self._slot_of, seq, self._next_id)

    def _live_slot(self, seq) -> int:
        slot = self._slot(seq)
        if slot in self._swapped:
            raise SequenceSwappedError(f"sequence {seq} is swapped out; swap_in() first")
        return slot

    def _check_layer(self, layer) -> None:
        check_layer(layer, self.num_layers)
