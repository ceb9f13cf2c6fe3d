"""The pieces VirtualKVCache is built from, each on its own: SlotTable, PrefixIndex (page references),
SwapSpace.save/restore, KVGeometry, the PagePool's page operations and the Reclaimable protocol."""

import random

import pytest
import torch

from vpaged import KVGeometry, PagePool
from vpaged.errors import DTypeError, InvalidArgumentError, SwapSpaceFullError, UnknownSequenceError
from vpaged.kvcache.checks import check_token_span, write_start
from vpaged.kvcache.virtual.layout import LAYOUTS, Layout
from vpaged.kvcache.virtual.prefix import PrefixIndex
from vpaged.kvcache.virtual.slot_table import SlotTable
from vpaged.kvcache.virtual.swap import SwappedSlots, SwapSpace
from vpaged.kvcache.virtual.views import SlotViews
from vpaged.memory.pool import Reclaimable, default_pool, resolve_pool

PS = 4096


def pool_of(pages=32):
    return PagePool("cpu", capacity_pages=pages, page_size=PS)


# ------------------------------------------------------------------------------------------------ SlotTable
def test_slot_table_against_a_model(rng):
    """Random take/bind/unbind/release/unmap sequences against sets kept by hand."""
    r = random.Random(int(torch.randint(0, 2**31, (1,), generator=rng)))
    n = r.randint(3, 9)
    t = SlotTable(n)
    live, empty, dormant = {}, list(range(n - 1, -1, -1)), []  # empty: a stack; dormant: oldest first
    for _ in range(300):
        op = r.choice(["reuse", "run", "free", "unmap"])
        if op == "reuse":
            slot = t.take_reusable()
            want = dormant.pop() if dormant else (empty.pop() if empty else None)
            assert slot == want  # the most recently freed slot with pages, else the last empty one
            if slot is None:
                continue
            live[t.bind(slot)] = slot
        elif op == "run":
            k = r.randint(1, n)
            first = t.free_run(k)
            free = set(empty) | set(dormant)
            runs = [s for s in range(n - k + 1) if all(x in free for x in range(s, s + k))]
            assert first == (runs[0] if runs else None)
            if first is not None:
                for s in range(first, first + k):
                    t.take(s)
                    if s in empty:
                        empty.remove(s)
                    if s in dormant:
                        dormant.remove(s)
                    live[t.bind(s)] = s
        elif op == "free" and live:
            seq = r.choice(sorted(live))
            slot = live.pop(seq)
            t.mapped_pages[slot] = r.choice([0, r.randint(1, 4)])
            assert t.unbind(seq) == slot
            t.release(slot)
            if t.mapped_pages[slot]:
                dormant.append(slot)
            else:
                empty.append(slot)
            with pytest.raises(UnknownSequenceError, match="freed"):
                t.slot_of(seq)
        elif op == "unmap" and dormant:
            slot = r.choice(dormant)
            t.set_unmapped(slot)
            dormant.remove(slot)
            empty.append(slot)
        assert {s: t.slot_of(s) for s in t.sequences} == live
        assert t.dormant_slots() == dormant and t.free_count == len(empty) + len(dormant)


def test_slot_table_watermark_only_moves_as_documented():
    t = SlotTable(2)
    slot = t.take_reusable()
    t.bind(slot)
    t.mapped_pages[slot] = 5
    t.mark_shared(slot, 3)
    assert t.shared_below_page[slot] == 3
    t.mark_shared(slot, 9)  # never past what is mapped
    assert t.shared_below_page[slot] == 5
    t.mark_private_from(slot, 2)
    assert t.shared_below_page[slot] == 2
    t.mark_shared(slot, 1)  # sharing never lowers it
    assert t.shared_below_page[slot] == 2
    t.truncate_pages(slot, 1)
    assert (t.mapped_pages[slot], t.shared_below_page[slot]) == (1, 1)


# ------------------------------------------------------------------------------------------------ PrefixIndex
def test_prefix_index_owns_the_references_of_its_pages(rng):
    pool = pool_of()
    holder = pool.new_range(6 * PS)  # holds one reference on each page, as a cache's range would
    pages = holder.map_new(list(range(6)))
    index = PrefixIndex(4, pool)
    tokens = torch.randint(0, 1000, (12,), generator=rng).tolist()
    keys = index.keys(tokens)
    for depth, (key, block) in enumerate(keys):
        assert index.insert(key, depth, block, pages[2 * depth : 2 * depth + 2])
    assert not index.insert(keys[0][0], 0, keys[0][1], pages[:2])  # taken: no reference taken
    assert [pool.refcount(p) for p in pages] == [2] * 6 and index.pages == 6
    assert [b.depth for b in index.match(tokens + [1, 2])] == [0, 1, 2]
    holder.unmap([2, 3])  # the range lets go of block 1's pages: only the index holds them
    assert [b.depth for b in index.evictable()] == [1]
    assert [b.depth for b in index.evictable(set(pages))] == [2, 0]  # deeper first; +1 releasable reference
    block = index.evictable()[0]
    assert index.evict(block) == 2 and [pool.refcount(p) for p in pages[2:4]] == [0, 0]
    assert pool.free_pages() == 32 - 4
    assert index.clear() == 4 and index.pages == 0
    assert [pool.refcount(p) for p in pages[:2] + pages[4:]] == [1] * 4


def test_prefix_insert_stops_at_a_colliding_key(rng):
    pool = pool_of()
    holder = pool.new_range(8 * PS)
    pages = holder.map_new(list(range(8)))
    # Keys of blocks past the first ignore the tokens: a second prefix collides at depth 1.
    index = PrefixIndex(4, pool, lambda parent, block: b"deep" if parent else bytes(block))
    a = torch.randint(0, 100, (8,), generator=rng).tolist()
    b = [t + 100 for t in a]  # differs in every block
    assert index.insert_prefix(a, lambda d: pages[d : d + 1]) == 8 and index.pages == 2
    assert index.insert_prefix(a[:6], lambda d: pytest.fail("cached already")) == 4  # one full block
    assert index.insert_prefix(b, lambda d: pages[4 + d : 5 + d]) == 4  # block 0 new, block 1's key taken
    assert index.pages == 3 and [pool.refcount(p) for p in pages[:6]] == [2, 2, 1, 1, 2, 1]


# ------------------------------------------------------------------------------------------------ SwapSpace
def test_swap_space_saves_and_restores_pages_bit_exactly(rng):
    pool = pool_of()
    rng_range = pool.new_range(4 * PS)
    pages = rng_range.map_new([0, 1, 2])
    data = torch.randint(0, 256, (3 * PS,), dtype=torch.uint8, generator=rng)
    view = torch.from_dlpack(rng_range.view(0, [3 * PS], [1], 1, 8))
    view.copy_(data)
    swap = SwapSpace(3 * PS, PS)
    with pytest.raises(SwapSpaceFullError):
        swap.save(pool, pages + pages[:1])
    assert swap.used_chunks == 0
    chunks = swap.save(pool, pages)
    assert swap.used_chunks == 3
    view.zero_()
    swap.restore(pool, pages[::-1], chunks[::-1])  # chunk i goes back to page i, in any order
    assert torch.equal(view, data) and swap.used_chunks == 3
    swap.release(chunks)
    assert swap.used_chunks == 0


def test_swapped_slots_release_their_chunks():
    space = SwapSpace(8 * PS, PS)
    swapped = SwappedSlots(space)
    swapped.add(3, [10, 11], space.alloc(2))
    swapped.add(1, [4], space.alloc(1))
    assert 3 in swapped and 2 not in swapped and len(swapped) == 2 and swapped.page_count == 3
    assert swapped[1][0] == [4] and space.used_chunks == 3
    swapped.drop(3)
    assert 3 not in swapped and space.used_chunks == 1 and swapped.page_count == 1
    swapped.clear()
    assert len(swapped) == 0 and swapped.space is None


# ------------------------------------------------------------------------------------------------ KVGeometry
def test_geometry_costs_and_checks():
    g = KVGeometry(32, 8, 128, torch.bfloat16)
    assert g.bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131072
    assert g.static_bytes(4, 4096) == 4 * 4096 * 131072
    for bad in (0, -1, True, 2.0):
        with pytest.raises(InvalidArgumentError, match="num_kv_heads"):
            KVGeometry(1, bad, 8, torch.float32)
    with pytest.raises(DTypeError):
        KVGeometry(1, 1, 8, torch.int8)


def test_geometry_describes_itself_and_its_layout():
    g = KVGeometry(2, 4, 8, torch.float16)
    assert g.describe() == "layers=2, kv_heads=4, head_dim=8, dtype=torch.float16"
    assert Layout.of("head_major", g, 3, 100, PS) == Layout("head_major", 2, 4, 8, 2, 3, 100, PS)


# ------------------------------------------------------------------------------------------------ checks
def test_write_start_and_token_span_checks():
    assert write_start(None, 3, 10) == 7 and write_start(2, 3, 10) == 2
    for start, n in ((8, 3), (-1, 1), (None, 11)):
        with pytest.raises(InvalidArgumentError, match="outside the sequence"):
            write_start(start, n, 10)
    for bad in (1.0, True, "1"):
        with pytest.raises(InvalidArgumentError, match="start must be an int"):
            write_start(bad, 1, 10)
        with pytest.raises(InvalidArgumentError, match="must be an int"):
            check_token_span(bad, 2, 10)
    check_token_span(0, 10, 10)
    for start, stop in ((3, 2), (-1, 2), (0, 11)):
        with pytest.raises(InvalidArgumentError, match="outside the sequence"):
            check_token_span(start, stop, 10)


# ------------------------------------------------------------------------------------------------ SlotViews
@pytest.mark.parametrize("kind", LAYOUTS)
def test_layers_view_agrees_with_per_layer_views(kind, rng):
    pool = pool_of(64)
    lay = Layout(kind, 3, 2, 8, 4, 2, 64, PS)
    vrange = pool.new_range(lay.total_bytes)
    vrange.map_new(list(range(vrange.num_pages))[: lay.total_bytes // PS])
    views = SlotViews(vrange, lay, torch.float32, torch.device("cpu"))
    for layer in range(3):
        for kv in range(2):
            views.tokens(layer, kv, 1, 0, 64).copy_(torch.randn(64, 2, 8, generator=rng))
    start, n = 5, 40
    both = views.layers(1, start, n)
    assert both.shape == (3, 2, n, 2, 8)
    for layer in range(3):
        for kv in range(2):
            assert torch.equal(both[layer, kv], views.tokens(layer, kv, 1, start, n))


# ------------------------------------------------------------------------------------------------ PagePool
def test_resolve_pool_picks_and_checks_the_pool():
    pool = pool_of()
    assert resolve_pool(None, pool) == (torch.device("cpu"), pool)
    dev, private = resolve_pool("cpu", capacity_bytes=4 * PS, page_size=PS)
    assert dev == torch.device("cpu") and private.capacity_pages == 4 and private is not pool
    assert resolve_pool(None)[1] is default_pool("cpu")
    for kwargs, match in (
        ({"pool": pool, "capacity_bytes": PS}, "either pool or capacity_bytes"),
        ({"pool": pool, "page_size": 2 * PS}, "differs from the pool's"),
        ({"page_size": 3 * default_pool("cpu").page_size}, "differs from the default pool's"),
    ):
        with pytest.raises(InvalidArgumentError, match=match):
            resolve_pool("cpu", **kwargs)


# ------------------------------------------------------------------------------------------------ PagePool
def test_pool_registers_only_reclaimable_clients():
    pool = pool_of()

    class Keeper:
        def __init__(self):
            self.kept = 3

        def reclaimable_pages(self):
            return self.kept

        def reclaim_pages(self, pages):
            freed, self.kept = min(pages, self.kept), self.kept - min(pages, self.kept)
            return freed

    keeper = Keeper()
    assert isinstance(keeper, Reclaimable)
    pool.register(keeper)
    assert pool.reclaimable_pages() == 3 and pool.reclaim(2) == 2 and pool.reclaimable_pages() == 1
    pool.unregister(keeper)
    assert pool.reclaimable_pages() == 0
    with pytest.raises(InvalidArgumentError, match="not Reclaimable"):
        pool.register(object())
