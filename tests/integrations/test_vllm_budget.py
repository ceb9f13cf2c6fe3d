"""vpaged.integrations.vllm.budget without vLLM: the cap put on vLLM's scheduler in a shared budget, and
the reclaimer that gives back the pages of blocks vLLM keeps only as prefix cache. vLLM's scheduler and
block pool are stood in for by the few attributes the plugin reads (running, waiting, block_size; blocks
with ref_cnt and block_hash; _maybe_evict_cached_block)."""

from __future__ import annotations

import math
import os
import random
import threading
from types import SimpleNamespace

import torch

from vpaged.integrations.vllm import guard
from vpaged.integrations.vllm.backing import BlockGeometry, KVBacking, block_page_size, make_pool
from vpaged.integrations.vllm.budget import (
    DormantBlockReclaimer,
    SchedulerCap,
    demand_pages,
    head_blocks,
    plan_step,
    refit_after_free,
)
from vpaged.memory import PagePool, SharedBudget
from vpaged.memory.budget import member as budget_member

PAGE = 64 * 1024


class FakeQueue(list):
    def peek_request(self):
        return self[0]


class FakeBlockPool:
    """vLLM's BlockPool as the reclaimer sees it: blocks with a reference count and a prefix-cache hash."""

    def __init__(self, n: int):
        self.blocks = [SimpleNamespace(block_id=i, ref_cnt=0, block_hash=None) for i in range(n)]
        self._reuse_watchers: dict[int, object] = {}
        self.evicted: list[int] = []

    def _maybe_evict_cached_block(self, block) -> bool:
        if block.block_hash is None:
            return False
        block.block_hash = None
        self.evicted.append(block.block_id)
        return True


def layer_major(blocks: int, layers: int = 2, block_bytes: int = 16 * 1024) -> tuple[BlockGeometry, int]:
    return BlockGeometry(
        0, block_bytes * blocks, block_bytes, block_bytes, layers, blocks
    ), layers * blocks * block_bytes


def free_queue(order: list[int]):
    """vLLM's FreeKVCacheBlockQueue as the plan reads it: a linked list between two sentinels."""
    head, tail = SimpleNamespace(block_id=-1), SimpleNamespace(block_id=-1, next_free_block=None)
    prev = head
    for b in order:
        node = SimpleNamespace(block_id=b)
        prev.next_free_block, prev = node, node
    prev.next_free_block = tail
    return SimpleNamespace(fake_free_list_head=head, fake_free_list_tail=tail)


def scheduler(running: int, waiting_tokens: list[int], block_size: int = 16, free_order=()):
    waiting = FakeQueue(SimpleNamespace(num_tokens=t) for t in waiting_tokens)
    block_pool = SimpleNamespace(free_block_queue=free_queue(list(free_order)))
    return SimpleNamespace(
        running=[object()] * running,
        waiting=waiting,
        block_size=block_size,
        kv_cache_manager=SimpleNamespace(block_pool=block_pool),
    )


def test_demand_counts_the_prompts_one_step_admits_and_the_blocks_decoding_opens():
    rng = random.Random()
    geom, nbytes = layer_major(64)
    backing = KVBacking(nbytes, [geom], make_pool(nbytes))
    running = rng.randint(0, 40)
    prompts = [rng.randint(1, 300) for _ in range(rng.randint(1, 6))]
    sched = scheduler(running, prompts)
    per_block = 2 * 16 * 1024 / PAGE
    decode = math.ceil(running / 16)
    assert demand_pages(sched, backing) == math.ceil((decode + sum(math.ceil(p / 16) for p in prompts)) * per_block)
    sched.max_num_scheduled_tokens = prompts[0]  # room for one prompt only
    assert demand_pages(sched, backing) == math.ceil((decode + math.ceil(prompts[0] / 16)) * per_block)
    assert head_blocks(sched) == math.ceil(prompts[0] / 16)
    assert demand_pages(scheduler(0, []), backing) == 0 and head_blocks(scheduler(0, [])) == 0
    assert head_blocks(scheduler(3, [])) == 1


def test_plan_caps_the_blocks_to_what_the_budget_can_map(budget_name, monkeypatch):
    """The cap is the longest head of vLLM's free queue whose fresh pages fit in the pool's free pages
    (blocks share pages, mapped neighbours cost nothing), after a grant from what the other member left."""
    # Granted pages left unused go back unasked after IDLE_RELEASE_S: not while this test reads them.
    monkeypatch.setattr(budget_member, "IDLE_RELEASE_S", 3600.0)
    rng = random.Random()
    seed = rng.randrange(2**32)
    rng.seed(seed)
    capacity = rng.randint(20, 40)
    SharedBudget.create(budget_name, capacity * PAGE)
    other = PagePool("cpu", capacity_pages=capacity, shared_budget=budget_name)
    # The other member holds these pages; what it leaves covers the held blocks' pages (up to 6 blocks in
    # pages of their own, in each of 2 layers: 12) and a page or two of the queue.
    taken = rng.randint(0, capacity - 14)
    assert other.ensure_free(max(1, taken))
    other_range = other.new_range(max(1, taken) * PAGE)
    other_range.map_new(list(range(max(1, taken))))
    n = 256
    geom, nbytes = layer_major(n)  # 4 blocks share a page in each of 2 layers
    pool = PagePool("cpu", capacity_pages=nbytes // PAGE, shared_budget=budget_name, zero_on_reuse=True)
    backing = KVBacking(nbytes, [geom], pool)
    held = rng.sample(range(1, n), rng.randint(0, 6))
    assert pool.ensure_free(len({p for b in held for p in backing.pages_of(b)}))
    backing.map_blocks(held)
    order = rng.sample(sorted(set(range(1, n)) - set(held)), rng.randint(40, 120))
    cap = SchedulerCap()
    plan_step(scheduler(0, [rng.randint(16, 400)], free_order=order), backing, cap)
    free = pool.free_pages()
    assert free <= capacity - max(1, taken), seed
    mapped = {p for b in held for p in backing.pages_of(b)}
    fresh, fits = set(), 0
    for b in order:  # the reference: walk the queue page by page
        fresh |= set(backing.pages_of(b)) - mapped
        if len(fresh) > free:
            break
        fits += 1
    assert cap.blocks == fits, seed
    # vLLM's free count is capped while schedule() runs and counts down as blocks are taken.
    assert cap.limit(10_000) == cap.blocks and cap.limit(3) == min(3, cap.blocks)
    # What the cap allowed maps without waiting for anyone.
    maps = backing.map_calls
    backing.map_blocks(order[: cap.blocks])
    assert cap.blocks == 0 or backing.map_calls == maps + 1
    cap.taken = cap.blocks
    assert cap.limit(10_000) == 0
    cap.blocks = None
    assert cap.limit(7) == 7
    del other_range


def test_plan_takes_a_partial_grant_when_the_demand_exceeds_the_headroom(budget_name, monkeypatch):
    """A step's demand counts every prompt it could admit; when that is more than the budget has room for,
    the plan still takes the room there is (an all-or-nothing grant left two engines starved next to free
    pages), and the cap lets vLLM start what fits."""
    monkeypatch.setattr(budget_member, "IDLE_RELEASE_S", 3600.0)
    rng = random.Random()
    seed = rng.randrange(2**32)
    rng.seed(seed)
    capacity = rng.randint(48, 96)  # the other member's grant (up to a chunk of 32 pages) leaves room
    SharedBudget.create(budget_name, capacity * PAGE)
    other = PagePool("cpu", capacity_pages=capacity, shared_budget=budget_name)
    taken = rng.randint(1, capacity // 2)
    assert other.ensure_free(taken)
    other_range = other.new_range(taken * PAGE)
    other_range.map_new(list(range(taken)))
    n = 512
    geom, nbytes = layer_major(n)
    pool = PagePool("cpu", capacity_pages=nbytes // PAGE, shared_budget=budget_name, zero_on_reuse=True)
    backing = KVBacking(nbytes, [geom], pool)
    room = pool.budget.headroom_pages()
    assert 16 <= room <= capacity - taken, seed
    # Prompts worth several times the room, the first of them small enough to fit in it: blocks 1..r of 16
    # KiB touch ceil((r + 1) / 4) pages of 64 KiB in each of the 2 layers.
    first = rng.randint(1, 4 * (room // 2) - 1)
    prompts = [16 * first] + [16 * rng.randint(2 * room, 8 * room) for _ in range(rng.randint(3, 6))]
    sched = scheduler(0, prompts, free_order=list(range(1, n)))
    assert demand_pages(sched, backing) > room, seed
    cap = SchedulerCap()
    plan_step(sched, backing, cap)
    assert pool.free_pages() == room, seed  # the whole room, not nothing
    assert cap.blocks >= head_blocks(sched), seed
    backing.map_blocks(range(1, 1 + cap.blocks))  # what the cap allowed maps without waiting
    del other_range


def test_reclaimer_gives_back_only_free_prefix_cached_blocks():
    rng = random.Random()
    seed = rng.randrange(2**32)
    rng.seed(seed)
    n = 64
    geom, nbytes = layer_major(n)
    backing = KVBacking(nbytes, [geom], make_pool(nbytes))
    vllm_pool = FakeBlockPool(n)
    held, cached, plain = set(), set(), set()
    for b in range(1, n):
        kind = rng.choice(["held", "cached", "plain", "unmapped"])
        if kind == "unmapped":
            continue
        backing.map_blocks([b])
        block = vllm_pool.blocks[b]
        if kind == "held":
            block.ref_cnt, block.block_hash = 1, rng.choice([None, ("h", b)])
            held.add(b)
        elif kind == "cached":
            block.block_hash = ("h", b)
            cached.add(b)
        else:
            plain.add(b)  # free, no hash, not yet drained: not the reclaimer's to touch
    watched = rng.choice(sorted(cached)) if cached else None
    if watched is not None:
        vllm_pool._reuse_watchers[watched] = object()  # being read through unpin_blocks
    backing.set_dormant(cached | held)  # stale marks: a held block may have been hit since the last drain
    t = backing.tensor
    for b in held:
        for s, e in geom.spans(b):
            t[s:e] = b % 100 + 1
    cap = SchedulerCap()
    reclaimer = DormantBlockReclaimer(backing, cap, lambda _: vllm_pool)

    # While schedule() runs (the cap's lock is held elsewhere) nothing is touched.
    entered, leave = threading.Event(), threading.Event()

    def scheduling():
        with cap.lock:
            entered.set()
            leave.wait()

    th = threading.Thread(target=scheduling)
    th.start()
    entered.wait()
    before = backing.stats()
    assert reclaimer.reclaim_pages(10_000) == 0 and backing.stats() == before and not vllm_pool.evicted
    leave.set()
    th.join()

    freed = reclaimer.reclaim_pages(10_000)
    gone = cached - {watched}
    assert sorted(vllm_pool.evicted) == sorted(gone), seed
    for b in range(n):
        assert backing.is_mapped(b) == (b in held | plain | ({watched} - {None})), (seed, b)
    for b in held:
        assert vllm_pool.blocks[b].ref_cnt == 1
        for s, e in geom.spans(b):
            assert torch.all(t[s:e] == b % 100 + 1), seed
    still = set()
    for b in held | plain | ({watched} - {None}):
        still.update(backing.pages_of(b))
    assert backing.stats().mapped_bytes == len(still) * PAGE, seed
    assert freed >= 0 and reclaimer.reclaimable_pages() * PAGE <= backing.stats().mapped_bytes


def test_host_pages_are_sized_so_that_no_two_blocks_share_one():
    """block_page_size: the largest power of two from 4 KiB to 64 KiB dividing every offset, stride and block
    size; then every block's span in every layer is whole pages of its own."""
    rng = random.Random()
    seed = rng.randrange(2**32)
    rng.seed(seed)
    for _ in range(50):
        block = rng.choice([1, 2, 3, 5, 6, 8, 12, 16, 24, 32]) * 1024 * rng.choice([1, 2, 4])
        blocks, layers = rng.randint(2, 40), rng.randint(1, 4)
        geom = BlockGeometry(rng.choice([0, block]), block * blocks, block, block, layers, blocks)
        page = block_page_size([geom])
        assert page & (page - 1) == 0 and 4096 <= page <= 64 * 1024, (seed, block, page)
        values = [v for v in (geom.offset, geom.layer_stride, geom.block_stride, geom.block_bytes) if v]
        if page > 4096:
            assert all(v % page == 0 for v in values), (seed, block, page)
        if page < 64 * 1024:
            assert any(v % (2 * page) for v in values), (seed, block, page)
        if block % 4096 == 0:  # then the pages are the block's own: no page is touched by two blocks
            spans = [(s // page, (e - 1) // page) for b in range(blocks) for s, e in geom.spans(b)]
            pages = [p for first, last in spans for p in range(first, last + 1)]
            assert len(pages) == len(set(pages)), (seed, block, page)
    assert block_page_size([layer_major(8)[0]], "cuda") is None  # CUDA pages are the driver's granularity


def test_a_budget_of_another_page_size_wins_with_a_warning(budget_name, monkeypatch, caplog):
    SharedBudget.create(budget_name, 64 * PAGE)  # 64 KiB pages
    monkeypatch.setenv("VPAGED_SHARED_BUDGET", budget_name)
    monkeypatch.setattr(guard, "_warned", set())  # warn_once: this test's warning is not one already given
    with caplog.at_level("WARNING", logger="vpaged.integrations.vllm"):
        pool = make_pool(8 * PAGE, page_size=16 * 1024, model="tiny")
    assert pool.page_size == PAGE and pool.budget is not None
    assert "--page-size 16384" in caplog.text
    handle = SharedBudget.open(budget_name)
    (member,) = handle.state().members  # how `vpaged budget show` lists it
    handle.close()
    assert (member.name, member.model, member.pid) == (f"vllm-{os.getpid()}", "tiny", os.getpid())
    pool.leave_budget()
    SharedBudget.remove(budget_name)
    SharedBudget.create(budget_name, 64 * PAGE, page_size=16 * 1024)
    pool = make_pool(8 * PAGE, page_size=16 * 1024)
    assert pool.page_size == 16 * 1024 and pool.capacity_pages == 32
    pool.leave_budget()


def test_blocks_freed_inside_schedule_widen_the_cap_by_the_pages_they_give_back():
    """A preemption inside schedule() frees blocks: their pages go back to the pool at once and the cap
    grows by the free-queue blocks that then fit (before, the cap stayed put and vLLM preempted every
    running request in turn)."""
    rng = random.Random()
    seed = rng.randrange(2**32)
    rng.seed(seed)
    n = 256
    geom, nbytes = layer_major(n, block_bytes=64 * 1024)  # one page per block and layer
    held = rng.sample(range(1, n), rng.randint(4, 20))
    pool = PagePool("cpu", capacity_pages=2 * len(held), zero_on_reuse=True)
    backing = KVBacking(nbytes, [geom], pool)
    backing.map_blocks(held)
    assert pool.free_pages() == 0
    cap = SchedulerCap()
    cap.blocks, cap.taken = 0, 0
    order = rng.sample(sorted(set(range(1, n)) - set(held)), rng.randint(10, 60))
    freed = rng.sample(held, rng.randint(1, len(held)))
    vllm_pool = SimpleNamespace(free_block_queue=free_queue(order))
    refit_after_free(vllm_pool, backing, cap, lambda: backing.release_blocks(freed), 2 * len(freed))
    assert pool.free_pages() == 2 * len(freed), seed
    assert cap.blocks == min(len(order), len(freed)), seed  # each block of the queue needs 2 fresh pages
    assert all(not backing.is_mapped(b) for b in freed) and all(backing.is_mapped(b) for b in set(held) - set(freed))
    backing.map_blocks(order[: cap.blocks])  # what the cap allows maps
