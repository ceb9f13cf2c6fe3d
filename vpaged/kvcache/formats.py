"""KVFormat: how a cache stores K/V. The model's own dtype, or a quantized format with its scales.

A cache takes K/V in the model's dtype and, with `kv_dtype=` one of the formats below, stores them in fewer
bytes; readers get them back through dequantize():

  torch.float8_e4m3fn, torch.float8_e5m2   one byte per element and one scale per layer for K and one for V
                                           (value = float(x) * scale): given, 1.0, or calibrated from the
                                           first write of each layer (scales="calibrate": amax / fp8 max).
  torch.int8                               one byte per element and a float32 scale per token and KV head
                                           (symmetric: value = x * scale, scale = amax / 127).

Scales that belong to tokens live beside them: each KV head's row of head_dim int8 values is followed by its
4-byte scale in the same row, so whatever moves a token's bytes (fork, copy-on-write, prefix sharing, swap,
reorder, truncate, a block copy) moves its scale with it, and an unmapped page takes its scales along. A
quantized cache is therefore, to the memory layers below, a cache of 1-byte elements with rows of
`storage_dim(head_dim)` bytes (head_dim + 4 for int8); only this module and the kernels know what the bytes
mean. Per-layer fp8 scales belong to the cache (its `kv_scales`, [num_layers, 2] float32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import DTypeError, InvalidArgumentError, ShapeError

MODEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
QUANTIZED_DTYPES = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)
NAMES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
INT8_SCALE_BYTES = 4  # a float32 per token and KV head, after the head's int8 row
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def resolve_kv_dtype(kv_dtype, dtype: torch.dtype) -> torch.dtype:
    """A cache's stored element type: `dtype` when kv_dtype is None (or the same), else a quantized format,
    given as a torch dtype or by name ("int8", "fp8" = "fp8_e4m3", "fp8_e5m2", "auto" = the model dtype)."""
    if kv_dtype is None or kv_dtype == "auto":
        return dtype
    if isinstance(kv_dtype, str):
        try:
            kv_dtype = NAMES[kv_dtype]
        except KeyError:
            names = ", ".join(["auto", *NAMES])
            raise DTypeError(f"unknown kv_dtype {kv_dtype!r}; use one of {names} or a torch dtype") from None
    if not isinstance(kv_dtype, torch.dtype):
        raise DTypeError(f"kv_dtype must be a torch dtype or a name, got {kv_dtype!r}")
    if kv_dtype == dtype:
        return dtype
    if kv_dtype not in QUANTIZED_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in QUANTIZED_DTYPES)
        raise DTypeError(f"kv_dtype {kv_dtype} is neither the model dtype ({dtype}) nor a quantized format ({names})")
    if dtype not in MODEL_DTYPES:
        raise DTypeError(f"a quantized cache takes K/V of a float dtype, got {dtype}")
    return kv_dtype


@dataclass(frozen=True)
class KVFormat:
    """What a cache stores (`kv_dtype`) for K/V given in `dtype` (the model's)."""

    dtype: torch.dtype
    kv_dtype: torch.dtype

    @classmethod
    def of(cls, dtype: torch.dtype, kv_dtype=None) -> KVFormat:
        return cls(dtype, resolve_kv_dtype(kv_dtype, dtype))

    @property
    def quantized(self) -> bool:
        return self.kv_dtype != self.dtype

    @property
    def is_int8(self) -> bool:
        return self.kv_dtype == torch.int8

    @property
    def is_fp8(self) -> bool:
        return self.kv_dtype in FP8_MAX

    @property
    def name(self) -> str:
        return {torch.int8: "int8", torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}.get(
            self.kv_dtype, str(self.kv_dtype).removeprefix("torch.")
        )

    @property
    def storage_dtype(self) -> torch.dtype:
        """The element type the memory layers see: bytes for a quantized format."""
        return torch.uint8 if self.quantized else self.dtype

    @property
    def scale_bytes(self) -> int:
        """Bytes of scale after each head's row (int8: a float32 per token and head)."""
        return INT8_SCALE_BYTES if self.is_int8 else 0

    def storage_dim(self, dim: int) -> int:
        """Elements of storage_dtype per head's row of `dim` values (scale included)."""
        return dim + self.scale_bytes

    def row_bytes(self, dim: int) -> int:
        """Bytes one head's row of `dim` values takes, scale included."""
        return dim * self.storage_dtype.itemsize + self.scale_bytes

    def check_dims(self, head_dim: int, v_head_dim: int) -> None:
        if self.is_int8 and (head_dim % 4 or v_head_dim % 4):
            raise ShapeError(
                f"int8 K/V keep a float32 scale after each head's row: head dims must be multiples of 4, got "
                f"{head_dim} / {v_head_dim}"
            )

    # --------------------------------------------------------------------------------- rows <-> values
    def quantize(self, x: torch.Tensor, scale: torch.Tensor | float | None = None) -> torch.Tensor:
        """x [..., dim] in the model dtype -> storage rows [..., storage_dim(dim)] (uint8 when quantized).
        fp8: `scale` is the layer's K or V scale (values are divided by it and saturate at the format's
        max); int8 computes a scale per row."""
        if not self.quantized:
            return x
        if self.is_int8:
            xf = x.float()
            amax = xf.abs().amax(dim=-1, keepdim=True)
            row_scale = amax / 127.0
            q = torch.where(row_scale > 0, xf / torch.where(row_scale > 0, row_scale, 1.0), 0.0)
            q = q.round_().clamp_(-127, 127).to(torch.int8)
            return torch.cat([q.view(torch.uint8), row_scale.contiguous().view(torch.uint8)], dim=-1)
        limit = FP8_MAX[self.kv_dtype]
        s = 1.0 if scale is None else scale
        xf = (x.float() / s).clamp_(-limit, limit)
        return xf.to(self.kv_dtype).view(torch.uint8)

    def split(self, rows: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Storage rows [..., storage_dim(dim)] -> (values [..., dim] as kv_dtype, int8: scales [..., 1]
        float32; else None). Views, no copy (of a view of the cache: views of the cache)."""
        if not self.quantized:
            return rows, None
        data = rows[..., :dim].view(self.kv_dtype)  # same item size: a view whatever the strides
        if not self.is_int8:
            return data, None
        return data, _as_float32(rows[..., dim : dim + INT8_SCALE_BYTES])

    def dequantize(
        self, rows: torch.Tensor, dim: int, scale: torch.Tensor | float | None = None, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """Storage rows -> values [..., dim] in `dtype` (default: the model dtype), a new tensor. fp8:
        `scale` is the layer's K or V scale."""
        dtype = self.dtype if dtype is None else dtype
        if not self.quantized:
            return rows.to(dtype, copy=True)
        data, row_scale = self.split(rows, dim)
        if row_scale is not None:
            return (data.float() * row_scale).to(dtype)
        out = data.float()
        if scale is not None and not (isinstance(scale, float) and scale == 1.0):
            out = out * scale
        return out.to(dtype)


def _as_float32(b: torch.Tensor) -> torch.Tensor:
    """[..., 4] bytes -> [..., 1] float32. A view when the bytes are aligned and the last dim dense (always
    so in a cache's rows, whose head dims are multiples of 4); else a copy."""
    try:
        return b.view(torch.float32)
    except RuntimeError:
        return b.contiguous().view(torch.float32)


@dataclass(frozen=True)
class QuantizedKV:
    """K or V of a quantized cache as stored: `data` [..., dim] (torch.int8 or a float8 dtype, a view of the
    cache's memory) and `scale` (int8: [..., 1] float32 per token and head, a view beside the data; fp8: the
    layer's 0-d float32 scale). value = data * scale; dequantize() gives them in the model dtype (a copy)."""

    data: torch.Tensor
    scale: torch.Tensor
    format: KVFormat

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return (self.data.float() * self.scale).to(self.format.dtype if dtype is None else dtype)


def check_scales(scales, num_layers: int, fmt: KVFormat) -> torch.Tensor | None:
    """The cache's per-layer (K, V) scales as a float32 [num_layers, 2] tensor on the CPU (None for a
    format without per-layer scales). `scales`: None (1.0), a float, a (k, v) pair, a [num_layers, 2]
    tensor / nested list, or "calibrate": NaN until each layer's first write sets its scales from what it
    writes (layer_scale). Only fp8 formats take scales."""
    if scales is None:
        return torch.ones(num_layers, 2) if fmt.is_fp8 else None
    if not fmt.is_fp8:
        raise InvalidArgumentError(
            f"kv_scales apply to fp8 K/V only (this cache stores {fmt.name}"
            + ("; int8 keeps a scale per token and head" if fmt.is_int8 else "")
            + ")"
        )
    if isinstance(scales, str):
        if scales != "calibrate":
            raise InvalidArgumentError(f"kv_scales must be numbers or 'calibrate', got {scales!r}")
        return torch.full((num_layers, 2), float("nan"))
    if isinstance(scales, (int, float)) and not isinstance(scales, bool):
        t = torch.full((num_layers, 2), float(scales))
    else:
        try:
            t = torch.as_tensor(scales, dtype=torch.float32).detach().cpu().clone()
        except (TypeError, ValueError, RuntimeError) as e:
            raise InvalidArgumentError(f"kv_scales: {e}") from None
        if t.shape == (2,):
            t = t.expand(num_layers, 2).clone()
        if t.shape != (num_layers, 2):
            raise ShapeError(f"kv_scales must be a float, a (k, v) pair or [{num_layers}, 2], got {list(t.shape)}")
    if not bool(torch.isfinite(t).all()) or bool((t <= 0).any()):
        raise InvalidArgumentError("kv_scales must be finite and positive")
    return t.float()


def calibrated_scale(x: torch.Tensor, fmt: KVFormat) -> float:
    """The fp8 scale that maps x's largest magnitude to the format's max (1.0 for all-zero x)."""
    amax = float(x.detach().abs().max()) if x.numel() else 0.0
    return amax / FP8_MAX[fmt.kv_dtype] if amax > 0 and amax == amax else 1.0


def layer_scale(scales: torch.Tensor | None, kv: int, x: torch.Tensor, fmt: KVFormat) -> float | None:
    """The fp8 scale to quantize x (K: kv=0, V: kv=1) with: scales[kv] of the layer's [2] scales, set first
    from x when still NaN (calibration by the layer's first write). None for formats without one."""
    if scales is None:
        return None
    s = float(scales[kv])
    if s != s:  # NaN: not calibrated yet
        s = calibrated_scale(x, fmt)
        scales[kv] = s
    return s


def read_scale(scales: torch.Tensor | None, kv: int) -> float:
    """The fp8 scale a kernel reads a layer with (1.0 before calibration: nothing written yet)."""
    if scales is None:
        return 1.0
    s = float(scales[kv])
    return 1.0 if s != s else s
