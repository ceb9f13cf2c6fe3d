"""What VPagedCache reads from a model's config before the first forward: the kind of every layer (held in
vpaged, or left to transformers' own layer classes) and the model's dtype."""

from __future__ import annotations

import torch

from ..errors import InvalidArgumentError
from .compat import layer_plan

# Layer kinds held in vpaged. A sliding-window layer is served correctly by a full cache (transformers'
# sliding mask hides the tokens outside the window); bounded_sliding=True keeps only its window.
ATTENTION_TYPES = ("full_attention", "sliding_attention")
# Layer kinds left to transformers' own layer classes: recurrent (Mamba / linear attention / short conv)
# states, and layers with no attention at all.
DELEGATED_TYPES = ("linear_attention", "conv", "moe", "mlp", "dummy")


def text_config(config):
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def layer_kinds(config) -> list[tuple[str, dict]]:
    """(layer type, kwargs of transformers' layer class) of every layer; raises for kinds vpaged cannot hold."""
    text = text_config(config)
    try:
        layers = int(text.num_hidden_layers)
    except AttributeError as e:
        raise InvalidArgumentError(
            f"config {type(config).__name__} lacks {e.name}: pass num_layers explicitly (and config=None)"
        ) from e
    if any(mode == "reuse" for mode in (getattr(text, "kv_sharing_modes", None) or [])):
        raise InvalidArgumentError("VPagedCache does not support models whose layers share another layer's K/V")
    plan = layer_plan(text)
    if len(plan) != layers:
        raise InvalidArgumentError(
            f"VPagedCache does not support models whose layers share another layer's K/V ({len(plan)} of "
            f"{layers} layers hold their own)"
        )
    odd = sorted({t for t, _ in plan if t not in ATTENTION_TYPES + DELEGATED_TYPES})
    if odd:
        raise InvalidArgumentError(
            f"VPagedCache holds attention K/V and delegates {list(DELEGATED_TYPES)} layers to transformers; "
            f"this model has layer types {odd}, which it does not support"
        )
    if not any(t in ATTENTION_TYPES for t, _ in plan):
        raise InvalidArgumentError("this model has no attention layers: VPagedCache has nothing to hold")
    return plan


def config_dtype(config) -> torch.dtype | None:
    dtype = getattr(text_config(config), "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else None
