"""The engine's KV stores: one interface over the three ways the engine can hold K/V, so that the scheduler,
the runner and the benchmark see only the cache as the difference.

  vpaged  VirtualKVCache: each sequence contiguous, pages mapped as it grows, prefix caching, swap, forks
          share pages. Decode rows: the contiguous kernel; prefill chunks: SDPA on zero-copy views.
  paged   PagedKVCache: block tables (the classic design). Decode rows: the block-table kernel; prefill
          chunks: SDPA on K/V gathered from the blocks. No prefix caching, no swap (preemption recomputes).
  static  VirtualKVCache in which each admitted sequence maps a fixed slot of max_model_len tokens at
          admission and never shares: what static batching (a StaticCache) reserves. Same kernels as vpaged.

Each step the runner asks for a StepAttention (plan once, run per layer): the per-step metadata (slots,
lengths, block tables, views of the tokens to write) is built once, and every layer's attention call reads
it. Views of the cache live only for one step: a view pins pages, and pinned pages cannot be swapped out.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from ...kvcache.paged import PagedKVCache
from ...kvcache.virtual.cache import VirtualKVCache
from ...ops import decode_attention_contiguous, decode_attention_paged, write_kv

KV_KINDS = ("vpaged", "paged", "static")


class StepAttention:
    """One step's attention for the packed batch: rows 0..num_decodes-1 are decode tokens (one per
    sequence), then the prefill chunks. attend() is called once per layer by the attention function."""

    def __init__(self, num_decodes: int, prefills: list[tuple[int, int, int]], num_tokens: int):
        self.num_decodes = num_decodes
        self.prefills = prefills  # (row offset, start position, tokens) per prefill chunk
        self.num_tokens = num_tokens
        self.causal_masks = [_chunk_mask(start, n, None) for _, start, n in prefills]

    def attend(self, layer: int, query, key, value, scale) -> torch.Tensor:
        qt = query[0].transpose(0, 1)  # [T, H, D]
        self.write(layer, key[0].transpose(0, 1), value[0].transpose(0, 1))
        out = torch.empty(qt.shape, dtype=qt.dtype, device=qt.device)
        nd = self.num_decodes
        if nd:
            self.decode(layer, qt[:nd], scale, out[:nd])
        for i, (row, _start, n) in enumerate(self.prefills):
            k, v = self.prefill_kv(layer, i)  # [start + n, KVH, D]
            o = F.scaled_dot_product_attention(
                qt[row : row + n].transpose(0, 1).unsqueeze(0),
                _heads_first(k, qt.shape[1]),
                _heads_first(v, qt.shape[1]),
                attn_mask=self.causal_masks[i],
                is_causal=self.causal_masks[i] is None and n > 1,
                scale=scale,
            )
            out[row : row + n] = o[0].transpose(0, 1)
        return out.unsqueeze(0)

    # Filled in by each store.
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        raise NotImplementedError

    def decode(self, layer: int, q: torch.Tensor, scale, out: torch.Tensor) -> None:
        raise NotImplementedError

    def prefill_kv(self, layer: int, i: int):
        raise NotImplementedError


def _heads_first(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """[S, KVH, D] cached K or V as [1, heads, S, D], each KV head repeated for its query-head group.

    SDPA's fused CPU kernel takes only 4D inputs with as many K/V heads as query heads: grouped heads
    (enable_gqa) or 3D inputs fall back to the unfused math path, 2-5x slower on a prefill chunk here. The
    copy costs S x heads x D elements, small next to the chunk's attention."""
    kv = kv.transpose(0, 1)
    group = heads // kv.shape[0]
    if group > 1:
        kv = kv.repeat_interleave(group, dim=0)
    return kv.unsqueeze(0)


def _chunk_mask(start: int, n: int, device):
    """Causal mask of a chunk of n queries at positions start.. over keys 0..start+n-1 (bottom-right
    aligned); None when the chunk starts at 0 (plain causal)."""
    if start == 0:
        return None
    q = torch.arange(start, start + n, device=device)[:, None]
    return torch.arange(start + n, device=device)[None, :] <= q


class _VirtualStep(StepAttention):
    def __init__(self, store: VirtualStore, decodes, prefills, row_offsets, num_tokens):
        super().__init__(len(decodes), [(r, s, n) for r, (_, s, n) in zip(row_offsets, prefills)], num_tokens)
        cache = store.cache
        if store.device.type != "cpu":
            self.causal_masks = [m if m is None else m.to(store.device) for m in self.causal_masks]
        # Prefill chunks attend over one view of the sequence's whole prefix (split per layer in prefill_kv).
        self._prefill_views = [cache.kv_layers(seq.handle, 0, start + n) for seq, start, n in prefills]
        if decodes:
            slots = torch.tensor([seq.slot for seq in decodes], dtype=torch.int32, device=store.device)
            lengths = torch.tensor([seq.num_computed + 1 for seq in decodes], dtype=torch.int32, device=store.device)
            self._max_len = max(seq.num_computed + 1 for seq in decodes)
            self._batched = [dataclasses.replace(b, slots=slots, lengths=lengths) for b in store.layer_kv]
        # New tokens are written by one scatter per layer (vpaged.ops.write_kv) through a descriptor of every
        # sequence of the step: row i of the packed K/V goes to token positions[i] of sequence rows[i]. The
        # bounds come from the cache (writable_range: the tokens mapped, and not shared with another sequence),
        # and the extension checks every row against them before writing.
        seqs = list(decodes) + [seq for seq, _, _ in prefills]
        self._write = None
        if seqs:
            ranges = [cache.writable_range(seq.handle) for seq in seqs]
            positions = [seq.num_computed for seq in decodes]
            for _, start, n in prefills:
                positions.extend(range(start, start + n))
            counts = [1] * len(decodes) + [n for _, _, n in prefills]
            ends = [end for _, end in ranges]
            self._write = (
                torch.tensor([first for first, _ in ranges], dtype=torch.int32),
                torch.repeat_interleave(torch.arange(len(seqs), dtype=torch.int32), torch.tensor(counts)),
                torch.tensor(positions, dtype=torch.int32),
            )
            if not prefills and store.device.type == "cpu" and ends == lengths.tolist():
                self._write_kv = self._batched  # a decode-only step: the decode descriptors say the same
            else:
                # write_kv reads the slots and lengths on the host: CPU tensors also for a CUDA cache.
                slots = torch.tensor([seq.slot for seq in seqs], dtype=torch.int32)
                lengths = torch.tensor(ends, dtype=torch.int32)
                self._write_kv = [dataclasses.replace(b, slots=slots, lengths=lengths) for b in store.layer_kv]

    def write(self, layer, k, v):
        if self._write is None:
            return
        first, rows, positions = self._write
        write_kv(k, v, self._write_kv[layer], rows, positions, writable_from=first, check_mapped=False)

    def decode(self, layer, q, scale, out):
        decode_attention_contiguous(q, self._batched[layer], scale, out, max_len=self._max_len)

    def prefill_kv(self, layer, i):
        view = self._prefill_views[i]
        return view[layer, 0], view[layer, 1]


class VirtualStore:
    """vpaged and static: a VirtualKVCache (static: each sequence maps its whole reservation up front)."""

    def __init__(
        self,
        kind: str,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype,
        *,
        budget_bytes: int,
        swap_bytes: int,
        max_seqs: int,
        max_seq_len: int,
        device,
        page_size: int | None,
        layout: str,
        prefix_caching: bool,
    ):
        self.kind = kind
        self.static = kind == "static"
        self.cache = VirtualKVCache(
            num_layers,
            num_kv_heads,
            head_dim,
            dtype=dtype,
            max_seqs=max_seqs,
            max_seq_len=max_seq_len,
            device=device,
            capacity_bytes=budget_bytes,
            page_size=page_size,
            layout=layout,
            swap_bytes=0 if self.static else swap_bytes,
        )
        self.device = self.cache.device
        self.page_bytes = self.cache.pool.page_size
        lay = self.cache.layout
        # The prefix index needs pages that hold a whole number of tokens.
        self.prefix_caching = prefix_caching and not self.static and lay.page_size % lay.token_bytes == 0
        self.swap_capacity = 0 if self.static else swap_bytes
        self.layer_kv = [self.cache.batch(layer, []) for layer in range(num_layers)]  # pointers per layer
        self._swapped_bytes = 0  # swap space in use, tracked here so planning needs no stats() call
        self._swapped: dict[int, int] = {}  # handle -> bytes it holds in swap space
        self._reserved: dict[int, list[int]] = {}  # static: handle -> reservations for its other completions

    # capacity
    def total_pages(self) -> int:
        return self.cache.pool.capacity_pages

    def pages_for_tokens(self, tokens: int) -> int:
        lay = self.cache.layout
        return lay.pages_for(tokens) * lay.runs

    def free_slots(self) -> int:
        return self.cache.max_seqs - len(self.cache.sequences)

    def pages_available(self, need: int) -> bool:
        # The pool's free count is one call; reclaimable pages (freed slots, unused prefix blocks) are summed
        # only when the free ones do not suffice.
        return need <= self.cache.pool.free_pages() or need <= self.cache.pages_available()

    # sequences
    @property
    def slot_tokens(self) -> int:
        """static: tokens each sequence reserves at admission (its slot: the longest sequence allowed)."""
        return self.cache.max_seq_len

    @property
    def slot_pages(self) -> int:
        """static: pages one slot maps."""
        return self.pages_for_tokens(self.slot_tokens)

    def allocate(self, tokens: list[int], seats: int = 1) -> tuple[int, int]:
        """(handle, tokens already present from the prefix cache). static: maps a slot of slot_tokens for each
        of `seats` completions now (the others wait, unshared, for fork())."""
        if self.static:
            handles = []
            for _ in range(seats):
                handles.append(self.cache.allocate())
                self.cache.extend(handles[-1], self.slot_tokens)
            if seats > 1:
                self._reserved[handles[0]] = handles[1:]
            return handles[0], 0
        seq = self.cache.allocate(tokens=tokens) if self.prefix_caching else self.cache.allocate()
        return seq, self.cache.seq_len(seq)

    def slot(self, handle: int) -> int:
        return self.cache.slot(handle)

    def pages_needed(self, handles, n: int) -> int:
        return 0 if self.static else self.cache.pages_needed(handles, n)

    def extend(self, handles, n: int) -> None:
        if not self.static and handles:
            self.cache.extend_many(handles, n)

    def truncate(self, handle: int, length: int) -> None:
        self.cache.truncate(handle, length)

    def free(self, handle: int) -> None:
        self.cache.free(handle)
        for child in self._reserved.pop(handle, ()):
            self.cache.free(child)
        if handle in self._swapped:
            self._swapped_bytes -= self._swapped.pop(handle)

    def fork(self, handle: int, n: int, length: int) -> list[int]:
        """n sequences holding the first `length` tokens of `handle`: shared pages (vpaged), or copies into
        the reservations made at admission (static never shares)."""
        if not self.static:
            return self.cache.fork_many(handle, n)
        children = self._reserved.pop(handle)
        source = self.cache.kv_layers(handle, 0, length)
        for child in children:
            self.cache.kv_layers(child, 0, length).copy_(source)
        return children

    def cache_prefix(self, handle: int, tokens: list[int]) -> None:
        if self.prefix_caching:
            self.cache.cache_prefix(handle, tokens)

    # swapping
    def can_swap_out(self, handle: int) -> bool:
        if not self.swap_capacity:
            return False
        # Upper bound: every page of the sequence (shared pages stay mapped and take no swap space).
        need = self.pages_for_tokens(self.cache.seq_len(handle)) * self.page_bytes
        return need <= self.swap_capacity - self._swapped_bytes

    def swap_out(self, handle: int) -> int:
        moved = self.cache.swap_out(handle)
        self._swapped[handle] = moved
        self._swapped_bytes += moved
        return moved

    def swap_in(self, handle: int) -> None:
        self.cache.swap_in(handle)
        self._swapped_bytes -= self._swapped.pop(handle)

    # attention
    def step_attention(self, decodes, prefills, row_offsets, num_tokens) -> StepAttention:
        return _VirtualStep(self, decodes, prefills, row_offsets, num_tokens)

    # stats
    def memory(self) -> dict:
        s = self.cache.stats()
        pool = self.cache.pool.stats()
        return dict(
            live_tokens=s.live_tokens,
            live_bytes=s.live_bytes,
            held_bytes=s.mapped_bytes,
            high_water_bytes=pool.high_water_bytes,
            budget_bytes=pool.total_bytes,
            prefix_hit_tokens=s.prefix_hit_tokens,
            swapped_bytes=s.swapped_bytes,
        )

    def close(self) -> None:
        self.cache.close()


class _PagedStep(StepAttention):
    def __init__(self, store: PagedStore, decodes, prefills, row_offsets, num_tokens):
        super().__init__(len(decodes), [(r, s, n) for r, (_, s, n) in zip(row_offsets, prefills)], num_tokens)
        cache, bs = store.cache, store.cache.block_size
        if store.device.type != "cpu":
            self.causal_masks = [m if m is None else m.to(store.device) for m in self.causal_masks]
        self._cache = cache
        rows: list[int] = []  # pool row (block * block_size + offset) of each new token
        for seq in decodes:
            t = seq.num_computed
            rows.append(cache.blocks(seq.handle)[t // bs] * bs + t % bs)
        self._prefill_rows = []
        for seq, start, n in prefills:
            table = torch.tensor(cache.blocks(seq.handle), dtype=torch.int64)
            pos = torch.arange(start + n)
            token_rows = (table[pos // bs] * bs + pos % bs).to(store.device)
            self._prefill_rows.append(token_rows)
            rows.extend(token_rows[start:].tolist())
        self._rows = torch.tensor(rows, dtype=torch.int64, device=store.device)
        if decodes:
            handles = [seq.handle for seq in decodes]
            self._max_len = max(seq.num_computed + 1 for seq in decodes)
            width = -(-self._max_len // bs)
            self._tables = cache.block_tables(handles, width)
            self._lengths = torch.tensor(
                [seq.num_computed + 1 for seq in decodes], dtype=torch.int32, device=store.device
            )

    def write(self, layer, k, v):
        shape = (-1, k.shape[1], k.shape[2])
        self._cache.key_caches[layer].view(shape).index_copy_(0, self._rows, k)
        self._cache.value_caches[layer].view(shape).index_copy_(0, self._rows, v)

    def decode(self, layer, q, scale, out):
        decode_attention_paged(
            q,
            self._cache.key_caches[layer],
            self._cache.value_caches[layer],
            self._tables,
            self._lengths,
            scale,
            out,
            max_len=self._max_len,
        )

    def prefill_kv(self, layer, i):
        rows = self._prefill_rows[i]
        k_pool, v_pool = self._cache.key_caches[layer], self._cache.value_caches[layer]
        shape = (-1, k_pool.shape[2], k_pool.shape[3])
        return k_pool.view(shape).index_select(0, rows), v_pool.view(shape).index_select(0, rows)


class PagedStore:
    """paged: a PagedKVCache of block_size-token blocks (no prefix caching, no swap)."""

    kind = "paged"
    prefix_caching = False
    static = False
    swap_capacity = 0

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype,
        *,
        budget_bytes: int,
        max_seqs: int,
        max_seq_len: int,
        device,
        block_size: int = 16,
    ):
        self.cache = PagedKVCache(
            num_layers,
            num_kv_heads,
            head_dim,
            dtype=dtype,
            max_seqs=max_seqs,
            max_seq_len=max_seq_len,
            device=device,
            capacity_bytes=budget_bytes,
            block_size=block_size,
        )
        self.device = self.cache.device
        self.page_bytes = self.cache.block_bytes
        self._high_water_blocks = 0

    def total_pages(self) -> int:
        return self.cache.num_blocks

    def pages_for_tokens(self, tokens: int) -> int:
        return -(-tokens // self.cache.block_size)

    def free_slots(self) -> int:
        return self.cache.max_seqs - len(self.cache.sequences)

    def pages_available(self, need: int) -> bool:
        return need <= self.cache.pages_available()

    def allocate(self, tokens, seats: int = 1):
        return self.cache.allocate(), 0

    def slot(self, handle: int) -> int:
        return -1

    def pages_needed(self, handles, n: int) -> int:
        return self.cache.pages_needed(handles, n)

    def extend(self, handles, n: int) -> None:
        if handles:
            self.cache.extend_many(handles, n)
            used = self.cache.num_blocks - self.cache.pages_available()
            self._high_water_blocks = max(self._high_water_blocks, used)

    def truncate(self, handle, length):  # not reached: no prefix hits
        raise NotImplementedError

    def free(self, handle: int) -> None:
        self.cache.free(handle)

    def fork(self, handle: int, n: int, length: int) -> list[int]:
        return [self.cache.fork(handle) for _ in range(n)]

    def cache_prefix(self, handle, tokens) -> None:
        pass

    def can_swap_out(self, handle) -> bool:
        return False

    def step_attention(self, decodes, prefills, row_offsets, num_tokens) -> StepAttention:
        return _PagedStep(self, decodes, prefills, row_offsets, num_tokens)

    def memory(self) -> dict:
        c = self.cache
        used = c.num_blocks - c.pages_available()
        live = sum(c.seq_len(s) for s in c.sequences)
        held = used * c.block_bytes
        return dict(
            live_tokens=live,
            live_bytes=live * c.bytes_per_token,
            held_bytes=held,
            high_water_bytes=self._high_water_blocks * c.block_bytes,
            budget_bytes=c.num_blocks * c.block_bytes,
            prefix_hit_tokens=0,
            swapped_bytes=0,
        )

    def close(self) -> None:
        self.cache.close()
