"""Benchmark-only C++ stays out of vpaged._C: the per-page host backend and the bare map + unmap loops that
benchmarks/bench_mapping.py compares vpaged with live in vpaged_bench_ext (benchmarks/csrc/), which
benchmarks/common.py builds on first use."""

from __future__ import annotations

import shutil
import sys
import sysconfig
from pathlib import Path

import pytest

from vpaged import _C
from vpaged.errors import InvalidArgumentError

ROOT = Path(__file__).resolve().parents[2]
# The names vpaged._C bound before the benchmark code moved out, and the C++ behind them.
BENCH_ONLY_NAMES = ("_per_page_host_backend", "_raw_map_unmap_seconds_per_page")
BENCH_ONLY_CODE = (b"PerPageHostBackend", b"raw_map_unmap_seconds_per_page", b"make_per_page_host_backend")


def test_extension_exports_no_benchmark_only_name():
    names = set(dir(_C))
    assert not names & set(BENCH_ONLY_NAMES)
    assert not [n for n in names if any(w in n.lower() for w in ("bench", "per_page", "raw_map"))]
    binary = Path(_C.__file__).read_bytes()
    assert not [m for m in BENCH_ONLY_CODE if m in binary], "benchmark-only C++ is compiled into vpaged._C"


def bench_ext():
    if not (shutil.which("c++") or shutil.which("g++")):
        pytest.skip("no C++ compiler: cannot build the benchmark extension")
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file():
        pytest.skip("no Python.h: cannot build the benchmark extension")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from common import bench_ext as build
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return build()


def test_bench_ext_backend_plugs_into_the_core_pool():
    """The per-page backend made in vpaged_bench_ext drives vpaged._C's pool and range: one mapping per
    scattered page, all of them gone after unmap."""
    ext = bench_ext()
    page = 64 * 1024
    backend = ext.per_page_host_backend(page, 8)
    assert isinstance(backend, _C.Backend) and backend.device == "cpu"
    pool = _C.PagePool(backend)
    r = _C.VirtualRange(pool, 16 * page)
    pages = r.map_new([0, 2, 4])
    assert len(set(pages)) == 3 and pool.stats().used_pages == 3 and backend.map_calls == 3
    r.unmap([0, 2, 4])
    assert pool.stats().used_pages == 0 and r.pages_at([0, 2, 4]) == [-1, -1, -1]
    with pytest.raises(InvalidArgumentError):
        ext.per_page_host_backend(page + 1, 8)  # a C++ exception of the other module, translated by vpaged._C


@pytest.mark.parametrize("design", ["per_page", "anon", "home"])
def test_bench_ext_raw_loops_time_each_design(design):
    ext = bench_ext()
    assert ext.raw_map_unmap_seconds_per_page(64 * 1024, 8, design, touch=True) > 0
    with pytest.raises(ValueError):
        ext.raw_map_unmap_seconds_per_page(64 * 1024, 8, "nope")
