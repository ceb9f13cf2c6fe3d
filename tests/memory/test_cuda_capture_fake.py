"""The CUDA backend against the strict fake driver where the real driver is stricter than it used to be modelled:
unmapping a run of separately mapped pages (cuMemUnmap wants one whole mapping), and releases, limit changes and
range teardowns while a CUDA graph capture runs (any thread's cuMemUnmap / cuMemRelease / cuMemCreate / cuMemMap /
cuMemSetAccess invalidates a global-mode capture).

The checks run as test_cuda_backend_fake.py runs its own (one child process whose LD_LIBRARY_PATH finds the fake
driver, a fresh fork per check, no API violation and no driver object left behind afterwards); this module only
adds its checks to that runner's table."""

import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import test_cuda_backend_fake as fake
import torch
from test_cuda_backend_fake import fake_driver_dir  # noqa: F401 - the fixture, compiled once per session

import vpaged
import vpaged._C as C
from vpaged import KVGeometry, VirtualCacheConfig
from vpaged.errors import BackendError, OutOfPagesError
from vpaged.memory import SharedBudget

THIS_FILE = Path(__file__).resolve()
CHECKS: dict = {}
CAPTURE_GLOBAL, CAPTURE_THREAD_LOCAL, CAPTURE_RELAXED = 0, 1, 2


check = fake.check_registrar(CHECKS, "capture_fake_results")  # @check(**env): a check run under the fake driver


@pytest.fixture(scope="module")
def capture_fake_results(request, fake_driver_dir) -> dict:  # noqa: F811 - the imported fixture
    return fake.run_checks(request, fake_driver_dir, THIS_FILE, CHECKS, (str(THIS_FILE.parent),))


def device_memory(drv) -> tuple:
    """The fake device's allocations holding memory and their bytes."""
    return drv.live("allocations"), drv.live("allocated_bytes")


def write_pages(rng, range_, indices, page) -> dict:
    data = {}
    for i in indices:
        data[i] = fake.random_bytes(rng, page)
        fake.host_bytes(range_.address + i * page, page)[:] = data[i]
    return data


def reads_back(range_, data, page) -> bool:
    return all(np.array_equal(fake.host_bytes(range_.address + i * page, page), d) for i, d in data.items())


def in_thread(fn):
    """fn() on another thread (as the budget's give-back thread or vLLM's idle thread would call it)."""
    return fake.run_in_thread(fn)


# ---------------------------------------------------------------------------------------------------
# The fake itself: the rules it now enforces (so that the checks below mean something).


@check()
def test_the_strict_fake_refuses_what_the_driver_refuses(drv, rng):
    g = drv.granularity
    n = int(rng.integers(2, 6))
    backend, pool = fake.make_pool(drv, n, n, batch=n)
    # A released handle's memory stays until its last mapping goes (the pool window maps every page).
    assert device_memory(drv) == (n, n * g)
    stream = drv.stream()
    drv.begin_capture(stream)
    # The legacy stream may not be used while a global-mode capture runs: the backend's query says so.
    r = C.VirtualRange(pool, g)
    assert r.capturing() is True and pool.capture_running
    assert drv.end_capture(stream) == 0  # asking broke nothing
    assert r.capturing() is False and not pool.capture_running
    # A legacy-stream copy is asynchronous: its bytes land at the synchronize.
    (page,) = pool.acquire(1)
    data = fake.random_bytes(rng, g)
    pool.copy_from_host(page, data.ctypes.data)
    out = np.zeros(g, np.uint8)
    pool.copy_to_host(page, out.ctypes.data)
    assert not out.any(), "the copies ran before the legacy stream was synchronized"
    backend.synchronize()
    assert np.array_equal(out, data)
    pool.decref(page)
    del r


# ---------------------------------------------------------------------------------------------------
# Item: one cuMemUnmap over a run of separately mapped pages, and the per-page fallback.


@check()
def test_trim_unmaps_page_by_page_where_the_driver_refuses_a_run_and_counts_it(drv, rng):
    g = drv.granularity
    n = int(rng.integers(3, 9))
    backend, pool = fake.make_pool(drv, n, n, batch=n)  # ids 0..n-1: one run in the pool window
    assert device_memory(drv) == (n, n * g)
    refused = drv.live("refused_unmaps")
    assert pool.trim() == n
    assert device_memory(drv) == (0, 0), "the driver refused the run's unmap and the memory stayed"
    assert drv.live("refused_unmaps") - refused == 1 and drv.live("mappings") == 0
    assert pool.stats().unmap_fallbacks == backend.unmap_fallbacks == 1
    # Re-created as handed out, and a range's run of pages unmaps page by page too.
    r = C.VirtualRange(pool, n * g)
    r.map_new(list(range(n)))
    data = write_pages(rng, r, range(n), g)
    assert reads_back(r, data, g)
    keep = int(rng.integers(0, n - 1))
    r.unmap(list(range(keep, n)))
    assert r.mapped_pages == keep and drv.live("mappings") == n + keep  # the window's n, the range's keep
    assert pool.stats().unmap_fallbacks == 1 + (n - keep > 1)
    assert reads_back(r, {i: data[i] for i in range(keep)}, g)
    if keep:
        r.unmap(list(range(keep)))
    del r


@check(FAKE_CUDA_MULTI_UNMAP=1)
def test_a_driver_that_accepts_a_run_unmaps_it_in_one_call(drv, rng):
    n = int(rng.integers(3, 9))
    backend, pool = fake.make_pool(drv, n, n, batch=n)
    before = drv.snapshot()
    assert pool.trim() == n and device_memory(drv) == (0, 0)
    assert drv.calls_since(before, "cuMemUnmap") == {"cuMemUnmap": 1}
    assert pool.stats().unmap_fallbacks == 0 and drv.live("refused_unmaps") == 0


# ---------------------------------------------------------------------------------------------------
# Item: releases and limit changes while a capture runs.


@check()
def test_a_lower_limit_from_another_thread_during_a_global_capture_waits_for_the_capture(drv, rng):
    """The budget's give-back thread lowers the limit while the engine captures a graph on a stream of its own
    (no vpaged range knows it). No release may reach the driver then: the limit is set, the release waits,
    and the pool's next call after the capture does it."""
    g = drv.granularity
    n = int(rng.integers(4, 10))
    backend, pool = fake.make_pool(drv, n, n, batch=n)
    used = int(rng.integers(1, n - 2))
    held = pool.acquire(used)
    limit = int(rng.integers(used, n - 1))
    stream = drv.stream()
    drv.begin_capture(stream)
    assert in_thread(lambda: pool.set_limit(limit)) == limit
    assert in_thread(pool.trim) == limit - used
    assert drv.violations() == (0, ""), "a release reached the driver during the capture"
    assert device_memory(drv) == (n, n * g), "memory was released during the capture"
    assert pool.limit == limit and pool.free_pages() == limit - used  # the limit holds at once
    assert pool.stats().release_pending
    with pytest.raises(OutOfPagesError):
        pool.acquire(limit - used + 1)
    assert drv.end_capture(stream) == 0, "a call during the capture invalidated it"
    # The pool's next call releases what the capture kept: the trim's (every free page).
    assert pool.set_limit(limit) == limit
    assert device_memory(drv) == (used, used * g) and not pool.stats().release_pending
    pool.decref_all(held)


@check()
def test_the_capture_flag_defers_every_release_until_it_is_lowered(drv, rng):
    """graph_capture() announces a capture vpaged cannot see (thread-local or relaxed mode, a stream nobody
    registered): trims and limit changes from any thread wait, and the flag's last exit releases them."""
    from vpaged.memory import capture_active, graph_capture

    g = drv.granularity
    n = int(rng.integers(4, 10))
    backend, pool = fake.make_pool(drv, n, n, batch=n)
    limit = int(rng.integers(0, n - 1))
    stream = drv.stream()
    with graph_capture():
        drv.begin_capture(stream, CAPTURE_RELAXED)  # the driver itself would allow the calls: only the flag stops them
        assert capture_active() and in_thread(capture_active)
        with graph_capture():  # nested (vLLM's capture inside torch.cuda.graph's): counted
            assert in_thread(lambda: pool.set_limit(limit)) == limit
        assert device_memory(drv) == (n, n * g), "the inner exit released while the outer capture runs"
        in_thread(pool.trim)
        assert device_memory(drv) == (n, n * g) and pool.stats().release_pending
        assert drv.end_capture(stream) == 0
    assert not capture_active()
    assert device_memory(drv) == (0, 0), "the flag's exit must release what the capture deferred"
    assert not pool.stats().release_pending


@check()
def test_mapping_under_the_capture_flag_is_refused_and_changes_nothing(drv, rng):
    """Mapping creates and maps pages (cuMemCreate, cuMemMap, cuMemSetAccess): under the flag it is refused
    before any of that, as unmapping is; the same call succeeds after the capture."""
    from vpaged.memory import graph_capture

    g = drv.granularity
    n = int(rng.integers(2, 6))
    backend, pool = fake.make_pool(drv, n, 0, batch=n)
    r = C.VirtualRange(pool, n * g)
    (page,) = r.map_new([0])
    before, stats = drv.snapshot(), (pool.stats().used_pages, backend.created_pages, r.mapped_pages)
    with graph_capture():
        with pytest.raises(BackendError, match="mapping would invalidate"):
            r.map_new(list(range(1, n)))
        with pytest.raises(BackendError, match="mapping would invalidate"):
            r.map_shared([1], [page])
        with pytest.raises(BackendError, match="CUDA graph capture runs"):
            r.unmap([0])
        assert drv.calls_since(before, *fake.VMM_CALLS) == {}
        assert (pool.stats().used_pages, backend.created_pages, r.mapped_pages) == stats
    r.map_new(list(range(1, n)))
    r.unmap(list(range(n)))


# ---------------------------------------------------------------------------------------------------
# Item: a range destroyed during a capture.


@check()
def test_a_range_destroyed_during_a_capture_keeps_its_pages_until_the_capture_ends(drv, rng):
    """The stream wait of a range's teardown is refused while its stream captures: the pages must stay mapped
    and referenced (kernels queued before may still write through the range), and go after the capture."""
    g = drv.granularity
    n = int(rng.integers(2, 6))
    backend, pool = fake.make_pool(drv, 2 * n, 0, batch=2 * n)
    r = C.VirtualRange(pool, n * g)
    pages = r.map_new(list(range(n)))
    address = r.address
    data = write_pages(rng, r, range(n), g)
    stream = drv.stream()
    r.add_stream(stream)
    worker = drv.stream()  # a kernel queued before the capture, on a stream nobody registered
    assert drv.launch_read(worker, address, n * g) == 0
    drv.begin_capture(stream)
    del r
    assert pool.stats().used_pages == n, "the teardown dropped the references of pages still mapped"
    assert [pool.refcount(p) for p in pages] == [1] * n
    assert fake.protection(address) == "rw-s" and reads_back_at(address, data, g)
    assert pool.stats().deferred_teardowns == 1
    # Meanwhile the pool hands none of them out, and a trim keeps them.
    assert sorted(set(pool.acquire(n)) & set(pages)) == []
    pool.trim()
    assert drv.end_capture(stream) == 0, "the teardown invalidated the capture"
    assert pool.release_deferred()
    assert fake.protection(address) == "---p" or fake.protection(address) == ""
    assert drv.sticky_error() == 0, "the queued kernel ran after its memory was unmapped"
    assert pool.stats().deferred_teardowns == 0
    assert pool.stats().used_pages == n  # only the n acquired since
    pool.decref_all([p for p in range(2 * n) if pool.refcount(p) > 0])


def reads_back_at(address, data, page) -> bool:
    return all(np.array_equal(fake.host_bytes(address + i * page, page), d) for i, d in data.items())


@check()
def test_a_cache_dropped_under_the_capture_flag_is_torn_down_when_the_flag_drops(drv, rng):
    """A cache whose last reference goes while the flag is up (an engine torn down mid-capture): its range's
    teardown waits for the flag's exit; closing it explicitly then is refused (nothing changed)."""
    import gc

    from vpaged.memory import graph_capture

    torch.cuda.current_stream = lambda device=None: fake.CurrentStream()  # this child process only
    g = drv.granularity
    pool = vpaged.memory.PagePool("cuda", capacity_bytes=16 * g)
    caches = [
        vpaged.VirtualKVCache(
            KVGeometry(1, 8, 128, torch.bfloat16), VirtualCacheConfig(max_seqs=2, max_seq_len=2048), pool=pool
        )
        for _ in range(2)
    ]
    for cache in caches:
        cache.extend(cache.allocate(), 2048)
    used = pool.stats().used_pages
    mappings, reservations = drv.live("mappings"), drv.live("reservations")
    with graph_capture():
        with pytest.raises(BackendError, match="capture"):
            caches[0].close()  # an unmap during the capture: refused, nothing changed
        assert pool.stats().used_pages == used and drv.live("mappings") == mappings
        del cache
        caches.pop(1)
        gc.collect()
        assert pool.stats().used_pages == used and drv.live("mappings") == mappings
        assert drv.live("reservations") == reservations and pool.stats().deferred_teardowns == 1
    assert pool.stats().deferred_teardowns == 0 and pool.stats().used_pages == used // 2
    assert drv.live("reservations") == reservations - 1
    caches[0].close()
    assert pool.stats().used_pages == 0


# ---------------------------------------------------------------------------------------------------
# Item: a budget member asked to give back while another engine of the process captures.


def kv_cache(budget):
    return vpaged.VirtualKVCache(
        KVGeometry(1, 8, 128, torch.bfloat16),
        VirtualCacheConfig(max_seqs=4, max_seq_len=2048, device="cuda", shared_budget=budget),
    )


def fill(cache, seqs) -> list:
    """Allocate and extend `seqs` full sequences; all or nothing (a sequence that found no pages is freed)."""
    out = []
    try:
        for _ in range(seqs):
            out.append(cache.allocate())
            cache.extend(out[-1], cache.layout.max_seq_len)
    except OutOfPagesError:
        for s in out:
            cache.free(s)
        raise
    return out


@check()
def test_a_member_asked_during_a_capture_unmaps_nothing_and_gives_the_rest_after(drv, rng):
    g = drv.granularity
    torch.cuda.current_stream = lambda device=None: fake.CurrentStream()  # this child process only
    name = f"test-cuda-{uuid.uuid4().hex[:12]}"
    pages = 16
    drv.set_memory_limit(pages * g)
    SharedBudget.create(name, capacity_bytes=pages * g, page_size=g)
    try:
        a, b = kv_cache(name), kv_cache(name)
        for s in fill(a, 4)[1:]:  # the whole budget; then all but one sequence dormant (mapped, reclaimable)
            a.free(s)
        mapped = drv.live("mappings")
        stream = drv.stream()
        drv.begin_capture(stream)  # global mode: any thread's unmap or release would break it
        with pytest.raises(OutOfPagesError):
            fill(b, 1)  # asks A; A's thread may give its free pages only: it has none
        time.sleep(0.2)  # A's thread polls every 20 ms
        assert drv.violations() == (0, ""), "A unmapped or released pages during the capture"
        assert drv.live("mappings") == mapped, "A unmapped pages during the capture"
        assert drv.end_capture(stream) == 0, "A's give-back invalidated the capture"
        deadline = time.monotonic() + 10
        while True:  # after the capture, A gives its dormant pages
            try:
                fill(b, 1)
                break
            except OutOfPagesError:
                assert time.monotonic() < deadline, "A never gave its dormant pages after the capture"
                time.sleep(0.05)
        for cache in (a, b):
            cache.close()
            cache.pool.leave_budget()
        del a, b, cache
    finally:
        SharedBudget.remove(name, force=True)


if __name__ == "__main__":  # the runner in the child process: python this_file RESULT_JSON CHECK...
    fake.CHECKS.update(CHECKS)
    fake._serve(sys.argv[1], sys.argv[2:])
