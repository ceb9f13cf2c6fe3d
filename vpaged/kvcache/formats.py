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
mean. Per-layer fp8 scales belong to the cache (its `kv_scales`, [num_layers, 2] float32); what they mean is the
format's: which scales a cache takes (check_scales), which one a write quantizes with (write_scale, calibrating a
layer at its first write), which one a reader or a kernel dequantizes with (read_scale, kernel_scales).

One class per scheme behind one interface (KVFormat: PlainFormat, Int8Format, Fp8Format), so that callers ask
the format and never branch on its kind; KVFormat(dtype, kv_dtype) and KVFormat.of() give the scheme's class.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..errors import DTypeError, InvalidArgumentError, ShapeError

MODEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
QUANTIZED_DTYPES = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)
NAMES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
INT8_SCALE_BYTES = 4  # a float32 per token and KV head, after the head's int8 row
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def _resolve_kv_dtype(kv_dtype, dtype: torch.dtype) -> torch.dtype:
    """A cache's stored element type (the one place a kv_dtype is resolved; elsewhere KVFormat(dtype,
    kv_dtype).kv_dtype): `dtype` when kv_dtype is None (or the same), else a quantized format,
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
    """What a cache stores (`kv_dtype`) for K/V given in `dtype` (the model's). Constructing KVFormat gives the
    instance of its scheme's class (PlainFormat, Int8Format or Fp8Format); the methods below are the scheme's.

    `layer_scales` below is one layer's [2] (K, V) scales of the cache's `kv_scales` (None where the cache has
    none) and `kv` picks K (0) or V (1)."""

    dtype: torch.dtype
    kv_dtype: torch.dtype

    quantized: ClassVar[bool] = False
    scale_bytes: ClassVar[int] = 0  # bytes of scale after each head's row (int8: a float32 per token and head)

    def __new__(cls, *args, **kwargs):
        if cls is KVFormat:  # the scheme's class, from the same arguments as __init__'s
            dtype = args[0] if args else kwargs.get("dtype")
            kv_dtype = args[1] if len(args) > 1 else kwargs.get("kv_dtype")
            cls = _scheme_class(_resolve_kv_dtype(kv_dtype, dtype))
        return super().__new__(cls)

    def __post_init__(self):
        kv_dtype = _resolve_kv_dtype(self.kv_dtype, self.dtype)
        if _scheme_class(kv_dtype) is not type(self):
            raise DTypeError(f"{type(self).__name__} does not store {kv_dtype}")
        object.__setattr__(self, "kv_dtype", kv_dtype)

    @classmethod
    def of(cls, dtype: torch.dtype, kv_dtype=None) -> KVFormat:
        return KVFormat(dtype, kv_dtype)

    @property
    def name(self) -> str:
        return str(self.kv_dtype).removeprefix("torch.")

    @property
    def storage_dtype(self) -> torch.dtype:
        """The element type the memory layers see: bytes for a quantized format."""
        return torch.uint8

    def storage_dim(self, dim: int) -> int:
        """Elements of storage_dtype per head's row of `dim` values (scale included)."""
        return dim + self.scale_bytes

    def row_bytes(self, dim: int) -> int:
        """Bytes one head's row of `dim` values takes, scale included."""
        return dim * self.storage_dtype.itemsize + self.scale_bytes

    def check_dims(self, head_dim: int, v_head_dim: int) -> None:
        """Raise ShapeError for head dims the stored row cannot hold."""

    # --------------------------------------------------------------------------------- rows <-> values
    def quantize(self, x: torch.Tensor, scale: torch.Tensor | float | None = None) -> torch.Tensor:
        """x [..., dim] in the model dtype -> storage rows [..., storage_dim(dim)] (uint8 when quantized).
        fp8: `scale` is the layer's K or V scale (values are divided by it and saturate at the format's
        max); int8 computes a scale per row."""
        raise NotImplementedError

    def split(self, rows: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Storage rows [..., storage_dim(dim)] -> (values [..., dim] as kv_dtype, int8: scales [..., 1]
        float32; else None). Views, no copy (of a view of the cache: views of the cache)."""
        return rows[..., :dim].view(self.kv_dtype), None  # same item size: a view whatever the strides

    def dequantize(
        self, rows: torch.Tensor, dim: int, scale: torch.Tensor | float | None = None, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """Storage rows -> values [..., dim] in `dtype` (default: the model dtype), a new tensor. fp8:
        `scale` is the layer's K or V scale."""
        raise NotImplementedError

    # --------------------------------------------------------------------------------- a cache's scales
    def check_scales(self, scales, num_layers: int) -> torch.Tensor | None:
        """The cache's per-layer (K, V) scales as a float32 [num_layers, 2] tensor on the CPU, or None for a
        format without per-layer scales (which then takes none)."""
        if scales is not None:
            raise InvalidArgumentError(
                f"kv_scales apply to fp8 K/V only (this cache stores {self.name}{self._no_scales})"
            )
        return None

    _no_scales: ClassVar[str] = ""  # why the format takes no kv_scales, for the error

    def write_scale(self, layer_scales: torch.Tensor | None, kv: int, x: torch.Tensor) -> float | None:
        """The scale quantize() takes to store x as K or V of a layer (None: the format has no layer scales)."""
        return None

    def read_scale(self, layer_scales: torch.Tensor | None, kv: int) -> float:
        """The scale a reader dequantizes K or V of a layer with (1.0 where the format has none)."""
        return 1.0

    def kernel_scales(self, layer_scales: torch.Tensor | None) -> tuple[float, float]:
        """(k_scale, v_scale) of a layer for the kernels' parameters (read at launch: calibration sets them at
        the layer's first write)."""
        return self.read_scale(layer_scales, 0), self.read_scale(layer_scales, 1)

    def quantize_kv(self, x: torch.Tensor, layer_scales: torch.Tensor | None, kv: int) -> torch.Tensor:
        """x (values in the model dtype) as the stored rows of K or V of a layer."""
        return self.quantize(x, self.write_scale(layer_scales, kv, x))

    def values(self, rows: torch.Tensor, dim: int, layer_scales: torch.Tensor | None, kv: int):
        """Stored rows of K or V of a layer as what they stand for: a QuantizedKV of views (the rows themselves
        for plain values)."""
        data, row_scale = self.split(rows, dim)
        return QuantizedKV(data, row_scale, self)

    def dequantize_kv(
        self, rows: torch.Tensor, dim: int, layer_scales: torch.Tensor | None, kv: int, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """Stored rows of K or V of a layer -> values in `dtype` (default: the model dtype), a new tensor."""
        return self.dequantize(rows, dim, self.read_scale(layer_scales, kv), dtype)


class PlainFormat(KVFormat):
    """K/V stored as given, in the model dtype."""

    @property
    def storage_dtype(self) -> torch.dtype:
        return self.dtype

    def quantize(self, x, scale=None):
        return x

    def split(self, rows, dim):
        return rows, None

    def dequantize(self, rows, dim, scale=None, dtype=None):
        return rows.to(self.dtype if dtype is None else dtype, copy=True)

    def values(self, rows, dim, layer_scales, kv):
        return rows


class Int8Format(KVFormat):
    """int8 values, symmetric, a float32 scale per token and KV head after the head's row (value = x * scale,
    scale = amax / 127)."""

    quantized = True
    scale_bytes = INT8_SCALE_BYTES
    _no_scales = "; int8 keeps a scale per token and head"

    @property
    def name(self) -> str:
        return "int8"

    def check_dims(self, head_dim, v_head_dim):
        if head_dim % 4 or v_head_dim % 4:
            raise ShapeError(
                f"int8 K/V keep a float32 scale after each head's row: head dims must be multiples of 4, got "
                f"{head_dim} / {v_head_dim}"
            )

    def quantize(self, x, scale=None):
        xf = x.float()
        amax = xf.abs().amax(dim=-1, keepdim=True)
        row_scale = amax / 127.0
        q = torch.where(row_scale > 0, xf / torch.where(row_scale > 0, row_scale, 1.0), 0.0)
        q = q.round_().clamp_(-127, 127).to(torch.int8)
        return torch.cat([q.view(torch.uint8), row_scale.contiguous().view(torch.uint8)], dim=-1)

    def split(self, rows, dim):
        return rows[..., :dim].view(torch.int8), _as_float32(rows[..., dim : dim + INT8_SCALE_BYTES])

    def dequantize(self, rows, dim, scale=None, dtype=None):
        data, row_scale = self.split(rows, dim)
        return (data.float() * row_scale).to(self.dtype if dtype is None else dtype)


class Fp8Format(KVFormat):
    """float8 e4m3 ("fn": no inf, max 448) or e5m2 values, one scale per layer for K and one for V (value =
    float(x) * scale): given, 1.0, or calibrated from the layer's first write (amax / the format's max)."""

    quantized = True

    @property
    def name(self) -> str:
        return "fp8_e4m3" if self.kv_dtype == torch.float8_e4m3fn else "fp8_e5m2"

    @property
    def max(self) -> float:
        return FP8_MAX[self.kv_dtype]

    def quantize(self, x, scale=None):
        s = 1.0 if scale is None else scale
        xf = (x.float() / s).clamp_(-self.max, self.max)
        return xf.to(self.kv_dtype).view(torch.uint8)

    def dequantize(self, rows, dim, scale=None, dtype=None):
        out = self.split(rows, dim)[0].float()
        if scale is not None and not (isinstance(scale, float) and scale == 1.0):
            out = out * scale
        return out.to(self.dtype if dtype is None else dtype)

    def check_scales(self, scales, num_layers):
        """`scales`: None (1.0), a float, a (k, v) pair, a [num_layers, 2] tensor / nested list, or "calibrate":
        NaN until each layer's first write sets its scales from what it writes (write_scale)."""
        if scales is None:
            return torch.ones(num_layers, 2)
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

    def calibrated_scale(self, x: torch.Tensor) -> float:
        """The scale that maps x's largest magnitude to the format's max (1.0 for all-zero x)."""
        amax = float(x.detach().abs().max()) if x.numel() else 0.0
        return amax / self.max if amax > 0 and amax == amax else 1.0

    def write_scale(self, layer_scales, kv, x):
        """layer_scales[kv], set first from x when still NaN (calibration by the layer's first write)."""
        if layer_scales is None:
            return None
        s = float(layer_scales[kv])
        if s != s:  # NaN: not calibrated yet
            s = self.calibrated_scale(x)
            layer_scales[kv] = s
        return s

    def read_scale(self, layer_scales, kv):
        """layer_scales[kv], 1.0 before calibration (nothing written yet)."""
        if layer_scales is None:
            return 1.0
        s = float(layer_scales[kv])
        return 1.0 if s != s else s

    def values(self, rows, dim, layer_scales, kv):
        return QuantizedKV(self.split(rows, dim)[0], layer_scales[kv], self)  # a 0-d view of the cache's scales


def _scheme_class(kv_dtype: torch.dtype) -> type[KVFormat]:
    if kv_dtype == torch.int8:
        return Int8Format
    return Fp8Format if kv_dtype in FP8_MAX else PlainFormat


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
    """fmt.check_scales(scales, num_layers): the cache's per-layer (K, V) scales (None for a format without)."""
    return fmt.check_scales(scales, num_layers)
