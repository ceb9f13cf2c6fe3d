"""Refusals before any rank starts work: what a tensor-parallel engine cannot serve, and why.

Each rank keeps the K/V of num_kv_heads / N heads, so N must divide the KV heads (and the query heads, which
the attention projections split the same way); transformers must know how to shard the model (a
tensor-parallel plan in its config); and the ranks must load the model from somewhere every process can read
(a directory, or a named random model each process can build), not from an object living in one process.
"""

from __future__ import annotations

import os

import torch

from ...errors import InvalidArgumentError
from ..models import model_geometry, random_config


def model_config(spec):
    """The transformers config of a model spec, read without loading weights."""
    from transformers import AutoConfig, PreTrainedModel

    if isinstance(spec, PreTrainedModel):
        raise InvalidArgumentError(
            "tensor_parallel_size > 1 needs a model directory or 'random:<name>': a model already loaded in this "
            "process cannot be sharded over the ranks (save_pretrained it and pass the directory)"
        )
    if not isinstance(spec, (str, os.PathLike)):
        raise InvalidArgumentError(f"model must be a directory or 'random:<name>', got {spec!r}")
    spec = os.fspath(spec)
    if spec.startswith("random:"):
        return random_config(spec[len("random:") :].partition(":")[0])
    if not os.path.isdir(spec):
        raise InvalidArgumentError(f"no model directory {spec!r}")
    try:
        return AutoConfig.from_pretrained(spec, local_files_only=True)
    except (OSError, ValueError) as e:
        raise InvalidArgumentError(f"cannot read the config of {spec!r}: {e}") from e


def check_tensor_parallel(spec, size: int, device: torch.device) -> None:
    """Raise InvalidArgumentError, with the reason, when `size` ranks cannot serve the model of `spec`."""
    config = model_config(spec)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    _, kv_heads, _ = model_geometry(config)
    heads = int(text.num_attention_heads)
    name = getattr(config, "model_type", type(config).__name__)
    if kv_heads % size or heads % size:
        raise InvalidArgumentError(
            f"tensor_parallel_size={size} must divide the model's KV heads ({kv_heads}) and attention heads "
            f"({heads}): each rank keeps whole KV heads"
        )
    if not getattr(text, "base_model_tp_plan", None):
        raise InvalidArgumentError(
            f"the {name} model has no tensor-parallel plan in transformers (base_model_tp_plan): it cannot be "
            "sharded with tp_plan='auto'"
        )
    if device.type == "cuda" and torch.cuda.device_count() < size and "WORLD_SIZE" not in os.environ:
        raise InvalidArgumentError(
            f"tensor_parallel_size={size} needs {size} CUDA devices on this host; {torch.cuda.device_count()} found "
            "(across hosts, launch the ranks with torchrun)"
        )
    if device.type not in ("cpu", "cuda"):
        raise InvalidArgumentError(f"tensor parallelism runs on CPU (gloo) or CUDA (NCCL), not on {device.type}")
