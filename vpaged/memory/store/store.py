"""PageStore: a named, content-addressed store of KV pages that processes share through files they own.

Note (what a store does now). A store keeps up to capacity_pages pages of page_bytes each, keyed by the chain keys
of fingerprint.py. publish(key, data) makes a page visible atomically (index.py's state machine): a writer reserves
a free slot by compare-and-swap (or evicts the least recently used unpinned page), writes the key, checks that no
other slot holds or is writing the same key (one of two concurrent publishers of a key gives its slot back; if each
sees the other, both do), writes the bytes into the data file, its crc32, then publishes by one compare-and-swap;
publish_many(pages) does the same for a batch, reading the slot table (capacity x 64 bytes) twice in all instead of
twice a page. match(keys) counts the leading keys present; pin(keys) pins them and returns handles with each page's
data offset, so the page can be read (verified against its crc32) and, later, mapped read-only at that offset. A
process's pins are one bit in each page's pin word plus counts in its own memory; a dead process's bits and
half-written slots go back through reclaim.py. Everything shared lives in the index file, touched only through a
vpaged._C.LedgerMapping; page bytes are written with pwrite (a full tmpfs is ENOSPC, an error, not a SIGBUS) and
read through a second LedgerMapping of the data file (a truncated file is a typed error, not a SIGBUS).

Lookups: each process keeps a dict key -> slot built from one read of the slot table, valid while the store's
publish counter has not moved; every hit is re-checked against the slot's state word and record crc, so a
stale dict entry is a miss, never a wrong page.

A cache maps pinned pages into its ranges at their offsets in the data file (kvcache/virtual/store_link.py).
"""

from __future__ import annotations

import os
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Sequence

import numpy as np

from ... import _C
from ...errors import (
    InvalidArgumentError,
    StoreCorruptError,
    StoreError,
    StoreFullError,
    StoreLeaseLostError,
    StoreMismatchError,
    StoreNotFoundError,
    StorePermissionError,
)
from ..budget.liveness import boottime_ns
from . import clients as cl
from . import index as ix
from . import layout as lay
from .location import StoreLocation, check_mode, check_owner, resolve
from .reclaim import ReclaimCounts, clear_pins, reclaim_pass, release_slots
from .stats import Counters, StoreStats

PUBLISHED, PRESENT, RACED, FULL = "published", "present", "raced", "full"
LEASE_S = 10.0

# Test hook: called with "evicting" (a published page is EVICTING, its pins not yet re-read), "reserved" (a slot
# is WRITING, its key written), "written" (its bytes are in the data file) and "signed" (its checksums written,
# before the publishing compare-and-swap); tests kill the process there to show that a publish cut at any step
# leaves nothing visible, nothing leaked and no published page lost. None in production.
publish_hook: Callable[[str], None] | None = None


class PinnedPage:
    """One pinned page: it stays published (never evicted, never changed) until release(). offset: where its
    bytes lie in the store's data file (a multiple of the OS page); nbytes: the store's page_bytes."""

    __slots__ = ("store", "key", "slot", "offset", "nbytes", "crc", "_state", "_released", "__weakref__")

    def __init__(self, store: PageStore, key: bytes, slot: int, state: int, crc: int):
        self.store, self.key, self.slot, self.crc, self._state = store, key, slot, crc, state
        self.offset, self.nbytes = slot * store.page_bytes, store.page_bytes
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    def read(self, verify: bool = True) -> bytes:
        """The page's bytes, through the guarded mapping; verify: check them against the crc32 recorded at
        publish (StoreCorruptError if they differ)."""
        if self._released:
            raise InvalidArgumentError(f"page handle of slot {self.slot} was released")
        return self.store._read_page(self, verify)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.store._release(self)

    def __enter__(self) -> PinnedPage:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"PinnedPage(slot={self.slot}, offset={self.offset}, key={self.key.hex()[:16]}…)"


class PageStore:
    """An open page store (see the module's Note). Open one per process with PageStore.open(); a forked child
    opens its own."""

    def __init__(self, location: StoreLocation, index_fd: int, data_fd: int, header: lay.Header, data_path: str):
        self.location, self.header, self.data_path = location, header, data_path
        self._index_fd, self._data_fd = index_fd, data_fd
        self._pid = os.getpid()
        self._lock = threading.RLock()
        self._closed = False
        self._lost = False
        self.lease_ns = header.lease_ms * 1_000_000
        self._index_size = lay.index_bytes(header.capacity)
        self._imap = _C.LedgerMapping(index_fd, self._index_size)
        try:
            self._dmap = _C.LedgerMapping(data_fd, header.data_bytes)
        except BaseException:
            self._imap.close()
            raise
        self.slots = ix.SlotTable(self._imap, header.capacity)
        self.clients = cl.ClientTable(self._imap, self.lease_ns)
        self.counters = Counters(self._imap)
        self._pins: dict[int, list[int]] = {}  # slot -> [published state word, count of handles]
        self._keys: dict[bytes, int] = {}
        self._keys_seq = -1
        self._stop = threading.Event()
        try:
            self._join()
        except BaseException:
            self._unmap()
            raise
        self._renewer = threading.Thread(
            target=_renew_loop, args=(weakref.ref(self), self._stop), name="vpaged-store-lease", daemon=True
        )
        self._renewer.start()

    # ----------------------------------------------------------------------------------- open, create, remove
    @classmethod
    def open(
        cls,
        name_or_path: str,
        *,
        create: bool = False,
        capacity_pages: int | None = None,
        page_bytes: int | None = None,
        mode: int = 0o600,
        lease_s: float = LEASE_S,
    ) -> PageStore:
        """Open the store `name_or_path` ("NAME": in /dev/shm; "dir:PATH": files under PATH). create: make it
        when it does not exist (capacity_pages and page_bytes then required; mode 0o600, or 0o660 to share it
        with the owner's group; lease_s: how long a stopped process keeps its pins). capacity_pages / page_bytes
        given for an existing store must be its own (StoreMismatchError)."""
        location = resolve(name_or_path)
        if create:
            check_mode(mode)
            lease_ms = int(round(float(lease_s) * 1000))
            if not 100 <= lease_ms <= 3_600_000:
                raise InvalidArgumentError(f"a store's lease is 0.1 to 3600 s, got {lease_s!r}")
            if capacity_pages is None or page_bytes is None:
                raise InvalidArgumentError("creating a store needs capacity_pages and page_bytes")
            lay.check_geometry(capacity_pages, page_bytes)
        for _ in range(50):
            try:
                index_fd = os.open(location.index_path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:
                if not create:
                    raise StoreNotFoundError(
                        f"no page store {name_or_path!r} ({location.index_path}): open it with create=True"
                    ) from None
                _create(location, capacity_pages, page_bytes, mode, lease_ms)
                continue
            except PermissionError:
                raise StorePermissionError(
                    f"store {name_or_path!r}: {location.index_path} cannot be opened by uid {os.geteuid()}"
                ) from None
            except OSError as e:  # O_NOFOLLOW on a symlink: ELOOP
                raise StorePermissionError(f"store {name_or_path!r}: {location.index_path}: {e.strerror}") from None
            return _open_fd(cls, location, index_fd, capacity_pages, page_bytes)
        raise StoreError(f"store {name_or_path!r} kept being removed while being opened")

    @staticmethod
    def remove(name_or_path: str) -> bool:
        """Unlink the store's files (processes that have it open keep using their copy until they close it);
        False when there was none."""
        location = resolve(name_or_path)
        found = False
        for path in [location.index_path, *location.all_data_paths()]:
            try:
                os.unlink(path)
                found = True
            except FileNotFoundError:
                pass
            except PermissionError:
                raise StorePermissionError(f"store {name_or_path!r}: {path} cannot be removed by this user") from None
        return found

    @staticmethod
    def exists(name_or_path: str) -> bool:
        return os.path.exists(resolve(name_or_path).index_path)

    # ---------------------------------------------------------------------------------------------- figures
    @property
    def name(self) -> str:
        return self.location.spec

    @property
    def page_bytes(self) -> int:
        return self.header.page_bytes

    @property
    def capacity_pages(self) -> int:
        return self.header.capacity

    @property
    def data_fd(self) -> int:
        """The data file's descriptor: page `slot` lies at offset slot * page_bytes (for a read-only mapping)."""
        self._usable()
        return self._data_fd

    @property
    def client_index(self) -> int:
        return self._me

    @property
    def closed(self) -> bool:
        return self._closed

    def stats(self) -> StoreStats:
        with self._lock:
            self._usable()
            snap = self.slots.snapshot()
            kinds = snap["state"] & np.uint64(3)
            visible = (kinds == ix.PUBLISHED) | (kinds == ix.EVICTING)
            c = self.counters.all()
            live = sum(1 for r in self.clients.records() if r.kind == cl.LIVE)
            return StoreStats(
                capacity_pages=self.capacity_pages, page_bytes=self.page_bytes,
                used_pages=int(np.count_nonzero(kinds != ix.FREE)), published_pages=int(np.count_nonzero(visible)),
                writing_pages=int(np.count_nonzero(kinds == ix.WRITING)),
                pinned_pages=int(np.count_nonzero(visible & (snap["pins"] != 0))), clients=live,
                hits=c["hits"], misses=c["misses"], published=c["published"], duplicates=c["duplicates"],
                evictions=c["evictions"], reclaimed_writing=c["reclaimed_writing"],
                reclaimed_pins=c["reclaimed_pins"], reclaimed_clients=c["reclaimed_clients"],
                fenced_clients=c["fenced_clients"],
            )  # fmt: skip

    def processes(self) -> list[tuple[int, int]]:
        """(pid, pages pinned) of every other process with the store open (as its own PID namespace sees it)."""
        with self._lock:
            self._usable()
            return [(r.pid, r.pinned) for r in self.clients.records() if r.kind == cl.LIVE and r.index != self._me]

    # ---------------------------------------------------------------------------------------------- lookup
    def match(self, keys: Sequence[bytes]) -> int:
        """How many of `keys`, from the first, are published now (a probe: no pins, no counters, no LRU touch)."""
        keys = _check_keys(keys)
        with self._lock:
            self._usable()
            return len(self._leading(keys, self._published))

    def pin(self, keys: Sequence[bytes]) -> list[PinnedPage]:
        """Pin the leading `keys` that are published (stopping at the first that is not): one handle each,
        released by handle.release() (or close()). Counts hits (pages pinned) and misses (the rest of keys)."""
        keys = _check_keys(keys)
        with self._lock:
            self._usable()
            handles: list[PinnedPage] = self._leading(keys, self._pin_slot)
            # Deepest first, so a prefix's first pages are the most recently used: eviction takes a chain's
            # tail before its head (a head's loss makes every page after it unreachable).
            for handle in reversed(handles):
                self.slots.touch(handle.slot, self.counters.add("clock"))
            if handles:
                self.counters.add("hits", len(handles))
            if len(keys) > len(handles):
                self.counters.add("misses", len(keys) - len(handles))
            return handles

    def _leading(self, keys: list[bytes], act: Callable[[int, bytes], object]) -> list:
        """act(slot, key) for the leading keys found, stopping at the first where it gives None. The key ->
        slot dict is read again from the slot table only on a miss, and only when something was published
        since it was read (a hit costs no table read, however busy the publishers)."""
        out, refreshed = [], False
        for key in keys:
            while True:
                slot = self._keys.get(key)
                got = None if slot is None else act(slot, key)
                if got is not None or refreshed:
                    break
                refreshed = True
                if not self._refresh_keys():
                    break
            if got is None:
                break
            out.append(got)
        return out

    def _refresh_keys(self) -> bool:
        """Read the key -> slot dict again if anything was published since it was read; whether it was."""
        seq = self.counters.get("publish_seq")
        if seq == self._keys_seq:
            return False
        snap = self.slots.snapshot()
        published = np.flatnonzero((snap["state"] & np.uint64(3)) == ix.PUBLISHED)[::-1]  # a duplicate: lowest wins
        self._keys = dict(zip(snap["key"][published].tolist(), published.tolist()))
        self._keys_seq = seq
        return True

    def _published(self, slot: int, key: bytes) -> tuple[int, int] | None:
        """(state word, data crc) when slot holds `key` published now, else None."""
        state = self.slots.state(slot)
        if ix.kind_of(state) != ix.PUBLISHED:
            return None
        meta = self.slots.read_meta(slot, ix.generation_of(state))
        if meta is None or meta[0] != key or self.slots.state(slot) != state:
            return None
        return state, meta[1]

    def _pin_slot(self, slot: int, key: bytes) -> PinnedPage | None:
        got = self._published(slot, key)
        if got is None:
            return None
        state, crc = got
        mine = self._pins.get(slot)
        if mine is not None and mine[0] == state:
            mine[1] += 1
        else:
            bit = 1 << self._me
            self.slots.set_pin(slot, bit)
            # The re-read after the bit is set: an evictor that moved the slot meanwhile sees the bit or we see
            # its EVICTING (index.py's Note).
            if self.slots.state(slot) != state:
                if mine is None:
                    self.slots.clear_pin(slot, bit)
                return None
            self._pins[slot] = [state, 1]
            self.clients.set_pinned(self._me, len(self._pins))
        return PinnedPage(self, key, slot, state, crc)

    def _release(self, handle: PinnedPage) -> None:
        with self._lock:
            mine = self._pins.get(handle.slot)
            if mine is None or mine[0] != handle._state or self._closed or self._lost or os.getpid() != self._pid:
                return
            mine[1] -= 1
            if mine[1] == 0:
                del self._pins[handle.slot]
                self.slots.clear_pin(handle.slot, 1 << self._me)
                self.clients.set_pinned(self._me, len(self._pins))

    def _read_page(self, handle: PinnedPage, verify: bool) -> bytes:
        with self._lock:
            self._usable()
            data = self._dmap.read(handle.offset, handle.nbytes)
            self._check_files()  # an access that faulted (truncated) read zeros: refuse them
            if verify and zlib.crc32(data) != handle.crc:
                raise StoreCorruptError(
                    f"store {self.name!r}: the page in slot {handle.slot} fails its checksum (its data file "
                    f"{self.data_path} was overwritten outside vpaged): remove the store and create it again"
                )
            return data

    # ---------------------------------------------------------------------------------------------- publish
    def publish(self, key: bytes, data) -> str:
        """Make `data` (exactly page_bytes, any bytes-like object) the page of `key`, visible to every process
        at once and whole. Returns PUBLISHED, PRESENT (the key was published already; nothing written) or
        RACED (another process is publishing the same key right now; nothing written). StoreFullError when
        every page is pinned or being written."""
        outcome = self.publish_many([(key, data)])[0]
        if outcome == FULL:
            raise StoreFullError(
                f"store {self.name!r}: all {self.capacity_pages} pages are pinned or being written; nothing was "
                "published"
            )
        return outcome

    def publish_many(self, pages: Sequence[tuple[bytes, object]]) -> list[str]:
        """publish() of several (key, data) pages at once: an outcome for each, in order, FULL for those the
        store found no free or evictable slot for (the others are published all the same). A key given twice
        is published once; its later places say PRESENT. Each page becomes visible on its own, whole, as with
        publish(). The batch reads the slot table (capacity x 64 bytes) twice in all, where publishing its pages
        one by one reads it twice per page, a cost that grows with the capacity (bench_store_publish.py). StoreFullError
        only when the data file has no room for a page's bytes (ENOSPC): the pages before it stay published,
        that one and those after it are not."""
        keys = _check_keys([key for key, _ in pages])
        views = [self._page_view(data) for _, data in pages]
        outcomes: list[str | None] = [None] * len(keys)
        first: dict[bytes, int] = {}
        for i, key in enumerate(keys):
            first.setdefault(key, i)
        with self._lock:
            self._usable()
            snap = self.slots.snapshot()
            # Keys held or being written elsewhere are settled before reserving, which could evict a page for nothing.
            held = _kinds_of(snap, first, {})
            todo = []
            for key, i in first.items():
                other = _settled(held.get(key))
                if other is None:
                    todo.append(i)
                else:
                    outcomes[i] = other
            reserved = self._reserve_many(snap, len(todo))
            for i in todo[len(reserved) :]:
                outcomes[i] = FULL
            mine = {keys[i]: (i, slot, writing) for i, (slot, writing) in zip(todo, reserved)}
            try:
                self._write_many(mine, views, outcomes)
            except BaseException:
                for i, slot, writing in mine.values():
                    if outcomes[i] is None:  # reserved, not published
                        self._give_back(slot, writing)
                raise
        for i, key in enumerate(keys):
            if outcomes[i] is None:  # a later place of a key given twice
                outcomes[i] = PRESENT if outcomes[first[key]] in (PUBLISHED, PRESENT) else outcomes[first[key]]
        duplicates = outcomes.count(PRESENT)
        if duplicates:
            self.counters.add("duplicates", duplicates)
        return outcomes  # type: ignore[return-value]

    def _page_view(self, data) -> memoryview:
        view = memoryview(data).cast("B")
        if view.nbytes != self.page_bytes:
            raise InvalidArgumentError(f"a page of store {self.name!r} is {self.page_bytes} bytes, got {view.nbytes}")
        return view

    def _write_many(self, mine: dict[bytes, tuple[int, int, int]], views: list[memoryview], outcomes: list) -> None:
        """Write and publish the pages of the slots reserved for them (mine: key -> (place, slot, WRITING word)),
        settling each outcome: their keys first, then, after one full barrier, one look for each key in another
        slot (index.py's Note: of two publishers of a key, at least one sees the other's key), then each page's
        bytes, its checksums and the publishing compare-and-swap."""
        for key, (_, slot, _) in mine.items():
            self.slots.write_key(slot, key)
        stamp = self.counters.add("clock")  # a full barrier after the keys (index.py's Note)
        for _, slot, _ in mine.values():
            self.slots.touch(slot, stamp)
        ours = {slot: key for key, (_, slot, _) in mine.items()}
        elsewhere = _kinds_of(self.slots.snapshot(), mine, ours) if mine else {}
        for key, (i, slot, writing) in mine.items():
            other = elsewhere.get(key)
            if other is not None:
                outcomes[i] = PRESENT if other == ix.PUBLISHED else RACED
                self._give_back(slot, writing)
                continue
            if publish_hook is not None:
                publish_hook("reserved")
            self._write_bytes(slot, views[i])
            if publish_hook is not None:
                publish_hook("written")
            published = ix.word(ix.PUBLISHED, 0, ix.generation_of(writing) + 1)
            self.slots.write_meta(slot, key, zlib.crc32(views[i]), ix.generation_of(published))
            if publish_hook is not None:
                publish_hook("signed")
            if not self.slots.cas(slot, writing, published):
                self._lost = True
                raise StoreLeaseLostError(
                    f"store {self.name!r}: this process's half-written page was reclaimed (its lease ran out): "
                    "reopen the store"
                )
            outcomes[i] = PUBLISHED
            self.counters.add("publish_seq")
            self.counters.add("published")

    def _give_back(self, slot: int, writing: int) -> None:
        """A slot this process reserved (WRITING) and will not publish goes back FREE, one generation on (a no-op
        when the reclaimer took it already)."""
        self.slots.cas(slot, writing, ix.word(ix.FREE, 0, ix.generation_of(writing) + 1))

    def _write_bytes(self, slot: int, view: memoryview) -> None:
        offset = slot * self.page_bytes
        try:
            done = 0
            while done < view.nbytes:
                done += os.pwrite(self._data_fd, view[done:], offset + done)
        except OSError as e:
            raise StoreFullError(
                f"store {self.name!r}: no room for a page's bytes in {self.data_path} ({e.strerror}); that page and "
                "those after it in the batch were not published"
            ) from None

    def _reserve_many(self, snap: np.ndarray, n: int) -> list[tuple[int, int]]:
        """Up to n (slot, its WRITING word) this process now writes: free slots first, then the least recently
        used unpinned pages, evicted (snap: the slot table as just read). Fewer than n when the rest of the
        store is pinned or being written."""
        got: list[tuple[int, int]] = []
        for attempt in range(3):
            if len(got) == n:
                break
            if attempt:
                snap = self.slots.snapshot()
            states = snap["state"]
            kinds = states & np.uint64(3)
            for slot in np.flatnonzero(kinds == ix.FREE):
                if len(got) == n:
                    return got
                old = int(states[slot])
                new = ix.word(ix.WRITING, self._me, ix.generation_of(old) + 1)
                if self.slots.cas(int(slot), old, new):
                    got.append((int(slot), new))
            candidates = np.flatnonzero((kinds == ix.PUBLISHED) & (snap["pins"] == 0))
            for slot in candidates[np.argsort(snap["last_use"][candidates], kind="stable")]:
                if len(got) == n:
                    return got
                writing = self._evict(int(slot), int(states[slot]))
                if writing is not None:
                    got.append((int(slot), writing))
            if len(got) < n:
                if attempt == 0:
                    self._reclaim()
                else:
                    time.sleep(0.01)
        return got

    def _evict(self, slot: int, published: int) -> int | None:
        evicting = ix.word(ix.EVICTING, self._me, ix.generation_of(published))
        if not self.slots.cas(slot, published, evicting):
            return None
        if publish_hook is not None:
            publish_hook("evicting")
        if self.slots.pins(slot) != 0:  # a reader pinned it after our read: it stays
            self.slots.cas(slot, evicting, published)
            return None
        writing = ix.word(ix.WRITING, self._me, ix.generation_of(published) + 1)
        if not self.slots.cas(slot, evicting, writing):
            return None
        self.counters.add("evictions")
        return writing

    # ---------------------------------------------------------------------------------------------- upkeep
    def reclaim(self) -> ReclaimCounts:
        """Run a reclaim pass now (the lease thread runs one every clients.RENEW_S)."""
        with self._lock:
            self._usable()
            return self._reclaim()

    def _reclaim(self) -> ReclaimCounts:
        return reclaim_pass(self.clients, self.slots, self.counters, self._me, self.lease_ns)

    def verify(self) -> int:
        """Read every published page and check it against its crc32; the number checked. StoreCorruptError
        names the first that fails."""
        with self._lock:
            self._usable()
            snap = self.slots.snapshot()
            checked = 0
            for slot in np.flatnonzero((snap["state"] & np.uint64(3)) == ix.PUBLISHED):
                slot = int(slot)
                state = self.slots.state(slot)
                if ix.kind_of(state) != ix.PUBLISHED:
                    continue
                meta = self.slots.read_meta(slot, ix.generation_of(state))
                if meta is None:
                    raise StoreCorruptError(f"store {self.name!r}: slot {slot}'s record fails its checksum")
                data = self._dmap.read(slot * self.page_bytes, self.page_bytes)
                self._check_files()
                if self.slots.state(slot) == state and zlib.crc32(data) != meta[1]:
                    raise StoreCorruptError(f"store {self.name!r}: the page in slot {slot} fails its checksum")
                checked += 1
            return checked

    def renew(self) -> bool:
        """Renew this process's lease (the lease thread does); False once it was lost."""
        with self._lock:
            if self._closed or self._lost or os.getpid() != self._pid:
                return False
            self._check_files()
            if not self.clients.renew(self._me, self._live):
                self._lost = True
            return not self._lost

    def close(self) -> None:
        """Drop this process's pins and its client record, and close the files (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._stop.set()
            try:
                if os.getpid() == self._pid:
                    self._check_files()  # a truncated index: nothing of it to give back
                    self._leave()
            except StoreCorruptError:
                pass
            finally:
                self._unmap()
        if self._renewer is not threading.current_thread():
            self._renewer.join(timeout=2 * cl.RENEW_S + 1)

    def __enter__(self) -> PageStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"PageStore({self.name!r}, {self.capacity_pages} pages of {self.page_bytes} bytes)"

    # ---------------------------------------------------------------------------------------------- internals
    def _join(self) -> None:
        self._check_files()
        got = self.clients.join()
        if got is None:
            reclaim_pass(self.clients, self.slots, self.counters, None, self.lease_ns)
            got = self.clients.join()
        if got is None:
            raise StoreFullError(
                f"store {self.name!r}: all {lay.MAX_CLIENTS} client records are taken by live processes"
            )
        self._me, self._live = got
        self._reclaim()

    def _leave(self) -> None:
        me, bit = self._me, 1 << self._me
        for slot in list(self._pins):
            self.slots.clear_pin(slot, bit)
        self._pins.clear()
        state = self.clients.state(me)
        if state == self._live or cl.kind_of(state) == cl.FENCED:
            claim = cl.word(cl.RECLAIMING, boottime_ns())
            if self.clients.cas(me, state, claim):
                clear_pins(self.slots, me)
                release_slots(self.slots, me)
                self.clients.cas(me, claim, cl.FREE)

    def _unmap(self) -> None:
        self._dmap.close()
        self._imap.close()
        for fd in (self._index_fd, self._data_fd):
            try:
                os.close(fd)
            except OSError:
                pass

    def _usable(self) -> None:
        if self._closed:
            raise StoreError(f"store {self.name!r} is closed in this process")
        if os.getpid() != self._pid:
            raise InvalidArgumentError(
                f"store {self.name!r} was opened by process {self._pid}: a forked process opens the store itself"
            )
        self._check_files()
        if not self._lost and self.clients.state(self._me) != self._live:
            self._lost = True  # fenced (or reclaimed) while this process was stopped
        if self._lost:
            raise StoreLeaseLostError(
                f"store {self.name!r}: this process lost its record (its lease ran out while it was stopped) and "
                "with it its pins: close the store and open it again"
            )

    def _check_files(self) -> None:
        index_size = os.fstat(self._index_fd).st_size
        data_size = os.fstat(self._data_fd).st_size
        if (
            index_size < self._index_size
            or data_size < self.header.data_bytes
            or self._imap.damaged
            or self._dmap.damaged
        ):
            raise StoreCorruptError(
                f"store {self.name!r} was truncated while in use (index {index_size} of {self._index_size} bytes, "
                f"data {data_size} of {self.header.data_bytes}): remove it and create it again"
            )


def _kinds_of(snap: np.ndarray, keys, but: dict[int, bytes]) -> dict[bytes, int]:
    """For each of `keys` that a slot of `snap` holds or is writing (other than the slot `but` maps it to), the
    kind of such a slot, PUBLISHED first, else the lowest. The slots are found by the first 8 bytes of their
    keys (one vectorized look over the table), then compared whole."""
    if not keys:
        return {}
    words = snap.view(np.uint64).reshape(len(snap), -1)[:, ix.KEY_WORD]
    wanted = np.sort(np.frombuffer(b"".join(bytes(k[:8]) for k in keys), dtype=np.uint64))
    near = wanted[np.minimum(np.searchsorted(wanted, words), len(wanted) - 1)]
    kinds = snap["state"] & np.uint64(3)
    found: dict[bytes, int] = {}
    for slot in np.flatnonzero((near == words) & (kinds != ix.FREE)).tolist():
        key = snap["key"][slot].tobytes()
        if key not in keys or but.get(slot) == key:
            continue
        kind = int(kinds[slot])
        if kind == ix.PUBLISHED or key not in found:
            found[key] = kind
        elif found[key] != ix.PUBLISHED:
            found[key] = min(found[key], kind)
    return found


def _settled(kind: int | None) -> str | None:
    """The outcome of publishing a key another slot holds (kind), before this process reserves one: PRESENT when
    it is published, RACED while it is being written; None: go on (absent, or only being evicted)."""
    if kind == ix.PUBLISHED:
        return PRESENT
    if kind == ix.WRITING:
        return RACED
    return None


def _check_keys(keys) -> list[bytes]:
    if isinstance(keys, (bytes, bytearray)):
        raise InvalidArgumentError("keys is a sequence of 32-byte keys, not one key")
    out = []
    for key in keys:
        if not isinstance(key, (bytes, bytearray)) or len(key) != lay.KEY_BYTES:
            raise InvalidArgumentError(f"a store key is {lay.KEY_BYTES} bytes (fingerprint.chain_keys), got {key!r}")
        out.append(bytes(key))
    return out


def _corrupt(location: StoreLocation, path: str, why: str) -> StoreCorruptError:
    return StoreCorruptError(
        f"store {location.spec!r}: {path} {why}: remove it (PageStore.remove({location.spec!r})) and create it again"
    )


def _open_fd(cls, location: StoreLocation, index_fd: int, capacity: int | None, page_bytes: int | None) -> PageStore:
    data_fd = -1
    try:
        st = os.fstat(index_fd)
        check_owner(location.spec, location.index_path, st)
        raw = os.pread(index_fd, lay.HEADER_BYTES, 0)
        header = lay.unpack_header(raw)
        if isinstance(header, str):
            magic, version = lay.header_magic_version(raw) if len(raw) >= 12 else (b"", 0)
            if magic == lay.INDEX_MAGIC and version != lay.VERSION:
                raise StoreMismatchError(f"store {location.spec!r}: {location.index_path} {header}")
            raise _corrupt(location, location.index_path, header)
        if st.st_size != lay.index_bytes(header.capacity):
            raise _corrupt(
                location, location.index_path, f"has {st.st_size} bytes, not {lay.index_bytes(header.capacity)}"
            )
        asked = (capacity if capacity is not None else header.capacity, page_bytes or header.page_bytes)
        if asked != (header.capacity, header.page_bytes):
            raise StoreMismatchError(
                f"store {location.spec!r} holds {header.capacity} pages of {header.page_bytes} bytes, not "
                f"{asked[0]} of {asked[1]}"
            )
        data_path = location.data_path(header.store_id)
        try:
            data_fd = os.open(data_path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise _corrupt(location, data_path, "is missing (the index names it)") from None
        except OSError as e:
            raise StorePermissionError(f"store {location.spec!r}: {data_path}: {e.strerror}") from None
        dst = os.fstat(data_fd)
        check_owner(location.spec, data_path, dst)
        if dst.st_size != header.data_bytes:
            raise _corrupt(location, data_path, f"has {dst.st_size} bytes, not {header.data_bytes}")
        problem = lay.trailer_problem(
            os.pread(data_fd, lay.TRAILER_BYTES, header.data_bytes - lay.TRAILER_BYTES), header
        )
        if problem is not None:
            kind, why = problem
            if kind == "mismatch":
                raise StoreMismatchError(f"store {location.spec!r}: {data_path} {why}")
            raise _corrupt(location, data_path, why)
        return cls(location, index_fd, data_fd, header, data_path)
    except BaseException:
        os.close(index_fd)
        if data_fd >= 0:
            os.close(data_fd)
        raise


def _create(location: StoreLocation, capacity: int, page_bytes: int, mode: int, lease_ms: int) -> None:
    """Write a new store's files, the index linked in last (an opener never sees half a store); returns
    quietly when another process linked its index first (the caller opens that one)."""
    if location.directory is not None:
        os.makedirs(os.path.dirname(location.directory), exist_ok=True)
        try:
            os.mkdir(location.directory)
            os.chmod(location.directory, 0o700 if mode == 0o600 else 0o770)  # a directory made here: the umask aside
        except FileExistsError:
            pass  # the user's own directory keeps its mode
    header = lay.Header(
        page_bytes,
        capacity,
        lease_ms,
        os.geteuid(),
        time.time_ns(),
        os.urandom(16),
        lay.data_bytes(capacity, page_bytes),
    )
    data_path = location.data_path(header.store_id)
    tmp = f"{location.index_path}.{os.getpid()}.{threading.get_ident()}.tmp"
    linked = False
    try:
        fd = os.open(data_path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, mode)
        try:
            os.fchmod(fd, mode)  # the umask may have taken bits away; the mode is the contract
            os.ftruncate(fd, header.data_bytes)
            os.pwrite(fd, lay.pack_trailer(header), header.data_bytes - lay.TRAILER_BYTES)
        finally:
            os.close(fd)
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, mode)
        try:
            os.fchmod(fd, mode)
            os.ftruncate(fd, lay.index_bytes(capacity))
            os.pwrite(fd, header.pack(), 0)
        finally:
            os.close(fd)
        try:
            os.link(tmp, location.index_path)
            linked = True
        except FileExistsError:
            pass  # another creator won: its store is the one
    except PermissionError:
        raise StorePermissionError(
            f"store {location.spec!r}: cannot create files beside {location.index_path}"
        ) from None
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if not linked:
            try:
                os.unlink(data_path)
            except FileNotFoundError:
                pass


def _renew_loop(store_ref, stop: threading.Event) -> None:
    while not stop.wait(cl.RENEW_S):
        store = store_ref()
        if store is None:
            return
        try:
            if not store.renew():
                return
            with store._lock:
                if store._closed:
                    return
                store._reclaim()
        except (StoreError, RuntimeError, IndexError):  # damaged or closed under us: the calls say so
            return
        finally:
            del store
