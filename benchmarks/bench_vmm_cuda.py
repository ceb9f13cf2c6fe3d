"""CUDA virtual memory on a real GPU: driver-call costs, vpaged's mapping cost per page, driver calls of a
steady workload, and attention on VMM-backed K/V against ordinary tensors.

  python benchmarks/bench_vmm_cuda.py [--quick] [--out PATH] [--require-gpu] [--parts driver,map,steady,sdpa]

Runs only where vpaged's CUDA backend is usable; elsewhere it prints why and exits (status 0, or 2 with
--require-gpu). Each part is independent: one that fails records its error in the JSON and the others run.

1. driver: per-call cost of cuMemCreate / cuMemMap / cuMemSetAccess / cuMemUnmap / cuMemRelease on pages of
   the allocation granularity (2 MiB), called through cuda-python (cuda.bindings.driver) directly, one page
   per call, then cuMemSetAccess and cuMemUnmap once over a run of pages. The floor vpaged builds on
   (Python-call overhead of the bindings included; cuCtxGetCurrent is timed as that overhead).
2. map: vpaged's VirtualRange.map_new over runs of 1, 8 and 64 slots, then unmap, with the pages created
   ahead: µs per page. Goal: <= 10 µs per page amortized (map and unmap each).
3. steady: a continuous-batching workload on a VirtualKVCache with VirtualCacheConfig(device="cuda") (sequences finish, are freed and
   replaced; every step extends the batch by one token) counted with backend.map_calls / unmap_calls.
   Goal: zero driver calls per decode step once every slot has been used (deferred reclamation).
4. sdpa: torch.nn.functional.scaled_dot_product_attention, bf16, GQA, one query token, on kv_batch views of
   a VirtualKVCache versus the same call on ordinary CUDA tensors with the same strides and data (and on
   dense copies), at several context lengths; medians of CUDA-event timings. Goal: <= 1.03x.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, print_table, write_json  # noqa: E402

import vpaged  # noqa: E402
from vpaged import (
    _C,  # noqa: E402
    KVGeometry,
    VirtualCacheConfig,
)

DEVICE = 0
GOAL_US_PER_PAGE = 10.0
GOAL_SDPA_RATIO = 1.03
RESULT_NAME = "vmm_cuda.json"


def us(ns: float) -> float:
    return ns / 1e3


def median(xs) -> float:
    return statistics.median(xs) if xs else float("nan")


def p90(xs) -> float:
    return sorted(xs)[int(0.9 * (len(xs) - 1))] if xs else float("nan")


# --------------------------------------------------------------------------------------------------- 1
def bench_driver(quick: bool) -> dict:
    """Per-call costs through cuda-python, with the device's primary context pushed on this thread."""
    from cuda.bindings import driver as cu

    def call(name, *args):
        ret = getattr(cu, name)(*args)
        err, values = ret[0], ret[1:]
        if err != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"{name} failed: {err!r}")
        return values[0] if len(values) == 1 else values

    def timed(samples, name, *args):
        t0 = time.perf_counter_ns()
        ret = getattr(cu, name)(*args)
        samples.append(time.perf_counter_ns() - t0)
        if ret[0] != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"{name} failed: {ret[0]!r}")
        return ret[1] if len(ret) == 2 else None

    call("cuInit", 0)
    dev = call("cuDeviceGet", DEVICE)
    ctx = call("cuDevicePrimaryCtxRetain", dev)
    call("cuCtxPushCurrent", ctx)
    try:
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = DEVICE
        gran = call(
            "cuMemGetAllocationGranularity", prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        )
        access = cu.CUmemAccessDesc()
        access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = DEVICE
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        pages = 32 if quick else 64
        rounds = 2 if quick else 4
        s = {
            k: []
            for k in (
                "binding_overhead",
                "cuMemCreate",
                "cuMemMap",
                "cuMemSetAccess",
                "cuMemUnmap",
                "cuMemRelease",
                "cuMemSetAccess_run",
                "cuMemUnmap_run",
            )
        }
        run_unmap_error = None
        for _ in range(rounds):
            for _ in range(pages):
                timed(s["binding_overhead"], "cuCtxGetCurrent")
            base = int(call("cuMemAddressReserve", pages * gran, gran, 0, 0))
            handles = [timed(s["cuMemCreate"], "cuMemCreate", gran, prop, 0) for _ in range(pages)]
            # One page per call: map, grant access, unmap.
            for i, h in enumerate(handles):
                timed(s["cuMemMap"], "cuMemMap", base + i * gran, gran, 0, h, 0)
            for i in range(pages):
                timed(s["cuMemSetAccess"], "cuMemSetAccess", base + i * gran, gran, [access], 1)
            for i in range(pages):
                timed(s["cuMemUnmap"], "cuMemUnmap", base + i * gran, gran)
            # The whole run in one call each (how vpaged batches).
            for i, h in enumerate(handles):
                call("cuMemMap", base + i * gran, gran, 0, h, 0)
            timed(s["cuMemSetAccess_run"], "cuMemSetAccess", base, pages * gran, [access], 1)
            try:
                timed(s["cuMemUnmap_run"], "cuMemUnmap", base, pages * gran)
            except RuntimeError as e:  # a driver that refuses to unmap several mappings at once
                run_unmap_error = str(e)
                for i in range(pages):
                    call("cuMemUnmap", base + i * gran, gran)
            for h in handles:
                timed(s["cuMemRelease"], "cuMemRelease", h)
            call("cuMemAddressFree", base, pages * gran)
    finally:
        call("cuCtxPopCurrent")
        call("cuDevicePrimaryCtxRelease", dev)
    per_call = {k: {"median_us": us(median(v)), "p90_us": us(p90(v)), "samples": len(v)} for k, v in s.items() if v}
    for k in ("cuMemSetAccess_run", "cuMemUnmap_run"):
        if k in per_call:
            per_call[k]["per_page_us"] = per_call[k]["median_us"] / pages
    print(f"driver calls through cuda-python, {gran >> 20} MiB pages, {pages} pages x {rounds} rounds (µs)")
    print_table(
        ["call", "median", "p90", "per page"],
        [
            [k, f"{v['median_us']:.2f}", f"{v['p90_us']:.2f}", f"{v.get('per_page_us', v['median_us']):.2f}"]
            for k, v in per_call.items()
        ],
    )
    if run_unmap_error:
        print(f"  cuMemUnmap over a run of mappings was refused: {run_unmap_error}")
    return {
        "granularity": gran,
        "pages": pages,
        "rounds": rounds,
        "per_call": per_call,
        "unmap_run_supported": run_unmap_error is None,
        "unmap_run_error": run_unmap_error,
    }


# --------------------------------------------------------------------------------------------------- 2
def bench_map(quick: bool) -> dict:
    """vpaged map_new / unmap per page over runs of page indices, pages created ahead."""
    gran = _C.cuda_granularity(DEVICE)
    runs = (1, 8, 64)
    capacity = max(runs)
    backend = _C.cuda_backend(DEVICE, gran, capacity, capacity)
    pool = _C.PagePool(backend, 0)
    r = _C.VirtualRange(pool, capacity * gran)
    repeats = 10 if quick else 40
    rows, out = [], {}
    for run in runs:
        indices = list(range(run))
        r.map_new(indices)  # warm-up
        r.unmap(indices)
        maps, unmaps = [], []
        m0, u0 = backend.map_calls, backend.unmap_calls
        for _ in range(repeats):
            t0 = time.perf_counter_ns()
            r.map_new(indices)
            t1 = time.perf_counter_ns()
            r.unmap(indices)
            t2 = time.perf_counter_ns()
            maps.append((t1 - t0) / run)
            unmaps.append((t2 - t1) / run)
        entry = {
            "map_us_per_page": us(median(maps)),
            "unmap_us_per_page": us(median(unmaps)),
            "map_p90_us_per_page": us(p90(maps)),
            "unmap_p90_us_per_page": us(p90(unmaps)),
            "driver_map_calls_per_run": (backend.map_calls - m0) / repeats,
            "driver_unmap_calls_per_run": (backend.unmap_calls - u0) / repeats,
        }
        out[str(run)] = entry
        rows.append(
            [
                run,
                f"{entry['map_us_per_page']:.2f}",
                f"{entry['unmap_us_per_page']:.2f}",
                f"{entry['map_us_per_page'] + entry['unmap_us_per_page']:.2f}",
                f"{entry['driver_map_calls_per_run']:.0f}",
                f"{entry['driver_unmap_calls_per_run']:.0f}",
            ]
        )
    del r, pool, backend
    gc.collect()
    best = out[str(max(runs))]
    print(f"vpaged map_new / unmap of a run of slots, {gran >> 20} MiB pages created ahead (median µs per page)")
    print_table(["run", "map", "unmap", "map+unmap", "driver maps/run", "driver unmaps/run"], rows)
    return {
        "granularity": gran,
        "repeats": repeats,
        "runs": out,
        "goal_us_per_page": GOAL_US_PER_PAGE,
        "goal_met_map": best["map_us_per_page"] <= GOAL_US_PER_PAGE,
        "goal_met_unmap": best["unmap_us_per_page"] <= GOAL_US_PER_PAGE,
    }


# --------------------------------------------------------------------------------------------------- 3
def steady_workload(cache, batch: int, steps: int, prompt, decode, seed: int) -> dict:
    """Continuous batching: `batch` sequences decode one token per step; one that reaches its length is
    freed and replaced at once by a new request (prefill of prompt() tokens, then decode() steps). Counting
    starts when every slot has been freed twice: from then on every request runs in a slot that already
    served a request of the steady mix."""
    import random

    rnd = random.Random(seed)
    backend = cache.pool.backend
    live = {}  # seq -> decode steps left
    frees = [0] * cache.max_seqs  # per slot

    def admit(steps_left):
        seq = cache.allocate()
        cache.extend(seq, prompt(rnd))
        live[seq] = steps_left

    for i in range(batch):
        admit(decode(rnd) * (i + 1) // batch + 1)  # staggered, so that requests end at different steps
    warm_at, counts, step_ns = None, None, []
    for step in range(steps):
        if warm_at is None and min(frees) >= 2:
            warm_at, counts = step, (backend.map_calls, backend.unmap_calls)
        t0 = time.perf_counter_ns()
        seqs = list(live)
        cache.extend_many(seqs, 1)
        for seq in seqs:
            live[seq] -= 1
            if live[seq] <= 0:
                frees[cache.slot(seq)] += 1
                del live[seq]
                cache.free(seq)
                admit(decode(rnd))
        if warm_at is not None:
            step_ns.append(time.perf_counter_ns() - t0)
    if warm_at is None:
        return {"warm": False, "steps": steps, "note": "some slot was not reused twice: run longer"}
    measured = steps - warm_at
    maps, unmaps = backend.map_calls - counts[0], backend.unmap_calls - counts[1]
    return {
        "warm": True,
        "warm_after_steps": warm_at,
        "measured_steps": measured,
        "map_calls": maps,
        "unmap_calls": unmaps,
        "driver_calls_per_step": (maps + unmaps) / measured,
        "host_us_per_step_median": us(median(step_ns)),
        "host_us_per_step_p90": us(p90(step_ns)),
    }


def bench_steady(quick: bool) -> dict:
    gran = _C.cuda_granularity(DEVICE)
    # Llama-3-8B geometry (32 layers, 8 KV heads of 128, bf16): 1,024 tokens per page and region.
    layers, heads, dim, batch, max_len = 32, 8, 128, 8, 4096
    steps = 1500 if quick else 4000
    cap_pages = 2 * layers * batch * (max_len * heads * dim * 2 // gran)  # every slot full: no reclamation
    out = {}
    scenarios = {
        # Every request the same length: a reused slot always has the pages it needs.
        "fixed_lengths": (lambda rnd: 1000, lambda rnd: 200),
        # Lengths vary: a request longer than its slot's previous one maps the difference.
        "varied_lengths": (lambda rnd: rnd.randint(100, 2500), lambda rnd: rnd.randint(50, 600)),
    }
    rows = []
    for name, (prompt, decode) in scenarios.items():
        cache = vpaged.VirtualKVCache(
            KVGeometry(layers, heads, dim, torch.bfloat16),
            VirtualCacheConfig(
                max_seqs=batch, max_seq_len=max_len, device=f"cuda:{DEVICE}", capacity_bytes=cap_pages * gran
            ),
        )
        res = steady_workload(cache, batch, steps, prompt, decode, seed=1234)
        cache.close()
        del cache
        gc.collect()
        out[name] = res
        if res["warm"]:
            rows.append(
                [
                    name,
                    res["measured_steps"],
                    res["map_calls"],
                    res["unmap_calls"],
                    f"{res['driver_calls_per_step']:.3f}",
                    f"{res['host_us_per_step_median']:.1f}",
                ]
            )
        else:
            rows.append([name, "-", "-", "-", "-", res["note"]])
    print(f"steady decode, {batch} sequences, {layers} layers x {heads} KV heads x {dim}, bf16, per_layer layout")
    print_table(["workload", "steps", "map calls", "unmap calls", "calls/step", "host µs/step"], rows)
    fixed = out["fixed_lengths"]
    return {
        "scenarios": out,
        "goal_driver_calls_per_step": 0,
        "goal_met": bool(fixed.get("warm")) and fixed["driver_calls_per_step"] == 0,
    }


# --------------------------------------------------------------------------------------------------- 4
def cuda_median_ms(fns: dict, inner: int, repeats: int) -> dict:
    """Median ms per call of each fn, timed with CUDA events, interleaving the fns every repeat."""
    samples = {k: [] for k in fns}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for k, fn in fns.items():  # warm-up
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    for _ in range(repeats):
        for k, fn in fns.items():
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            samples[k].append(start.elapsed_time(end) / inner)
    return {k: median(v) for k, v in samples.items()}


def bench_sdpa(quick: bool) -> dict:
    if not torch.cuda.is_available():
        raise RuntimeError(f"torch {torch.__version__} has no usable CUDA: SDPA cannot run on the GPU")
    dev = torch.device("cuda", DEVICE)
    torch.cuda.set_device(dev)
    gran = _C.cuda_granularity(DEVICE)
    q_heads, kv_heads, dim, batch = 32, 8, 128, 8
    contexts = (512, 2048, 8192) if quick else (512, 2048, 8192, 32768)
    inner, repeats = (10, 15) if quick else (20, 31)
    gen = torch.Generator(device=dev).manual_seed(0)
    out, rows = {}, []
    for ctx in contexts:
        per_seq_bytes = 2 * ctx * kv_heads * dim * 2  # K and V, bf16
        pages = batch * 2 * -(-(ctx * kv_heads * dim * 2) // gran)  # K and V regions, whole pages each
        cache = vpaged.VirtualKVCache(
            KVGeometry(1, kv_heads, dim, torch.bfloat16),
            VirtualCacheConfig(max_seqs=batch, max_seq_len=ctx, device=dev, capacity_bytes=pages * gran),
        )
        seqs = cache.allocate_many(batch)
        cache.extend_many(seqs, ctx)
        for s in seqs:
            k = torch.randn(ctx, kv_heads, dim, device=dev, dtype=torch.bfloat16, generator=gen)
            v = torch.randn(ctx, kv_heads, dim, device=dev, dtype=torch.bfloat16, generator=gen)
            cache.write(0, s, k, v)
        kv_k, kv_v = cache.kv_batch(0, seqs)  # [B, ctx, H, D], batch stride = slot stride

        def same_strides(t):
            base = torch.empty(
                t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1,
                dtype=t.dtype,
                device=dev,
            )
            return base.as_strided(t.shape, t.stride()).copy_(t)

        ord_k, ord_v = same_strides(kv_k), same_strides(kv_v)
        dense_k, dense_v = kv_k.contiguous(), kv_v.contiguous()
        q = torch.randn(batch, q_heads, 1, dim, device=dev, dtype=torch.bfloat16, generator=gen)

        def attend(k, v):
            return F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True)

        a, b, c = attend(kv_k, kv_v), attend(ord_k, ord_v), attend(dense_k, dense_v)
        identical = bool(torch.equal(a, b))
        max_diff = float((a.float() - b.float()).abs().max())
        max_diff_dense = float((a.float() - c.float()).abs().max())
        t = cuda_median_ms(
            {
                "vmm": lambda: attend(kv_k, kv_v),
                "ordinary": lambda: attend(ord_k, ord_v),
                "dense": lambda: attend(dense_k, dense_v),
            },
            inner,
            repeats,
        )
        entry = {
            "context": ctx,
            "batch": batch,
            "q_heads": q_heads,
            "kv_heads": kv_heads,
            "head_dim": dim,
            "vmm_ms": t["vmm"],
            "ordinary_same_strides_ms": t["ordinary"],
            "dense_ms": t["dense"],
            "ratio_vs_same_strides": t["vmm"] / t["ordinary"],
            "ratio_vs_dense": t["vmm"] / t["dense"],
            "outputs_identical": identical,
            "max_abs_diff": max_diff,
            "max_abs_diff_vs_dense": max_diff_dense,
            "kv_bytes": batch * per_seq_bytes,
        }
        out[str(ctx)] = entry
        rows.append(
            [
                ctx,
                f"{t['vmm'] * 1e3:.1f}",
                f"{t['ordinary'] * 1e3:.1f}",
                f"{t['dense'] * 1e3:.1f}",
                f"{entry['ratio_vs_same_strides']:.3f}x",
                f"{entry['ratio_vs_dense']:.3f}x",
                "yes" if identical else f"no ({max_diff:.2g})",
            ]
        )
        del kv_k, kv_v, a, b, c  # the views pin the cache's pages
        cache.close()
        del cache, ord_k, ord_v, dense_k, dense_v
        gc.collect()
        torch.cuda.empty_cache()
    print(
        f"SDPA decode (1 query token), bf16, batch {batch}, {q_heads} query / {kv_heads} KV heads x {dim} "
        f"(median µs per call, CUDA events)"
    )
    print_table(["context", "VMM views", "ordinary", "dense", "VMM/ordinary", "VMM/dense", "identical"], rows)
    worst = max(e["ratio_vs_same_strides"] for e in out.values())
    return {
        "contexts": out,
        "goal_ratio": GOAL_SDPA_RATIO,
        "worst_ratio": worst,
        "goal_met": worst <= GOAL_SDPA_RATIO,
        "all_identical": all(e["outputs_identical"] for e in out.values()),
    }


# --------------------------------------------------------------------------------------------------- main
PARTS = {"driver": bench_driver, "map": bench_map, "steady": bench_steady, "sdpa": bench_sdpa}


def gpu_facts() -> dict:
    facts = {"device": DEVICE}
    try:
        line = subprocess.run(
            ["nvidia-smi", f"--id={DEVICE}", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout.strip()
        if line:
            name, driver, memory = (x.strip() for x in line.split(",", 2))
            facts.update(gpu=name, driver_version=driver, gpu_memory=memory)
    except (OSError, subprocess.SubprocessError) as e:
        facts["nvidia_smi_error"] = str(e)
    try:
        from cuda.bindings import driver as cu

        err, version = cu.cuDriverGetVersion()
        if err == cu.CUresult.CUDA_SUCCESS:
            facts["driver_cuda_version"] = f"{version // 1000}.{version % 1000 // 10}"
    except Exception as e:  # noqa: BLE001 - facts are best effort
        facts["cuda_bindings_error"] = f"{type(e).__name__}: {e}"
    facts["torch_cuda"] = torch.version.cuda
    if torch.cuda.is_available():
        facts["gpu"] = torch.cuda.get_device_name(DEVICE)
    facts["vmm_granularity"] = _C.cuda_granularity(DEVICE)
    return facts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repeats and contexts")
    ap.add_argument("--out", type=Path, help=f"JSON path (default benchmarks/results/{RESULT_NAME})")
    ap.add_argument("--require-gpu", action="store_true", help="exit 2 (not 0) when CUDA is not usable")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    args = ap.parse_args()
    parts = [p for p in args.parts.split(",") if p]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        ap.error(f"unknown part(s) {unknown}; choose from {list(PARTS)}")

    info = vpaged.backends()["cuda"]
    if not info.usable:
        print(f"bench_vmm_cuda: nothing measured: vpaged's CUDA backend is not usable here: {info.reason}")
        return 2 if args.require_gpu else 0

    if torch.cuda.is_available():
        # As in an inference process: torch has made the device's primary context current on this thread,
        # so vpaged's driver calls need no context push.
        torch.zeros(1, device=f"cuda:{DEVICE}")
    results = {
        "benchmark": "vmm_cuda",
        "complete": False,
        "machine": machine(),
        "gpu": gpu_facts(),
        "quick": args.quick,
        "parts": {},
    }
    failed = []

    def save() -> Path:  # after every part: a run stopped part way keeps the parts it finished
        results["goals"] = {name: part.get("goal_met") for name, part in results["parts"].items() if "goal_met" in part}
        if "map" in results["parts"] and "goal_met_map" in results["parts"]["map"]:
            m = results["parts"]["map"]
            results["goals"]["map"] = m["goal_met_map"]
            results["goals"]["unmap"] = m["goal_met_unmap"]
        results["failed_parts"] = failed
        return write_json(args.out if args.out is not None else RESULT_NAME, results)

    for name in parts:
        print(f"\n== {name}", flush=True)
        t0 = time.perf_counter()
        try:
            results["parts"][name] = PARTS[name](args.quick)
        except Exception as e:  # noqa: BLE001 - recorded; the other parts still run
            traceback.print_exc()
            results["parts"][name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            failed.append(name)
        results["parts"][name]["seconds"] = round(time.perf_counter() - t0, 2)
        save()
    results["complete"] = True
    path = save()
    print(f"\ngoals: {results['goals']}" + (f"; failed parts: {failed}" if failed else ""))
    print(f"wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
