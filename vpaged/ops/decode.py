"""Decode attention over vpaged caches: one query token per sequence against its cached K/V.

    decode_attention(q, cache, seqs, layer)            picks the kernel for a VirtualKVCache or PagedKVCache
    decode_attention_contiguous(q, batched_kv)         contiguous-with-lengths kernel (VirtualKVCache.batch())
    decode_attention_paged(q, key_cache, value_cache, block_tables, lengths)   block-table kernel
    decode_attention_reference(q, cache, seqs, layer)  torch SDPA per sequence (views / gathered blocks)
    batched_kv_from_tensors(k, v, lengths)             BatchedKV over ordinary dense [B, T, H, D] / [B, H, T, D]
                                                       tensors (BatchedKV.from_tensors), for the contiguous kernel
    write_kv(k, v, batched_kv, rows, positions)        scatter new tokens' K/V into the cache through a BatchedKV
                                                       (one call per layer for every sequence of a step)

q is [num_seqs, num_heads, head_dim] with num_heads a multiple of num_kv_heads (GQA); the result is
[num_seqs, num_heads, v_head_dim] (V's head dim, which may differ from K's) in q's dtype (float32, float16
or bfloat16; scores and sums are float32 inside). scale defaults to
1/sqrt(head_dim). `out`, when given, is written in place and returned.

Lengths are checked (each in 1..capacity) before any kernel reads memory. On CUDA that check reads them
back to the host, a synchronisation; a caller that knows the longest length (a scheduler does) passes
max_len=..., which skips the read-back: lengths are then clamped to max_len inside the kernels, so a wrong
hint gives wrong numbers but never a read outside the cache. CUDA kernels run asynchronously on
torch.cuda.current_stream().
"""

from __future__ import annotations

import math
import weakref

import torch

from .. import _C
from ..errors import DTypeError, InvalidArgumentError, ShapeError
from ..kvcache.checks import check_layer
from ..kvcache.paged import PagedKVCache
from ..kvcache.virtual.cache import BatchedKV, VirtualKVCache
from ..memory.dtypes import itemsize

__all__ = [
    "batched_kv_from_tensors",
    "decode_attention",
    "decode_attention_contiguous",
    "decode_attention_paged",
    "decode_attention_reference",
    "write_kv",
]

_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


# --------------------------------------------------------------------------------------------- entry points
def decode_attention_contiguous(
    q: torch.Tensor,
    batched_kv: BatchedKV,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    *,
    max_len: int | None = None,
) -> torch.Tensor:
    """Decode attention over a BatchedKV descriptor (VirtualKVCache.batch(layer, seqs)): sequence i reads
    tokens 0..lengths[i]-1 of its slot, never past them. Every cache layout (they differ in token_stride and
    head_stride)."""
    kv = batched_kv
    if not isinstance(kv, BatchedKV):
        raise InvalidArgumentError(f"batched_kv must be a BatchedKV (VirtualKVCache.batch()), got {type(kv).__name__}")
    _check_dtype(kv.dtype, "the cache")
    q = _check_q(q, kv.num_kv_heads, kv.head_dim, kv.dtype, kv.device)
    if not isinstance(kv.v_head_dim, int) or not 1 <= kv.v_head_dim <= 256:
        raise ShapeError(f"v_head_dim must be an int in 1..256, got {kv.v_head_dim!r}")
    out = _check_out(out, q, kv.v_head_dim)
    num_seqs = q.shape[0]
    slots = _index_tensor(kv.slots, "slots", (num_seqs,), q.device)
    lengths = _index_tensor(kv.lengths, "lengths", (num_seqs,), q.device)
    capacity = _kv_capacity(kv)
    if max_len is None:
        max_len = _check_lengths(lengths, capacity)
        _check_extent(kv, slots.tolist(), lengths.tolist())
    else:
        max_len = _check_max_len(max_len, capacity)
    if num_seqs == 0:
        return out
    p = _params(q, out, kv.k_ptr, kv.v_ptr, kv.num_kv_heads, kv.token_stride, lengths, max_len, scale)
    _describe_contiguous(p, kv)
    p.slots = slots.data_ptr()
    _launch(p, q)
    return out


def decode_attention_paged(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    *,
    max_len: int | None = None,
) -> torch.Tensor:
    """Decode attention over block pools key_cache [num_blocks, block_size, num_kv_heads, head_dim] and
    value_cache [num_blocks, block_size, num_kv_heads, v_head_dim] (dense; block_size a power of two) through
    block_tables [num_seqs, width] (block ids) and lengths [num_seqs]; token t of sequence i is row
    t % block_size of block block_tables[i, t // block_size]. The result is [num_seqs, num_heads, v_head_dim]."""
    _check_pools(key_cache, value_cache)
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    v_head_dim = value_cache.shape[3]
    _check_dtype(key_cache.dtype, "key_cache")
    q = _check_q(q, num_kv_heads, head_dim, key_cache.dtype, key_cache.device)
    out = _check_out(out, q, v_head_dim)
    num_seqs = q.shape[0]
    if not isinstance(block_tables, torch.Tensor) or block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ShapeError(
            f"block_tables must be a [{num_seqs}, width] tensor, got "
            f"{list(block_tables.shape) if isinstance(block_tables, torch.Tensor) else type(block_tables)}"
        )
    tables = _index_tensor(block_tables, "block_tables", tuple(block_tables.shape), q.device)
    lengths = _index_tensor(lengths, "lengths", (num_seqs,), q.device)
    capacity = tables.shape[1] * block_size
    if max_len is None:
        max_len = _check_lengths(lengths, capacity, tables, block_size, num_blocks)
    else:
        max_len = _check_max_len(max_len, capacity)
    if num_seqs == 0:
        return out
    p = _params(
        q,
        out,
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        num_kv_heads,
        num_kv_heads * head_dim,
        lengths,
        max_len,
        scale,
    )
    _describe_paged(p, key_cache, value_cache)
    p.block_tables = tables.data_ptr()
    p.bt_stride = tables.stride(0)
    _launch(p, q)
    return out


def decode_attention(
    q: torch.Tensor, cache, seqs, layer: int, scale: float | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Decode attention of q (row i for seqs[i]) over one layer of a VirtualKVCache (contiguous kernel)
    or a PagedKVCache (block-table kernel). Lengths come from the cache (no device read-back)."""
    seqs = list(seqs)
    if isinstance(q, torch.Tensor) and q.dim() == 3 and q.shape[0] != len(seqs):
        raise ShapeError(f"q has {q.shape[0]} rows for {len(seqs)} sequences")
    if isinstance(cache, VirtualKVCache):
        if cache.device.type == "cpu":
            return _decode_cache_cpu(q, cache, seqs, layer, scale, out)
        max_len = _cache_max_len(cache, seqs)
        return decode_attention_contiguous(q, cache.batch(layer, seqs), scale, out, max_len=max_len)
    if isinstance(cache, PagedKVCache):
        check_layer(layer, cache.num_layers)
        if cache.accounting_only:
            raise InvalidArgumentError("the cache is accounting-only: it keeps block tables but holds no K/V")
        if cache.device.type == "cpu":
            return _decode_paged_cpu(q, cache, seqs, layer, scale, out)
        max_len = _cache_max_len(cache, seqs)
        return decode_attention_paged(
            q,
            cache.key_caches[layer],
            cache.value_caches[layer],
            cache.block_tables(seqs),
            cache.lengths(seqs),
            scale,
            out,
            max_len=max_len,
        )
    raise InvalidArgumentError(f"cache must be a VirtualKVCache or a PagedKVCache, got {type(cache).__name__}")


def decode_attention_reference(
    q: torch.Tensor, cache, seqs, layer: int, scale: float | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The same result by torch's scaled_dot_product_attention, one sequence at a time, over cache.kv()
    (zero-copy views of a VirtualKVCache, blocks gathered into copies for a PagedKVCache)."""
    if not isinstance(cache, (VirtualKVCache, PagedKVCache)):
        raise InvalidArgumentError(f"cache must be a VirtualKVCache or a PagedKVCache, got {type(cache).__name__}")
    seqs = list(seqs)
    q = _check_q(q, cache.num_kv_heads, cache.head_dim, cache.dtype, cache.device)
    if q.shape[0] != len(seqs):
        raise ShapeError(f"q has {q.shape[0]} rows for {len(seqs)} sequences")
    out = _check_out(out, q, getattr(cache, "v_head_dim", cache.head_dim))
    _cache_max_len(cache, seqs)  # every sequence holds at least one token
    for i, seq in enumerate(seqs):
        k, v = cache.kv(layer, seq)  # [T, kv_heads, D]
        o = torch.nn.functional.scaled_dot_product_attention(
            q[i].unsqueeze(1), k.transpose(0, 1), v.transpose(0, 1), scale=scale, enable_gqa=True
        )
        out[i].copy_(o.squeeze(1))
    return out


def batched_kv_from_tensors(k: torch.Tensor, v: torch.Tensor, lengths, layout: str = "bthd") -> BatchedKV:
    """A BatchedKV over ordinary tensors (e.g. a StaticCache's), for decode_attention_contiguous.

    k: [B, T, H, D] (layout="bthd") or [B, H, T, D] (layout="bhtd"); v the same layout with the same B, T and
    H but its own head dim (last dimension) and strides, e.g. MLA-style K 192 / V 128. Same dtype and device;
    each head's row dense (views of a larger buffer, e.g. the first T tokens of a longer cache, are fine).
    lengths: valid tokens of each of the B sequences (an int for all, a sequence of ints, or an integer
    tensor), each in 1..T; sequence i is row i. The descriptor keeps k and v alive."""
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise InvalidArgumentError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ShapeError(f"{name} must be 4-d ([B, T, H, D] or [B, H, T, D]), got {list(t.shape)}")
    if layout not in ("bthd", "bhtd"):
        raise InvalidArgumentError(f"layout must be 'bthd' ([B, T, H, D]) or 'bhtd' ([B, H, T, D]), got {layout!r}")
    if k.shape[:3] != v.shape[:3] or k.dtype != v.dtype or k.device != v.device:
        raise ShapeError(
            f"k {list(k.shape)} {k.dtype} {k.device} and v {list(v.shape)} {v.dtype} {v.device} differ "
            "(only the head dim, the last dimension, may)"
        )
    _check_dtype(k.dtype, "k")
    batch, tokens, heads, dim, slot_stride, token_stride, head_stride = _dense_strides("k", k, layout)
    *_, v_dim, v_slot_stride, v_token_stride, v_head_stride = _dense_strides("v", v, layout)
    if isinstance(lengths, torch.Tensor):
        lengths = _index_tensor(lengths, "lengths", (batch,), k.device)
        if k.device.type == "cpu":
            _check_lengths(lengths, tokens)
    else:
        if isinstance(lengths, int) and not isinstance(lengths, bool):
            lengths = [lengths] * batch
        lengths = list(lengths)
        if len(lengths) != batch:
            raise ShapeError(f"lengths has {len(lengths)} entries for {batch} sequences")
        if not all(isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= tokens for n in lengths):
            raise InvalidArgumentError(f"lengths must be ints in 1..{tokens}, got {lengths}")
        lengths = torch.tensor(lengths, dtype=torch.int32, device=k.device)
    slots = torch.arange(batch, dtype=torch.int32, device=k.device)
    return BatchedKV(
        k.data_ptr(),
        v.data_ptr(),
        slots,
        lengths,
        slot_stride,
        token_stride,
        head_stride,
        heads,
        dim,
        k.dtype,
        k.device,
        layout,
        (k, v),
        v_head_dim=v_dim,
        v_slot_stride=v_slot_stride,
        v_token_stride=v_token_stride,
        v_head_stride=v_head_stride,
    )


def _dense_strides(name: str, t: torch.Tensor, layout: str) -> tuple[int, int, int, int, int, int, int]:
    """(batch, tokens, heads, dim, slot_stride, token_stride, head_stride) of a [B, T, H, D] / [B, H, T, D]
    tensor whose heads' rows are dense and whose tokens and heads do not overlap."""
    if layout == "bthd":
        batch, tokens, heads, dim = t.shape
        slot_stride, token_stride, head_stride, row_stride = t.stride()
    else:
        batch, heads, tokens, dim = t.shape
        slot_stride, head_stride, token_stride, row_stride = t.stride()
    if min(t.shape) == 0:
        raise ShapeError(f"{name} must not be empty, got {list(t.shape)}")
    if not 1 <= dim <= 256:
        raise ShapeError(f"{name}'s head dim must be in 1..256, got {dim}")
    if (row_stride != 1 and dim > 1) or min(t.stride()) < 0:
        raise InvalidArgumentError(
            f"each head's row of {name} ({dim} elements) must be dense, got strides {t.stride()}"
        )
    if heads == 1:
        head_stride = dim  # one head: its stride is never used
    if tokens == 1:
        token_stride = max(token_stride, heads * dim if head_stride == dim else dim)  # one token: likewise
    if head_stride == dim:
        if token_stride < heads * dim:
            raise InvalidArgumentError(f"tokens of {name} overlap: token stride {token_stride} < {heads} heads x {dim}")
    elif head_stride < tokens * token_stride or token_stride < dim:
        raise InvalidArgumentError(
            f"the strides {t.stride()} of {name} do not give every head a run of {tokens} tokens"
        )
    return batch, tokens, heads, dim, slot_stride, token_stride, head_stride


# --------------------------------------------------------------------------------------------- cache fast path
class _LayerPlan:
    """A layer's kernel parameters that never change while its cache is open (addresses, strides, dims;
    max_tokens = the capacity per sequence), built once and reused by every step. pools: for a PagedKVCache,
    what the parameters assume of its two block pools (_pool_fingerprint); a step whose pools differ in any
    of it gets a new plan (None for a VirtualKVCache, whose range is fixed for its life)."""

    __slots__ = ("params", "num_kv_heads", "head_dim", "v_head_dim", "scale", "pools")

    def __init__(self, params: _C.DecodeParams, capacity: int, pools: tuple | None = None):
        params.max_tokens = min(capacity, 2**31 - 1)
        self.params = params
        self.num_kv_heads, self.head_dim, self.v_head_dim = params.num_kv_heads, params.head_dim, params.v_head_dim
        self.scale = 1.0 / math.sqrt(params.head_dim)
        self.pools = pools

    @classmethod
    def contiguous(cls, kv: BatchedKV) -> _LayerPlan:
        _check_dtype(kv.dtype, "the cache")
        p = _C.DecodeParams()
        p.dtype = _DTYPE_CODES[kv.dtype]
        p.head_dim, p.v_head_dim = kv.head_dim, kv.v_head_dim
        _describe_contiguous(p, kv)
        return cls(p, _kv_capacity(kv))

    @classmethod
    def paged(cls, cache: PagedKVCache, key_cache, value_cache) -> _LayerPlan:
        _check_pools(key_cache, value_cache)
        # The pools must be what the cache says it holds: q and out are checked against the cache's dtype and
        # device, block tables against its num_blocks, so pools of another dtype would make the kernel read q
        # and write out past their ends, and fewer blocks would let a valid table reach past the pool.
        want_k = (cache.num_blocks, cache.block_size, cache.num_kv_heads, cache.head_dim)
        want_v = (*want_k[:3], cache.v_head_dim)
        if key_cache.dtype != cache.dtype or key_cache.device != cache.device:
            raise InvalidArgumentError(
                f"the layer's block pools are {key_cache.dtype} on {key_cache.device}; the cache holds "
                f"{cache.dtype} on {cache.device}"
            )
        if tuple(key_cache.shape) != want_k or tuple(value_cache.shape) != want_v:
            raise ShapeError(
                f"the layer's block pools are {list(key_cache.shape)} and {list(value_cache.shape)}; the cache's "
                f"geometry needs {list(want_k)} and {list(want_v)}"
            )
        _check_dtype(key_cache.dtype, "the cache")
        p = _C.DecodeParams()
        p.dtype = _DTYPE_CODES[key_cache.dtype]
        p.head_dim, p.v_head_dim = key_cache.shape[3], value_cache.shape[3]
        _describe_paged(p, key_cache, value_cache)
        return cls(p, cache.max_seq_len, _pool_fingerprint(key_cache, value_cache))


def _pool_fingerprint(key_cache, value_cache) -> tuple | None:
    """Everything a paged plan's parameters take from the two pools: their storage addresses, shapes,
    strides, dtype and device. Compared at every step, so a pool replaced, or given new storage in place
    (`.data =`, `set_`, `resize_`), gets a new plan instead of a stale address. None when not tensors."""
    if not (isinstance(key_cache, torch.Tensor) and isinstance(value_cache, torch.Tensor)):
        return None
    return tuple((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device) for t in (key_cache, value_cache))


# cache -> {layer: _LayerPlan}. Weak: a plan dies with its cache. A closed cache never reaches its plans
# (slots_and_lengths() / tables_and_lengths() raise first), a VirtualKVCache's range and layout are fixed for
# its life, and a PagedKVCache's plan is rebuilt should its pools ever be replaced.
_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _layer_plan(cache, layer: int) -> _LayerPlan:
    check_layer(layer, cache.num_layers)
    plans = _PLANS.get(cache)
    if plans is None:
        plans = _PLANS.setdefault(cache, {})
    plan = plans.get(layer)
    if isinstance(cache, PagedKVCache):
        key_cache, value_cache = cache.key_caches[layer], cache.value_caches[layer]
        fingerprint = _pool_fingerprint(key_cache, value_cache)
        if plan is None or fingerprint is None or plan.pools != fingerprint:
            plans.pop(layer, None)  # a refused rebuild must not leave the old plan in use
            plan = plans[layer] = _LayerPlan.paged(cache, key_cache, value_cache)
    elif plan is None:
        plan = plans[layer] = _LayerPlan.contiguous(cache.batch(layer, []))  # batch() refuses accounting-only
    return plan


def _decode_cache_cpu(q, cache: VirtualKVCache, seqs: list, layer: int, scale, out) -> torch.Tensor:
    """decode_attention on a CPU VirtualKVCache: the layer's prebuilt parameters, slots and lengths as
    lists straight from the cache (whose lengths never exceed what it has mapped; the kernel entry checks
    them against the capacity again)."""
    plan = _layer_plan(cache, layer)
    slots, lengths = cache.slots_and_lengths(seqs)
    return _run_step_cpu(_C.decode_cpu_rows, plan, cache, seqs, slots, lengths, q, scale, out)


def _decode_paged_cpu(q, cache: PagedKVCache, seqs: list, layer: int, scale, out) -> torch.Tensor:
    """decode_attention on a CPU PagedKVCache (holding K/V): the layer's prebuilt parameters, block tables
    and lengths as lists straight from the cache; the kernel entry checks every length against the capacity
    and every block id a length reaches against the pool before the kernel reads anything."""
    tables, lengths = cache.tables_and_lengths(seqs)  # raises first on a closed cache or an unknown sequence
    plan = _layer_plan(cache, layer)
    # Held for the call: the kernel runs without the GIL, and the plan keeps no reference to the pools.
    pools = (cache.key_caches[layer], cache.value_caches[layer])
    out = _run_step_cpu(_C.decode_cpu_tables, plan, cache, seqs, tables, lengths, q, scale, out)
    del pools
    return out


def _run_step_cpu(entry, plan: _LayerPlan, cache, seqs: list, where: list, lengths: list, q, scale, out):
    """A per-step entry of the CPU kernel (decode_cpu_rows: where = slots; decode_cpu_tables: where = block
    tables) after the checks both paths share."""
    _check_held(seqs, lengths)
    q = _check_q(q, plan.num_kv_heads, plan.head_dim, cache.dtype, cache.device)
    out = _check_out(out, q, plan.v_head_dim)
    if not seqs:
        return out
    scale = plan.scale if scale is None else float(scale)
    entry(plan.params, q.data_ptr(), out.data_ptr(), q.shape[1], scale, where, lengths, torch.get_num_threads())
    return out


def _check_held(seqs: list, lengths: list[int]) -> None:
    if lengths and min(lengths) < 1:
        seq = seqs[lengths.index(min(lengths))]
        raise InvalidArgumentError(f"sequence {seq} holds no tokens; decode attends over at least one")


# --------------------------------------------------------------------------------------------- checks
def _check_dtype(dtype: torch.dtype, what: str) -> None:
    if dtype not in _DTYPE_CODES:
        raise DTypeError(f"{what} holds {dtype}; decode kernels support float32, float16 and bfloat16")


def _check_q(q, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if not isinstance(q, torch.Tensor):
        raise InvalidArgumentError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.dim() != 3 or q.shape[2] != head_dim or q.shape[1] == 0 or q.shape[1] % num_kv_heads:
        raise ShapeError(
            f"q must be [num_seqs, num_heads, {head_dim}] with num_heads a positive multiple of "
            f"num_kv_heads={num_kv_heads}, got {list(q.shape)}"
        )
    if q.dtype != dtype:
        raise DTypeError(f"q has dtype {q.dtype}, the cache holds {dtype}")
    if q.device != device:
        raise InvalidArgumentError(f"q is on {q.device}, the cache on {device}")
    return q.contiguous()


def _check_out(out, q: torch.Tensor, v_head_dim: int) -> torch.Tensor:
    shape = (q.shape[0], q.shape[1], v_head_dim)
    if out is None:
        return torch.empty(shape, dtype=q.dtype, device=q.device)
    if not isinstance(out, torch.Tensor):
        raise InvalidArgumentError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if tuple(out.shape) != shape:
        raise ShapeError(f"out must be {list(shape)} ([num_seqs, num_heads, v_head_dim]), got {list(out.shape)}")
    if out.dtype != q.dtype:
        raise DTypeError(f"out has dtype {out.dtype}, q {q.dtype}")
    if out.device != q.device:
        raise InvalidArgumentError(f"out is on {out.device}, q on {q.device}")
    if not out.is_contiguous():
        raise InvalidArgumentError("out must be contiguous")
    return out


def _index_tensor(t, name: str, shape: tuple, device: torch.device) -> torch.Tensor:
    """An integer tensor as dense int32 on `device` (converted when needed: tables are small)."""
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ShapeError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise DTypeError(f"{name} must hold integers, got {t.dtype}")
    if t.device != device:
        raise InvalidArgumentError(f"{name} is on {t.device}, q on {device}")
    if t.dtype != torch.int32:
        if t.numel() and (int(t.min()) < -(2**31) or int(t.max()) >= 2**31):
            raise InvalidArgumentError(f"{name} holds values outside int32")
        t = t.to(torch.int32)
    return t.contiguous()


def _check_lengths(
    lengths: torch.Tensor, capacity: int, tables: torch.Tensor | None = None, block_size: int = 0, num_blocks: int = 0
) -> int:
    """Every length in 1..capacity and, for block tables, every block a length reaches a valid id. One
    read-back to the host. Returns the longest length."""
    if lengths.numel() == 0:
        return 1
    checks = [lengths.min(), lengths.max()]
    if tables is not None:
        used = (lengths.to(torch.int64) + block_size - 1) // block_size  # blocks each sequence reaches
        reached = (
            torch.arange(tables.shape[1], device=tables.device)[None, :] < used.clamp(max=tables.shape[1])[:, None]
        )
        bad = reached & ((tables < 0) | (tables >= num_blocks))
        checks.append(bad.sum())
    lo, hi, *bad_blocks = torch.stack([c.to(torch.int64) for c in checks]).tolist()
    if lo < 1:
        raise InvalidArgumentError(f"every sequence must hold at least one token; a length is {lo}")
    if hi > capacity:
        raise InvalidArgumentError(f"a length of {hi} exceeds the capacity of {capacity} tokens per sequence")
    if bad_blocks and bad_blocks[0]:
        raise InvalidArgumentError(
            f"{bad_blocks[0]} block table entries below the lengths are outside 0..{num_blocks - 1}"
        )
    return hi


def _check_max_len(max_len, capacity: int) -> int:
    if not isinstance(max_len, int) or isinstance(max_len, bool) or not 1 <= max_len <= capacity:
        raise InvalidArgumentError(f"max_len must be an int in 1..{capacity}, got {max_len!r}")
    return max_len


def _kv_capacity(kv: BatchedKV) -> int:
    """Tokens per sequence the descriptor's K and V runs hold (the bound every length is checked against)."""
    return min(
        _run_capacity("K", kv.num_kv_heads, kv.head_dim, kv.head_stride, kv.token_stride, kv.slot_stride),
        _run_capacity("V", kv.num_kv_heads, kv.v_head_dim, kv.v_head_stride, kv.v_token_stride, kv.v_slot_stride),
    )


def _describe_contiguous(p: _C.DecodeParams, kv: BatchedKV) -> None:
    """The descriptor's addresses and strides into the kernel parameters (contiguous, not block tables)."""
    p.paged = False
    p.num_kv_heads = kv.num_kv_heads
    p.k, p.v = kv.k_ptr, kv.v_ptr
    p.token_stride, p.v_token_stride = kv.token_stride, kv.v_token_stride
    p.head_stride, p.v_head_stride = kv.head_stride, kv.v_head_stride
    p.slot_stride, p.v_slot_stride = kv.slot_stride, kv.v_slot_stride


def _check_pools(key_cache, value_cache) -> None:
    """key_cache / value_cache: dense block pools [num_blocks, block_size, num_kv_heads, head_dim] (V: its own
    head dim), alike in everything else, block_size a power of two."""
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        if not isinstance(t, torch.Tensor):
            raise InvalidArgumentError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ShapeError(f"{name} must be [num_blocks, block_size, num_kv_heads, head_dim], got {list(t.shape)}")
        if not t.is_contiguous():
            raise InvalidArgumentError(f"{name} must be contiguous (a block pool, not a view into one)")
    if (
        key_cache.shape[:3] != value_cache.shape[:3]
        or key_cache.dtype != value_cache.dtype
        or key_cache.device != value_cache.device
    ):
        raise ShapeError(
            f"key_cache {list(key_cache.shape)} {key_cache.dtype} {key_cache.device} and value_cache "
            f"{list(value_cache.shape)} {value_cache.dtype} {value_cache.device} differ"
        )
    num_blocks, block_size = key_cache.shape[:2]
    if not 1 <= value_cache.shape[3] <= 256:
        raise ShapeError(f"value_cache's head dim must be in 1..256, got {value_cache.shape[3]}")
    if block_size <= 0 or block_size & (block_size - 1):
        raise ShapeError(f"block_size (dim 1 of the caches) must be a power of two, got {block_size}")
    if num_blocks <= 0:
        raise ShapeError("the block pools hold no blocks")


def _describe_paged(p: _C.DecodeParams, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """Checked block pools' addresses and strides into the kernel parameters (block tables, not slots)."""
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    v_head_dim = value_cache.shape[3]
    p.paged = True
    p.num_kv_heads = num_kv_heads
    p.k, p.v = key_cache.data_ptr(), value_cache.data_ptr()
    p.token_stride, p.v_token_stride = num_kv_heads * head_dim, num_kv_heads * v_head_dim
    p.head_stride, p.v_head_stride = head_dim, v_head_dim
    p.block_size, p.num_blocks = block_size, num_blocks


def _run_capacity(name: str, heads: int, dim: int, head_stride: int, token_stride: int, slot_stride: int) -> int:
    """Tokens one sequence of K or V can hold with these strides (checked not to overlap)."""
    heads_apart = head_stride != dim  # head_major: each head has its own run of tokens
    row = dim if heads_apart else heads * dim
    if head_stride < dim or token_stride < row or slot_stride < 0:
        raise InvalidArgumentError(
            f"{name}'s token_stride {token_stride} / head_stride {head_stride} / slot_stride {slot_stride} "
            f"cannot hold {heads} heads of {dim}"
        )
    span = head_stride if heads_apart else slot_stride  # elements one token run may fill
    return span // token_stride if span else 2**31 - 1


def _check_extent(kv: BatchedKV, slots: list[int], lengths: list[int]) -> None:
    """The last row each sequence reaches must lie inside the memory that owns the descriptor."""
    owners = kv.owner if isinstance(kv.owner, tuple) else (kv.owner, kv.owner)  # from_tensors: (k, v)
    extents = [_owner_extent(o) for o in owners]
    if None in extents or not slots:
        return
    item = itemsize(kv.dtype)
    # (name, base, extent, head dim, head stride, token stride, slot stride) of K and of V
    tensors = (
        ("K", kv.k_ptr, extents[0], kv.head_dim, kv.head_stride, kv.token_stride, kv.slot_stride),
        ("V", kv.v_ptr, extents[1], kv.v_head_dim, kv.v_head_stride, kv.v_token_stride, kv.v_slot_stride),
    )
    for name, base, (elo, ehi), dim, hs, ts, ss in tensors:
        row = (kv.num_kv_heads - 1) * hs + dim  # first to one past the last element of a token
        first = min(slots) * ss
        last = max(s * ss + (n - 1) * ts for s, n in zip(slots, lengths)) + row
        if min(slots) < 0 or base + first * item < elo or base + last * item > ehi:
            raise InvalidArgumentError(
                f"{name} rows of the descriptor's slots and lengths fall outside the cache's memory"
            )
    if isinstance(kv.owner, _C.VirtualRange):
        # Inside the reservation is not enough: a descriptor kept past free() + reclaim, truncate() or close()
        # (or lengths edited by hand) would make the kernel read unmapped pages, a SIGSEGV on the host.
        lo = extents[0][0]
        for _, base, _, dim, hs, ts, ss in tensors:
            heads_apart = hs != dim
            runs = [h * hs for h in range(kv.num_kv_heads)] if heads_apart else [0]
            run_row = dim if heads_apart else (kv.num_kv_heads - 1) * hs + dim
            for s, n in zip(slots, lengths):
                nbytes = ((n - 1) * ts + run_row) * item
                for h in runs:
                    if not kv.owner.is_mapped(base - lo + (s * ss + h) * item, nbytes):
                        raise InvalidArgumentError(
                            f"the descriptor reaches unmapped memory (slot {s}, length {n}): it is stale; take "
                            "a fresh one with VirtualKVCache.batch() after free(), truncate() or swap_out()"
                        )


def _owner_extent(owner) -> tuple[int, int] | None:
    if isinstance(owner, torch.Tensor):
        start = owner.untyped_storage().data_ptr()
        return start, start + owner.untyped_storage().nbytes()
    if isinstance(owner, _C.VirtualRange):
        return owner.address, owner.address + owner.bytes
    return None  # unknown owner: nothing to check against


def _cache_max_len(cache, seqs: list) -> int:
    lens = [cache.seq_len(s) for s in seqs]
    for s, n in zip(seqs, lens):
        if n < 1:
            raise InvalidArgumentError(f"sequence {s} holds no tokens; decode attends over at least one")
    return max(lens, default=1)


# --------------------------------------------------------------------------------------------- launch
def _params(
    q, out, k_ptr: int, v_ptr: int, num_kv_heads: int, token_stride: int, lengths, max_len: int, scale
) -> _C.DecodeParams:
    p = _C.DecodeParams()
    p.dtype = _DTYPE_CODES[q.dtype]
    p.num_seqs, p.num_heads, p.head_dim = q.shape
    p.v_head_dim = out.shape[2]
    p.num_kv_heads = num_kv_heads
    p.q, p.out, p.k, p.v = q.data_ptr(), out.data_ptr(), k_ptr, v_ptr
    p.token_stride = token_stride
    p.lengths = lengths.data_ptr()
    p.max_tokens = max_len
    p.scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else float(scale)
    return p


def _launch(p: _C.DecodeParams, q: torch.Tensor) -> None:
    if q.device.type == "cpu":
        _C.decode_cpu(p, torch.get_num_threads())
        return
    launch = _C.CudaLaunch()
    launch.device = q.device.index
    launch.stream = torch.cuda.current_stream(q.device).cuda_stream
    launch.num_splits, launch.split_tokens = plan_cuda_splits(p.num_seqs, p.num_kv_heads, p.max_tokens, q.device)
    if launch.num_splits > 1:
        # Freed tensors return to torch's caching allocator for this stream: later work on the same stream
        # runs after the kernels, so reuse is safe without a sync.
        acc = torch.empty(
            (p.num_seqs, p.num_heads, launch.num_splits, p.v_head_dim), dtype=torch.float32, device=q.device
        )
        ml = torch.empty((p.num_seqs, p.num_heads, launch.num_splits, 2), dtype=torch.float32, device=q.device)
        launch.partial_acc, launch.partial_ml = acc.data_ptr(), ml.data_ptr()
    _C.decode_cuda(p, launch)


def plan_cuda_splits(num_seqs: int, num_kv_heads: int, max_len: int, device) -> tuple[int, int]:
    """(num_splits, split_tokens) for the CUDA kernels: one pass when the batch alone gives every SM a few
    blocks (or contexts are short); otherwise cut contexts into pieces of >= 256 tokens until it does."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    blocks = num_seqs * num_kv_heads  # thread blocks per piece (at least)
    target = 4 * sms
    if max_len <= 512 or blocks >= target:
        return 1, max_len
    pieces = min(-(-target // blocks), -(-max_len // 256))
    split_tokens = -(-max_len // pieces)
    split_tokens = -(-split_tokens // 64) * 64
    return -(-max_len // split_tokens), split_tokens


# --------------------------------------------------------------------------------------------- K/V scatter
_WRITE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    batched_kv: BatchedKV,
    rows: torch.Tensor,
    positions: torch.Tensor,
    *,
    writable_from: torch.Tensor | None = None,
    check_mapped: bool = True,
) -> None:
    """Scatter new tokens' K/V into the cache a BatchedKV describes, in one extension call.

    k [N, num_kv_heads, head_dim] and v [N, num_kv_heads, v_head_dim] (the cache's dtype and device; any row
    and head strides, each head's elements dense): row i goes to token positions[i] of sequence rows[i] of the
    descriptor (its slot batched_kv.slots[rows[i]]), through the descriptor's base pointers and strides, so
    every layout the decode kernel reads (per_layer, interleaved, head_major) is written alike. Rows naming the
    same token leave one of them there (which one is unspecified).

    Every row is checked before anything is written (in the extension, on host copies of the indices): the
    sequence index in 0..B-1, the position below that sequence's length in the descriptor (the tokens it has
    mapped) and at or above writable_from[rows[i]] when given (VirtualKVCache.writable_range(): tokens before it
    may share pages with other sequences), and the bytes inside the cache's memory. A bad row raises
    InvalidArgumentError and writes nothing. check_mapped (default) also asks the range that the descriptor's
    lengths are still mapped (a stale descriptor, kept past free() / truncate() / swap_out(), is refused);
    a caller that took the descriptor's lengths from the cache just now may skip it.

    The index tensors (rows, positions, writable_from, and the descriptor's slots and lengths) are read on the
    host: on CUDA that is a synchronisation for any that live on the device (CPU tensors avoid it; the
    descriptor's slots and lengths may be CPU tensors here). The copy runs on torch.cuda.current_stream()."""
    kv = batched_kv
    if not isinstance(kv, BatchedKV):
        raise InvalidArgumentError(f"batched_kv must be a BatchedKV (VirtualKVCache.batch()), got {type(kv).__name__}")
    if kv.dtype not in _WRITE_DTYPES:
        raise DTypeError(f"write_kv supports {', '.join(map(str, _WRITE_DTYPES))}; the cache holds {kv.dtype}")
    n = _check_rows("k", k, None, kv.num_kv_heads, kv.head_dim, kv.dtype, kv.device)
    _check_rows("v", v, n, kv.num_kv_heads, kv.v_head_dim, kv.dtype, kv.device)
    slots_h = _host(kv.slots, "the descriptor's slots")
    if slots_h.dim() != 1:
        raise ShapeError(f"the descriptor's slots must be a 1-d tensor, got {list(slots_h.shape)}")
    num_seqs = slots_h.shape[0]
    host = torch.device("cpu")
    slots_h = _index_tensor(slots_h, "the descriptor's slots", (num_seqs,), host)
    lengths_h = _index_tensor(
        _host(kv.lengths, "the descriptor's lengths"), "the descriptor's lengths", (num_seqs,), host
    )
    rows_h = _index_tensor(_host(rows, "rows"), "rows", (n,), host)
    pos_h = _index_tensor(_host(positions, "positions"), "positions", (n,), host)
    from_h = None
    if writable_from is not None:
        from_h = _index_tensor(_host(writable_from, "writable_from"), "writable_from", (num_seqs,), host)
    p = _C.WriteKVParams()
    p.itemsize = itemsize(kv.dtype)
    p.num_rows, p.num_seqs = n, num_seqs
    p.num_kv_heads, p.head_dim, p.v_head_dim = kv.num_kv_heads, kv.head_dim, kv.v_head_dim
    p.k, p.v = k.data_ptr(), v.data_ptr()
    p.k_row_stride, p.k_head_stride = k.stride(0), k.stride(1)
    p.v_row_stride, p.v_head_stride = v.stride(0), v.stride(1)
    p.k_cache, p.v_cache = kv.k_ptr, kv.v_ptr
    p.slot_stride, p.token_stride, p.head_stride = kv.slot_stride, kv.token_stride, kv.head_stride
    p.v_slot_stride, p.v_token_stride, p.v_cache_head_stride = kv.v_slot_stride, kv.v_token_stride, kv.v_head_stride
    owners = kv.owner if isinstance(kv.owner, tuple) else (kv.owner, kv.owner)  # from_tensors: (k, v)
    extents = [_owner_extent(o) for o in owners]
    if extents[0] is not None:
        p.extent_lo, p.extent_hi = extents[0]
    if extents[1] is not None:
        p.v_extent_lo, p.v_extent_hi = extents[1]
    p.slots, p.lengths, p.rows, p.positions = (
        slots_h.data_ptr(),
        lengths_h.data_ptr(),
        rows_h.data_ptr(),
        pos_h.data_ptr(),
    )
    p.writable_from = from_h.data_ptr() if from_h is not None else 0
    if check_mapped and n:
        named = sorted(set(rows_h.tolist()))
        if named and 0 <= named[0] and named[-1] < num_seqs:
            _check_extent(kv, [int(slots_h[i]) for i in named], [int(lengths_h[i]) for i in named])
    if k.device.type == "cpu":
        _C.write_kv_cpu(p, torch.get_num_threads())
        return
    _C.write_kv_check(p)  # every row, on the host copies, before anything is launched
    if n == 0:
        return
    dev = k.device
    on_dev = [t.to(dev, non_blocking=True) for t in (slots_h, lengths_h, rows_h, pos_h)]
    p.slots, p.lengths, p.rows, p.positions = (t.data_ptr() for t in on_dev)
    if from_h is not None:
        from_d = from_h.to(dev, non_blocking=True)
        p.writable_from = from_d.data_ptr()
    _C.write_kv_cuda(p, dev.index, torch.cuda.current_stream(dev).cuda_stream)


def _check_rows(name: str, t, n: int | None, heads: int, dim: int, dtype: torch.dtype, device) -> int:
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    rows = t.shape[0] if t.dim() == 3 else -1
    if t.dim() != 3 or tuple(t.shape[1:]) != (heads, dim) or (n is not None and rows != n):
        want = f"[{n if n is not None else 'N'}, {heads}, {dim}]"
        raise ShapeError(f"{name} must be {want} (rows, kv heads, head dim), got {list(t.shape)}")
    if t.dtype != dtype:
        raise DTypeError(f"{name} has dtype {t.dtype}, the cache holds {dtype}")
    if t.device != device:
        raise InvalidArgumentError(f"{name} is on {t.device}, the cache on {device}")
    if (dim > 1 and t.stride(2) != 1) or min(t.stride()) < 0:
        raise InvalidArgumentError(f"each head's row of {name} must be dense, got strides {t.stride()}")
    return rows


def _host(t, name: str):
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t.cpu()
