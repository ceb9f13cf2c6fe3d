"""Beam reorder and swap by runs of pages (issue #40, items 3 and 4), on the host backend.

reorder() is one range call (VirtualRange.reorder_runs): unchanged pages are left alone, a beam's partly filled
last page is copied into the destination's own page where that page is private, everything else is remapped by
runs. Swap moves a sequence's pages in one pool call. Every check compares the cache with a plain torch copy of
what each sequence must hold, on fresh random data."""

import random

import pytest
import torch
from test_cache import assert_same, snapshot

import vpaged
from vpaged import KVGeometry, VirtualCacheConfig, VirtualKVCache

PAGE = 64 * 1024
LAYOUTS = ["per_layer", "interleaved", "head_major"]


def make(layout="per_layer", max_seqs=8, max_len=1200, capacity_pages=400, **kw):
    # 2 layers, 2 heads x 64 dims fp32: per_layer 128 tokens a page, interleaved 32, head_major 256 per head
    return VirtualKVCache(
        KVGeometry(2, 2, 64, torch.float32),
        VirtualCacheConfig(
            max_seqs=max_seqs, max_seq_len=max_len, capacity_bytes=capacity_pages * PAGE, layout=layout, **kw
        ),
    )


class Reference:
    """What each sequence holds, as ordinary tensors: [tokens, heads, dim] per layer and K/V."""

    def __init__(self, cache, rng):
        self.cache, self.rng, self.kv = cache, rng, {}

    def grow(self, seq, n):
        c = self.cache
        c.extend(seq, n)
        for layer in range(c.num_layers):
            k = torch.randn(n, c.num_kv_heads, c.head_dim, generator=self.rng)
            v = torch.randn(n, c.num_kv_heads, c.head_dim, generator=self.rng)
            c.write(layer, seq, k, v)
            old = self.kv.get((seq, layer), (k[:0], v[:0]))
            self.kv[seq, layer] = (torch.cat([old[0], k]), torch.cat([old[1], v]))

    def reorder(self, seqs, sources):
        self.cache.reorder(seqs, sources)
        before = {(s, layer): self.kv.get((s, layer)) for s in seqs for layer in range(self.cache.num_layers)}
        for s, i in zip(seqs, sources):
            for layer in range(self.cache.num_layers):
                self.kv[s, layer] = before[seqs[i], layer]

    def check(self):
        for (seq, layer), (k, v) in self.kv.items():
            ck, cv = self.cache.kv(layer, seq)
            assert torch.equal(ck, k) and torch.equal(cv, v), (seq, layer)


def beams(cache, ref, lengths):
    seqs = cache.allocate_many(len(lengths))
    for s, n in zip(seqs, lengths):
        ref.grow(s, n)
    return seqs


@pytest.mark.parametrize("layout", LAYOUTS)
def test_random_beam_steps_match_a_torch_reference(layout, rng):
    cache = make(layout)
    ref = Reference(cache, rng)
    pick = random.Random(int(torch.randint(0, 2**31, (1,), generator=rng)))
    seqs = beams(cache, ref, [pick.randrange(1, 400) for _ in range(6)])
    for step in range(30):
        kind = pick.choice(["random", "permutation", "identity", "one"])
        if kind == "random":  # repeated indices: several beams take one
            sources = [pick.randrange(len(seqs)) for _ in seqs]
        elif kind == "permutation":  # beams trading places: cycles of last pages
            sources = pick.sample(range(len(seqs)), len(seqs))
        elif kind == "identity":  # every row onto itself: nothing changes
            sources = list(range(len(seqs)))
        else:
            sources = [pick.randrange(len(seqs))] * len(seqs)
        ref.reorder(seqs, sources)
        ref.check()
        for s in seqs:  # every beam writes: partly filled pages, page boundaries, runs broken by copies
            if cache.seq_len(s) < 1000:
                ref.grow(s, pick.choice([1, 1, 1, 7, 40, 130]))
        ref.check()
    for s in seqs:
        cache.free(s)
    cache.reclaim()
    assert cache.pool.stats().used_pages == 0


def test_private_last_pages_are_copied_without_mapping_calls(rng):
    cache = make("per_layer")
    ref = Reference(cache, rng)
    seqs = beams(cache, ref, [300, 300, 300, 300])
    # Make the rows share their full pages (as beams of one prompt do), with private last pages.
    ref.reorder(seqs, [0, 0, 0, 0])
    for s in seqs:
        ref.grow(s, 1)
    backend = cache.pool.backend
    calls = backend.map_calls + backend.unmap_calls
    copies = cache.stats().cow_copies
    # Rows 2 and 3 take rows 0 and 1, which keep their own beams: only last pages differ, and rows 2 and 3 are
    # read by no one, so their own last pages take the copies.
    ref.reorder(seqs, [0, 1, 0, 1])
    ref.check()
    assert backend.map_calls + backend.unmap_calls == calls
    assert cache.stats().cow_copies - copies == 2 * cache.layout.runs
    copies = cache.stats().cow_copies
    for s in seqs:  # the copied pages are private: the next token copies nothing
        ref.grow(s, 1)
    assert cache.stats().cow_copies == copies
    ref.check()


def test_a_run_of_pages_is_one_mapping_call(rng):
    cache = make("interleaved", max_len=1200)  # one region: a run of 20 pages per slot
    ref = Reference(cache, rng)
    seqs = beams(cache, ref, [640, 640])  # 20 full pages each, their own (consecutive home pages)
    backend = cache.pool.backend
    calls = backend.map_calls
    ref.reorder(seqs, [1, 1])  # row 0 takes row 1's 20 pages
    ref.check()
    assert backend.map_calls - calls == 1
    ref.grow(seqs[0], 5)  # row 0's next token copies the page it shares
    ref.grow(seqs[1], 5)
    ref.check()


def test_cycles_and_chains_of_last_pages(rng):
    cache = make("head_major")
    ref = Reference(cache, rng)
    seqs = beams(cache, ref, [100, 150, 200, 250, 50])
    ref.reorder(seqs, [1, 2, 0, 3, 3])  # 0 <- 1 <- 2 <- 0 is a cycle, 4 <- 3 a chain onto a kept row
    ref.check()
    ref.reorder(seqs, [4, 0, 1, 2, 3])  # one long chain of last pages
    ref.check()
    for s in seqs:
        ref.grow(s, 3)
    ref.check()


def test_refused_reorder_changes_nothing(rng):
    cache = make("per_layer")
    ref = Reference(cache, rng)
    seqs = beams(cache, ref, [200, 330, 70])
    ref.reorder(seqs, [0, 0, 1])
    for s in seqs:
        ref.grow(s, 2)
    k = cache.kv(0, seqs[2])  # a live view pins row 2: a copy into its last page is refused as a remap is
    before = snapshot(cache)
    with pytest.raises(vpaged.ViewsAliveError):
        cache.reorder(seqs, [0, 1, 1])
    assert_same(before, snapshot(cache))
    del k
    vrange = cache._range
    first = cache.layout.page_indices(cache.slot(seqs[0]), 0, 1)[0]
    other = cache.layout.page_indices(cache.slot(seqs[1]), 0, 1)[0]
    bad = [
        ([first], [other], [1], [1], [1, 2]),  # lists of different lengths
        ([first, first], [other, other], [1, 1], [1, 1], [0, 0]),  # destination runs overlap
        ([first], [other], [2], [1], [0]),  # count above span
        ([first], [other], [1], [1], [PAGE]),  # a tail of a whole page
        ([vrange.num_pages - 1], [other], [2], [2], [0]),  # past the end of the range
        ([first], [-1], [1], [1], [0]),
    ]
    for args in bad:
        with pytest.raises(vpaged.InvalidArgumentError):
            vrange.reorder_runs(*args)
        assert_same(before, snapshot(cache))
    ref.check()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_swap_of_a_sequence_with_shared_pages_and_a_fragmented_arena(layout, rng):
    cache = make(layout, swap_bytes=120 * PAGE)
    ref = Reference(cache, rng)
    parent, other = beams(cache, ref, [700, 90])
    child = cache.fork(parent)
    ref.kv.update({(child, layer): ref.kv[parent, layer] for layer in range(cache.num_layers)})
    ref.grow(child, 150)  # private pages past the shared ones, the shared last page copied
    ref.grow(other, 1)
    cache.swap_out(other)  # its chunks come first: the child's follow them
    cache.swap_out(child)
    cache.swap_in(other)  # a gap in the arena before the child's chunks
    ref.grow(other, 300)
    cache.swap_out(other)  # fills the gap and goes on past the child's chunks
    assert cache.is_swapped(child) and cache.is_swapped(other)
    ref.grow(parent, 5)  # the parent writes while the child is out: the pages they share stay mapped
    cache.swap_in(child)
    cache.swap_in(other)
    ref.check()
    for s in (parent, child, other):
        ref.grow(s, 2)
    ref.check()


def test_batched_page_copies_match_single_page_copies(rng):
    pool = vpaged.PagePool("cpu", capacity_pages=64, page_size=PAGE)
    vrange = pool.new_range(32 * PAGE)
    pages = vrange.map_new(list(range(32)))
    view = torch.from_dlpack(vrange.view(0, [32 * PAGE // 4], [1], 2, 32))  # float32
    view.copy_(torch.randn(view.numel(), generator=rng))
    order = torch.randperm(32, generator=rng)[:20].tolist()
    order[3:9] = sorted(order[3:9])  # a few neighbours among scattered pages
    wanted = [pages[i] for i in order]
    arena = torch.empty(len(order) * PAGE, dtype=torch.uint8)
    base = arena.data_ptr()
    slots = list(range(len(order)))
    slots[10:14] = [13, 12, 11, 10]  # consecutive pages into buffers that do not follow each other
    pool.copy_pages_to_host(wanted, [base + s * PAGE for s in slots])
    expect = view.view(torch.uint8).view(32, PAGE)
    for i, s in zip(order, slots):
        assert torch.equal(arena[s * PAGE : (s + 1) * PAGE], expect[i])
    single = torch.empty(PAGE, dtype=torch.uint8)
    pool.copy_to_host(wanted[0], single.data_ptr())
    assert torch.equal(single, expect[order[0]])
    fresh = torch.randint(0, 255, (len(order) * PAGE,), dtype=torch.uint8, generator=rng)
    pool.copy_pages_from_host(wanted, [fresh.data_ptr() + s * PAGE for s in slots])
    for i, s in zip(order, slots):
        assert torch.equal(expect[i], fresh[s * PAGE : (s + 1) * PAGE])
    with pytest.raises(vpaged.InvalidArgumentError):
        pool.copy_pages_to_host(wanted, [base])
    del view, expect
