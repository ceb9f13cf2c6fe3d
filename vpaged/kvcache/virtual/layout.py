"""Where each token's K and V live inside a VirtualKVCache's virtual range.

per_layer:   2·num_layers regions (K and V of each layer), each of max_seqs slots; a sequence's K of one layer is
             a dense [len, kv_heads, head_dim] tensor. Page fill: page / (heads·dim·itemsize) tokens.
interleaved: one region of max_seqs slots; per token all layers' K and V side by side, so K of a layer is a
             strided view. Page fill: page / (2·layers·heads·dim·itemsize) tokens; one map serves all layers.
head_major:  like per_layer, but each head of a slot has its own run of pages, so a sequence's K of one layer
             is a dense [kv_heads, len, head_dim] tensor: the [B, H, T, D] that SDPA and transformers use.
             Page fill: page / (dim·itemsize) tokens per head; a page boundary costs kv_heads pages per region.

A slot is cut into `runs_per_slot` runs of pages (one per head for head_major, else one); every run starts
on a page boundary, so the pages of different sequences (and heads) never overlap. Page-index lists are
run-major: for each region, for each run, the pages in order.

Keys and values with different head sizes (v_head_dim != head_dim, e.g. multi-head latent attention): in
interleaved, a token row holds each layer's K (heads x head_dim) then V (heads x v_head_dim), nothing
wasted. per_layer and head_major give K and V regions the same token stride, sized for the larger of the
two, so that a page index covers the same tokens in every region (one page count per slot, as for equal
dims); the smaller one leaves the rest of each row unused, which the memory accounting reports as
fragmentation, not as stored bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...errors import InvalidArgumentError
from ..config import LAYOUTS

if TYPE_CHECKING:
    from ..geometry import KVGeometry


@dataclass(frozen=True)
class Layout:
    kind: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    itemsize: int
    max_seqs: int
    max_seq_len: int
    page_size: int
    v_head_dim: int | None = None  # None: the same as head_dim

    def __post_init__(self):
        if self.kind not in LAYOUTS:
            raise InvalidArgumentError(f"layout must be one of {LAYOUTS}, got {self.kind!r}")
        if self.v_head_dim is None:
            object.__setattr__(self, "v_head_dim", self.head_dim)

    def dim(self, kv: int) -> int:
        """Head size of K (kv=0) or V (kv=1)."""
        return self.v_head_dim if kv else self.head_dim

    @property
    def row_dim(self) -> int:
        """Elements per head in one token row of a per_layer / head_major region (the larger head size)."""
        return max(self.head_dim, self.v_head_dim)

    @classmethod
    def of(cls, kind: str, geometry: KVGeometry, max_seqs: int, max_seq_len: int, page_size: int) -> Layout:
        """The layout of a cache of `geometry`'s K/V (of its stored rows: head_dim and itemsize here are the
        storage's, e.g. head_dim + 4 bytes per int8 row)."""
        g = geometry
        head_dim, v_head_dim, item = g.storage_dims()  # a quantized format: byte rows, scales included
        return cls(kind, g.num_layers, g.num_kv_heads, head_dim, item, max_seqs, max_seq_len, page_size, v_head_dim)

    @property
    def regions(self) -> int:
        return 1 if self.kind == "interleaved" else 2 * self.num_layers

    @property
    def runs_per_slot(self) -> int:
        return self.num_kv_heads if self.kind == "head_major" else 1

    @property
    def runs(self) -> int:
        """Page runs of one slot over all regions: pages per slot for each page index."""
        return self.regions * self.runs_per_slot

    @property
    def token_stride(self) -> int:
        """Elements from one token to the next inside a run."""
        if self.kind == "head_major":
            return self.row_dim
        if self.kind == "per_layer":
            return self.num_kv_heads * self.row_dim
        return self.num_layers * self.num_kv_heads * (self.head_dim + self.v_head_dim)

    @property
    def head_stride(self) -> int:
        """Elements from one head of K to the next of the same token."""
        return self.head_stride_of(0)

    def head_stride_of(self, kv: int) -> int:
        """Elements from one head of K (kv=0) or V (kv=1) to the next of the same token."""
        if self.kind == "head_major":
            return self.pages_per_run * self.page_size // self.itemsize
        return self.dim(kv)

    @property
    def token_bytes(self) -> int:
        """Bytes one token occupies in one run."""
        return self.token_stride * self.itemsize

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K and V of one token over all layers."""
        return self.num_layers * self.num_kv_heads * (self.head_dim + self.v_head_dim) * self.itemsize

    @property
    def payload_fraction(self) -> tuple[int, int]:
        """(numerator, denominator): the part of the token rows of all runs that holds K/V; below 1 only when
        per_layer / head_major pad the smaller of K and V to the larger head size."""
        if self.kind == "interleaved":
            return 1, 1
        return self.head_dim + self.v_head_dim, 2 * self.row_dim

    @property
    def pages_per_run(self) -> int:
        return -(-self.max_seq_len * self.token_bytes // self.page_size)

    @property
    def slot_bytes(self) -> int:
        return self.runs_per_slot * self.pages_per_run * self.page_size

    @property
    def slot_stride(self) -> int:
        """Elements from one sequence slot to the next."""
        return self.slot_bytes // self.itemsize

    @property
    def total_bytes(self) -> int:
        return self.regions * self.max_seqs * self.slot_bytes

    @property
    def tokens_per_page(self) -> float:
        """Fill granularity: tokens that fit one page of one run."""
        return self.page_size / self.token_bytes

    def pages_for(self, tokens: int) -> int:
        """Pages each run of a slot needs to hold `tokens` tokens."""
        return -(-tokens * self.token_bytes // self.page_size)

    def page_indices(self, slot: int, first: int, stop: int) -> list[int]:
        """The range's page indices of pages first..stop-1 of every run of `slot` (run-major)."""
        ppr, rps, seqs = self.pages_per_run, self.runs_per_slot, self.max_seqs
        return [
            ((r * seqs + slot) * rps + h) * ppr + p
            for r in range(self.regions)
            for h in range(rps)
            for p in range(first, stop)
        ]

    def base_offset(self, layer: int, kv: int) -> int:
        """Byte offset of slot 0, head 0, token 0 of layer's K (kv=0) or V (kv=1)."""
        if self.kind == "interleaved":
            row = self.num_kv_heads * (self.head_dim + self.v_head_dim)
            return (layer * row + kv * self.num_kv_heads * self.head_dim) * self.itemsize
        return (2 * layer + kv) * self.max_seqs * self.slot_bytes

    def offset(self, layer: int, kv: int, slot: int, token: int = 0) -> int:
        return self.base_offset(layer, kv) + slot * self.slot_bytes + token * self.token_bytes

    def view_dims(self, tokens: int, kv: int = 0) -> tuple[list[int], list[int], tuple[int, ...]]:
        """(shape, strides, permutation) of a [tokens, heads, dim] view of K (kv=0) or V (kv=1): shape/strides
        list the dims in memory order (largest stride first) as the core checks them; permuting gives
        [tokens, heads, dim]."""
        dim, hs = self.dim(kv), self.head_stride_of(kv)
        if self.kind == "head_major":
            return [self.num_kv_heads, tokens, dim], [hs, self.token_stride, 1], (1, 0, 2)
        return [tokens, self.num_kv_heads, dim], [self.token_stride, hs, 1], (0, 1, 2)
