"""PagePool: the physical pages of one device, shared by every cache built on it.

A pool is an object, not global state; `default_pool(device)` creates one per device on first use and
`set_default_pool` replaces it. Caches register with their pool so that, when one cache runs short of
pages, the pool can take back pages other caches keep only for reuse (deferred reclamation) before
anybody sees an OutOfPagesError.
"""

from __future__ import annotations

import functools
import inspect
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from .. import _C
from ..errors import BackendUnavailableError, InvalidArgumentError, OutOfPagesError
from .budget.member import GIVE_BACK_WAIT_S, BudgetMembership
from .budget.shared import SharedBudget, default_member_name
from .capture import capture_active
from .device import CUDA_PAGE_SIZE, default_page_size, make_backend, normalize_device
from .limits import check_host_capacity


@dataclass(frozen=True)
class PoolStats:
    device: str
    page_size: int
    total_pages: int
    used_pages: int
    free_pages: int
    high_water_pages: int
    created_pages: int  # pages with memory now: on CUDA live handles (trim releases free ones); host: all
    kv_pages: int = 0  # used pages by owner: KV caches ...
    allocator_pages: int = 0  # ... and torch tensors (vpaged.torch_allocator, vpaged.empty)
    kept_free_pages: int = 0  # free pages that kept their memory (keep_freed_bytes): resident, not in use
    # CUDA: runs of separately mapped pages the driver refused to unmap with one cuMemUnmap, each then unmapped
    # page by page (the driver documents that the range must be one whole mapping; docs/gpu.md). 0 elsewhere.
    unmap_fallbacks: int = 0
    release_pending: bool = False  # a trim / lowered limit waits for a CUDA graph capture to end (capture.py)
    deferred_teardowns: int = 0  # ranges destroyed during a capture, unmapped once it ended (capture.py)
    # Pages of a file (a page store's) mapped into ranges with no copy and still referenced: not in used_pages,
    # since their memory is the file's, not the pool's (attach_file_pages).
    file_pages: int = 0
    # Device pages another process exported, imported and still referenced (import_pages, CUDA): not in
    # used_pages either, since their memory is the exporter's.
    imported_pages: int = 0

    @property
    def used_bytes(self) -> int:
        return self.used_pages * self.page_size

    @property
    def total_bytes(self) -> int:
        return self.total_pages * self.page_size

    @property
    def high_water_bytes(self) -> int:
        return self.high_water_pages * self.page_size


@runtime_checkable
class Reclaimable(Protocol):
    """A pool client that keeps pages only for reuse (dormant slots, cached prefixes) and gives them back
    when the pool runs short. Register it with PagePool.register(); the pool holds it weakly."""

    def reclaimable_pages(self) -> int:
        """Pages reclaim_pages() could free now."""

    def reclaim_pages(self, pages: int) -> int:
        """Free up to `pages` pages (at least that many if possible); returns the pages freed."""


def _check_keep_freed(nbytes) -> None:
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise InvalidArgumentError(f"keep_freed_bytes must be a non-negative int, got {nbytes!r}")


class PagePool:
    """Physical pages of one device with a fixed capacity.

    capacity_bytes / capacity_pages: the budget (one of them). page_size: bytes per page (default 64 KiB on
    the host, the VMM granularity, 2 MiB on current NVIDIA GPUs, on CUDA). reserve_pages: pages created
    up front (CUDA creates physical memory ahead of need; on the host every page exists at no cost).
    accounting_only: count pages without mapping any memory (the accounting backend): caches on such a
    pool allocate, extend, fork, share and free exactly as on real memory, at any scale, but refuse views
    and kernels. What `vpaged simulate` uses; always on device "cpu" (give the page size to model a GPU).
    overcommit: allow a host capacity above what the machine can back (RAM + swap, or its cgroup limit);
    refused by default, since writing past physical memory ends the process (see limits.py).
    zero_on_reuse: pages read as zeros whenever they change owner (handed out again, or a freed sequence's
    pages given to a new one), so no request ever sees another's K/V. Off by default, like torch.empty.
    keep_freed_bytes: on the host, up to this many bytes of pages that go free keep their memory (the most
    recently freed), so that pages handed out again soon are written in place: a copy-on-write's fresh page, a
    swapped-out sequence's pages on swap in (the kernel need not allocate and zero them first). The process
    then holds at most this much memory beyond its pages in use; trim() and a lower limit give it back. 0 (the
    default): every free page's memory goes back at once. Such a page reads what it held when handed out
    again, not zeros (zero_on_reuse still zeroes it). No effect on CUDA, which keeps free pages' memory anyway.
    shared_budget: the name of a machine-wide SharedBudget (or one opened) to join: capacity becomes this
    pool's ceiling, and the pages it may have in use at once are granted by the budget, which asks the other
    members to give back spare pages when it is full (memory/budget/: shared.py, member.py).
    min_bytes: with shared_budget, bytes guaranteed to this pool that no other member can take.
    member_name, model: how `vpaged budget show` names this member.
    """

    def __init__(
        self,
        device="cpu",
        *,
        capacity_bytes: int | None = None,
        capacity_pages: int | None = None,
        page_size: int | None = None,
        reserve_pages: int = 0,
        overcommit: bool = False,
        zero_on_reuse: bool = False,
        keep_freed_bytes: int = 0,
        accounting_only: bool = False,
        shared_budget=None,
        min_bytes: int = 0,
        member_name: str = "",
        model: str = "",
    ):
        self.device = normalize_device(device)
        _check_keep_freed(keep_freed_bytes)
        self.accounting_only = bool(accounting_only)
        if self.accounting_only and self.device.type != "cpu":
            raise InvalidArgumentError(
                "an accounting-only pool is a host object (caches on it run no kernels): use device='cpu' and "
                f"page_size={CUDA_PAGE_SIZE} to count GPU-sized pages"
            )
        self.page_size = int(page_size) if page_size is not None else default_page_size(self.device)
        if self.page_size <= 0:
            raise InvalidArgumentError(f"page_size must be positive, got {page_size}")
        if (capacity_bytes is None) == (capacity_pages is None):
            raise InvalidArgumentError("give exactly one of capacity_bytes and capacity_pages")
        if capacity_pages is None:
            capacity_pages = int(capacity_bytes) // self.page_size
        if capacity_pages <= 0:
            raise InvalidArgumentError(
                f"a pool needs at least one page of {self.page_size} bytes (capacity {capacity_bytes} bytes)"
            )
        if self.accounting_only:
            backend = _C.accounting_backend(self.page_size, int(capacity_pages))
        else:
            if self.device.type == "cpu":
                check_host_capacity(int(capacity_pages), self.page_size, overcommit)
            backend = make_backend(self.device, self.page_size, int(capacity_pages), int(reserve_pages))
        self._pool = _C.PagePool(backend, int(reserve_pages))
        self._pool.zero_on_reuse = bool(zero_on_reuse)
        self.keep_freed_bytes = keep_freed_bytes
        self._clients: weakref.WeakSet = weakref.WeakSet()
        # Held by the clients' calls that change mappings (kvcache: pool_serialized) and by the budget's
        # give-back thread, so that the thread never reclaims from a cache halfway through a call.
        self.client_lock = threading.RLock()
        self.budget: BudgetMembership | None = None
        if shared_budget is not None:
            if min_bytes and min_bytes > self.capacity_pages * self.page_size:
                raise InvalidArgumentError(f"min_bytes={min_bytes} exceeds the pool's capacity")
            self.budget = BudgetMembership(
                self, self._pool, shared_budget, min_bytes, member_name or default_member_name(), model
            )
            weakref.finalize(self, self.budget.close)
        elif min_bytes:
            raise InvalidArgumentError("min_bytes is a guarantee within a shared budget: give shared_budget too")

    @property
    def capacity_pages(self) -> int:
        return self._pool.backend.capacity_pages

    @property
    def backend(self):
        return self._pool.backend

    @property
    def zero_on_reuse(self) -> bool:
        """Whether pages read as zeros when they change owner (see the constructor)."""
        return self._pool.zero_on_reuse

    @property
    def keep_freed_bytes(self) -> int:
        """Bytes of free pages that may keep their memory (see the constructor); 0 on CUDA."""
        return self._pool.keep_freed * self.page_size

    @keep_freed_bytes.setter
    def keep_freed_bytes(self, nbytes: int) -> None:
        _check_keep_freed(nbytes)
        self._pool.keep_freed = nbytes // self.page_size

    def zero_pages(self, pages) -> None:
        """Make pages (ids in use) read as zeros."""
        self._pool.zero_pages(list(pages))

    def free_pages(self) -> int:
        return self._pool.free_pages()

    def stats(self) -> PoolStats:
        s = self._pool.stats()
        return PoolStats(
            str(self.device),
            s.page_size,
            s.total_pages,
            s.used_pages,
            s.free_pages,
            s.high_water_pages,
            s.created_pages,
            s.kv_pages,
            s.allocator_pages,
            s.kept_free_pages,
            s.unmap_fallbacks,
            s.release_pending,
            s.deferred_teardowns,
            s.file_pages,
            s.imported_pages,
        )

    def trim(self) -> int:
        """Give the memory of all free pages back to the system: the host punches their holes (done already as
        each page went free, except those keep_freed_bytes kept), CUDA releases their cuMemCreate handles (a
        released page is re-created when it is handed out again). Returns how many pages were free. While a
        CUDA graph capture runs (vpaged.memory.graph_capture), the release waits for the capture to end."""
        return self._pool.trim()

    def capture_running(self) -> bool:
        """Whether a CUDA graph capture runs as far as this pool can tell (capture.capture_active(), or on CUDA
        the driver's answer for the legacy stream): unmapping would invalidate it, releases wait for its end."""
        return capture_active() or self._pool.capture_running

    def release_deferred(self) -> bool:
        """Do the releases and range teardowns a CUDA graph capture deferred (capture.py), unless a capture
        still runs; True when nothing is left pending. The capture flag's last exit does this already."""
        return self._pool.release_deferred()

    def reset_high_water(self) -> None:
        self._pool.reset_high_water()

    # Page references and copies, for the ranges' users (prefix index, swap space).
    def new_allocator(self, max_bytes: int = 0):
        """A C++ allocator handing out whole-page allocations from this pool (vpaged/memory/allocator.py; 0: no cap)."""
        return _C.PoolAllocator(self._pool, int(max_bytes))

    def new_range(self, nbytes: int):
        """A VirtualRange (vpaged._C) of nbytes of address space whose pages come from this pool."""
        return _C.VirtualRange(self._pool, int(nbytes))

    def incref(self, pages: list[int]) -> None:
        """Take one more reference on each page (all or none)."""
        self._pool.incref_all(list(pages))

    def decref(self, pages: list[int]) -> None:
        """Drop one reference on each page; a page left with none goes back to the free list."""
        self._pool.decref_all(list(pages))

    def refcount(self, page: int) -> int:
        return self._pool.refcount(page)

    @property
    def can_attach_file_pages(self) -> bool:
        """Whether pages of another file can be mapped into this pool's ranges with no copy (the host backend)."""
        return bool(self._pool.backend.can_attach_file_pages)

    def attach_file_pages(self, fd: int, offsets: list[int]) -> list[int]:
        """Ids for the pages of file `fd` at `offsets` (multiples of the OS page, inside the file), one reference
        each owned by the caller, to map into ranges like any page (VirtualRange.map_shared) with no copy. Such a
        page is mapped private (a write through a range never reaches the file; the caches copy before writing a
        shared page anyway), is read-only to the pool's copies, does not count against the capacity (stats()'s
        file_pages counts them), and is detached when its last reference goes. The host backend only:
        InvalidArgumentError elsewhere, and for an offset that is not a page of the file."""
        return self._pool.attach_file_pages(int(fd), [int(o) for o in offsets])

    def is_file_page(self, page: int) -> bool:
        return self._pool.is_file_page(int(page))

    @property
    def can_share_pages(self) -> bool:
        """Whether this pool's pages can be exported to and imported from other processes (CUDA, where the device
        supports POSIX file-descriptor handles; VPAGED_CUDA_SHAREABLE_PAGES=0 turns it off)."""
        return bool(self._pool.backend.can_share_pages)

    def export_pages(self, pages: list[int]) -> list[int]:
        """One new POSIX file descriptor per page in use (cuMemExportToShareableHandle), for another process on the
        machine to import: send them over a Unix socket (socket.send_fds) and close them here. The memory lives
        while any process holds or maps it, so this pool's later death does not end an importer's pages; the page
        itself stays this pool's as before (its data is shared: publish only pages no one writes any more).
        InvalidArgumentError where pages cannot be shared (can_share_pages) and for a free page."""
        return self._pool.export_pages([int(p) for p in pages])

    def import_pages(self, fds: list[int]) -> list[int]:
        """Ids for the device pages behind descriptors another process exported (export_pages), one reference each
        owned by the caller, to map into ranges like any page (VirtualRange.map_shared): the exporter's memory, no
        copy. Such a page is read-only (ranges map it read-only; the pool's copies into it are refused; the caches
        copy a shared page before writing it), does not count against the capacity (stats()'s imported_pages counts
        them), and is released when its last reference goes. The descriptors stay the caller's to close. All or
        nothing; InvalidArgumentError where pages cannot be shared and for a descriptor that is not a page of this
        pool's size on its device."""
        return self._pool.import_pages([int(fd) for fd in fds])

    def is_imported_page(self, page: int) -> bool:
        return self._pool.is_imported_page(int(page))

    @property
    def file_page_faults(self) -> int:
        """Reads of file pages that faulted because their file was cut short under a range (each answered with
        zeros instead of SIGBUS)."""
        return int(self._pool.backend.file_page_faults)

    def copy_to_host(self, page: int, host_ptr: int, stream: int = 0) -> None:
        """Queue a copy of a page to host memory on `stream` (CUDA; synchronous on the host)."""
        self._pool.copy_to_host(page, host_ptr, stream)

    def copy_from_host(self, page: int, host_ptr: int, stream: int = 0) -> None:
        self._pool.copy_from_host(page, host_ptr, stream)

    def copy_pages_to_host(self, pages: list[int], host_ptrs: list[int], stream: int = 0) -> None:
        """copy_to_host of many pages in one call: pages[i] to host_ptrs[i]. A run of consecutive pages into
        consecutive buffers is one copy (a pread, or a memcpy from where the page is mapped, on the host)."""
        self._pool.copy_pages_to_host(pages, host_ptrs, stream)

    def copy_pages_from_host(self, pages: list[int], host_ptrs: list[int], stream: int = 0) -> None:
        """copy_from_host of many pages in one call, by runs as copy_pages_to_host."""
        self._pool.copy_pages_from_host(pages, host_ptrs, stream)

    def synchronize(self, stream: int = 0) -> None:
        """Wait for the copies queued on `stream`."""
        self._pool.backend.synchronize(stream)

    # Deferred reclamation across the caches that share this pool.
    def register(self, client: Reclaimable) -> None:
        """Ask `client` for pages when the pool runs short (held weakly; see Reclaimable)."""
        if not isinstance(client, Reclaimable):
            raise InvalidArgumentError(f"{type(client).__name__} is not Reclaimable")
        self._clients.add(client)

    def unregister(self, client: Reclaimable) -> None:
        self._clients.discard(client)

    def reclaimable_pages(self) -> int:
        """Pages the clients keep only for reuse and would give back (not counting a shared budget)."""
        with self.client_lock:
            return sum(c.reclaimable_pages() for c in list(self._clients))

    def available_pages(self) -> int:
        """Pages a call could take now: free ones, the clients' reclaimable ones and, in a shared budget,
        what the budget would grant without anyone giving back."""
        budget = self.budget.headroom_pages() if self.budget else 0
        return self.free_pages() + self.reclaimable_pages() + budget

    def can_take(self, pages: int) -> bool:
        """Whether `pages` pages are available now (available_pages); when they are not and the pool is in a
        shared budget, the other members are asked to give back the rest (answered within a poll interval,
        not waited for here), so that a later call may find them. A planning call: changes nothing here."""
        if pages <= self.available_pages():
            return True
        if self.budget:
            self.budget.ask(pages - self.reclaimable_pages())
            return pages <= self.free_pages() + self.reclaimable_pages()
        return False

    def budget_figures(self):
        """In a shared budget: its totals and this pool's figures (budget.member.BudgetFigures); else None."""
        return self.budget.figures(self) if self.budget else None

    def answer_budget_asks(self) -> int:
        """In a shared budget: give back now what the other members asked for and this pool has not answered
        yet (free granted pages, then the clients' reclaimable ones); returns the pages given back. For a
        caller between cache calls (the serving scheduler, each step); a no-op read of 8 bytes when no ask is
        pending."""
        return self.budget.answer_pending(self) if self.budget else 0

    def admission_cap_pages(self) -> int | None:
        """In a shared budget under contention: the pages of live K/V (used minus reclaimable) this pool may
        hold when it admits new work, by the budget's share policy (memory/budget/policy.py); None: no cap."""
        return self.budget.admission_cap_pages() if self.budget else None

    def reclaim_clients(self, pages: int) -> int:
        """Ask clients to unmap pages they keep only for reuse until `pages` are freed; returns pages freed."""
        freed = 0
        with self.client_lock:
            for c in list(self._clients):
                if freed >= pages:
                    break
                freed += c.reclaim_pages(pages - freed)
        return freed

    def reclaim(self, pages: int) -> int:
        """Make up to `pages` more pages free: in a shared budget first by a grant the budget has room
        for, then by asking clients to unmap pages they keep only for reuse; returns the pages made free."""
        grown = self.budget.grow(pages) if self.budget else 0
        return grown + (self.reclaim_clients(pages - grown) if grown < pages else 0)

    def ensure_free(self, pages: int) -> bool:
        """Make `pages` pages free if that is possible: from the pool's free pages; in a shared budget a
        grant where it has room; the clients' reclaimable pages; and last (shared budget) the other members'
        spare pages, waiting up to GIVE_BACK_WAIT_S for them to answer. Changes nothing when it fails."""
        short = pages - self.free_pages()
        if short <= 0:
            return True
        if self.budget:
            self.budget.grow(pages)
            short = pages - self.free_pages()
            if short <= 0:
                return True
        if self.reclaimable_pages() >= short:
            self.reclaim_clients(short)
            return self.free_pages() >= pages
        if self.budget:
            self.budget.grow(pages - self.reclaimable_pages(), wait_s=GIVE_BACK_WAIT_S)
            short = pages - self.free_pages()
            if short <= 0:
                return True
            if self.reclaimable_pages() >= short:
                self.reclaim_clients(short)
                return self.free_pages() >= pages
        return False

    def label_budget_member(self, model: str) -> None:
        """In a shared budget: name the model this pool serves in `vpaged budget show` (a server knows it
        only once the model is loaded, after the pool joined); a no-op outside a budget."""
        if self.budget is not None:
            self.budget.label(model)

    def budget_health(self):
        """In a shared budget: whether it is still the one joined and usable (budget.health.BudgetHealth:
        ok, removed, replaced, corrupt, or waiting on members that do not answer); None outside a budget. A
        read without a lock, for a server's /health while its engine thread is busy."""
        return self.budget.health() if self.budget is not None else None

    def leave_budget(self) -> None:
        """Leave the shared budget (its grant returns to the others); the pool keeps what it has in use,
        and takes nothing more. Also done when the pool is dropped."""
        if self.budget is not None:
            self.budget.close()

    def __repr__(self) -> str:
        s = self.stats()
        kind = ", accounting only" if self.accounting_only else ""
        return f"PagePool(device={s.device}{kind}, page_size={s.page_size}, used={s.used_pages}/{s.total_pages} pages)"


def reserve_in_budget(budget, nbytes: int, name: str = "") -> PagePool:
    """Hold `nbytes` of a shared budget for good, for memory reserved up front outside any pool (a
    PagedKVCache's block pools): an accounting-only member whose minimum is its whole ceiling, granted at
    once or once the others gave back. Raises OutOfPagesError (holding nothing) when the budget cannot
    grant it; BudgetMismatchError when the members' minimums leave no room for it. leave_budget() ends it."""
    budget = budget if isinstance(budget, SharedBudget) else SharedBudget.open(budget)
    pages = -(-int(nbytes) // budget.page_size)
    pool = PagePool(
        "cpu",
        capacity_pages=pages,
        page_size=budget.page_size,
        accounting_only=True,
        shared_budget=budget,
        min_bytes=pages * budget.page_size,
        member_name=name or f"reserved-{os.getpid()}",
    )
    if not pool.ensure_free(pages):
        pool.leave_budget()
        raise OutOfPagesError(
            f"budget {budget.name!r} cannot grant {pages * budget.page_size} bytes reserved up front: the other "
            "members hold them in live pages"
        )
    return pool


def pool_serialized(cls):
    """Class decorator for a pool client: each public method defined on `cls` runs holding
    `self.pool.client_lock` (re-entrant), so the pool's give-back thread (a shared budget asking for pages
    while this process is idle) never reclaims in the middle of one of the client's calls."""
    for name, fn in list(vars(cls).items()):
        if not name.startswith("_") and inspect.isfunction(fn):
            setattr(cls, name, _holding_client_lock(fn))
    return cls


def _holding_client_lock(fn):
    @functools.wraps(fn)
    def call(self, *args, **kwargs):
        with self.pool.client_lock:
            return fn(self, *args, **kwargs)

    return call


_default_pools: dict[torch.device, PagePool] = {}


def default_pool(device="cpu") -> PagePool:
    """The pool of `device`, created on first use. Host: a quarter of RAM (sparse: RAM is used only by
    pages holding data), or VPAGED_HOST_POOL_BYTES. CUDA: 90 % of the free device memory at first use."""
    dev = normalize_device(device)
    pool = _default_pools.get(dev)
    if pool is None:
        if dev.type == "cpu":
            env = os.environ.get("VPAGED_HOST_POOL_BYTES")
            cap = int(env) if env else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
        else:
            reason = _C.cuda_unavailable_reason(dev.index)
            if reason:
                raise BackendUnavailableError(f"cannot use {dev}: {reason}")
            free, _total = torch.cuda.mem_get_info(dev)
            cap = int(free * 0.9)
        pool = PagePool(dev, capacity_bytes=cap)
        _default_pools[dev] = pool
    return pool


def set_default_pool(pool: PagePool) -> None:
    """Make `pool` the default pool of its device (caches created later use it)."""
    _default_pools[pool.device] = pool


def resolve_pool(
    device,
    pool: PagePool | None = None,
    capacity_bytes: int | None = None,
    page_size: int | None = None,
    shared_budget=None,
    min_bytes: int = 0,
    member_name: str = "",
) -> tuple[torch.device, PagePool]:
    """(device, pool) of a cache built with these arguments: `pool` when given (it must be on `device` and
    of `page_size`), else a private pool of capacity_bytes, else the device's default pool. device defaults
    to the pool's device when a pool is given, else "cpu". shared_budget (a name or a SharedBudget): the
    private pool joins it, capacity_bytes (default: the budget's capacity) being its ceiling, min_bytes its
    guaranteed share, page_size defaulting to the budget's."""
    dev = normalize_device(device if device is not None else pool.device if pool else "cpu")
    if pool is not None:
        if capacity_bytes is not None or shared_budget is not None:
            raise InvalidArgumentError("give either pool or capacity_bytes / shared_budget, not both")
        if pool.device != dev:
            raise InvalidArgumentError(f"pool is on {pool.device}, device={device!r} asks for {dev}")
        if page_size is not None and page_size != pool.page_size:
            raise InvalidArgumentError(f"page_size {page_size} differs from the pool's {pool.page_size}")
        return dev, pool
    if shared_budget is not None:
        budget = shared_budget if isinstance(shared_budget, SharedBudget) else SharedBudget.open(shared_budget)
        pool = PagePool(
            dev,
            capacity_bytes=capacity_bytes if capacity_bytes is not None else budget.capacity_bytes,
            page_size=page_size if page_size is not None else budget.page_size,
            shared_budget=budget,
            min_bytes=min_bytes,
            member_name=member_name,
        )
        return dev, pool
    if min_bytes:
        raise InvalidArgumentError("min_bytes is a guarantee within a shared budget: give shared_budget too")
    if capacity_bytes is not None:
        return dev, PagePool(dev, capacity_bytes=capacity_bytes, page_size=page_size)
    pool = default_pool(dev)
    if page_size is not None and page_size != pool.page_size:
        raise InvalidArgumentError(
            f"page_size {page_size} differs from the default pool's {pool.page_size}; "
            "pass capacity_bytes or a pool of that page size"
        )
    return dev, pool
