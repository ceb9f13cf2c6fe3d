"""The torch allocator hook's CUDA path without a GPU: vpaged_torch_malloc / vpaged_torch_free on a CUDA
pool, driven through the fake driver (tests/fake_cuda), with failures injected into its calls.

The checks run as test_cuda_backend_fake.py runs its own (one child process whose LD_LIBRARY_PATH finds
the fake driver, a fresh fork per check, no driver object left behind afterwards); this module only adds
its checks to that runner's table."""

import ctypes
import gc
import sys
from pathlib import Path

import numpy as np
import pytest
import test_cuda_backend_fake as fake
from test_cuda_backend_fake import fake_driver_dir  # noqa: F401 - the fixture, compiled once per session
from test_torch_allocator import CStats, load_library

import vpaged
import vpaged._C as C

THIS_FILE = Path(__file__).resolve()
CHECKS: dict = {}
DEVICE = 0


def check(**env):
    """Register check(drv, rng) to run under the fake driver; return the pytest test reporting it."""

    def register(fn):
        CHECKS[fn.__name__] = (fn, {k: str(v) for k, v in env.items()})

        def test(allocator_fake_results):
            fake.report(allocator_fake_results, fn.__name__)

        test.__name__ = test.__qualname__ = fn.__name__
        test.__doc__ = fn.__doc__
        return test

    return register


@pytest.fixture(scope="module")
def allocator_fake_results(request, fake_driver_dir) -> dict:  # noqa: F811 - the imported fixture
    return fake.run_checks(request, fake_driver_dir, THIS_FILE, CHECKS, (str(THIS_FILE.parent),))


# ---------------------------------------------------------------------------------------------------
# Helpers inside a check's process.


class Hook:
    """A CUDA pool on the fake device with a PoolAllocator bound to it, and the C entry points."""

    def __init__(self, drv, capacity_pages, reserve=0, max_bytes=0):
        self.lib = load_library()
        self.page = drv.granularity
        self.pool = vpaged.PagePool(
            f"cuda:{DEVICE}", capacity_pages=capacity_pages, page_size=self.page, reserve_pages=reserve
        )
        self.allocator = C.PoolAllocator(self.pool._pool, max_bytes)
        C.bind_device_allocator(DEVICE, self.allocator)

    def malloc(self, size):
        return self.lib.vpaged_torch_malloc(size, DEVICE, None)

    def free(self, ptr, size):
        self.lib.vpaged_torch_free(ptr, size, DEVICE, None)

    def error(self) -> str:
        return self.lib.vpaged_torch_last_error().decode()

    def stats(self) -> CStats:
        out = CStats()
        assert self.lib.vpaged_torch_stats(DEVICE, ctypes.byref(out)) == 0, self.error()
        return out

    def close(self):
        """Unbind and drop every object, so that the runner finds no driver object left."""
        C.unbind_device_allocator(DEVICE, self.allocator)
        del self.allocator, self.pool
        gc.collect()


def state(drv, hook):
    """Everything a failed call must leave as it was: pool, allocator and driver objects."""
    s, p = hook.stats(), hook.pool.stats()
    # Not the pool's high-water mark: it records that the pages were taken for a moment.
    return (
        (p.used_pages, p.free_pages, p.kv_pages, p.allocator_pages, p.created_pages),
        s.segments,
        s.bytes,
        s.mapped_bytes,
        drv.live("allocations"),
        drv.live("mappings"),
        drv.live("reservations"),
    )


# ---------------------------------------------------------------------------------------------------
# Checks.


@check()
def test_fake_malloc_maps_whole_pages_and_free_waits_for_the_device_first(drv, rng):
    hook = Hook(drv, capacity_pages=8)
    page = hook.page
    before = drv.snapshot()
    size = 3 * page + int(rng.integers(1, page))
    ptr = hook.malloc(size)
    assert ptr is not None, hook.error()
    assert ptr % page == 0
    calls = drv.calls_since(before, *fake.VMM_CALLS)
    # One reservation, a page per cuMemMap (+ the pool's first batch of cuMemCreate), one cuMemSetAccess.
    assert calls["cuMemAddressReserve"] == 1 and calls["cuMemMap"] >= 4 and calls["cuMemSetAccess"] >= 1, calls
    assert fake.protection(ptr) == "rw-s" and fake.protection(ptr + 3 * page) == "rw-s"
    data = fake.random_bytes(rng, size)
    fake.host_bytes(ptr, size)[:] = data
    assert np.array_equal(fake.host_bytes(ptr, size), data)
    st = hook.pool.stats()
    assert (st.allocator_pages, st.kv_pages) == (4, 0)

    # A failed wait must leave the memory mapped: cuMemUnmap is not called, the pointer stays live.
    drv.fail("cuCtxSynchronize")
    syncs, unmaps = drv.calls("cuCtxSynchronize"), drv.calls("cuMemUnmap")
    hook.free(ptr, size)
    assert "cuCtxSynchronize failed" in hook.error(), hook.error()
    assert (drv.calls("cuCtxSynchronize") - syncs, drv.calls("cuMemUnmap") - unmaps) == (1, 0)
    assert np.array_equal(fake.host_bytes(ptr, size), data)
    assert hook.pool.stats().allocator_pages == 4 and hook.stats().segments == 1

    names = ("cuCtxSynchronize", "cuMemUnmap", "cuMemAddressFree")
    before = [drv.calls(n) for n in names]
    hook.free(ptr, size)
    assert hook.error() == ""
    calls = [drv.calls(n) - b for n, b in zip(names, before)]
    assert calls == [1, 1, 1], calls  # one wait, one unmap of the whole range, one release
    assert fake.protection(ptr) in ("", "---p"), "the freed range must be unmapped"
    assert hook.pool.stats().used_pages == 0
    s = hook.stats()
    assert (s.segments, s.frees, s.bad_frees) == (0, 1, 1)
    hook.close()


@check()
def test_fake_injected_failures_leave_everything_unchanged(drv, rng):
    hook = Hook(drv, capacity_pages=8, reserve=8)
    page = hook.page
    keep = hook.malloc(page)  # something live, so "unchanged" is not just "empty"
    assert keep is not None, hook.error()
    for call, skip in (("cuMemAddressReserve", 0), ("cuMemMap", 1), ("cuMemSetAccess", 0)):
        before = state(drv, hook)
        drv.fail(call, skip=skip)
        assert hook.malloc(3 * page) is None, call
        assert f"{call} failed" in hook.error(), (call, hook.error())
        assert state(drv, hook) == before, call
    assert hook.stats().failures == 3
    ok = hook.malloc(3 * page)  # nothing was left behind that blocks the next one
    assert ok is not None, hook.error()

    # A failed unmap keeps the allocation (still mapped, pages held); a later free succeeds.
    drv.fail("cuMemUnmap")
    before = state(drv, hook)
    hook.free(ok, 3 * page)
    assert "cuMemUnmap failed" in hook.error()
    assert state(drv, hook) == before
    hook.free(ok, 3 * page)
    hook.free(keep, page)
    assert hook.error() == "" and hook.pool.stats().used_pages == 0
    hook.close()


@check()
def test_fake_device_out_of_memory_is_null_with_the_reason(drv, rng):
    hook = Hook(drv, capacity_pages=16)
    page = hook.page
    drv.set_memory_limit(2 * page)  # the device holds 2 pages, the pool would allow 16
    before = state(drv, hook)
    assert hook.malloc(3 * page) is None
    assert "page pool exhausted" in hook.error(), hook.error()
    after = state(drv, hook)
    assert after[0][0] == 0 and after[1:4] == before[1:4] and after[6] == before[6]
    ptr = hook.malloc(2 * page)  # the pages the device could create serve a smaller request
    assert ptr is not None, hook.error()
    hook.free(ptr, 2 * page)
    drv.set_memory_limit(None)
    hook.close()


@check()
def test_fake_malloc_from_a_thread_without_a_context(drv, rng):
    hook = Hook(drv, capacity_pages=4)
    page = hook.page

    def body():
        ptr = hook.malloc(page)
        assert ptr is not None, hook.error()
        fake.host_bytes(ptr, page)[:7] = 7
        hook.free(ptr, page)
        return hook.error()

    assert fake.run_in_thread(body) == ""
    assert hook.pool.stats().used_pages == 0
    hook.close()


@check()
def test_fake_two_threads_allocate_and_free_at_once(drv, rng):
    import threading

    hook = Hook(drv, capacity_pages=16, reserve=16)
    page = hook.page
    errors = []
    seeds = rng.integers(0, 2**32, 2)

    def worker(seed):
        r = np.random.default_rng(int(seed))
        held = []
        for _ in range(60):
            if held and r.random() < 0.5:
                ptr, size, data = held.pop()
                if not np.array_equal(fake.host_bytes(ptr, 64), data):
                    errors.append("bytes changed under another thread")
                hook.free(ptr, size)
                if hook.error():
                    errors.append(hook.error())
            else:
                size = int(r.integers(1, 3 * page))
                ptr = hook.malloc(size)
                if ptr is None:  # two threads may hold up to 2 x 3 x 3 pages: more than 16 at times
                    if "page pool exhausted" not in hook.error():
                        errors.append(hook.error())
                    continue
                data = r.integers(0, 256, 64, dtype=np.uint8)
                fake.host_bytes(ptr, 64)[:] = data
                held.append((ptr, size, data))
        for ptr, size, _ in held:
            hook.free(ptr, size)

    threads = [threading.Thread(target=worker, args=(s,)) for s in seeds]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    s = hook.stats()
    assert (s.segments, s.bytes, s.bad_frees) == (0, 0, 0) and s.mallocs == s.frees > 0
    assert hook.pool.stats().used_pages == 0
    hook.close()


if __name__ == "__main__":  # the runner in the child process: python this_file RESULT_JSON CHECK...
    fake.CHECKS.update(CHECKS)
    fake._serve(sys.argv[1], sys.argv[2:])
