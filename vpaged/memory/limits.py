"""The limits a host pool meets, checked when it is created rather than mid-serving.

1. Memory: a host pool's pages are sparse, so a capacity beyond what the machine can back is accepted by the
   kernel and fails only when tokens are written past physical memory, by the OOM killer ending the process
   instead of an OutOfPagesError. check_host_capacity refuses such a pool unless the caller opts in.
2. What the process has: the largest piece of address space it can still reserve (reservable_bytes) and the
   mappings it holds against vm.max_map_count (mapping_count, mapping_limit). What a cache's layout needs of
   them is checked in vpaged/kvcache/virtual/limits.py.
"""

from __future__ import annotations

import os
import resource

from ..errors import InvalidArgumentError

USER_ADDRESS_SPACE = 1 << 47  # what mmap hands out without an address hint on x86-64 and arm64
DEFAULT_MAX_MAP_COUNT = 65530


def gib(n: int | float) -> str:
    return f"{n / 2**30:,.1f} GiB"


def _meminfo() -> dict[str, int]:
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, value = line.split(":", 1)
                out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def _cgroup_limit() -> int | None:
    """memory.max (+ memory.swap.max) of this process's cgroup (v2), None when unlimited or unknown."""
    try:
        with open("/proc/self/cgroup") as f:
            path = next((line.split("::", 1)[1].strip() for line in f if line.startswith("0::")), None)
        if path is None:
            return None
        base = os.path.join("/sys/fs/cgroup", path.lstrip("/"))
        with open(os.path.join(base, "memory.max")) as f:
            mem = f.read().strip()
        if mem == "max":
            return None
        swap = 0
        try:
            with open(os.path.join(base, "memory.swap.max")) as f:
                s = f.read().strip()
            swap = 0 if s == "max" else int(s)
        except OSError:
            pass
        return int(mem) + swap
    except (OSError, ValueError):
        return None


def backable_bytes() -> tuple[int, str]:
    """Bytes of pages this machine can back (RAM + swap, or the cgroup's limit if lower), and how it was found."""
    info = _meminfo()
    ram, swap = info.get("MemTotal", 0), info.get("SwapTotal", 0)
    total, how = ram + swap, f"{gib(ram)} RAM + {gib(swap)} swap"
    cg = _cgroup_limit()
    if cg is not None and cg < total:
        total, how = cg, f"the cgroup memory limit {gib(cg)} ({how})"
    return total, how


def check_host_capacity(capacity_pages: int, page_size: int, overcommit: bool) -> None:
    """Refuse a host pool the machine cannot back, unless overcommit=True."""
    if overcommit:
        return
    capacity = capacity_pages * page_size
    limit, how = backable_bytes()
    if limit and capacity > limit:
        raise InvalidArgumentError(
            f"a host pool of {gib(capacity)} ({capacity_pages:,} pages of {page_size // 1024} KiB) is more than this "
            f"machine can back: {how} = {gib(limit)}. Its pages are sparse, so nothing would fail until tokens are "
            f"written past physical memory, and then the kernel's OOM killer ends the process instead of an "
            f"OutOfPagesError. Give capacity_bytes <= {limit:,}, or overcommit=True to accept that risk."
        )


def mapping_limit() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return DEFAULT_MAX_MAP_COUNT


def _maps() -> list[tuple[int, int]]:
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = line.split(None, 1)[0].split("-")
            out.append((int(lo, 16), int(hi, 16)))
    return out


def mapping_count() -> int:
    """Mappings this process holds now (lines of /proc/self/maps)."""
    return len(_maps())


def reservable_bytes() -> int:
    """The largest piece of virtual address space the process can still reserve (below the 47-bit limit,
    and within RLIMIT_AS)."""
    maps = _maps()
    largest, prev = 0, 1 << 16
    for lo, hi in sorted(maps):
        if lo >= USER_ADDRESS_SPACE:
            break
        largest = max(largest, lo - prev)
        prev = max(prev, hi)
    largest = max(largest, USER_ADDRESS_SPACE - prev)
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        largest = min(largest, max(0, soft - sum(hi - lo for lo, hi in maps)))
    return largest
