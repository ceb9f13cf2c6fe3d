"""The limits a user hits first, said when a pool or cache is created: memory the machine can back, address
space, the mapping limit; and zeroing pages that change owner (PagePool(zero_on_reuse=True)). Pages that keep
their memory when freed: test_pool_keep_freed.py."""

import gc
import re
import warnings

import pytest
import torch

import vpaged
from vpaged import _C, KVGeometry, VirtualCacheConfig
from vpaged.memory.limits import mapping_count

GIB = 2**30


def meminfo_bytes(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def test_host_pool_beyond_the_machine_is_refused_with_numbers():
    ram = meminfo_bytes("MemTotal")
    backable = ram + meminfo_bytes("SwapTotal")
    capacity = max(1 << 40, 2 * backable)  # 1 TiB: the budget that was accepted silently
    with pytest.raises(vpaged.InvalidArgumentError) as e:
        vpaged.PagePool("cpu", capacity_bytes=capacity)
    msg = str(e.value)
    assert "more than this machine can back" in msg and "overcommit=True" in msg
    assert f"{capacity / GIB:,.1f} GiB" in msg
    assert f"{ram / GIB:,.1f} GiB RAM" in msg or "cgroup" in msg
    # Opting in builds it (2 MiB pages keep the page table small); nothing is written, so nothing is used.
    pool = vpaged.PagePool("cpu", capacity_bytes=capacity, page_size=2 * 2**20, overcommit=True)
    assert pool.stats().total_bytes == capacity // (2 * 2**20) * 2 * 2**20
    # A budget the machine backs needs no opt-in.
    assert vpaged.PagePool("cpu", capacity_bytes=backable // 2).capacity_pages > 0


def test_oversized_reservation_names_address_space():
    pool = vpaged.PagePool("cpu", capacity_bytes=64 * 2**20)
    maps = mapping_count()
    # 4,096 sequences x 1M tokens of Llama-2-7B: 2 PiB of address space, 128 TiB exist.
    with pytest.raises(vpaged.AddressSpaceError) as e:
        vpaged.VirtualKVCache(
            KVGeometry(32, 32, 128, torch.bfloat16), VirtualCacheConfig(max_seqs=4096, max_seq_len=2**20), pool=pool
        )
    msg = str(e.value)
    assert isinstance(e.value, vpaged.MappingLimitError)  # what older code caught still catches it
    assert "virtual address space" in msg and "max_map_count" not in msg
    assert "2,097,152.0 GiB" in msg  # what was asked
    m = re.search(r"can reserve at most ([\d,.]+) GiB", msg)
    assert m and 1 < float(m.group(1).replace(",", "")) <= 128 * 1024  # what can be reserved
    assert "max_seqs * max_seq_len <=" in msg
    assert pool.stats().used_pages == 0 and mapping_count() <= maps  # nothing reserved
    # The core says the same when asked directly, past the Python check.
    with pytest.raises(vpaged.AddressSpaceError, match=r"reserving [\d,.]+ GiB of virtual address space failed"):
        _C.VirtualRange(pool._pool, 1 << 50)
    assert mapping_count() <= maps
    # A range the process can reserve still works afterwards.
    r = _C.VirtualRange(pool._pool, 1 << 30)
    r.map_new([0])
    assert pool.stats().used_pages == 1


def test_head_major_sharing_worst_case_warns_at_creation():
    pool = vpaged.PagePool("cpu", capacity_bytes=GIB)
    with pytest.warns(vpaged.MappingLimitWarning, match=r"4,096 host mappings .* 262,145") as w:
        c = vpaged.VirtualKVCache(
            KVGeometry(32, 32, 128, torch.bfloat16),
            VirtualCacheConfig(max_seqs=64, max_seq_len=4096, layout="head_major"),
            pool=pool,
        )
    assert "max_map_count" in str(w[0].message) and "per_layer" in str(w[0].message)
    c.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error", vpaged.MappingLimitWarning)
        vpaged.VirtualKVCache(
            KVGeometry(32, 32, 128, torch.bfloat16),
            VirtualCacheConfig(max_seqs=64, max_seq_len=4096, layout="per_layer"),
            pool=pool,
        ).close()


def written_cache(zero: bool, rng, layout):
    pool = vpaged.PagePool("cpu", capacity_bytes=64 * 2**16, page_size=2**16, zero_on_reuse=zero)
    assert pool.zero_on_reuse is zero
    cache = vpaged.VirtualKVCache(
        KVGeometry(2, 2, 64, torch.float32), VirtualCacheConfig(max_seqs=4, max_seq_len=256, layout=layout), pool=pool
    )
    a = cache.allocate()
    cache.extend(a, 100)
    data = {}
    for layer in range(2):
        k, v = torch.randn(100, 2, 64, generator=rng) + 3, torch.randn(100, 2, 64, generator=rng) + 3
        cache.write(layer, a, k, v)
        data[layer] = (k, v)
    return cache, a, data


@pytest.mark.parametrize("layout", ["per_layer", "interleaved", "head_major"])
@pytest.mark.parametrize("zero", [False, True], ids=["off", "zero_on_reuse"])
def test_pages_changing_owner_are_zeroed_only_when_asked(zero, layout, rng):
    # A freed sequence's dormant pages go to the next allocate() (deferred reclamation).
    cache, a, data = written_cache(zero, rng, layout)
    slot = cache.slot(a)
    cache.free(a)
    b = cache.allocate()
    assert cache.slot(b) == slot and cache.stats().pages_mapped_total == cache.stats().mapped_pages  # no new map
    cache.extend(b, 100)
    for layer in range(2):
        k, v = cache.kv(layer, b)
        if zero:
            assert torch.count_nonzero(k) == 0 and torch.count_nonzero(v) == 0
        else:  # the old sequence's K/V, as torch.empty would show them
            assert torch.equal(k, data[layer][0]) and torch.equal(v, data[layer][1])
    # Pages that went back to the pool and come out for another sequence: zeros on the host either way
    # (their holes are punched when they go free).
    del k, v
    cache.free(b)
    cache.reclaim()
    c = cache.allocate()
    cache.extend(c, 100)
    assert all(torch.count_nonzero(t) == 0 for layer in range(2) for t in cache.kv(layer, c))


def test_zero_on_reuse_covers_allocate_many(rng):
    cache, a, data = written_cache(True, rng, "per_layer")
    cache.free(a)  # slot 0 dormant
    ids = cache.allocate_many(2)
    assert [cache.slot(s) for s in ids] == [0, 1]
    for s in ids:
        cache.extend(s, 100)
        assert all(torch.count_nonzero(t) == 0 for layer in range(2) for t in cache.kv(layer, s))


def test_zero_on_reuse_never_zeroes_pages_another_sequence_shares(rng):
    cache, a, data = written_cache(True, rng, "per_layer")
    child = cache.fork(a)
    view = cache.kv(0, a)  # a live view: free() cannot give up the shared pages, the slot stays dormant
    cache.free(a)
    b = cache.allocate()  # may not zero pages the child reads: takes another slot
    cache.extend(b, 100)
    assert all(torch.count_nonzero(t) == 0 for layer in range(2) for t in cache.kv(layer, b))
    for layer in range(2):
        k, v = cache.kv(layer, child)
        assert torch.equal(k, data[layer][0]) and torch.equal(v, data[layer][1])
    assert torch.equal(view[0], data[0][0])
    del view
    gc.collect()


def test_zero_pages_on_the_pool_reads_back_zeros(rng):
    pool = vpaged.PagePool("cpu", capacity_bytes=8 * 2**16, page_size=2**16)
    r = _C.VirtualRange(pool._pool, 8 * 2**16)
    pages = r.map_new([1, 2, 5])
    view = torch.from_dlpack(r.view(2**16, [2 * 2**14], [1], 2, 32))
    view.copy_(torch.randn(2 * 2**14, generator=rng) + 1)
    pool.zero_pages(pages[:1])
    assert torch.count_nonzero(view[: 2**14]) == 0 and torch.count_nonzero(view[2**14 :]) == 2**14
    with pytest.raises(vpaged.InvalidArgumentError, match="free page"):
        pool.zero_pages([pool.backend.home_page(r.address)])  # page index 0 is not mapped: its page is free
    del view
    gc.collect()
