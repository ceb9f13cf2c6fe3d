"""Giving device memory back on the CUDA backend, without a GPU: PagePool.trim releases the cuMemCreate handles
of free pages, a released id is re-created before it is handed out again, and a SharedBudget's members on one
(fake) device really pass memory to each other.

The checks run as test_cuda_backend_fake.py runs its own (one child process whose LD_LIBRARY_PATH finds the fake
driver, a fresh fork per check, no API violation and no driver object left behind afterwards); this module only
adds its checks to that runner's table. Device pointers under the fake are host addresses: pages are written and
read with numpy, through the ranges' mappings and through the pool window (copy_to_host / copy_from_host)."""

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
from vpaged.errors import BackendError, InvalidArgumentError, OutOfPagesError
from vpaged.memory import SharedBudget

THIS_FILE = Path(__file__).resolve()
CHECKS: dict = {}


check = fake.check_registrar(CHECKS, "budget_fake_results")  # @check(**env): a check run under the fake driver


@pytest.fixture(scope="module")
def budget_fake_results(request, fake_driver_dir) -> dict:  # noqa: F811 - the imported fixture
    return fake.run_checks(request, fake_driver_dir, THIS_FILE, CHECKS, (str(THIS_FILE.parent),))


# ---------------------------------------------------------------------------------------------------
# Helpers inside a check's process.


def write_pages(rng, range_, indices, page) -> dict:
    """Random bytes into the pages mapped at `indices` of a range, through the range's mapping."""
    data = {}
    for i in indices:
        data[i] = fake.random_bytes(rng, page)
        fake.host_bytes(range_.address + i * page, page)[:] = data[i]
    return data


def reads_back(range_, data, page) -> bool:
    return all(np.array_equal(fake.host_bytes(range_.address + i * page, page), d) for i, d in data.items())


def device_memory(drv) -> tuple:
    """The fake device's live allocations and their bytes."""
    return drv.live("allocations"), drv.live("allocated_bytes")


# ---------------------------------------------------------------------------------------------------
# trim() on a CUDA pool


@check()
def test_trim_releases_the_handles_of_free_pages_and_reacquired_ids_get_memory_again(drv, rng):
    g = drv.granularity
    n = 8
    backend, pool = fake.make_pool(drv, n, 0, batch=n)
    r = C.VirtualRange(pool, n * g)
    pages = r.map_new(list(range(n)))
    data = write_pages(rng, r, range(n), g)
    keep = int(rng.integers(1, n - 2))  # indices 0..keep-1 stay mapped
    r.unmap(list(range(keep, n)))
    # A free page keeps its handle (creation is the slow call): nothing is released by freeing.
    assert device_memory(drv) == (n, n * g) and backend.created_pages == n
    before = drv.snapshot()
    assert pool.trim() == n - keep
    assert device_memory(drv) == (keep, keep * g), "trim must release the free pages' device memory"
    assert backend.created_pages == pool.stats().created_pages == keep
    assert backend.page_ids == n  # the ids stay valid, without memory
    calls = drv.calls_since(before, *fake.VMM_CALLS)
    assert calls["cuMemRelease"] == n - keep and calls["cuMemUnmap"] >= 1, calls  # one unmap per run of ids
    assert "cuMemCreate" not in calls and "cuMemSetAccess" not in calls
    assert drv.live("mappings") == 2 * keep  # the window and the range, for the live pages only
    assert reads_back(r, {i: data[i] for i in range(keep)}, g)
    st = pool.stats()
    assert (st.used_pages, st.free_pages, st.total_pages) == (keep, n - keep, n)
    # A released id is not usable until handed out again: no copy may reach its (unmapped) window address.
    released = pages[keep]
    out = np.empty(g, np.uint8)
    with pytest.raises(InvalidArgumentError, match="has no memory"):
        pool.copy_to_host(released, out.ctypes.data)
    assert pool.trim() == n - keep and device_memory(drv) == (keep, keep * g)  # a second trim: nothing to do

    # Handed out again: re-created (cuMemCreate + window map + access) before anyone sees them.
    before = drv.snapshot()
    again = r.map_new(list(range(keep, n)))
    assert sorted(again) == sorted(pages[keep:])
    calls = drv.calls_since(before, "cuMemCreate", "cuMemMap")
    assert calls == {"cuMemCreate": n - keep, "cuMemMap": 2 * (n - keep)}, calls  # the window, then the range
    assert device_memory(drv) == (n, n * g) and backend.created_pages == n
    fresh = write_pages(rng, r, range(keep, n), g)
    assert reads_back(r, fresh, g) and reads_back(r, {i: data[i] for i in range(keep)}, g)
    # Copies through the pool window see what the range's mapping wrote, both ways.
    for i in range(keep, n):
        assert np.array_equal(fake.page_contents(pool, again[i - keep]), fresh[i])
    other = fake.random_bytes(rng, g)
    pool.copy_from_host(again[0], other.ctypes.data)
    backend.synchronize()
    assert np.array_equal(fake.host_bytes(r.address + keep * g, g), other)
    r.unmap(list(range(n)))


@check()
def test_pages_with_memory_are_handed_out_before_released_ones_and_read_zero_on_reuse(drv, rng):
    g = drv.granularity
    n = 8
    for zero_on_reuse in (False, True):
        backend, pool = fake.make_pool(drv, n, n, batch=n)
        pool.zero_on_reuse = zero_on_reuse
        r = C.VirtualRange(pool, n * g)
        r.map_new(list(range(n)))
        data = write_pages(rng, r, range(n), g)
        r.unmap(list(range(2, n)))
        pool.trim()  # 6 released
        (dirty,) = r.pages_at([1])
        r.unmap([1])  # freed after the trim: keeps its handle and its bytes
        assert backend.created_pages == 2 and device_memory(drv) == (2, 2 * g)
        before = drv.snapshot()
        got = r.map_new([1, 2, 3])
        assert got[0] == dirty, "a free page with memory goes out before a released id is re-created"
        assert drv.calls_since(before, "cuMemCreate") == {"cuMemCreate": 2}
        if zero_on_reuse:
            assert all(not fake.host_bytes(r.address + i * g, g).any() for i in (1, 2, 3))
        else:
            assert np.array_equal(fake.host_bytes(r.address + g, g), data[1])  # reused as it was
        assert reads_back(r, {0: data[0]}, g)
        fresh = write_pages(rng, r, (1, 2, 3), g)
        assert reads_back(r, fresh, g)
        r.unmap([0, 1, 2, 3])
        del r, pool, backend  # the next round counts only its own device memory


@check()
def test_lowering_the_limit_releases_free_pages_beyond_it(drv, rng):
    """A budget that lowers a pool's limit gave the difference to another member: on CUDA the free pages
    beyond the new limit must let go of their device memory at once (the host punched their holes already)."""
    g = drv.granularity
    n = 10
    backend, pool = fake.make_pool(drv, n, n)
    pages = pool.acquire(n)
    used = int(rng.integers(1, 4))
    pool.decref_all(pages[used:])
    assert device_memory(drv) == (n, n * g)
    limit = int(rng.integers(used, n - 1))
    assert pool.set_limit(limit) == limit
    assert backend.created_pages == limit and device_memory(drv) == (limit, limit * g)
    assert pool.free_pages() == limit - used
    assert pool.set_limit(0) == used  # clamped to the pages in use; those keep their memory
    assert backend.created_pages == used and [pool.refcount(p) for p in pages[:used]] == [1] * used
    pool.set_limit(n)
    more = pool.acquire(n - used)  # every free id again, re-created as it goes out
    assert backend.created_pages == n and device_memory(drv) == (n, n * g)
    pool.decref_all(pages[:used] + more)


@check()
def test_a_failed_re_create_raises_out_of_pages_and_changes_nothing(drv, rng):
    g = drv.granularity
    n = 8
    backend, pool = fake.make_pool(drv, n, n, batch=n)
    r = C.VirtualRange(pool, n * g)
    r.map_new(list(range(n)))
    data = write_pages(rng, r, range(2), g)
    r.unmap(list(range(2, n)))
    pool.trim()

    def state():
        s = pool.stats()
        return (
            (s.used_pages, s.free_pages, s.created_pages, s.high_water_pages),
            r.mapped_pages,
            r.pages_at(list(range(n))),
            device_memory(drv),
            drv.live("mappings"),
            drv.live("accessible_mappings"),
        )

    before = state()
    want = int(rng.integers(2, n - 2))
    drv.set_memory_limit(drv.live("allocated_bytes") + (want - 1) * g)  # one page short
    with pytest.raises(OutOfPagesError, match="no memory to re-create"):
        r.map_new(list(range(2, 2 + want)))
    assert state() == before
    drv.set_memory_limit(None)
    for call, skip in (("cuMemMap", int(rng.integers(0, want))), ("cuMemSetAccess", 0), ("cuMemCreate", 1)):
        drv.fail(call, skip=skip)  # a driver error part way: undone as well
        with pytest.raises(BackendError, match=f"{call}.* failed"):
            r.map_new(list(range(2, 2 + want)))
        assert state() == before, call
    r.map_new(list(range(2, 2 + want)))  # nothing was lost: the same ids go out now
    assert r.mapped_pages == 2 + want and reads_back(r, data, g)
    r.unmap(list(range(2 + want)))


@check()
def test_random_acquire_free_trim_and_limit_keep_data_and_device_memory_within_the_limit(drv, rng):
    """Random acquire / free / trim / set_limit on a CUDA pool against a plain model (page -> bytes written):
    pages in use keep their bytes, newly handed out pages read zero (zero_on_reuse), and the pages with device
    memory are the fake's live allocations, never above the limit, and exactly those in use after a trim."""
    g = drv.granularity
    n = 8
    backend, pool = fake.make_pool(drv, n, 0, batch=int(rng.integers(1, 5)))
    pool.zero_on_reuse = True
    held: dict = {}  # page in use -> what was written into it
    for _ in range(40):
        op = rng.choice(["acquire", "free", "trim", "limit"])
        if op == "acquire":
            k = int(rng.integers(1, 4))
            if len(held) + k > pool.limit:
                with pytest.raises(OutOfPagesError):
                    pool.acquire(k)
                continue
            for page in pool.acquire(k):
                assert page not in held and not fake.page_contents(pool, page).any()
                held[page] = fake.random_bytes(rng, g)
                pool.copy_from_host(page, held[page].ctypes.data)
            backend.synchronize()
        elif op == "free" and held:
            gone = [p for p in held if rng.random() < 0.5]
            pool.decref_all(gone)
            for p in gone:
                del held[p]
        elif op == "trim":
            free_ids = min(backend.page_ids, pool.limit) - len(held)  # ids created and free, within the limit
            assert pool.trim() == free_ids
            assert backend.created_pages == len(held)
        elif op == "limit":
            want = int(rng.integers(0, n + 1))
            assert pool.set_limit(want) == max(want, len(held))
        assert backend.created_pages <= pool.limit and backend.created_pages >= len(held)
        assert device_memory(drv) == (backend.created_pages, backend.created_pages * g)
        assert pool.stats().used_pages == len(held)
        assert all(np.array_equal(fake.page_contents(pool, p), d) for p, d in held.items())
    pool.decref_all(list(held))


# ---------------------------------------------------------------------------------------------------
# The shared budget over cuMemCreate allocations of one device


def kv_cache(budget):
    # 1 layer x K/V of 8 heads x 128 bf16: 1,024 tokens per 2 MiB page and region; 2,048 tokens = 4 pages.
    return vpaged.VirtualKVCache(
        KVGeometry(1, 8, 128, torch.bfloat16),
        VirtualCacheConfig(max_seqs=4, max_seq_len=2048, device="cuda", shared_budget=budget),
    )


def fill(cache, rng, seqs) -> dict:
    """Allocate and extend `seqs` full sequences; random bytes into their K and V (through the cache's range)."""
    out, lay = {}, cache.layout
    for _ in range(seqs):
        s = cache.allocate()
        cache.extend(s, lay.max_seq_len)
        for kv in (0, 1):
            nbytes = lay.max_seq_len * lay.token_bytes
            out[s, kv] = fake.random_bytes(rng, nbytes)
            fake.host_bytes(cache._range.address + lay.offset(0, kv, cache.slot(s)), nbytes)[:] = out[s, kv]
    return out


def intact(cache, data) -> bool:
    lay = cache.layout
    return all(
        np.array_equal(fake.host_bytes(cache._range.address + lay.offset(0, kv, cache.slot(s)), len(d)), d)
        for (s, kv), d in data.items()
    )


@check()
def test_an_idle_member_gives_its_device_memory_to_another(drv, rng):
    """Two CUDA caches on one fake device, each a member of one SharedBudget as large as the device: A fills the
    budget, frees all but one sequence and goes idle; B's sequences need A's pages. The device cannot hold
    B's pages next to A's, so B succeeds only because A's give-back thread released A's handles (trim)."""
    g = drv.granularity
    torch.cuda.current_stream = lambda device=None: fake.CurrentStream()  # this child process only
    name = f"test-cuda-{uuid.uuid4().hex[:12]}"
    pages = 16
    drv.set_memory_limit(pages * g)  # the whole device: the budget is all of it
    SharedBudget.create(name, capacity_bytes=pages * g, page_size=g)  # one CUDA page: the granularity
    try:
        a, b = kv_cache(name), kv_cache(name)
        data_a = fill(a, rng, 4)  # 4 sequences x 4 pages: the whole budget, and the whole device
        assert a.pool.stats().used_pages == pages and device_memory(drv) == (pages, pages * g)
        live = next(iter(data_a))[0]
        for s in {s for s, _ in data_a} - {live}:
            a.free(s)  # dormant: mapped, A's until asked for
        keep = {key: d for key, d in data_a.items() if key[0] == live}
        a_backend = a.pool.backend
        assert a_backend.created_pages == pages

        released = drv.calls("cuMemRelease")
        started = time.monotonic()
        data_b = fill(b, rng, 3)  # 12 pages: only A's released handles make room on the device
        took = time.monotonic() - started
        assert took < 2.0, f"B waited {took:.2f} s for A's pages"
        assert a_backend.created_pages == 4, "A must hold device memory only for its live sequence"
        assert drv.calls("cuMemRelease") - released >= 12
        assert device_memory(drv) == (pages, pages * g)  # A's 4 live pages + B's 12
        assert intact(a, keep) and intact(b, data_b)
        state = SharedBudget.open(name).state()
        assert state.granted_bytes <= state.capacity_bytes
        with pytest.raises(OutOfPagesError):  # A's live sequence is never taken
            fill(b, rng, 1)
        assert intact(a, keep) and intact(b, data_b)
        assert a_backend.created_pages == 4 and device_memory(drv) == (pages, pages * g)
        for cache in (a, b):
            cache.close()
            cache.pool.leave_budget()
        del a, b, a_backend, cache
    finally:
        SharedBudget.remove(name, force=True)


if __name__ == "__main__":  # the runner in the child process: python this_file RESULT_JSON CHECK...
    fake.CHECKS.update(CHECKS)
    fake._serve(sys.argv[1], sys.argv[2:])
