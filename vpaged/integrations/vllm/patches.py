"""The hooks the plugin puts into vLLM 0.32, when switched on and the version is supported.

- `allocate_kv_cache` under the name each model runner calls (runners.py: V1 `gpu_model_runner`, V2
  `gpu/attn_utils`; the CPU runners inherit them): the backing buffer becomes a KVBacking of the same size,
  viewed the same way. The throwaway KV cache a runner makes to measure CUDA graphs' memory
  (`initialize_kv_cache(is_profiling=True)`) stays vLLM's own.
- `execute_model` of both runners: before each step, under the backing's lock, every block id of the
  scheduler's output (new requests, running and resumed ones, blocks to zero) is mapped, and the blocks the
  block pool has let go are unmapped. Block 0, vLLM's null block (padding slots point at it), stays mapped.
  The V2 runner's dummy batches (`dummy_run=True`: profiling, warm-up, graph capture) pass straight through.
- `BlockPool.free_blocks / _maybe_evict_cached_block / reset_prefix_cache`: note which block ids may have
  become unused. The block's state is read again when the release runs (on the worker's thread, or the
  idle thread between steps), so a block handed out again in the meantime is never unmapped: free, with no
  prefix-cache hash, and not being read through unpin_blocks is the only state that unmaps.
- `Scheduler.schedule` (holding the lock that keeps reclaim out) and `BlockPool.get_num_free_blocks /
  get_new_blocks`: in a shared budget, each schedule() is planned against the pages the budget can map
  (budget.py). Idle for IDLE_EVICT_S, the idle thread also gives back the pages of blocks kept only as
  prefix cache (evicting them from vLLM's pool first) unless VPAGED_VLLM_KEEP_PREFIX=1. While a CUDA graph
  capture runs (vLLM's, counted by runners.make_graph_capture, or any vpaged.memory knows of) it waits.

Cost per step: the ids of the step's new blocks only (vLLM sends a running request's blocks once), one
C++ call for all their fresh pages, one for all pages released; no madvise on the step's path (the pool
trims once idle). TP or PP > 1 is declined (guard.parallel_refusal says why).
"""

from __future__ import annotations

import atexit
import functools
import inspect
import logging
import math
import threading
import time
import weakref

from .backing import BlockGeometry, KVBacking, block_page_size, make_pool
from .budget import DormantBlockReclaimer, SchedulerCap, plan_step, refit_after_free
from .guard import MAP_ENV, executor_refusal, layout_refusal, parallel_refusal, warn_once

logger = logging.getLogger("vpaged.integrations.vllm")
IDLE_PERIOD_S = 0.25
IDLE_EVICT_S = 0.75  # idle this long, blocks kept only as prefix cache give their pages back
KEEP_PREFIX_ENV = "VPAGED_VLLM_KEEP_PREFIX"  # "1": keep prefix-cached blocks mapped while idle


class PluginState:
    """The plugin's objects in this process: the live backing, the block pools seen, ids to re-check."""

    def __init__(self):
        self.backing: KVBacking | None = None
        self.block_pools: weakref.WeakSet = weakref.WeakSet()
        self.candidates: set[int] = set()
        self.evicted: set[int] = set()  # candidates evicted from vLLM's prefix cache since the last drain
        self.candidates_lock = threading.Lock()
        self.map_mode = "demand"
        self.released_since_trim = 0
        self.last_step = time.monotonic()
        self.cap = SchedulerCap()  # the shared budget's cap on the blocks schedule() hands out
        self.freed_in_schedule = 0  # blocks vLLM freed since the cap was last fitted (inside schedule())
        self.reclaimer: DormantBlockReclaimer | None = None
        self.evict_when_idle = True
        self.plan_held = None  # the pool's client lock, held from schedule()'s plan to the step's map
        self.hook_seconds = 0.0  # time the step hooks took (mapping, releasing), for the overhead figure
        self.captures = 0  # vLLM's CUDA graph captures running now (runners.make_graph_capture counts them)
        self.profiling = 0  # vLLM's throwaway KV caches being set up (initialize_kv_cache(is_profiling=True))
        self.steps = 0
        self.step_seconds = 0.0  # whole steps, hooks included
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def release_plan(self) -> None:
        """Let the budget's give-back thread in again (the planned step has mapped, or never ran)."""
        held, self.plan_held = self.plan_held, None
        if held is not None:
            held.release()

    def note(self, block_ids, evicted: bool = False) -> None:
        """Blocks to look at in the next drain: freed, or evicted from the prefix cache (their bytes no longer
        what their hash said)."""
        with self.candidates_lock:
            ids = set(block_ids)
            self.candidates.update(ids)
            if evicted:
                self.evicted.update(ids)

    def pool_for(self, backing: KVBacking):
        for pool in list(self.block_pools):
            if pool.num_gpu_blocks == backing.num_blocks:
                return pool
        return None

    def drain(self) -> int:
        """Unmap the noted blocks that are now unused; mark prefix-cached free ones dormant. Caller holds
        nothing; takes the backing's lock."""
        backing = self.backing
        if backing is None or self.map_mode != "demand":
            return 0
        with self.candidates_lock:
            ids, self.candidates = self.candidates, set()
            evicted, self.evicted = self.evicted, set()
        if not ids:
            return 0
        pool = self.pool_for(backing)
        if pool is None:
            return 0
        with backing.lock:
            release, dormant, held = [], [], []
            watchers = getattr(pool, "_reuse_watchers", {})
            for b in ids:
                if b <= 0 or b >= len(pool.blocks):
                    continue
                block = pool.blocks[b]
                if block.ref_cnt > 0 or block.block_id in watchers:
                    held.append(b)
                elif block.block_hash is None:
                    release.append(b)
                else:
                    dormant.append(b)
            backing.set_dormant(dormant, True)
            backing.set_dormant(held, False)
            # A held block that was evicted from the prefix cache, or has no hash, was handed out again for other
            # tokens (a block re-hit from the prefix cache keeps its hash and was not evicted): if it maps a page
            # store's pages (connector/worker_side.py maps them into the blocks of a hit), it gets pages of its
            # own before the step writes into it. Its hash alone cannot tell: vLLM hashes the blocks a step
            # fills when it schedules them, before the forward writes them.
            backing.replace_file_pages(b for b in held if b in evicted or pool.blocks[b].block_hash is None)
            released = backing.release_blocks(release)
        self.released_since_trim += released
        return released

    def start_idle_thread(self) -> None:
        if self._thread is None:
            self._stop = threading.Event()
            self._thread = threading.Thread(
                target=self._idle_loop, args=(self._stop,), name="vpaged-vllm-release", daemon=True
            )
            self._thread.start()
            # A daemon thread still running when the interpreter finalizes is ended where it next asks for the
            # GIL back. Inside a torch or numpy call that had let the GIL go (the release work makes such
            # calls), that end unwinds through C++ frames and aborts the process ("terminate called without
            # an active exception") after the engine's work is done. atexit hooks run before that.
            atexit.register(self.stop_idle_thread)

    def stop_idle_thread(self, timeout_s: float = 5.0) -> None:
        """Stop the idle thread after its current round and wait for it (up to timeout_s)."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        atexit.unregister(self.stop_idle_thread)
        self._stop.set()
        if thread is not threading.current_thread():
            thread.join(timeout_s)

    def capturing(self) -> bool:
        """Whether a CUDA graph capture runs in this process: vLLM's (counted here) or any other that
        vpaged.memory knows of. No page is unmapped or released meanwhile: in the default capture mode a
        driver memory call from any thread invalidates the capture."""
        return self.captures > 0 or _vpaged_capture_active()

    def _idle_loop(self, stop: threading.Event) -> None:
        while not stop.wait(IDLE_PERIOD_S):
            try:
                if self.capturing():
                    continue  # the noted blocks stay noted; the first round after the capture releases them
                self.drain()
                backing = self.backing
                idle_s = time.monotonic() - self.last_step
                if self.reclaimer is not None and self.evict_when_idle and idle_s > IDLE_EVICT_S:
                    # The prefix cache's blocks go too (evicted from vLLM's block pool, so no request hits
                    # on them): an idle engine keeps no KV memory. Skipped while schedule() runs.
                    if self.reclaimer.reclaimable_pages():
                        self.released_since_trim += self.reclaimer.reclaim_pages(backing.num_pages)
                # Unmapped pages sit in the pool's free list; once vLLM is idle, hand their RAM back.
                if backing is not None and self.released_since_trim and idle_s > 0.5:
                    with backing.lock:
                        backing.pool.trim()
                    self.released_since_trim = 0
            except Exception as e:  # never take the engine down from the release thread
                warn_once("idle", f"releasing KV pages failed: {e!r}")


STATE = PluginState()


def _vpaged_capture_active() -> bool:
    """vpaged.memory.capture_active() where this vpaged has it (False otherwise)."""
    try:
        from ...memory import capture_active
    except ImportError:
        return False
    return bool(capture_active())


def scheduled_block_ids(scheduler_output) -> set[int]:
    """Every block id a step of this scheduler output may touch."""
    ids: set[int] = {0}
    for req in scheduler_output.scheduled_new_reqs:
        for group in req.block_ids:
            ids.update(group)
    cached = scheduler_output.scheduled_cached_reqs
    for groups in cached.new_block_ids:
        if groups is not None:
            for group in groups:
                ids.update(group)
    if scheduler_output.new_block_ids_to_zero:
        ids.update(scheduler_output.new_block_ids_to_zero)
    return ids


def make_allocate_kv_cache(original):
    @functools.wraps(original)
    def allocate_kv_cache(kv_cache_config, device, layout, kernel_block_sizes=None):
        if STATE.profiling:
            # The minimal KV cache vLLM makes to measure CUDA graphs' memory, dropped right after: it stays
            # vLLM's own (a backing here would become the live one and outlive it).
            return original(kv_cache_config, device, layout, kernel_block_sizes)
        refusal = None if kv_cache_config.kv_cache_tensors else "no KV tensors"
        refusal = refusal or layout_refusal(kv_cache_config) or parallel_refusal(*_parallel_sizes())
        refusal = refusal or executor_refusal(_executor_backend())
        if refusal is None and device.type not in ("cpu", "cuda"):
            refusal = f"device {device} is not supported"
        if refusal is not None:
            warn_once("layout:" + refusal, f"vLLM keeps its own KV buffer: {refusal}")
            return original(kv_cache_config, device, layout, kernel_block_sizes)
        try:
            kv_caches = _allocate_on_vpaged(kv_cache_config, device, layout, kernel_block_sizes)
        except TypeError as e:  # a vpaged without the shared budget asked for by VPAGED_SHARED_BUDGET
            warn_once("budget", f"vLLM keeps its own KV buffer: {e}")
            return original(kv_cache_config, device, layout, kernel_block_sizes)
        return kv_caches

    allocate_kv_cache._vpaged_original = original
    return allocate_kv_cache


def _parallel_sizes() -> tuple[int, int]:
    """This worker's tensor and pipeline parallel sizes (1, 1 where vLLM's groups are not set up)."""
    try:
        from vllm.distributed import parallel_state
    except ImportError:
        return 1, 1
    tp = parallel_state._TP.world_size if parallel_state._TP is not None else 1
    pp = parallel_state._PP.world_size if parallel_state._PP is not None else 1
    return tp, pp


def _executor_backend() -> str | None:
    """The running engine's distributed_executor_backend as a name (None outside a vLLM config context)."""
    try:
        from vllm.config import get_current_vllm_config_or_none

        config = get_current_vllm_config_or_none()
    except Exception:  # no vLLM config machinery (a test), or a vLLM that moved it
        return None
    backend = config.parallel_config.distributed_executor_backend if config is not None else None
    return backend if isinstance(backend, str) or backend is None else getattr(backend, "__name__", str(backend))


def _model_name() -> str:
    """The served model's name, for `vpaged budget show` ("" outside a vLLM config context)."""
    try:
        from vllm.config import get_current_vllm_config_or_none

        config = get_current_vllm_config_or_none()
        return str(config.model_config.model or "") if config is not None and config.model_config else ""
    except Exception:  # no config set (a test), or a vLLM that moved it: the name is only a label
        return ""


def _allocate_on_vpaged(kv_cache_config, device, layout, kernel_block_sizes):
    import os

    from vllm.v1.kv_cache_interface import create_kv_cache_views

    group = kv_cache_config.kv_cache_groups[0]
    spec = group.kv_cache_spec
    nbytes = kv_cache_config.kv_cache_tensors[0].size
    geometries = [
        BlockGeometry(
            t.offset,
            t.layer_stride,
            t.block_stride,
            spec.page_size_bytes,
            len(t.layers),
            kv_cache_config.num_blocks_of(t),
        )
        for t in kv_cache_config.kv_cache_tensors
    ]
    pool = make_pool(nbytes, device, page_size=block_page_size(geometries, device), model=_model_name())
    backing = KVBacking(nbytes, geometries, pool, device)
    STATE.map_mode = "all" if os.environ.get(MAP_ENV, "demand") == "all" else "demand"
    if STATE.map_mode == "all":
        backing.map_all()
    else:
        backing.map_blocks([0])
    kernel_block_size = kernel_block_sizes[0] if kernel_block_sizes else None
    kv_caches = {}
    for t in kv_cache_config.kv_cache_tensors:
        views = create_kv_cache_views(
            backing.tensor, spec, kv_cache_config.num_blocks_of(t), layout, t, kernel_block_size=kernel_block_size
        )
        kv_caches.update(zip(t.layers, views))
    STATE.backing = backing
    STATE.reclaimer = DormantBlockReclaimer(backing, STATE.cap, STATE.pool_for)
    STATE.evict_when_idle = os.environ.get(KEEP_PREFIX_ENV, "0") != "1"
    if backing.pool.budget is not None:
        backing.pool.register(STATE.reclaimer)
    STATE.start_idle_thread()
    s = backing.stats()
    logger.warning(
        "vpaged: vLLM's KV buffer (%d blocks, %.2f GiB) is a vpaged range mapped %s; %.1f MiB mapped now",
        backing.num_blocks,
        nbytes / 2**30,
        "on demand" if STATE.map_mode == "demand" else "whole at start",
        s.mapped_bytes / 2**20,
    )
    return kv_caches


def make_execute_model(original):
    # The V2 runner also runs its dummy batches (profiling, warm-up, CUDA graph capture) through
    # execute_model(dummy_run=True): they address only the null block (block 0, mapped from the start) and
    # padding slots, and may run inside a capture, where no page may be mapped or unmapped.
    params = list(inspect.signature(original).parameters)
    dummy_at = params.index("dummy_run") - 2 if "dummy_run" in params else None  # in *args, past self and output

    @functools.wraps(original)
    def execute_model(self, scheduler_output, *args, **kwargs):
        backing = STATE.backing
        dummy = kwargs.get("dummy_run", False) or (dummy_at is not None and len(args) > dummy_at and args[dummy_at])
        if backing is None or STATE.map_mode != "demand" or dummy:
            return original(self, scheduler_output, *args, **kwargs)
        tic = time.perf_counter()
        STATE.drain()
        with backing.lock:
            try:
                backing.map_blocks(scheduled_block_ids(scheduler_output))
            finally:
                STATE.release_plan()
            STATE.hook_seconds += time.perf_counter() - tic
            STATE.steps += 1
            try:
                return original(self, scheduler_output, *args, **kwargs)
            finally:
                STATE.step_seconds += time.perf_counter() - tic
                STATE.last_step = time.monotonic()

    return execute_model


def make_initialize_kv_cache(original):
    """initialize_kv_cache(config, is_profiling=True) makes a throwaway KV cache (to measure CUDA graphs'
    memory before the real one exists): allocate_kv_cache leaves that one to vLLM."""
    params = list(inspect.signature(original).parameters)
    profiling_at = params.index("is_profiling") - 2 if "is_profiling" in params else None

    @functools.wraps(original)
    def initialize_kv_cache(self, kv_cache_config, *args, **kwargs):
        profiling = kwargs.get("is_profiling", False) or (
            profiling_at is not None and len(args) > profiling_at and args[profiling_at]
        )
        if not profiling:
            return original(self, kv_cache_config, *args, **kwargs)
        STATE.profiling += 1
        try:
            return original(self, kv_cache_config, *args, **kwargs)
        finally:
            STATE.profiling -= 1

    return initialize_kv_cache


def make_block_pool_hooks(block_pool_cls):
    init, free, evict, reset = (
        block_pool_cls.__init__,
        block_pool_cls.free_blocks,
        block_pool_cls._maybe_evict_cached_block,
        block_pool_cls.reset_prefix_cache,
    )

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        STATE.block_pools.add(self)

    @functools.wraps(free)
    def free_blocks(self, ordered_blocks):
        blocks = list(ordered_blocks)
        free(self, blocks)
        STATE.note(b.block_id for b in blocks)
        if STATE.cap.blocks is not None:  # inside a capped schedule(): the cap is fitted again (budget.py)
            STATE.freed_in_schedule += len(blocks)

    @functools.wraps(evict)
    def _maybe_evict_cached_block(self, block):
        evicted = evict(self, block)
        if evicted:
            STATE.note((block.block_id,), evicted=True)
        return evicted

    @functools.wraps(reset)
    def reset_prefix_cache(self):
        done = reset(self)
        if done:
            STATE.note(range(1, self.num_gpu_blocks))
        return done

    return {
        "__init__": __init__,
        "free_blocks": free_blocks,
        "_maybe_evict_cached_block": _maybe_evict_cached_block,
        "reset_prefix_cache": reset_prefix_cache,
    }


def make_scheduler_hooks(scheduler_cls, block_pool_cls):
    """Scheduler.schedule plans each step against the shared budget (budget.py); BlockPool's free count
    is capped while it runs. Without a budget both pass straight through."""
    schedule, num_free, get_new = (
        scheduler_cls.schedule,
        block_pool_cls.get_num_free_blocks,
        block_pool_cls.get_new_blocks,
    )

    @functools.wraps(schedule)
    def scheduled(self, *args, **kwargs):
        backing = STATE.backing
        with STATE.cap.lock:  # held so that no reclaim evicts a block this call may look up
            if backing is None or backing.pool.budget is None or STATE.map_mode != "demand":
                return schedule(self, *args, **kwargs)
            STATE.release_plan()
            # The pool's client lock stays held from the plan until the step has mapped its blocks: the
            # budget's give-back thread (which takes it) cannot hand the planned pages to another engine.
            backing.pool.client_lock.acquire()
            STATE.plan_held = backing.pool.client_lock
            STATE.drain()
            # Between steps, no block is being read: answer the other members' asks here. The budget's
            # give-back thread cannot evict this engine's prefix-cached blocks while a step runs (it would
            # need the backing's lock, held through the forward), so a busy engine answered only with its
            # free pages and the asking engine waited for it, seconds at a time.
            backing.pool.answer_budget_asks()
            plan_step(self, backing, STATE.cap)
            STATE.freed_in_schedule = 0
            try:
                return schedule(self, *args, **kwargs)
            finally:
                STATE.cap.blocks = None
                STATE.freed_in_schedule = 0

    @functools.wraps(num_free)
    def get_num_free_blocks(self):
        if STATE.freed_in_schedule and STATE.cap.blocks is not None and STATE.backing is not None:
            freed, STATE.freed_in_schedule = STATE.freed_in_schedule, 0
            backing = STATE.backing
            refit_after_free(self, backing, STATE.cap, STATE.drain, math.ceil(freed * backing.pages_per_block()))
        return STATE.cap.limit(num_free(self))

    @functools.wraps(get_new)
    def get_new_blocks(self, num_blocks):
        blocks = get_new(self, num_blocks)
        STATE.cap.taken += len(blocks)
        return blocks

    return (
        {"schedule": scheduled},
        {"get_num_free_blocks": get_num_free_blocks, "get_new_blocks": get_new_blocks},
    )
