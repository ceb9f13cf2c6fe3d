"""Fused element-wise ops of a decoder layer's forward, on the CPU: RMSNorm and SiLU-and-multiply in one pass.

    rms_norm(x, weight, eps)        weight * (x * rsqrt(mean(x**2, -1) + eps)), LlamaRMSNorm's formula
    silu_mul(gate, up)              silu(gate) * up, a gated MLP's activation
    silu_mul(gate_up)               the same over the [gate | up] halves of one product's last dim

Eager PyTorch runs RMSNorm as ~6 kernels (to, pow, mean, add, rsqrt, mul, mul) and SiLU-and-multiply as 2, each
a pass over the activations; these are one pass each (csrc/kernels/fused_ops_cpu.cpp, AVX2 where the CPU has
it). float32 and bfloat16, rounded where the eager code rounds (bf16: the normalised row before the weight,
silu(gate) before the product), so a model whose modules call them (vpaged.hf.fused) gives what it gave, up to
the order of a sum. Any leading dims; the last one dense. Inference only: a call autograd would record is
refused (the modules fall back to their own forward there). Results are new tensors.
"""

from __future__ import annotations

import torch

from .. import _C
from ..errors import InvalidArgumentError, ShapeError
from .checks import cpu_rows
from .launch import DTYPE_CODES

FUSED_DTYPES = (torch.float32, torch.bfloat16)


def _rows(name: str, t, dtype: torch.dtype | None = None) -> torch.Tensor:
    return cpu_rows("the fused ops", FUSED_DTYPES, name, t, dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, isa: str = "auto") -> torch.Tensor:
    """weight * (x * rsqrt(mean(x**2, -1) + eps)) over x's last dim (see the module's text); x's shape."""
    rows = _rows("x", x)
    w = _rows("weight", weight, x.dtype)
    cols = rows.shape[1]
    if weight.dim() != 1 or weight.shape[0] != cols:
        raise ShapeError(f"weight must be [{cols}] (x's last dim), got {list(weight.shape)}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise InvalidArgumentError(f"eps must be a number >= 0, got {eps!r}")
    out = torch.empty(x.shape, dtype=x.dtype)
    _C.rms_norm_cpu(
        rows.data_ptr(),
        rows.stride(0),
        w.data_ptr(),
        out.data_ptr(),
        cols,
        rows.shape[0],
        cols,
        float(eps),
        DTYPE_CODES[x.dtype],
        torch.get_num_threads(),
        isa,
    )
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor | None = None, *, isa: str = "auto") -> torch.Tensor:
    """silu(gate) * up; with up None, gate's last dim is [gate | up] (its first half the gate, as a fused
    gate_up product lays them out) and the result has half of it."""
    g = _rows("gate", gate)
    if up is None:
        if g.shape[1] % 2:
            raise ShapeError(f"a [gate | up] last dim must be even, got {gate.shape[-1]}")
        cols = g.shape[1] // 2
        u_ptr, u_stride = g.data_ptr() + cols * g.element_size(), g.stride(0)
        shape = (*gate.shape[:-1], cols)
    else:
        u = _rows("up", up, gate.dtype)
        if up.shape != gate.shape:
            raise ShapeError(f"gate and up must have one shape, got {list(gate.shape)} and {list(up.shape)}")
        cols = g.shape[1]
        u_ptr, u_stride = u.data_ptr(), u.stride(0)
        shape = gate.shape
    out = torch.empty(shape, dtype=gate.dtype)
    _C.silu_mul_cpu(
        g.data_ptr(),
        g.stride(0),
        u_ptr,
        u_stride,
        out.data_ptr(),
        cols,
        g.shape[0],
        cols,
        DTYPE_CODES[gate.dtype],
        torch.get_num_threads(),
        isa,
    )
    return out
