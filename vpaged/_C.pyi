# The C++ surface of vpaged (csrc/bindings/: module.cpp, kernels.cpp, torch_allocator.cpp), typed for readers and
# type checkers. Addresses and stream handles are ints. C++ exceptions arrive as the classes of
# vpaged.errors (OutOfPages -> OutOfPagesError, ViewsAlive -> ViewsAliveError, ...).
#
# A "page index" (indices below) names a page-sized piece of a VirtualRange, as Layout.page_indices() returns
# them; a "slot" is a sequence's row in the Python caches (slot_stride, slots of WriteKVParams).

class Backend:
    @property
    def device(self) -> str: ...  # "cpu" or "cuda:N"
    @property
    def page_size(self) -> int: ...
    @property
    def capacity_pages(self) -> int: ...
    @property
    def created_pages(self) -> int: ...  # pages with memory now (CUDA: live handles; host: every page)
    @property
    def page_ids(self) -> int: ...  # ids that exist (CUDA: created so far, released ones included)
    @property
    def map_calls(self) -> int: ...  # map calls issued to the OS or driver since creation
    @property
    def unmap_calls(self) -> int: ...
    @property
    def unmap_fallbacks(self) -> int: ...  # runs the driver refused to unmap in one call, then unmapped page by page
    @property
    def can_attach_file_pages(
        self,
    ) -> bool: ...  # host: pages of another file can be mapped (PagePool.attach_file_pages)
    @property
    def file_page_faults(self) -> int: ...  # reads of file pages whose file was cut short, answered with zeros
    def reserve(self, bytes: int) -> int: ...
    def release(self, va: int, bytes: int) -> None: ...
    def synchronize(self, stream: int = 0) -> None: ...  # wait for the work queued on a CUDA stream

def host_backend(page_size: int, capacity_pages: int) -> Backend: ...
def cuda_backend(device: int, page_size: int, capacity_pages: int, reserve_pages: int = 0) -> Backend: ...
def cuda_unavailable_reason(device: int = 0) -> str: ...  # "" when CUDA is usable
def cuda_granularity(device: int = 0) -> int: ...  # 0 when CUDA is unusable
def cuda_device_count() -> int: ...
def cuda_primary_context_held(device: int = 0) -> bool: ...  # the process's own reference, from its first backend
def built_with_cuda() -> bool: ...

class PoolStats:
    page_size: int
    total_pages: int
    used_pages: int
    free_pages: int
    high_water_pages: int
    created_pages: int
    kv_pages: int
    allocator_pages: int
    kept_free_pages: int  # free pages that kept their memory (PagePool.keep_freed)
    unmap_fallbacks: int  # Backend.unmap_fallbacks
    release_pending: bool  # a trim / lowered limit waits for a CUDA graph capture to end
    deferred_teardowns: int  # ranges destroyed during a capture, unmapped once it ended
    file_pages: int  # attached file pages still referenced (not in used_pages: their memory is the file's)

# The process-wide CUDA graph capture flag (counted; vpaged/memory/capture.py raises it around a capture).
def begin_capture() -> None: ...
def end_capture() -> None: ...  # the last one releases what every pool deferred during the capture
def capture_flagged() -> bool: ...

class PagePool:
    """Physical pages of one backend: free list and reference counts. Thread-safe."""

    def __init__(self, backend: Backend, reserve_pages: int = 0, create_batch: int = 64) -> None: ...
    @property
    def backend(self) -> Backend: ...
    @property
    def page_size(self) -> int: ...
    def acquire(self, n: int) -> list[int]: ...  # n pages with one reference each; all or nothing
    # Ids for the pages of a file at `offsets` (multiples of the OS page), one reference each, owned by the caller;
    # mapped MAP_PRIVATE, read-only to the pool's copies, detached when the last reference goes (page_pool.h).
    def attach_file_pages(self, fd: int, offsets: list[int]) -> list[int]: ...
    def is_file_page(self, page: int) -> bool: ...
    def incref(self, page: int) -> None: ...
    def decref(self, page: int) -> None: ...
    def incref_all(self, pages: list[int]) -> None: ...  # checks every page first; all or nothing
    def decref_all(self, pages: list[int]) -> None: ...
    def refcount(self, page: int) -> int: ...
    def free_pages(self) -> int: ...
    def stats(self) -> PoolStats: ...
    def trim(self) -> int: ...  # free pages' memory back (CUDA: handles released); returns the pages free
    def set_limit(self, pages: int) -> int: ...  # clamped to [pages in use, capacity]; returns the limit set
    def release_deferred(self) -> bool: ...  # what a capture deferred, unless one runs; True: nothing pending
    @property
    def capture_running(self) -> bool: ...  # releases are deferred now (capture flag, or the legacy stream says so)
    @property
    def limit(self) -> int: ...  # pages that may be in use at once (capacity unless lowered)
    def reset_high_water(self) -> None: ...
    keep_freed: int  # free pages that may keep their memory (host); 0: every free page's memory goes back at once
    def copy_page(self, dst: int, src: int, stream: int = 0) -> None: ...
    def copy_to_host(self, src: int, host_ptr: int, stream: int = 0) -> None: ...
    def copy_from_host(self, dst: int, host_ptr: int, stream: int = 0) -> None: ...
    def copy_pages_to_host(self, pages: list[int], host_ptrs: list[int], stream: int = 0) -> None: ...
    def copy_pages_from_host(self, pages: list[int], host_ptrs: list[int], stream: int = 0) -> None: ...

class VirtualRange:
    """Reserved address space cut into pages, each unmapped or showing one pool page. Views pin the pages
    they cover; every unmap or remap first waits for the registered streams.

    `indices` / `index` are page indices of the range (0..num_pages-1), as Layout.page_indices() returns
    them."""

    def __init__(self, pool: PagePool, bytes: int) -> None: ...
    @property
    def address(self) -> int: ...
    @property
    def bytes(self) -> int: ...
    @property
    def num_pages(self) -> int: ...
    @property
    def page_size(self) -> int: ...
    @property
    def mapped_pages(self) -> int: ...
    @property
    def streams(self) -> list[int]: ...
    def map_new(self, indices: list[int]) -> list[int]: ...  # fresh pages; all or nothing
    def map_shared(self, indices: list[int], pages: list[int]) -> None: ...  # takes a reference on each page
    def unmap(self, indices: list[int]) -> None: ...  # ViewsAliveError while a view pins one of them
    def copy_on_write(self, index: int, stream: int = 0) -> int: ...
    def make_private(self, indices: list[int], stream: int = 0) -> int: ...  # copies made
    def copies_needed(self, indices: list[int]) -> int: ...  # what make_private(indices) would copy
    def assign(self, indices: list[int], pages: list[int]) -> None: ...  # -1: unmapped
    # Beam reorder: dst[k].. shows what src[k].. showed (count[k] pages, unmapped up to span[k]); a partly filled
    # last page (tail[k] bytes) is copied into the destination's private page where it can be. Returns the copies.
    def reorder_runs(
        self, dst: list[int], src: list[int], count: list[int], span: list[int], tail: list[int], stream: int = 0
    ) -> int: ...
    def refcounts_at(self, indices: list[int]) -> list[int]: ...
    def page_at(self, index: int, /) -> int: ...  # -1 when unmapped
    def pages_at(self, indices: list[int], /) -> list[int]: ...
    def pins_at(self, index: int, /) -> int: ...
    def pinned_count(self, indices: list[int]) -> int: ...
    def is_mapped(self, offset: int, length: int) -> bool: ...
    def unmap_all_unpinned(self) -> None: ...
    def add_stream(self, stream: int) -> None: ...
    def remove_stream(self, stream: int) -> None: ...
    def wait_for_streams(self) -> None: ...
    def capturing(self) -> bool: ...
    def view(self, offset: int, shape: list[int], strides: list[int], dtype_code: int, dtype_bits: int) -> object:
        """A DLPack capsule over mapped memory (strides in elements); pins its pages while it lives."""

class DecodeParams:
    """Arguments of a decode attention launch (csrc/kernels/decode.h); pointers are ints."""

    dtype: int  # of q and out (dtype_codes()): 0 float32, 1 float16, 2 bfloat16
    kv_dtype: int  # of K/V storage: -1 as dtype; 3 int8 (float32 scale after each head's row), 4 fp8 e4m3fn, 5 fp8 e5m2
    num_seqs: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int  # 0: head_dim
    token_stride: int
    head_stride: int
    v_token_stride: int  # 0: token_stride
    v_head_stride: int  # 0: as K's
    max_tokens: int
    paged: bool
    slot_stride: int
    v_slot_stride: int  # -1: slot_stride
    bt_stride: int
    block_size: int
    num_blocks: int
    scale: float
    k_scale: float  # fp8 K: value = stored * k_scale
    v_scale: float  # fp8 V: value = stored * v_scale
    q: int
    out: int
    k: int
    v: int
    lengths: int
    slots: int
    block_tables: int
    def __init__(self) -> None: ...

class CudaLaunch:
    device: int
    stream: int
    num_splits: int
    split_tokens: int
    partial_acc: int
    partial_ml: int
    def __init__(self) -> None: ...

def dtype_codes() -> dict[str, int]:
    """The codes of DecodeParams.dtype / kv_dtype (decode.h's DType) by torch dtype name ("float32": 0, ...)."""

def decode_check(params: DecodeParams) -> None: ...
def decode_cpu(params: DecodeParams, num_threads: int = 0, isa: str = "auto") -> None: ...
def decode_cpu_rows(
    base: DecodeParams,
    q: int,
    out: int,
    num_heads: int,
    scale: float,
    slots: list[int],
    lengths: list[int],
    num_threads: int = 0,
    isa: str = "auto",
) -> None: ...
def decode_cpu_tables(
    base: DecodeParams,
    q: int,
    out: int,
    num_heads: int,
    scale: float,
    block_tables: list[list[int]],
    lengths: list[int],
    num_threads: int = 0,
    isa: str = "auto",
) -> None: ...
def decode_cpu_isas() -> list[str]: ...
def cpu_auto_isa() -> str: ...
def decode_cuda(params: DecodeParams, launch: CudaLaunch) -> None: ...
def kernels_built_with_cuda() -> bool: ...

class WriteKVParams:
    """Arguments of a K/V scatter into a contiguous cache (csrc/kernels/write_kv.h); pointers are ints."""

    itemsize: int
    num_rows: int
    num_seqs: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int  # 0: head_dim
    k_row_stride: int
    k_head_stride: int
    v_row_stride: int
    v_head_stride: int
    slot_stride: int
    token_stride: int
    head_stride: int
    v_slot_stride: int
    v_token_stride: int
    v_cache_head_stride: int
    extent_lo: int
    extent_hi: int
    v_extent_lo: int
    v_extent_hi: int
    k: int
    v: int
    k_cache: int
    v_cache: int
    slots: int
    lengths: int
    writable_from: int  # 0: every token from 0
    rows: int
    positions: int
    def __init__(self) -> None: ...

def write_kv_check(params: WriteKVParams) -> None: ...
def write_kv_cpu(params: WriteKVParams, num_threads: int = 0) -> None: ...
def write_kv_cuda(params: WriteKVParams, device: int, stream: int) -> None: ...

# Fused element-wise ops of a forward (csrc/kernels/fused_ops.h); addresses are ints, strides in elements,
# dtype a decode dtype code (0: float32, 2: bfloat16).
def rms_norm_cpu(
    x: int,
    x_stride: int,
    weight: int,
    out: int,
    out_stride: int,
    rows: int,
    cols: int,
    eps: float,
    dtype: int,
    num_threads: int = 0,
    isa: str = "auto",
) -> None: ...
def add_rms_norm_cpu(
    x: int,
    x_stride: int,
    residual: int,
    residual_stride: int,
    weight: int,
    out: int,
    out_stride: int,
    rows: int,
    cols: int,
    eps: float,
    dtype: int,
    num_threads: int = 0,
    isa: str = "auto",
) -> None: ...
def rotary_cpu(
    x: int,
    x_stride: int,
    heads: int,
    head_dim: int,
    cos: int,
    sin: int,
    cs_stride: int,
    rows: int,
    dtype: int,
    num_threads: int = 0,
    isa: str = "auto",
) -> None: ...
def silu_mul_cpu(
    gate: int,
    gate_stride: int,
    up: int,
    up_stride: int,
    out: int,
    out_stride: int,
    rows: int,
    cols: int,
    dtype: int,
    num_threads: int = 0,
    isa: str = "auto",
) -> None: ...

# csrc/bindings/shm_ledger.cpp: a shared budget ledger's mapping (memory/budget/segment.py). Bounds-checked
# (IndexError), atomics need 8-byte alignment; a SIGBUS from a truncated file sets `damaged` instead of killing.
class LedgerMapping:
    def __init__(self, fd: int, size: int) -> None: ...
    def close(self) -> None: ...
    @property
    def size(self) -> int: ...
    @property
    def closed(self) -> bool: ...
    @property
    def damaged(self) -> bool: ...  # an access faulted: the file shrank under the mapping
    def read(self, offset: int, n: int) -> bytes: ...
    def write(self, offset: int, data: bytes) -> None: ...
    def load64(self, offset: int) -> int: ...
    def store64(self, offset: int, value: int) -> None: ...
    def cas64(self, offset: int, expected: int, desired: int) -> bool: ...  # True: it held expected, now desired
