"""The C++ core: host backend, page pool, virtual ranges, DLPack views."""

import gc

import pytest
import torch
from process_helpers import address_is_mapped, open_fds

import vpaged
from vpaged import _C

PAGE = 64 * 1024
F32 = (2, 32)


def f32_view(r, offset, n):
    return torch.from_dlpack(r.view(offset, [n], [1], *F32))


def make(capacity=16):
    pool = _C.PagePool(_C.host_backend(PAGE, capacity))
    return pool, _C.VirtualRange(pool, 8 * PAGE)


def test_two_addresses_one_page_see_each_others_writes(rng):
    pool, r = make()
    (page,) = r.map_new([2])
    r.map_shared([5], [page])
    a, b = f32_view(r, 2 * PAGE, PAGE // 4), f32_view(r, 5 * PAGE, PAGE // 4)
    assert a.data_ptr() != b.data_ptr()
    data = torch.randn(PAGE // 4, generator=rng)
    a.copy_(data)
    assert torch.equal(b, data)
    b[123] = 7.0
    assert a[123] == 7.0
    # A second range of the same pool sees the same page too.
    r2 = _C.VirtualRange(pool, 2 * PAGE)
    r2.map_shared([1], [page])
    assert torch.equal(f32_view(r2, PAGE, PAGE // 4), a)
    assert pool.refcount(page) == 3


def test_views_of_unmapped_memory_are_refused():
    pool, r = make()
    r.map_new([0, 1, 3])
    f32_view(r, 0, 2 * PAGE // 4)  # page indices 0..1: fine
    with pytest.raises(vpaged.InvalidArgumentError, match="unmapped"):
        f32_view(r, 0, 3 * PAGE // 4)  # reaches page index 2
    with pytest.raises(vpaged.InvalidArgumentError, match="unmapped"):
        f32_view(r, 2 * PAGE - 4, 2)  # straddles into page index 2
    with pytest.raises(vpaged.InvalidArgumentError, match="past the end"):
        f32_view(r, 7 * PAGE, PAGE // 4 + 1)
    # A strided view over page indices 0 and 3 skips the unmapped index 2 exactly: allowed.
    t = torch.from_dlpack(r.view(0, [2, 16], [3 * PAGE // 4, 1], *F32))
    assert t.shape == (2, 16)
    # Empty views reach nothing.
    assert f32_view(r, 2 * PAGE, 0).numel() == 0


def test_views_pin_pages_and_keep_the_range_alive(rng):
    pool, r = make()
    r.map_new([0])
    v = f32_view(r, 0, 8)
    assert r.pins_at(0) == 1
    with pytest.raises(vpaged.ViewsAliveError):
        r.unmap([0])
    w = v[2:5]  # derived views keep the base alive
    del v
    gc.collect()
    assert r.pins_at(0) == 1
    del w
    gc.collect()
    assert r.pins_at(0) == 0
    r.unmap([0])
    r.map_new([0])
    x = f32_view(r, 0, 8)
    x.copy_(torch.randn(8, generator=rng))
    expect = x.clone()
    del r  # the view still owns the range: memory stays mapped and readable
    gc.collect()
    assert torch.equal(x, expect)
    assert pool.stats().used_pages == 1
    del x
    gc.collect()
    assert pool.stats().used_pages == 0


def test_pages_return_to_the_pool_and_nothing_leaks():
    gc.collect()  # earlier tests' pools closing their fds inside this test's count would read as a negative leak
    fds = open_fds()
    pool, r = make(capacity=32)
    addr = r.address
    r.map_new(list(range(8)))
    r2 = _C.VirtualRange(pool, 4 * PAGE)
    r2.map_shared([0, 1], r.pages_at([0, 1]))
    assert pool.stats().used_pages == 8
    assert pool.stats().high_water_pages == 8
    r.unmap([0, 1, 2])
    assert pool.stats().used_pages == 7  # page 2 freed; pages 0 and 1 still held by r2
    del r, r2
    gc.collect()
    s = pool.stats()
    assert (s.used_pages, s.free_pages) == (0, 32)
    assert not address_is_mapped(addr)
    del pool
    gc.collect()
    assert open_fds() == fds


def test_out_of_pages_changes_nothing():
    pool, r = make(capacity=4)
    r.map_new([0, 1, 2])
    before = r.pages_at(list(range(8)))
    with pytest.raises(vpaged.OutOfPagesError) as e:
        r.map_new([3, 4])
    assert isinstance(e.value, MemoryError)
    assert r.pages_at(list(range(8))) == before
    assert pool.stats().used_pages == 3
    assert r.mapped_pages == 3
    r.map_new([3])  # the last page is still there to take


def test_bad_indices_and_pages_are_typed_errors():
    pool, r = make()
    r.map_new([1])
    with pytest.raises(vpaged.InvalidArgumentError, match="already mapped"):
        r.map_new([0, 1])
    with pytest.raises(vpaged.InvalidArgumentError, match="outside"):
        r.map_new([8])
    with pytest.raises(vpaged.InvalidArgumentError, match="not mapped"):
        r.unmap([2])
    with pytest.raises(vpaged.InvalidArgumentError):
        r.map_shared([2], [999])
    assert r.mapped_pages == 1 and pool.stats().used_pages == 1


def test_copy_on_write_gives_a_private_copy(rng):
    pool, r = make()
    (page,) = r.map_new([0])
    r.map_shared([1], [page])
    a, b = f32_view(r, 0, PAGE // 4), f32_view(r, PAGE, PAGE // 4)
    a.copy_(torch.randn(PAGE // 4, generator=rng))
    fresh = r.copy_on_write(1)
    assert fresh != page and pool.refcount(page) == 1
    assert torch.equal(a, b)  # the copy holds the same data, at the same address
    b.fill_(1.0)
    assert not torch.equal(a, b)


def test_host_pages_round_trip_through_host_memory(rng):
    pool, r = make()
    (page,) = r.map_new([0])
    data = torch.randn(PAGE // 4, generator=rng)
    f32_view(r, 0, PAGE // 4).copy_(data)
    buf = torch.empty(PAGE // 4)
    pool.copy_to_host(page, buf.data_ptr())
    assert torch.equal(buf, data)
    other = pool.acquire(1)[0]
    pool.copy_from_host(other, buf.data_ptr())
    r.map_shared([4], [other])
    pool.decref(other)
    assert torch.equal(f32_view(r, 4 * PAGE, PAGE // 4), data)


def test_trim_gives_ram_back_and_free_pages_read_zero(rng):
    pool, r = make()
    (page,) = r.map_new([0])
    f32_view(r, 0, PAGE // 4).copy_(torch.randn(PAGE // 4, generator=rng) + 10)
    r.unmap([0])
    assert pool.trim() == 16
    again = r.map_new([0])
    assert again == [page]  # most recently freed first
    assert torch.count_nonzero(f32_view(r, 0, PAGE // 4)) == 0


def test_host_page_size_must_be_os_page_multiple():
    with pytest.raises(vpaged.InvalidArgumentError, match="multiple"):
        _C.host_backend(1000, 4)


def test_duplicate_indices_and_overflowing_views_are_refused():
    pool, r = make()
    r.map_new([0, 1])
    with pytest.raises(vpaged.InvalidArgumentError, match="twice"):
        r.unmap([0, 0])
    with pytest.raises(vpaged.InvalidArgumentError, match="overflow"):
        r.view(0, [2**40, 2**40], [2**40, 1], *F32)
    assert r.mapped_pages == 2 and pool.stats().used_pages == 2
    r.unmap([0, 1])
    assert pool.stats().used_pages == 0
