"""VPagedCacheConfig: the record a VPagedCache is built from, besides the model's config or a KVGeometry.

Like the kvcache records (vpaged/kvcache/config.py) it says what the cache maps (rows and their length),
where it lives (device, a private pool's size and page size, a shared budget) and how it keeps what it
stores (layout, prompt sharing, bounded sliding windows, the stored format). Live objects (a PagePool to
share) stay keywords of the cache. `VPagedCache(model.config, max_cache_len=4096, ...)` fills this record
from its keywords, transformers' way of building a Cache; `VPagedCache(model.config, VPagedCacheConfig(...))`
passes a record made elsewhere (a serving config, a logged value rebuilt with dataclasses.replace()).

Fields are checked when the record is made, with a typed error naming the field; what only the cache can
check (a geometry that already gives the dtype, a pool on another device) the cache checks before building
anything. Importing this module does not import transformers.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ..errors import DTypeError, InvalidArgumentError
from ..kvcache.checks import check_positive_int
from ..kvcache.config import LAYOUTS, check_budget, check_optional_bytes
from ..kvcache.formats import KVFormat
from ..memory import SharedBudget

__all__ = ["VPagedCacheConfig"]


@dataclass(frozen=True)
class VPagedCacheConfig:
    """How a VPagedCache is built (the model's layers and K/V geometry aside).

    What it maps:
        max_cache_len: tokens a row may hold (prompt + generated); going past it raises SequenceTooLongError.
        max_batch_size: rows the cache may hold at once (default: the batch of the first forward). Give it
            when batch_repeat_interleave() is to grow the batch.
    Where it lives:
        device: of K/V; default: the pool's device when a pool is given, else the device of the first K/V.
        capacity_bytes: memory budget of a private page pool; running out raises OutOfPagesError. None (and
            no pool given to the cache): the device's default pool.
        page_size: bytes per page of a private or default pool.
        shared_budget: the name of a machine-wide budget (vpaged.memory.SharedBudget), or the budget, that the
            private pool joins; capacity_bytes (default: the budget's capacity) is then its ceiling.
    How it keeps what it stores:
        layout: "head_major" (default: each head's K/V dense, the [B, H, T, D] transformers' attention reads
            fastest; a page per head at each page boundary), "per_layer" (dense [T, H, D] per layer: finer
            pages, attention on a strided view) or "interleaved" (all layers of a token side by side: finest
            pages, one map per page for all layers). See benchmarks/NOTES.md for measurements.
        share_prefill: store identical prompt rows once (vpaged/hf/cache.py's docstring).
        bounded_sliding: hold only the window (plus one page of tokens) of each sliding-window layer per row,
            instead of every token; tokens generated are the same as with transformers' sliding cache.
        dtype: of K/V; default: the model config's dtype, else the dtype of the first K/V. Not with a
            KVGeometry (it has one).
        kv_dtype, kv_scales: store K/V quantized (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2 or
            "int8" / "fp8" / "fp8_e5m2"; fp8 scales: a float, (k, v), [layers, 2] or "calibrate"), as
            VirtualKVCache does: layers attend over the dequantized stored K/V (not with bounded_sliding).
            kv_dtype not with a KVGeometry (it has one); kv_scales with either.
    """

    max_cache_len: int
    max_batch_size: int | None = None
    device: str | torch.device | None = None
    capacity_bytes: int | None = None
    page_size: int | None = None
    shared_budget: str | SharedBudget | None = None
    layout: str = "head_major"
    share_prefill: bool = True
    bounded_sliding: bool = False
    dtype: torch.dtype | None = None
    kv_dtype: object = None
    kv_scales: object = None

    def __post_init__(self):
        check_positive_int("max_cache_len", self.max_cache_len)
        if self.max_batch_size is not None:
            check_positive_int("max_batch_size", self.max_batch_size)
        check_optional_bytes("capacity_bytes", self.capacity_bytes)
        check_optional_bytes("page_size", self.page_size)
        check_budget(self.shared_budget, 0, "")
        if self.layout not in LAYOUTS:
            raise InvalidArgumentError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        for name in ("share_prefill", "bounded_sliding"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgumentError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.dtype is not None and not isinstance(self.dtype, torch.dtype):
            raise DTypeError(f"dtype must be a torch.dtype, got {self.dtype!r}")
        if self.kv_dtype is not None:
            KVFormat(self.dtype or torch.float32, self.kv_dtype)  # DTypeError now, not at the first forward

    @classmethod
    def from_options(cls, owner: str, options: dict) -> VPagedCacheConfig:
        """The record of a constructor's keyword options, with an error naming the fields for a keyword that
        is not one (a TypeError, as Python gives for any unexpected keyword)."""
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise TypeError(f"{owner} got unexpected keyword(s) {unknown}; its options are {names}")
        if "max_cache_len" not in options:
            raise InvalidArgumentError(f"{owner} needs max_cache_len (or a VPagedCacheConfig)")
        return cls(**options)
