"""KVCacheBase: what VirtualKVCache and PagedKVCache share.

The model's K/V geometry and the sequence limits (checked here, once for both), what a token and a static
cache of the same shape cost, and closing as a context manager.
"""

from __future__ import annotations

from typing import TypeVar

import torch

from ._checks import check_positive_int
from .geometry import KVGeometry

C = TypeVar("C", bound="KVCacheBase")


class KVCacheBase:
    geometry: KVGeometry

    def _init_shape(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        max_seqs: int,
        max_seq_len: int,
        v_head_dim: int | None = None,
    ) -> None:
        self.geometry = KVGeometry(num_layers, num_kv_heads, head_dim, dtype, v_head_dim)  # checks them; DTypeError
        self.v_head_dim = self.geometry.v_head_dim  # V's head size: head_dim unless the model's differs
        check_positive_int("max_seqs", max_seqs)
        check_positive_int("max_seq_len", max_seq_len)
        self.dtype = dtype
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.max_seqs, self.max_seq_len = max_seqs, max_seq_len

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over all layers."""
        return self.geometry.bytes_per_token

    def static_bytes(self, num_seqs: int | None = None) -> int:
        """What reserving max_seq_len tokens for each of num_seqs sequences (default max_seqs) would take."""
        return self.geometry.static_bytes(self.max_seqs if num_seqs is None else num_seqs, self.max_seq_len)

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: C) -> C:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
