"""The pieces VirtualKVCache is built from, each on its own: SlotTable, PrefixIndex (page references),
SwapSpace.save/restore, KVGeometry, the PagePool's page operations and the Reclaimable protocol."""

import random

import pytest
import torch

from vpaged import KVGeometry, PagePool
from vpaged.errors import DTypeError, InvalidArgumentError, SwapSpaceFullError, UnknownSequenceError
from vpaged.pool import Reclaimable
from vpaged.prefix import PrefixIndex
from vpaged.slot_table import SlotTable
from vpaged.swap import SwapSpace

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
