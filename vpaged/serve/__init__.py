"""vpaged.serve: continuous batching of transformers models on vpaged KV caches.

    from vpaged.serve import LLM, SamplingParams
    llm = LLM("random:llama-tiny", kv_budget_bytes=64 << 20, kv="vpaged")
    outs = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8, temperature=0.0))

Needs transformers (the `hf` extra). Importing the package makes attn_implementation="vpaged" known to
transformers, as `import vpaged.hf` does (vpaged/hf/autoregister.py).
Names are loaded on first use, so that the CLI reads the engine's options (`vpaged.serve.config`, from which
its flags are made) without importing transformers.
"""

from __future__ import annotations

from ..hf import autoregister as _autoregister  # noqa: F401  (importing vpaged.hf registers "vpaged")
from ..lazy import lazy_names

_NAMES = {
    "LLM": "engine",
    "LLMEngine": "engine",
    "EngineConfig": "config",
    "SchedulerConfig": "config",
    "StoreConfig": "config",
    "VirtualStoreConfig": "config",
    "StaticStoreConfig": "config",
    "PagedStoreConfig": "config",
    "ModelConfig": "config",
    "ParallelConfig": "config",
    "KVStore": "stores",
    "SamplingParams": "sample.params",
    "RequestOutput": "outputs",
    "CompletionOutput": "outputs",
    "RequestMetrics": "outputs",
    "EngineStats": "outputs",
    "load_model": "models",
    "RANDOM_CONFIGS": "models",
}

__all__ = list(_NAMES)


__getattr__, __dir__ = lazy_names(__name__, _NAMES, globals())
