"""Free pages that keep their memory (PagePool(keep_freed_bytes=...)): within the bound the most recently freed
pages keep their memory and data, the rest give it back at once; zero_on_reuse, trim() and a lower limit; swap
and copy-on-write on such a pool keep every value."""

import gc

import pytest
import torch

import vpaged
from vpaged import _C, KVGeometry, VirtualCacheConfig

PAGE = 2**16
FLOATS = PAGE // 4


def pages_after_free_and_remap(pool, rng, n=6):
    """Map pages 0..n-1 of a fresh range, fill them with random floats, unmap them (their last references go),
    map them again: the same home pages come back. Returns (before, after) as [n, floats per page]."""
    r = _C.VirtualRange(pool._pool, 8 * PAGE)
    r.map_new(list(range(n)))
    view = torch.from_dlpack(r.view(0, [n * FLOATS], [1], 2, 32))
    before = torch.randn(n * FLOATS, generator=rng) + 5  # never 0
    view.copy_(before)
    del view
    gc.collect()
    r.unmap(list(range(n)))
    kept = pool.stats().kept_free_pages
    r.map_new(list(range(n)))
    assert pool.stats().kept_free_pages == 0  # handed out again: no longer kept
    view = torch.from_dlpack(r.view(0, [n * FLOATS], [1], 2, 32))
    after = view.clone()
    del view
    gc.collect()
    r.unmap(list(range(n)))
    return before.view(n, FLOATS), after.view(n, FLOATS), kept


@pytest.mark.parametrize("keep_pages", [0, 3, 6, 8])
def test_freed_pages_keep_their_memory_up_to_the_bound(keep_pages, rng):
    """keep_freed_bytes: the most recently freed pages, up to the bound, keep their memory and data (handed out
    again they read what they held); the others' memory goes back at once (their holes read zeros)."""
    pool = vpaged.PagePool("cpu", capacity_bytes=64 * PAGE, page_size=PAGE, keep_freed_bytes=keep_pages * PAGE)
    assert pool.keep_freed_bytes == keep_pages * PAGE
    before, after, kept = pages_after_free_and_remap(pool, rng)
    assert kept == min(keep_pages, 6)
    held = [bool(torch.equal(a, b)) for a, b in zip(after, before)]
    zeros = [int(torch.count_nonzero(a)) == 0 for a in after]
    assert all(h != z for h, z in zip(held, zeros))  # each page: all its old data, or all zeros
    assert sum(held) == min(keep_pages, 6)
    assert held == sorted(held)  # the oldest freed (lowest index first) gave their memory back first
    assert pool.stats().kept_free_pages == min(keep_pages, 6)  # the unmap at the end kept them again
    assert pool.stats().used_pages == 0


def test_kept_pages_are_zeroed_when_asked_and_given_back_by_trim_and_a_lower_limit(rng):
    pool = vpaged.PagePool(
        "cpu", capacity_bytes=64 * PAGE, page_size=PAGE, keep_freed_bytes=8 * PAGE, zero_on_reuse=True
    )
    _, after, kept = pages_after_free_and_remap(pool, rng)
    assert kept == 6 and torch.count_nonzero(after) == 0  # zero_on_reuse zeroes kept pages too

    pool = vpaged.PagePool("cpu", capacity_bytes=64 * PAGE, page_size=PAGE, keep_freed_bytes=8 * PAGE)
    pages_after_free_and_remap(pool, rng)
    assert pool.stats().kept_free_pages == 6
    assert pool.trim() == 64 and pool.stats().kept_free_pages == 0
    _, after, kept = pages_after_free_and_remap(pool, rng)
    assert kept == 6 and pool.stats().kept_free_pages == 6
    pool._pool.set_limit(32)  # a budget taking pages back: the memory of kept pages goes with them
    assert pool.stats().kept_free_pages == 0
    pool.keep_freed_bytes = 2 * PAGE + 1  # whole pages: 2
    assert pool.keep_freed_bytes == 2 * PAGE
    before, after, kept = pages_after_free_and_remap(pool, rng)
    assert kept == 2 and sum(bool(torch.equal(a, b)) for a, b in zip(after, before)) == 2
    pool.keep_freed_bytes = 0  # lowering the bound gives back what is beyond it
    assert pool.stats().kept_free_pages == 0


@pytest.mark.parametrize("bad", [-1, True, 1.5, "64"])
def test_keep_freed_bytes_must_be_a_byte_count(bad):
    with pytest.raises(vpaged.InvalidArgumentError, match="keep_freed_bytes"):
        vpaged.PagePool("cpu", capacity_bytes=8 * PAGE, page_size=PAGE, keep_freed_bytes=bad)
    pool = vpaged.PagePool("cpu", capacity_bytes=8 * PAGE, page_size=PAGE, keep_freed_bytes=PAGE)
    with pytest.raises(vpaged.InvalidArgumentError, match="keep_freed_bytes"):
        pool.keep_freed_bytes = bad
    assert pool.keep_freed_bytes == PAGE


@pytest.mark.parametrize("keep", [0, 256 * PAGE], ids=["default", "kept"])
def test_swap_and_copy_on_write_with_kept_pages_keep_every_value(keep, rng):
    """Swap out / in and a fork's first write on a pool that keeps freed memory: data bit-exact, parent and
    child independent, the kept pages within the bound."""
    pool = vpaged.PagePool("cpu", capacity_bytes=512 * PAGE, page_size=PAGE, keep_freed_bytes=keep)
    cache = vpaged.VirtualKVCache(
        KVGeometry(2, 2, 64, torch.float32),
        VirtualCacheConfig(max_seqs=8, max_seq_len=1024, swap_bytes=256 * PAGE),
        pool=pool,
    )
    seqs, data = [], {}
    for n in (700, 333):
        s = cache.allocate()
        cache.extend(s, n)
        for layer in range(2):
            kv = (torch.randn(n, 2, 64, generator=rng), torch.randn(n, 2, 64, generator=rng))
            cache.write(layer, s, *kv)
            data[s, layer] = kv
        seqs.append(s)
    for _ in range(3):
        cache.swap_out(seqs[0])
        assert pool.stats().kept_free_pages <= keep // PAGE
        cache.swap_in(seqs[0])
        for s in seqs:
            for layer in range(2):
                k, v = cache.kv(layer, s)
                assert torch.equal(k, data[s, layer][0]) and torch.equal(v, data[s, layer][1])
    child = cache.fork(seqs[1])
    cache.extend(child, 1)  # copy-on-write of the partly filled last pages
    for layer in range(2):
        k1, v1 = torch.randn(1, 2, 64, generator=rng), torch.randn(1, 2, 64, generator=rng)
        cache.write(layer, child, k1, v1)
        k, v = cache.kv(layer, child)
        assert torch.equal(k[:333], data[seqs[1], layer][0]) and torch.equal(k[333:], k1)
        assert torch.equal(v[:333], data[seqs[1], layer][1]) and torch.equal(v[333:], v1)
        pk, pv = cache.kv(layer, seqs[1])
        assert torch.equal(pk, data[seqs[1], layer][0]) and torch.equal(pv, data[seqs[1], layer][1])
    del k, v, pk, pv
    gc.collect()
    cache.close()
    assert pool.stats().used_pages == 0 and pool.stats().kept_free_pages <= keep // PAGE


def test_kept_pages_survive_many_reuses_of_others(rng):
    """Pages freed and handed out again thousands of times next to a kept page that stays free: the bound holds
    throughout and the kept page keeps its data (the pool compacts its list of kept pages as it goes)."""
    pool = vpaged.PagePool("cpu", capacity_bytes=64 * PAGE, page_size=PAGE, keep_freed_bytes=4 * PAGE)
    r = _C.VirtualRange(pool._pool, 8 * PAGE)
    r.map_new([0])
    view = torch.from_dlpack(r.view(0, [FLOATS], [1], 2, 32))
    data = torch.randn(FLOATS, generator=rng) + 5
    view.copy_(data)
    del view
    gc.collect()
    r.unmap([0])  # kept, and never handed out below
    for i in range(3000):
        r.map_new([1 + i % 2, 3])
        assert pool.stats().kept_free_pages <= 4
        r.unmap([1 + i % 2, 3])
    assert pool.stats().kept_free_pages == 4  # page 0, page 3 and pages 1, 2
    r.map_new([0])
    view = torch.from_dlpack(r.view(0, [FLOATS], [1], 2, 32))
    assert torch.equal(view, data)
    del view
    gc.collect()


@pytest.mark.parametrize("zero_on_reuse", [False, True])
def test_copy_on_write_into_kept_and_punched_pages_copies_every_value(zero_on_reuse, rng):
    """A fork's first write copies into the fresh page before the remap: into a kept page (its memory in place,
    written through the range's second mapping of its pages), into a hole (a pwrite), and into a kept page again
    after trim() punched it. Every cycle: the copy equals the parent's page, and parent and child are
    independent afterwards."""
    pool = vpaged.PagePool(
        "cpu", capacity_bytes=64 * PAGE, page_size=PAGE, keep_freed_bytes=8 * PAGE, zero_on_reuse=zero_on_reuse
    )
    r = _C.VirtualRange(pool._pool, 8 * PAGE)
    (parent,) = r.map_new([0])

    def view(index):
        return torch.from_dlpack(r.view(index * PAGE, [FLOATS], [1], 2, 32))

    for cycle in range(12):
        if cycle == 8:
            pool.trim()  # the kept pages are punched: the next copies go into holes
            assert pool.stats().kept_free_pages == 0
        data = torch.randn(FLOATS, generator=rng) + 5
        view(0).copy_(data)
        r.map_shared([1, 2], [parent, parent])
        assert r.make_private([1, 2]) == 2
        child1, child2 = view(1), view(2)
        assert torch.equal(child1, data) and torch.equal(child2, data), cycle
        child1.copy_(-data)
        assert torch.equal(view(0), data) and torch.equal(child2, data)
        view(0).fill_(7.0)
        assert torch.equal(child1, -data) and torch.equal(child2, data)
        del child1, child2
        gc.collect()
        r.unmap([1, 2])  # the copies' pages go free: kept, and the next cycle copies into them again
        assert pool.stats().kept_free_pages <= 8
    gc.collect()
    r.unmap([0])
    assert pool.stats().used_pages == 0
