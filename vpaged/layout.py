"""Where each token's K and V live inside a VirtualKVCache's virtual range.

per_layer:   2·num_layers regions (K and V of each layer), each of max_seqs slots; a sequence's K of one
             layer is a dense [len, kv_heads, head_dim] tensor. Page fill: page / (heads·dim·itemsize) tokens.
interleaved: one region of max_seqs slots; per token all layers' K and V side by side, so K of a layer is a
             strided view. Page fill: page / (2·layers·heads·dim·itemsize) tokens; one map serves all layers.

Every slot starts on a page boundary, so the pages of different sequences never overlap.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import InvalidArgumentError

LAYOUTS = ("per_layer", "interleaved")


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

    def __post_init__(self):
        if self.kind not in LAYOUTS:
            raise InvalidArgumentError(f"layout must be one of {LAYOUTS}, got {self.kind!r}")

    @property
    def regions(self) -> int:
        return 2 * self.num_layers if self.kind == "per_layer" else 1

    @property
    def token_stride(self) -> int:
        """Elements from one token to the next inside a region."""
        per_head_row = self.num_kv_heads * self.head_dim
        return per_head_row if self.kind == "per_layer" else 2 * self.num_layers * per_head_row

    @property
    def token_bytes(self) -> int:
        """Bytes one token occupies in one region."""
        return self.token_stride * self.itemsize

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K and V of one token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def pages_per_slot(self) -> int:
        return -(-self.max_seq_len * self.token_bytes // self.page_size)

    @property
    def slot_bytes(self) -> int:
        return self.pages_per_slot * self.page_size

    @property
    def slot_stride(self) -> int:
        """Elements from one sequence slot to the next."""
        return self.slot_bytes // self.itemsize

    @property
    def total_bytes(self) -> int:
        return self.regions * self.max_seqs * self.slot_bytes

    @property
    def tokens_per_page(self) -> float:
        """Fill granularity: tokens that fit one page of one region."""
        return self.page_size / self.token_bytes

    def pages_for(self, tokens: int) -> int:
        """Pages each region of a slot needs to hold `tokens` tokens."""
        return -(-tokens * self.token_bytes // self.page_size)

    def page_slots(self, slot: int, first: int, stop: int) -> list[int]:
        """Range page-slot indices of pages first..stop-1 of `slot`, in every region."""
        pps, seqs = self.pages_per_slot, self.max_seqs
        return [(r * seqs + slot) * pps + p for r in range(self.regions) for p in range(first, stop)]

    def base_offset(self, layer: int, kv: int) -> int:
        """Byte offset of slot 0, token 0 of layer's K (kv=0) or V (kv=1)."""
        if self.kind == "per_layer":
            return (2 * layer + kv) * self.max_seqs * self.slot_bytes
        return (2 * layer + kv) * self.num_kv_heads * self.head_dim * self.itemsize

    def offset(self, layer: int, kv: int, slot: int, token: int = 0) -> int:
        return self.base_offset(layer, kv) + slot * self.slot_bytes + token * self.token_bytes
