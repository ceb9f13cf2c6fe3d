"""VirtualKVCache: every sequence's KV in one contiguous virtual range, pages mapped on demand.

A sequence is a slot of max_seq_len tokens in each region (see layout.py). extend() maps the pages its
new tokens need; kv() hands out zero-copy torch views of exactly the tokens present, so standard kernels
(SDPA, FlashAttention) run on them unchanged. free() keeps the slot's pages mapped for the next allocate()
(deferred reclamation: no map calls in a steady workload); the pool takes them back when it runs low.

Not thread-safe: one cache belongs to one scheduler thread. The pool under it is thread-safe.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from . import _C
from ._dtypes import dlpack_code, itemsize
from .device import normalize_device
from .errors import (CacheClosedError, DTypeError, InvalidArgumentError, LayerIndexError, OutOfPagesError,
                     SequenceTooLongError, ShapeError, SlotsExhaustedError, UnknownSequenceError)
from .layout import Layout
from .pool import PagePool, default_pool


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
    utilization: float  # live_bytes / mapped_bytes (1.0 when nothing is mapped)
    tokens_per_page: float  # fill granularity: tokens one page of one region holds
    pool_free_pages: int
    pool_used_pages: int
    pages_mapped_total: int  # pages mapped since creation (map work done)
    pages_unmapped_total: int
    map_calls: int  # calls into the range that mapped pages (one per extend that needed pages)


@dataclass(frozen=True)
class BatchedKV:
    """One layer's K and V of several sequences, for decode kernels that take per-sequence lengths.

    k_ptr / v_ptr address token 0 of slot 0; sequence i starts `slots[i] * slot_stride` elements further
    and holds `lengths[i]` valid tokens with `token_stride` elements between tokens, `head_dim` between
    heads. Only memory below each length is guaranteed mapped: a kernel must not read past it. Valid until
    one of the sequences is freed, truncated or swapped out.
    """

    k_ptr: int
    v_ptr: int
    slots: torch.Tensor  # int32 [B] on the cache's device
    lengths: torch.Tensor  # int32 [B] on the cache's device
    slot_stride: int
    token_stride: int
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
        layout: "per_layer" (dense per-layer views, fastest kernels) or "interleaved" (all layers of a token
            together: finer fill granularity, one map per page for all layers).
        page_size: bytes per page for a private/default pool (must match a given pool).
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype = torch.bfloat16,
                 max_seqs: int = 64, max_seq_len: int = 4096, device="cpu", pool: PagePool | None = None,
                 capacity_bytes: int | None = None, layout: str = "per_layer", page_size: int | None = None):
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
        self._next_id = 0
        self._pages_mapped = 0
        self._pages_unmapped = 0
        self._map_calls = 0
        self._closed = False
        pool._register(self)

    # ----------------------------------------------------------------------------------------- lifecycle
    def allocate(self) -> int:
        """A new empty sequence; returns its id. Reuses a freed slot's pages when one has them."""
        self._check_open()
        if self._dormant:
            slot, _ = self._dormant.popitem(last=True)  # most recently freed: its pages are warmest
        elif self._empty:
            slot = self._empty.pop()
        else:
            raise SlotsExhaustedError(f"all {self.max_seqs} sequence slots are in use")
        return self._bind(slot)

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
        return seq

    def free(self, seq: int) -> None:
        """End a sequence. Its pages stay mapped for the next allocate() until the pool needs them."""
        slot = self._slot(seq)
        del self._slot_of[seq]
        self._len[slot] = 0
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
        if not isinstance(n, int) or isinstance(n, bool):
            raise InvalidArgumentError(f"n must be an int, got {n!r}")
        if n < 0:
            raise InvalidArgumentError(f"n must be >= 0, got {n}")
        slots = [self._slot(s) for s in seqs]
        if len(set(slots)) != len(slots):
            raise InvalidArgumentError("a sequence is listed twice")
        page_slots: list[int] = []
        grown = []
        for seq, slot in zip(seqs, slots):
            new_len = self._len[slot] + n
            if new_len > self.max_seq_len:
                raise SequenceTooLongError(
                    f"sequence {seq} would hold {new_len} tokens, more than max_seq_len={self.max_seq_len}")
            need = self.layout.pages_for(new_len)
            if need > self._mapped[slot]:
                page_slots += self.layout.page_slots(slot, self._mapped[slot], need)
                grown.append((slot, need))
        if page_slots:
            self._map_new(page_slots)
            for slot, need in grown:
                self._mapped[slot] = need
        for slot in slots:
            self._len[slot] += n

    def _map_new(self, page_slots: list[int]) -> None:
        if not self.pool.ensure_free(len(page_slots)):
            s = self.pool.stats()
            raise OutOfPagesError(
                f"out of pages: {len(page_slots)} page(s) of {s.page_size} bytes needed, {s.free_pages} free "
                f"of {s.total_pages} (+{self.pool.reclaimable_pages()} reclaimable); nothing was changed")
        self._range.map_new(page_slots)
        self._pages_mapped += len(page_slots)
        self._map_calls += 1

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
        slot = self._slot(seq)
        n = self._len[slot]
        return self._view(layer, 0, slot, 0, n), self._view(layer, 1, slot, 0, n)

    def kv_batch(self, layer: int, seqs, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of several sequences as [B, length, num_kv_heads, head_dim] views. The sequences must sit
        in evenly spaced slots (allocate_many gives consecutive ones); length defaults to their common length
        and may not exceed the shortest."""
        self._check_layer(layer)
        seqs = list(seqs)
        if not seqs:
            raise InvalidArgumentError("kv_batch needs at least one sequence")
        slots = [self._slot(s) for s in seqs]
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
        shape = [len(slots), length, self.num_kv_heads, self.head_dim]
        strides = [step * lay.slot_stride, lay.token_stride, self.head_dim, 1]
        return tuple(self._make_view(lay.offset(layer, kv, slots[0]), shape, strides) for kv in (0, 1))

    def batch(self, layer: int, seqs) -> BatchedKV:
        """Descriptor of one layer's K/V of `seqs` for decode kernels with per-sequence lengths."""
        self._check_layer(layer)
        slots = [self._slot(s) for s in seqs]
        lay = self.layout
        base = self._range.address
        return BatchedKV(
            k_ptr=base + lay.base_offset(layer, 0), v_ptr=base + lay.base_offset(layer, 1),
            slots=torch.tensor(slots, dtype=torch.int32, device=self.device),
            lengths=torch.tensor([self._len[s] for s in slots], dtype=torch.int32, device=self.device),
            slot_stride=lay.slot_stride, token_stride=lay.token_stride, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, dtype=self.dtype, device=self.device, layout=lay.kind, owner=self._range)

    def write(self, layer: int, seq: int, k: torch.Tensor, v: torch.Tensor, start: int | None = None) -> None:
        """Copy k, v of shape [n, num_kv_heads, head_dim] into tokens start..start+n-1 of the sequence
        (default: its last n tokens, i.e. those the last extend() added)."""
        self._check_layer(layer)
        slot = self._slot(seq)
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise InvalidArgumentError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype != self.dtype:
                raise DTypeError(f"{name} has dtype {t.dtype}, the cache holds {self.dtype}")
            if t.dim() != 3 or tuple(t.shape[1:]) != (self.num_kv_heads, self.head_dim):
                raise ShapeError(f"{name} must be [n, {self.num_kv_heads}, {self.head_dim}], got {list(t.shape)}")
            if t.device != self.device:
                raise InvalidArgumentError(f"{name} is on {t.device}, the cache on {self.device}")
        if k.shape != v.shape:
            raise ShapeError(f"k {list(k.shape)} and v {list(v.shape)} differ in shape")
        n, length = k.shape[0], self._len[slot]
        if start is None:
            start = length - n
        if start < 0 or start + n > length:
            raise InvalidArgumentError(f"tokens {start}..{start + n - 1} outside the sequence's 0..{length - 1}; "
                                       "extend() first")
        self._view(layer, 0, slot, start, n).copy_(k)
        self._view(layer, 1, slot, start, n).copy_(v)

    def _view(self, layer: int, kv: int, slot: int, start: int, n: int) -> torch.Tensor:
        return self._make_view(self.layout.offset(layer, kv, slot, start), [n, self.num_kv_heads, self.head_dim],
                               [self.layout.token_stride, self.head_dim, 1])

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
        regions = self.layout.regions
        mapped = sum(self._mapped) * regions
        dormant = sum(self._mapped[s] for s in self._dormant) * regions
        live_tokens = sum(self._len[s] for s in self._slot_of.values())
        live_bytes = live_tokens * self.bytes_per_token
        mapped_bytes = mapped * self.layout.page_size
        pool = self.pool.stats()
        return CacheStats(
            layout=self.layout.kind, page_size=self.layout.page_size, sequences=len(self._slot_of),
            live_tokens=live_tokens, live_bytes=live_bytes, mapped_pages=mapped, mapped_bytes=mapped_bytes,
            dormant_pages=dormant, utilization=live_bytes / mapped_bytes if mapped_bytes else 1.0,
            tokens_per_page=self.layout.tokens_per_page, pool_free_pages=pool.free_pages,
            pool_used_pages=pool.used_pages, pages_mapped_total=self._pages_mapped,
            pages_unmapped_total=self._pages_unmapped, map_calls=self._map_calls)

    def reclaim(self) -> int:
        """Unmap the pages of every freed slot now; returns pages returned to the pool."""
        self._check_open()
        return self._reclaim(self._reclaimable_pages())

    def _reclaimable_pages(self) -> int:
        if self._closed:
            return 0
        return sum(self._mapped[s] for s in self._dormant) * self.layout.regions

    def _reclaim(self, pages: int) -> int:
        """Unmap freed slots' pages, oldest first, until `pages` are freed. Slots still read through a
        live view are skipped."""
        from .errors import ViewsAliveError

        freed = 0
        for slot in list(self._dormant):
            if freed >= pages:
                break
            idx = self.layout.page_slots(slot, 0, self._mapped[slot])
            try:
                self._range.unmap(idx)
            except ViewsAliveError:
                continue
            del self._dormant[slot]
            self._mapped[slot] = 0
            self._empty.append(slot)
            self._pages_unmapped += len(idx)
            freed += len(idx)
        return freed

    def close(self) -> None:
        """Free every sequence and return every page to the pool (pages still read through live views
        return when the last such view is gone), then release the address range."""
        if self._closed:
            return
        self._range.unmap_all_unpinned()
        self._range = None
        self._slot_of.clear()
        self._closed = True

    def __enter__(self) -> VirtualKVCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._slot_of)} sequences"
        return (f"VirtualKVCache(layers={self.num_layers}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"dtype={self.dtype}, layout={self.layout.kind}, device={self.device}, {state})")

    # ----------------------------------------------------------------------------------------- checks
    def _check_open(self) -> None:
        if self._closed:
            raise CacheClosedError("the cache is closed")

    def _slot(self, seq) -> int:
        self._check_open()
        try:
            return self._slot_of[seq]
        except (KeyError, TypeError):
            pass
        if isinstance(seq, int) and 0 <= seq < self._next_id:
            raise UnknownSequenceError(f"sequence {seq} has been freed")
        raise UnknownSequenceError(f"no sequence {seq!r} in this cache")

    def _check_layer(self, layer) -> None:
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < self.num_layers:
            raise LayerIndexError(f"layer {layer!r} outside 0..{self.num_layers - 1}")
