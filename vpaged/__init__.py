"""vpaged: a virtual-memory KV cache for LLM inference.

Each sequence's keys and values sit in one contiguous virtual address range; physical pages are mapped
into it on demand, so the KV of a sequence is an ordinary strided torch tensor that standard attention
kernels read unchanged.
"""

from .allocator import AllocatorStats, TorchAllocator, empty, torch_allocator
from .buildinfo import build_info
from .cache import BatchedKV, CacheStats, VirtualKVCache
from .device import BackendInfo, backends
from .errors import *  # noqa: F401,F403
from .geometry import KVGeometry
from .layout import Layout
from .paged_cache import PagedCacheStats, PagedKVCache
from .pool import PagePool, PoolStats, default_pool, set_default_pool
from . import ops

__version__ = "0.1.0"
