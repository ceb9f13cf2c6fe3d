"""A linear layer's product for few rows on the CPU, from a weight packed once in column panels.

    packed = pack_panels(weight)            # once: a PanelWeight, panels [ceil(out / 16), in, 16] of the weight's dtype
    y = panel_linear(x, packed, bias)       # x @ weight.T + bias, in x's dtype

At decode batch sizes a layer's product reads its whole weight for a few rows: the weight streams from memory and
the rows' arithmetic is small. General GEMM libraries block for large products; this kernel
(csrc/kernels/linear_cpu.cpp) reads each 16-output panel once per call, k-major, while every row takes its
products from it, so the weight streams near the memory's rate (on a 2-core Zen 3, SmolLM2-135M's 30 layers at 8
rows in 0.6x oneDNN's packed time: benchmarks/bench_linear.py). vpaged.hf.prepack packs its layers for it where
vpaged's kernels run their AVX2 path (prepack.linear_plan()).

float32 and bfloat16 rows and weights, any mix: bf16 weights are widened in registers (exact), so a bf16 model
streams half the bytes even on CPUs without bf16 arithmetic. Every output is one fp32 sum in k order (bf16 x and
weights widened to fp32 first), bias added, rounded once to x's dtype. Inference only (no autograd). On CPUs with
AVX2 the AVX2 build runs (AVX-512 CPUs included), elsewhere the portable one; isa= forces a path as the decode
kernels' does.
"""

from __future__ import annotations

import torch

from .. import _C
from ..errors import DTypeError, InvalidArgumentError, ShapeError
from .checks import cpu_rows
from .launch import DTYPE_CODES

PANEL_WIDTH = int(_C.LINEAR_PANEL_WIDTH)
LINEAR_DTYPES = (torch.float32, torch.bfloat16)
DTYPE_CODES_LINEAR = {d: DTYPE_CODES[d] for d in LINEAR_DTYPES}


class PanelWeight:
    """A weight packed in panels by pack_panels: `panels` [ceil(out / 16), in, 16] (element [p, k, j] =
    weight[16p + j, k], zero past out_features) of the weight's dtype, and the sizes panel_linear checks calls
    against. Read-only: the kernel trusts the sizes to match the panels' memory."""

    __slots__ = ("_panels", "_out_features", "_in_features", "_code")

    def __init__(self, panels: torch.Tensor, out_features: int, in_features: int):
        self._panels, self._out_features, self._in_features = panels, out_features, in_features
        self._code = DTYPE_CODES[panels.dtype]

    panels = property(lambda self: self._panels)
    out_features = property(lambda self: self._out_features)
    in_features = property(lambda self: self._in_features)
    dtype = property(lambda self: self._panels.dtype)

    def __repr__(self) -> str:
        return f"PanelWeight(out_features={self._out_features}, in_features={self._in_features}, dtype={self.dtype})"


def pack_panels(weight: torch.Tensor) -> PanelWeight:
    """weight [out_features, in_features] packed in 16-output panels (a new tensor of the weight's dtype)."""
    if not isinstance(weight, torch.Tensor):
        raise InvalidArgumentError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if weight.device.type != "cpu":
        raise InvalidArgumentError(f"weight is on {weight.device}: panel products run on the CPU")
    if weight.dtype not in LINEAR_DTYPES:
        raise DTypeError(f"weight has dtype {weight.dtype}; panel products take float32 or bfloat16")
    if weight.dim() != 2 or weight.shape[0] == 0 or weight.shape[1] == 0:
        raise ShapeError(f"weight must be a non-empty [out_features, in_features], got {list(weight.shape)}")
    out_features, in_features = weight.shape
    with torch.no_grad():
        w = weight.detach()
        pad = -out_features % PANEL_WIDTH
        if pad:
            w = torch.cat([w, w.new_zeros(pad, in_features)])
        panels = w.reshape(-1, PANEL_WIDTH, in_features).transpose(1, 2).contiguous()
    return PanelWeight(panels, out_features, in_features)


def panel_linear(
    x: torch.Tensor, packed: PanelWeight, bias: torch.Tensor | None = None, *, isa: str = "auto"
) -> torch.Tensor:
    """x @ W.T (+ bias) for W packed by pack_panels; x [..., in_features], the result [..., out_features] in x's
    dtype (see the module's text). Checks are kept to what a call can get wrong: a decode step makes ~200 of
    these calls, each a few microseconds of work."""
    if type(packed) is not PanelWeight:
        raise InvalidArgumentError(f"packed must be a PanelWeight (pack_panels), got {type(packed).__name__}")
    if (
        type(x) is not torch.Tensor
        or x.dtype not in DTYPE_CODES_LINEAR
        or x.device.type != "cpu"
        or x.dim() == 0
        or x.stride(-1) != 1
        or x.requires_grad
    ):
        rows = cpu_rows("panel products", LINEAR_DTYPES, "x", x)  # raises, or dense rows of a strided last dim
    else:
        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    in_features, out_features = packed._in_features, packed._out_features
    if rows.shape[1] != in_features:
        raise ShapeError(f"x's last dim must be in_features={in_features}, got {list(x.shape)}")
    if rows.shape[0] > 1 and rows.stride(0) < in_features:  # rows overlap (an expanded x): the kernel wants them apart
        rows = rows.contiguous()
    bias_ptr = 0
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.dtype != rows.dtype or bias.device.type != "cpu":
            raise DTypeError(
                f"bias must be a CPU tensor of x's dtype {rows.dtype}, got {getattr(bias, 'dtype', bias)!r}"
            )
        if bias.dim() != 1 or bias.shape[0] != out_features:
            raise ShapeError(f"bias must be [{out_features}], got {list(bias.shape)}")
        if bias.stride(0) != 1:
            bias = bias.contiguous()
        bias_ptr = bias.data_ptr()
    out = torch.empty((*x.shape[:-1], out_features), dtype=rows.dtype)
    _C.linear_panels_cpu(
        rows.data_ptr(),
        rows.stride(0) if rows.shape[0] > 1 else in_features,
        rows.shape[0],
        in_features,
        packed._panels.data_ptr(),
        packed._code,
        out_features,
        bias_ptr,
        out.data_ptr(),
        out_features,
        DTYPE_CODES_LINEAR[rows.dtype],
        torch.get_num_threads(),
        isa,
    )
    return out
