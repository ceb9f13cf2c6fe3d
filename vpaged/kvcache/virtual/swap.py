"""Swap space: host memory outside the page pool's budget that holds the pages of swapped-out sequences.

One arena of fixed-size chunks (one page each); pinned on CUDA so page copies run at full bandwidth. A swap
moves all of a sequence's pages in one pool call (PagePool.copy_pages_to_host / _from_host): runs of consecutive
pages into consecutive chunks are one copy each there, and no page crosses into Python on its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...errors import SwapSpaceFullError

if TYPE_CHECKING:
    from ...memory.pool import PagePool


class SwapSpace:
    def __init__(self, capacity_bytes: int, page_size: int, pin: bool = False):
        self.page_size = page_size
        self.capacity_chunks = capacity_bytes // page_size
        self._arena = torch.empty(self.capacity_chunks * page_size, dtype=torch.uint8, pin_memory=pin)
        self._base = self._arena.data_ptr()
        self._free = list(range(self.capacity_chunks - 1, -1, -1))  # pop() from the end: the lowest first

    @property
    def used_chunks(self) -> int:
        return self.capacity_chunks - len(self._free)

    @property
    def used_bytes(self) -> int:
        return self.used_chunks * self.page_size

    def alloc(self, n: int) -> list[int]:
        """n chunks, all or none, in ascending order (consecutive while the arena is not fragmented)."""
        if n > len(self._free):
            raise SwapSpaceFullError(
                f"swap space full: {n} page(s) of {self.page_size} bytes needed, {len(self._free)} free of "
                f"{self.capacity_chunks}"
            )
        out = self._free[len(self._free) - n :]
        del self._free[len(self._free) - n :]
        out.reverse()
        return out

    def release(self, chunks: list[int]) -> None:
        self._free.extend(reversed(chunks))  # handed out again in the same order

    def address(self, chunk: int) -> int:
        return self._base + chunk * self.page_size

    def save(self, pool: PagePool, pages: list[int]) -> list[int]:
        """Copy pages into fresh chunks (all or none: SwapSpaceFullError changes nothing) and wait for the
        copies to land, so the pages may go back to the pool. Returns the chunks, in the pages' order."""
        chunks = self.alloc(len(pages))
        try:
            pool.copy_pages_to_host(pages, [self._base + c * self.page_size for c in chunks])
            pool.synchronize()
        except BaseException:
            self.release(chunks)
            raise
        return chunks

    def restore(self, pool: PagePool, pages: list[int], chunks: list[int]) -> None:
        """Copy chunks back into pages and wait for the copies; the chunks stay allocated (release() them
        once the pages are in use: a failed restore can be retried)."""
        pool.copy_pages_from_host(pages, [self._base + c * self.page_size for c in chunks])
        pool.synchronize()


class SwappedSlots:
    """The slots of a cache's swapped-out sequences: for each, the page indices whose pages are in swap space
    (holes in the slot's mapping) and the chunks holding them. Owns the cache's SwapSpace (None: no swapping)."""

    def __init__(self, space: SwapSpace | None):
        self.space = space
        self._out: dict[int, tuple[list[int], list[int]]] = {}  # slot -> (page indices, chunks)

    def __contains__(self, slot: int) -> bool:
        return slot in self._out

    def __len__(self) -> int:
        return len(self._out)

    def __getitem__(self, slot: int) -> tuple[list[int], list[int]]:
        return self._out[slot]

    @property
    def page_count(self) -> int:
        """Pages in swap space, over all swapped-out sequences."""
        return sum(len(p) for p, _ in self._out.values())

    def add(self, slot: int, page_indices: list[int], chunks: list[int]) -> None:
        self._out[slot] = (page_indices, chunks)

    def drop(self, slot: int) -> None:
        """The slot's pages are back in memory (or given up): release their chunks."""
        _, chunks = self._out.pop(slot)
        self.space.release(chunks)

    def clear(self) -> None:
        self._out.clear()
        self.space = None
