"""The KV page store (vpaged/memory/store/) in one process and a few forked ones: keys and fingerprints,
publish / match / pin against an independent model, LRU eviction order, duplicate publishes racing, bad
input, permissions, and a directory store reopened by new processes. Faults (SIGKILL, truncation,
overwritten files): test_page_store_faults.py."""

import hashlib
import mmap
import os
import random
import select
import signal
import stat
import traceback
import uuid

import pytest

from vpaged.errors import (
    InvalidArgumentError,
    StoreFullError,
    StoreMismatchError,
    StoreNotFoundError,
    StorePermissionError,
)
from vpaged.memory.store import PRESENT, PUBLISHED, RACED, PageStore, StoreFingerprint, chain_keys
from vpaged.memory.store.layout import OS_PAGE

PAGE = OS_PAGE


@pytest.fixture
def store_name():
    name = f"test-{uuid.uuid4().hex[:12]}"
    yield name
    PageStore.remove(name)


def fingerprint(**changes) -> StoreFingerprint:
    fields = dict(
        weights="sha256:" + "ab" * 32, num_layers=2, num_kv_heads=2, head_dim=64, layout="kv", page_bytes=65536,
        kv_format="fp32",
    )  # fmt: skip
    fields.update(changes)
    return StoreFingerprint(**fields)


def page_for(key: bytes, rng: random.Random, page_bytes: int = PAGE) -> bytes:
    """Random bytes ending in a digest of (key, the bytes): a reader checks a page against its key on its own."""
    body = rng.randbytes(page_bytes - 32)
    return body + hashlib.blake2b(key + body, digest_size=32).digest()


def page_is_whole(key: bytes, data: bytes) -> bool:
    return hashlib.blake2b(key + data[:-32], digest_size=32).digest() == data[-32:]


class Child:
    """A forked process running fn(say, *args); say(line) writes a line the parent reads."""

    def __init__(self, fn, *args):
        r, w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            os.close(r)
            code = 0
            try:
                out = os.fdopen(w, "w", buffering=1)
                fn(lambda *words: print(*words, file=out, flush=True), *args)
            except BaseException:
                traceback.print_exc()
                code = 1
            os._exit(code)
        os.close(w)
        self.out = os.fdopen(r)

    def readline(self, timeout: float = 60.0) -> str:
        ready, _, _ = select.select([self.out], [], [], timeout)
        assert ready, f"child {self.pid} said nothing in {timeout} s"
        line = self.out.readline()
        assert line, f"child {self.pid} ended without a word"
        return line.strip()

    def wait(self, timeout: float = 60.0) -> int:
        import time

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.out.close()
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.01)
        os.kill(self.pid, signal.SIGKILL)
        raise AssertionError(f"child {self.pid} still running after {timeout} s")


# --------------------------------------------------------------------------------------------- fingerprints
def test_fingerprint_digest_is_stable_and_names_every_field():
    base = fingerprint()
    # The digest is part of every key a store keeps (a directory store outlives the process): it must not
    # change between runs or releases unnoticed.
    assert base.digest().hex() == "463f78d0c3860bef4e9a269e7f166ace55240b19a1136711218f795890754412"
    assert base.keys(list(range(16)), 16)[0].hex() == (
        "1364418a6bc1d8b75407d0f8f236f8772c24ada721cef79debd80c81291f53bf"
    )
    assert StoreFingerprint(**{**base.__dict__, "extra": (("b", "2"), ("a", "1"))}).digest() == (
        StoreFingerprint(**{**base.__dict__, "extra": {"a": "1", "b": "2"}.items()}).digest()
    )
    changed = [
        fingerprint(weights="sha256:" + "cd" * 32), fingerprint(num_layers=3), fingerprint(num_kv_heads=1),
        fingerprint(head_dim=128), fingerprint(layout="interleaved"), fingerprint(page_bytes=131072),
        fingerprint(kv_format="int8"), fingerprint(scales="per-token:v1"), fingerprint(extra=(("rope", "2"),)),
    ]  # fmt: skip
    digests = {f.digest() for f in changed} | {base.digest()}
    assert len(digests) == len(changed) + 1


def test_chain_keys_chain_the_prefix():
    fp = fingerprint()
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    tokens = [rng.randrange(50000) for _ in range(10 * 16 + 5)]
    keys = fp.keys(tokens, 16)
    assert len(keys) == 10  # the partial page has no key
    parent = fp.digest()
    for i, key in enumerate(keys):  # an independent chain: blake2b(parent, person) over little-endian int64 ids
        h = hashlib.blake2b(parent, digest_size=32, person=b"vpaged-kv-page")
        h.update(b"".join(t.to_bytes(8, "little", signed=True) for t in tokens[i * 16 : (i + 1) * 16]))
        parent = h.digest()
        assert key == parent
    other = list(tokens)
    other[20] += 1  # a change in page 1 changes key 1 and every key after it, never key 0
    changed = fp.keys(other, 16)
    assert changed[0] == keys[0] and all(a != b for a, b in zip(changed[1:], keys[1:]))
    assert chain_keys(fp, [tokens[:16], tokens[16:32]]) == keys[:2]
    with pytest.raises(InvalidArgumentError):
        chain_keys(fp, [[]])
    with pytest.raises(InvalidArgumentError):
        fingerprint(num_layers=0)
    with pytest.raises(InvalidArgumentError):
        fingerprint(weights="")


def test_another_fingerprint_never_hits(store_name):
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    tokens = [rng.randrange(32000) for _ in range(8 * 32)]
    with PageStore.open(store_name, create=True, capacity_pages=64, page_bytes=PAGE) as store:
        mine = fingerprint().keys(tokens, 32)
        for key in mine:
            assert store.publish(key, page_for(key, rng)) == PUBLISHED
        assert store.match(mine) == len(mine)
        for other in (
            fingerprint(kv_format="bf16"), fingerprint(page_bytes=32768), fingerprint(weights="other-model"),
            fingerprint(scales="s"), fingerprint(layout="interleaved"), fingerprint(num_kv_heads=4),
        ):  # fmt: skip
            theirs = other.keys(tokens, 32)
            assert store.match(theirs) == 0
            assert store.pin(theirs) == []
        assert store.stats().hits == 0 and store.stats().misses == 6 * len(mine)


# --------------------------------------------------------------------------------------------- publish, pin
def test_publish_match_pin_against_a_model(store_name):
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    fp = fingerprint()
    capacity = 24
    with PageStore.open(store_name, create=True, capacity_pages=capacity, page_bytes=PAGE) as store:
        assert (store.capacity_pages, store.page_bytes) == (capacity, PAGE)
        prompts = [[rng.randrange(1000) for _ in range(4 * 8)] for _ in range(5)]
        model: dict[bytes, bytes] = {}
        for tokens in prompts:
            for key in fp.keys(tokens, 8):
                data = page_for(key, rng)
                assert store.publish(key, data) == PUBLISHED
                model[key] = data
                assert store.publish(key, page_for(key, rng)) == PRESENT  # immutable: the first bytes stay
        assert len(model) == 20
        for tokens in prompts:
            keys = fp.keys(tokens, 8)
            assert store.match(keys) == 4
            longer = fp.keys(tokens + [7] * 8, 8)
            assert store.match(longer) == 4  # the leading keys present, the new page not
            handles = store.pin(longer)
            assert [h.key for h in handles] == keys
            for h in handles:
                assert h.offset == h.slot * PAGE and h.offset % OS_PAGE == 0 and h.nbytes == PAGE
                assert h.read() == model[h.key] and page_is_whole(h.key, h.read())
                assert os.pread(store.data_fd, PAGE, h.offset) == model[h.key]
                with mmap.mmap(store.data_fd, PAGE, prot=mmap.PROT_READ, offset=h.offset) as m:
                    assert m[:] == model[h.key]  # a read-only mapping at the page's offset sees exactly its bytes
            assert store.stats().pinned_pages == 4
            for h in handles:
                h.release()
            h.release()  # twice: no-op
        s = store.stats()
        assert (s.published_pages, s.used_pages, s.pinned_pages, s.writing_pages) == (20, 20, 0, 0)
        assert (s.hits, s.misses, s.published, s.duplicates, s.evictions) == (20, 5, 20, 20, 0)
        with pytest.raises(InvalidArgumentError):
            handles[0].read()


def test_pins_are_counted_per_handle(store_name):
    rng = random.Random(1)
    key = fingerprint().keys([1] * 8, 8)[0]
    with PageStore.open(store_name, create=True, capacity_pages=1, page_bytes=PAGE) as store:
        store.publish(key, page_for(key, rng))
        a, b = store.pin([key]), store.pin([key])
        a[0].release()
        assert store.stats().pinned_pages == 1  # b still pins it: a publish cannot evict it
        with pytest.raises(StoreFullError):
            store.publish(fingerprint().keys([2] * 8, 8)[0], bytes(PAGE))
        b[0].release()
        assert store.stats().pinned_pages == 0
        assert store.publish(fingerprint().keys([2] * 8, 8)[0], bytes(PAGE)) == PUBLISHED


def test_bad_input_changes_nothing(store_name):
    rng = random.Random(2)
    key = fingerprint().keys([1] * 8, 8)[0]
    with PageStore.open(store_name, create=True, capacity_pages=4, page_bytes=PAGE) as store:
        store.publish(key, page_for(key, rng))
        before = store.stats()
        for bad_key in (b"short", "x" * 32, None):
            with pytest.raises(InvalidArgumentError):
                store.publish(bad_key, bytes(PAGE))
            with pytest.raises(InvalidArgumentError):
                store.match([bad_key])
        with pytest.raises(InvalidArgumentError):
            store.match(key)  # one key, not a list of them
        for size in (0, PAGE - 1, PAGE + 1):
            with pytest.raises(InvalidArgumentError):
                store.publish(os.urandom(32), bytes(size))
        assert store.stats() == before
    for kw in (
        dict(capacity_pages=0, page_bytes=PAGE), dict(capacity_pages=4, page_bytes=PAGE + 8),
        dict(capacity_pages=4, page_bytes=PAGE, mode=0o644), dict(capacity_pages=4), dict(page_bytes=PAGE),
        dict(capacity_pages=4, page_bytes=PAGE, lease_s=0.0),
    ):  # fmt: skip
        with pytest.raises(InvalidArgumentError):
            PageStore.open(f"{store_name}-bad", create=True, **kw)
    assert not PageStore.exists(f"{store_name}-bad")
    for spec in ("", "a/b", "x" * 65, "dir:", 3):
        with pytest.raises(InvalidArgumentError):
            PageStore.open(spec)
    with pytest.raises(StoreNotFoundError):
        PageStore.open(f"{store_name}-none")


def test_open_checks_the_geometry_asked_for(store_name):
    PageStore.open(store_name, create=True, capacity_pages=8, page_bytes=PAGE).close()
    with PageStore.open(store_name, create=True, capacity_pages=8, page_bytes=PAGE) as again:  # existing: opened
        assert again.capacity_pages == 8
    with pytest.raises(StoreMismatchError):
        PageStore.open(store_name, create=True, capacity_pages=16, page_bytes=PAGE)
    with pytest.raises(StoreMismatchError):
        PageStore.open(store_name, page_bytes=2 * PAGE)


def test_a_page_moved_by_eviction_and_republished_is_found_where_it_is_now(store_name):
    """Two openers (two client records, as two processes would have): one's key -> slot dict goes stale when
    the other evicts and publishes again; a hit is always re-checked, so it finds the page where it is now."""
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    keys = [os.urandom(32) for _ in range(5)]
    with (
        PageStore.open(store_name, create=True, capacity_pages=4, page_bytes=PAGE) as a,
        PageStore.open(store_name) as b,
    ):
        assert a.client_index != b.client_index
        for key in keys[:4]:
            a.publish(key, page_for(key, rng))
        assert b.match(keys[:4]) == 4
        slot_of_0 = b.pin(keys[:1])[0]
        slot_of_0.release()
        a.publish(keys[4], page_for(keys[4], rng))  # evicts the least recently used: keys[1]
        assert b.match(keys[1:2]) == 0 and b.match(keys[:1]) == 1
        again = page_for(keys[1], rng)
        a.publish(keys[1], again)  # back, in the slot of the next least recently used (keys[2])
        assert b.match(keys[2:3]) == 0
        [h] = b.pin(keys[1:2])
        assert h.read() == again and h.slot != slot_of_0.slot
        h.release()


# --------------------------------------------------------------------------------------------- eviction
def test_lru_eviction_order_against_a_model(store_name):
    """Random publishes and pins; whenever the store is full, the page evicted is the least recently used
    (published or pinned) of those not pinned, as an independent model of the clock says."""
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    capacity = 6
    with PageStore.open(store_name, create=True, capacity_pages=capacity, page_bytes=PAGE) as store:
        clock = 0
        stamps: dict[bytes, int] = {}  # the model: key -> last use
        held: dict[bytes, list] = {}
        for step in range(300):
            if stamps and rng.random() < 0.45:
                key = rng.choice(list(stamps))
                handles = store.pin([key])
                assert [h.key for h in handles] == [key]
                clock += 1
                stamps[key] = clock
                if len(held) < capacity - 2 and rng.random() < 0.3:
                    held.setdefault(key, []).extend(handles)
                else:
                    handles[0].release()
            elif held and rng.random() < 0.3:
                key = rng.choice(list(held))
                for h in held.pop(key):
                    h.release()
            else:
                key = os.urandom(32)
                expected_victim = None
                if len(stamps) == capacity:
                    expected_victim = min((k for k in stamps if k not in held), key=stamps.__getitem__)
                assert store.publish(key, page_for(key, rng)) == PUBLISHED
                if expected_victim is not None:
                    del stamps[expected_victim]
                    assert store.match([expected_victim]) == 0, f"step {step}: the LRU page is still there"
                clock += 1
                stamps[key] = clock
            assert all(store.match([k]) == 1 for k in stamps)
        for hs in held.values():
            for h in hs:
                h.release()
        assert store.stats().evictions > 0


def test_a_prefix_pinned_together_loses_its_tail_first(store_name):
    rng = random.Random(3)
    keys = fingerprint().keys(list(range(4 * 8)), 8)
    with PageStore.open(store_name, create=True, capacity_pages=4, page_bytes=PAGE) as store:
        for key in keys:
            store.publish(key, page_for(key, rng))
        for h in store.pin(keys):
            h.release()
        store.publish(os.urandom(32), bytes(PAGE))
        assert store.match(keys) == 3  # the deepest page went, the head of the prefix stays usable


# --------------------------------------------------------------------------------------------- processes
def _publish_all(say, name, keys, seed):
    rng = random.Random(seed)
    order = list(range(len(keys)))
    rng.shuffle(order)
    won = []
    with PageStore.open(name) as store:
        say("ready")
        for i in order:
            for _ in range(50):
                outcome = store.publish(keys[i], page_for(keys[i], rng))
                if outcome != RACED:
                    break
            if outcome == PUBLISHED:
                won.append(i)
    say("won", *won)


def race(store: PageStore, publisher, keys: list[bytes], rng: random.Random, processes: int = 3) -> None:
    """`processes` children run publisher(say, store name, keys, seed) at once, each saying "ready" and then the
    places of the keys it published ("won"): every key must be published by exactly one of them, in one slot,
    whole."""
    children = [Child(publisher, store.name, keys, rng.randrange(1 << 30)) for _ in range(processes)]
    wins = []
    for c in children:
        assert c.readline() == "ready"
    for c in children:
        words = c.readline(120).split()
        assert words[0] == "won"
        wins += [int(w) for w in words[1:]]
        assert c.wait() == 0
    assert sorted(wins) == list(range(len(keys)))  # each key published by exactly one of them
    snap = store.slots.snapshot()
    published = snap[(snap["state"] & 3) == 2]
    assert sorted(bytes(k) for k in published["key"]) == sorted(keys)  # one slot per key: no duplicate
    s = store.stats()
    assert (s.published_pages, s.used_pages, s.writing_pages) == (len(keys), len(keys), 0)
    for h in store.pin(keys):
        assert page_is_whole(h.key, h.read())
        h.release()


def test_duplicate_publishes_race_and_one_wins(store_name):
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    keys = [os.urandom(32) for _ in range(150)]
    with PageStore.open(store_name, create=True, capacity_pages=256, page_bytes=PAGE) as store:
        race(store, _publish_all, keys, rng)


def _publish_and_leave(say, spec, keys, seed):
    rng = random.Random(seed)
    with PageStore.open(spec, create=True, capacity_pages=32, page_bytes=PAGE) as store:
        for key in keys:
            assert store.publish(key, page_for(key, rng)) == PUBLISHED
    say("published")


def _check_present(say, spec, keys):
    with PageStore.open(spec) as store:
        n = store.match(keys)
        whole = all(page_is_whole(h.key, h.read()) for h in store.pin(keys))
        say("found", n, whole)


def test_a_directory_store_is_found_again_by_new_processes(tmp_path):
    spec = f"dir:{tmp_path / 'kv'}"
    keys = fingerprint().keys(list(range(12 * 16)), 16)
    writer = Child(_publish_and_leave, spec, keys, 5)
    assert writer.readline() == "published" and writer.wait() == 0
    reader = Child(_check_present, spec, keys)
    assert reader.readline() == f"found {len(keys)} True" and reader.wait() == 0
    with PageStore.open(spec) as store:  # and this process, a third one
        assert store.match(keys) == len(keys)
        assert store.verify() == len(keys)
        assert store.stats().clients == 1  # the two before left their records
    assert PageStore.remove(spec)
    assert not any(p.name.startswith("store.") for p in (tmp_path / "kv").iterdir())


# --------------------------------------------------------------------------------------------- permissions
def _modes(spec):
    from vpaged.memory.store.location import resolve

    loc = resolve(spec)
    return [stat.S_IMODE(os.stat(p).st_mode) for p in [loc.index_path, *loc.all_data_paths()]]


def test_files_are_private_unless_shared_with_the_group(store_name, tmp_path):
    old = os.umask(0o077)  # the mode asked for is the contract, whatever the umask
    try:
        PageStore.open(store_name, create=True, capacity_pages=2, page_bytes=PAGE).close()
        assert _modes(store_name) == [0o600, 0o600]
        group = f"dir:{tmp_path / 'g'}"
        PageStore.open(group, create=True, capacity_pages=2, page_bytes=PAGE, mode=0o660).close()
        assert _modes(group) == [0o660, 0o660]
        assert stat.S_IMODE(os.stat(tmp_path / "g").st_mode) == 0o770
        private = f"dir:{tmp_path / 'p'}"
        PageStore.open(private, create=True, capacity_pages=2, page_bytes=PAGE).close()
        assert stat.S_IMODE(os.stat(tmp_path / "p").st_mode) == 0o700
    finally:
        os.umask(old)
    from vpaged.memory.store.location import resolve

    loc = resolve(store_name)
    os.chmod(loc.index_path, 0o644)  # readable by others: refused
    with pytest.raises(StorePermissionError):
        PageStore.open(store_name)
    os.chmod(loc.index_path, 0o600)
    os.chmod(loc.all_data_paths()[0], 0o606)
    with pytest.raises(StorePermissionError):
        PageStore.open(store_name)
    os.chmod(loc.all_data_paths()[0], 0o600)
    PageStore.open(store_name).close()
    link = resolve(f"{store_name}-link").index_path
    os.symlink(loc.index_path, link)  # a symlink planted under a store's name is not followed
    try:
        with pytest.raises(StorePermissionError):
            PageStore.open(f"{store_name}-link")
    finally:
        os.unlink(link)
