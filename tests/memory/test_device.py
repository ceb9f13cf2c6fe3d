"""Backends and devices: what is usable here, and clear errors where CUDA is not."""

import pytest
import torch

import vpaged
from vpaged import _C, KVGeometry, VirtualCacheConfig

CUDA_REASON = _C.cuda_unavailable_reason(0)


def test_backends_report_cpu_usable_and_why_cuda_is_not():
    b = vpaged.backends()
    assert b["cpu"].usable and b["cpu"].reason == "" and b["cpu"].granularity > 0
    assert b["cuda"].usable == (CUDA_REASON == "")
    if not b["cuda"].usable:
        assert b["cuda"].reason == CUDA_REASON and len(CUDA_REASON) > 10
        assert b["cuda"].granularity == 0 and b["cuda"].devices == 0


@pytest.mark.skipif(CUDA_REASON == "", reason="CUDA is usable here")
@pytest.mark.parametrize("kwargs", [{}, {"capacity_bytes": 1 << 30}])
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:1"])
def test_a_cuda_cache_where_cuda_is_unusable_raises_the_reason(device, kwargs):
    with pytest.raises(vpaged.BackendUnavailableError) as e:
        vpaged.VirtualKVCache(KVGeometry(2, 2, 64, torch.bfloat16), VirtualCacheConfig(device=device, **kwargs))
    assert CUDA_REASON.split(":")[0] in str(e.value) or "cuda" in str(e.value)
    assert isinstance(e.value, RuntimeError)
    with pytest.raises(vpaged.BackendUnavailableError):
        vpaged.PagePool(device, capacity_bytes=1 << 30)


def test_bad_devices_are_typed_errors():
    for device in ("tpu", "meta", 3.5):
        with pytest.raises(vpaged.InvalidArgumentError):
            vpaged.VirtualKVCache(
                KVGeometry(2, 2, 64, torch.bfloat16), VirtualCacheConfig(device=device, capacity_bytes=1 << 20)
            )


def test_pool_arguments_are_checked():
    with pytest.raises(vpaged.InvalidArgumentError, match="exactly one"):
        vpaged.PagePool("cpu")
    with pytest.raises(vpaged.InvalidArgumentError, match="exactly one"):
        vpaged.PagePool("cpu", capacity_bytes=1 << 20, capacity_pages=4)
    with pytest.raises(vpaged.InvalidArgumentError):
        vpaged.PagePool("cpu", capacity_pages=4, page_size=1000)
    pool = vpaged.PagePool("cpu", capacity_pages=4, page_size=8192)
    with pytest.raises(vpaged.InvalidArgumentError, match="page_size"):
        vpaged.VirtualKVCache(KVGeometry(2, 2, 64, torch.bfloat16), VirtualCacheConfig(page_size=4096), pool=pool)
    with pytest.raises(vpaged.InvalidArgumentError, match="not both"):
        vpaged.VirtualKVCache(
            KVGeometry(2, 2, 64, torch.bfloat16), VirtualCacheConfig(capacity_bytes=1 << 20), pool=pool
        )


def test_default_pool_is_per_device_and_replaceable():
    a = vpaged.default_pool("cpu")
    assert vpaged.default_pool(torch.device("cpu")) is a
    mine = vpaged.PagePool("cpu", capacity_pages=64)
    vpaged.set_default_pool(mine)
    try:
        cache = vpaged.VirtualKVCache(
            KVGeometry(2, 2, 64, torch.float32), VirtualCacheConfig(max_seqs=2, max_seq_len=256)
        )
        assert cache.pool is mine
        s = cache.allocate()
        cache.extend(s, 10)
        assert mine.stats().used_pages == 4
        cache.close()
        assert mine.stats().used_pages == 0
    finally:
        vpaged.set_default_pool(a)


def test_steady_workload_makes_no_map_calls_after_warm_up():
    cache = vpaged.VirtualKVCache(
        KVGeometry(2, 2, 64, torch.float32), VirtualCacheConfig(max_seqs=8, max_seq_len=512, capacity_bytes=128 * 65536)
    )
    for _round in range(2):
        seqs = [cache.allocate() for _ in range(6)]
        for step in range(300):
            cache.extend_many(seqs, 1)
        for s in seqs:
            cache.free(s)
        if _round == 0:
            warm = (cache.stats().pages_mapped_total, cache.pool.backend.map_calls, cache.pool.backend.unmap_calls)
    assert (cache.stats().pages_mapped_total, cache.pool.backend.map_calls, cache.pool.backend.unmap_calls) == warm
