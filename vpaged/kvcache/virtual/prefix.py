"""Prefix index: full pages of token prefixes that earlier sequences computed, for reuse.

A block is the run of tokens that fills one page of every region. Its key chains the key of the block before
it with its own token ids (so a key names the whole prefix up to it); on a key hit the stored token ids are
compared too, so a hash collision is never taken for a hit. The index owns one pool reference on each
page of a block: insert() takes them, evict() and clear() drop them. Blocks that nothing else maps are
evicted least recently used first when the pool runs low.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ...errors import InvalidArgumentError

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
    last_used: int


def prefix_unavailable(layout: Layout) -> InvalidArgumentError:
    """The error for prefix caching on a layout whose pages do not hold a whole number of tokens."""
    return InvalidArgumentError(
        f"prefix caching needs pages that hold a whole number of tokens; a page of {layout.page_size} "
        f"bytes holds {layout.tokens_per_page:.3f} (choose a page size that is a multiple of "
        f"{layout.token_bytes} bytes)"
    )


class PrefixIndex:
    def __init__(self, block_tokens: int, pool: PagePool, hash_fn: HashFn | None = None):
        self.block_tokens = block_tokens
        self.pool = pool
        self.hash_fn = hash_fn or chained_hash
        self._blocks: dict[bytes, PrefixBlock] = {}
        self._clock = 0

    @classmethod
    def for_layout(cls, layout: Layout, pool: PagePool, hash_fn: HashFn | None = None) -> PrefixIndex | None:
        """An index whose blocks are the tokens filling one page of every run; None when a page does not
        hold a whole number of tokens (see prefix_unavailable)."""
        tokens = layout.page_size / layout.token_bytes
        return cls(int(tokens), pool, hash_fn) if tokens == int(tokens) else None

    def __len__(self) -> int:
        return len(self._blocks)

    def blocks(self) -> list[PrefixBlock]:
        return list(self._blocks.values())

    def keys(self, tokens: Sequence[int]) -> list[tuple[bytes, tuple[int, ...]]]:
        """(key, token ids) of each full block of `tokens`."""
        out, parent, b = [], b"", self.block_tokens
        for start in range(0, len(tokens) - b + 1, b):
            block = tuple(int(t) for t in tokens[start : start + b])
            parent = self.hash_fn(parent, block)
            out.append((parent, block))
        return out

    def match(self, tokens: Sequence[int]) -> list[PrefixBlock]:
        """The longest run of cached blocks that starts at token 0 and whose token ids all match."""
        self._clock += 1
        hits = []
        for key, block in self.keys(tokens):
            found = self._blocks.get(key)
            if found is None or found.tokens != block or found.depth != len(hits):
                break
            found.last_used = self._clock
            hits.append(found)
        return hits

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
        """Add the full blocks of `tokens` that are not cached yet; pages_of(depth) gives the pages of block
        `depth` (one reference taken on each). Stops at a key that a different prefix owns (a hash
        collision). Returns the number of tokens cached for this prefix."""
        for depth, (key, block) in enumerate(self.keys(tokens)):
            found = self._blocks.get(key)
            if found is None:
                self.insert(key, depth, block, pages_of(depth))
            elif found.tokens != block or found.depth != depth:
                return depth * self.block_tokens
        return len(tokens) // self.block_tokens * self.block_tokens

    def lookup(self, key: bytes) -> PrefixBlock | None:
        return self._blocks.get(key)

    def eviction_order(self) -> list[PrefixBlock]:
        """Least recently used first; within a prefix, deeper blocks before the ones they extend."""
        return sorted(self._blocks.values(), key=lambda b: (b.last_used, -b.depth))

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
