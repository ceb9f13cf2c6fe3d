"""Cost of mapping pages through vpaged versus raw mmap calls, and of per-step extend bookkeeping.

  python benchmarks/bench_mapping.py [--quick]

1. Per page, map + unmap: raw mmap(MAP_FIXED) of a memfd page then mmap(PROT_NONE) over it, called through
   ctypes and in a C++ loop (the floor); versus VirtualRange.map_new / unmap (pool bookkeeping + the same two syscalls), one page per call
   and 64 scattered pages per call. Page sizes 64 KiB and 2 MiB. Goal: vpaged within 1.3x of raw.
2. Bookkeeping of a decode step: extend 256 sequences by one token when no page is needed, as
   extend_many (one call) and as 256 extend calls. Goal: negligible next to a decode step (µs).
"""
from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, median_time, print_table, write_json  # noqa: E402

import vpaged  # noqa: E402
from vpaged import _C  # noqa: E402

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


def raw_c_map_unmap(page_size: int, pages: int, repeats: int) -> float:
    """The same two syscalls per page in a C++ loop: the floor."""
    return sorted(_C._raw_map_unmap_seconds_per_page(page_size, pages) for _ in range(repeats))[repeats // 2]


def vpaged_map_unmap(page_size: int, pages: int, batch: int, repeats: int) -> float:
    pool = _C.PagePool(_C.host_backend(page_size, pages))
    r = _C.VirtualRange(pool, 2 * pages * page_size)
    groups = [[2 * i for i in range(g, min(g + batch, pages))] for g in range(0, pages, batch)]

    def once():
        for slots in groups:
            r.map_new(slots)
            r.unmap(slots)

    return median_time(once, repeats) / pages


def extend_bookkeeping(num_seqs: int, repeats: int) -> dict:
    # 2 MiB pages hold 1024 tokens per region: the timed steps never need a page.
    cache = vpaged.VirtualKVCache(32, 8, 128, dtype=torch.bfloat16, max_seqs=num_seqs, max_seq_len=4096,
                                  capacity_bytes=num_seqs * 64 * 2**21, layout="per_layer", page_size=2**21)
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
    return {"extend_many_us": t_many * 1e6, "extend_loop_us": t_single * 1e6,
            "per_sequence_us": t_many * 1e6 / num_seqs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    repeats = 5 if args.quick else 11
    results = {"machine": machine(), "mapping": [], "goal_ratio": 1.3}
    rows = []
    for page_size in (64 * 1024, 2 * 1024 * 1024):
        pages = 256
        raw = raw_map_unmap(page_size, pages, repeats)
        floor = raw_c_map_unmap(page_size, pages, repeats)
        one = vpaged_map_unmap(page_size, pages, 1, repeats)
        batched = vpaged_map_unmap(page_size, pages, 64, repeats)
        entry = {"page_size": page_size, "raw_c_us": floor * 1e6, "raw_ctypes_us": raw * 1e6,
                 "vpaged_1_us": one * 1e6, "vpaged_64_us": batched * 1e6, "ratio_1_vs_c": one / floor,
                 "ratio_64_vs_c": batched / floor, "ratio_1_vs_ctypes": one / raw}
        results["mapping"].append(entry)
        rows.append([f"{page_size // 1024} KiB", f"{floor * 1e6:.2f}", f"{raw * 1e6:.2f}", f"{one * 1e6:.2f}",
                     f"{one / floor:.2f}x", f"{batched * 1e6:.2f}", f"{batched / floor:.2f}x"])
    print("map + unmap, per page (median µs; ratios against the C++ loop)")
    print_table(["page", "raw C++", "raw ctypes", "vpaged 1/call", "ratio", "vpaged 64/call", "ratio"], rows)
    book = extend_bookkeeping(256, repeats)
    results["extend_256"] = book
    print()
    print("decode-step bookkeeping: extend 256 sequences by 1 token, no page needed (median µs)")
    print_table(["extend_many", "256 x extend", "per sequence"],
                [[f"{book['extend_many_us']:.1f}", f"{book['extend_loop_us']:.1f}", f"{book['per_sequence_us']:.3f}"]])
    path = write_json("mapping_cpu.json", results)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
