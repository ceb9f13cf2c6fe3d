"""torch tensors on vpaged's page pool: one physical budget for the KV cache and everything else.

`torch_allocator(pool, device)` plugs the pool into torch's caching allocator through
`torch.cuda.memory.CUDAPluggableAllocator`: inside `hook.scope()` every CUDA tensor the current thread
creates lives in a segment whose pages come from the pool, and leaving the scope returns them. CUDA
graphs capture into `hook.mempool`. `empty(shape, dtype, pool=...)` makes host tensors the same way.

The C side (csrc/torch_allocator.cpp) exports `vpaged_torch_malloc` / `vpaged_torch_free` from
vpaged._C's own file. They never take the GIL, so they cannot ask Python caches to give back pages they
keep for reuse: call `pool.ensure_free(n)` before a step that needs room.

Why a MemPool scope and not `torch.cuda.memory.change_current_allocator`: that switch must happen before
torch's first CUDA allocation in the process (order-sensitive), makes torch.cuda.memory_stats() raise (the
pluggable allocator keeps no stats), and sends every tensor's free, uncached, to vpaged, which must wait for
the whole device before unmapping. In a MemPool the caching allocator keeps its stats and caching, and only
segments of the scope reach vpaged, when the scope closes.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import weakref
from dataclasses import dataclass

import torch

from .. import _C
from ..errors import BackendUnavailableError, InvalidArgumentError
from .device import normalize_device
from .pool import PagePool, default_pool

MALLOC_SYMBOL = "vpaged_torch_malloc"
FREE_SYMBOL = "vpaged_torch_free"


@dataclass(frozen=True)
class AllocatorStats:
    segments: int  # live allocations (torch segments)
    bytes: int  # their requested sizes, summed: what torch counts as reserved
    mapped_bytes: int  # their pages and those of deferred frees, summed (bytes rounded up to whole pages)
    peak_bytes: int
    mallocs: int
    frees: int
    failures: int  # allocations refused: cap, out of pages, driver failure
    bad_frees: int  # frees of unknown or already freed pointers, or frees that failed
    max_bytes: int  # the cap (0: only the pool's capacity)
    page_size: int
    # Frees that came during a CUDA graph capture (the device cannot be waited for then): not in segments,
    # their pages still mapped (in mapped_bytes), held and counted against the cap until the first call after
    # the capture completes them (stats() and flush() are such calls).
    deferred_frees: int = 0


def _stats(s) -> AllocatorStats:
    return AllocatorStats(
        s.segments,
        s.bytes,
        s.mapped_bytes,
        s.peak_bytes,
        s.mallocs,
        s.frees,
        s.failures,
        s.bad_frees,
        s.max_bytes,
        s.page_size,
        s.deferred_frees,
    )


def library_path() -> str:
    """The shared object that exports the C entry points (vpaged._C itself)."""
    return _C.__file__


def _expandable_segments_requested() -> bool:
    # torch reads its allocator settings from these variables at start-up (PYTORCH_ALLOC_CONF is the newer
    # name). Settings changed later through torch._C._accelerator_setAllocatorSettings are not visible here.
    for var in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        if re.search(r"expandable_segments\s*:\s*true", os.environ.get(var, ""), re.IGNORECASE):
            return True
    return False


class TorchAllocator:
    """Torch's caching allocator fed with pages of one vpaged pool (use `torch_allocator()` to get one)."""

    def __init__(self, pool: PagePool, device: torch.device, max_bytes: int):
        self.pool = pool
        self.device = device
        self.max_bytes = max_bytes
        self._allocator = pool.new_allocator(max_bytes)
        _C.bind_device_allocator(device.index, self._allocator)
        try:
            self._pluggable = torch.cuda.memory.CUDAPluggableAllocator(library_path(), MALLOC_SYMBOL, FREE_SYMBOL)
        except BaseException:
            _C.unbind_device_allocator(device.index, self._allocator)
            raise
        self._mempool = None
        self.closed = False

    def _check_open(self) -> None:
        if self.closed:
            raise InvalidArgumentError(f"the vpaged torch allocator of {self.device} was closed")

    @contextlib.contextmanager
    def scope(self):
        """Route the current thread's CUDA allocations on this device to the pool until the block ends.

        A fresh torch.cuda.MemPool per scope; on exit it is dropped, which empties its cache, so every
        segment not held by a live tensor goes back to the pool. Tensors that outlive the scope keep their
        segment until they die and torch.cuda.empty_cache() runs. Allocations made by other threads (the
        autograd engine's, in backward) are not routed (torch.cuda.use_mem_pool's rule)."""
        self._check_open()
        live_before = self._allocator.live_segments
        with torch.cuda.device(self.device):
            mempool = torch.cuda.MemPool(self._pluggable.allocator())
        try:
            with torch.cuda.use_mem_pool(mempool, self.device):
                yield
        finally:
            del mempool  # ~MemPool releases the pool and empties its cache
            if self._allocator.live_segments > live_before:
                torch.cuda.empty_cache()  # segments freed after release may still sit in torch's cache

    @property
    def mempool(self):
        """A torch.cuda.MemPool over this pool that lives until close(): pass `hook.mempool.id` as
        torch.cuda.graph(..., pool=...) so a graph's memory comes from the pool, or use it with
        torch.cuda.use_mem_pool for allocations that outlive a scope."""
        self._check_open()
        if self._mempool is None:
            with torch.cuda.device(self.device):
                self._mempool = torch.cuda.MemPool(self._pluggable.allocator())
        return self._mempool

    def stats(self) -> AllocatorStats:
        """The allocator's counters, after completing the frees deferred by a graph capture that has ended."""
        return _stats(self._allocator.stats())

    def flush(self) -> int:
        """Complete the frees deferred during a CUDA graph capture (they wait for the device, which a capture
        forbids); returns how many are still deferred because a capture still runs. Any later allocation, free
        or stats() call does the same."""
        return self._allocator.flush()

    def contains(self, tensor_or_address) -> bool:
        """True when the tensor's data (or the address) lies in a live allocation of this hook."""
        addr = tensor_or_address.data_ptr() if isinstance(tensor_or_address, torch.Tensor) else int(tensor_or_address)
        return self._allocator.contains(addr)

    def close(self) -> None:
        """Stop taking new allocations. Segments still alive are freed when torch frees them."""
        if self.closed:
            return
        self._mempool = None
        self.closed = True
        _C.unbind_device_allocator(self.device.index, self._allocator)
        if _hooks.get(self.device) is self:
            del _hooks[self.device]

    def __repr__(self) -> str:
        s = self.stats()
        return f"TorchAllocator(device={self.device}, segments={s.segments}, bytes={s.bytes}, closed={self.closed})"


_hooks: dict[torch.device, TorchAllocator] = {}


def torch_allocator(pool: PagePool | None = None, device="cuda:0", max_bytes: int | None = None) -> TorchAllocator:
    """The allocator hook of `device`, feeding torch from `pool` (default: the device's default pool).

    max_bytes caps the bytes torch may hold through the hook at once (default: only the pool's capacity).
    One hook per device at a time: asking again with the same pool and cap returns the same hook; a
    different one needs the first closed. Raises BackendUnavailableError where torch or vpaged cannot use
    CUDA, InvalidArgumentError for a host device, a pool of another device, or expandable segments on.
    """
    dev = normalize_device(device)
    if dev.type != "cuda":
        raise InvalidArgumentError(
            f"torch's pluggable allocator serves CUDA devices, not {dev}; for host tensors from a pool use "
            "vpaged.empty(shape, dtype, pool=...)"
        )
    if torch.version.cuda is None:
        raise BackendUnavailableError(
            f"this torch ({torch.__version__}) was built without CUDA: torch.cuda.MemPool and "
            "CUDAPluggableAllocator are unavailable"
        )
    if not torch.cuda.is_available():
        raise BackendUnavailableError(f"torch {torch.__version__} sees no CUDA device")
    if _expandable_segments_requested():
        raise InvalidArgumentError(
            "torch's expandable_segments is on (PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF): depending on "
            "the version, torch then refuses a MemPool with a custom allocator (\"MemPool doesn't currently "
            'support expandable_segments") or serves only the default pool from expandable segments; turn it '
            "off to give torch memory from a vpaged pool"
        )
    if pool is None:
        pool = default_pool(dev)
    if not isinstance(pool, PagePool):
        raise InvalidArgumentError(f"pool must be a vpaged.PagePool, got {type(pool).__name__}")
    if pool.device != dev:
        raise InvalidArgumentError(f"the pool lives on {pool.device}, the allocator was asked for {dev}")
    if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes <= 0):
        raise InvalidArgumentError(f"max_bytes must be a positive int or None, got {max_bytes!r}")
    cap = 0 if max_bytes is None else max_bytes
    hook = _hooks.get(dev)
    if hook is not None and not hook.closed:
        if hook.pool is pool and hook.max_bytes == cap:
            return hook
        raise InvalidArgumentError(
            f"{dev} already has a vpaged torch allocator (on {hook.pool!r}, "
            f"max_bytes={hook.max_bytes or None}); close() it first"
        )
    hook = TorchAllocator(pool, dev, cap)
    _hooks[dev] = hook
    return hook


# One allocator per host pool for vpaged.empty (no cap), made on first use.
_host_allocators: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def empty(shape, dtype: torch.dtype = torch.float32, pool: PagePool | None = None) -> torch.Tensor:
    """An uninitialised host tensor whose memory is mapped from `pool` (default: the host default pool).

    Its pages count as allocator pages in pool.stats() and go back to the pool when the tensor (and every
    view of it) dies. Raises OutOfPagesError when the pool is short, InvalidArgumentError for a bad shape
    or a CUDA pool. A tensor with no elements holds no memory and is an ordinary torch.empty."""
    if pool is None:
        pool = default_pool("cpu")
    if not isinstance(pool, PagePool):
        raise InvalidArgumentError(f"pool must be a vpaged.PagePool, got {type(pool).__name__}")
    if pool.device.type != "cpu":
        raise InvalidArgumentError(
            f"vpaged.empty makes host tensors; the pool lives on {pool.device} (CUDA tensors come from "
            "vpaged.torch_allocator(pool).scope())"
        )
    if not isinstance(dtype, torch.dtype):
        raise InvalidArgumentError(f"dtype must be a torch.dtype, got {dtype!r}")
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims):
        raise InvalidArgumentError(f"shape must be non-negative ints, got {shape!r}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(dims) * itemsize
    if nbytes == 0:
        return torch.empty(dims, dtype=dtype)
    allocator = _host_allocators.get(pool)
    if allocator is None:
        allocator = _host_allocators[pool] = pool.new_allocator(0)
    raw = torch.from_dlpack(allocator.tensor(nbytes))  # uint8 [nbytes]; the allocation dies with its storage
    return raw.view(dtype).view(dims)
