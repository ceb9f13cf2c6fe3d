"""vLLM's scheduler under a shared budget (VPAGED_SHARED_BUDGET): it schedules only what the budget can map.

vLLM believes it owns every block of its KV buffer; in a shared budget the pages behind them are granted as
needed and may be in another engine's hands. Without help vLLM would schedule a burst that the budget
cannot back and the step would wait for pages that the other engine, itself waiting, never gives. So, for
the length of each `Scheduler.schedule` call:

- the blocks vLLM may take are capped (`BlockPool.get_num_free_blocks`) by the pages this pool can map now
  (its free pages once a grant or its own prefix-cached blocks made room), counted in blocks with the
  buffer's pages per block; a request that does not fit waits or is preempted, as vLLM does when its own
  blocks run out, and the other members are asked to give back;
- from the plan until the step has mapped its blocks, the pool's client lock is held (patches.py), so the
  budget's give-back thread cannot hand the planned pages to another engine in between (it answers once
  the step's map is done);
- `DormantBlockReclaimer`, the pool's Reclaimable client, frees the pages of blocks vLLM keeps only as
  prefix cache: it evicts them from vLLM's block pool (so no later request can hit on them) and unmaps
  them. It runs only while it holds the scheduler lock (no schedule() is looking blocks up or taking
  them) and never waits for a lock: the budget's give-back thread tries, and a busy engine answers at its
  next schedule().
"""

from __future__ import annotations

import math
import threading

from .backing import KVBacking


class SchedulerCap:
    """The per-schedule() cap on blocks handed out, and the lock that keeps reclaim out of schedule()."""

    def __init__(self):
        self.lock = threading.RLock()
        self.blocks: int | None = None  # blocks vLLM may still take in this schedule() call; None: no cap
        self.taken = 0

    def limit(self, num_free: int) -> int:
        return num_free if self.blocks is None else max(0, min(num_free, self.blocks - self.taken))


def demand_pages(scheduler, backing: KVBacking) -> int:
    """Pages the next step may need: the prompts of the waiting requests that one step could admit (vLLM
    prefills as many as its token budget allows at once), and for the running requests the blocks their
    next token may open (one in block_size steps each)."""
    blocks = math.ceil(len(scheduler.running) / scheduler.block_size)
    room_tokens = getattr(scheduler, "max_num_scheduled_tokens", 8192)
    room_requests = getattr(scheduler, "max_num_running_reqs", 256) - len(scheduler.running)
    for request in scheduler.waiting:
        if room_tokens <= 0 or room_requests <= 0:
            break
        blocks += math.ceil(request.num_tokens / scheduler.block_size)
        room_tokens -= request.num_tokens
        room_requests -= 1
    return math.ceil(blocks * backing.pages_per_block())


def head_blocks(scheduler) -> int:
    """Blocks without which nothing new can start: the first waiting prompt's, else one for decoding."""
    if len(scheduler.waiting):
        return math.ceil(scheduler.waiting.peek_request().num_tokens / scheduler.block_size)
    return 1 if scheduler.running else 0


FIT_SCAN_BLOCKS = 4096  # free blocks looked at per schedule(): more than one step can take


def next_free_blocks(block_pool, limit: int) -> list[int]:
    """The ids vLLM's free queue will hand out next, in order (it pops from the head)."""
    queue = block_pool.free_block_queue
    out, block = [], queue.fake_free_list_head.next_free_block
    while block is not None and block is not queue.fake_free_list_tail and len(out) < limit:
        out.append(block.block_id)
        block = block.next_free_block
    return out


def plan_step(scheduler, backing: KVBacking, cap: SchedulerCap) -> None:
    """Before schedule(): make room for the step's demand (a grant, then this engine's own prefix-cached
    blocks) and cap the blocks vLLM may take to those of its free queue whose fresh pages fit in the pool's
    free pages. Only when even the first waiting request cannot start are the others asked to give back
    (answered later): asking at every step would have two busy engines take each other's spare pages in
    turn, each answer landing between the other's plan and its step."""
    pool = backing.pool
    short = demand_pages(scheduler, backing) - pool.free_pages()
    if short > 0:
        # Grant what there is room for, even short of the demand: the demand counts every prompt one step
        # could admit, often more than the whole budget's headroom, and an all-or-nothing grant gave none;
        # two engines short at once then each waited, starved, for pages the budget had free.
        room = pool.budget.headroom_pages()
        if room > 0:
            short -= pool.budget.grow(pool.free_pages() + min(short, room))
    if short > 0:
        short -= pool.reclaim_clients(short)  # this engine's own prefix-cached blocks
    order = next_free_blocks(scheduler.kv_cache_manager.block_pool, FIT_SCAN_BLOCKS)
    cap.blocks = backing.blocks_that_fit(order, pool.free_pages())
    cap.taken = 0
    if short > 0 and cap.blocks < head_blocks(scheduler):
        pool.budget.ask(short)


def refit_after_free(scheduler_pool, backing: KVBacking, cap: SchedulerCap, drain, freed_pages: int) -> None:
    """Within a schedule() call, after vLLM freed blocks (a preemption, an aborted request): give their
    pages back to the pool now and widen the cap by the blocks that then fit. Without this the cap stayed
    at the plan's count, vLLM found no room for the next block, preempted another request, and another,
    until it had preempted all of them (measured: bursts of two engines on a shared budget waited 10-100 s,
    recomputing). Freed blocks without a prefix-cache hash are unmapped by `drain`; those vLLM keeps as
    prefix cache are evicted from it (this engine's own reclaimer) for up to the pages the freed blocks
    held. No step is running (the scheduler's thread holds the cap's lock, and the backing's lock is
    taken for each unmap)."""
    drain()
    pool = backing.pool
    order = next_free_blocks(scheduler_pool, FIT_SCAN_BLOCKS)
    fits = backing.blocks_that_fit(order, pool.free_pages())
    if fits < len(order) and freed_pages > 0:
        pool.reclaim_clients(freed_pages)
        fits = backing.blocks_that_fit(order, pool.free_pages())
    cap.blocks = cap.taken + fits


class DormantBlockReclaimer:
    """The pool's Reclaimable client: pages of blocks that vLLM holds only as prefix cache."""

    def __init__(self, backing: KVBacking, cap: SchedulerCap, block_pool_of):
        self.backing = backing
        self.cap = cap
        self.block_pool_of = block_pool_of  # backing -> vLLM's BlockPool, or None

    def reclaimable_pages(self) -> int:
        s = self.backing.stats()
        return s.dormant_bytes // s.page_size

    def reclaim_pages(self, pages: int) -> int:
        pool = self.block_pool_of(self.backing)
        if pool is None or not self.cap.lock.acquire(blocking=False):
            return 0
        try:
            if not self.backing.lock.acquire(blocking=False):
                return 0
            try:
                return self._evict(pool, pages)
            finally:
                self.backing.lock.release()
        finally:
            self.cap.lock.release()

    def _evict(self, pool, pages: int) -> int:
        before = self.backing.pool.free_pages()
        watchers = getattr(pool, "_reuse_watchers", {})
        candidates = sorted(self.backing.dormant_blocks())
        chunk = max(1, math.ceil(pages / self.backing.pages_per_block()))
        while candidates and self.backing.pool.free_pages() - before < pages:
            chosen, candidates = candidates[:chunk], candidates[chunk:]
            chosen = [b for b in chosen if self._evictable(pool, pool.blocks[b], watchers)]
            for b in chosen:
                pool._maybe_evict_cached_block(pool.blocks[b])
            self.backing.release_blocks(chosen)  # blocks share pages: a chunk may free fewer than asked
        return self.backing.pool.free_pages() - before

    @staticmethod
    def _evictable(pool, block, watchers) -> bool:
        return block.ref_cnt == 0 and block.block_hash is not None and block.block_id not in watchers
