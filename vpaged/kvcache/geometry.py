"""KVGeometry: the shape of a model's K/V (layers, heads, head sizes, element type), shared by every cache.

One place computes what a token costs and what a static cache of the same model would reserve, so the two
caches and the transformers integration agree on it.

Keys and values may have different head sizes (v_head_dim; default head_dim): multi-head latent attention
(DeepSeek-V2/V3) attends with K of nope + rope dims and V of its own, smaller dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InvalidArgumentError
from ..memory.dtypes import itemsize
from .checks import check_positive_int
from .formats import KVFormat, resolve_kv_dtype


@dataclass(frozen=True)
class KVGeometry:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    v_head_dim: int | None = None  # None: the same as head_dim
    kv_dtype: torch.dtype | None = None  # what the cache stores (formats.py); None: dtype

    def __post_init__(self):
        if self.v_head_dim is None:
            object.__setattr__(self, "v_head_dim", self.head_dim)
        for name in ("num_layers", "num_kv_heads", "head_dim", "v_head_dim"):
            check_positive_int(name, getattr(self, name))
        itemsize(self.dtype)  # DTypeError for a dtype a cache cannot hold
        object.__setattr__(self, "kv_dtype", resolve_kv_dtype(self.kv_dtype, self.dtype))
        self.format.check_dims(self.head_dim, self.v_head_dim)

    @property
    def format(self) -> KVFormat:
        return KVFormat(self.dtype, self.kv_dtype)

    @property
    def quantized(self) -> bool:
        return self.kv_dtype != self.dtype

    def storage_dims(self) -> tuple[int, int, int]:
        """(head_dim, v_head_dim, itemsize) as the memory layers see a token's rows: for a quantized format
        1-byte elements, scales included in the row; else the model's."""
        if not self.quantized:
            return self.head_dim, self.v_head_dim, self.itemsize
        f = self.format
        return f.storage_dim(self.head_dim), f.storage_dim(self.v_head_dim), 1

    @property
    def itemsize(self) -> int:
        return itemsize(self.dtype)

    @property
    def token_row_elements(self) -> int:
        """Elements of one token's K in one layer."""
        return self.num_kv_heads * self.head_dim

    @property
    def v_token_row_elements(self) -> int:
        """Elements of one token's V in one layer."""
        return self.num_kv_heads * self.v_head_dim

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over all layers."""
        if self.quantized:
            f = self.format
            return self.num_layers * self.num_kv_heads * (f.row_bytes(self.head_dim) + f.row_bytes(self.v_head_dim))
        return self.num_layers * (self.token_row_elements + self.v_token_row_elements) * self.itemsize

    def describe(self) -> str:
        """The geometry as repr() fields: 'layers=.., kv_heads=.., head_dim=.., dtype=..'."""
        v = f", v_head_dim={self.v_head_dim}" if self.v_head_dim != self.head_dim else ""
        dims = f"kv_heads={self.num_kv_heads}, head_dim={self.head_dim}{v}"
        kv = f", kv_dtype={self.kv_dtype}" if self.quantized else ""
        return f"layers={self.num_layers}, {dims}, dtype={self.dtype}{kv}"

    def static_bytes(self, num_seqs: int, max_seq_len: int) -> int:
        """What reserving max_seq_len tokens for each of num_seqs sequences takes (a static cache)."""
        return num_seqs * max_seq_len * self.bytes_per_token


def cache_geometry(
    geometry: KVGeometry | None,
    num_layers=None,
    num_kv_heads=None,
    head_dim=None,
    dtype=None,
    v_head_dim=None,
    kv_dtype=None,
) -> KVGeometry:
    """The geometry a cache is built on: `geometry` given whole (then none of the loose fields), or one built
    from the loose fields (dtype defaults to bfloat16), checked here once. A KVGeometry given in num_layers'
    place (the first positional argument) counts as `geometry`."""
    if isinstance(num_layers, KVGeometry) and geometry is None:
        geometry, num_layers = num_layers, None
    loose = dict(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype)
    loose.update(v_head_dim=v_head_dim, kv_dtype=kv_dtype)
    if geometry is not None:
        given = [name for name, value in loose.items() if value is not None]
        if not isinstance(geometry, KVGeometry):
            raise InvalidArgumentError(f"geometry must be a KVGeometry, got {type(geometry).__name__}")
        if given:
            raise InvalidArgumentError(f"give either geometry or {', '.join(given)}, not both")
        return geometry
    missing = [name for name in ("num_layers", "num_kv_heads", "head_dim") if loose[name] is None]
    if missing:
        raise InvalidArgumentError(f"give a geometry, or num_layers, num_kv_heads and head_dim (missing {missing})")
    return KVGeometry(
        num_layers, num_kv_heads, head_dim, torch.bfloat16 if dtype is None else dtype, v_head_dim, kv_dtype
    )
