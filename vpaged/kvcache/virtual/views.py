"""SlotViews: zero-copy torch views and decode-kernel descriptors over a VirtualKVCache's range.

Stateless beyond what it is built with (the range, the layout, dtype and device): the cache decides which
tokens may be viewed (lengths, the write contract), this module turns slots and token spans into tensors.
The C++ range refuses any view that would reach unmapped memory and pins the pages of each view it makes.
"""

from __future__ import annotations

import numpy as np
import torch

from ...errors import InvalidArgumentError
from ...memory.dtypes import storage_dlpack_code
from ..formats import KVFormat
from ..records import BatchedKV
from .layout import Layout


class SlotViews:
    """Views of stored rows. For a quantized format (kvcache/formats.py) the memory holds bytes: tokens() and
    layers() view them as uint8 rows (scales included), values() as QuantizedKV, write() quantizes."""

    def __init__(self, vrange, layout: Layout, fmt: KVFormat | torch.dtype, device: torch.device, scales=None):
        if isinstance(fmt, torch.dtype):  # plain values of that dtype
            fmt = KVFormat(fmt, fmt)
        self.range, self.layout, self.format, self.device = vrange, layout, fmt, device
        self.dtype = fmt.storage_dtype
        self.scales = scales  # fp8: [num_layers, 2] (K, V) per layer
        self._dl_code, self._dl_bits = storage_dlpack_code(self.dtype)

    def tokens(self, layer: int, kv: int, slot: int, start: int, n: int) -> torch.Tensor:
        """K (kv=0) or V (kv=1) of tokens start..start+n-1 of a slot as a [n, kv_heads, dim] view (dim: the
        layout's head_dim for K, v_head_dim for V)."""
        shape, strides, perm = self.layout.view_dims(n, kv)
        return self._make(self.layout.offset(layer, kv, slot, start), shape, strides).permute(perm)

    def values(self, layer: int, kv: int, slot: int, start: int, n: int):
        """tokens() as the values they stand for: the view itself, or a QuantizedKV of views."""
        rows = self.tokens(layer, kv, slot, start, n)
        return self.as_values(rows, layer, kv)

    def as_values(self, rows: torch.Tensor, layer: int, kv: int):
        scales = self.scales[layer] if self.scales is not None else None
        return self.format.values(rows, self.value_dim(kv), scales, kv)

    def value_dim(self, kv: int) -> int:
        """Head size of the values of K (kv=0) or V (kv=1): the stored row's less its scale."""
        return self.layout.dim(kv) - self.format.scale_bytes

    def write(self, layer: int, slot: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v (values in the model dtype, [n, heads, dim]) at tokens start.. of a slot."""
        n = k.shape[0]
        for kv, x in ((0, k), (1, v)):
            rows = self.tokens(layer, kv, slot, start, n)
            if self.format.quantized:
                scales = self.scales[layer] if self.scales is not None else None
                x = self.format.quantize_kv(x, scales, kv)
            rows.copy_(x)

    def rows(self, layer: int, slots: list[int], lengths: list[int], length: int | None):
        """(K, V) of evenly spaced slots as [B, length, kv_heads, dim] views; length defaults to the
        slots' common length and may not exceed the shortest."""
        step = slots[1] - slots[0] if len(slots) > 1 else 1
        if step <= 0 or any(b - a != step for a, b in zip(slots, slots[1:])):
            raise InvalidArgumentError(f"kv_batch needs sequences in evenly spaced increasing slots, got {slots}")
        if length is None:
            if len(set(lengths)) != 1:
                raise InvalidArgumentError(f"sequences differ in length {lengths}; pass length <= {min(lengths)}")
            length = lengths[0]
        if not 0 <= length <= min(lengths):
            raise InvalidArgumentError(f"length {length} outside 0..{min(lengths)} (shortest sequence)")
        return tuple(self._rows_of(layer, kv, slots[0], step, len(slots), length) for kv in (0, 1))

    def _rows_of(self, layer: int, kv: int, first: int, step: int, batch: int, length: int) -> torch.Tensor:
        lay = self.layout
        shape, strides, perm = lay.view_dims(length, kv)
        shape, strides = [batch] + shape, [step * lay.slot_stride] + strides
        perm = (0,) + tuple(p + 1 for p in perm)
        return self._make(lay.offset(layer, kv, first), shape, strides).permute(perm)

    def descriptor(self, layer: int, slots: list[int], lengths: list[int]) -> BatchedKV:
        lay = self.layout
        base = self.range.address
        values = {}  # V's own head size and strides, where they differ from K's (None in BatchedKV: the same)
        if lay.v_head_dim != lay.head_dim:
            values = dict(v_head_dim=lay.v_head_dim, v_head_stride=lay.head_stride_of(1))
        # One array for both (each torch.tensor() from a list costs several µs), moved to the device once.
        rows = torch.from_numpy(np.array([slots, lengths], dtype=np.int32).reshape(2, len(slots)))
        if self.device.type != "cpu":
            rows = rows.to(self.device)
        return BatchedKV(
            k_ptr=base + lay.base_offset(layer, 0),
            v_ptr=base + lay.base_offset(layer, 1),
            slots=rows[0],
            lengths=rows[1],
            slot_stride=lay.slot_stride,
            token_stride=lay.token_stride,
            head_stride=lay.head_stride,
            num_kv_heads=lay.num_kv_heads,
            head_dim=lay.head_dim,
            dtype=self.dtype,
            device=self.device,
            layout=lay.kind,
            owner=self.range,
            kv_format=self.format if self.format.quantized else None,
            kv_scales=self.scales[layer] if self.scales is not None else None,
            **values,
        )

    def layers(self, slot: int, start: int, n: int) -> torch.Tensor:
        """K/V of tokens start..start+n-1 of a slot in every layer as one [num_layers, 2, n, kv_heads,
        head_dim] view ([:, 0] is K, [:, 1] is V)."""
        lay = self.layout
        if lay.v_head_dim != lay.head_dim:
            raise InvalidArgumentError("kv_layers(): K and V differ in head size here; use kv() per layer")
        shape, strides, perm = lay.view_dims(n)
        # K and V of layer l start at base_offset(l, 0) and base_offset(l, 1): whole regions apart (per_layer,
        # head_major) or columns of one token row (interleaved); kv_stride apart in every layout.
        kv_stride = (lay.base_offset(0, 1) - lay.base_offset(0, 0)) // lay.itemsize
        dims = [(2 * kv_stride, lay.num_layers, 0), (kv_stride, 2, 1)]
        dims += [(strides[i], shape[i], 2 + perm.index(i)) for i in range(len(shape))]
        dims.sort(key=lambda d: -d[0])  # the core takes dims in memory order, largest stride first
        view = self._make(lay.offset(0, 0, slot, start), [d[1] for d in dims], [d[0] for d in dims])
        order = [d[2] for d in dims]
        return view.permute([order.index(j) for j in range(len(order))])

    def _make(self, offset: int, shape, strides) -> torch.Tensor:
        return torch.from_dlpack(self.range.view(offset, shape, strides, self._dl_code, self._dl_bits))
