"""bench_allocator: torch memory from vpaged's page pool against torch's own allocators.

Host (always): vpaged_torch_malloc + vpaged_torch_free on the host pool (device -1, 2 MiB pages) and
vpaged.empty against torch.empty on the CPU, at 2 MiB and 20 MiB.

GPU (when torch and vpaged can use CUDA):
  * latency of one malloc + free at 2 MiB and 20 MiB: the hook's C entry points (free waits for the
    device, then unmaps), cudaMalloc + cudaFree (the runtime torch loaded), and torch's caching allocator
    in steady state (torch.empty + del, memory cached);
  * a mixed-size workload (seeded random sizes 4 KiB..64 MiB, allocations and frees interleaved), each
    mode in a fresh process: torch's default allocator, expandable_segments:True and the vpaged hook
    scope. Reported: reserved - allocated (mean and max over the run, MiB) and the run's time.

    python benchmarks/bench_allocator.py [--quick]

Writes benchmarks/results/allocator_cpu.json (no GPU) or allocator_gpu.json. Runs in well under a minute.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, median_time, print_table, write_json  # noqa: E402

import vpaged  # noqa: E402
import vpaged._C as C  # noqa: E402

MiB = 1 << 20
SIZES = (2 * MiB, 20 * MiB)


def entry_points():
    lib = ctypes.CDLL(C.__file__)
    lib.vpaged_torch_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.vpaged_torch_malloc.restype = ctypes.c_void_p
    lib.vpaged_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.vpaged_torch_free.restype = None
    lib.vpaged_torch_last_error.restype = ctypes.c_char_p
    return lib


def pair_us(malloc, free, size, repeats, inner) -> float:
    """Median µs of one malloc + free of `size` bytes."""

    def once():
        p = malloc(size)
        if not p:
            raise RuntimeError(f"allocation of {size} bytes failed")
        free(p, size)

    once()  # first touch of the path (driver tables, page creation)
    return median_time(once, repeats, inner) * 1e6


def host_part(repeats, inner) -> dict:
    lib = entry_points()
    pool = vpaged.PagePool("cpu", capacity_bytes=1 << 30, page_size=2 * MiB)
    allocator = C.PoolAllocator(pool._pool, 0)
    C.bind_device_allocator(-1, allocator)
    try:
        rows, out = [], {}
        for size in SIZES:
            hook = pair_us(
                lambda n: lib.vpaged_torch_malloc(n, -1, None),
                lambda p, n: lib.vpaged_torch_free(p, n, -1, None),
                size,
                repeats,
                inner,
            )
            empty = median_time(lambda: vpaged.empty(size, torch.uint8, pool=pool), repeats, inner) * 1e6
            torch_empty = median_time(lambda: torch.empty(size, dtype=torch.uint8), repeats, inner) * 1e6
            out[str(size)] = {
                "hook_malloc_free_us": hook,
                "vpaged_empty_us": empty,
                "torch_empty_us": torch_empty,
                "vpaged_empty_over_torch_empty": empty / torch_empty,
            }
            rows.append(
                [
                    f"{size // MiB} MiB",
                    f"{hook:.1f}",
                    f"{empty:.1f}",
                    f"{torch_empty:.1f}",
                    f"{empty / torch_empty:.1f}x",
                ]
            )
        print("host (2 MiB pages): one allocation + free, median µs")
        print_table(["size", "hook C calls", "vpaged.empty", "torch.empty", "empty ratio"], rows)
        assert pool.stats().used_pages == 0
        return out
    finally:
        C.unbind_device_allocator(-1, allocator)


def cudart():
    """The CUDA runtime torch loaded (found in this process's mappings), or None."""
    torch.cuda.init()
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "libcudart" in line}
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
            lib.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
            lib.cudaFree.argtypes = [ctypes.c_void_p]
            return lib
        except OSError:
            continue
    return None


def gpu_latency(repeats, inner) -> dict:
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    pool = vpaged.PagePool(dev, capacity_bytes=1 << 30, reserve_pages=64)
    hook = vpaged.torch_allocator(pool, dev)
    lib = entry_points()
    rt = cudart()
    out, rows = {}, []
    try:
        for size in SIZES:
            torch.cuda.synchronize()
            r = {
                "hook_malloc_free_us": pair_us(
                    lambda n: lib.vpaged_torch_malloc(n, 0, None),
                    lambda p, n: lib.vpaged_torch_free(p, n, 0, None),
                    size,
                    repeats,
                    inner,
                )
            }
            if rt is not None:

                def rt_malloc(n):
                    p = ctypes.c_void_p()
                    return p.value if rt.cudaMalloc(ctypes.byref(p), n) == 0 else None

                r["cudaMalloc_free_us"] = pair_us(
                    rt_malloc, lambda p, n: rt.cudaFree(ctypes.c_void_p(p)), size, repeats, inner
                )
            r["caching_allocator_us"] = (
                median_time(lambda: torch.empty(size, dtype=torch.uint8, device=dev), repeats, inner * 10) * 1e6
            )
            with hook.scope():
                r["hook_scope_cached_us"] = (
                    median_time(lambda: torch.empty(size, dtype=torch.uint8, device=dev), repeats, inner * 10) * 1e6
                )
            out[str(size)] = r
            rows.append(
                [
                    f"{size // MiB} MiB",
                    f"{r['hook_malloc_free_us']:.0f}",
                    f"{r.get('cudaMalloc_free_us', float('nan')):.0f}",
                    f"{r['caching_allocator_us']:.1f}",
                    f"{r['hook_scope_cached_us']:.1f}",
                ]
            )
        print("GPU: one allocation + free, median µs")
        print_table(
            ["size", "vpaged hook C calls", "cudaMalloc+cudaFree", "torch cached", "in hook scope, cached"], rows
        )
        if rt is None:
            out["note"] = "libcudart not found in the process mappings: no cudaMalloc row"
    finally:
        hook.close()
    return out


# ---------------------------------------------------------------------------------------------------
# Mixed-size workload, one mode per process (allocator settings are fixed when torch starts).

MODES = {
    "default": {},
    "expandable_segments": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},  # read by every torch 2.x
    "vpaged_scope": {},
}


def workload(mode: str, steps: int, seed: int) -> dict:
    import contextlib
    import random

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    torch.empty(1, device=dev)
    rnd = random.Random(seed)
    hook = None
    scope = contextlib.nullcontext()
    if mode.startswith("vpaged"):
        pool = vpaged.PagePool(dev, capacity_bytes=8 << 30, reserve_pages=256)
        hook = vpaged.torch_allocator(pool, dev)
        scope = hook.scope()
    torch.cuda.synchronize()
    base_res, base_alloc = torch.cuda.memory_reserved(dev), torch.cuda.memory_allocated(dev)
    gaps, live = [], []
    t0 = time.perf_counter()
    with scope:
        for _ in range(steps):
            if live and (len(live) >= 48 or rnd.random() < 0.45):
                live.pop(rnd.randrange(len(live)))
            else:
                size = int(2 ** rnd.uniform(12, 26))  # 4 KiB .. 64 MiB, log-uniform
                live.append(torch.empty(size, dtype=torch.uint8, device=dev))
            res = torch.cuda.memory_reserved(dev) - base_res
            alloc = torch.cuda.memory_allocated(dev) - base_alloc
            gaps.append(res - alloc)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        peak_alloc = torch.cuda.max_memory_allocated(dev) - base_alloc
        live.clear()
    out = {
        "mode": mode,
        "steps": steps,
        "seconds": elapsed,
        "gap_mean_mib": sum(gaps) / len(gaps) / MiB,
        "gap_max_mib": max(gaps) / MiB,
        "peak_allocated_mib": peak_alloc / MiB,
    }
    if hook is not None:
        out["pool_peak_mib"] = pool.stats().high_water_pages * pool.page_size / MiB
        hook.close()
    return out


def run_workloads(steps: int, seed: int) -> dict:
    results, rows = {}, []
    for mode, env_extra in MODES.items():
        env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
        env.update(env_extra)
        proc = subprocess.run(
            [sys.executable, __file__, "--worker", mode, "--steps", str(steps), "--seed", str(seed)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if proc.returncode != 0:
            results[mode] = {"error": proc.stderr[-2000:]}
            rows.append([mode, "error", "", "", ""])
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        results[mode] = r
        rows.append(
            [
                mode,
                f"{r['gap_mean_mib']:.1f}",
                f"{r['gap_max_mib']:.1f}",
                f"{r['peak_allocated_mib']:.0f}",
                f"{r['seconds'] * 1e3:.0f}",
            ]
        )
    print(f"GPU mixed-size workload ({steps} steps, seed {seed}): reserved - allocated")
    print_table(["mode", "mean MiB", "max MiB", "peak allocated MiB", "ms"], rows)
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--worker", choices=list(MODES))
    ap.add_argument("--steps", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(workload(args.worker, args.steps, args.seed)))
        return
    repeats, inner = (5, 20) if args.quick else (9, 50)
    payload = {"machine": machine(), "host": host_part(repeats, inner)}
    gpu = torch.cuda.is_available() and C.cuda_unavailable_reason(0) == ""
    payload["gpu"] = gpu
    if gpu:
        payload["gpu_latency"] = gpu_latency(repeats, inner)
        payload["gpu_workload"] = run_workloads(400 if args.quick else 1000, seed=1234)
    else:
        payload["gpu_skipped"] = (
            "torch has no CUDA device" if not torch.cuda.is_available() else C.cuda_unavailable_reason(0)
        )
        print(f"GPU part skipped: {payload['gpu_skipped']}")
    path = write_json("allocator_gpu.json" if gpu else "allocator_cpu.json", payload)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
