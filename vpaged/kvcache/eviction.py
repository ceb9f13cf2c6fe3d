"""What a cache gives up first when its pool runs short: two injected strategies, today's orders by default.

- An EvictionPolicy orders cached prefix blocks for eviction: "lru" (least recently used first, the default,
  as vLLM's free-block queue does) or "lfu" (least frequently used first, ties least recently used, as
  SGLang's radix cache offers). A block counts one use when it is cached and one per prefix hit.
- A ReclaimOrder says in which order the kinds of pages kept only for reuse go back to the pool:
  "dormant_first" (the default: freed slots' pages, then prefix blocks nothing else maps, then live
  sequences' spare tails) or "prefix_first" (cached prefixes before freed slots: for workloads whose
  prompts share little, where a freed slot's mapped pages save more than a cached prefix does).

Both are chosen by one option string of the cache's record (VirtualCacheConfig(eviction_policy=..., reclaim_order=...)),
or passed as objects (any class with the protocol's members). Each policy only orders: which blocks or pages
may be given back at all (nothing a live view reads, nothing another sequence maps) stays the cache's rule.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from ..errors import InvalidArgumentError


class CachedBlock(Protocol):
    """What an eviction policy may read of a cached block (prefix.py's PrefixBlock has these)."""

    depth: int  # block index in its prefix (0: the first page of tokens)
    last_used: int  # the index's clock at its insertion or latest hit
    uses: int  # its insertion plus its hits


@runtime_checkable
class EvictionPolicy(Protocol):
    """Orders cached blocks for eviction: evicted first is the block with the smallest sort_key."""

    name: str

    def sort_key(self, block: CachedBlock) -> tuple: ...


class LRUEviction:
    """Least recently used first; within a prefix (blocks touched at the same clock) deeper blocks before
    the ones they extend, so a prefix is cut from its end."""

    name = "lru"

    def sort_key(self, block: CachedBlock) -> tuple:
        return (block.last_used, -block.depth)


class LFUEviction:
    """Least frequently used first, then least recently used, then deeper first. A hit on block d also hits
    blocks 0..d-1, so a block is never used less than the blocks that extend it: a prefix is cut from its end
    here too."""

    name = "lfu"

    def sort_key(self, block: CachedBlock) -> tuple:
        return (block.uses, block.last_used, -block.depth)


EVICTION_POLICIES: dict[str, type] = {"lru": LRUEviction, "lfu": LFUEviction}


def resolve_eviction_policy(policy: str | EvictionPolicy = "lru") -> EvictionPolicy:
    """The policy a name stands for ("lru", "lfu"), or a given policy object as is."""
    if isinstance(policy, str):
        if policy not in EVICTION_POLICIES:
            raise InvalidArgumentError(f"eviction_policy must be one of {sorted(EVICTION_POLICIES)}, got {policy!r}")
        return EVICTION_POLICIES[policy]()
    if not isinstance(policy, EvictionPolicy):
        raise InvalidArgumentError(
            f"eviction_policy must be a name ({sorted(EVICTION_POLICIES)}) or an object with name and "
            f"sort_key(block), got {policy!r}"
        )
    return policy


def eviction_order(blocks: Iterable[CachedBlock], policy: EvictionPolicy) -> list:
    """The blocks, first to be evicted first."""
    return sorted(blocks, key=policy.sort_key)


class ReclaimStage(enum.Enum):
    DORMANT = "dormant"  # pages of freed slots (deferred reclamation), oldest freed first
    PREFIX = "prefix"  # cached prefix blocks nothing but the index maps, in the eviction policy's order
    SPARE = "spare"  # live sequences' private pages past what their tokens need


@dataclass(frozen=True)
class ReclaimOrder:
    """The order in which a cache gives its kinds of reusable pages back: each stage once."""

    name: str
    stages: tuple[ReclaimStage, ...]

    def __post_init__(self):
        if sorted(s.value for s in self.stages) != sorted(s.value for s in ReclaimStage):
            raise InvalidArgumentError(
                f"a reclaim order names each of {[s.value for s in ReclaimStage]} once, got {self.stages}"
            )


RECLAIM_ORDERS: dict[str, ReclaimOrder] = {
    "dormant_first": ReclaimOrder("dormant_first", (ReclaimStage.DORMANT, ReclaimStage.PREFIX, ReclaimStage.SPARE)),
    "prefix_first": ReclaimOrder("prefix_first", (ReclaimStage.PREFIX, ReclaimStage.DORMANT, ReclaimStage.SPARE)),
}


def resolve_reclaim_order(order: str | ReclaimOrder = "dormant_first") -> ReclaimOrder:
    """The order a name stands for ("dormant_first", "prefix_first"), or a given ReclaimOrder as is."""
    if isinstance(order, ReclaimOrder):
        return order
    if not isinstance(order, str) or order not in RECLAIM_ORDERS:
        raise InvalidArgumentError(f"reclaim_order must be one of {sorted(RECLAIM_ORDERS)}, got {order!r}")
    return RECLAIM_ORDERS[order]
