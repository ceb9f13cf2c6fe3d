"""Prefix index: full pages of token prefixes that earlier sequences computed, for reuse.

A block is page d of every run of a sequence; its tokens are every token with bytes in that page. A page
need not hold a whole number of tokens (a 64 KiB page holds 85.33 tokens of a 768-byte row: 3 KV heads x 64
x fp32), so a token may straddle two pages and then belongs to both blocks' token windows:

    tokens   |  0 .. 84  | 85 |  86 .. 169  | 170 | 171 ...
    pages    |<------ page 0 ------>|<------ page 1 ------>|<-- page 2
    block 0 window: tokens 0..85 (85 straddles)   block 1 window: tokens 85..170

Block d is complete once every token of its window is written; a hit of blocks 0..d maps those pages shared
and gives the new sequence the tokens that lie wholly in them (tokens_in(d + 1): 170 above). The token that
straddles the last shared page is computed again: writing it copies that one page first (copy-on-write, as
for any shared page), so the cached page never changes. Where pages hold whole tokens nothing straddles and
a block is exactly the tokens that fill one page; where a token spans several pages (rows longer than a
page), a hit ends at the last page that completes a token.

A block's key chains the key of the block before it with its own window's token ids (so a key names the
whole prefix up to it); on a key hit the stored token ids are compared too, so a hash collision is never
taken for a hit. The index owns one pool reference on each page of a block: insert() takes them, evict()
and clear() drop them. Blocks that nothing else maps are evicted when the pool runs low, in the order of
the index's EvictionPolicy (kvcache/eviction.py: least recently used first by default, or least frequently
used first); each block keeps what a policy reads: its clock of last use and its count of uses.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING

import numpy as np

from ..eviction import EvictionPolicy, eviction_order, resolve_eviction_policy

if TYPE_CHECKING:
    from ...memory.pool import PagePool
    from .layout import Layout

HashFn = Callable[[bytes, Sequence[int]], bytes]


def chained_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.digest()


@dataclass
class PrefixBlock:
    key: bytes
    depth: int  # block index in the prefix (0: the first page of tokens)
    tokens: tuple[int, ...]
    pages: list[int]  # one page per region, in region order
    last_used: int  # the index's clock at insertion or the latest hit
    uses: int = 1  # insertion plus hits (what "lfu" orders by)


class PrefixIndex:
    def __init__(
        self,
        tokens_per_page: int | Fraction,
        pool: PagePool,
        hash_fn: HashFn | None = None,
        eviction: str | EvictionPolicy = "lru",
    ):
        """tokens_per_page: page size / token row bytes, exactly (a Fraction where a page holds a part token);
        eviction: the order blocks are evicted in (a name of kvcache/eviction.py or a policy object)."""
        self.eviction = resolve_eviction_policy(eviction)
        self.tokens_per_page = Fraction(tokens_per_page)
        if self.tokens_per_page <= 0:
            raise ValueError(f"tokens_per_page must be positive, got {tokens_per_page}")
        self.pool = pool
        self.hash_fn = hash_fn or chained_hash
        self._blocks: dict[bytes, PrefixBlock] = {}
        self._clock = 0

    @classmethod
    def for_layout(
        cls, layout: Layout, pool: PagePool, hash_fn: HashFn | None = None, eviction: str | EvictionPolicy = "lru"
    ) -> PrefixIndex:
        """An index whose blocks are one page of every run of the layout."""
        return cls(Fraction(layout.page_size, layout.token_bytes), pool, hash_fn, eviction)

    @property
    def block_tokens(self) -> int:
        """The most tokens a block's window spans: tokens_per_page where pages hold whole tokens, else one more
        than it rounded up (a straddling token at either end)."""
        if self.tokens_per_page.denominator == 1:
            return int(self.tokens_per_page)
        return math.ceil(self.tokens_per_page) + 1

    def tokens_in(self, pages: int) -> int:
        """Tokens whose bytes lie wholly in the first `pages` pages."""
        return math.floor(pages * self.tokens_per_page)

    def tokens_to_fill(self, pages: int) -> int:
        """Tokens that must be written before the first `pages` pages are complete (straddlers included)."""
        return math.ceil(pages * self.tokens_per_page)

    def usable_pages(self, pages: int) -> int:
        """The most of the first `pages` pages a hit maps: up to the last one that completes a token (all of
        them unless a token spans more than a page)."""
        tokens = self.tokens_in(pages)
        return min(pages, math.ceil(tokens / self.tokens_per_page))

    def __len__(self) -> int:
        return len(self._blocks)

    def blocks(self) -> list[PrefixBlock]:
        return list(self._blocks.values())

    def keys(self, tokens: Sequence[int]) -> list[tuple[bytes, tuple[int, ...]]]:
        """(key, token ids of its window) of each complete block of `tokens`."""
        out, parent, depth = [], b"", 0
        while (end := self.tokens_to_fill(depth + 1)) <= len(tokens):
            block = tuple(int(t) for t in tokens[self.tokens_in(depth) : end])
            parent = self.hash_fn(parent, block)
            out.append((parent, block))
            depth += 1
        return out

    def match(self, tokens: Sequence[int]) -> list[PrefixBlock]:
        """The longest run of cached blocks that starts at token 0 and whose token ids all match (ending at a
        page that completes a token: see usable_pages)."""
        self._clock += 1
        hits = []
        for key, block in self.keys(tokens):
            found = self._blocks.get(key)
            if found is None or found.tokens != block or found.depth != len(hits):
                break
            found.last_used = self._clock
            found.uses += 1
            hits.append(found)
        return hits[: self.usable_pages(len(hits))]

    @property
    def pages(self) -> int:
        """Pages the index holds a reference on."""
        return sum(len(b.pages) for b in self._blocks.values())

    def insert(self, key: bytes, depth: int, tokens: tuple[int, ...], pages: list[int]) -> bool:
        """Add a block, taking a reference on each of its pages; False (nothing taken) if its key is taken."""
        if key in self._blocks:
            return False
        self.pool.incref(pages)
        self._clock += 1
        self._blocks[key] = PrefixBlock(key, depth, tokens, pages, self._clock)
        return True

    def insert_prefix(self, tokens: Sequence[int], pages_of: Callable[[int], list[int]]) -> int:
        """Add the complete blocks of `tokens` that are not cached yet; pages_of(depth) gives the pages of
        block `depth` (one reference taken on each). Stops at a key that a different prefix owns (a hash
        collision). Returns the number of tokens wholly in the blocks now cached for this prefix."""
        return self.tokens_in(self.insert_blocks(tokens, pages_of))

    def insert_blocks(self, tokens: Sequence[int], pages_of: Callable[[int], list[int]]) -> int:
        """insert_prefix(), returning the number of blocks (pages of each run) cached for this prefix."""
        keys = self.keys(tokens)
        added, cached = [], len(keys)
        for depth, (key, block) in enumerate(keys):
            found = self._blocks.get(key)
            if found is None:
                self.insert(key, depth, block, pages_of(depth))
                added.append(self._blocks[key])
            elif found.tokens != block or found.depth != depth:
                cached = depth  # a key that a different prefix owns (a hash collision): stop
                break
        # One use of the whole prefix, at one clock: within it, deeper blocks are evicted before the blocks they
        # extend (a tick per insert would make the first block the oldest and evict it first, stranding the rest).
        for b in added:
            b.last_used = self._clock
        return cached

    def lookup(self, key: bytes) -> PrefixBlock | None:
        return self._blocks.get(key)

    def eviction_order(self) -> list[PrefixBlock]:
        """Every block, first to be evicted first, in the eviction policy's order (by default least recently
        used first; within a prefix, deeper blocks before the ones they extend)."""
        return eviction_order(self._blocks.values(), self.eviction)

    def evictable(self, releasable: set[int] = frozenset()) -> list[PrefixBlock]:
        """Blocks whose pages evicting would free, in eviction order: pages nothing but the index holds,
        counting one more reference on each page in `releasable` (held by mappings the caller can drop)."""
        refcount = self.pool.refcount
        return [b for b in self.eviction_order() if all(refcount(p) == 1 + (p in releasable) for p in b.pages)]

    def evict(self, block: PrefixBlock) -> int:
        """Remove a block and drop its page references; returns the number of pages."""
        del self._blocks[block.key]
        self.pool.decref(block.pages)
        return len(block.pages)

    def clear(self) -> int:
        """Evict every block; returns the number of pages whose references were dropped."""
        pages = [p for b in self._blocks.values() for p in b.pages]
        self._blocks.clear()
        self.pool.decref(pages)
        return len(pages)
