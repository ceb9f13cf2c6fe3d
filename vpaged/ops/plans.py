"""decode_attention over a cache: one kernel plan per layer, built from what the cache says of its memory.

Plan once, run many. A cache describes one layer to a kernel as a plain record (`cache.decode_source(layer)`:
a BatchedKV for a VirtualKVCache, BlockPools for a PagedKVCache) and a step's sequences as plain lists
(`cache.decode_rows(seqs)`: slots or block tables, and lengths). The record's type picks the plan class
(PLANS below); the plan holds the kernel parameters that never change while the cache is open (addresses,
strides, dims, capacity) and is kept in the cache's own `kernel_plans`, so it dies with the cache and a
closed cache has none. A new cache type or KV format adds a record and a plan here, not a branch in the
entry points.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch

from .. import _C
from ..errors import InvalidArgumentError, ShapeError
from ..kvcache.base import KVCacheBase
from ..kvcache.checks import check_kernel_dtype, check_layer
from ..kvcache.records import BatchedKV, BlockPools
from .checks import cache_max_len, check_held, check_out, check_pools, check_q, kv_capacity
from .decode import decode_attention_contiguous, decode_attention_paged
from .launch import DTYPE_CODES, describe_contiguous, describe_format, describe_paged, float32_io


class LayerPlan(ABC):
    """A layer's kernel parameters (max_tokens = the capacity per sequence), built once, reused every step."""

    __slots__ = ("params", "num_kv_heads", "head_dim", "v_head_dim", "scale", "quantized")

    def __init__(self, params: _C.DecodeParams, capacity: int, quantized: BatchedKV | None = None):
        params.max_tokens = min(capacity, 2**31 - 1)
        self.params = params
        self.num_kv_heads, self.head_dim, self.v_head_dim = params.num_kv_heads, params.head_dim, params.v_head_dim
        self.scale = 1.0 / math.sqrt(params.head_dim)
        # A quantized cache's source (kv_format set): its fp8 scales are read at each step (calibration may
        # set them after the plan is built), q and out cross in float32.
        self.quantized = quantized

    # Whether each step compares the cache's source record with the plan (a source that can change under it).
    checks_source = False

    def describes(self, source) -> bool:
        """Whether the parameters still describe `source`, the cache's record of this step (None where
        checks_source is False: such a plan always does)."""
        return True

    def run_cpu(self, q, cache, seqs: list, scale, out) -> torch.Tensor:
        """The per-step CPU entry: rows and lengths as lists straight from the cache (the kernel entry checks
        them against the plan's capacity, and block ids against the pool, before it reads anything)."""
        where, lengths = cache.decode_rows(seqs)  # raises first on a closed cache or an unknown sequence
        check_held(seqs, lengths)
        q = check_q(q, self.num_kv_heads, self.head_dim, cache.dtype, cache.device)
        out = check_out(out, q, self.v_head_dim)
        if not seqs:
            return out
        scale = self.scale if scale is None else float(scale)
        qk, outk = q, out
        if self.quantized is not None:
            describe_format(self.params, self.quantized)
            qk, outk = float32_io(q, out)
        self.cpu_entry()(self.params, qk.data_ptr(), outk.data_ptr(), q.shape[1], scale, where, lengths,
                         torch.get_num_threads())  # fmt: skip
        if outk is not out:
            out.copy_(outk)
        return out

    @abstractmethod
    def cpu_entry(self):
        """The extension's per-step CPU entry for this kind of source."""

    @abstractmethod
    def run_device(self, q, cache, seqs: list, layer: int, scale, out, source) -> torch.Tensor:
        """The step on a CUDA cache (tensors of rows and lengths, the longest length as a hint); `source` as
        describes() got it."""


class ContiguousPlan(LayerPlan):
    """A VirtualKVCache layer (or any BatchedKV source): its range and layout are fixed for the cache's life."""

    __slots__ = ()

    @classmethod
    def build(cls, cache, kv: BatchedKV) -> ContiguousPlan:
        check_kernel_dtype(kv.value_dtype, "the cache")
        p = _C.DecodeParams()
        p.dtype = DTYPE_CODES[kv.value_dtype]
        p.head_dim, p.v_head_dim = kv.head_dim, kv.v_head_dim
        describe_contiguous(p, kv)
        describe_format(p, kv)  # a quantized cache: its format, value head dims, q/out in float32
        return cls(p, kv_capacity(kv), kv if kv.kv_format is not None else None)

    def cpu_entry(self):
        return _C.decode_cpu_rows  # looked up per call: tests replace it to watch the calls

    def run_device(self, q, cache, seqs: list, layer: int, scale, out, source) -> torch.Tensor:
        max_len = cache_max_len(cache, seqs)
        return decode_attention_contiguous(q, cache.batch(layer, seqs), scale, out, max_len=max_len)


class BlockTablePlan(LayerPlan):
    """A PagedKVCache layer. `pools` is what the parameters assume of the two block pools (their storage
    addresses, shapes, strides, dtype, device): compared at every step, so that a pool replaced, or given new
    storage in place (`.data =`, `set_`, `resize_`), gets a new plan instead of a stale address."""

    __slots__ = ("pools",)

    @classmethod
    def build(cls, cache, source: BlockPools) -> BlockTablePlan:
        key_cache, value_cache = source.key_cache, source.value_cache
        check_pools(key_cache, value_cache)
        # The pools must be what the cache says it holds: q and out are checked against the cache's dtype and
        # device, block tables against its num_blocks, so pools of another dtype would make the kernel read q
        # and write out past their ends, and fewer blocks would let a valid table reach past the pool.
        want_k = (source.num_blocks, source.block_size, source.num_kv_heads, source.head_dim)
        want_v = (*want_k[:3], source.v_head_dim)
        if key_cache.dtype != source.dtype or key_cache.device != source.device:
            raise InvalidArgumentError(
                f"the layer's block pools are {key_cache.dtype} on {key_cache.device}; the cache holds "
                f"{source.dtype} on {source.device}"
            )
        if tuple(key_cache.shape) != want_k or tuple(value_cache.shape) != want_v:
            raise ShapeError(
                f"the layer's block pools are {list(key_cache.shape)} and {list(value_cache.shape)}; the cache's "
                f"geometry needs {list(want_k)} and {list(want_v)}"
            )
        check_kernel_dtype(source.value_dtype, "the cache")
        p = _C.DecodeParams()
        p.dtype = DTYPE_CODES[source.value_dtype]
        p.head_dim, p.v_head_dim = key_cache.shape[3], value_cache.shape[3]
        describe_paged(p, key_cache, value_cache)
        describe_format(p, source)  # a quantized cache: its format, value head dims, q/out in float32
        plan = cls(p, source.max_seq_len, source if source.kv_format is not None else None)
        plan.pools = _pool_fingerprint(source)
        return plan

    checks_source = True

    def describes(self, source) -> bool:
        fingerprint = _pool_fingerprint(source)
        return fingerprint is not None and fingerprint == self.pools

    def cpu_entry(self):
        return _C.decode_cpu_tables

    def run_device(self, q, cache, seqs: list, layer: int, scale, out, source) -> torch.Tensor:
        max_len = cache_max_len(cache, seqs)
        tables, lengths = cache.block_tables(seqs), cache.lengths(seqs)
        return decode_attention_paged(
            q, source.key_cache, source.value_cache, tables, lengths, scale, out, max_len=max_len,
            kv_format=source.kv_format, kv_scales=source.kv_scales,
        )  # fmt: skip


# Which plan reads which source record. A new cache type or KV format registers its record here.
PLANS: dict[type, type[LayerPlan]] = {BatchedKV: ContiguousPlan, BlockPools: BlockTablePlan}


def _pool_fingerprint(source: BlockPools) -> tuple | None:
    """Everything a block-table plan's parameters take from the two pools; None when they are not tensors."""
    pools = (source.key_cache, source.value_cache)
    if not all(isinstance(t, torch.Tensor) for t in pools):
        return None
    return tuple((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device) for t in pools)


def layer_plan(cache, layer: int) -> LayerPlan:
    """The cache's plan for `layer`, built on first use and whenever the old one no longer describes the
    cache's memory (a refused rebuild leaves no plan behind)."""
    return _plan_and_source(cache, layer)[0]


def _plan_and_source(cache, layer: int) -> tuple[LayerPlan, object]:
    """layer_plan(), and the source record it was checked against this call (None when the plan needed no
    check): the step uses that same record, so a paged step builds one BlockPools, not one per use."""
    check_layer(layer, cache.num_layers)
    plans = cache.kernel_plans
    plan = plans.get(layer)
    source = cache.decode_source(layer) if plan is None or plan.checks_source else None  # refuses accounting-only
    if plan is not None and plan.describes(source):
        return plan, source
    plans.pop(layer, None)
    if source is None:
        source = cache.decode_source(layer)
    kind = PLANS.get(type(source))
    if kind is None:
        raise InvalidArgumentError(f"no decode kernel reads a {type(source).__name__}")
    plan = plans[layer] = kind.build(cache, source)
    return plan, source


def decode_attention(
    q: torch.Tensor, cache, seqs, layer: int, scale: float | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Decode attention of q (row i for seqs[i]) over one layer of a cache (a VirtualKVCache: the contiguous
    kernel; a PagedKVCache: the block-table kernel). Lengths come from the cache (no device read-back)."""
    seqs = list(seqs)
    if isinstance(q, torch.Tensor) and q.dim() == 3 and q.shape[0] != len(seqs):
        raise ShapeError(f"q has {q.shape[0]} rows for {len(seqs)} sequences")
    if not isinstance(cache, KVCacheBase):
        raise InvalidArgumentError(f"cache must be a VirtualKVCache or a PagedKVCache, got {type(cache).__name__}")
    # `source` is held for the call: the CPU kernel runs without the GIL, and a plan keeps no reference to
    # the memory it describes (a PagedKVCache's pools).
    plan, source = _plan_and_source(cache, layer)
    if cache.device.type == "cpu":
        return plan.run_cpu(q, cache, seqs, scale, out)
    return plan.run_device(q, cache, seqs, layer, scale, out, source)
