"""Model shapes for the simulator: the geometry that sets a token's KV bytes, by name or spelled out."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..errors import InvalidArgumentError
from ..kvcache.geometry import KVGeometry


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16
    kv_dtype: torch.dtype | None = None  # what the caches store (kvcache/formats.py); None: dtype

    @property
    def geometry(self) -> KVGeometry:
        """The KV geometry the simulated caches are built on (handed to them whole)."""
        return KVGeometry(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype, kv_dtype=self.kv_dtype)

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over all layers (a quantized format's scales included)."""
        return self.geometry.bytes_per_token

    def per_rank(self, tensor_parallel_size: int) -> ModelShape:
        """The shape one rank of a tensor-parallel deployment keeps K/V for: its share of the KV heads."""
        n = tensor_parallel_size
        if n <= 0 or self.num_kv_heads % n:
            raise InvalidArgumentError(
                f"tensor-parallel size {n} must be positive and divide {self.name}'s {self.num_kv_heads} KV heads"
            )
        if n == 1:
            return self
        return ModelShape(
            f"{self.name} TP{n} rank", self.num_layers, self.num_kv_heads // n, self.head_dim, self.dtype, self.kv_dtype
        )


# Attention geometry from each model's published config (num_hidden_layers, num_key_value_heads, head_dim).
SHAPES = {
    s.name: s
    for s in (
        ModelShape("Llama-3-8B", 32, 8, 128),
        ModelShape("Llama-3-70B", 80, 8, 128),
        ModelShape("Llama-2-7B", 32, 32, 128),
        ModelShape("Llama-2-13B", 40, 40, 128),
        ModelShape("Mistral-7B", 32, 8, 128),
        ModelShape("Qwen2.5-7B", 28, 4, 128),
        ModelShape("Qwen2.5-72B", 80, 8, 128),
    )
}

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_EXPLICIT = re.compile(r"^(\d+)x(\d+)x(\d+)(?::(bf16|fp16|fp32))?$")


def model_shape(spec: str) -> ModelShape:
    """A named shape (case-insensitive, e.g. 'llama-3-8b') or 'LAYERSxKV_HEADSxHEAD_DIM[:bf16|fp16|fp32]'."""
    for name, shape in SHAPES.items():
        if name.lower() == spec.lower():
            return shape
    m = _EXPLICIT.match(spec.strip().lower())
    if m is None:
        raise InvalidArgumentError(
            f"unknown model shape {spec!r}: use one of {', '.join(SHAPES)} or LAYERSxKV_HEADSxHEAD_DIM[:dtype], "
            "e.g. 32x8x128:bf16"
        )
    layers, heads, dim = (int(g) for g in m.groups()[:3])
    if min(layers, heads, dim) <= 0:
        raise InvalidArgumentError(f"model shape {spec!r}: layers, heads and head_dim must be positive")
    return ModelShape(spec, layers, heads, dim, _DTYPES[m.group(4) or "bf16"])
