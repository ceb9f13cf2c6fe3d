"""StoreLink: a VirtualKVCache's tie to a PageStore shared with other processes (and with later runs).

Note (what a link does, and what it does not do yet). A cache built with VirtualCacheConfig(prefix_store=...)
opens the store (memory/store/) and keeps its own prefix index (prefix.py) as before. The store sits behind
that index as a second tier:

- publish: cache_prefix(seq, tokens) offers the sequence's full blocks to the local index and then publishes
  every page of each block the store does not hold yet (one copy of each page into the store's data file).
  A block is page d of every run of the slot (prefix.py); its store keys are one per run, chained from the
  fingerprint as fingerprint.py says, so a page of another model, dtype, KV format, layout or page size never
  hits.
- fetch: allocate(tokens) maps the local index's hits first; for the blocks after them it asks the store and
  pins the leading blocks whose every page is published. On the host the pinned pages themselves are mapped
  into the new sequence's range (PagePool.attach_file_pages: the store's data file, MAP_PRIVATE, no byte
  copied; counted in mapped_bytes), each checked against its crc32 where it is mapped the first time in this
  process. On CUDA (the store is host memory), or with mapping off, they are copied into fresh pages
  (copied_bytes: one host-to-device copy per page on CUDA) and unpinned.

Mapped pages. The link holds one pool reference and the store pin of every store page it mapped, keyed by the
page's store key, so a page hit by several sequences is attached once. That reference keeps the page shared
(reference count 2 or more while a sequence maps it): the sequence's pages up to the hit are below its shared
watermark, so a write into one (the straddling token it recomputes, a rollback) copies the page first, as
for any shared page, and no write ever lands in the store. Pages only the link still holds (their sequences
freed) are given back, pin and reference, at the next fetch or publish, and all of them at close. The local
index does not keep store pages past their use either: its blocks whose pages are all store pages that no
sequence maps are evicted from it then too. Such a block costs the local pool nothing, so the pool would never
ask for it back, and its pins would keep the store from evicting it for as long as the process runs; the
store, which holds it anyway, serves the next hit on it by mapping it again.

Pages the local index evicts under pressure stay in the store (within its capacity), so the store is also this
process's host tier and, for a dir: store, what a restarted process finds again.
"""

from __future__ import annotations

import ctypes
import hashlib
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ...errors import (
    BackendError,
    InvalidArgumentError,
    MappingLimitError,
    OutOfPagesError,
    StoreError,
    StoreFullError,
)
from ...memory.store import FULL, PRESENT, PUBLISHED, PageStore, StoreFingerprint, chain_keys, page_key

if TYPE_CHECKING:
    from .page_map import PageMap
    from .prefix import PrefixIndex

DEFAULT_STORE_PAGES = 4096  # capacity of a store a cache creates when the config gives none
# Pages staged for one PageStore.publish_many (whole blocks, at least one): a batch reads the store's slot table
# twice however many pages it holds.
PUBLISH_BATCH_BYTES = 32 << 20


@dataclass
class StoreLinkStats:
    """What a cache's link to its store did. hit_tokens: tokens a new sequence started with from the store
    (beyond the local index's hits); hit_pages: pages fetched; copied_bytes: bytes copied for the pages fetched
    by copy; mapped_bytes: bytes of store pages mapped into ranges with no copy (a page mapped into two sequences
    counts twice); mapped_pages: store pages the link holds mapped now; published_pages:
    pages this cache published; present_pages: pages it offered that the store held already; full: publishes
    refused because every page of the store was pinned or being written; short: hits not taken because the
    pool had no room for their pages; faults: fetches given up on a store error (a page failing its checksum,
    a damaged file, a lost lease, a mapping refused), the tokens computed instead; read_faults: reads of mapped
    store pages that found their data file cut short (they read zeros: the sequences mapping them compute wrong
    K/V from there on, and the link maps no store page any more)."""

    hit_tokens: int = 0
    hit_pages: int = 0
    copied_bytes: int = 0
    mapped_bytes: int = 0
    mapped_pages: int = 0
    published_pages: int = 0
    present_pages: int = 0
    full: int = 0
    short: int = 0
    faults: int = 0
    read_faults: int = 0


class StoreLink:
    """map_pages: map hits into ranges with no copy where the pool can (the host backend), else copy them."""

    def __init__(
        self, store: PageStore, fingerprint: StoreFingerprint, runs: int, page_size: int, pool=None, map_pages=True
    ):
        if store.page_bytes != page_size:
            raise InvalidArgumentError(
                f"store {store.name!r} holds pages of {store.page_bytes} bytes, this cache's pages are {page_size}: "
                "use a store made for this page size (or another store name)"
            )
        self.store, self.fingerprint, self.runs, self.page_size = store, fingerprint, runs, page_size
        self.stats = StoreLinkStats()
        self._known: set[bytes] = set()  # block keys this process published or found published
        self.pool = pool
        self.maps = bool(map_pages and pool is not None and pool.can_attach_file_pages)
        # A publish hands the store host pages where the range maps them; a device's go through a host buffer.
        self.publishes_in_place = pool is not None and pool.device.type == "cpu"
        # store key -> (pool page id, pin) of every store page mapped (see the module note)
        self._mapped: dict[bytes, tuple[int, object]] = {}
        self._read_faults_seen = pool.file_page_faults if self.maps else 0

    @classmethod
    def open(
        cls,
        name: str,
        fingerprint: StoreFingerprint,
        runs: int,
        page_size: int,
        capacity_pages: int | None,
        pool=None,
        map_pages: bool = True,
    ):
        store = PageStore.open(
            name, create=True, capacity_pages=capacity_pages or DEFAULT_STORE_PAGES, page_bytes=page_size
        )
        try:
            return cls(store, fingerprint, runs, page_size, pool, map_pages)
        except BaseException:
            store.close()
            raise

    def block_keys(self, windows: Sequence[Sequence[int]]) -> list[bytes]:
        return chain_keys(self.fingerprint, windows)

    def _keys_of(self, block_keys: Sequence[bytes]) -> list[bytes]:
        """The store keys of the blocks, block-major (every run of a block, then the next block)."""
        return [page_key(b, r) for b in block_keys for r in range(self.runs)]

    # ------------------------------------------------------------------------------------------------ fetch
    def fetch(self, index: PrefixIndex, page_map: PageMap, slot: int, tokens: Sequence[int], have: int) -> int:
        """Fill blocks `have`.. of a slot just taken (its first `have` blocks mapped from the local index) from
        the store: the leading blocks whose every page is published, within what a hit may map
        (index.usable_pages). Returns the number of blocks the slot holds now. All or nothing on error: the
        pages mapped here are unmapped again and the error raised."""
        self.give_back_unused(index)
        self._check_read_faults()
        windows = [w for _, w in index.keys(tokens)]
        if len(windows) <= have:
            return have
        block_keys = self.block_keys(windows)
        keys = self._keys_of(block_keys[have:])
        try:
            whole = self.store.match(keys) // self.runs
            wanted = index.usable_pages(have + whole) - have
            if wanted <= 0:
                return have
            return self._fill(index, page_map, slot, block_keys, keys, have, wanted)
        except StoreError:
            # A corrupt page, a truncated file, a lost lease: the store is not worth failing a request for. The
            # slot is as it was (map_new_with undoes itself); the caller computes those tokens.
            self.stats.faults += 1
            return have

    def _fill(self, index, page_map, slot, block_keys, keys, have: int, wanted: int) -> int:
        handles = self.store.pin(keys[: wanted * self.runs])
        got = len(handles) // self.runs  # a page evicted since match(): stop at the block before it
        got = index.usable_pages(have + got) - have
        if got <= 0:
            for h in handles:
                h.release()
            return have
        if self.maps:
            return self._map(index, page_map, slot, block_keys, handles, have, got)
        try:
            # Run-major, as page_indices lists them: run r's pages of blocks have..have+got-1.
            data = [handles[d * self.runs + r].read() for r in range(self.runs) for d in range(got)]
            try:
                page_map.map_new_with(slot, have, have + got, data)
            except OutOfPagesError:
                self.stats.short += 1
                return have  # the pool has no room for them now: the caller computes those tokens
        finally:
            for h in handles:
                h.release()
        self._known.update(block_keys[: have + got])
        s = self.stats
        s.hit_pages += got * self.runs
        s.copied_bytes += got * self.runs * self.page_size
        s.hit_tokens += index.tokens_in(have + got) - index.tokens_in(have)
        return have + got

    def _map(self, index, page_map, slot, block_keys, handles, have: int, got: int) -> int:
        """_fill by mapping: the pinned pages of blocks have..have+got-1 (block-major in handles) mapped into the
        slot, the ones new to this process attached (the link keeps their pins) and checked where they are mapped.
        All or nothing: on error the slot is mapped up to `have` again."""
        used = handles[: got * self.runs]
        for h in handles[got * self.runs :]:
            h.release()
        new = [h for h in used if h.key not in self._mapped]
        for h in used:
            if h.key in self._mapped:
                h.release()  # the pin the link holds already covers it
        try:
            ids = self.pool.attach_file_pages(self.store.data_fd, [h.offset for h in new]) if new else []
        except (StoreError, InvalidArgumentError, MappingLimitError, BackendError):
            # The data file cut short (an offset past its end), out of descriptors: computed instead.
            for h in new:
                h.release()
            self.stats.faults += 1
            return have
        for h, page in zip(new, ids):
            self._mapped[h.key] = (page, h)
        runs, ps = self.runs, self.page_size
        pages = [self._mapped[used[d * runs + r].key][0] for r in range(runs) for d in range(got)]  # run-major
        try:
            page_map.map_borrowed(slot, have, have + got, pages)
        except (OutOfPagesError, MappingLimitError, BackendError):
            self._drop([h.key for h in new])
            self.stats.faults += 1
            return have
        # Checked in place (a read through the range, no copy): the file may have been overwritten outside vpaged.
        fresh = {h.key for h in new}
        indices = page_map.page_indices(slot, have, have + got)
        base = page_map.range.address
        bad = False
        for r in range(runs):
            for d in range(got):
                h = used[d * runs + r]
                if h.key in fresh:
                    at = base + indices[r * got + d] * ps
                    bad |= zlib.crc32((ctypes.c_char * ps).from_address(at)) != h.crc
        if bad or self._check_read_faults():
            page_map.unmap_tail(slot, have)
            self._drop([h.key for h in new])
            self.stats.faults += 1
            return have
        self._known.update(block_keys[: have + got])
        s = self.stats
        s.hit_pages += got * runs
        s.mapped_bytes += got * runs * ps
        s.mapped_pages = len(self._mapped)
        s.hit_tokens += index.tokens_in(have + got) - index.tokens_in(have)
        return have + got

    def _check_read_faults(self) -> bool:
        """Whether reads of mapped store pages faulted since last asked (their data file was cut short): the link
        then stops mapping (later hits copy, and fail their checks while the file is damaged)."""
        if not self.maps:
            return False
        now = self.pool.file_page_faults
        if now == self._read_faults_seen:
            return False
        self.stats.read_faults += now - self._read_faults_seen
        self._read_faults_seen = now
        self.maps = False
        return True

    def _drop(self, keys) -> None:
        """Give back the link's reference and pin of the mapped store pages of `keys`."""
        for key in keys:
            page, handle = self._mapped.pop(key)
            self.pool.decref([page])
            handle.release()
        self.stats.mapped_pages = len(self._mapped)

    def give_back_unused(self, index: PrefixIndex | None = None) -> int:
        """Give back the mapped store pages no sequence maps any more: first the blocks of the local `index`
        made only of such pages are evicted from it (see the module note), then every page left with only the
        link's reference loses its pin, so the store may evict it. Returns how many pages went."""
        if not self._mapped:
            return 0
        refcount = self.pool.refcount
        if index is not None:
            ours = {page for page, _ in self._mapped.values()}
            for block in index.blocks():
                if block.pages[0] in ours and all(p in ours and refcount(p) == 2 for p in block.pages):
                    index.evict(block)  # held by the index and the link only
        unused = [key for key, (page, _) in self._mapped.items() if refcount(page) == 1]
        self._drop(unused)
        return len(unused)

    # ---------------------------------------------------------------------------------------------- publish
    def publish(self, index: PrefixIndex, page_map: PageMap, slot: int, tokens: Sequence[int], blocks: int) -> int:
        """Publish every page of the slot's first `blocks` blocks that the store lacks (their K/V written).
        Returns the pages published. A full store (every page pinned or being written) is counted, not an
        error: the local cache works on without it."""
        self.give_back_unused(index)
        windows = [w for _, w in index.keys(tokens)][:blocks]
        if not windows:
            return 0
        block_keys = self.block_keys(windows)
        published = 0
        try:
            todo = self._unknown_blocks(block_keys)
            if todo:
                published = self._publish_blocks(page_map, slot, block_keys, todo)
        except StoreError:  # a damaged store, a lost lease: the local cache works on without it
            self.stats.faults += 1
        return published

    def _unknown_blocks(self, block_keys: list[bytes]) -> list[int]:
        """The depths of the blocks the store may lack; those it holds whole become known."""
        todo = []
        for depth, block_key in enumerate(block_keys):
            if block_key in self._known:
                continue
            if self.store.match(self._keys_of([block_key])) == self.runs:
                self._known.add(block_key)
                self.stats.present_pages += self.runs
            else:
                todo.append(depth)
        return todo

    def _publish_blocks(self, page_map: PageMap, slot: int, block_keys: list[bytes], todo: list[int]) -> int:
        """Publish the blocks at depths `todo`, a batch of whole blocks per PageStore.publish_many. On the host a
        page is handed to the store where the range maps it (the store copies it into its data file); a device's
        pages are copied to a host buffer first. Stops at a full store, the blocks after a missing one being of
        no use (a hit needs every block before it)."""
        runs, ps = self.runs, self.page_size
        host = self.publishes_in_place
        page_map.range.wait_for_streams()  # CUDA: the kernels that wrote the K/V finish before it is read
        per_batch = max(1, PUBLISH_BATCH_BYTES // (runs * ps))
        staging = None if host else np.empty((min(per_batch, len(todo)) * runs, ps), dtype=np.uint8)
        published = 0
        for at in range(0, len(todo), per_batch):
            depths = todo[at : at + per_batch]
            keys = self._keys_of([block_keys[d] for d in depths])  # block-major, one page per run
            if host:
                base = page_map.range.address
                data = [
                    (ctypes.c_char * ps).from_address(base + i * ps)
                    for d in depths
                    for i in page_map.page_indices(slot, d, d + 1)
                ]
            else:
                for row, page in zip(staging, [p for d in depths for p in page_map.pages(slot, d, d + 1)]):
                    page_map.pool.copy_to_host(page, row.ctypes.data)
                page_map.pool.synchronize()
                data = list(staging)
            try:
                outcomes = self.store.publish_many(list(zip(keys, data)))
            except StoreFullError:  # the data file has no room for a page's bytes (ENOSPC)
                self.stats.full += 1
                break
            done = outcomes.count(PUBLISHED)
            published += done
            self.stats.published_pages += done
            self.stats.present_pages += outcomes.count(PRESENT)
            for j, d in enumerate(depths):
                if FULL not in outcomes[j * runs : (j + 1) * runs]:
                    self._known.add(block_keys[d])
            if FULL in outcomes:  # every page pinned or being written
                self.stats.full += 1
                break
        return published

    def close(self) -> None:
        """Every mapped page given back (the cache unmapped its ranges first), then the store closed."""
        try:
            if self._mapped:
                self._drop(list(self._mapped))
        finally:
            self.store.close()


def cache_fingerprint(
    weights: str, geometry, layout_name: str, page_size: int, kv_format, kv_scales
) -> StoreFingerprint:
    """The fingerprint of a cache's pages: the weights' identity (the caller's), the KV geometry, the layout,
    the page size, the KV format and its scales' values (fp8: a digest of the per-layer scales; "calibrate"
    scales are set by what is written first, so such a cache cannot share pages and is refused)."""
    if not isinstance(weights, str) or not weights:
        raise InvalidArgumentError(
            "a cache with a prefix_store needs prefix_store_weights: a string naming the model weights (a name with "
            "its revision, or a digest), so pages of another model never hit"
        )
    scales = ""
    if kv_scales is not None:
        values = kv_scales.detach().to("cpu").contiguous().numpy()
        if np.isnan(values).any():
            raise InvalidArgumentError(
                'a prefix_store needs fixed kv_scales: "calibrate" sets them from the first writes, so pages of two '
                "caches would not agree"
            )
        scales = hashlib.blake2b(values.astype("<f4").tobytes(), digest_size=16).hexdigest()
    return StoreFingerprint(
        weights=weights,
        num_layers=geometry.num_layers,
        num_kv_heads=geometry.num_kv_heads,
        head_dim=geometry.head_dim,
        layout=layout_name,
        page_bytes=page_size,
        kv_format=f"{kv_format.name}:{geometry.dtype}",
        scales=scales,
        extra=(("v_head_dim", str(geometry.v_head_dim)),),
    )
