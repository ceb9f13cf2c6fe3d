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


check = fake.check_registrar(CHECKS, "allocator_fake_results")  # @check(**env): a check run under the fake driver


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

    def malloc(self, size, stream=None):
        return self.lib.vpaged_torch_malloc(size, DEVICE, stream)

    def free(self, ptr, size, stream=None):
        """vpaged_torch_free with the stream torch would pass (None: the legacy stream)."""
        self.lib.vpaged_torch_free(ptr, size, DEVICE, stream)

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
    # One wait, the range's unmap (refused as one call by the strict fake, as the driver documents: then one
    # call per page), one release.
    assert calls == [1, 1 + 4, 1], calls
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

    # A failed unmap keeps the allocation (still mapped, pages held); a later free succeeds. One page: a run
    # whose one call fails is unmapped page by page instead (below).
    drv.fail("cuMemUnmap")
    before = state(drv, hook)
    hook.free(keep, page)
    assert "cuMemUnmap failed" in hook.error()
    assert state(drv, hook) == before
    drv.fail("cuMemUnmap")
    hook.free(ok, 3 * page)
    assert hook.error() == "" and hook.pool.stats().unmap_fallbacks >= 1
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


# ---------------------------------------------------------------------------------------------------
# Frees while a CUDA graph is being captured: the device cannot be waited for then (cuCtxSynchronize
# returns CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED), so the free is deferred, not failed or leaked.


def held(drv, hook):
    """What a deferred free keeps: the pool's allocator pages and the driver's mappings and reservations."""
    return hook.pool.stats().allocator_pages, drv.live("mappings"), drv.live("reservations")


@check()
def test_fake_free_on_the_capturing_stream_is_deferred_without_waiting(drv, rng):
    """torch frees on the segment's stream; when that stream captures, vpaged asks the driver and defers the
    free without calling cuCtxSynchronize (which would invalidate the capture). The next call after the
    capture completes it."""
    hook = Hook(drv, capacity_pages=8)
    page = hook.page
    size = 2 * page + int(rng.integers(1, page))
    ptr = hook.malloc(size)
    keep = hook.malloc(page)
    assert ptr is not None and keep is not None, hook.error()
    data = fake.random_bytes(rng, size)
    fake.host_bytes(ptr, size)[:] = data
    stream = drv.stream()
    # Relaxed capture mode: the mallocs below map pages, which a global-mode capture forbids (any thread's cuMemMap
    # would invalidate it; the strict fake refuses them).
    drv.begin_capture(stream, 2)
    before_held, before = held(drv, hook), drv.snapshot()

    hook.free(ptr, size, stream)
    assert hook.error() == "", hook.error()
    assert drv.calls_since(before, "cuCtxSynchronize", "cuMemUnmap", "cuMemAddressFree") == {}
    assert held(drv, hook) == before_held, "nothing may be unmapped or given back during the capture"
    assert np.array_equal(fake.host_bytes(ptr, size), data)  # still mapped: a replay may still use it
    s = hook.stats()
    assert (s.segments, s.bytes, s.frees, s.bad_frees, s.deferred_frees) == (1, page, 0, 0, 1), s
    assert s.mapped_bytes == 4 * page  # the deferred allocation's pages are still mapped
    assert not hook.allocator.owns(ptr)  # freed as far as torch is concerned

    # A second free of the deferred pointer is still refused, and changes nothing.
    hook.free(ptr, size, stream)
    assert "freed already" in hook.error(), hook.error()
    s = hook.stats()
    assert (s.bad_frees, s.deferred_frees) == (1, 1) and held(drv, hook) == before_held

    # Allocations on the capturing stream still work, and never wait for the device.
    other = hook.malloc(page, stream)
    assert other is not None, hook.error()
    hook.free(other, page, stream)
    assert hook.error() == "" and hook.stats().deferred_frees == 2
    assert drv.calls_since(before, "cuCtxSynchronize", "cuMemUnmap") == {}
    assert drv.end_capture(stream) == 0, "vpaged invalidated the capture"

    # The capture is over: the next call (stats here) completes both deferred frees with one wait.
    s = hook.stats()
    assert (s.segments, s.deferred_frees, s.frees, s.bad_frees) == (1, 0, 2, 1), s
    assert s.mapped_bytes == page
    # 3 pages (refused as one call by the strict fake, then one per page) and 1.
    assert drv.calls_since(before, "cuCtxSynchronize", "cuMemUnmap")["cuMemUnmap"] == (1 + 3) + 1
    assert fake.protection(ptr) in ("", "---p"), "the deferred range must be unmapped now"
    assert hook.pool.stats().allocator_pages == 1
    hook.free(keep, page)
    assert hook.error() == "" and hook.pool.stats().used_pages == 0
    hook.close()


@check()
def test_fake_free_that_finds_the_device_capturing_is_deferred(drv, rng):
    """A free on a stream that does not capture, while another stream does: the wait fails with
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, and the free is deferred instead of failing (the allocation used
    to stay live, counted as a bad free, its pages lost to the pool until torch freed it again, which it
    never does). The next malloc after the capture completes it."""
    hook = Hook(drv, capacity_pages=4)
    page = hook.page
    ptr = hook.malloc(3 * page)
    assert ptr is not None, hook.error()
    stream = drv.stream()
    # Relaxed mode: the legacy stream then does not report the capture, so the free tries the wait, which fails.
    drv.begin_capture(stream, 2)
    before_held, unmaps = held(drv, hook), drv.calls("cuMemUnmap")
    hook.free(ptr, 3 * page)  # the legacy stream: not capturing itself
    assert hook.error() == "", hook.error()
    assert drv.calls("cuMemUnmap") == unmaps and held(drv, hook) == before_held
    s = hook.stats()  # tries again (the capture still runs): still deferred
    assert (s.segments, s.bytes, s.frees, s.bad_frees, s.deferred_frees) == (0, 0, 0, 0, 1), s
    # The pages are still held: the pool cannot serve 2 more pages of its 4 yet.
    assert hook.malloc(2 * page, stream) is None and "exhausted" in hook.error(), hook.error()
    assert drv.end_capture(stream) != 0  # the failed wait broke this capture (a wait conflicts with any capture)

    ptr2 = hook.malloc(2 * page)  # completes the deferred free first, so the pages are there
    assert ptr2 is not None, hook.error()
    s = hook.stats()
    assert (s.segments, s.frees, s.deferred_frees, s.mapped_bytes) == (1, 1, 0, 2 * page), s
    assert drv.calls("cuMemUnmap") == unmaps + 1 + 3  # the run refused as one call (strict fake), then per page
    hook.free(ptr2, 2 * page)
    assert hook.error() == "" and hook.pool.stats().used_pages == 0
    hook.close()


@check()
def test_fake_deferred_frees_wait_for_the_capture_they_saw(drv, rng):
    """Once a free was deferred because its stream captures, later calls on other streams do not try the
    wait (and so do not break the capture) until that stream has ended its capture; flush() completes them
    once it has. Other failures of the wait still fail the free."""
    hook = Hook(drv, capacity_pages=8)
    page = hook.page
    a, b, c = (hook.malloc(page) for _ in range(3))
    assert None not in (a, b, c), hook.error()
    stream = drv.stream()
    drv.begin_capture(stream)
    syncs = drv.calls("cuCtxSynchronize")
    hook.free(a, page, stream)
    hook.free(b, page)  # legacy stream, but a capture vpaged knows of still runs
    assert hook.error() == "", hook.error()
    assert hook.allocator.flush() == 2  # still pending
    assert hook.allocator.stats().deferred_frees == 2
    assert drv.calls("cuCtxSynchronize") == syncs
    assert drv.end_capture(stream) == 0

    assert hook.allocator.flush() == 0
    st = hook.allocator.stats()
    assert (st.segments, st.frees, st.deferred_frees) == (1, 2, 0)
    assert hook.pool.stats().allocator_pages == 1

    drv.fail("cuCtxSynchronize")  # not a capture error: the free fails as before and keeps the allocation
    hook.free(c, page)
    assert "cuCtxSynchronize failed" in hook.error(), hook.error()
    s = hook.stats()
    assert (s.segments, s.bad_frees, s.deferred_frees) == (1, 1, 0), s
    hook.free(c, page)
    assert hook.error() == "" and hook.pool.stats().used_pages == 0
    hook.close()


if __name__ == "__main__":  # the runner in the child process: python this_file RESULT_JSON CHECK...
    fake.CHECKS.update(CHECKS)
    fake._serve(sys.argv[1], sys.argv[2:])
