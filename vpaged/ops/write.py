"""write_kv: scatter a step's new K/V rows into a cache through a BatchedKV, one extension call per layer; WritePlan:
the same for every layer of a step, its index tensors checked once."""

from __future__ import annotations

import torch

from .. import _C
from ..errors import DTypeError, InvalidArgumentError, ShapeError
from ..kvcache.checks import index_tensor
from ..kvcache.records import BatchedKV
from ..memory.dtypes import itemsize
from .checks import check_extent, owner_extent

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
    same token leave one of them there (which one is unspecified). For a quantized cache (batched_kv.kv_format
    set) k and v are values in the model dtype with the value head dims: they are quantized here (int8: a scale
    per row; fp8: the layer's scales, calibrated by its first write when asked to) and scattered as bytes.

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
    WritePlan([batched_kv], rows, positions, writable_from=writable_from, check_mapped=check_mapped).write(0, k, v)


class WritePlan:
    """write_kv for one step over several descriptors of the same sequences (one per layer of a cache: the same
    slots and lengths, each its own memory), the index tensors checked and copied to the host once, then
    write(i, k, v) per descriptor.

    Why: a step writes every layer through the same rows and positions, and write_kv checks and copies them on
    every call; one plan per step takes a 30-layer step's writes in 0.87-0.92x write_kv's time (~1 ms a step at
    batch 1-32 on a 2-core Zen 3, SmolLM2's K/V shape: benchmarks/bench_write_plan.py). What write_kv checks per
    call is checked here once at construction (the index
    tensors, the descriptors' dtypes, check_mapped per descriptor); write() checks k and v against its descriptor,
    and the extension checks every row against the bounds before writing, as write_kv's does. The descriptors must
    share their slots and lengths (InvalidArgumentError otherwise); a plan is for one step: build a new one when
    the sequences change."""

    __slots__ = ("_descriptors", "_host", "_n", "_num_seqs", "_params", "_device_index")

    def __init__(
        self,
        descriptors,
        rows: torch.Tensor,
        positions: torch.Tensor,
        *,
        writable_from: torch.Tensor | None = None,
        check_mapped: bool = True,
    ):
        descriptors = list(descriptors) if isinstance(descriptors, (list, tuple)) else descriptors
        if not isinstance(descriptors, list) or not descriptors:
            raise InvalidArgumentError("descriptors must be a non-empty list of BatchedKV (VirtualKVCache.batch())")
        for kv in descriptors:
            if not isinstance(kv, BatchedKV):
                raise InvalidArgumentError(
                    f"batched_kv must be a BatchedKV (VirtualKVCache.batch()), got {type(kv).__name__}"
                )
            if kv.kv_format is None and kv.dtype not in _WRITE_DTYPES:
                raise DTypeError(f"write_kv supports {', '.join(map(str, _WRITE_DTYPES))}; the cache holds {kv.dtype}")
        first = descriptors[0]
        slots_h = _host(first.slots, "the descriptor's slots")
        if slots_h.dim() != 1:
            raise ShapeError(f"the descriptor's slots must be a 1-d tensor, got {list(slots_h.shape)}")
        num_seqs = slots_h.shape[0]
        host = torch.device("cpu")
        slots_h = index_tensor(slots_h, "the descriptor's slots", (num_seqs,), host)
        lengths_h = index_tensor(
            _host(first.lengths, "the descriptor's lengths"), "the descriptor's lengths", (num_seqs,), host
        )
        for kv in descriptors[1:]:
            same = kv.slots is first.slots and kv.lengths is first.lengths
            if not same and not (
                isinstance(kv.slots, torch.Tensor)
                and isinstance(kv.lengths, torch.Tensor)
                and torch.equal(kv.slots.cpu().long(), slots_h.long())
                and torch.equal(kv.lengths.cpu().long(), lengths_h.long())
            ):
                raise InvalidArgumentError("the descriptors of a WritePlan must hold the same slots and lengths")
        if not isinstance(rows, torch.Tensor):
            raise InvalidArgumentError(f"rows must be a torch.Tensor, got {type(rows).__name__}")
        n = rows.shape[0] if rows.dim() == 1 else -1
        if n < 0:
            raise ShapeError(f"rows must be a 1-d tensor, got {list(rows.shape)}")
        rows_h = index_tensor(_host(rows, "rows"), "rows", (n,), host)
        pos_h = index_tensor(_host(positions, "positions"), "positions", (n,), host)
        from_h = None
        if writable_from is not None:
            from_h = index_tensor(_host(writable_from, "writable_from"), "writable_from", (num_seqs,), host)
        if check_mapped and n:
            named = sorted(set(rows_h.tolist()))
            if named and 0 <= named[0] and named[-1] < num_seqs:
                for kv in descriptors:
                    check_extent(kv, [int(slots_h[i]) for i in named], [int(lengths_h[i]) for i in named])
        self._descriptors = descriptors
        self._host = (slots_h, lengths_h, rows_h, pos_h, from_h)
        self._n, self._num_seqs = n, num_seqs
        self._params: list = [None] * len(descriptors)
        self._device_index = None  # the index tensors on a CUDA cache's device and stream, copied at the first write

    def write(self, i: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Scatter k and v ([N, num_kv_heads, head_dim] / [N, num_kv_heads, v_head_dim], N the plan's rows) into
        descriptor i's memory, as write_kv does."""
        kv = self._descriptors[i]
        fmt = kv.kv_format
        if fmt is not None:
            # A quantized cache: values in the model dtype are quantized here (int8: a scale per row, stored
            # after it; fp8: the layer's scales, calibrated by its first write), then scattered as bytes.
            head_dim, v_head_dim = kv.value_head_dims
            _check_rows("k", k, self._n, kv.num_kv_heads, head_dim, kv.value_dtype, kv.device)
            _check_rows("v", v, self._n, kv.num_kv_heads, v_head_dim, kv.value_dtype, kv.device)
            k, v = fmt.quantize_kv(k, kv.kv_scales, 0), fmt.quantize_kv(v, kv.kv_scales, 1)
        _check_rows("k", k, self._n, kv.num_kv_heads, kv.head_dim, kv.dtype, kv.device)
        _check_rows("v", v, self._n, kv.num_kv_heads, kv.v_head_dim, kv.dtype, kv.device)
        p = self._params[i]
        if p is None:
            p = self._params[i] = self._descriptor_params(kv)
        p.k, p.v = k.data_ptr(), v.data_ptr()
        p.k_row_stride, p.k_head_stride = k.stride(0), k.stride(1)
        p.v_row_stride, p.v_head_stride = v.stride(0), v.stride(1)
        if k.device.type == "cpu":
            _C.write_kv_cpu(p, torch.get_num_threads())
            return
        slots_h, lengths_h, rows_h, pos_h, from_h = self._host
        p.slots, p.lengths, p.rows, p.positions = (t.data_ptr() for t in (slots_h, lengths_h, rows_h, pos_h))
        p.writable_from = from_h.data_ptr() if from_h is not None else 0
        _C.write_kv_check(p)  # every row, on the host copies, before anything is launched
        if self._n == 0:
            return
        dev = k.device
        stream = torch.cuda.current_stream(dev)
        # The index tensors go to the device once per stream: a write on the stream that copied them is ordered
        # after the copy; another stream gets its own copy.
        if self._device_index is None or self._device_index[0] != (dev, stream.cuda_stream):
            on_dev = [None if t is None else t.to(dev, non_blocking=True) for t in self._host]
            self._device_index = ((dev, stream.cuda_stream), on_dev)
        d_slots, d_lengths, d_rows, d_pos, d_from = self._device_index[1]
        p.slots, p.lengths, p.rows, p.positions = (t.data_ptr() for t in (d_slots, d_lengths, d_rows, d_pos))
        p.writable_from = d_from.data_ptr() if d_from is not None else 0
        _C.write_kv_cuda(p, dev.index, stream.cuda_stream)

    def _descriptor_params(self, kv: BatchedKV):
        """The extension's parameters for descriptor kv: its memory, strides and extents and the host index
        tensors (the sources' pointers and strides are set per write)."""
        slots_h, lengths_h, rows_h, pos_h, from_h = self._host
        p = _C.WriteKVParams()
        p.itemsize = kv.dtype.itemsize if kv.kv_format is not None else itemsize(kv.dtype)
        p.num_rows, p.num_seqs = self._n, self._num_seqs
        p.num_kv_heads, p.head_dim, p.v_head_dim = kv.num_kv_heads, kv.head_dim, kv.v_head_dim
        p.k_cache, p.v_cache = kv.k_ptr, kv.v_ptr
        p.slot_stride, p.token_stride, p.head_stride = kv.slot_stride, kv.token_stride, kv.head_stride
        p.v_slot_stride, p.v_token_stride, p.v_cache_head_stride = kv.v_slot_stride, kv.v_token_stride, kv.v_head_stride
        owners = kv.owner if isinstance(kv.owner, tuple) else (kv.owner, kv.owner)  # from_tensors: (k, v)
        extents = [owner_extent(o) for o in owners]
        if extents[0] is not None:
            p.extent_lo, p.extent_hi = extents[0]
        if extents[1] is not None:
            p.v_extent_lo, p.v_extent_hi = extents[1]
        p.slots, p.lengths, p.rows, p.positions = (t.data_ptr() for t in (slots_h, lengths_h, rows_h, pos_h))
        p.writable_from = from_h.data_ptr() if from_h is not None else 0
        return p


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
