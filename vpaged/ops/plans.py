"""Decode attention over a cache: one DecodePlan per step, built from the cache's records, run per layer.

Plan once, run many (FlashInfer's plan/run). A cache describes a step's sequences as plain lists
(`cache.decode_rows(seqs)`: slots or block tables, and lengths) and each layer's memory as a plain record
(`cache.decode_source(layer)`: a BatchedKV for a VirtualKVCache, BlockPools for a PagedKVCache); both are
KVCache protocol members, and nothing here reads anything else of a cache. DecodePlan.build(cache, seqs)
reads the rows once per step (and, on CUDA, makes the step's row tensors once); run(layer, q) per layer adds
only that layer's kernel parameters. Those are a LayerPlan, picked by the record's type (PLANS below): the
parameters that never change while the cache is open (addresses, strides, dims, capacity), kept in the
cache's own `kernel_plans`, so they die with the cache and a closed cache has none. A new cache type or KV
format adds a record and a LayerPlan here, not a branch in the callers: the serving stores, the
transformers attention function (a plan over the tensors it is given: DecodePlan.over_tensors) and
ops.decode_attention all run their decode rows through a DecodePlan.
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod

import torch

from .. import _C
from ..errors import InvalidArgumentError, ShapeError
from ..kvcache.base import is_kvcache
from ..kvcache.checks import check_kernel_dtype, check_layer
from ..kvcache.records import BatchedKV, BlockPools
from .checks import check_extent, check_held, check_out, check_pools, check_q, kv_capacity
from .decode import decode_attention_contiguous, decode_attention_paged
from .launch import DTYPE_CODES, describe_contiguous, describe_format, describe_paged, float32_io


class LayerPlan(ABC):
    """A layer's kernel parameters (max_tokens = the capacity per sequence), built once, reused every step."""

    __slots__ = ("params", "num_kv_heads", "head_dim", "v_head_dim", "scale", "quantized", "dtype", "device")

    def __init__(self, params: _C.DecodeParams, capacity: int, source, quantized=None):
        params.max_tokens = min(capacity, 2**31 - 1)
        self.params = params
        self.num_kv_heads, self.head_dim, self.v_head_dim = params.num_kv_heads, params.head_dim, params.v_head_dim
        self.scale = 1.0 / math.sqrt(params.head_dim)
        self.dtype, self.device = source.value_dtype, source.device  # what q and out must be
        # A quantized cache's source (kv_format set): its fp8 scales are read at each step (calibration may
        # set them after the plan is built), q and out cross in float32.
        self.quantized = quantized

    # Whether each step compares the cache's source record with the plan (a source that can change under it).
    checks_source = False

    def describes(self, source) -> bool:
        """Whether the parameters still describe `source`, the cache's record of this step (None where
        checks_source is False: such a plan always does)."""
        return True

    def run_cpu(self, q, where: list, lengths: list[int], scale, out) -> torch.Tensor:
        """The CPU step: rows and lengths as lists straight from the cache's decode_rows() (the kernel entry
        checks them against the plan's capacity, and block ids against the pool, before it reads anything)."""
        q = check_q(q, self.num_kv_heads, self.head_dim, self.dtype, self.device)
        out = check_out(out, q, self.v_head_dim)
        if not lengths:
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

    @staticmethod
    @abstractmethod
    def device_rows(where: list, lengths: list[int], max_len: int, device) -> tuple:
        """A step's rows as the CUDA entry takes them (tensors on `device`), made once per step."""

    @abstractmethod
    def run_device(self, q, rows: tuple, max_len: int, scale, out, source) -> torch.Tensor:
        """The step on a CUDA cache: rows from device_rows(), the longest length as the kernel's bound
        (no read-back); `source` as describes() got it."""


class ContiguousPlan(LayerPlan):
    """A VirtualKVCache layer (or any BatchedKV source): its range and layout are fixed for the cache's life."""

    __slots__ = ("record",)

    @classmethod
    def build(cls, kv: BatchedKV) -> ContiguousPlan:
        check_kernel_dtype(kv.value_dtype, "the cache")
        p = _C.DecodeParams()
        p.dtype = DTYPE_CODES[kv.value_dtype]
        p.head_dim, p.v_head_dim = kv.head_dim, kv.v_head_dim
        describe_contiguous(p, kv)
        describe_format(p, kv)  # a quantized cache: its format, value head dims, q/out in float32
        plan = cls(p, kv_capacity(kv), kv, kv if kv.kv_format is not None else None)
        plan.record = kv  # the device entry takes the record with the step's rows
        return plan

    def cpu_entry(self):
        return _C.decode_cpu_rows  # looked up per call: tests replace it to watch the calls

    @staticmethod
    def device_rows(where, lengths, max_len, device) -> tuple:
        return (
            torch.tensor(where, dtype=torch.int32, device=device),
            torch.tensor(lengths, dtype=torch.int32, device=device),
        )

    def run_device(self, q, rows, max_len, scale, out, source) -> torch.Tensor:
        kv = dataclasses.replace(self.record, slots=rows[0], lengths=rows[1])
        return decode_attention_contiguous(q, kv, scale, out, max_len=max_len)


class BlockTablePlan(LayerPlan):
    """A PagedKVCache layer. `pools` is what the parameters assume of the two block pools (their storage
    addresses, shapes, strides, dtype, device): compared at every step, so that a pool replaced, or given new
    storage in place (`.data =`, `set_`, `resize_`), gets a new plan instead of a stale address."""

    __slots__ = ("pools",)

    @classmethod
    def build(cls, source: BlockPools) -> BlockTablePlan:
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
        plan = cls(p, source.max_seq_len, source, source if source.kv_format is not None else None)
        plan.pools = _pool_fingerprint(source)
        return plan

    checks_source = True

    def describes(self, source) -> bool:
        fingerprint = _pool_fingerprint(source)
        return fingerprint is not None and fingerprint == self.pools

    def cpu_entry(self):
        return _C.decode_cpu_tables

    @staticmethod
    def device_rows(where, lengths, max_len, device) -> tuple:
        width = max(1, max((len(t) for t in where), default=0))
        tables = [t + [0] * (width - len(t)) for t in where]  # kernels read only the blocks below each length
        return (
            torch.tensor(tables, dtype=torch.int32, device=device).reshape(len(where), width),
            torch.tensor(lengths, dtype=torch.int32, device=device),
        )

    def run_device(self, q, rows, max_len, scale, out, source) -> torch.Tensor:
        return decode_attention_paged(
            q, source.key_cache, source.value_cache, rows[0], rows[1], scale, out, max_len=max_len,
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
    plan = plans[layer] = kind.build(source)
    return plan, source


class DecodePlan:
    """One step's decode attention over a KVCache: the step's rows read once (cache.decode_rows), then run()
    per layer with that layer's LayerPlan. The rows are the cache's at build time: build a new plan after
    the sequences change (extend, truncate, free), as a step does."""

    __slots__ = ("_cache", "_fixed", "_seqs", "_where", "_lengths", "_max_len", "_device_rows")

    def __init__(self, cache, fixed, seqs: list, where: list, lengths: list[int]):
        self._cache, self._fixed = cache, fixed
        self._seqs, self._where, self._lengths = seqs, where, lengths
        self._max_len = max(lengths, default=1)
        self._device_rows = None  # made at the first run on a CUDA cache, once for every layer

    @classmethod
    def build(cls, cache, seqs, lengths: list[int] | None = None) -> DecodePlan:
        """The plan of a step over `seqs` (row i of q is seqs[i]). lengths: the tokens each attends over
        (default: all it holds; fewer for a store that reserves more than it fills, kv="static"), each in
        1..what the sequence holds."""
        if not is_kvcache(cache):
            raise InvalidArgumentError(f"cache must be a vpaged KVCache, got {type(cache).__name__}")
        seqs = list(seqs)
        where, held = cache.decode_rows(seqs)  # raises first on a closed cache or an unknown sequence
        if lengths is None:
            lengths = held
        else:
            lengths = list(lengths)
            if len(lengths) != len(seqs):
                raise ShapeError(f"{len(lengths)} lengths for {len(seqs)} sequences")
            for seq, n, have in zip(seqs, lengths, held):
                if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= have:
                    raise InvalidArgumentError(f"sequence {seq} holds {have} tokens; cannot attend over {n!r}")
        check_held(seqs, lengths)
        return cls(cache, None, seqs, where, lengths)

    @classmethod
    def over_tensors(cls, kv: BatchedKV, lengths: list[int] | None = None) -> DecodePlan:
        """A one-layer plan (layer 0) over a BatchedKV of ordinary tensors (BatchedKV.from_tensors, or the
        strided views transformers hands an attention function): row i is slot i. lengths: each row's tokens
        (default: the record's, read back to the host); checked to lie inside the tensors."""
        if not isinstance(kv, BatchedKV):
            raise InvalidArgumentError(f"kv must be a BatchedKV, got {type(kv).__name__}")
        lengths = torch.as_tensor(kv.lengths).tolist() if lengths is None else list(lengths)
        rows = list(range(len(lengths)))
        check_held(rows, lengths)
        check_extent(kv, rows, lengths)
        return cls(None, ContiguousPlan.build(kv), rows, rows, lengths)

    @property
    def num_seqs(self) -> int:
        return len(self._lengths)

    def run(self, layer: int, q: torch.Tensor, scale: float | None = None, out: torch.Tensor | None = None):
        """Decode attention of q [num_seqs, num_heads, head_dim] over `layer`, into out (returned)."""
        if isinstance(q, torch.Tensor) and q.dim() == 3 and q.shape[0] != len(self._lengths):
            raise ShapeError(f"q has {q.shape[0]} rows for {len(self._lengths)} sequences")
        if self._fixed is not None:
            check_layer(layer, 1)
            plan, source = self._fixed, None
        else:
            # `source` is held for the call: the CPU kernel runs without the GIL, and a plan keeps no
            # reference to the memory it describes (a PagedKVCache's pools).
            plan, source = _plan_and_source(self._cache, layer)
        if plan.device.type == "cpu":
            return plan.run_cpu(q, self._where, self._lengths, scale, out)
        if self._device_rows is None:
            self._device_rows = plan.device_rows(self._where, self._lengths, self._max_len, plan.device)
        if not self._lengths:
            q = check_q(q, plan.num_kv_heads, plan.head_dim, plan.dtype, plan.device)
            return check_out(out, q, plan.v_head_dim)
        return plan.run_device(q, self._device_rows, self._max_len, scale, out, source)


def decode_attention(
    q: torch.Tensor, cache, seqs, layer: int, scale: float | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Decode attention of q (row i for seqs[i]) over one layer of a cache (a VirtualKVCache: the contiguous
    kernel; a PagedKVCache: the block-table kernel): a one-layer DecodePlan. Lengths come from the cache (no
    device read-back). A step over many layers builds one DecodePlan and runs it per layer instead."""
    seqs = list(seqs)
    if isinstance(q, torch.Tensor) and q.dim() == 3 and q.shape[0] != len(seqs):
        raise ShapeError(f"q has {q.shape[0]} rows for {len(seqs)} sequences")
    return DecodePlan.build(cache, seqs).run(layer, q, scale, out)
