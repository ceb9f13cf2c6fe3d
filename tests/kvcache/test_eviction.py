"""Eviction and reclaim order as strategies (kvcache/eviction.py): the prefix index evicts in its policy's
order (LRU: least recently used; LFU: least used, then least recently), checked against use counts and clocks
kept here from the operations alone; a cache's reclaim order decides whether freed slots or prefix blocks go
back first; unknown names are typed errors that leave nothing behind."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vpaged import InvalidArgumentError, KVGeometry, PagePool, VirtualCacheConfig, VirtualKVCache
from vpaged.kvcache import LFUEviction, LRUEviction, ReclaimOrder, ReclaimStage
from vpaged.kvcache.eviction import resolve_eviction_policy, resolve_reclaim_order
from vpaged.kvcache.virtual.layout import Layout
from vpaged.kvcache.virtual.page_map import PageMap
from vpaged.kvcache.virtual.prefix import PrefixIndex
from vpaged.kvcache.virtual.reclaim import SlotReclaim

TPP = 4  # tokens per page of the bare index below
PS = 4096
CACHE_TPP = 32  # 2 heads x 16 dims x float32 = 128 bytes a token on 4 KiB pages


class CountingPool:
    """The three pool calls a PrefixIndex makes, over plain counts (pages are just numbers here)."""

    def __init__(self):
        self.refs: dict[int, int] = {}

    def incref(self, pages):
        for p in pages:
            self.refs[p] = self.refs.get(p, 0) + 1

    def decref(self, pages):
        for p in pages:
            self.refs[p] -= 1

    def refcount(self, page):
        return self.refs.get(page, 0)


# Prompts drawn from a few chains, so that prefixes share blocks: chain c, blocks 0..depth-1.
def chain_tokens(chain: int, blocks: int) -> list[int]:
    return [chain * 1000 + i for i in range(blocks * TPP)]


ops = st.lists(
    st.tuples(st.sampled_from(["insert", "match"]), st.integers(0, 3), st.integers(1, 3)), min_size=1, max_size=40
)


def run_ops(index: PrefixIndex, operations) -> tuple[dict, dict]:
    """Apply (op, chain, blocks) to the index; return, per block (chain, depth), its uses and the time of its
    last touch, counted here: an insert of a block not cached yet is a use, a match is a use of each block it
    walks through."""
    uses: dict[tuple[int, int], int] = {}
    touched: dict[tuple[int, int], int] = {}
    pages = iter(range(10**6))
    for time, (op, chain, blocks) in enumerate(operations):
        tokens = chain_tokens(chain, blocks)
        if op == "insert":
            index.insert_prefix(tokens, lambda d: [next(pages)])
            for d in range(blocks):
                if (chain, d) not in uses:
                    uses[(chain, d)], touched[(chain, d)] = 1, time
        else:
            index.match(tokens)
            for d in range(blocks):
                if (chain, d) not in uses:
                    break
                uses[(chain, d)] += 1
                touched[(chain, d)] = time
    return uses, touched


def block_id(block) -> tuple[int, int]:
    return block.tokens[0] // 1000, block.depth


@settings(max_examples=60, deadline=None)
@given(ops)
def test_lfu_evicts_the_least_used_block_then_the_least_recent(operations):
    index = PrefixIndex(TPP, CountingPool(), eviction="lfu")
    uses, touched = run_ops(index, operations)
    order = [block_id(b) for b in index.eviction_order()]
    assert sorted(order) == sorted(uses)  # every cached block, once
    while order:
        first = order[0]
        fewest = min(uses[b] for b in order)
        assert uses[first] == fewest
        # among the least used: the least recently touched, and of those (one match) the deepest
        ties = [b for b in order if uses[b] == fewest]
        oldest = min(touched[b] for b in ties)
        assert touched[first] == oldest
        assert first[1] == max(b[1] for b in ties if touched[b] == oldest)
        order.pop(0)


@settings(max_examples=60, deadline=None)
@given(ops)
def test_lru_evicts_the_least_recently_used_block(operations):
    index = PrefixIndex(TPP, CountingPool())  # the default
    assert isinstance(index.eviction, LRUEviction)
    _, touched = run_ops(index, operations)
    order = [block_id(b) for b in index.eviction_order()]
    assert [touched[b] for b in order] == sorted(touched[b] for b in order)


@settings(max_examples=30, deadline=None)
@given(ops, st.sampled_from(["lru", "lfu"]))
def test_evictable_blocks_follow_the_policy_and_evict_drops_references(operations, name):
    pool = CountingPool()
    index = PrefixIndex(TPP, pool, eviction=name)
    run_ops(index, operations)
    held = {b.pages[0] for b in index.blocks()}
    pinned = set(sorted(held)[::3])  # another mapping holds every third page
    pool.incref(sorted(pinned))
    evictable = index.evictable()
    assert evictable == [b for b in index.eviction_order() if b.pages[0] not in pinned]
    for block in evictable:
        assert index.evict(block) == 1 and pool.refcount(block.pages[0]) == 0
    assert {b.pages[0] for b in index.blocks()} == pinned


class MostRecentFirst:
    """An injected policy the library does not ship: the most recently used block goes first."""

    name = "mru"

    def sort_key(self, block):
        return (-block.last_used, -block.depth)


def cache(**kw):
    pool = PagePool("cpu", capacity_pages=64, page_size=PS)
    return VirtualKVCache(
        KVGeometry(1, 2, 16, torch.float32), VirtualCacheConfig(max_seqs=4, max_seq_len=4 * CACHE_TPP, **kw), pool=pool
    )


def use_prompt(c: VirtualKVCache, prompt: list[int]) -> int:
    """One request: allocate with its prompt (a prefix hit maps cached pages), compute the rest, offer its
    full pages, finish. Returns the tokens the prefix cache supplied."""
    seq = c.allocate(tokens=prompt)
    hit = c.seq_len(seq)
    c.extend(seq, len(prompt) - hit)
    c.cache_prefix(seq, prompt)
    c.free(seq)
    return hit


@pytest.mark.parametrize(
    "policy, evicted",
    [("lru", "often"), ("lfu", "once"), (MostRecentFirst(), "once")],
)
def test_the_cache_evicts_the_prefix_its_policy_names(policy, evicted):
    prompts = {"often": list(range(CACHE_TPP + 5)), "once": list(range(10**6, 10**6 + CACHE_TPP + 5))}
    with cache(eviction_policy=policy) as c:
        for _ in range(3):
            use_prompt(c, prompts["often"])  # used three times, long ago
        use_prompt(c, prompts["once"])  # used once, last
        runs = c.layout.runs
        assert c.stats().prefix_cached_pages == c.reclaimable_pages() == 2 * runs  # a block of each prompt
        assert c.reclaim_pages(1) == runs  # one block goes: the policy's first
        kept = "once" if evicted == "often" else "often"
        assert use_prompt(c, prompts[kept]) == CACHE_TPP
        assert use_prompt(c, prompts[evicted]) == 0


def test_reclaim_order_decides_what_goes_back_first():
    prompt = list(range(2 * CACHE_TPP))
    for name, first in (("dormant_first", "dormant"), ("prefix_first", "prefix")):
        with cache(reclaim_order=name) as c:
            runs = c.layout.runs
            use_prompt(c, prompt)  # 2 cached blocks; its slot let go of them on free
            plain = c.allocate()
            c.extend(plain, CACHE_TPP)
            c.free(plain)  # a dormant slot: 1 page a run stays mapped
            assert c.reclaimable_pages() == 3 * runs
            assert c.reclaim_pages(1) == runs
            s = c.stats()
            if first == "dormant":
                assert (s.dormant_pages, s.prefix_cached_pages) == (0, 2 * runs)  # both blocks still cached
            else:
                assert (s.dormant_pages, s.prefix_cached_pages) == (runs, runs)  # the slot kept its page
            assert c.reclaim_pages(100) == 2 * runs and c.reclaimable_pages() == 0


def make_page_map(pages=128, max_seqs=6):
    pool = PagePool("cpu", capacity_pages=pages, page_size=PS)
    lay = Layout("per_layer", 1, 2, 16, 4, max_seqs, 8 * CACHE_TPP, PS)
    return PageMap(pool.new_range(lay.total_bytes), lay, pool)


def live(sp, tokens):
    slot = sp.table.take_reusable()
    seq = sp.table.bind(slot)
    sp.extend(sp.plan_extend([slot], [slot], tokens))
    return seq, slot


@pytest.mark.parametrize("order", ["dormant_first", "prefix_first"])
def test_each_order_gives_back_what_it_counts(order):
    # A dormant slot still maps the pages the index holds: its blocks become evictable only once the slot is
    # unmapped, so prefix_first has to come back to the prefix blocks after the dormant stage.
    sp = make_page_map()
    runs = sp.layout.runs
    prefix = PrefixIndex(CACHE_TPP, sp.pool, eviction="lfu")
    rec = SlotReclaim(sp, prefix, {}, resolve_reclaim_order(order))
    _, spare = live(sp, 3 * CACHE_TPP)
    sp.table.length_tokens[spare] = 1  # 2 spare pages a run
    seq, slot = live(sp, 2 * CACHE_TPP)
    prefix.insert_prefix(list(range(2 * CACHE_TPP)), lambda d: sp.pages(slot, d, d + 1))
    sp.table.unbind(seq)
    sp.table.release(slot)
    used = sp.pool.stats().used_pages
    # The slot's pages count as dormant and, once it lets go, as the blocks' (the count every order keeps).
    assert rec.reclaimable_pages() == (2 + 2) * runs + 2 * runs
    assert rec.reclaim_pages(100) == 6 * runs  # prefix_first: the blocks come back after the dormant stage
    assert len(prefix) == 0 and sp.table.mapped_pages[slot] == 0 and sp.table.mapped_pages[spare] == 1
    assert rec.reclaimable_pages() == 0 and sp.pool.stats().used_pages == used - 4 * runs


def test_prefix_first_takes_a_block_before_a_dormant_slot():
    sp = make_page_map()
    runs = sp.layout.runs
    prefix = PrefixIndex(CACHE_TPP, sp.pool)
    rec = SlotReclaim(sp, prefix, {}, resolve_reclaim_order("prefix_first"))
    seq, slot = live(sp, CACHE_TPP)
    seq2, slot2 = live(sp, CACHE_TPP)
    prefix.insert_prefix(list(range(CACHE_TPP)), lambda d: sp.pages(slot, d, d + 1))
    sp.table.unbind(seq)
    sp.table.release(slot)
    sp.unmap_slot(slot)  # only the index holds the block now
    sp.table.unbind(seq2)
    sp.table.release(slot2)  # dormant, 1 page a run
    assert rec.reclaim_pages(1) == runs and len(prefix) == 0 and sp.table.mapped_pages[slot2] == 1
    assert rec.reclaim_pages(1) == runs and sp.table.mapped_pages[slot2] == 0


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(eviction_policy="mru"), "eviction_policy must be one of"),
        (dict(eviction_policy=3), "eviction_policy must be a name"),
        (dict(reclaim_order="newest_first"), "reclaim_order must be one of"),
        (dict(reclaim_order=None), "reclaim_order must be one of"),
    ],
)
def test_unknown_policy_names_are_typed_errors_and_create_nothing(kw, message):
    pool = PagePool("cpu", capacity_pages=16, page_size=PS)
    before = pool.stats()
    with pytest.raises(InvalidArgumentError, match=message):
        VirtualKVCache(
            KVGeometry(1, 2, 16, torch.float32), VirtualCacheConfig(max_seqs=2, max_seq_len=64, **kw), pool=pool
        )
    assert pool.stats() == before and pool.reclaimable_pages() == 0  # nothing registered, nothing taken


def test_a_reclaim_order_names_each_stage_once():
    with pytest.raises(InvalidArgumentError, match="once"):
        ReclaimOrder("twice", (ReclaimStage.DORMANT, ReclaimStage.DORMANT, ReclaimStage.SPARE))
    spare_first = ReclaimOrder("spare_first", (ReclaimStage.SPARE, ReclaimStage.DORMANT, ReclaimStage.PREFIX))
    assert resolve_reclaim_order(spare_first) is spare_first
    assert isinstance(resolve_eviction_policy("lfu"), LFUEviction)
    assert resolve_eviction_policy(MostRecentFirst()).name == "mru"
