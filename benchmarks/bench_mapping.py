"""Cost of mapping pages through vpaged versus raw mmap calls, and of per-step extend bookkeeping.

  python benchmarks/bench_mapping.py [--quick]

1. Host designs side by side, bare system calls in a C++ loop per page (scattered pages), untouched and
   written once (touch): per_page (a mapping per page: the backend before home pages), anon (anonymous
   mapping + MADV_DONTNEED), home (a range-long memfd mapping; unmap punches the page's hole: the backend
   now). Mappings held with 256 scattered pages mapped.
2. Per page, map + unmap through vpaged (VirtualRange.map_new / unmap: pool bookkeeping + the backend),
   one page per call and 64 scattered pages per call, against the C++ floor of the design it uses, for
   the current backend and the per-page reference backend. Page sizes 64 KiB and 2 MiB. Goal: within 1.3x.
   "crossing": two calls into the range that pass a one-element list each way and do no mapping work
   (pages_at + pinned_count), per page: floor + crossing is the least one page per call from Python can cost.
3. Bookkeeping of a decode step: extend 256 sequences by one token when no page is needed (extend_many and
   256 extend calls), and a step where every sequence crosses a page (maps a page per region), on both
   backends. Goal: no slower than before.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_ext, machine, median_time, print_table, write_json  # noqa: E402

import vpaged  # noqa: E402
from vpaged import (
    _C,  # noqa: E402
    KVGeometry,
    VirtualCacheConfig,
)
from vpaged.memory.limits import mapping_count  # noqa: E402

BENCH = bench_ext()  # the per-page backend and the C++ floors: benchmark-only C++, not in vpaged._C

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
MAP_FIXED, MAP_NORESERVE, PROT_NONE = 0x10, 0x4000, 0
RW = mmap.PROT_READ | mmap.PROT_WRITE
NONE_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED


def raw_map_unmap(page_size: int, pages: int, repeats: int) -> float:
    """Seconds per page of map + unmap with bare syscalls (through ctypes, as vpaged is called from Python)."""
    fd = os.memfd_create("bench-raw")
    os.ftruncate(fd, page_size * pages)
    span = 2 * pages * page_size
    base = libc.mmap(None, span, PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
    mm, shared = libc.mmap, mmap.MAP_SHARED | MAP_FIXED

    def once():
        for i in range(pages):
            addr = base + 2 * i * page_size  # every other slot: separate mappings, as scattered KV pages are
            if mm(addr, page_size, RW, shared, fd, i * page_size) != addr:
                raise OSError(ctypes.get_errno(), "mmap")
            mm(addr, page_size, PROT_NONE, NONE_FLAGS, -1, 0)

    t = median_time(once, repeats) / pages
    libc.munmap(base, span)
    os.close(fd)
    return t


def raw_c_map_unmap(page_size: int, pages: int, repeats: int, design: str = "home", touch: bool = False) -> float:
    """The bare syscalls of one design per page in a C++ loop: the floor."""
    return sorted(BENCH.raw_map_unmap_seconds_per_page(page_size, pages, design, touch) for _ in range(repeats))[
        repeats // 2
    ]


BACKENDS = {"home": _C.host_backend, "per_page": BENCH.per_page_host_backend}


def vpaged_map_unmap(page_size: int, pages: int, batch: int, repeats: int, backend: str = "home") -> float:
    pool = _C.PagePool(BACKENDS[backend](page_size, pages))
    r = _C.VirtualRange(pool, 2 * pages * page_size)
    groups = [[2 * i for i in range(g, min(g + batch, pages))] for g in range(0, pages, batch)]

    def once():
        for indices in groups:
            r.map_new(indices)
            r.unmap(indices)

    return median_time(once, repeats) / pages


def python_crossing(page_size: int, pages: int, repeats: int) -> float:
    """Seconds per page of two range calls that carry a page index list each way and map nothing."""
    pool = _C.PagePool(BACKENDS["home"](page_size, pages))
    r = _C.VirtualRange(pool, 2 * pages * page_size)
    groups = [[2 * i] for i in range(pages)]

    def once():
        for indices in groups:
            r.pages_at(indices)
            r.pinned_count(indices)

    return median_time(once, repeats) / pages


def design_mappings(page_size: int, pages: int, backend: str) -> int:
    """Mappings the process gains with `pages` scattered pages mapped through vpaged."""
    pool = _C.PagePool(BACKENDS[backend](page_size, pages))
    r = _C.VirtualRange(pool, 2 * pages * page_size)
    before = mapping_count()
    r.map_new([2 * i for i in range(pages)])
    return mapping_count() - before + 1  # + the reservation itself


def cache_on(backend: str, page_size: int, capacity_bytes: int, **kw) -> vpaged.VirtualKVCache:
    pool = vpaged.PagePool("cpu", capacity_bytes=capacity_bytes, page_size=page_size, overcommit=True)  # never written
    if backend != "home":  # the same pool and cache code over the reference backend
        pool._pool = _C.PagePool(BACKENDS[backend](page_size, pool.capacity_pages))
    with warnings.catch_warnings():  # sharing's worst case; these benchmarks share nothing
        warnings.simplefilter("ignore", vpaged.MappingLimitWarning)
        return vpaged.VirtualKVCache(
            KVGeometry(32, 8, 128, torch.bfloat16), VirtualCacheConfig(layout="per_layer", **kw), pool=pool
        )


def crossing_step(num_seqs: int, repeats: int, backend: str) -> float:
    """A decode step in which every sequence crosses into a new page (64 KiB: every 32 tokens): extend_many
    maps num_seqs * 64 pages; then truncate them away again (not timed separately: map + unmap per step).
    128 sequences: 256 would pass vm.max_map_count on the per-page backend."""
    cache = cache_on(backend, 64 * 1024, num_seqs * 64 * 2 * 2**16, max_seqs=num_seqs, max_seq_len=64)
    seqs = [cache.allocate() for _ in range(num_seqs)]
    cache.extend_many(seqs, 32)  # one full page per region

    def step():
        cache.extend_many(seqs, 1)  # maps the second page of every region
        for s in seqs:
            cache.truncate(s, 32)

    return median_time(step, repeats)


def extend_bookkeeping(num_seqs: int, repeats: int, backend: str = "home") -> dict:
    # 2 MiB pages hold 1024 tokens per region: the timed steps never need a page.
    cache = cache_on(backend, 2**21, num_seqs * 64 * 2**21, max_seqs=num_seqs, max_seq_len=4096)
    seqs = [cache.allocate() for _ in range(num_seqs)]
    cache.extend_many(seqs, 1)  # maps one page per region; the next 255 tokens need none
    steps = 0

    def many():
        nonlocal steps
        cache.extend_many(seqs, 1)
        steps += 1

    def single():
        nonlocal steps
        for s in seqs:
            cache.extend(s, 1)
        steps += 1

    maps_before = cache.stats().pages_mapped_total
    t_many = median_time(many, repeats, inner=10)
    t_single = median_time(single, repeats, inner=2)
    assert cache.stats().pages_mapped_total == maps_before, "the benchmark must not cross a page"
    assert steps < 1023
    return {
        "extend_many_us": t_many * 1e6,
        "extend_loop_us": t_single * 1e6,
        "per_sequence_us": t_many * 1e6 / num_seqs,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    repeats = 5 if args.quick else 11
    pages = 256
    results = {"machine": machine(), "designs": [], "mapping": [], "goal_ratio": 1.3}
    rows = []
    for page_size in (64 * 1024, 2 * 1024 * 1024):
        for design in ("per_page", "anon", "home"):
            e = {
                "page_size": page_size,
                "design": design,
                "raw_us": raw_c_map_unmap(page_size, pages, repeats, design) * 1e6,
                "raw_touch_us": raw_c_map_unmap(page_size, pages, repeats, design, True) * 1e6,
                "mappings_for_256_pages": {"per_page": 2 * pages + 1, "anon": 1, "home": 1}[design],
            }
            if design != "anon":
                e["vpaged_mappings_for_256_pages"] = design_mappings(page_size, pages, design)
            results["designs"].append(e)
            rows.append(
                [
                    f"{page_size // 1024} KiB",
                    design,
                    f"{e['raw_us']:.2f}",
                    f"{e['raw_touch_us']:.2f}",
                    str(e.get("vpaged_mappings_for_256_pages", e["mappings_for_256_pages"])),
                ]
            )
    print("host designs: bare syscalls per page, C++ loop (median µs); mappings with 256 scattered pages")
    print_table(["page", "design", "map+unmap", "with touch", "mappings"], rows)
    rows = []
    for page_size in (64 * 1024, 2 * 1024 * 1024):
        for backend in ("home", "per_page"):
            floor = raw_c_map_unmap(page_size, pages, repeats, backend)
            one = vpaged_map_unmap(page_size, pages, 1, repeats, backend)
            batched = vpaged_map_unmap(page_size, pages, 64, repeats, backend)
            entry = {
                "page_size": page_size,
                "backend": backend,
                "raw_c_us": floor * 1e6,
                "vpaged_1_us": one * 1e6,
                "vpaged_64_us": batched * 1e6,
                "ratio_1_vs_c": one / floor,
                "ratio_64_vs_c": batched / floor,
            }
            if backend == "per_page":
                entry["raw_ctypes_us"] = raw_map_unmap(page_size, pages, repeats) * 1e6
            crossing = python_crossing(page_size, pages, repeats)
            entry["python_crossing_us"] = crossing * 1e6
            entry["ratio_1_best_possible"] = (floor + crossing) / floor
            results["mapping"].append(entry)
            rows.append(
                [
                    f"{page_size // 1024} KiB",
                    backend,
                    f"{floor * 1e6:.2f}",
                    f"{one * 1e6:.2f}",
                    f"{one / floor:.2f}x",
                    f"{crossing * 1e6:.2f} ({(floor + crossing) / floor:.2f}x)",
                    f"{batched * 1e6:.2f}",
                    f"{batched / floor:.2f}x",
                ]
            )
    print("\nmap + unmap through vpaged, per page (median µs; ratios against the C++ floor of the same design)")
    print_table(["page", "backend", "floor", "1/call", "ratio", "crossing (floor + it)", "64/call", "ratio"], rows)
    rows = []
    for backend in ("home", "per_page"):
        book = extend_bookkeeping(256, repeats, backend)
        book["page_crossing_step_128_us"] = crossing_step(128, repeats, backend) * 1e6
        results[f"extend_256_{backend}"] = book
        rows.append(
            [
                backend,
                f"{book['extend_many_us']:.1f}",
                f"{book['extend_loop_us']:.1f}",
                f"{book['per_sequence_us']:.3f}",
                f"{book['page_crossing_step_128_us']:.0f}",
            ]
        )
    results["extend_256"] = results["extend_256_home"]
    print()
    print(
        "decode-step bookkeeping (median µs): 256 sequences +1 token with no page needed; 128 sequences each "
        "mapping a page per region (64 regions) and truncating it again"
    )
    print_table(["backend", "extend_many", "256 x extend", "per sequence", "page-crossing step (128)"], rows)
    path = write_json("mapping_cpu.json", results)
    print(f"\nwrote {path}")


def summary_rows(results: dict) -> list[dict]:
    """This script's comparisons as `vpaged bench` and docs/numbers.md show them, read from its JSON: vpaged's
    map + unmap of one page against the bare system calls, and one extend_many() against 256 extend() calls.
    Builtins only: the suite compiles this function alone, without the imports above (vpaged_bench_ext)."""

    def row(comparison, vpaged, baseline, baseline_name):
        return {
            "benchmark": "mapping",
            "comparison": comparison,
            "vpaged": vpaged,
            "baseline": baseline,
            "baseline_name": baseline_name,
            "unit": "µs",
            "better": "lower",
        }

    rows = []
    for m in results.get("mapping", []):
        size = f"{m['page_size'] // 1024} KiB" if m["page_size"] < 1 << 20 else f"{m['page_size'] >> 20} MiB"
        rows.append(row(f"map + unmap one {size} page", m["vpaged_1_us"], m["raw_c_us"], "bare syscalls (C++)"))
    ext = results.get("extend_256")
    if ext:
        rows.append(
            row(
                "decode-step bookkeeping, 256 sequences",
                ext["extend_many_us"],
                ext["extend_loop_us"],
                "256 extend() calls",
            )
        )
    return rows


if __name__ == "__main__":
    main()
