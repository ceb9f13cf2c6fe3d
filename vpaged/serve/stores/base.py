"""The KVStore contract: what the engine, the scheduler and the runner may ask of the place K/V live.

A store wraps one KV cache and speaks in the serving layer's terms: pages (the unit the budget is counted in:
a page of the vpaged pool, a block of the paged pool), handles (the cache's sequence ids) and admission. The
three kinds differ only behind this interface:

  vpaged  VirtualStore (virtual.py): a VirtualKVCache, pages mapped as a sequence grows, prefix caching,
          swap, forks share pages.
  paged   PagedStore (paged.py): a PagedKVCache of blocks (the classic design); no prefix caching, no swap.
  static  StaticStore (static.py): a VirtualKVCache in which each admitted sequence maps a fixed slot of
          max_model_len tokens at admission and never shares: what static batching reserves.

Everything kind-specific (a static reservation, swap space, the prefix index) is decided inside the store, so
that no caller tests which kind it holds. Planning calls change nothing (pages_needed, pages_available,
can_allocate, can_swap_out, pages_for_request); the scheduler asks them before the matching call that changes
the store (extend, allocate, swap_out), which is then expected to succeed. The calls that change a store are
marked @mutates (KVSTORE_MUTATING): a tensor-parallel engine replays exactly those on its other ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from ..sequence import Sequence
    from .attention import StepAttention

KV_KINDS = ("vpaged", "paged", "static")


def mutates(method):
    """Marks a KVStore method that changes the store: a tensor-parallel engine must replay it on every rank
    (serve/distributed/mirror.py has one operation record per marked method, and a test checks it)."""
    method.__kvstore_mutates__ = True
    return method


@dataclass(frozen=True)
class StoreMemory:
    """A store's memory at one moment (what EngineStats reports about K/V)."""

    live_tokens: int  # tokens whose K/V are held (shared tokens count once per sequence)
    live_bytes: int  # their K/V bytes
    held_bytes: int  # KV memory held now: pages mapped, blocks taken, slots reserved
    high_water_bytes: int  # most KV memory held at once
    budget_bytes: int  # the pool's size
    prefix_hit_tokens: int  # tokens the prefix cache supplied (0 without prefix caching)
    swapped_bytes: int  # bytes in host swap space now
    # Pages (vpaged / static) or blocks (paged) of the pool: free, taken, and of the taken ones those kept only
    # for reuse (freed slots, the prefix cache: reclaimable on demand).
    free_pages: int = 0
    used_pages: int = 0
    dormant_pages: int = 0
    shared_pages: int = 0  # pages mapped by more than one sequence or held by the prefix cache (vpaged, static)


@dataclass(frozen=True)
class Allocation:
    """A sequence the store admitted: its handle, and how many of its tokens the prefix cache already holds
    (their K/V need not be computed)."""

    handle: int
    cached_tokens: int = 0


@runtime_checkable
class KVStore(Protocol):
    """The calls made on a store. Handles are the cache's sequence ids; `n` counts tokens."""

    kind: str  # one of KV_KINDS
    device: torch.device
    page_bytes: int  # bytes one page (vpaged, static) or one block (paged) holds
    prefix_caching: bool  # allocate() may find tokens in the prefix cache
    prefix_tokens_per_page: float  # tokens a cached block (one page of every run) holds; 0.0 when off
    prefix_caching_off: str | None  # why prefix caching is off (None: it is on)
    swap_capacity: int  # bytes of host swap space (0: a preempted sequence is recomputed)
    decode_unsupported: str | None  # why decode rows go to SDPA instead of the kernel (None: the kernel)

    # ---- capacity (change nothing)
    def total_pages(self) -> int:
        """Pages the KV budget holds."""
        ...

    def pages_for_request(self, tokens: int, completions: int) -> int:
        """Pages a request of `tokens` tokens (prompt plus the most it may generate) with `completions`
        completions can need at most: the engine refuses a request that needs more than total_pages()."""
        ...

    def pages_available(self, need: int) -> bool:
        """Whether `need` more pages can be taken now (free ones, or ones the cache can reclaim)."""
        ...

    def pages_needed(self, handles: list[int], n: int) -> int:
        """Pages extend(handles, n) would take (copy-on-write copies included)."""
        ...

    def budget_figures(self):
        """In a machine-wide shared budget: the budget's totals and this store's figures as a member
        (vpaged.memory.BudgetFigures, what /metrics exports); None otherwise."""
        ...

    def label_budget_member(self, model: str) -> None:
        """In a shared budget: the model this store's member serves, for `vpaged budget show`."""
        ...

    def within_share(self, need: int) -> bool:
        """Whether a new request taking `need` pages may be admitted under the store's share of a machine-wide
        budget: False while another member of the budget is starved and this store's live K/V plus `need`
        would pass its fair share (memory/budget/policy.py). True outside a shared budget."""
        ...

    # ---- sequences
    def can_allocate(self, seats: int) -> bool:
        """Whether allocate(tokens, seats) can run now: a free slot for each of the request's `seats`
        completions, plus whatever the kind takes up front at admission."""
        ...

    @mutates
    def allocate(self, tokens: list[int], seats: int = 1) -> Allocation:
        """A new sequence for a prompt (after can_allocate(seats)); it may start with tokens found in the
        prefix cache. `seats`: completions the request will fork into (a store may reserve for them)."""
        ...

    def slot(self, handle: int) -> int:
        """The cache slot of a sequence (its row in the decode kernels), -1 for a store without slots."""
        ...

    @mutates
    def extend(self, handles: list[int], n: int) -> None:
        """Grow each sequence by n tokens (their K/V are written by the step's StepAttention)."""
        ...

    @mutates
    def truncate(self, handle: int, length: int) -> None:
        """Keep a sequence's first `length` tokens (0..its length); the pages wholly past them go back to the
        pool (a static reservation stays whole). The scheduler truncates a prompt found entirely in the prefix
        cache by one token, whose logits it still needs."""
        ...

    @mutates
    def free(self, handle: int) -> None:
        """End a sequence (finished, aborted or preempted for recompute): its pages go back."""
        ...

    @mutates
    def fork(self, handle: int, n: int, length: int) -> list[int]:
        """n new sequences holding the first `length` tokens of `handle` (n > 1 completions of a request,
        once its prompt is computed); returns their handles."""
        ...

    @mutates
    def cache_prefix(self, handle: int, tokens: list[int]) -> None:
        """Offer a sequence's computed prompt `tokens` to the prefix cache (a no-op without one)."""
        ...

    # ---- swapping
    def can_swap_out(self, handle: int) -> bool:
        """Whether swap_out(handle) fits in the swap space left (always False without swap space)."""
        ...

    @mutates
    def swap_out(self, handle: int) -> int:
        """Move a sequence's pages to host swap space (after can_swap_out); returns the bytes moved."""
        ...

    @mutates
    def swap_in(self, handle: int) -> None:
        """Bring a swapped-out sequence back."""
        ...

    # ---- a step
    def step_attention(
        self,
        decodes: list[Sequence],
        prefills: list[tuple[Sequence, int, int]],
        row_offsets: list[int],
        num_tokens: int,
    ) -> StepAttention:
        """The attention of one packed step (see attention.py), built after the step's extend() calls."""
        ...

    # ---- memory
    def memory(self) -> StoreMemory:
        """The store's memory now."""
        ...

    def close(self) -> None:
        """Release the cache."""
        ...


def _members(protocol) -> dict:
    """What a protocol class and the protocols it extends declare (typing's own bases left out)."""
    members: dict = {}
    for cls in reversed(protocol.__mro__):
        if cls is not object and cls.__module__ != "typing":
            members.update(vars(cls))
    return members


def protocol_methods(protocol) -> tuple[str, ...]:
    """The public methods a store protocol declares, in order."""
    return tuple(name for name, value in _members(protocol).items() if callable(value) and not name.startswith("_"))


def mutating_methods(protocol) -> tuple[str, ...]:
    """Those of its methods marked @mutates (they change the store)."""
    members = _members(protocol)
    return tuple(n for n in protocol_methods(protocol) if getattr(members[n], "__kvstore_mutates__", False))


# The methods and attributes every store must have: KVStore's own members, read from the protocol so that a
# member added to it is checked too (tests/serve/test_serve_stores.py); and the methods that change a store, which a
# tensor-parallel engine mirrors on every rank (tests/serve/test_serve_tp_messages.py).
KVSTORE_METHODS = protocol_methods(KVStore)
KVSTORE_ATTRIBUTES = tuple(KVStore.__annotations__)
KVSTORE_MUTATING = mutating_methods(KVStore)


def budget_health(store):
    """The health of the machine-wide shared budget `store`'s pool is a member of (memory.BudgetHealth: ok,
    removed, replaced, corrupt, waiting), or None outside a budget. A lock-free read, for a server's /health
    and its routes while the engine thread is busy: a vpaged / static store's pool, or a paged store's
    reservation in the budget."""
    cache = getattr(store, "cache", None)
    pool = getattr(cache, "budget_share", None) or getattr(cache, "pool", None)
    probe = getattr(pool, "budget_health", None)
    return probe() if callable(probe) else None
