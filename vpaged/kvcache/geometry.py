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
from .formats import KVFormat


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
        object.__setattr__(self, "kv_dtype", KVFormat(self.dtype, self.kv_dtype).kv_dtype)
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


def check_cache_args(cache, geometry, config, config_type: type):
    """(geometry, config) of a cache built as Cache(geometry, config): a KVGeometry and a config_type record
    (None: config_type()), or InvalidArgumentError naming the form. The loose form of earlier releases
    (num_layers, num_kv_heads, head_dim, dtype, ... as arguments) is refused here, in one place, with the
    call that replaces it."""
    name = type(cache).__name__
    if not isinstance(geometry, KVGeometry):
        raise InvalidArgumentError(
            f"{name}(geometry, config): geometry must be a KVGeometry, got {type(geometry).__name__}; a cache is "
            f"built as {name}(KVGeometry(num_layers, num_kv_heads, head_dim, dtype), {config_type.__name__}(...))"
        )
    if config is None:
        config = config_type()
    if not isinstance(config, config_type):
        raise InvalidArgumentError(
            f"{name}(geometry, config): config must be a {config_type.__name__}, got {type(config).__name__}"
        )
    return geometry, config
