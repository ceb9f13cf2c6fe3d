"""File pages (PagePool.attach_file_pages): pages of another file mapped into ranges with no copy, what a page
store's hits use. Checked against the file's bytes read back with os.pread: reads through a range show the
file, a write through a range or into a copy never reaches it, copy-on-write and copies to the host read the
file, the pool's accounting leaves them out of its capacity, bad input changes nothing, and a file cut short
under a mapping reads zeros instead of raising SIGBUS."""

import ctypes
import os

import numpy as np
import pytest

from vpaged.errors import InvalidArgumentError
from vpaged.memory.pool import PagePool

PAGE = 16384


@pytest.fixture
def pool():
    return PagePool("cpu", capacity_pages=32, page_size=PAGE)


@pytest.fixture
def data_file(tmp_path, rng):
    """A file of 8 pages of random bytes, open for reading and writing; its bytes."""
    data = np.random.default_rng(int(rng.initial_seed())).integers(0, 256, 8 * PAGE, dtype=np.uint8)
    path = tmp_path / "pages.data"
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDWR)
    yield fd, data, path
    os.close(fd)


def read_at(vrange, index: int) -> np.ndarray:
    return np.frombuffer((ctypes.c_char * PAGE).from_address(vrange.address + index * PAGE), dtype=np.uint8).copy()


def page_of(data, i):
    return data[i * PAGE : (i + 1) * PAGE]


def test_mapped_file_pages_show_the_file_and_take_none_of_the_pool(pool, data_file, prng):
    fd, data, _ = data_file
    chosen = prng.sample(range(8), 5)
    ids = pool.attach_file_pages(fd, [i * PAGE for i in chosen])
    assert len(set(ids)) == 5 and all(pool.is_file_page(p) and pool.refcount(p) == 1 for p in ids)
    s = pool.stats()
    assert s.file_pages == 5 and s.used_pages == 0 and s.free_pages == 32
    r = pool.new_range(16 * PAGE)
    indices = prng.sample(range(16), 5)
    r.map_shared(indices, ids)
    for index, i in zip(indices, chosen):
        assert np.array_equal(read_at(r, index), page_of(data, i))
    # Consecutive pages of the file at consecutive indices are one mapping.
    before = pool.backend.map_calls
    run = pool.attach_file_pages(fd, [2 * PAGE, 3 * PAGE, 4 * PAGE])
    r2 = pool.new_range(4 * PAGE)
    r2.map_shared([0, 1, 2], run)
    assert run == list(range(run[0], run[0] + 3))  # fresh ids (none was detached yet) come in order
    assert pool.backend.map_calls - before == 1
    assert all(np.array_equal(read_at(r2, k), page_of(data, 2 + k)) for k in range(3))
    del r2
    pool.decref(run)
    r.unmap(indices)
    assert [pool.refcount(p) for p in ids] == [1] * 5
    pool.decref(ids)
    assert pool.stats().file_pages == 0 and pool.stats().used_pages == 0
    assert not any(pool.is_file_page(p) for p in ids)


def test_writes_never_reach_the_file_and_copies_read_it(pool, data_file):
    fd, data, _ = data_file
    (page,) = pool.attach_file_pages(fd, [3 * PAGE])
    r = pool.new_range(4 * PAGE)
    r.map_shared([1], [page])
    # A stray write through the range (the caches copy before they write; this is the safety net).
    ctypes.memset(r.address + PAGE + 100, 0xAB, 64)
    assert os.pread(fd, PAGE, 3 * PAGE) == page_of(data, 3).tobytes()
    # Copy-on-write: the index gets a pool page holding the file's bytes.
    r.unmap([1])
    r.map_shared([1], [page])
    assert r.make_private([1]) == 1
    own = r.page_at(1)
    assert not pool.is_file_page(own) and pool.refcount(page) == 1
    assert np.array_equal(read_at(r, 1), page_of(data, 3))
    assert pool.stats().used_pages == 1
    # Out to the host (swap, publish) reads the file.
    out = np.empty(PAGE, dtype=np.uint8)
    pool.copy_to_host(page, out.ctypes.data)
    assert np.array_equal(out, page_of(data, 3))
    # Into a file page: refused, the file unchanged.
    with pytest.raises(InvalidArgumentError, match="read-only"):
        pool.copy_from_host(page, np.zeros(PAGE, dtype=np.uint8).ctypes.data)
    with pytest.raises(InvalidArgumentError, match="read-only"):
        pool.zero_pages([page])
    assert os.pread(fd, PAGE, 3 * PAGE) == page_of(data, 3).tobytes()
    pool.decref([page])


def test_bad_offsets_and_files_are_refused_with_nothing_attached(pool, data_file, tmp_path):
    fd, _, path = data_file
    ids_before = pool.backend.page_ids
    for offsets in ([100], [8 * PAGE], [7 * PAGE + 4096], [0, 9 * PAGE]):
        with pytest.raises(InvalidArgumentError, match="not a page"):
            pool.attach_file_pages(fd, offsets)
    wronly = os.open(path, os.O_WRONLY)
    try:
        with pytest.raises(InvalidArgumentError, match="not open for reading"):
            pool.attach_file_pages(wronly, [0])
    finally:
        os.close(wronly)
    directory = os.open(tmp_path, os.O_RDONLY)
    try:
        with pytest.raises(InvalidArgumentError, match="regular file"):
            pool.attach_file_pages(directory, [0])
    finally:
        os.close(directory)
    assert pool.stats().file_pages == 0 and pool.backend.page_ids == ids_before
    counting = PagePool("cpu", capacity_pages=8, page_size=PAGE, accounting_only=True)
    assert not counting.can_attach_file_pages
    with pytest.raises(InvalidArgumentError, match="cannot map pages of a file"):
        counting.attach_file_pages(fd, [0])


def test_a_file_cut_short_under_a_mapping_reads_zeros_not_sigbus(pool, data_file):
    fd, data, _ = data_file
    ids = pool.attach_file_pages(fd, [0, 5 * PAGE])
    r = pool.new_range(2 * PAGE)
    r.map_shared([0, 1], ids)
    assert np.array_equal(read_at(r, 0), page_of(data, 0))
    os.ftruncate(fd, 2 * PAGE)  # page 5 is gone from the file
    faults = pool.file_page_faults
    assert np.count_nonzero(read_at(r, 1)) == 0
    assert pool.file_page_faults > faults
    assert np.array_equal(read_at(r, 0), page_of(data, 0))  # what is still in the file reads as before
    r.unmap([0, 1])
    pool.decref(ids)
    # Mapped again after the cut: the page is refused, not mapped.
    with pytest.raises(InvalidArgumentError, match="not a page"):
        pool.attach_file_pages(fd, [5 * PAGE])
