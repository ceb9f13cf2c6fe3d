"""vpaged.serve: continuous batching of transformers models on vpaged KV caches.

    from vpaged.serve import LLM, SamplingParams
    llm = LLM("random:llama-tiny", kv_budget_bytes=64 << 20, kv="vpaged")
    outs = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8, temperature=0.0))

Needs transformers (the `hf` extra). Importing this package registers attn_implementation="vpaged".
"""

from .config import (
    EngineConfig,
    ModelConfig,
    PagedStoreConfig,
    ParallelConfig,
    SchedulerConfig,
    StaticStoreConfig,
    StoreConfig,
    VirtualStoreConfig,
)
from .engine import LLM, LLMEngine
from .models import RANDOM_CONFIGS, load_model
from .outputs import CompletionOutput, EngineStats, RequestMetrics, RequestOutput
from .params import SamplingParams
from .stores import KVStore

__all__ = [
    "LLM",
    "LLMEngine",
    "EngineConfig",
    "SchedulerConfig",
    "StoreConfig",
    "VirtualStoreConfig",
    "StaticStoreConfig",
    "PagedStoreConfig",
    "ModelConfig",
    "ParallelConfig",
    "KVStore",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "RequestMetrics",
    "EngineStats",
    "load_model",
    "RANDOM_CONFIGS",
]
