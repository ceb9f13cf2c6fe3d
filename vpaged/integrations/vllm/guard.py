"""What the vLLM plugin agrees to touch: the vLLM versions it was written against and the KV layouts it can
map block by block. Anything else is declined with one warning and vLLM runs as if vpaged were absent."""

from __future__ import annotations

import logging

SWITCH_ENV = "VPAGED_VLLM"  # "1" turns the plugin on; the contract with users, off by default
MAP_ENV = "VPAGED_VLLM_MAP"  # "demand" (default): pages follow vLLM's blocks; "all": map the buffer at start
SUPPORTED_VLLM_VERSIONS = ("0.32.0",)
# Only plain full attention: MLA, sliding windows, chunked-local, mamba and cross-attention specs are
# subclasses or siblings whose blocks are addressed differently, so the class must match exactly.
SUPPORTED_SPECS = ("FullAttentionSpec",)

logger = logging.getLogger("vpaged.integrations.vllm")
_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning("vpaged: %s", message)


def enabled(environ) -> bool:
    return environ.get(SWITCH_ENV, "0").strip() == "1"


def version_supported(version: str) -> bool:
    return version.split("+")[0] in SUPPORTED_VLLM_VERSIONS


def layout_refusal(kv_cache_config) -> str | None:
    """Why the plugin cannot back this KV cache config, or None when it can."""
    groups = kv_cache_config.kv_cache_groups
    tensors = kv_cache_config.kv_cache_tensors
    if len(groups) != 1:
        return f"{len(groups)} KV cache groups (hybrid models) are not supported"
    spec = groups[0].kv_cache_spec
    if type(spec).__name__ not in SUPPORTED_SPECS:
        return f"KV spec {type(spec).__name__} is not supported (only {', '.join(SUPPORTED_SPECS)})"
    if not getattr(spec, "has_layer_views", True):
        return "a KV spec without per-layer views is not supported"
    if len({t.size for t in tensors}) != 1:
        return "KV tensors of different backing sizes"
    if any(getattr(t, "host_resident", False) for t in tensors):
        return "host-resident KV tensors are not supported"
    return None


def parallel_refusal(tensor_parallel: int, pipeline_parallel: int) -> str | None:
    """Why the plugin declines a parallel engine, or None for one worker.

    With TP or PP > 1, vLLM runs each worker in its own process (MultiprocExecutor) and keeps the block
    pool in the engine-core process. A worker sees which blocks a step uses but not which blocks are
    freed, nor whether a freed block still holds a prefix-cached entry that a later request will read:
    it could map pages but could never give one back safely (unmapping a cached block would feed zeros
    to the next request that hits it). Declining keeps vLLM's own buffer instead of a buffer that only
    grows."""
    if tensor_parallel * pipeline_parallel > 1:
        return (
            f"tensor parallel {tensor_parallel} x pipeline parallel {pipeline_parallel}: the workers run apart "
            "from vLLM's block pool and could never give a page back"
        )
    return None


APART_EXECUTORS = ("mp", "ray")  # executors whose workers run in processes of their own


def executor_refusal(backend: str | None) -> str | None:
    """Why the plugin declines an engine whose worker runs apart from its scheduler, or None.

    The block pool (which blocks are freed, which a prefix-cache entry still holds) lives with the scheduler;
    the KV buffer with the worker. vLLM's CPU build runs its one worker in a process of its own under the
    multiprocess executor whenever VLLM_ENABLE_V1_MULTIPROCESSING is 1 (its default, and what `vllm serve`
    uses): there the plugin would map pages as blocks are used and could never give one back (nor answer a
    shared budget's asks), so it keeps vLLM's own buffer. VLLM_ENABLE_V1_MULTIPROCESSING=0 runs the worker in
    the scheduler's process (the engine-core process of `vllm serve`, the caller's of `LLM`)."""
    if backend in APART_EXECUTORS:
        return (
            f"vLLM's worker runs apart from its scheduler (distributed_executor_backend={backend!r}), so freed "
            "blocks could never give their pages back: run vLLM with VLLM_ENABLE_V1_MULTIPROCESSING=0"
        )
    return None
