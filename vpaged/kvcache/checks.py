"""Argument checks shared by the KV caches."""

from __future__ import annotations

import torch

from ..errors import DTypeError, InvalidArgumentError, LayerIndexError, ShapeError, UnknownSequenceError


def is_int(value) -> bool:
    """An int that is not a bool (True would otherwise pass as 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_positive_int(name: str, value) -> None:
    if not is_int(value) or value <= 0:
        raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")


def check_layer(layer, num_layers: int) -> None:
    if not is_int(layer) or not 0 <= layer < num_layers:
        raise LayerIndexError(f"layer {layer!r} outside 0..{num_layers - 1}")


def check_token_count(n) -> None:
    """A number of tokens to add: an int (not a bool), zero or more."""
    if not is_int(n):
        raise InvalidArgumentError(f"n must be an int, got {n!r}")
    if n < 0:
        raise InvalidArgumentError(f"n must be >= 0, got {n}")


def write_start(start, n: int, length: int) -> int:
    """The first token of a write of n tokens into a sequence of `length` tokens (default: its last n)."""
    if start is None:
        start = length - n
    if not is_int(start):
        raise InvalidArgumentError(f"start must be an int, got {start!r}")
    if start < 0 or start + n > length:
        raise InvalidArgumentError(
            f"tokens {start}..{start + n - 1} outside the sequence's 0..{length - 1}; extend() first"
        )
    return start


def check_token_span(start, stop, length: int) -> None:
    """start..stop-1: ints with 0 <= start <= stop <= length."""
    for name, value in (("start", start), ("stop", stop)):
        if not is_int(value):
            raise InvalidArgumentError(f"{name} must be an int, got {value!r}")
    if not 0 <= start <= stop <= length:
        raise InvalidArgumentError(f"tokens {start}..{stop - 1} outside the sequence's 0..{length - 1}")


def check_kv(
    k, v, dtype: torch.dtype, num_kv_heads: int, head_dim: int, device: torch.device, v_head_dim: int | None = None
) -> None:
    """k and v: tensors of the cache's dtype and device, [n, num_kv_heads, head_dim] and
    [n, num_kv_heads, v_head_dim] (v_head_dim default: head_dim)."""
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    for name, t, dim in (("k", k, head_dim), ("v", v, v_head_dim)):
        if not isinstance(t, torch.Tensor):
            raise InvalidArgumentError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != dtype:
            raise DTypeError(f"{name} has dtype {t.dtype}, the cache holds {dtype}")
        if t.dim() != 3 or tuple(t.shape[1:]) != (num_kv_heads, dim):
            raise ShapeError(f"{name} must be [n, {num_kv_heads}, {dim}], got {list(t.shape)}")
        if t.device != device:
            raise InvalidArgumentError(f"{name} is on {t.device}, the cache on {device}")
    if k.shape[0] != v.shape[0]:
        raise ShapeError(f"k {list(k.shape)} and v {list(v.shape)} differ in token count")


def lookup_sequence(table: dict, seq, next_id: int):
    """table[seq] for a live sequence id; ids below next_id that are gone were freed."""
    try:
        return table[seq]
    except (KeyError, TypeError):
        pass
    if isinstance(seq, int) and 0 <= seq < next_id:
        raise UnknownSequenceError(f"sequence {seq} has been freed")
    raise UnknownSequenceError(f"no sequence {seq!r} in this cache")


# The element types vpaged's decode kernels read (a BatchedKV is made for them; write_kv also takes float64).
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def index_tensor(t, name: str, shape: tuple, device: torch.device) -> torch.Tensor:
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


def check_lengths(
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


def check_kernel_dtype(dtype: torch.dtype, what: str) -> None:
    if dtype not in KERNEL_DTYPES:
        raise DTypeError(f"{what} holds {dtype}; decode kernels support float32, float16 and bfloat16")
