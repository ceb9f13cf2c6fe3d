"""PageMap on its own: a range's mapping state slot by slot (plan and carry out extends, copy-on-write,
unmapping, remapping rows, swapping), checked against page arithmetic and data written through views."""

import random

import pytest
import torch

from vpaged import PagePool
from vpaged.errors import OutOfPagesError, SequenceTooLongError, ViewsAliveError
from vpaged.kvcache.virtual.layout import LAYOUTS, Layout
from vpaged.kvcache.virtual.page_map import PageMap
from vpaged.kvcache.virtual.swap import SwapSpace
from vpaged.kvcache.virtual.views import SlotViews

PS = 4096
HEADS, DIM = 2, 16  # float32: 128 bytes a token per run (per_layer), 32 tokens a page


def make(kind="per_layer", pages=64, max_seqs=4, max_seq_len=128, **pool_kw):
    pool = PagePool("cpu", capacity_pages=pages, page_size=PS, **pool_kw)
    lay = Layout(kind, 2, HEADS, DIM, 4, max_seqs, max_seq_len, PS)
    sp = PageMap(pool.new_range(lay.total_bytes), lay, pool)
    return sp, SlotViews(sp.range, lay, torch.float32, torch.device("cpu"))


def new_slot(sp: PageMap, tokens: int = 0) -> int:
    slot = sp.table.take_reusable()
    sp.table.bind(slot)
    if tokens:
        sp.extend(sp.plan_extend([slot], [slot], tokens))
    return slot


def fill(views, slot, n, rng):
    """Random K/V into tokens 0..n-1 of every layer; returns them."""
    data = torch.randn(2, 2, n, HEADS, DIM, generator=rng)
    for layer in range(2):
        for kv in range(2):
            views.tokens(layer, kv, slot, 0, n).copy_(data[layer, kv])
    return data


def read(views, slot, n):
    return torch.stack([torch.stack([views.tokens(la, kv, slot, 0, n).clone() for kv in range(2)]) for la in range(2)])


@pytest.mark.parametrize("kind", LAYOUTS)
def test_extend_maps_what_the_lengths_need(kind, rng):
    sp, _ = make(kind, pages=512)
    lay, t = sp.layout, sp.table
    r = random.Random(int(torch.randint(0, 2**31, (1,), generator=rng)))
    slots = [new_slot(sp) for _ in range(3)]
    for _ in range(6):
        n = r.randint(0, 20)
        chosen = r.sample(slots, r.randint(1, 3))
        before = {s: t.length_tokens[s] for s in slots}
        plan = sp.plan_extend(chosen, chosen, n)
        # Independent arithmetic: ceil(len * token_bytes / page_size) pages per run.
        want = sum(
            (-(-(before[s] + n) * lay.token_bytes // PS) - -(-before[s] * lay.token_bytes // PS)) * lay.runs
            for s in chosen
        )
        assert plan.pages == want and plan.copies == 0
        used = sp.pool.stats().used_pages
        sp.extend(plan)
        assert sp.pool.stats().used_pages == used + want
        for s in slots:
            assert t.length_tokens[s] == before[s] + (n if s in chosen else 0)
            assert t.mapped_pages[s] == lay.pages_for(t.length_tokens[s])
            assert all(p >= 0 for p in sp.pages(s))
    assert sp.pages_mapped == sp.pool.stats().used_pages and sp.pages_unmapped == 0


def test_plan_refuses_past_max_seq_len_and_changes_nothing():
    sp, _ = make()
    slot = new_slot(sp, 100)
    with pytest.raises(SequenceTooLongError, match="129 tokens"):
        sp.plan_extend(["seq 7"], [slot], 29)
    assert sp.table.length_tokens[slot] == 100


def test_copy_on_write_gives_a_private_copy_of_the_shared_page(rng):
    sp, views = make()
    t, runs = sp.table, sp.layout.runs
    a = new_slot(sp, 40)  # pages 0 (full) and 1 (8 tokens) of each run
    data = fill(views, a, 40, rng)
    b = new_slot(sp)
    sp.map_shared(b, sp.pages(a), 2)
    t.length_tokens[b] = 40
    t.mark_shared(a, 2)
    plan = sp.plan_extend([b], [b], 10)  # lands in page 1: copy it; page 0 stays shared
    assert plan.fresh == [] and plan.copies == runs and len(plan.to_privatize) == runs
    sp.extend(plan)
    assert sp.cow_copies == runs and t.shared_below_page[b] == 1 and t.shared_below_page[a] == 2
    pa, pb = sp.pages(a), sp.pages(b)
    assert [x == y for x, y in zip(pa, pb)] == [True, False] * runs  # run-major: page 0 shared, 1 private
    assert torch.equal(read(views, b, 40), data)  # the copy holds the shared page's data
    views.tokens(0, 0, b, 40, 10).fill_(7.0)
    assert torch.equal(read(views, a, 40), data)  # writing b's new tokens leaves a alone


def test_extend_is_all_or_nothing_when_the_pool_is_short():
    sp, _ = make(pages=6)
    lay, t = sp.layout, sp.table
    a, b = new_slot(sp, 32), new_slot(sp)
    plan = sp.plan_extend([a, b], [a, b], 64)  # a: 2 more pages a run, b: 2 a run; 4 runs: 16 > 2 free
    before = (list(t.length_tokens), list(t.mapped_pages), sp.pool.stats().used_pages, sp.pages_mapped)
    with pytest.raises(OutOfPagesError, match="nothing was changed"):
        sp.extend(plan)
    assert (list(t.length_tokens), list(t.mapped_pages), sp.pool.stats().used_pages, sp.pages_mapped) == before
    assert sp.growing == {} and plan.pages == 4 * lay.runs


def test_unmap_tail_and_slot_wait_for_views_to_go(rng):
    sp, views = make()
    t = sp.table
    a = new_slot(sp, 100)  # 4 pages a run
    view = views.tokens(0, 0, a, 70, 10)  # pins page 2
    assert sp.pinned(a, 2) and not sp.pinned(a, 3)
    used = sp.pool.stats().used_pages
    assert not sp.unmap_tail(a, 1)  # page 2 is read through the view: nothing changes
    assert t.mapped_pages[a] == 4 and sp.pool.stats().used_pages == used
    assert sp.unmap_tail(a, 3)
    assert t.mapped_pages[a] == 3 and sp.pages_unmapped == sp.layout.runs
    del view
    t.unbind(0)
    t.release(a)
    assert t.dormant_slots() == [a] and sp.unmap_slot(a)
    assert t.dormant_slots() == [] and t.mapped_pages[a] == 0 and sp.pool.stats().used_pages == 0


def test_take_clean_slot_unmaps_the_oldest_unviewed_dormant_slot():
    sp, views = make(max_seqs=3)
    t = sp.table
    slots = [new_slot(sp, 10) for _ in range(3)]
    view = views.tokens(0, 0, slots[0], 0, 5)
    for seq, slot in enumerate(slots):
        t.unbind(seq)
        t.release(slot)  # dormant, oldest first: 0, 1, 2
    assert sp.take_clean_slot() == slots[1]  # slots[0] is pinned by the view
    assert t.mapped_pages[slots[1]] == 0 and t.dormant_slots() == [slots[0], slots[2]]
    del view


def test_zero_on_reuse_scrubs_a_dormant_slot_before_a_new_owner(rng):
    sp, views = make(zero_on_reuse=True)
    t = sp.table
    a = new_slot(sp, 40)
    fill(views, a, 40, rng)
    t.unbind(0)
    t.release(a)
    slot = t.take_reusable()
    assert slot == a and sp.clean_for_new_owner(slot) == a
    t.bind(slot)
    t.length_tokens[slot] = 40
    assert not read(views, a, 40).any()  # the old owner's K/V are gone, the pages kept


def test_remap_rows_moves_pages_not_data(rng):
    sp, views = make()
    t = sp.table
    lens = [40, 70, 10]
    slots = [new_slot(sp, n) for n in lens]
    data = [fill(views, s, n, rng) for s, n in zip(slots, lens)]
    old = [sp.pages(s) for s in slots]
    sp.remap_rows(slots, [1, 1, 0])  # row 0 takes row 1's, row 2 takes row 0's (before the call)
    assert [t.length_tokens[s] for s in slots] == [70, 70, 40]
    assert sp.pages(slots[0]) == sp.pages(slots[1]) == old[1]
    assert sp.pages(slots[2]) == old[0]
    assert torch.equal(read(views, slots[0], 70), data[1]) and torch.equal(read(views, slots[2], 40), data[0])
    assert all(t.shared_below_page[s] == t.mapped_pages[s] for s in slots)  # every page may be shared now
    assert sp.pool.stats().used_pages == len(old[0]) + len(old[1])  # row 2's own pages went back


def test_swap_out_and_in_restores_private_pages_bit_exactly(rng):
    sp, views = make()
    t = sp.table
    a = new_slot(sp, 60)
    data = fill(views, a, 60, rng)
    b = new_slot(sp)
    sp.map_shared(b, sp.pages(a, 0, 1), 1)  # a's page 0 is shared: it stays mapped
    space = SwapSpace(16 * PS, PS)
    used = sp.pool.stats().used_pages
    pinned = views.tokens(0, 0, a, 40, 1)
    with pytest.raises(ViewsAliveError, match="sequence 5"):
        sp.swap_out(5, a, space)
    assert space.used_chunks == 0 and sp.pool.stats().used_pages == used
    del pinned
    holes, chunks = sp.swap_out(5, a, space)
    assert len(holes) == len(chunks) == sp.layout.runs  # page 1 of each run
    assert sp.pool.stats().used_pages == used - len(holes) and t.mapped_pages[a] == 2
    sp.swap_in(holes, chunks, space)
    assert torch.equal(read(views, a, 60), data) and sp.pool.stats().used_pages == used
    space.release(chunks)
