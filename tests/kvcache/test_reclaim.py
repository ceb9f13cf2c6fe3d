"""SlotReclaim and virtual_cache_stats on their own, over a PageMap built by hand: what is reclaimable,
in which order it is given back, and what the stats count, against sums computed here."""

import pytest
import torch

from vpaged import KVGeometry, PagePool, VirtualCacheConfig
from vpaged.kvcache.virtual.layout import Layout
from vpaged.kvcache.virtual.page_map import PageMap
from vpaged.kvcache.virtual.prefix import PrefixIndex
from vpaged.kvcache.virtual.reclaim import SlotReclaim
from vpaged.kvcache.virtual.stats import virtual_cache_stats
from vpaged.kvcache.virtual.swap import SwappedSlots, SwapSpace
from vpaged.kvcache.virtual.views import SlotViews

PS = 4096
TPP = 32  # tokens a page: 2 heads x 16 dims x float32 = 128 bytes a token


def make(pages=128, max_seqs=6):
    pool = PagePool("cpu", capacity_pages=pages, page_size=PS)
    lay = Layout("per_layer", 1, 2, 16, 4, max_seqs, 8 * TPP, PS)  # 2 runs (K and V)
    sp = PageMap(pool.new_range(lay.total_bytes), lay, pool)
    return sp, SlotViews(sp.range, lay, torch.float32, torch.device("cpu"))


def live(sp, tokens):
    slot = sp.table.take_reusable()
    seq = sp.table.bind(slot)
    sp.extend(sp.plan_extend([slot], [slot], tokens))
    return seq, slot


def free(sp, seq, slot):
    sp.table.unbind(seq)
    sp.table.release(slot)


def test_reclaim_order_dormant_then_prefix_then_spare_tails():
    sp, views = make()
    t, runs = sp.table, sp.layout.runs
    prefix = PrefixIndex(TPP, sp.pool)
    swapped: dict = {}
    rec = SlotReclaim(sp, prefix, swapped)
    old = [live(sp, TPP * k) for k in (1, 2, 3)]  # 1, 2, 3 pages a run
    cached_seq, cached = live(sp, 2 * TPP)
    prefix.insert_prefix(list(range(2 * TPP)), lambda d: sp.pages(cached, d, d + 1))
    _, spare = live(sp, 4 * TPP)
    t.length_tokens[spare] = TPP + 3  # a shorter sequence in a longer one's pages: 2 spare pages a run
    free(sp, cached_seq, cached)  # dormant; the index holds its 2 pages a run too
    for seq, slot in old:
        free(sp, seq, slot)
    view = views.tokens(0, 0, old[1][1], 0, 1)  # pins a freed slot's pages
    # Dormant, oldest first: cached, old[0], old[1] (pinned), old[2].
    assert t.dormant_slots() == [cached, old[0][1], old[1][1], old[2][1]]
    assert rec.unpinned_dormant_slots() == [cached, old[0][1], old[2][1]]
    assert rec.spare_tails() == [(spare, 2)]
    # Dormant (2 + 1 + 3 pages a run) + spare (2 a run) + prefix blocks freed once `cached` lets go (2 x runs).
    assert rec.reclaimable_pages() == (2 + 1 + 3 + 2) * runs + 2 * runs
    used = sp.pool.stats().used_pages
    assert rec.reclaim_pages(1) == 2 * runs  # the oldest dormant slot, whole; its pages stay (index holds them)
    assert sp.pool.stats().used_pages == used and t.mapped_pages[cached] == 0
    assert rec.reclaim_pages(4 * runs) == 4 * runs  # old[0], old[2]: the pinned one is skipped
    assert sp.pool.stats().used_pages == used - 4 * runs and t.dormant_slots() == [old[1][1]]
    assert rec.reclaim_pages(2 * runs) == 2 * runs and prefix.pages == 0  # then the prefix blocks
    sp.growing = {spare: 3 * TPP}  # an extend in progress counts on one spare page a run
    assert rec.spare_tails() == [(spare, 3)]
    assert rec.reclaim_pages(100) == runs and t.mapped_pages[spare] == 3
    sp.growing = {}
    assert rec.reclaimable_pages() == runs and rec.reclaim_pages(100) == runs
    assert rec.reclaimable_pages() == 0 and rec.reclaim_pages(100) == 0
    del view
    assert rec.reclaimable_pages() == 2 * runs


def test_swapped_sequences_keep_their_tails():
    sp, _ = make()
    swapped: dict = {}
    rec = SlotReclaim(sp, None, swapped)
    _, slot = live(sp, 3 * TPP)
    sp.table.length_tokens[slot] = 1
    assert rec.spare_tails() == [(slot, 1)]
    swapped[slot] = ([], [])
    assert rec.spare_tails() == [] and rec.reclaimable_pages() == 0


@pytest.mark.parametrize("swap", [False, True])
def test_stats_count_pages_tokens_and_sharing(swap, rng):
    sp, _ = make()
    t, runs = sp.table, sp.layout.runs
    _, a = live(sp, 50)  # 2 pages a run
    _, b = live(sp, 0)
    sp.map_shared(b, sp.pages(a), 2)  # b shares both of a's pages
    t.length_tokens[b] = 50
    t.mark_shared(a, 2)
    c_seq, c = live(sp, 10)
    swapped = SwappedSlots(SwapSpace(8 * PS, PS))
    if swap:
        d_seq, d = live(sp, 40)
        swapped.add(d, *sp.swap_out(d_seq, d, swapped.space))  # both of its pages a run go to swap space
    free(sp, c_seq, c)  # dormant: 1 page a run
    s = virtual_cache_stats(sp, sp.pool, None, swapped, prefix_hit_tokens=7)
    assert s.sequences == 2 + swap and s.live_tokens == 100
    assert s.mapped_pages == (2 + 2 + 1) * runs  # a's and b's slots map the same pages: counted per slot
    assert s.shared_pages == 2 * 2 * runs  # both slots' page indices whose page is held twice
    assert s.dormant_pages == runs and s.swapped_sequences == swap and s.swapped_bytes == swap * 2 * runs * PS
    assert s.pool_used_pages == (2 + 1) * runs and s.prefix_hit_tokens == 7 and s.prefix_cached_pages == 0
    assert s.pages_mapped_total == sp.pages_mapped and s.pages_unmapped_total == sp.pages_unmapped
    assert s.stored_bytes == 50 * sp.layout.token_bytes * runs  # the shared pages once
    assert s.fragmentation_bytes == 2 * PS * runs - s.stored_bytes


def test_pages_needed_counts_the_spare_pages_an_extend_keeps(rng):
    """A sequence on a reused slot holds its predecessor's pages as a spare tail: pages_available() counts them
    (reclaimable) but an extend of that sequence keeps them, so pages_needed() counts them too; the answer
    "needed <= available" is then exactly whether the extend succeeds, for every length asked for."""
    from vpaged import VirtualKVCache
    from vpaged.errors import OutOfPagesError

    page = 64 << 10
    tokens_per_page = page // (2 * 16 * 4)  # 2 heads x 16 dims x fp32 per region
    for n in range(1, 30 * tokens_per_page, tokens_per_page // 3 + int(torch.randint(1, 7, (), generator=rng))):
        cache = VirtualKVCache(
            KVGeometry(1, 2, 16, torch.float32),
            VirtualCacheConfig(max_seqs=2, max_seq_len=40 * tokens_per_page, capacity_bytes=24 * page, page_size=page),
        )
        a = cache.allocate()
        cache.extend(a, 10 * tokens_per_page)  # 20 pages (K and V)
        cache.free(a)  # dormant: its pages stay mapped for the next sequence
        b = cache.allocate()  # the same slot, its 20 pages a spare tail
        fits = cache.pages_needed([b], n) <= cache.pages_available()
        try:
            cache.extend(b, n)
            ok = True
        except OutOfPagesError:
            ok = False
        assert fits == ok, (n, cache.pages_needed([b], n), cache.pages_available())
        cache.close()
