"""The CUDA backend (csrc/backends/cuda_backend.cpp) through the low-level API: vpaged._C.cuda_backend,
PagePool, VirtualRange.

Tests marked `gpu` need a usable CUDA device and skip with the backend's own reason otherwise. The
unmarked tests run everywhere and check that a machine without CUDA gets a clean, typed refusal.
Independent oracles on a GPU: cuda-python's driver bindings (granularity) and torch (reads and writes
through DLPack views), each skipped when not installed.
"""

import ast
import gc
import glob
import os
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

import vpaged._C as C
from vpaged.errors import BackendUnavailableError, InvalidArgumentError, OutOfPagesError

ROOT = Path(__file__).resolve().parents[2]
DEVICE = 0
KDL_FLOAT, KDL_UINT = 2, 1


def cuda_home_found_by_setup():
    """Run setup.py's own is_cuda_home/find_cuda_home (without running setup()): one source of truth
    for "was this build meant to have CUDA". Valid when the tests see the build's environment
    (VPAGED_CUDA, CUDA_HOME, PATH)."""
    setup_py = ROOT / "setup.py"
    if not setup_py.is_file():
        pytest.skip("setup.py not found next to the tests (installed package)")
    tree = ast.parse(setup_py.read_text())
    funcs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in ("is_cuda_home", "find_cuda_home")]
    assert len(funcs) == 2, "setup.py no longer defines is_cuda_home and find_cuda_home"
    ns = {"os": os, "glob": glob, "shutil": shutil, "Path": Path}
    exec(compile(ast.Module(body=funcs, type_ignores=[]), str(setup_py), "exec"), ns)
    return ns["find_cuda_home"]()


def test_built_with_cuda_matches_cuda_home():
    assert C.built_with_cuda() == (cuda_home_found_by_setup() is not None)


def test_unusable_cuda_is_refused_with_a_reason():
    reason = C.cuda_unavailable_reason(DEVICE)
    if reason == "":
        pytest.skip("CUDA is usable here; the refusal path is not reachable")
    assert C.cuda_granularity(DEVICE) == 0
    with pytest.raises(BackendUnavailableError) as info:
        C.cuda_backend(DEVICE, 2 << 20, 4)
    assert str(info.value).strip()
    assert str(info.value) == reason
    if not C.built_with_cuda():
        assert C.cuda_device_count() == 0
        assert "without CUDA" in reason


# ---------------------------------------------------------------------------------------------------
# GPU tests


@pytest.fixture
def gran():
    reason = C.cuda_unavailable_reason(DEVICE)
    if reason:
        pytest.skip(f"CUDA unusable: {reason}")
    g = C.cuda_granularity(DEVICE)
    assert g > 0
    return g


@pytest.fixture
def torch_cuda(gran):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA: no independent device-side reader")
    return torch


def make(gran, capacity, reserve=0, batch=64):
    backend = C.cuda_backend(DEVICE, gran, capacity, reserve)
    return backend, C.PagePool(backend, 0, batch)


def fview(torch, vr, index, n_pages=1):
    """float32 tensor over n_pages pages starting at page `index` of a VirtualRange."""
    n = n_pages * vr.page_size // 4
    return torch.from_dlpack(vr.view(index * vr.page_size, [n], [1], KDL_FLOAT, 32))


def page_bytes(pool, page):
    out = np.empty(pool.page_size, np.uint8)
    pool.copy_to_host(page, out.ctypes.data)
    pool.backend.synchronize()
    return out


@pytest.mark.gpu
def test_granularity_matches_cuda_python(gran):
    driver = pytest.importorskip("cuda.bindings.driver")
    ok = driver.CUresult.CUDA_SUCCESS
    (err,) = driver.cuInit(0)
    assert err == ok
    # This may be the first test of the process: no context is current yet. Retain and push the device's
    # primary context (as torch would have it) so the query runs as it does inside an inference process.
    err, dev = driver.cuDeviceGet(DEVICE)
    assert err == ok
    err, ctx = driver.cuDevicePrimaryCtxRetain(dev)
    assert err == ok
    (err,) = driver.cuCtxPushCurrent(ctx)
    assert err == ok
    try:
        prop = driver.CUmemAllocationProp()
        prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = DEVICE
        err, expected = driver.cuMemGetAllocationGranularity(
            prop, driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        )
    finally:
        driver.cuCtxPopCurrent()
        driver.cuDevicePrimaryCtxRelease(dev)
    assert err == ok
    assert gran == expected


@pytest.mark.gpu
def test_page_size_must_be_a_multiple_of_the_granularity(gran):
    for bad in (gran // 2, gran + gran // 2, 0):
        with pytest.raises(InvalidArgumentError):
            C.cuda_backend(DEVICE, bad, 4)
    backend = C.cuda_backend(DEVICE, 2 * gran, 4, 1)
    assert backend.page_size == 2 * gran


@pytest.mark.gpu
def test_missing_device_is_unavailable(gran):
    missing = C.cuda_device_count()
    assert "does not exist" in C.cuda_unavailable_reason(missing)
    with pytest.raises(BackendUnavailableError):
        C.cuda_backend(missing, gran, 4)


@pytest.mark.gpu
def test_pages_are_created_ahead_and_grow_to_capacity(gran):
    backend = C.cuda_backend(DEVICE, gran, 8, 3)
    assert (backend.device, backend.capacity_pages, backend.created_pages) == ("cuda:0", 8, 3)
    pool = C.PagePool(backend, 0, 2)
    vr = C.VirtualRange(pool, 8 * gran)
    vr.map_new([0, 1, 2, 3])  # 3 exist, the pool creates a batch of 2 more
    assert backend.created_pages == 5
    vr.map_new([4, 5, 6, 7])
    assert backend.created_pages == 8
    assert pool.stats().used_pages == 8


@pytest.mark.gpu
def test_map_and_unmap_call_counts(gran):
    backend, pool = make(gran, 8, 8)
    vr = C.VirtualRange(pool, 8 * gran)
    m, u = backend.map_calls, backend.unmap_calls
    vr.map_new([0, 1, 2, 3])
    assert backend.map_calls == m + 5  # one cuMemMap per page, one cuMemSetAccess for the run
    vr.unmap([0, 1, 2, 3])
    assert backend.unmap_calls == u + 1  # one cuMemUnmap over the whole run of mappings
    assert vr.mapped_pages == 0


@pytest.mark.gpu
def test_shared_page_is_coherent_across_addresses(torch_cuda):
    torch = torch_cuda
    gran = C.cuda_granularity(DEVICE)
    backend, pool = make(gran, 8, 4)
    vr = C.VirtualRange(pool, 4 * gran)
    (page,) = vr.map_new([0])
    vr.map_shared([3], [page])
    assert pool.refcount(page) == 2
    a, b = fview(torch, vr, 0), fview(torch, vr, 3)
    assert a.device.type == "cuda" and a.data_ptr() == vr.address
    assert b.data_ptr() == vr.address + 3 * gran
    data = torch.rand(a.numel(), device="cuda")
    a.copy_(data)
    torch.cuda.synchronize()
    assert torch.equal(b, data)
    b.mul_(2)
    torch.cuda.synchronize()
    assert torch.equal(a, data * 2)
    assert np.array_equal(page_bytes(pool, page), (data * 2).cpu().numpy().view(np.uint8))
    del a, b


@pytest.mark.gpu
def test_kernel_reads_across_page_boundaries(torch_cuda):
    torch = torch_cuda
    gran = C.cuda_granularity(DEVICE)
    backend, pool = make(gran, 8, 8)
    vr = C.VirtualRange(pool, 4 * gran)
    pages = vr.map_new([1, 2, 3])
    t = fview(torch, vr, 1, n_pages=3)
    data = torch.randn(t.numel(), device="cuda")
    t.copy_(data)
    torch.cuda.synchronize()
    assert torch.equal(t.clone(), data)
    per_page = gran // 4
    for i, p in enumerate(pages):
        expect = data[i * per_page : (i + 1) * per_page].cpu().numpy().view(np.uint8)
        assert np.array_equal(page_bytes(pool, p), expect)


@pytest.mark.gpu
def test_copy_on_write_separates_the_copy(torch_cuda):
    torch = torch_cuda
    gran = C.cuda_granularity(DEVICE)
    backend, pool = make(gran, 8, 4)
    vr = C.VirtualRange(pool, 2 * gran)
    (page,) = vr.map_new([0])
    vr.map_shared([1], [page])
    a = fview(torch, vr, 0)
    data = torch.rand(a.numel(), device="cuda")
    a.copy_(data)
    torch.cuda.synchronize()
    fresh = vr.copy_on_write(1)
    backend.synchronize()
    assert fresh != page and pool.refcount(page) == 1
    b = fview(torch, vr, 1)
    assert torch.equal(b, data)
    b.zero_()
    torch.cuda.synchronize()
    assert torch.equal(a, data)


@pytest.mark.gpu
def test_pool_counts_return_to_zero(gran):
    backend, pool = make(gran, 8, 8)
    r1 = C.VirtualRange(pool, 4 * gran)
    r2 = C.VirtualRange(pool, 4 * gran)
    pages = r1.map_new([0, 1, 2])
    r2.map_shared([0, 2], [pages[0], pages[2]])
    r2.map_new([1])
    assert pool.stats().used_pages == 4
    del r1
    gc.collect()
    assert pool.stats().used_pages == 3  # pages still mapped in r2 stay used
    del r2
    gc.collect()
    st = pool.stats()
    assert (st.used_pages, st.free_pages, st.high_water_pages) == (0, 8, 4)


@pytest.mark.gpu
def test_out_of_pages_changes_nothing(gran):
    backend, pool = make(gran, 4, 2)
    vr = C.VirtualRange(pool, 8 * gran)
    vr.map_new([0, 1, 2])
    before = (pool.stats().used_pages, backend.created_pages, backend.map_calls, vr.mapped_pages)
    with pytest.raises(OutOfPagesError):
        vr.map_new([4, 5])
    assert (pool.stats().used_pages, backend.created_pages, backend.map_calls, vr.mapped_pages) == before
    assert [vr.page_at(s) for s in (4, 5)] == [-1, -1]
    vr.map_new([3])  # the last page is still there
    assert pool.free_pages() == 0


@pytest.mark.gpu
def test_trim_gives_device_memory_back_and_released_pages_come_back_usable(torch_cuda):
    """trim() releases the handles of free pages: the device's free memory (cudaMemGetInfo, torch's reading of
    the driver) rises by their bytes; mapped again, they are re-created and hold what a kernel writes."""
    torch = torch_cuda
    gran = C.cuda_granularity(DEVICE)
    n = 64  # 128 MiB at 2 MiB: far above what other allocations move during the test
    backend, pool = make(gran, n, n)
    vr = C.VirtualRange(pool, n * gran)
    vr.map_new(list(range(n)))
    first = fview(torch, vr, 0)
    data = torch.rand(first.numel(), device="cuda")
    first.copy_(data)
    torch.cuda.synchronize()
    vr.unmap(list(range(1, n)))
    before = torch.cuda.mem_get_info(DEVICE)[0]
    assert pool.trim() == n - 1 and backend.created_pages == 1
    released = torch.cuda.mem_get_info(DEVICE)[0] - before
    assert released >= (n - 1 - 4) * gran, f"only {released} bytes came back"
    vr.map_new(list(range(1, n)))
    assert backend.created_pages == n
    rest = fview(torch, vr, 1, n_pages=n - 1)
    fill = torch.randn(rest.numel(), device="cuda")
    rest.copy_(fill)
    torch.cuda.synchronize()
    assert torch.equal(rest, fill) and torch.equal(first, data)
    del first, rest
    gc.collect()


@pytest.mark.gpu
def test_copies_round_trip_random_data(gran):
    backend, pool = make(gran, 4, 4)
    a, b = pool.acquire(2)
    src = np.random.default_rng().integers(0, 256, gran, dtype=np.uint8)
    out = np.zeros(gran, np.uint8)
    pool.copy_from_host(a, src.ctypes.data)
    pool.copy_page(b, a)
    pool.copy_to_host(b, out.ctypes.data)
    backend.synchronize(0)
    assert np.array_equal(out, src)
    with pytest.raises(InvalidArgumentError):
        pool.copy_page(b, 99)


@pytest.mark.gpu
def test_copies_on_a_torch_stream(torch_cuda):
    torch = torch_cuda
    gran = C.cuda_granularity(DEVICE)
    backend, pool = make(gran, 4, 4)
    a, b = pool.acquire(2)
    src = torch.randint(0, 256, (gran,), dtype=torch.uint8).pin_memory()
    out = torch.zeros(gran, dtype=torch.uint8).pin_memory()
    stream = torch.cuda.Stream()
    pool.copy_from_host(a, src.data_ptr(), stream.cuda_stream)
    pool.copy_page(b, a, stream.cuda_stream)
    pool.copy_to_host(b, out.data_ptr(), stream.cuda_stream)
    backend.synchronize(stream.cuda_stream)
    assert torch.equal(out, src)


@pytest.mark.gpu
def test_calls_from_a_fresh_thread(gran):
    """A new thread has no current context: the backend must make its primary context current."""
    backend, pool = make(gran, 4, 4)
    vr = C.VirtualRange(pool, 4 * gran)
    errors = []
    src = np.random.default_rng().integers(0, 256, gran, dtype=np.uint8)

    def work():
        try:
            (p,) = vr.map_new([2])
            pool.copy_from_host(p, src.ctypes.data)
            backend.synchronize()
            vr.map_shared([0], [p])
            vr.unmap([2])
        except Exception as e:  # re-raised in the main thread
            errors.append(e)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert not errors, errors
    assert np.array_equal(page_bytes(pool, vr.page_at(0)), src)
