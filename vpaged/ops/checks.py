"""Argument checks of the kernel entries: every query, output, length, block pool and descriptor is checked
here before a kernel reads memory, so that no call reads outside a cache or past what it has mapped."""

from __future__ import annotations

import torch

from .. import _C
from ..errors import DTypeError, InvalidArgumentError, ShapeError
from ..kvcache.records import BatchedKV
from ..memory.dtypes import itemsize


def check_q(q, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
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


def check_out(out, q: torch.Tensor, v_head_dim: int) -> torch.Tensor:
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


def check_max_len(max_len, capacity: int) -> int:
    if not isinstance(max_len, int) or isinstance(max_len, bool) or not 1 <= max_len <= capacity:
        raise InvalidArgumentError(f"max_len must be an int in 1..{capacity}, got {max_len!r}")
    return max_len


def kv_capacity(kv: BatchedKV) -> int:
    """Tokens per sequence the descriptor's K and V runs hold (the bound every length is checked against)."""
    return min(
        _run_capacity("K", kv.num_kv_heads, kv.head_dim, kv.head_stride, kv.token_stride, kv.slot_stride),
        _run_capacity("V", kv.num_kv_heads, kv.v_head_dim, kv.v_head_stride, kv.v_token_stride, kv.v_slot_stride),
    )


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


def check_pools(key_cache, value_cache) -> None:
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


def check_extent(kv: BatchedKV, slots: list[int], lengths: list[int]) -> None:
    """The last row each sequence reaches must lie inside the memory that owns the descriptor."""
    owners = kv.owner if isinstance(kv.owner, tuple) else (kv.owner, kv.owner)  # from_tensors: (k, v)
    extents = [owner_extent(o) for o in owners]
    if None in extents or not slots:
        return
    item = kv.dtype.itemsize if kv.kv_format is not None else itemsize(kv.dtype)
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


def owner_extent(owner) -> tuple[int, int] | None:
    if isinstance(owner, torch.Tensor):
        start = owner.untyped_storage().data_ptr()
        return start, start + owner.untyped_storage().nbytes()
    if isinstance(owner, _C.VirtualRange):
        return owner.address, owner.address + owner.bytes
    return None  # unknown owner: nothing to check against


def cache_max_len(cache, seqs: list) -> int:
    lens = [cache.seq_len(s) for s in seqs]
    for s, n in zip(seqs, lens):
        if n < 1:
            raise InvalidArgumentError(f"sequence {s} holds no tokens; decode attends over at least one")
    return max(lens, default=1)


def check_held(seqs: list, lengths: list[int]) -> None:
    if lengths and min(lengths) < 1:
        seq = seqs[lengths.index(min(lengths))]
        raise InvalidArgumentError(f"sequence {seq} holds no tokens; decode attends over at least one")


def cpu_rows_in_place(op: str, dtypes: tuple, name: str, t, dtype: torch.dtype | None = None) -> torch.Tensor:
    """As cpu_rows, for an operand a row op updates in place: a 2-d view of t itself (never a copy), else
    InvalidArgumentError (its leading dims must merge into rows, its last dim be dense)."""
    check_cpu_operand(op, dtypes, name, t, dtype)
    if t.stride(-1) == 1:
        try:
            return t.view(-1, t.shape[-1])
        except RuntimeError:
            pass
    raise InvalidArgumentError(
        f"{name} is updated in place: its last dim must be dense and its leading dims mergeable into rows "
        f"(got shape {list(t.shape)}, strides {list(t.stride())})"
    )


def cpu_rows(op: str, dtypes: tuple, name: str, t, dtype: torch.dtype | None = None) -> torch.Tensor:
    """t as a 2-d [rows, cols] view with dense rows (a copy only where its leading dims cannot be viewed as one or
    its last dim is strided), checked for a CPU row op: a CPU tensor of one of `dtypes` (of `dtype` when given),
    a non-empty last dim, nothing autograd would record."""
    check_cpu_operand(op, dtypes, name, t, dtype)
    if t.stride(-1) != 1:
        t = t.contiguous()
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        return t.contiguous().view(-1, t.shape[-1])


def check_cpu_operand(op: str, dtypes: tuple, name: str, t, dtype: torch.dtype | None = None) -> None:
    """t is a CPU tensor of one of `dtypes` (of `dtype` when given) with a non-empty last dim that autograd would
    not record; else a typed error naming it."""
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise InvalidArgumentError(f"{name} is on {t.device}: {op} run on the CPU")
    if t.dtype not in dtypes:
        raise DTypeError(f"{name} has dtype {t.dtype}; {op} take {', '.join(map(str, dtypes))}")
    if dtype is not None and t.dtype != dtype:
        raise DTypeError(f"{name} has dtype {t.dtype}, the other operand {dtype}")
    if t.dim() == 0 or t.shape[-1] == 0:
        raise ShapeError(f"{name} needs a non-empty last dim, got shape {list(t.shape)}")
    if torch.is_grad_enabled() and t.requires_grad:
        raise InvalidArgumentError(f"{name} requires grad: {op} are for inference (no autograd)")
