"""VirtualStore (kv="vpaged"): a VirtualKVCache, each sequence contiguous in its slot, pages mapped as it grows.

Prefix caching (full prompt pages computed before are mapped again), swap to host memory, and forks that
share pages. Decode rows run the contiguous kernel, and on the CPU so do the query tokens of short prefill chunks
(stores/attention.py: kernel_chunks); longer prefill chunks run SDPA on zero-copy views of the cache.
StaticStore (static.py) is the same cache with each sequence's whole slot mapped at admission.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from ...kvcache import VirtualCacheConfig, VirtualKVCache
from ...kvcache.geometry import KVGeometry
from ...ops import DecodePlan, WritePlan, decode_unsupported
from .attention import StepAttention, decodes_as_prefills, kernel_chunks, prefill_rows
from .base import Allocation, StoreMemory

if TYPE_CHECKING:
    from ..config import EngineConfig


def store_layout(layout: str, quantized: bool) -> str:
    """The VirtualKVCache layout a store builds: `layout`, or for "auto" per_layer on K/V in the model's dtype
    and interleaved on a quantized format.

    Why interleaved for int8 / fp8: every page run of a sequence ends in a partly filled page, and per_layer has
    2 x layers runs. At one byte per element each of them holds twice the tokens, so that rounding costs a
    quantized sequence twice the share of its bytes: on bench_kv_quant's engine workload (8 runs, 64 KiB pages,
    ~1.3K-token requests) int8 / fp8 held 10 requests at once against bf16's 6 (1.67x) where their bytes allow
    1.94x / 2x; one run per sequence holds 11 / 12. What per_layer buys (dense K/V views that SDPA reads
    faster) does not apply: a quantized cache's prefill chunks dequantize the rows they read into new tensors,
    and the decode kernels take any token stride."""
    if layout != "auto":
        return layout
    return "interleaved" if quantized else "per_layer"


class VirtualStep(StepAttention):
    """A step over a VirtualKVCache: one scatter per layer writes the new K/V, decode rows run the step's
    DecodePlan (vpaged.ops), prefill chunks read views of their sequence's prefix."""

    def __init__(self, store: VirtualStore, decodes, prefills, row_offsets, num_tokens):
        # On the CPU the decode kernel also takes the short prefill chunks (attention.kernel_chunks).
        kernel_takes = store.device.type == "cpu" and store.decode_unsupported is None
        taken = kernel_chunks(prefills, store.kv_bytes_per_token) if kernel_takes else 0
        super().__init__(len(decodes), prefill_rows(row_offsets, prefills), num_tokens, store.device, taken)
        cache = store.cache
        self._kv_format, self._kv_scales = store.kv_format, cache.kv_scales
        self._value_dims = (cache.head_dim, cache.v_head_dim)
        # The other prefill chunks attend over one view of the sequence's whole prefix (split per layer in
        # prefill_kv).
        self._prefill_views = [
            None if i < taken else cache.kv_layers(seq.handle, 0, start + n)
            for i, (seq, start, n) in enumerate(prefills)
        ]
        # The kernel's rows: one plan for the step from the cache's own rows (slots), run per layer. A decode row
        # attends over its tokens and the new one (a static slot holds more); a taken chunk's query token at
        # position p over tokens 0..p, its own included (its K/V are written before the kernel runs).
        self._decode = None
        if self.kernel_rows:
            handles = [seq.handle for seq in decodes]
            lengths = [seq.num_computed + 1 for seq in decodes]
            for seq, start, n in prefills[:taken]:
                handles += [seq.handle] * n
                lengths += range(start + 1, start + n + 1)
            self._decode = DecodePlan.build(cache, handles, lengths)
        # New tokens are written by one scatter per layer (vpaged.ops.WritePlan) through a descriptor of every
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
            # write_kv reads the slots and lengths on the host: CPU tensors also for a CUDA cache. One WritePlan for
            # every layer: the rows and positions are checked once a step, not once a layer.
            slots = torch.tensor([seq.slot for seq in seqs], dtype=torch.int32)
            lengths = torch.tensor(ends, dtype=torch.int32)
            self._write = WritePlan(
                [dataclasses.replace(b, slots=slots, lengths=lengths) for b in store.layer_kv],
                torch.repeat_interleave(torch.arange(len(seqs), dtype=torch.int32), torch.tensor(counts)),
                torch.tensor(positions, dtype=torch.int32),
                writable_from=torch.tensor([first for first, _ in ranges], dtype=torch.int32),
                check_mapped=False,
            )

    def write(self, layer, k, v):
        if self._write is not None:
            self._write.write(layer, k, v)

    def decode(self, layer, q, scale, out):
        self._decode.run(layer, q, scale, out)

    def prefill_kv(self, layer, i):
        view = self._prefill_views[i]
        fmt = self._kv_format
        if fmt is None:
            return view[layer, 0], view[layer, 1]
        # A quantized cache: only what this chunk reads is dequantized (the rows of its sequence's prefix).
        scales = None if self._kv_scales is None else self._kv_scales[layer]
        dim, v_dim = self._value_dims
        return fmt.dequantize_kv(view[layer, 0], dim, scales, 0), fmt.dequantize_kv(view[layer, 1], v_dim, scales, 1)


class VirtualStore:
    """kv="vpaged": a VirtualKVCache with prefix caching and swap space (see the module docstring).

    `cache` is the VirtualKVCache itself, public for tests and tools that inspect it; the engine goes through
    the KVStore calls only."""

    kind = "vpaged"

    def __init__(
        self,
        config: EngineConfig,
        geometry: KVGeometry,
        max_seq_len: int,
        *,
        swap_bytes: int | None = None,
        prefix_caching: bool | None = None,
        weights: str = "",
    ):
        """swap_bytes / prefix_caching: the config's unless given (StaticStore turns both off); weights: the
        model weights' identity, for the config's prefix_store."""
        options = config.store  # a VirtualStoreConfig (or StaticStoreConfig: then both are given)
        swap_bytes = options.swap_bytes if swap_bytes is None else swap_bytes
        prefix_caching = options.enable_prefix_caching if prefix_caching is None else prefix_caching
        self.cache = VirtualKVCache(
            geometry,
            VirtualCacheConfig(
                max_seqs=config.scheduler.max_cache_seqs,
                max_seq_len=max_seq_len,
                device=config.model.device,
                capacity_bytes=options.kv_budget_bytes,
                page_size=options.page_size,
                layout=store_layout(options.layout, geometry.quantized),
                swap_bytes=swap_bytes,
                kv_scales=options.kv_scales,
                eviction_policy=getattr(options, "eviction_policy", "lru"),  # StaticStoreConfig: no prefix cache
                reclaim_order=getattr(options, "reclaim_order", "dormant_first"),
                shared_budget=options.shared_budget,
                member_name=options.shared_budget_member or "",
                prefix_store=getattr(options, "prefix_store", None),
                prefix_store_weights=weights if getattr(options, "prefix_store", None) else "",
                prefix_store_pages=getattr(options, "prefix_store_pages", None),
                prefix_store_map=getattr(options, "prefix_store_map", True),
            ),
        )
        self.device = self.cache.device
        self.page_bytes = self.cache.pool.page_size
        # Prefix blocks are pages of every run, whatever part of a token a page ends in (kvcache/virtual/prefix.py).
        self.prefix_caching = prefix_caching
        self.prefix_tokens_per_page = float(self.cache.layout.tokens_per_page) if prefix_caching else 0.0
        self.prefix_caching_off = None if prefix_caching else "turned off (enable_prefix_caching=False)"
        self.swap_capacity = swap_bytes
        self.layer_kv = [self.cache.batch(layer, []) for layer in range(geometry.num_layers)]  # pointers per layer
        first = self.layer_kv[0]
        # Why decode rows cannot go to the kernel on this device (None: they do); SDPA serves them then.
        self.decode_unsupported = decode_unsupported(
            self.device,
            geometry.dtype,
            geometry.head_dim,
            geometry.v_head_dim,
            (first.token_stride, first.head_stride, first.slot_stride, first.v_token_stride, first.v_head_stride),
            kv_dtype=geometry.kv_dtype,
        )
        # A quantized cache's prefill chunks attend over values made from its stored rows (format.dequantize).
        self.kv_format = self.cache.kv_format if self.cache.kv_format.quantized else None
        # What a token's K and V take in one layer (a quantized row's scale included): which prompt chunks the
        # decode kernel takes (attention.kernel_chunks).
        self.kv_bytes_per_token = geometry.bytes_per_token // geometry.num_layers
        self._swapped_bytes = 0  # swap space in use, tracked here so planning needs no stats() call
        self._swapped: dict[int, int] = {}  # handle -> bytes it holds in swap space

    # ---- capacity
    def total_pages(self) -> int:
        return self.cache.pool.capacity_pages

    def pages_for_tokens(self, tokens: int) -> int:
        """Pages `tokens` tokens of one sequence map (every run of the layout)."""
        lay = self.cache.layout
        return lay.pages_for(tokens) * lay.runs

    def pages_for_request(self, tokens: int, completions: int) -> int:
        # Forked completions share the prompt's pages: a request is checked against one sequence of its
        # full length (whether its completions fit together is the scheduler's to plan, step by step).
        return self.pages_for_tokens(tokens)

    def free_slots(self) -> int:
        return self.cache.max_seqs - len(self.cache.sequences)

    def pages_available(self, need: int) -> bool:
        # The pool's free count is one call; reclaimable pages (freed slots, unused prefix blocks) are summed
        # only when the free ones do not suffice. In a shared budget, can_take also counts what the budget
        # would grant and, when even that is short, asks the other members to give back for a later step.
        # Asks of the others are answered here first, between cache calls, rather than left to the budget's
        # thread alone (which may wait long for the client lock of a busy engine).
        pool = self.cache.pool
        pool.answer_budget_asks()
        return need <= pool.free_pages() or pool.can_take(need)

    def pages_needed(self, handles, n: int) -> int:
        return self.cache.pages_needed(handles, n)

    def budget_figures(self):
        return self.cache.pool.budget_figures()

    def label_budget_member(self, model: str) -> None:
        self.cache.pool.label_budget_member(model)

    def within_share(self, need: int) -> bool:
        pool = self.cache.pool
        cap = pool.admission_cap_pages()  # None outside a budget, or while no other member is starved
        return cap is None or pool.stats().used_pages - pool.reclaimable_pages() + need <= cap

    # ---- sequences
    def can_allocate(self, seats: int) -> bool:
        return self.free_slots() >= seats

    def allocate(self, tokens: list[int], seats: int = 1) -> Allocation:
        seq = self.cache.allocate(tokens=tokens) if self.prefix_caching else self.cache.allocate()
        return Allocation(seq, self.cache.seq_len(seq))

    def slot(self, handle: int) -> int:
        return self.cache.slot(handle)

    def extend(self, handles, n: int) -> None:
        if handles:
            self.cache.extend_many(handles, n)

    def truncate(self, handle: int, length: int) -> None:
        self.cache.truncate(handle, length)

    def free(self, handle: int) -> None:
        self.cache.free(handle)
        if handle in self._swapped:
            self._swapped_bytes -= self._swapped.pop(handle)

    def fork(self, handle: int, n: int, length: int) -> list[int]:
        """n sequences sharing every page of `handle` (copy-on-write); `length` is what it holds."""
        return self.cache.fork_many(handle, n)

    def cache_prefix(self, handle: int, tokens: list[int]) -> None:
        if self.prefix_caching:
            self.cache.cache_prefix(handle, tokens)

    # ---- swapping
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

    # ---- a step
    def step_attention(self, decodes, prefills, row_offsets, num_tokens) -> StepAttention:
        if self.decode_unsupported is not None:
            decodes, prefills, row_offsets = decodes_as_prefills(decodes, prefills, row_offsets)
        return VirtualStep(self, decodes, prefills, row_offsets, num_tokens)

    # ---- memory
    def memory(self) -> StoreMemory:
        s = self.cache.stats()
        pool = self.cache.pool.stats()
        return StoreMemory(
            live_tokens=s.live_tokens,
            live_bytes=s.live_bytes,
            held_bytes=s.mapped_bytes,
            high_water_bytes=pool.high_water_bytes,
            budget_bytes=pool.total_bytes,
            prefix_hit_tokens=s.prefix_hit_tokens,
            swapped_bytes=s.swapped_bytes,
            free_pages=pool.free_pages,
            used_pages=pool.used_pages,
            dormant_pages=s.dormant_bytes // pool.page_size,
            shared_pages=s.shared_pages,
        )

    def close(self) -> None:
        self.cache.close()
