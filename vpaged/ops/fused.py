"""Fused element-wise ops of a decoder layer's forward, on the CPU: each one pass over its rows.

    rms_norm(x, weight, eps)                 weight * (x * rsqrt(mean(x**2, -1) + eps)), LlamaRMSNorm's formula
    add_rms_norm(x, residual, weight, eps)   residual += x (in place), then rms_norm(residual, weight, eps)
    rotary_(x, cos, sin)                     x * cos + rotate_half(x) * sin per head, in place
    add_rms_norm_rows / rotary_rows          the same two for a loop over layers: a lean check of the common
                                             case (2-d rows / 3-d heads, one dtype, apart), the full one else
    silu_mul(gate, up)                       silu(gate) * up, a gated MLP's activation
    silu_mul(gate_up)                        the same over the [gate | up] halves of one product's last dim

Eager PyTorch runs RMSNorm as ~6 kernels (to, pow, mean, add, rsqrt, mul, mul) and SiLU-and-multiply as 2, each
a pass over the activations; these are one pass each (csrc/kernels/fused_ops_cpu.cpp, AVX2 where the CPU has
it). float32 and bfloat16, rounded where the eager code rounds (bf16: the normalised row before the weight,
silu(gate) before the product, each product of the rotation and its sum), so a model whose modules call them
(vpaged.hf.fused, vpaged.serve.direct_forward) gives what it gave, up to the order of a sum. Any leading dims;
the last one dense. Inference only: a call autograd would record is refused (the modules fall back to their own
forward there). rms_norm and silu_mul return new tensors; add_rms_norm updates residual and returns the norm;
rotary_ rotates x where it is (the query and key heads of one fused product in a single call: their rows may be
any distance apart), and takes only tensors it can update without a copy.
"""

from __future__ import annotations

import torch

from .. import _C
from ..errors import InvalidArgumentError, ShapeError
from .checks import check_cpu_operand, cpu_rows, cpu_rows_in_place
from .launch import DTYPE_CODES

FUSED_DTYPES = (torch.float32, torch.bfloat16)


def _rows(name: str, t, dtype: torch.dtype | None = None) -> torch.Tensor:
    return cpu_rows("the fused ops", FUSED_DTYPES, name, t, dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, isa: str = "auto") -> torch.Tensor:
    """weight * (x * rsqrt(mean(x**2, -1) + eps)) over x's last dim (see the module's text); x's shape."""
    rows = _rows("x", x)
    w = _norm_weight(weight, rows.shape[1], x.dtype, eps)
    return _rms_norm_rows(rows, w, float(eps), isa).view(x.shape)


def _norm_weight(weight, cols: int, dtype: torch.dtype, eps) -> torch.Tensor:
    """A norm's weight as a dense [cols] row of dtype, after checking it and eps (typed errors)."""
    w = _rows("weight", weight, dtype)
    if weight.dim() != 1 or weight.shape[0] != cols:
        raise ShapeError(f"weight must be [{cols}] (x's last dim), got {list(weight.shape)}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise InvalidArgumentError(f"eps must be a number >= 0, got {eps!r}")
    return w


def _rms_norm_rows(rows: torch.Tensor, weight: torch.Tensor, eps: float, isa: str = "auto") -> torch.Tensor:
    """rms_norm of checked operands: rows [R, C] with dense rows, weight [C] dense, both of one fused dtype."""
    cols = rows.shape[1]
    out = torch.empty(rows.shape, dtype=rows.dtype)
    _C.rms_norm_cpu(
        rows.data_ptr(),
        rows.stride(0),
        weight.data_ptr(),
        out.data_ptr(),
        cols,
        rows.shape[0],
        cols,
        eps,
        DTYPE_CODES[rows.dtype],
        torch.get_num_threads(),
        isa,
    )
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *, isa: str = "auto"
) -> torch.Tensor:
    """residual += x (rounded to the dtype, as eager `residual + x`), then rms_norm(residual, weight, eps): the
    residual add and the next RMSNorm of a decoder layer in one pass. Returns the norm (a new tensor)."""
    if isinstance(x, torch.Tensor) and isinstance(residual, torch.Tensor) and x.shape != residual.shape:
        raise ShapeError(f"x and residual must have one shape, got {list(x.shape)} and {list(residual.shape)}")
    rows = _rows("x", x)
    res = cpu_rows_in_place("the fused ops", FUSED_DTYPES, "residual", residual, x.dtype)
    w = _norm_weight(weight, rows.shape[1], x.dtype, eps)
    if _overlap(res, rows):
        raise InvalidArgumentError("x and residual must not share memory")
    return _add_rms_norm_rows(rows, res, w, float(eps), isa).view(x.shape)


def _add_rms_norm_rows(
    rows: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, isa: str = "auto"
) -> torch.Tensor:
    """add_rms_norm of checked operands: rows and residual [R, C] with dense rows and apart, weight [C] dense."""
    cols = rows.shape[1]
    out = torch.empty(rows.shape, dtype=rows.dtype)
    _C.add_rms_norm_cpu(
        rows.data_ptr(),
        rows.stride(0),
        residual.data_ptr(),
        residual.stride(0),
        weight.data_ptr(),
        out.data_ptr(),
        cols,
        rows.shape[0],
        cols,
        eps,
        DTYPE_CODES[rows.dtype],
        torch.get_num_threads(),
        isa,
    )
    return out


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, isa: str = "auto") -> torch.Tensor:
    """Rotary position embedding of x [rows, heads, head_dim] in place (returned): per head,
    x * cos + rotate_half(x) * sin with rotate_half(x) = cat(-x[half:], x[:half]), as Llama-family models apply
    it; cos and sin [rows, head_dim] (a row per position, shared by its heads), of x's dtype. x's heads must be
    dense (head_dim elements apart, each dense); its rows may be any distance apart."""
    for name, t in (("x", x), ("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor):
            raise InvalidArgumentError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if x.dim() != 3 or x.shape[2] < 2 or x.shape[2] % 2:
        raise ShapeError(f"x must be [rows, heads, head_dim] with an even head_dim, got {list(x.shape)}")
    rows, heads, dim = x.shape
    if cos.shape != (rows, dim) or sin.shape != (rows, dim):
        raise ShapeError(
            f"cos and sin must be [{rows}, {dim}] (x's rows and head_dim), got {list(cos.shape)} and {list(sin.shape)}"
        )
    check_cpu_operand("the fused ops", FUSED_DTYPES, "x", x)
    c = _rows("cos", cos, x.dtype)
    s = _rows("sin", sin, x.dtype)
    if c.stride(0) != s.stride(0):
        s = s.contiguous()
        c = c.contiguous()
    if x.stride(2) != 1 or (heads > 1 and x.stride(1) != dim):
        raise InvalidArgumentError(f"x's heads must be dense ({dim} elements apart), got strides {list(x.stride())}")
    if rows > 1 and x.stride(0) < heads * dim:
        raise InvalidArgumentError(f"x's rows overlap: {x.stride(0)} elements apart for {heads} x {dim}")
    if _overlap(x, c) or _overlap(x, s):
        raise InvalidArgumentError("x must not share memory with cos or sin")
    _rotary_rows(x, c, s, isa)
    return x


def _rotary_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, isa: str = "auto") -> None:
    """rotary_ of checked operands: x [R, H, D] with dense heads, cos and sin [R, D] with dense rows, one stride."""
    rows, heads, dim = x.shape
    _C.rotary_cpu(
        x.data_ptr(),
        x.stride(0) if rows > 1 else heads * dim,
        heads,
        dim,
        cos.data_ptr(),
        sin.data_ptr(),
        cos.stride(0),
        rows,
        DTYPE_CODES[x.dtype],
        torch.get_num_threads(),
        isa,
    )


def add_rms_norm_rows(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """add_rms_norm for a loop over layers (vpaged.serve.direct_forward): where x and residual are [R, C] CPU
    tensors of one fused dtype with dense rows in separate storages, weight a dense [C] of that dtype and eps a
    float >= 0, the op runs after that lean check alone; any other call is add_rms_norm's (its checks, its
    errors)."""
    if (
        _lean_rows(x)
        and _lean_rows(residual, x)
        and weight.dtype is x.dtype
        and weight.device.type == "cpu"
        and weight.dim() == 1
        and weight.is_contiguous()
        and weight.shape[0] == x.shape[1]
        and type(eps) is float
        and eps >= 0
        and not _same_storage(x, residual)
        and not (torch.is_grad_enabled() and (x.requires_grad or residual.requires_grad or weight.requires_grad))
    ):
        return _add_rms_norm_rows(x, residual, weight, eps)
    return add_rms_norm(x, residual, weight, eps)


def rotary_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """rotary_ for a loop over layers (vpaged.serve.direct_forward): where x is [R, H, D] on the CPU with dense
    heads and rows at least H * D apart, cos and sin [R, D] of x's dtype with dense rows, one row stride, and x's
    storage is neither's, the rotation runs after that lean check alone; any other call is rotary_'s."""
    if (
        type(x) is torch.Tensor
        and x.dim() == 3
        and x.dtype in FUSED_DTYPES
        and x.device.type == "cpu"
        and x.shape[2] >= 2
        and x.shape[2] % 2 == 0
        and x.stride(2) == 1
        and x.stride(1) == x.shape[2]
        and x.stride(0) >= x.shape[1] * x.shape[2]
        and _lean_rows(cos, x)
        and _lean_rows(sin, x)
        and cos.shape == sin.shape == (x.shape[0], x.shape[2])
        and cos.stride(0) == sin.stride(0)
        and not _same_storage(x, cos)
        and not _same_storage(x, sin)
        and not (torch.is_grad_enabled() and x.requires_grad)
    ):
        _rotary_rows(x, cos, sin)
        return x
    return rotary_(x, cos, sin)


def _lean_rows(t, like: torch.Tensor | None = None) -> bool:
    """t is a 2-d CPU tensor of a fused dtype (like's, given like) with dense rows (and like's shape, for a
    2-d like)."""
    if type(t) is not torch.Tensor or t.dim() != 2 or t.stride(1) != 1 or t.device.type != "cpu":
        return False
    if like is None:
        return t.dtype in FUSED_DTYPES and t.shape[1] > 0
    return t.dtype is like.dtype and (like.dim() != 2 or t.shape == like.shape)


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two CPU tensors' element spans share any byte (a conservative test: spans, not elements)."""
    if a.numel() == 0 or b.numel() == 0:
        return False

    def span(t):
        last = sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1
        return t.data_ptr(), t.data_ptr() + last * t.element_size()

    a0, a1 = span(a)
    b0, b1 = span(b)
    return a0 < b1 and b0 < a1


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
