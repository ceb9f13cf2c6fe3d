"""Keeping every rank's KV store in step with rank 0's: the calls that change a store, recorded and replayed.

Every rank's store has the same geometry (num_kv_heads / N heads, the same budget, page size and layout), so
a store that receives the same calls in the same order makes the same decisions: the same slots, the same
pages per head, the same prefix-cache hits. Rank 0's scheduler plans against its own store as in one
process; RecordingStore logs each call that changes it as one frozen operation record (Allocate, Extend, ...,
with what the call returned); the log rides on the next control message (messages.py), and Replica applies
it to the other ranks' stores, dispatching on the record's type, before their forward.

Which calls are recorded is not a list kept here by hand: the KVStore protocol marks the methods that change a
store (@mutates, stores/base.py), OPERATIONS has one record type per marked method, and every other protocol
method is in NOT_MIRRORED with the reason it need not travel. mirror_gaps() says what is missing
(tests/serve/test_serve_tp_messages.py asserts it is nothing), so a new mutating method cannot go unmirrored.

Handles are the cache's own sequence ids: a replica maps rank 0's handles to its own rather than assuming
they agree. An allocation whose prefix hit differs from rank 0's means the caches went out of step: that
raises (and ends the group) instead of computing with the wrong K/V.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...errors import TensorParallelError
from ..stores.base import KVSTORE_ATTRIBUTES, Allocation, KVStore, mutating_methods, protocol_methods


@dataclass(frozen=True)
class Allocate:
    method: ClassVar[str] = "allocate"
    tokens: tuple[int, ...]
    seats: int
    handle: int  # what rank 0's store returned
    cached_tokens: int  # the prefix hit rank 0's store found: a replica must find the same


@dataclass(frozen=True)
class Extend:
    method: ClassVar[str] = "extend"
    handles: tuple[int, ...]
    n: int


@dataclass(frozen=True)
class Truncate:
    method: ClassVar[str] = "truncate"
    handle: int
    length: int


@dataclass(frozen=True)
class Free:
    method: ClassVar[str] = "free"
    handle: int


@dataclass(frozen=True)
class Fork:
    method: ClassVar[str] = "fork"
    handle: int
    n: int
    length: int
    children: tuple[int, ...]  # the handles rank 0's store returned


@dataclass(frozen=True)
class CachePrefix:
    method: ClassVar[str] = "cache_prefix"
    handle: int
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class SwapOut:
    method: ClassVar[str] = "swap_out"
    handle: int


@dataclass(frozen=True)
class SwapIn:
    method: ClassVar[str] = "swap_in"
    handle: int


StoreOp = Allocate | Extend | Truncate | Free | Fork | CachePrefix | SwapOut | SwapIn
OPERATIONS: dict[str, type] = {
    op.method: op for op in (Allocate, Extend, Truncate, Free, Fork, CachePrefix, SwapOut, SwapIn)
}

# The KVStore methods that are not sent to the other ranks, and why.
NOT_MIRRORED: dict[str, str] = {
    "total_pages": "planning: changes nothing",
    "pages_for_request": "planning: changes nothing",
    "pages_available": "planning: changes nothing",
    "pages_needed": "planning: changes nothing",
    "within_share": "planning: changes nothing",
    "budget_figures": "a read of rank 0's membership in a shared budget",
    "label_budget_member": "names the model of rank 0's member in a shared budget (`vpaged budget show`); no K/V",
    "can_allocate": "planning: changes nothing",
    "can_swap_out": "planning: changes nothing",
    "slot": "a read; each rank reads its own (worker.run_step)",
    "step_attention": "each rank builds its own from the Step message (worker.run_step)",
    "memory": "a read; the other ranks answer a MemoryRequest with their own",
    "close": "each rank closes its own store when the group stops",
}


class RecordingStore:
    """Rank 0's store: every KVStore call goes to `store`; the ones that change it are also logged as
    operation records. Only KVStore's members are reachable through it: anything else is an AttributeError,
    so that no call bypasses the protocol (and the mirror) unnoticed."""

    _FORWARDED = frozenset(NOT_MIRRORED) | frozenset(KVSTORE_ATTRIBUTES)

    def __init__(self, store):
        self._store = store
        self._log: list[StoreOp] = []

    def __getattr__(self, name):
        if name in RecordingStore._FORWARDED:
            return getattr(self._store, name)
        raise AttributeError(
            f"{name!r} is not a KVStore member: a tensor-parallel engine reaches its store only through the protocol "
            "(add it there, marked @mutates if it changes the store, and to serve/distributed/mirror.py)"
        )

    def take(self) -> tuple[StoreOp, ...]:
        """The operations logged since the last take(), in order."""
        ops, self._log = tuple(self._log), []
        return ops

    def allocate(self, tokens: list[int], seats: int = 1) -> Allocation:
        allocation = self._store.allocate(tokens, seats)
        self._log.append(Allocate(tuple(tokens), seats, allocation.handle, allocation.cached_tokens))
        return allocation

    def extend(self, handles, n: int) -> None:
        self._store.extend(handles, n)
        if handles:
            self._log.append(Extend(tuple(handles), n))

    def truncate(self, handle: int, length: int) -> None:
        self._store.truncate(handle, length)
        self._log.append(Truncate(handle, length))

    def free(self, handle: int) -> None:
        self._store.free(handle)
        self._log.append(Free(handle))

    def fork(self, handle: int, n: int, length: int) -> list[int]:
        handles = self._store.fork(handle, n, length)
        self._log.append(Fork(handle, n, length, tuple(handles)))
        return handles

    def cache_prefix(self, handle: int, tokens: list[int]) -> None:
        self._store.cache_prefix(handle, tokens)
        self._log.append(CachePrefix(handle, tuple(tokens)))

    def swap_out(self, handle: int) -> int:
        moved = self._store.swap_out(handle)
        self._log.append(SwapOut(handle))
        return moved

    def swap_in(self, handle: int) -> None:
        self._store.swap_in(handle)
        self._log.append(SwapIn(handle))


class Replica:
    """Another rank's store, driven by rank 0's operation records."""

    def __init__(self, store, rank: int):
        self.store = store
        self.rank = rank
        self.handles: dict[int, int] = {}  # rank 0's handle -> this store's

    def local(self, handle: int) -> int:
        return self.handles[handle]

    def apply(self, ops) -> None:
        for op in ops:
            Replica.HANDLERS[type(op)](self, op)

    def _allocate(self, op: Allocate) -> None:
        allocation = self.store.allocate(list(op.tokens), op.seats)
        self.handles[op.handle] = allocation.handle
        if allocation.cached_tokens != op.cached_tokens:
            raise TensorParallelError(
                f"rank {self.rank}'s KV store is out of step with rank 0's: the prefix cache supplied "
                f"{allocation.cached_tokens} tokens here, {op.cached_tokens} on rank 0"
            )

    def _extend(self, op: Extend) -> None:
        self.store.extend([self.handles[h] for h in op.handles], op.n)

    def _truncate(self, op: Truncate) -> None:
        self.store.truncate(self.handles[op.handle], op.length)

    def _free(self, op: Free) -> None:
        self.store.free(self.handles.pop(op.handle))

    def _fork(self, op: Fork) -> None:
        mine = self.store.fork(self.handles[op.handle], op.n, op.length)
        self.handles.update(zip(op.children, mine))

    def _cache_prefix(self, op: CachePrefix) -> None:
        self.store.cache_prefix(self.handles[op.handle], list(op.tokens))

    def _swap_out(self, op: SwapOut) -> None:
        self.store.swap_out(self.handles[op.handle])

    def _swap_in(self, op: SwapIn) -> None:
        self.store.swap_in(self.handles[op.handle])

    HANDLERS = {
        Allocate: _allocate,
        Extend: _extend,
        Truncate: _truncate,
        Free: _free,
        Fork: _fork,
        CachePrefix: _cache_prefix,
        SwapOut: _swap_out,
        SwapIn: _swap_in,
    }


def mirror_gaps(protocol=KVStore) -> list[str]:
    """What keeps the mirror from covering `protocol`: a mutating method without an operation record, a
    RecordingStore method or a Replica handler; a method neither mirrored nor said to need no mirroring."""
    gaps = []
    mutating = set(mutating_methods(protocol))
    for name in protocol_methods(protocol):
        op = OPERATIONS.get(name)
        if name in mutating:
            if op is None:
                gaps.append(f"{name}: changes the store but has no operation record in mirror.OPERATIONS")
                continue
            if name not in vars(RecordingStore):
                gaps.append(f"{name}: RecordingStore does not record it")
            if op not in Replica.HANDLERS:
                gaps.append(f"{name}: Replica has no handler for {op.__name__}")
        elif op is not None:
            gaps.append(f"{name}: mirrored, but KVStore does not mark it @mutates")
        elif name not in NOT_MIRRORED:
            gaps.append(f"{name}: neither mirrored (@mutates) nor in mirror.NOT_MIRRORED with a reason")
    extra = sorted(set(OPERATIONS) - set(protocol_methods(protocol)))
    gaps += [f"{name}: in mirror.OPERATIONS but not a {protocol.__name__} method" for name in extra]
    return gaps
