"""VirtualKVCache on a shared page store (config.prefix_store): full blocks published by one cache come back,
bit-exact, in another cache and another process, mapped (no copy) or copied; a write into a mapped page copies
it first and never reaches the store; a different model, dtype or layout never hits; a damaged page is
recomputed, not served; a data file cut short under mapped pages reads zeros instead of killing the process."""

import os
import subprocess
import sys
import textwrap
import time
import uuid

import pytest
import torch

from vpaged import KVGeometry, VirtualCacheConfig, VirtualKVCache
from vpaged.errors import InvalidArgumentError, StoreMismatchError
from vpaged.kvcache.virtual import store_link
from vpaged.memory.store import PageStore

PAGE = 4096
GEOMETRY = KVGeometry(3, 2, 16, torch.float32)  # 128-byte rows: 32 tokens a page


@pytest.fixture
def store_name():
    name = f"test-{uuid.uuid4().hex[:12]}"
    yield name
    PageStore.remove(name)


def make_cache(store, layout="per_layer", weights="model@1", geometry=GEOMETRY, **extra):
    config = VirtualCacheConfig(
        max_seqs=4,
        max_seq_len=1024,
        capacity_bytes=256 * PAGE,
        page_size=PAGE,
        layout=layout,
        prefix_store=store,
        prefix_store_weights=weights,
        prefix_store_pages=256,
        **extra,
    )
    return VirtualKVCache(geometry, config)


def fill(cache, tokens, gen):
    """A sequence of `tokens` with random K/V written; returns it and its K/V (clones), per layer."""
    seq = cache.allocate(tokens=tokens)
    assert cache.seq_len(seq) == 0
    cache.extend(seq, len(tokens))
    values = []
    for layer in range(cache.num_layers):
        k = torch.randn(len(tokens), 2, 16, generator=gen)
        v = torch.randn(len(tokens), 2, 16, generator=gen)
        cache.write(layer, seq, k, v, start=0)
        values.append((k, v))
    return seq, values


@pytest.mark.parametrize("publish", ["in-place", "staged-by-block"])
@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "copied"])
@pytest.mark.parametrize("layout", ["per_layer", "interleaved", "head_major"])
def test_published_blocks_come_back_bit_exact_in_a_new_cache(store_name, layout, mapped, publish, rng, monkeypatch):
    gen = rng
    tokens = torch.randint(0, 50_000, (150,), generator=gen).tolist()
    a = make_cache(store_name, layout)
    if publish == "staged-by-block":  # the device's way (through a host buffer), one block a batch
        a.prefix_store.publishes_in_place = False
        monkeypatch.setattr(store_link, "PUBLISH_BATCH_BYTES", 1)
    seq, values = fill(a, tokens, gen)
    cached = a.cache_prefix(seq, tokens)
    assert cached > 0
    published = a.prefix_store.stats.published_pages
    assert published > 0
    a.close()

    with open(_data_path(store_name), "rb") as f:
        store_bytes = f.read()
    b = make_cache(store_name, layout, prefix_store_map=mapped)
    used = b.pool.stats().used_pages
    got = b.allocate(tokens=tokens + [7, 8, 9])
    n = b.seq_len(got)
    assert n == cached  # the same blocks the local index would hit
    for layer, (k, v) in enumerate(values):
        kb, vb = b.kv(layer, got)
        assert torch.equal(kb, k[:n]) and torch.equal(vb, v[:n])
        del kb, vb
    s = b.prefix_store.stats
    assert s.hit_tokens == n and s.hit_pages == published
    if mapped:  # the store's pages themselves: no copy, none of the pool's pages taken
        assert s.copied_bytes == 0 and s.mapped_bytes == published * PAGE and s.mapped_pages == published
        assert b.pool.stats().file_pages == published and b.pool.stats().used_pages == used
    else:
        assert s.copied_bytes == published * PAGE and s.mapped_bytes == 0
        assert b.pool.stats().file_pages == 0 and b.pool.stats().used_pages == used + published
    # The sequence goes on from there, and rewrites its last hit token: a mapped page is copied first.
    b.truncate(got, n - 1)
    b.extend(got, 4 + len(tokens) - n)
    k_new = torch.randn(len(tokens) + 4 - n, 2, 16, generator=gen)
    b.write(0, got, k_new, k_new, start=n - 1)
    kb, _ = b.kv(0, got)
    assert torch.equal(kb[: n - 1], values[0][0][: n - 1]) and torch.equal(kb[n - 1 :], k_new)
    del kb
    # Offering the same prefix again publishes nothing new.
    b.cache_prefix(got, tokens[: n - 1])
    assert b.prefix_store.stats.published_pages == 0
    with open(_data_path(store_name), "rb") as f:
        assert f.read() == store_bytes  # nothing the cache wrote reached the store
    # A third cache still finds the published values, not the rewrite.
    c = make_cache(store_name, layout, prefix_store_map=mapped)
    got_c = c.allocate(tokens=tokens)
    kc, _ = c.kv(0, got_c)
    assert c.seq_len(got_c) == n and torch.equal(kc, values[0][0][:n])
    del kc
    c.close()
    # Freed, the mapped pages go back, pins and all, at the next store call, also the blocks of them the local
    # index cached (cache_prefix above): the store holds them, the local index gives them up.
    cached_before = len(b._prefix)
    b.free(got)
    b.allocate(tokens=[1, 2, 3])
    assert b.prefix_store.stats.mapped_pages == 0 and b.pool.stats().file_pages == 0
    assert b.prefix_store.store.stats().pinned_pages == 0
    assert (len(b._prefix) < cached_before) == mapped  # copied pages are the pool's: the local index keeps them
    # The next hit on them maps them from the store again.
    again = b.allocate(tokens=tokens)
    assert b.seq_len(again) == n
    b.close()


def _data_path(store_name):
    store = PageStore.open(store_name)
    try:
        return store.data_path
    finally:
        store.close()


def test_another_model_dtype_or_layout_never_hits(store_name, rng):
    gen = rng
    tokens = torch.randint(0, 50_000, (100,), generator=gen).tolist()
    a = make_cache(store_name)
    seq, _ = fill(a, tokens, gen)
    a.cache_prefix(seq, tokens)
    a.close()
    others = [
        dict(weights="model@2"),
        dict(layout="interleaved"),
        dict(geometry=KVGeometry(3, 2, 16, torch.float32, kv_dtype=torch.int8)),
        dict(geometry=KVGeometry(3, 1, 32, torch.float32)),  # same row bytes, another geometry
    ]
    for kw in others:
        c = make_cache(store_name, **kw)
        assert c.seq_len(c.allocate(tokens=tokens)) == 0, kw
        assert c.prefix_store.stats.hit_pages == 0
        c.close()
    same = make_cache(store_name)
    assert same.seq_len(same.allocate(tokens=tokens)) == 96
    same.close()


def test_a_damaged_page_is_recomputed_not_served(store_name, rng):
    gen = rng
    tokens = torch.randint(0, 50_000, (64,), generator=gen).tolist()
    a = make_cache(store_name)
    seq, _ = fill(a, tokens, gen)
    a.cache_prefix(seq, tokens)
    data_path = a.prefix_store.store.data_path
    a.close()
    with open(data_path, "r+b") as f:  # every published page overwritten outside vpaged
        for slot in range(6):
            f.seek(slot * PAGE + 100)
            f.write(os.urandom(8))
    for mapped in (True, False):
        b = make_cache(store_name, prefix_store_map=mapped)
        used = b.pool.stats().used_pages
        got = b.allocate(tokens=tokens)
        assert b.seq_len(got) == 0 and b.prefix_store.stats.faults == 1
        assert b.pool.stats().used_pages == used  # the pages it mapped for the fetch went back
        assert b.pool.stats().file_pages == 0 and b.prefix_store.store.stats().pinned_pages == 0
        b.close()


def test_a_data_file_cut_short_under_mapped_pages_reads_zeros_not_sigbus(store_name, rng):
    gen = rng
    tokens = torch.randint(0, 50_000, (96,), generator=gen).tolist()
    a = make_cache(store_name)
    seq, values = fill(a, tokens, gen)
    a.cache_prefix(seq, tokens)
    a.close()
    b = make_cache(store_name)
    got = b.allocate(tokens=tokens)
    assert b.seq_len(got) == 96 and b.prefix_store.stats.mapped_pages > 0
    os.truncate(_data_path(store_name), 0)  # someone cuts the file short under the mapping
    k, _ = b.kv(0, got)
    assert torch.count_nonzero(k) == 0  # the guard answered with zeros; without it the process would be dead
    del k
    assert b.pool.file_page_faults > 0
    # The next request sees the damage: no store page is mapped from then on, and the tokens are computed.
    again = b.allocate(tokens=tokens)
    assert b.seq_len(again) == 0 and b.prefix_store.stats.read_faults > 0 and not b.prefix_store.maps
    b.close()


def test_store_of_another_page_size_and_bad_config_are_refused(store_name):
    make_cache(store_name).close()
    with pytest.raises(StoreMismatchError):
        VirtualKVCache(
            GEOMETRY,
            VirtualCacheConfig(
                capacity_bytes=64 * 8192, page_size=8192, prefix_store=store_name, prefix_store_weights="m"
            ),
        )
    with pytest.raises(InvalidArgumentError, match="prefix_store_weights"):
        VirtualCacheConfig(prefix_store=store_name)
    with pytest.raises(InvalidArgumentError, match="go with a prefix_store"):
        VirtualCacheConfig(prefix_store_weights="m")
    with pytest.raises(InvalidArgumentError, match="fixed kv_scales"):
        make_cache(
            store_name,
            geometry=KVGeometry(3, 2, 16, torch.float32, kv_dtype=torch.float8_e4m3fn),
            kv_scales="calibrate",
        )


# A child process's cache on the store NAME (argv[1]) and a sequence of 200 tokens drawn from SEED (argv[2]),
# allocated (hitting the store where it holds them).
CHILD_CACHE = textwrap.dedent(
    """
    import sys, time, torch
    from vpaged import KVGeometry, VirtualCacheConfig, VirtualKVCache
    name, seed = sys.argv[1], int(sys.argv[2])
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50_000, (200,), generator=gen).tolist()
    cache = VirtualKVCache(KVGeometry(3, 2, 16, torch.float32), VirtualCacheConfig(max_seqs=2, max_seq_len=1024,
        capacity_bytes=256 * 4096, page_size=4096, prefix_store=name, prefix_store_weights="model@1",
        prefix_store_pages=256))
    seq = cache.allocate(tokens=tokens)
    """
)

PUBLISHER = CHILD_CACHE + textwrap.dedent(
    """
    cache.extend(seq, len(tokens))
    for layer in range(3):
        k = torch.randn(len(tokens), 2, 16, generator=gen)
        cache.write(layer, seq, k, -k, start=0)
    print(cache.cache_prefix(seq, tokens))
    cache.close()
    """
)


def test_a_prefix_published_by_another_process_hits_here(store_name, prng):
    seed = prng.randrange(1 << 30)
    out = subprocess.run(
        [sys.executable, "-c", PUBLISHER, store_name, str(seed)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    cached = int(out.stdout.strip())
    gen = torch.Generator().manual_seed(seed)  # the publisher's values, made again here as the reference
    tokens = torch.randint(0, 50_000, (200,), generator=gen).tolist()
    keys = [torch.randn(200, 2, 16, generator=gen) for _ in range(3)]
    b = make_cache(store_name)
    got = b.allocate(tokens=tokens)
    assert b.seq_len(got) == cached == 192
    assert b.prefix_store.stats.mapped_bytes == b.prefix_store.stats.hit_pages * PAGE > 0
    for layer in range(3):
        k, v = b.kv(layer, got)
        assert torch.equal(k, keys[layer][:cached]) and torch.equal(v, -keys[layer][:cached])
        del k, v
    b.close()


MAPPER = CHILD_CACHE + textwrap.dedent(
    """
    print(cache.seq_len(seq), cache.prefix_store.stats.mapped_pages, flush=True)
    time.sleep(600)
    """
)


def test_a_killed_process_holding_mapped_pages_gives_its_pins_back(store_name, prng):
    seed = prng.randrange(1 << 30)
    out = subprocess.run(
        [sys.executable, "-c", PUBLISHER, store_name, str(seed)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    store = PageStore.open(store_name)
    try:
        mapper = subprocess.Popen(
            [sys.executable, "-c", MAPPER, store_name, str(seed)], stdout=subprocess.PIPE, text=True
        )
        try:
            tokens, mapped = map(int, mapper.stdout.readline().split())
            assert tokens == 192 and mapped == 36  # 6 blocks of 6 pages (K and V of 3 layers), mapped there
            assert store.stats().pinned_pages == mapped
        finally:
            mapper.kill()
            mapper.wait()
        killed = time.monotonic()
        while store.stats().pinned_pages and time.monotonic() - killed < 1.0:
            time.sleep(0.02)
        assert store.stats().pinned_pages == 0  # the reclaim pass of this process returned them
    finally:
        store.close()


def test_a_mapping_refused_mid_fetch_is_computed_with_nothing_held(store_name, rng, monkeypatch):
    gen = rng
    tokens = torch.randint(0, 50_000, (96,), generator=gen).tolist()
    a = make_cache(store_name)
    seq, _ = fill(a, tokens, gen)
    a.cache_prefix(seq, tokens)
    a.close()
    b = make_cache(store_name)
    used = b.pool.stats().used_pages

    def refuse(fd, offsets):
        raise InvalidArgumentError("attach_file_pages: offset past the end of the file")

    monkeypatch.setattr(b.pool, "attach_file_pages", refuse)
    got = b.allocate(tokens=tokens)
    assert b.seq_len(got) == 0 and b.prefix_store.stats.faults == 1
    assert b.prefix_store.store.stats().pinned_pages == 0 and b.pool.stats().used_pages == used
    monkeypatch.undo()
    again = b.allocate(tokens=tokens)  # the next request maps them
    assert b.seq_len(again) == 96 and b.prefix_store.stats.mapped_pages > 0
    b.close()
