"""Keeping every rank's KV store in step with rank 0's: the calls that change a store, recorded and replayed.

Every rank's store has the same geometry (num_kv_heads / N heads, the same budget, page size and layout), so
a store that receives the same calls in the same order makes the same decisions: the same slots, the same
pages per head, the same prefix-cache hits. Rank 0's scheduler plans against its own store as in one
process; RecordingStore logs each call that changes it (allocate, extend, truncate, free, fork,
cache_prefix, swap_out, swap_in) with what it returned; the log rides on the next control message, and
Replica applies it to the other ranks' stores before their forward. Planning calls (pages_needed,
pages_available, can_allocate, ...) change nothing and are not sent.

Handles are the cache's own sequence ids: a replica maps rank 0's handles to its own rather than assuming
they agree. An allocation whose prefix hit differs from rank 0's means the caches went out of step: that
raises (and ends the group) instead of computing with the wrong K/V.
"""

from __future__ import annotations

from ...errors import TensorParallelError
from ..stores.base import Allocation


class RecordingStore:
    """Rank 0's store: every KVStore call goes to `store`; the ones that change it are also logged."""

    def __init__(self, store):
        self._store = store
        self._log: list[tuple] = []

    def __getattr__(self, name):
        return getattr(self._store, name)

    def take(self) -> list[tuple]:
        """The calls logged since the last take(), in order."""
        ops, self._log = self._log, []
        return ops

    def allocate(self, tokens: list[int], seats: int = 1) -> Allocation:
        allocation = self._store.allocate(tokens, seats)
        self._log.append(("allocate", list(tokens), seats, allocation.handle, allocation.cached_tokens))
        return allocation

    def extend(self, handles, n: int) -> None:
        self._store.extend(handles, n)
        if handles:
            self._log.append(("extend", list(handles), n))

    def truncate(self, handle: int, length: int) -> None:
        self._store.truncate(handle, length)
        self._log.append(("truncate", handle, length))

    def free(self, handle: int) -> None:
        self._store.free(handle)
        self._log.append(("free", handle))

    def fork(self, handle: int, n: int, length: int) -> list[int]:
        handles = self._store.fork(handle, n, length)
        self._log.append(("fork", handle, n, length, list(handles)))
        return handles

    def cache_prefix(self, handle: int, tokens: list[int]) -> None:
        self._store.cache_prefix(handle, tokens)
        self._log.append(("cache_prefix", handle, list(tokens)))

    def swap_out(self, handle: int) -> int:
        moved = self._store.swap_out(handle)
        self._log.append(("swap_out", handle))
        return moved

    def swap_in(self, handle: int) -> None:
        self._store.swap_in(handle)
        self._log.append(("swap_in", handle))


class Replica:
    """Another rank's store, driven by rank 0's log."""

    def __init__(self, store, rank: int):
        self.store = store
        self.rank = rank
        self.handles: dict[int, int] = {}  # rank 0's handle -> this store's

    def local(self, handle: int) -> int:
        return self.handles[handle]

    def apply(self, ops: list[tuple]) -> None:
        for name, *args in ops:
            getattr(self, "_" + name)(*args)

    def _allocate(self, tokens, seats, handle, cached_tokens):
        allocation = self.store.allocate(tokens, seats)
        self.handles[handle] = allocation.handle
        if allocation.cached_tokens != cached_tokens:
            raise TensorParallelError(
                f"rank {self.rank}'s KV store is out of step with rank 0's: the prefix cache supplied "
                f"{allocation.cached_tokens} tokens here, {cached_tokens} on rank 0"
            )

    def _extend(self, handles, n):
        self.store.extend([self.handles[h] for h in handles], n)

    def _truncate(self, handle, length):
        self.store.truncate(self.handles[handle], length)

    def _free(self, handle):
        self.store.free(self.handles.pop(handle))

    def _fork(self, handle, n, length, children):
        mine = self.store.fork(self.handles[handle], n, length)
        self.handles.update(zip(children, mine))

    def _cache_prefix(self, handle, tokens):
        self.store.cache_prefix(self.handles[handle], tokens)

    def _swap_out(self, handle):
        self.store.swap_out(self.handles[handle])

    def _swap_in(self, handle):
        self.store.swap_in(self.handles[handle])
