"""The buffer vLLM keeps its KV cache in, as a vpaged virtual range whose pages map as blocks come and go.

vLLM (0.32) puts every layer of its KV cache in one int8 buffer and addresses it as "layer l of block b
starts at offset + l * layer_stride + b * block_stride" (KVCacheTensor). `BlockGeometry` turns a block id
into the pages of the range that block touches; `KVBacking` reserves the range, hands vLLM a torch tensor
over all of it, and keeps, for every page, how many held blocks touch it: a page is mapped while that count
is positive and unmapped (its memory back in the pool) when it drops to zero. Pages are counted per block
rather than per page owner because a small block (a few KiB per layer) shares a 64 KiB page with its
neighbours, and a page may only go when every block on it is gone.

The tensor is made from the raw address (not a vpaged view, which would pin every page and forbid unmap):
touching an unmapped page is a segmentation fault, so the caller must map every block a step may read or
write before the step runs (patches.py does it from the scheduler's output). A block may also map another
file's pages in place of its own (share_file_pages: vpaged's KV connector maps a page store's pages into
the blocks of a prefix hit, with no copy); they are unmapped like any when the block goes, and replaced by
fresh pages when vLLM hands the block out for other tokens. Nothing here knows vLLM.
"""

from __future__ import annotations

import ctypes
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ...errors import InvalidArgumentError, OutOfPagesError
from ...memory import PagePool
from ...memory.device import default_page_size, normalize_device
from .guard import warn_once

SHARED_BUDGET_ENV = "VPAGED_SHARED_BUDGET"
SHARED_MIN_ENV = "VPAGED_SHARED_MIN_MIB"  # MiB of the budget guaranteed to this engine (the others cannot take)
MAP_WAIT_S = 30.0  # how long a step waits for the shared budget's other members before it fails


@dataclass(frozen=True)
class BlockGeometry:
    """Where one block of one KV tensor lies in the buffer: for each layer l, the bytes
    [offset + l * layer_stride + b * block_stride, + block_bytes)."""

    offset: int
    layer_stride: int
    block_stride: int
    block_bytes: int  # one layer's page of one block
    num_layers: int
    num_blocks: int

    def spans(self, block: int) -> list[tuple[int, int]]:
        """(start, end) byte spans of `block`, one per layer."""
        base = self.offset + block * self.block_stride
        return [
            (base + layer * self.layer_stride, base + layer * self.layer_stride + self.block_bytes)
            for layer in range(self.num_layers)
        ]

    def end(self) -> int:
        """One past the last byte any block of this tensor touches."""
        if self.num_blocks == 0 or self.num_layers == 0:
            return 0
        return max(e for _, e in self.spans(self.num_blocks - 1) + self.spans(0))


@dataclass(frozen=True)
class BackingStats:
    """vpaged memory of a vLLM KV buffer, in bytes: reserved (the address space, vLLM's whole setting),
    mapped (pages with memory now), live (pages that a block vLLM holds touches), dormant (mapped for
    blocks vLLM keeps only as prefix cache)."""

    reserved_bytes: int
    mapped_bytes: int
    live_bytes: int
    dormant_bytes: int
    mapped_blocks: int
    page_size: int
    map_calls: int
    unmap_calls: int
    file_bytes: int = 0  # mapped pages that are another file's (a page store's), not the pool's
    file_blocks_replaced: int = 0  # blocks that mapped file pages and got pages of their own (handed out again)


HOST_MIN_PAGE = 4096  # the smallest page a host range maps (the OS page)


def block_page_size(geometries: list[BlockGeometry], device="cpu") -> int | None:
    """The host page size that gives every block's span in every layer pages of its own: the largest power
    of two from 4 KiB up to the host default (64 KiB) that divides every offset, stride and block size.
    With 64 KiB pages a 16 KiB block shares its page with three neighbours, and vLLM hands free blocks out
    in an order that scatters them over pages: a page is then kept by one live block in four, and a budget
    holds a fraction of the blocks it has bytes for (measured: two engines on one budget waited seconds for
    pages a static split never missed). None: keep the device's default (CUDA pages are 2 MiB, fixed by the
    driver's granularity)."""
    if normalize_device(device).type != "cpu":
        return None
    sizes = [v for g in geometries for v in (g.offset, g.layer_stride, g.block_stride, g.block_bytes) if v]
    page = default_page_size(normalize_device(device))
    while page > HOST_MIN_PAGE and any(v % page for v in sizes):
        page //= 2
    return page


def make_pool(
    nbytes: int, device="cpu", pool: PagePool | None = None, page_size: int | None = None, model: str = ""
) -> PagePool:
    """The pool the buffer's pages come from: `pool` when given, else a private one as large as the
    buffer, in pages of `page_size` (None: the device's default). With VPAGED_SHARED_BUDGET=NAME the private
    pool joins that machine-wide budget (PagePool(shared_budget=NAME), vpaged.memory.SharedBudget): its
    pages then count against the budget, with VPAGED_SHARED_MIN_MIB of them guaranteed to it (min_bytes).
    A budget has one page size for all its members: when it differs from `page_size`, the budget's is used
    and a warning names the `vpaged budget create --page-size` that would fit the blocks."""
    if pool is not None:
        return pool
    budget = os.environ.get(SHARED_BUDGET_ENV)
    if budget:
        from ...memory import SharedBudget

        handle = SharedBudget.open(budget)
        try:
            budget_page = handle.page_size
        finally:
            handle.close()
        if page_size is not None and page_size != budget_page:
            warn_once(
                "budget-page",
                f"shared budget {budget!r} counts pages of {budget_page} bytes; vLLM's blocks fit pages of "
                f"{page_size} (vpaged budget create {budget} --bytes N --page-size {page_size}): with larger "
                "pages, neighbouring blocks share a page and the budget holds fewer blocks",
            )
        page_size = budget_page
    page = page_size or default_page_size(normalize_device(device))
    pages = max(1, math.ceil(nbytes / page))
    kwargs = dict(capacity_pages=pages, page_size=page, zero_on_reuse=True)
    if budget:
        min_bytes = min(int(float(os.environ.get(SHARED_MIN_ENV, "0")) * 2**20), pages * page)
        name = f"vllm-{os.getpid()}"
        return PagePool(device, **kwargs, shared_budget=budget, min_bytes=min_bytes, member_name=name, model=model)
    return PagePool(device, **kwargs)


class KVBacking:
    """A `nbytes` vpaged range that vLLM's KV views are carved from; pages map per block on demand."""

    def __init__(self, nbytes: int, geometries: list[BlockGeometry], pool: PagePool, device="cpu"):
        if nbytes <= 0:
            raise InvalidArgumentError(f"a KV buffer needs a positive size, got {nbytes}")
        for g in geometries:
            if g.end() > nbytes:
                raise InvalidArgumentError(f"a KV tensor reaches byte {g.end()}, past the buffer's {nbytes}")
        if len({g.num_blocks for g in geometries}) > 1:
            raise InvalidArgumentError("the KV tensors disagree on the number of blocks")
        # Always with an index ("cuda" becomes cuda:0): torch makes a CUDA tensor from an address on the
        # device it is told, and asks the driver which device the pointer is on only when told none, which
        # fails for a reserved range whose pages are not mapped yet (and names the wrong device on cuda:1).
        device = normalize_device(device)
        if device != pool.device:
            raise InvalidArgumentError(f"a KV buffer on {device} cannot take its pages from a pool on {pool.device}")
        self.pool = pool
        self.nbytes = int(nbytes)
        self.geometries = list(geometries)
        self.num_blocks = geometries[0].num_blocks if geometries else 0
        self.page_size = pool.page_size
        self._range = pool.new_range(self.nbytes)
        self.num_pages = self._range.num_pages
        self._page_users = np.zeros(self._range.num_pages, dtype=np.int32)  # held blocks touching each page
        self._block_pages: dict[int, np.ndarray] = {}  # mapped block -> its pages
        self._dormant: set[int] = set()  # mapped blocks vLLM keeps only as prefix cache
        # block -> (its page indices that map another file's pages, called once they are unmapped)
        self._file_blocks: dict[int, tuple[list[int], Callable[[], None]]] = {}
        self.lock = threading.RLock()  # the worker's step holds it: no unmap runs under a kernel
        self.map_calls = 0
        self.unmap_calls = 0
        self.file_blocks_replaced = 0
        self.device = device
        self._tensor: torch.Tensor | None = None
        if self.device.type == "cuda":
            # vLLM's kernels run on the current stream: the range waits for it before every unmap, so a
            # block released between steps is never unmapped under a kernel still reading it.
            self._range.add_stream(torch.cuda.current_stream(self.device).cuda_stream)

    @property
    def tensor(self) -> torch.Tensor:
        """The int8 tensor over the whole range, made on first use (a CUDA one needs a CUDA build of torch,
        which the bookkeeping does not)."""
        if self._tensor is None:
            self._tensor = self._raw_tensor()
        return self._tensor

    @property
    def address(self) -> int:
        return self._range.address

    def _raw_tensor(self) -> torch.Tensor:
        addr = self._range.address
        if self.device.type == "cpu":
            buf = (ctypes.c_int8 * self.nbytes).from_address(addr)
            t = torch.frombuffer(buf, dtype=torch.int8, count=self.nbytes)
            t._vpaged_backing = self  # the range lives as long as the tensor
            return t
        holder = _CudaArray(addr, self.nbytes, self)
        return torch.as_tensor(holder, device=self.device)

    def pages_of(self, block: int) -> list[int]:
        if not 0 <= block < self.num_blocks:
            raise InvalidArgumentError(f"block {block} outside 0..{self.num_blocks - 1}")
        return self._pages_of_many(np.array([block], dtype=np.int64))[0].tolist()

    def _pages_of_many(self, blocks: np.ndarray) -> list[np.ndarray]:
        """The sorted pages of each block, computed for the whole batch at once (numpy, no Python per
        layer): a prefill hands out hundreds of blocks, each touching a page or two in every layer."""
        ps = self.page_size
        firsts, lasts = [], []
        for g in self.geometries:
            layers = np.arange(g.num_layers, dtype=np.int64) * g.layer_stride
            starts = g.offset + blocks[:, None] * g.block_stride + layers[None, :]
            firsts.append(starts // ps)
            lasts.append((starts + g.block_bytes - 1) // ps)
        first, last = np.concatenate(firsts, axis=1), np.concatenate(lasts, axis=1)
        widest = int((last - first).max(initial=0)) + 1  # a span crosses at most this many pages
        pages = first[:, :, None] + np.arange(widest, dtype=np.int64)[None, None, :]
        inside = pages <= last[:, :, None]
        return [np.unique(row[ok]) for row, ok in zip(pages, inside)]

    def pages_per_block(self) -> float:
        """Pages a block brings in on average: what a step needs per new block (blocks may share pages)."""
        span = sum(g.num_layers * g.block_bytes for g in self.geometries)
        return max(span / self.page_size, 1e-9)

    def blocks_that_fit(self, order, pages: int) -> int:
        """How many of the blocks `order` (in the order vLLM will hand them out) fit into `pages` fresh
        pages, counting pages already mapped (a neighbour's, a cached block's) and pages two of them share
        once."""
        with self.lock:
            arr = np.asarray(list(order), dtype=np.int64)
            if arr.size == 0:
                return 0
            per_block = self._pages_of_many(arr)
            flat = np.concatenate(per_block)
            owner = np.repeat(np.arange(len(per_block)), [len(p) for p in per_block])
            fresh = np.zeros(flat.size, dtype=bool)
            fresh[np.unique(flat, return_index=True)[1]] = True  # a page counts for the first block needing it
            fresh &= self._page_users[flat] == 0
            needed = np.cumsum(np.bincount(owner[fresh], minlength=len(per_block)))
            return int(np.searchsorted(needed, pages, side="right"))

    def is_mapped(self, block: int) -> bool:
        return block in self._block_pages

    def map_blocks(self, blocks) -> int:
        """Map the pages of every block not mapped yet (fresh pages read as zeros); returns blocks mapped.
        Costs O(blocks given), one C++ call for all fresh pages. In a shared budget the pool first makes
        the pages free (a grant, its own cached blocks, the others giving back; PagePool.ensure_free).
        All or nothing: OutOfPagesError leaves every block as it was."""
        with self.lock:
            ids = {int(b) for b in blocks}
            bad = [b for b in ids if not 0 <= b < self.num_blocks]
            if bad:
                raise InvalidArgumentError(f"block {bad[0]} outside 0..{self.num_blocks - 1}")
            self._dormant.difference_update(ids)
            todo = sorted(ids - self._block_pages.keys())
            if not todo:
                return 0
            arr = np.asarray(todo, dtype=np.int64)
            per_block = self._pages_of_many(arr)
            touched = np.unique(np.concatenate(per_block))
            fresh = touched[self._page_users[touched] == 0]
            if fresh.size:
                self._take_pages(int(fresh.size))
                self._range.map_new(fresh.tolist())
                self.map_calls += 1
            for b, pages in zip(todo, per_block):
                self._page_users[pages] += 1
                self._block_pages[b] = pages
            return len(todo)

    def _take_pages(self, pages: int) -> None:
        if self.pool.free_pages() >= pages:
            return
        deadline = time.monotonic() + MAP_WAIT_S
        while not self.pool.ensure_free(pages):
            if self.pool.budget is None or time.monotonic() > deadline:
                raise OutOfPagesError(
                    f"vLLM's step needs {pages} KV pages and the pool has {self.pool.free_pages()} free"
                    + (" (shared budget: the other members did not give back in time)" if self.pool.budget else "")
                )
            time.sleep(0.01)

    def map_all(self) -> None:
        self.map_blocks(range(self.num_blocks))

    def release_blocks(self, blocks) -> int:
        """Unmap the pages no other mapped block touches; returns blocks released (unmapped ones are skipped)."""
        with self.lock:
            gone = [int(b) for b in blocks if int(b) in self._block_pages]
            if not gone:
                return 0
            pages = np.concatenate([self._block_pages.pop(b) for b in gone])
            np.subtract.at(self._page_users, pages, 1)
            self._dormant.difference_update(gone)
            idle = np.unique(pages[self._page_users[pages] == 0])
            if idle.size:
                self._range.unmap(idle.tolist())
                self.unmap_calls += 1
            for b in gone:
                if b in self._file_blocks:
                    self._file_blocks.pop(b)[1]()
            return len(gone)

    # ------------------------------------------------------------------------------------- another file's pages
    def can_share_file_pages(self, nbytes: int) -> bool:
        """Whether a span of `nbytes` of a block can be another file's pages (share_file_pages): the pool can
        map file pages (the host backend), and every block's span starts on a page of its own and covers whole
        pages, so a page never holds bytes of two blocks."""
        ps = self.page_size
        if not self.pool.can_attach_file_pages or nbytes % ps:
            return False
        return all(
            g.block_bytes % ps == 0 and not (g.offset | g.layer_stride | g.block_stride) % ps for g in self.geometries
        )

    def share_file_pages(self, block: int, spans: list[tuple[int, int]], nbytes: int, fd: int, on_release) -> None:
        """Map the pages of file `fd` in place of the mapped block's own: spans are (byte offset in the buffer,
        byte offset in the file) of `nbytes` each. No byte is copied; the block then reads the file's page
        cache pages, mapped private (a write would never reach the file). on_release() is called once they are
        unmapped again: the block released (release_blocks) or given fresh pages (replace_file_pages). All or
        nothing: an error leaves the block on pages of its own (their bytes undefined)."""
        with self.lock:
            if block not in self._block_pages:
                raise InvalidArgumentError(f"block {block} is not mapped")
            if not self.can_share_file_pages(nbytes):
                raise InvalidArgumentError(f"spans of {nbytes} bytes cannot map file pages of this buffer")
            ps = self.page_size
            indices = [(at + k) // ps for at, _ in spans for k in range(0, nbytes, ps)]
            offsets = [off + k for _, off in spans for k in range(0, nbytes, ps)]
            if not set(indices) <= set(self._block_pages[block].tolist()) or (self._page_users[indices] != 1).any():
                raise InvalidArgumentError(f"the spans given are not pages of block {block} alone")
            self.replace_file_pages([block])  # the file pages of an earlier hit on this block go first
            ids = self.pool.attach_file_pages(fd, offsets)
            try:
                self._range.unmap(indices)
                try:
                    self._range.map_shared(indices, ids)
                except BaseException:
                    self._range.map_new(indices)
                    raise
            finally:
                self.pool.decref(ids)  # the range holds them now; they detach when it unmaps them
            self._file_blocks[block] = (indices, on_release)
            self.map_calls += 1

    def replace_file_pages(self, blocks) -> int:
        """Give the blocks among `blocks` that map file pages fresh pages of the pool instead (zeros), before
        vLLM writes other tokens into them; returns how many were."""
        with self.lock:
            todo = [int(b) for b in blocks if int(b) in self._file_blocks]
            for b in todo:
                indices, _ = self._file_blocks[b]
                self._range.unmap(indices)
                self._take_pages(len(indices))
                self._range.map_new(indices)
                self._file_blocks.pop(b)[1]()
                self.unmap_calls += 1
                self.file_blocks_replaced += 1
            return len(todo)

    def maps_file_pages(self, block: int) -> bool:
        return block in self._file_blocks

    def set_dormant(self, blocks, dormant: bool = True) -> None:
        """Mark mapped blocks as kept only for the prefix cache (counted as dormant), or as held again."""
        with self.lock:
            for b in blocks:
                if int(b) in self._block_pages:
                    (self._dormant.add if dormant else self._dormant.discard)(int(b))

    def mapped_bytes(self) -> int:
        """Bytes mapped now, read without the lock (a sampler may call it while a step runs)."""
        return self._range.mapped_pages * self.page_size

    def dormant_blocks(self) -> set[int]:
        with self.lock:
            return set(self._dormant)

    def stats(self) -> BackingStats:
        with self.lock:
            mapped = self._range.mapped_pages
            dormant_pages = set()
            for b in self._dormant:
                dormant_pages.update(self._block_pages[b].tolist())
            live_pages = set()
            for b, pages in self._block_pages.items():
                if b not in self._dormant:
                    live_pages.update(pages.tolist())
            dormant_only = dormant_pages - live_pages
            ps = self.page_size
            return BackingStats(
                self.nbytes,
                mapped * ps,
                len(live_pages) * ps,
                len(dormant_only) * ps,
                len(self._block_pages),
                ps,
                self.map_calls,
                self.unmap_calls,
                sum(len(i) for i, _ in self._file_blocks.values()) * ps,
                self.file_blocks_replaced,
            )


class _CudaArray:
    """Hands torch a CUDA address through __cuda_array_interface__ (the CUDA engine's path)."""

    def __init__(self, addr: int, nbytes: int, owner: KVBacking):
        self.owner = owner
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|i1", "data": (addr, False), "version": 3}
