"""The torch allocator hook on the host: the C entry points through ctypes on vpaged._C's own file (the
path torch's CUDAPluggableAllocator takes), vpaged.empty, and one budget shared with the KV caches.

Device -1 is the host pool, so everything but the CUDA driver calls runs here; tests/memory/test_torch_allocator_fake.py
covers those through the fake driver, tests/memory/test_torch_allocator_gpu.py on a GPU."""

import ctypes
import gc
import math
import mmap
import shutil
import subprocess
import threading

import numpy as np
import pytest
import torch
from process_helpers import address_is_mapped, mapping_count, open_fds

import vpaged
import vpaged._C as C
from vpaged import KVGeometry, VirtualCacheConfig, VirtualKVCache
from vpaged.errors import BackendUnavailableError, InvalidArgumentError, OutOfPagesError
from vpaged.memory.allocator import _expandable_segments_requested

PAGE = 64 * 1024
OS_PAGE = mmap.PAGESIZE
HOST = -1
SYMBOLS = ("vpaged_torch_malloc", "vpaged_torch_free", "vpaged_torch_stats", "vpaged_torch_last_error")


class CStats(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_uint64)
        for name in (
            "page_size",
            "segments",
            "bytes",
            "mapped_bytes",
            "peak_bytes",
            "mallocs",
            "frees",
            "failures",
            "bad_frees",
            "max_bytes",
            "deferred_frees",
        )
    ]


def load_library():
    lib = ctypes.CDLL(C.__file__)
    lib.vpaged_torch_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.vpaged_torch_malloc.restype = ctypes.c_void_p
    lib.vpaged_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.vpaged_torch_free.restype = None
    lib.vpaged_torch_stats.argtypes = [ctypes.c_int, ctypes.POINTER(CStats)]
    lib.vpaged_torch_stats.restype = ctypes.c_int
    lib.vpaged_torch_last_error.argtypes = []
    lib.vpaged_torch_last_error.restype = ctypes.c_char_p
    return lib


LIB = load_library()


def malloc(size, device=HOST):
    return LIB.vpaged_torch_malloc(size, device, None)  # None for NULL


def free(ptr, size, device=HOST):
    LIB.vpaged_torch_free(ptr, size, device, None)


def last_error() -> str:
    return LIB.vpaged_torch_last_error().decode()


def c_stats(device=HOST) -> CStats:
    out = CStats()
    assert LIB.vpaged_torch_stats(device, ctypes.byref(out)) == 0, last_error()
    return out


class HostHook:
    """A host pool with a PoolAllocator bound to device -1, as torch_allocator binds one to a GPU."""

    def __init__(self, capacity_pages=64, max_bytes=0):
        self.pool = vpaged.PagePool("cpu", capacity_pages=capacity_pages, page_size=PAGE)
        self.allocator = C.PoolAllocator(self.pool._pool, max_bytes)
        C.bind_device_allocator(HOST, self.allocator)

    def close(self):
        C.unbind_device_allocator(HOST, self.allocator)


@pytest.fixture
def hook():
    made = []

    def make(**kw):
        h = HostHook(**kw)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


def write_and_check(ptr, size, rng):
    """Fill [ptr, ptr + size) with fresh random bytes through ctypes and read them back through numpy."""
    data = bytes(rng.integers(0, 256, size, dtype=np.uint8))
    ctypes.memmove(ptr, data, size)
    view = np.frombuffer((ctypes.c_uint8 * size).from_address(ptr), np.uint8)
    assert view.tobytes() == data


@pytest.fixture
def nprng():
    return np.random.default_rng()


# ---------------------------------------------------------------------------------------------------
# The symbols.


def test_entry_points_are_exported_with_c_linkage():
    # ctypes finds them by their plain names, as torch's CUDAPluggableAllocator does (dlsym): C linkage.
    for name in SYMBOLS:
        assert ctypes.cast(getattr(LIB, name), ctypes.c_void_p).value, name
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm not found: cannot list the dynamic symbol table")
    out = subprocess.run([nm, "-D", "--defined-only", C.__file__], capture_output=True, text=True, check=True).stdout
    exported = {line.split()[-1] for line in out.splitlines() if line.strip()}
    for name in SYMBOLS:
        assert name in exported, f"{name} is not in the dynamic symbol table (hidden or mangled)"


def test_nothing_bound_returns_null_with_the_reason():
    assert C.device_allocator(HOST) is None
    assert malloc(4096) is None
    assert (
        last_error() == "no vpaged pool is bound to device -1 (vpaged.torch_allocator binds one; -1 is the host pool)"
    )
    assert malloc(4096, 3) is None
    if C.built_with_cuda():
        assert "no vpaged pool is bound to device 3" in last_error()
    else:
        assert last_error() == "vpaged was built without CUDA: no pool can serve CUDA device 3"
    assert LIB.vpaged_torch_stats(HOST, ctypes.byref(CStats())) == -1
    assert "no vpaged pool is bound to device -1" in last_error()


# ---------------------------------------------------------------------------------------------------
# Host allocations.


def test_host_allocations_are_writable_memory_of_the_requested_size(hook, nprng):
    h = hook(capacity_pages=64)
    live = {}
    for _ in range(12):
        size = int(nprng.integers(1, 5 * PAGE))
        ptr = malloc(size)
        assert ptr is not None, last_error()
        assert last_error() == ""
        assert ptr % OS_PAGE == 0  # host reservations are mmaps: aligned to the OS page (CUDA: to the pool page)
        write_and_check(ptr, size, nprng)
        live[ptr] = size
    pages = sum(math.ceil(s / PAGE) for s in live.values())
    st = h.pool.stats()
    assert (st.allocator_pages, st.kv_pages, st.used_pages) == (pages, 0, pages)
    cs = c_stats()
    assert (cs.segments, cs.bytes, cs.mapped_bytes, cs.mallocs, cs.frees) == (
        len(live),
        sum(live.values()),
        pages * PAGE,
        len(live),
        0,
    )
    assert cs.peak_bytes == sum(live.values()) and cs.page_size == PAGE
    # Every allocation still holds what was written last (no two overlap).
    contents = {}
    for ptr, size in live.items():
        contents[ptr] = bytes(nprng.integers(0, 256, size, dtype=np.uint8))
        ctypes.memmove(ptr, contents[ptr], size)
    for ptr, size in live.items():
        assert ctypes.string_at(ptr, size) == contents[ptr]
    for ptr, size in live.items():
        free(ptr, size)
        assert last_error() == ""
        assert not address_is_mapped(ptr), "a freed allocation's address range must be released"
    st = h.pool.stats()
    assert (st.allocator_pages, st.used_pages) == (0, 0)
    cs = c_stats()
    assert (cs.segments, cs.bytes, cs.mapped_bytes, cs.frees, cs.bad_frees) == (0, 0, 0, len(live), 0)


def test_out_of_pages_is_null_and_changes_nothing(hook):
    h = hook(capacity_pages=8)
    a = malloc(3 * PAGE)
    before = (h.pool.stats(), mapping_count())
    assert malloc(5 * PAGE + 1) is None  # needs 6 of the 5 free pages: all or nothing
    assert "page pool exhausted" in last_error() and "6 page(s)" in last_error()
    assert (h.pool.stats(), mapping_count()) == before
    cs = c_stats()
    assert (cs.segments, cs.failures, cs.bytes) == (1, 1, 3 * PAGE)
    b = malloc(5 * PAGE)  # exactly what is left
    assert b is not None, last_error()
    assert h.pool.stats().free_pages == 0
    free(a, 3 * PAGE)
    free(b, 5 * PAGE)
    assert h.pool.stats().used_pages == 0


def test_cap_refuses_past_max_bytes_and_frees_make_room(hook):
    h = hook(capacity_pages=64, max_bytes=3 * PAGE)
    a = malloc(2 * PAGE)
    assert a is not None
    assert malloc(PAGE + 1) is None
    assert "exceed the allocator's cap of 196608 bytes" in last_error()
    assert h.pool.stats().allocator_pages == 2
    b = malloc(PAGE)  # exactly at the cap
    assert b is not None, last_error()
    assert malloc(4 * PAGE) is None
    free(a, 2 * PAGE)
    c = malloc(2 * PAGE)
    assert c is not None, last_error()
    cs = c_stats()
    assert (cs.failures, cs.max_bytes, cs.bytes, cs.peak_bytes) == (2, 3 * PAGE, 3 * PAGE, 3 * PAGE)
    free(b, PAGE)
    free(c, 2 * PAGE)


def test_size_zero_is_null(hook):
    h = hook()
    assert malloc(0) is None
    assert "allocation of 0 bytes" in last_error()
    assert h.pool.stats().used_pages == 0 and c_stats().failures == 0


def test_unknown_pointer_double_free_and_wrong_size_are_recorded_not_fatal(hook, nprng):
    h = hook()
    free(None, 0)  # free(NULL) does nothing
    assert last_error() == ""
    bogus = 0x7F0000000000 + PAGE * int(nprng.integers(1, 1000))
    free(bogus, PAGE)
    assert "was not allocated by vpaged on device -1 or was freed already" in last_error()
    ptr = malloc(PAGE + 5)
    write_and_check(ptr, PAGE + 5, nprng)
    free(ptr, PAGE)  # not the size it was allocated with: refused, nothing freed
    assert "allocated with size 65541; not freed" in last_error()
    assert h.pool.stats().allocator_pages == 2
    write_and_check(ptr, PAGE + 5, nprng)  # still mapped and usable
    free(ptr, PAGE + 5)
    assert last_error() == ""
    free(ptr, PAGE + 5)  # double free
    assert "or was freed already" in last_error()
    cs = c_stats()
    assert (cs.bad_frees, cs.frees, cs.segments) == (3, 1, 0)
    assert h.pool.stats().used_pages == 0
    free(ptr, PAGE + 5, device=5)  # another device with nothing bound
    assert "was not allocated by vpaged on device 5" in last_error()


def test_last_error_is_per_thread(hook):
    hook()
    assert malloc(0) is None
    seen = {}
    t = threading.Thread(target=lambda: seen.update(other=last_error()))
    t.start()
    t.join()
    assert seen["other"] == "" and "0 bytes" in last_error()


def test_two_threads_allocate_and_free_at_once(hook, nprng):
    h = hook(capacity_pages=256)
    rounds = 300
    errors = []
    seeds = nprng.integers(0, 2**32, 2)

    def worker(seed):
        rng = np.random.default_rng(seed)
        held = []
        try:
            for _ in range(rounds):
                if held and rng.random() < 0.5:
                    ptr, size, data = held.pop(int(rng.integers(len(held))))
                    if ctypes.string_at(ptr, size) != data:
                        errors.append("an allocation's bytes changed under another thread")
                    free(ptr, size)
                    if last_error():
                        errors.append(last_error())
                else:
                    size = int(rng.integers(1, 3 * PAGE))
                    ptr = malloc(size)
                    if ptr is None:
                        errors.append(last_error())
                        continue
                    data = bytes(rng.integers(0, 256, size, dtype=np.uint8))
                    ctypes.memmove(ptr, data, size)
                    held.append((ptr, size, data))
            for ptr, size, data in held:
                if ctypes.string_at(ptr, size) != data:
                    errors.append("an allocation's bytes changed under another thread")
                free(ptr, size)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(int(s),)) for s in seeds]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:5]
    cs = c_stats()
    assert cs.mallocs == cs.frees and (cs.segments, cs.bytes, cs.bad_frees, cs.failures) == (0, 0, 0, 0)
    assert h.pool.stats().used_pages == 0


def test_unbinding_stops_mallocs_but_frees_still_find_their_allocator(hook):
    h = hook()
    ptr = malloc(PAGE)
    h.close()
    assert C.device_allocator(HOST) is None
    assert malloc(PAGE) is None and "no vpaged pool is bound" in last_error()
    free(ptr, PAGE)  # torch may free a segment long after the hook was closed
    assert last_error() == ""
    assert h.pool.stats().used_pages == 0 and h.allocator.stats().frees == 1


def test_one_allocator_per_device(hook):
    h = hook()
    C.bind_device_allocator(HOST, h.allocator)  # the same one again: nothing changes
    other = C.PoolAllocator(h.pool._pool, 0)
    with pytest.raises(InvalidArgumentError, match="already has a vpaged torch allocator bound"):
        C.bind_device_allocator(HOST, other)
    assert C.device_allocator(HOST) is h.allocator


# ---------------------------------------------------------------------------------------------------
# One budget with the KV caches.


def kv_cache(pool):
    # fp32, 2 heads x 64: 512 bytes per token and layer, so 128 tokens fill one 64 KiB page of each of the
    # 2 layers' K and V: 4 pages per 128 tokens.
    return VirtualKVCache(
        KVGeometry(2, 2, 64, torch.float32), VirtualCacheConfig(max_seqs=8, max_seq_len=1024), pool=pool
    )


def test_kv_cache_filling_the_pool_makes_malloc_fail_and_closing_it_makes_room(hook):
    h = hook(capacity_pages=16)
    cache = kv_cache(h.pool)
    seqs = [cache.allocate() for _ in range(4)]
    for s in seqs:
        cache.extend(s, 128)
    st = h.pool.stats()
    assert (st.kv_pages, st.allocator_pages, st.free_pages) == (16, 0, 0)
    assert malloc(PAGE) is None and "page pool exhausted" in last_error()
    cache.free(seqs[0])  # its pages stay mapped for reuse (dormant) ...
    assert malloc(PAGE) is None
    assert h.pool.ensure_free(2)  # ... until serving code asks the pool to reclaim them
    ptr = malloc(2 * PAGE)
    assert ptr is not None, last_error()
    st = h.pool.stats()
    assert (st.kv_pages, st.allocator_pages) == (12, 2)
    assert not h.pool.ensure_free(3)  # 2 free and nothing dormant left: refused, nothing changed
    assert h.pool.stats().free_pages == 2
    cache.close()
    st = h.pool.stats()
    assert (st.kv_pages, st.allocator_pages, st.free_pages) == (0, 2, 14)
    big = malloc(14 * PAGE)
    assert big is not None, last_error()
    free(ptr, 2 * PAGE)
    free(big, 14 * PAGE)


def test_allocator_pages_are_taken_back_by_kv_caches(hook):
    h = hook(capacity_pages=8)
    ptr = malloc(6 * PAGE)
    cache = kv_cache(h.pool)
    seq = cache.allocate()
    with pytest.raises(OutOfPagesError):
        cache.extend(seq, 256)  # 8 pages, 2 free
    assert cache.seq_len(seq) == 0 and h.pool.stats().kv_pages == 0
    free(ptr, 6 * PAGE)
    cache.extend(seq, 256)
    st = h.pool.stats()
    assert (st.kv_pages, st.allocator_pages, st.used_pages) == (8, 0, 8)
    cache.close()


# ---------------------------------------------------------------------------------------------------
# vpaged.empty


DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.int64,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.float64,
    torch.complex64,
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_empty_round_trip(dtype, rng):
    pool = vpaged.PagePool("cpu", capacity_pages=64, page_size=PAGE)
    shape = tuple(int(x) for x in torch.randint(1, 40, (3,), generator=rng))
    t = vpaged.empty(shape, dtype, pool=pool)
    assert (t.shape, t.dtype, t.device.type, t.is_contiguous()) == (shape, dtype, "cpu", True)
    assert t.data_ptr() % OS_PAGE == 0
    pages = math.ceil(math.prod(shape) * t.element_size() / PAGE)
    assert pool.stats().allocator_pages == pages
    ref = (torch.randn(shape, generator=rng) * 100).to(dtype)
    t.copy_(ref)
    assert torch.equal(t, ref)
    assert torch.equal(t * 1, ref * 1)  # ordinary torch ops read it
    view = t[1:]
    del t
    gc.collect()
    assert pool.stats().allocator_pages == pages, "a view keeps the memory alive"
    assert torch.equal(view, ref[1:])
    del view
    gc.collect()
    assert pool.stats().used_pages == 0


def test_empty_does_not_leak():
    pool = vpaged.PagePool("cpu", capacity_pages=32, page_size=PAGE)
    gc.collect()  # earlier tests' pools closing their fds inside this test's count would read as a negative leak
    maps, fds = mapping_count(), open_fds()
    for i in range(300):
        t = vpaged.empty((i % 7 + 1, 3000), torch.float32, pool=pool)
        t.fill_(i)
        assert pool.stats().allocator_pages == math.ceil(t.numel() * 4 / PAGE)
        del t
    gc.collect()
    assert pool.stats().used_pages == 0
    assert mapping_count() <= maps + 2 and open_fds() == fds


def test_empty_shares_the_budget_and_reports_out_of_pages():
    pool = vpaged.PagePool("cpu", capacity_pages=8, page_size=PAGE)
    a = vpaged.empty(6 * PAGE, torch.uint8, pool=pool)
    before = pool.stats()
    with pytest.raises(OutOfPagesError, match="page pool exhausted"):
        vpaged.empty((3, PAGE), torch.uint8, pool=pool)
    assert pool.stats() == before
    cache = kv_cache(pool)
    seq = cache.allocate()
    with pytest.raises(OutOfPagesError):
        cache.extend(seq, 128)  # 4 pages, 2 free
    del a
    gc.collect()
    cache.extend(seq, 128)
    assert pool.stats().kv_pages == 4
    cache.close()


def test_empty_rejects_bad_arguments():
    pool = vpaged.PagePool("cpu", capacity_pages=4, page_size=PAGE)
    for bad in ((-1, 3), (2.5,), (True, 2), "abc"):
        with pytest.raises(InvalidArgumentError, match="shape"):
            vpaged.empty(bad, pool=pool)
    with pytest.raises(InvalidArgumentError, match="dtype"):
        vpaged.empty((2,), "float32", pool=pool)
    with pytest.raises(InvalidArgumentError, match="vpaged.PagePool"):
        vpaged.empty((2,), pool=object())
    t = vpaged.empty((0, 5), torch.float32, pool=pool)
    assert t.shape == (0, 5) and pool.stats().used_pages == 0
    assert pool.stats().used_pages == 0


# ---------------------------------------------------------------------------------------------------
# torch_allocator's checks that need no GPU.


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a torch without CUDA")
def test_torch_allocator_without_cuda_torch_raises_backend_unavailable():
    with pytest.raises(BackendUnavailableError, match="built without CUDA|sees no CUDA device"):
        vpaged.torch_allocator(device="cuda:0")


def test_torch_allocator_refuses_the_host_device():
    with pytest.raises(InvalidArgumentError, match="serves CUDA devices.*vpaged.empty"):
        vpaged.torch_allocator(device="cpu")
    with pytest.raises(InvalidArgumentError, match="not a device"):
        vpaged.torch_allocator(device="gpu7")


def test_expandable_segments_setting_is_detected(monkeypatch):
    for var in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(var, raising=False)
    assert not _expandable_segments_requested()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64,expandable_segments:True")
    assert _expandable_segments_requested()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    assert not _expandable_segments_requested()
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:true")
    assert _expandable_segments_requested()
