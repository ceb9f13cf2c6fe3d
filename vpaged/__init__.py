"""vpaged: a virtual-memory KV cache for LLM inference.

Each sequence's keys and values sit in one contiguous virtual address range; physical pages are mapped
into it on demand, so the KV of a sequence is an ordinary strided torch tensor that standard attention
kernels read unchanged.

The package face: the names below are what users import from `vpaged`; the layers live in subpackages
(memory, kvcache, ops, hf, serve, sim, cli; see docs/architecture.md).
"""

from .errors import (
    AddressSpaceError,
    BackendError,
    BackendUnavailableError,
    CacheClosedError,
    DTypeError,
    EngineStepError,
    InvalidArgumentError,
    LayerIndexError,
    MappingLimitError,
    MappingLimitWarning,
    OutOfPagesError,
    PromptTooLongError,
    ReadOnlyTokensError,
    RequestError,
    SequenceSwappedError,
    SequenceTooLongError,
    ShapeError,
    SlotsExhaustedError,
    SwapSpaceFullError,
    TraceError,
    UnknownRequestError,
    UnknownSequenceError,
    ViewsAliveError,
    VPagedError,
)
from .memory import (
    AllocatorStats,
    BackendInfo,
    PagePool,
    PoolStats,
    TorchAllocator,
    backends,
    build_info,
    default_pool,
    empty,
    set_default_pool,
    torch_allocator,
)
from .kvcache import (
    BatchedKV,
    CacheStats,
    KVCache,
    KVGeometry,
    Layout,
    PagedCacheConfig,
    PagedCacheStats,
    PagedKVCache,
    VirtualCacheConfig,
    VirtualKVCache,
)
from . import ops

__version__ = "0.1.0"

__all__ = [
    # caches and their records
    "VirtualKVCache",
    "PagedKVCache",
    "KVCache",
    "KVGeometry",
    "VirtualCacheConfig",
    "PagedCacheConfig",
    "Layout",
    "CacheStats",
    "PagedCacheStats",
    "BatchedKV",
    # memory
    "PagePool",
    "PoolStats",
    "default_pool",
    "set_default_pool",
    "backends",
    "BackendInfo",
    "build_info",
    "torch_allocator",
    "TorchAllocator",
    "AllocatorStats",
    "empty",
    # kernels
    "ops",
    # errors
    "VPagedError",
    "AddressSpaceError",
    "BackendError",
    "BackendUnavailableError",
    "CacheClosedError",
    "DTypeError",
    "EngineStepError",
    "InvalidArgumentError",
    "LayerIndexError",
    "MappingLimitError",
    "MappingLimitWarning",
    "OutOfPagesError",
    "PromptTooLongError",
    "ReadOnlyTokensError",
    "RequestError",
    "SequenceSwappedError",
    "SequenceTooLongError",
    "ShapeError",
    "SlotsExhaustedError",
    "SwapSpaceFullError",
    "TraceError",
    "UnknownRequestError",
    "UnknownSequenceError",
    "ViewsAliveError",
]
