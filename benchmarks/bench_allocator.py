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

Writes benchmarks/results/allocator_cpu.json (no GPU) or allocator_gpu.json, after every part (host, GPU
latency, each workload process), so a run stopped part way keeps the parts it finished: "complete" says
whether it got to the end, "failed_parts" names the parts that raised (the others still ran). The workload
processes each import torch and initialize CUDA (~10-25 s each on a cold machine): they start together so
that this overlaps, then measure one at a time, the vpaged mode first. Runs in well under a minute on a warm machine.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
import traceback
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

MODES = {  # in the order they run: vpaged's own first, so that a run stopped at its cap still has it
    "vpaged_scope": {},
    "default": {},
    "expandable_segments": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},  # read by every torch 2.x
}
WORKER_TIMEOUT_S = 90


def workload(mode: str, steps: int, seed: int, wait_go: bool = False) -> dict:
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
    if wait_go:  # started with the other modes' processes: measure only when the parent says so
        print("ready", flush=True)
        sys.stdin.readline()
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


def _start_worker(mode: str, steps: int, seed: int, stderr) -> tuple:
    """A worker process for `mode`, started at once; it reports "ready" after torch's import and CUDA's
    initialization, then waits for a line on stdin before it measures. Its stdout lines arrive in a queue."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
    env.update(MODES[mode])
    proc = subprocess.Popen(
        [sys.executable, __file__, "--worker", mode, "--steps", str(steps), "--seed", str(seed), "--wait-go"],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
    )
    lines: queue.Queue = queue.Queue()

    def read():
        for line in proc.stdout:
            lines.put(line.strip())
        lines.put(None)  # end of output

    threading.Thread(target=read, daemon=True).start()
    return proc, lines


def _next_line(lines: queue.Queue, deadline: float):
    """The worker's next non-empty stdout line; None at its end; raises TimeoutError past the deadline."""
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError from None
        if line is None or line:
            return line


def run_workloads(steps: int, seed: int, results: dict, save=lambda: None) -> dict:
    """One process per mode, into `results` (mode -> outcome); save() after each. The processes start
    together, so their imports and CUDA initializations (the slow part on a cold machine) overlap, and measure
    one at a time, in MODES order."""
    rows = []
    t_start = time.monotonic()
    workers = {}
    for mode in MODES:
        err = tempfile.TemporaryFile(mode="w+")
        workers[mode] = (*_start_worker(mode, steps, seed, err), err)
    try:
        for mode, (proc, lines, err) in workers.items():
            deadline = time.monotonic() + WORKER_TIMEOUT_S
            r = None
            try:
                if _next_line(lines, deadline) == "ready":
                    ready_s = round(time.monotonic() - t_start, 2)  # with torch's import and CUDA's initialization
                    proc.stdin.write("go\n")
                    proc.stdin.flush()
                    line = _next_line(lines, deadline)
                    if line is not None:
                        r = json.loads(line)
                        r["ready_seconds"] = ready_s
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except (TimeoutError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()
                results[mode] = {"error": f"the worker process ran past {WORKER_TIMEOUT_S}s"}
            except (OSError, ValueError) as e:  # a broken pipe, a line that is not JSON
                proc.kill()
                proc.wait()
                results[mode] = {"error": f"{type(e).__name__}: {e}"}
            if mode not in results:
                if r is not None and proc.returncode == 0:
                    results[mode] = r
                else:
                    err.seek(0)
                    results[mode] = {"error": f"exit status {proc.returncode}: {err.read()[-2000:]}"}
            save()
            if "error" in results[mode]:
                rows.append([mode, "error", "", "", ""])
                continue
            rows.append(
                [
                    mode,
                    f"{r['gap_mean_mib']:.1f}",
                    f"{r['gap_max_mib']:.1f}",
                    f"{r['peak_allocated_mib']:.0f}",
                    f"{r['seconds'] * 1e3:.0f}",
                ]
            )
    finally:
        for proc, _, err in workers.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            err.close()
    print(f"GPU mixed-size workload ({steps} steps, seed {seed}): reserved - allocated")
    print_table(["mode", "mean MiB", "max MiB", "peak allocated MiB", "ms"], rows)
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--worker", choices=list(MODES))
    ap.add_argument("--steps", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--wait-go", action="store_true", help=argparse.SUPPRESS)  # worker: wait for "go" on stdin
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(workload(args.worker, args.steps, args.seed, args.wait_go)))
        return
    repeats, inner = (5, 20) if args.quick else (9, 50)
    gpu = torch.cuda.is_available() and C.cuda_unavailable_reason(0) == ""
    name = "allocator_gpu.json" if gpu else "allocator_cpu.json"
    payload = {"benchmark": "allocator", "complete": False, "machine": machine(), "gpu": gpu, "seconds": {}}
    failed: list = []
    payload["failed_parts"] = failed

    def save():  # after every part: a run stopped part way keeps the parts it finished
        return write_json(name, payload)

    def part(key, fn):
        t0 = time.perf_counter()
        try:
            payload[key] = fn()
        except Exception as e:  # noqa: BLE001 - recorded; the other parts still run
            traceback.print_exc()
            payload[key] = {**(payload.get(key) or {}), "error": f"{type(e).__name__}: {e}"}  # keeps what it wrote
            failed.append(key)
        payload["seconds"][key] = round(time.perf_counter() - t0, 2)
        save()

    save()  # the machine facts, before anything can be stopped
    part("host", lambda: host_part(repeats, inner))
    if gpu:
        part("gpu_latency", lambda: gpu_latency(repeats, inner))
        payload["gpu_workload"] = {}
        part("gpu_workload", lambda: run_workloads(400 if args.quick else 1000, 1234, payload["gpu_workload"], save))
    else:
        payload["gpu_skipped"] = (
            "torch has no CUDA device" if not torch.cuda.is_available() else C.cuda_unavailable_reason(0)
        )
        print(f"GPU part skipped: {payload['gpu_skipped']}")
    payload["complete"] = True
    path = save()
    print(f"wrote {path}" + (f"; failed parts: {failed}" if failed else ""))


if __name__ == "__main__":
    main()
