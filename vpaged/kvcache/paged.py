"""PagedKVCache: the classic block-table KV cache (vLLM-style), the baseline VirtualKVCache is measured against.

K and V of each layer live in preallocated pools of fixed-size blocks, `[num_blocks, block_size, num_kv_heads,
head_dim]` ordinary torch tensors (V's last dim is v_head_dim where the model's values have their own head
size). A sequence owns a list of block ids (its block table), the same ids for
every layer, filled front to back; kernels find token t in block `table[t // block_size]` at row
`t % block_size`. Nothing is ever mapped or unmapped: the memory is all there from the start, and the price
of that flexibility is paid in the kernels (an indirection per block) and in the last, partly filled block.

Blocks are reference counted. fork() lets the child share every block of its parent; whoever then writes
into a shared block (extend into the shared partly filled last block, or a write over shared tokens)
first copies it (copy-on-write), so the other sequence never sees the change.

Lifecycle and errors mirror VirtualKVCache (allocate, extend, write, free, fork, stats); not thread-safe.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import (
    CacheClosedError,
    InvalidArgumentError,
    OutOfPagesError,
    SequenceTooLongError,
    ShapeError,
    SlotsExhaustedError,
)
from ..memory.device import normalize_device
from ..memory.pool import reserve_in_budget
from .base import KVCacheBase, KVPair
from .checks import check_kv, check_layer, check_positive_int, check_token_count, is_int, lookup_sequence, write_start
from .config import BLOCK_SIZES, PagedCacheConfig
from .geometry import KVGeometry, check_cache_args
from .records import BlockPools, PagedCacheStats

__all__ = ["BLOCK_SIZES", "PagedCacheConfig", "PagedKVCache"]


class PagedKVCache(KVCacheBase):
    """KV cache in fixed-size blocks addressed through per-sequence block tables.

    PagedKVCache(geometry, config): the model's KVGeometry (kvcache/geometry.py; a quantized kv_dtype makes
    the pools hold bytes, an int8 row's scale after it: write() quantizes, kv() gives QuantizedKV) and a
    PagedCacheConfig (what it maps, the block pool's size and block size, where it lives: kvcache/config.py).
    """

    def __init__(self, geometry: KVGeometry, config: PagedCacheConfig):
        geometry, config = check_cache_args(self, geometry, config, PagedCacheConfig)
        self.config = c = config
        self._init_shape(geometry, c)
        self.device = normalize_device(c.device)
        self.block_size = block_size = c.block_size
        num_blocks = c.num_blocks if c.num_blocks is not None else int(c.capacity_bytes) // self.block_bytes
        if num_blocks <= 0:
            raise InvalidArgumentError(
                f"the pool needs at least one block of {self.block_bytes} bytes, got capacity_bytes="
                f"{c.capacity_bytes!r}"
            )
        self.num_blocks = num_blocks
        self.accounting_only = bool(c.accounting_only)
        # Block pools are reserved whole, up front: in a shared budget they hold all their bytes as a
        # guaranteed share (there is nothing to give back), through an accounting-only member.
        self.budget_share = None
        if c.shared_budget is not None:
            self.budget_share = reserve_in_budget(
                c.shared_budget, num_blocks * self.block_bytes, c.member_name or "paged-kv"
            )
        # The pools hold stored rows: values of dtype, or bytes of a quantized format (scales included).
        self._row_dims = self.geometry.storage_dims()[:2]
        store = self.kv_format.storage_dtype
        shape = (num_blocks, block_size, self.num_kv_heads, self._row_dims[0])
        pools = 0 if self.accounting_only else self.num_layers
        # torch.empty: on the host, untouched pages of a large allocation cost no RAM until written.
        self.key_caches = [torch.empty(shape, dtype=store, device=self.device) for _ in range(pools)]
        v_shape = (num_blocks, block_size, self.num_kv_heads, self._row_dims[1])
        self.value_caches = [torch.empty(v_shape, dtype=store, device=self.device) for _ in range(pools)]
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out the lowest id first
        self._ref = [0] * num_blocks
        self._blocks: dict[int, list[int]] = {}  # live sequence -> its block table
        self._len: dict[int, int] = {}
        self._next_id = 0
        self._cow_copies = 0
        self._closed = False

    # ----------------------------------------------------------------------------------------- geometry
    @property
    def block_bytes(self) -> int:
        return self.block_size * self.bytes_per_token

    @property
    def max_blocks_per_seq(self) -> int:
        """Width of a full block table."""
        return -(-self.max_seq_len // self.block_size)

    # ----------------------------------------------------------------------------------------- lifecycle
    def allocate(self, tokens: Sequence[int] | None = None) -> int:
        """A new empty sequence (no blocks yet); returns its id. tokens (a prompt's ids, as VirtualKVCache
        takes them to find a cached prefix) find nothing here: this cache keeps no prefix index, so the
        sequence starts empty whatever they are."""
        return self.allocate_many(1)[0]

    def allocate_many(self, n: int) -> list[int]:
        """n new empty sequences (all or, when too few may be live, none)."""
        self._check_open()
        check_positive_int("n", n)
        if len(self._blocks) + n > self.max_seqs:
            raise SlotsExhaustedError(
                f"{n} more sequence(s) would exceed max_seqs={self.max_seqs} ({len(self._blocks)} live)"
            )
        ids = list(range(self._next_id, self._next_id + n))
        self._next_id += n
        for seq in ids:
            self._blocks[seq] = []
            self._len[seq] = 0
        return ids

    def free(self, seq: int) -> None:
        """End a sequence; blocks no other sequence references go back to the free list."""
        blocks = self._table(seq)
        for blk in blocks:
            self._decref(blk)
        del self._blocks[seq], self._len[seq]

    def fork(self, seq: int) -> int:
        """A new sequence with the same tokens, sharing every block (copy-on-write); returns its id."""
        blocks = self._table(seq)
        child = self.allocate()
        for blk in blocks:
            self._ref[blk] += 1
        self._blocks[child] = list(blocks)
        self._len[child] = self._len[seq]
        return child

    def extend(self, seq: int, n: int) -> None:
        """Grow a sequence by n tokens, taking the blocks they need (and copying a shared partly filled last
        block first). Their K/V are then to be written with write(). Raises OutOfPagesError with nothing
        changed when the pool has too few free blocks."""
        self.extend_many([seq], n)

    def extend_many(self, seqs: Sequence[int], n: int = 1) -> None:
        """extend() for several sequences at once (a decode step): all of them or, on error, none."""
        plan, needed = self._plan_extend(seqs, n)
        self._check_free(needed)
        for seq, grow, cow in plan:
            table = self._blocks[seq]
            if cow:
                table[-1] = self._copy_on_write(table[-1])
            table.extend(self._take(grow))
            self._len[seq] += n

    def _plan_extend(self, seqs, n: int) -> tuple[list[tuple[int, int, bool]], int]:
        """What extend_many(seqs, n) does, changing nothing: per sequence (seq, new blocks, copy the shared
        partly filled last block first), and the blocks that takes in all. pages_needed() reads the same plan,
        so a scheduler's count is what the extend takes."""
        self._check_open()
        check_token_count(n)
        seqs = list(seqs)
        tables = [self._table(s) for s in seqs]
        if len(set(seqs)) != len(seqs):
            raise InvalidArgumentError("a sequence is listed twice")
        plan: list[tuple[int, int, bool]] = []
        if n == 0:
            return plan, 0
        bs = self.block_size
        needed = 0
        for seq, table in zip(seqs, tables):
            old = self._len[seq]
            new_len = old + n
            if new_len > self.max_seq_len:
                raise SequenceTooLongError(
                    f"sequence {seq} would hold {new_len} tokens, more than max_seq_len={self.max_seq_len}"
                )
            grow = -(-new_len // bs) - len(table)
            cow = old % bs != 0 and self._ref[table[-1]] > 1  # new tokens land in a shared block
            plan.append((seq, grow, cow))
            needed += grow + cow
        return plan, needed

    def truncate(self, seq: int, new_len: int) -> None:
        """Drop the tokens from new_len on (as VirtualKVCache.truncate). Blocks wholly past the new length leave
        the table and go back to the free list unless another sequence still references them; a partly kept
        last block stays (shared or not: a later extend or write copies a shared one first)."""
        table = self._table(seq)
        old = self._len[seq]
        if not is_int(new_len) or not 0 <= new_len <= old:
            raise InvalidArgumentError(f"new_len must be an int in 0..{old}, got {new_len!r}")
        keep = -(-new_len // self.block_size)
        for blk in table[keep:]:
            self._decref(blk)
        del table[keep:]
        self._len[seq] = new_len

    def pages_needed(self, seqs: Sequence[int], n: int = 1) -> int:
        """Blocks that extend_many(seqs, n) would take: new blocks plus copy-on-write copies of a shared
        partly filled last block. Changes nothing (a scheduler plans with it and pages_available())."""
        return self._plan_extend(seqs, n)[1]

    def pages_available(self) -> int:
        """Free blocks."""
        self._check_open()
        return len(self._free)

    def seq_len(self, seq: int) -> int:
        self._table(seq)
        return self._len[seq]

    @property
    def sequences(self) -> list[int]:
        """Ids of the live sequences."""
        return list(self._blocks)

    def blocks(self, seq: int) -> list[int]:
        """The sequence's block ids, in token order (a copy)."""
        return list(self._table(seq))

    def block_refcount(self, block: int) -> int:
        """How many sequences reference a block (0: free)."""
        if not is_int(block) or not 0 <= block < self.num_blocks:
            raise InvalidArgumentError(f"block {block!r} outside 0..{self.num_blocks - 1}")
        return self._ref[block]

    # ----------------------------------------------------------------------------------------- data
    def write(self, layer: int, seq: int, k: torch.Tensor, v: torch.Tensor, start: int | None = None) -> None:
        """Copy k, v of shape [n, num_kv_heads, head_dim] into tokens start..start+n-1 of the sequence
        (default: its last n tokens, i.e. those the last extend() added), through a slot mapping like vLLM's
        reshape_and_cache. Shared blocks in that range are copied first (OutOfPagesError, nothing changed,
        when no block is free for that)."""
        self._check_layer(layer)
        table = self._table(seq)
        self._check_kv(k, v)
        n = k.shape[0]
        start = write_start(start, n, self._len[seq])
        if n == 0:
            return
        bs = self.block_size
        first, last = start // bs, (start + n - 1) // bs
        shared = [i for i in range(first, last + 1) if self._ref[table[i]] > 1]
        self._check_free(len(shared))
        for i in shared:
            table[i] = self._copy_on_write(table[i])
        tokens = torch.arange(start, start + n)
        blocks = torch.tensor(table[first : last + 1], dtype=torch.int64)[tokens // bs - first]
        self.write_rows(layer, (blocks * bs + tokens % bs).to(self.device), k, v)

    def write_many(self, layer: int, seqs, k: torch.Tensor, v: torch.Tensor) -> None:
        """The last token of each sequence in one copy (a decode step, after extend_many(seqs, 1)):
        k, v are [len(seqs), num_kv_heads, head_dim / v_head_dim], row i for seqs[i]. Copy-on-write as in write()."""
        self._check_layer(layer)
        seqs = list(seqs)
        tables = [self._table(s) for s in seqs]
        self._check_kv(k, v)
        if k.shape[0] != len(seqs):
            raise ShapeError(f"k has {k.shape[0]} rows for {len(seqs)} sequences")
        if len(set(seqs)) != len(seqs):
            raise InvalidArgumentError("a sequence is listed twice")
        bs = self.block_size
        for seq in seqs:
            if self._len[seq] == 0:
                raise InvalidArgumentError(f"sequence {seq} holds no tokens; extend() first")
        last = [(self._len[s] - 1) // bs for s in seqs]
        shared = [(t, i) for t, i in zip(tables, last) if self._ref[t[i]] > 1]
        self._check_free(len(shared))
        for table, i in shared:
            table[i] = self._copy_on_write(table[i])
        slots = [t[i] * bs + (self._len[s] - 1) % bs for s, t, i in zip(seqs, tables, last)]
        self.write_rows(layer, torch.tensor(slots, dtype=torch.int64, device=self.device), k, v)

    def write_rows(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v (values, [n, heads, dim]) in pool rows `slots` (block * block_size + offset; int64 on the
        cache's device) of one layer, quantized for a quantized format. No block-table or copy-on-write
        checks: for callers that computed the rows from the tables (write(), the serving store's step)."""
        # A block pool viewed as [num_blocks * block_size, heads, dim] rows: token slot s is row s.
        fmt, (k_dim, v_dim) = self.kv_format, self._row_dims
        if fmt.quantized:
            scales = self.kv_scales[layer] if self.kv_scales is not None else None
            k, v = fmt.quantize_kv(k, scales, 0), fmt.quantize_kv(v, scales, 1)
        self.key_caches[layer].view(-1, self.num_kv_heads, k_dim).index_copy_(0, slots, k)
        self.value_caches[layer].view(-1, self.num_kv_heads, v_dim).index_copy_(0, slots, v)

    def kv(self, layer: int, seq: int) -> KVPair:
        """(K, V) of the sequence as [seq_len, num_kv_heads, head_dim / v_head_dim] tensors gathered from its blocks
        (copies, unlike VirtualKVCache.kv(): a block table has no strided view). A quantized cache gives
        QuantizedKV records of the gathered rows (dequantized_kv(): values)."""
        self._check_layer(layer)
        self._check_data()
        table = self._table(seq)
        n = self._len[seq]
        idx = torch.tensor(table, dtype=torch.int64, device=self.device)
        (k_dim, v_dim), fmt = self._row_dims, self.kv_format
        k = self.key_caches[layer].index_select(0, idx).view(-1, self.num_kv_heads, k_dim)[:n]
        v = self.value_caches[layer].index_select(0, idx).view(-1, self.num_kv_heads, v_dim)[:n]
        if not fmt.quantized:
            return k, v
        scales = self.kv_scales[layer] if self.kv_scales is not None else None
        return fmt.values(k, self.head_dim, scales, 0), fmt.values(v, self.v_head_dim, scales, 1)

    def gather_rows(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V values ([n, heads, dim], copies in the model dtype) of pool rows `slots` of one layer."""
        (k_dim, v_dim), fmt = self._row_dims, self.kv_format
        k = self.key_caches[layer].view(-1, self.num_kv_heads, k_dim).index_select(0, slots)
        v = self.value_caches[layer].view(-1, self.num_kv_heads, v_dim).index_select(0, slots)
        if not fmt.quantized:
            return k, v
        scales = self.kv_scales[layer] if self.kv_scales is not None else None
        return fmt.dequantize_kv(k, self.head_dim, scales, 0), fmt.dequantize_kv(v, self.v_head_dim, scales, 1)

    def dequantized_kv(self, layer: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """kv() as values in the model dtype."""
        k, v = self.kv(layer, seq)
        return (k.dequantize(), v.dequantize()) if self.kv_format.quantized else (k, v)

    def block_tables(self, seqs, width: int | None = None) -> torch.Tensor:
        """int32 [len(seqs), width] block tables on the cache's device, padded with 0 (kernels read only the
        blocks below each length). width defaults to max_blocks_per_seq (a fixed shape)."""
        seqs = list(seqs)
        tables = [self._table(s) for s in seqs]
        if width is None:
            width = self.max_blocks_per_seq
        longest = max((len(t) for t in tables), default=0)
        if not isinstance(width, int) or width < longest:
            raise InvalidArgumentError(f"width {width!r} is smaller than the longest block table ({longest})")
        rows = [t + [0] * (width - len(t)) for t in tables]
        return torch.tensor(rows, dtype=torch.int32, device=self.device).reshape(len(seqs), width)

    def tables_and_lengths(self, seqs) -> tuple[list[list[int]], list[int]]:
        """(block tables, lengths) of live sequences as plain lists (copies): what block_tables() and
        lengths() hold, without building tensors (decode kernels on the CPU take them so, per step)."""
        self._check_open()
        blocks, next_id = self._blocks, self._next_id
        tables = [list(lookup_sequence(blocks, s, next_id)) for s in seqs]
        lens = self._len
        return tables, [lens[s] for s in seqs]

    def decode_source(self, layer: int) -> BlockPools:
        """The layer's block pools and the geometry they must have, for a decode kernel's plan (vpaged.ops)."""
        self._check_open()
        check_layer(layer, self.num_layers)
        if self.accounting_only:
            raise InvalidArgumentError("the cache is accounting-only: it keeps block tables but holds no K/V")
        return BlockPools(
            self.key_caches[layer],
            self.value_caches[layer],
            self.num_blocks,
            self.block_size,
            self.num_kv_heads,
            *self._row_dims,
            self.kv_format.storage_dtype,
            self.device,
            self.max_seq_len,
            kv_format=self.kv_format if self.kv_format.quantized else None,
            kv_scales=self.kv_scales[layer] if self.kv_scales is not None else None,
        )

    def decode_rows(self, seqs: Sequence[int]) -> tuple[list[list[int]], list[int]]:
        """Where a step's sequences are for a block-table kernel: (block tables, lengths)."""
        return self.tables_and_lengths(seqs)

    def lengths(self, seqs) -> torch.Tensor:
        """int32 [len(seqs)] sequence lengths on the cache's device."""
        return torch.tensor([self.seq_len(s) for s in seqs], dtype=torch.int32, device=self.device)

    # ----------------------------------------------------------------------------------------- memory
    def stats(self) -> PagedCacheStats:
        self._check_open()
        bs = self.block_size
        fill: dict[int, int] = {}
        for seq, table in self._blocks.items():
            n = self._len[seq]
            for i, blk in enumerate(table):
                fill[blk] = max(fill.get(blk, 0), min(bs, n - i * bs))
        used = self.num_blocks - len(self._free)
        stored = sum(fill.values())
        live_bytes = stored * self.bytes_per_token
        allocated = used * self.block_bytes
        return PagedCacheStats(
            block_size=bs,
            block_bytes=self.block_bytes,
            num_blocks=self.num_blocks,
            used_blocks=used,
            free_blocks=len(self._free),
            shared_blocks=sum(1 for r in self._ref if r > 1),
            sequences=len(self._blocks),
            live_tokens=sum(self._len.values()),
            stored_tokens=stored,
            live_bytes=live_bytes,
            allocated_bytes=allocated,
            pool_bytes=self.num_blocks * self.block_bytes,
            utilization=live_bytes / allocated if allocated else 1.0,
            cow_copies=self._cow_copies,
            stored_bytes=live_bytes,
            fragmentation_bytes=allocated - live_bytes,
            reserved_bytes=0,
            dormant_bytes=0,
        )

    def close(self) -> None:
        """Free every sequence and drop the block pools."""
        if self._closed:
            return
        self._blocks.clear()
        self._len.clear()
        self.key_caches, self.value_caches = [], []
        self.kernel_plans.clear()  # their parameters address memory that is gone
        if self.budget_share is not None:
            self.budget_share.leave_budget()
        self._closed = True

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._blocks)} sequences, {len(self._free)} free blocks"
        return (
            f"PagedKVCache({self.geometry.describe()}, block_size={self.block_size}, num_blocks={self.num_blocks}, "
            f"device={self.device}, {state})"
        )

    # ----------------------------------------------------------------------------------------- blocks
    def _check_free(self, needed: int) -> None:
        if needed > len(self._free):
            raise OutOfPagesError(
                f"out of blocks: {needed} block(s) of {self.block_bytes} bytes needed, {len(self._free)} free "
                f"of {self.num_blocks}; nothing was changed"
            )

    def _take(self, n: int) -> list[int]:
        taken = [self._free.pop() for _ in range(n)]
        for blk in taken:
            self._ref[blk] = 1
        return taken

    def _decref(self, blk: int) -> None:
        self._ref[blk] -= 1
        if self._ref[blk] == 0:
            self._free.append(blk)

    def _copy_on_write(self, blk: int) -> int:
        """A private copy of a shared block, all layers; the caller swaps it into its table."""
        (new,) = self._take(1)
        for cache in (*self.key_caches, *self.value_caches):
            cache[new].copy_(cache[blk])
        self._decref(blk)
        self._cow_copies += 1
        return new

    # ----------------------------------------------------------------------------------------- checks
    def _check_open(self) -> None:
        if self._closed:
            raise CacheClosedError("the cache is closed")

    def _table(self, seq) -> list[int]:
        self._check_open()
        return lookup_sequence(self._blocks, seq, self._next_id)

    def _check_layer(self, layer) -> None:
        check_layer(layer, self.num_layers)

    def _check_data(self) -> None:
        if self.accounting_only:
            raise InvalidArgumentError("the cache is accounting-only: it keeps block tables but holds no K/V")

    def _check_kv(self, k, v) -> None:
        self._check_data()
        check_kv(k, v, self.dtype, self.num_kv_heads, self.head_dim, self.device, self.v_head_dim)
