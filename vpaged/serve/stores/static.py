"""StaticStore (kv="static"): what static batching reserves, on a VirtualKVCache.

Each admitted sequence maps a fixed slot of max_model_len tokens at admission, and every completion of a
request gets its own slot then (the others wait, unshared, for fork()): the memory a StaticCache would hold
for the same batch. Nothing is shared, swapped or found in a prefix cache, and a step never needs pages: the
whole reservation is the admission's cost. The same kernels as vpaged run on it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from ...errors import InvalidArgumentError
from ...kvcache.checks import is_int
from ...kvcache.geometry import KVGeometry
from .base import Allocation, StoreMemory
from .virtual import VirtualStore

if TYPE_CHECKING:
    from ..config import EngineConfig


class StaticStore(VirtualStore):
    """kv="static": a VirtualStore whose sequences map their whole slot at admission (see the module)."""

    kind = "static"

    def __init__(self, config: EngineConfig, geometry: KVGeometry, max_seq_len: int):
        super().__init__(config, geometry, max_seq_len, swap_bytes=0, prefix_caching=False)
        self.prefix_caching_off = "kv='static' reserves a whole slot per sequence and shares no pages"
        self._reserved: dict[int, list[int]] = {}  # handle -> reservations for its other completions
        # Tokens extended into each reservation: the live ones (the cache holds every reservation in full).
        self._lengths: dict[int, int] = {}
        if self.slot_pages > self.total_pages():
            self.close()
            raise InvalidArgumentError(
                f"kv='static' reserves max_model_len={max_seq_len} tokens per sequence, more than the KV budget "
                f"of {config.store.kv_budget_bytes} bytes holds; raise kv_budget_bytes or lower max_model_len"
            )

    @property
    def slot_tokens(self) -> int:
        """Tokens each sequence reserves at admission (its slot: the longest sequence allowed)."""
        return self.cache.max_seq_len

    @property
    def slot_pages(self) -> int:
        """Pages one slot maps."""
        return self.pages_for_tokens(self.slot_tokens)

    # ---- capacity
    def pages_for_request(self, tokens: int, completions: int) -> int:
        return self.slot_pages * completions  # a whole slot per completion, whatever the length

    def pages_needed(self, handles, n: int) -> int:
        return 0  # the reservation is mapped already

    # ---- sequences
    def can_allocate(self, seats: int) -> bool:
        return self.free_slots() >= seats and self.pages_available(self.slot_pages * seats)

    def allocate(self, tokens: list[int], seats: int = 1) -> Allocation:
        """Maps a slot of slot_tokens for each of `seats` completions now; no prefix cache."""
        handles = []
        for _ in range(seats):
            handles.append(self.cache.allocate())
            self.cache.extend(handles[-1], self.slot_tokens)
            self._lengths[handles[-1]] = 0
        if seats > 1:
            self._reserved[handles[0]] = handles[1:]
        return Allocation(handles[0], 0)

    def extend(self, handles, n: int) -> None:
        for handle in handles:  # within the reservation: only the count of live tokens grows
            self._lengths[handle] += n

    def truncate(self, handle: int, length: int) -> None:
        """Keeps the first `length` tokens live; the slot stays reserved in full (that is what static holds)."""
        held = self._lengths[handle]
        if not is_int(length) or not 0 <= length <= held:
            raise InvalidArgumentError(f"new_len must be an int in 0..{held}, got {length!r}")
        self._lengths[handle] = length

    def free(self, handle: int) -> None:
        super().free(handle)
        self._lengths.pop(handle, None)
        for child in self._reserved.pop(handle, ()):
            self.cache.free(child)
            self._lengths.pop(child, None)

    def fork(self, handle: int, n: int, length: int) -> list[int]:
        """Copies the first `length` tokens into the reservations made at admission (static never shares)."""
        children = self._reserved.pop(handle)
        source = self.cache.kv_layers(handle, 0, length)
        for child in children:
            self.cache.kv_layers(child, 0, length).copy_(source)
            self._lengths[child] = length
        return children

    # ---- memory
    def memory(self) -> StoreMemory:
        # The cache counts every reservation in full as live; the tokens computed into them are the live ones.
        live = sum(self._lengths.values())
        return dataclasses.replace(super().memory(), live_tokens=live, live_bytes=live * self.cache.bytes_per_token)
