"""Decode attention: contiguous kernel on a VirtualKVCache vs block-table kernel on a PagedKVCache vs SDPA.

Every cell puts the same random K/V into both caches (one layer, Llama-3-8B geometry: 8 kv heads, 32 query
heads, head_dim 128, block size 16 for the paged cache), runs

    contiguous  vpaged.ops.decode_attention on the VirtualKVCache (BatchedKV, per-sequence lengths)
    tensors     the same contiguous kernel on ordinary [B, T, H, D] tensors holding the same K/V
                (BatchedKV.from_tensors): what virtual memory itself costs
    paged       vpaged.ops.decode_attention on the PagedKVCache (block tables)
    sdpa        vpaged.ops.decode_attention_reference: torch SDPA per sequence over the cache views

and reports median times next to the bandwidth floor: the bytes of K/V a decode step must read divided
by the copy bandwidth of a large torch copy on the same device ((read + write bytes) / time), plus the
ratios the kernels are judged by (contiguous / paged, contiguous / tensors). Next to it, the read floor:
the same bytes over the rate of a large torch reduction (a pure streaming read, what a decode kernel does),
which on some machines is well below the copy rate. Both floors are also taken per cell (x_cell_floor): a
torch copy and a torch max over the cell's own K/V byte count, timed in the same round-robin as the kernels,
so that a machine whose memory speed drifts during a run (a shared VM) moves floor and kernels together.
The kernels of a cell are timed round-robin (one call of each per round), so a burst of load from other
processes lands on all of them alike. Caches are
flushed before every call by READING a buffer larger than the last-level cache, so every call reads K/V
from memory as a real decode step over many layers would. (A flush by writing would leave the cache full
of dirty lines: every K/V line the timed call brings in would then evict one and write it back, doubling
the call's memory traffic and charging the kernel for the flush.) The read also evicts the call's own code,
torch's dispatch and the Python objects it touches, which a decode step running the call once per layer
keeps warm (a 1-token call costs ~20 µs warm, 0.2-0.35 ms right after the flush, about half of a 512-token
cell): --warm-path runs each call once on a 1-token cache of its own after the flush, before the timed
call, so that only K/V come from memory. A last table times a call on a 1-token
context (fixed per-call cost: checks, descriptor, launch), without flushing.

    python benchmarks/bench_decode.py --quick --threads 2   # small grid, ~2-4 min on 2 cores
    python benchmarks/bench_decode.py                     # full grid: batch 1..64, context 512..16K
    python benchmarks/bench_decode.py --device cuda        # on a GPU (the full grid fits an H200)
    python benchmarks/bench_decode.py --quick --threads 1 --clock cpu   # on a machine busy with other work
    python benchmarks/bench_decode.py --quick --threads 2 --warm-path   # K/V cold, the call's own path warm

Against vLLM's CPU attention op (--vllm-python PATH, an interpreter with vLLM's CPU build; --vllm-only skips
the grid): 16 query / 8 KV heads, head_dim 128, batch 8 x 2K context and batch 1 x 16K, fp32 and bf16, the same
K/V in both. vpaged's contiguous kernel (decode_attention on a VirtualKVCache) is timed here; vLLM's
`cpu_attention_with_kv_cache` (what its CPU attention backend calls, on its own block layout) by
benchmarks/vllm_decode.py in the other interpreter, flushed the same way, at each block size of --vllm-blocks
(default 16, 32, 128: the ISA vLLM picks depends on it, its AMX kernel wants 32), the fastest taken as vLLM's
best kernel; vpaged is timed before and after that process (median of both). Rows: ms each, ratio vpaged
contiguous / vLLM's best, the read floor of the cell's K/V (its bytes over a torch reduction's rate, flushed
the same way) and the two outputs' max difference. --vllm-heads 16,32 adds the cells with 32 query heads (groups
of 4, where the products weigh more); --isas avx512bf16,amx times vpaged on each of those code paths as well, in
the same round-robin as the auto path:

    python benchmarks/bench_decode.py --vllm-python .venv-vllm/bin/python --vllm-only --dtypes bf16 \
        --vllm-heads 16,32 --isas avx512bf16,amx --threads 2

Writes benchmarks/results/decode_<device>.json. On CUDA the contiguous kernel reads a VirtualKVCache on the
CUDA VMM backend; where that backend is unusable (vpaged.backends() says why) it runs on a plain tensor with
the per_layer layout's strides instead, and the JSON says so.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

import vpaged
from vpaged import KVGeometry, PagedCacheConfig, PagedKVCache, VirtualCacheConfig, VirtualKVCache, ops
from vpaged.kvcache.virtual.cache import BatchedKV

KV_HEADS, HEADS, HEAD_DIM, BLOCK = 8, 32, 128, 16
from common import RESULTS, write_json  # noqa: E402 - this folder is on sys.path when run as a script

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def machine(device: torch.device) -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass

    def git(*cmd):
        try:
            return subprocess.run(
                ["git", *cmd], capture_output=True, text=True, cwd=Path(__file__).parent, check=False
            ).stdout.strip()
        except OSError:
            return ""

    commit = git("rev-parse", "--short", "HEAD")
    if commit and git("status", "--porcelain", "--untracked-files=no", "--", "csrc", "vpaged"):
        commit += "+modified"  # the kernels measured are not exactly the commit's
    info = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "vpaged_commit": commit,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "load_average": os.getloadavg(),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def last_level_cache_bytes() -> int:
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index3/size") as f:
            text = f.read().strip()
        return int(text[:-1]) << {"K": 10, "M": 20, "G": 30}[text[-1]] if text[-1] in "KMG" else int(text)
    except (OSError, ValueError, KeyError):
        return 0


class Timer:
    """Median seconds of fns over repeats, each call after flushing the caches; the fns of one measurement
    run round-robin. On CUDA timed by events; on the CPU by the wall clock, or with clock="cpu" by the
    calling thread's CPU time (single-threaded runs on a machine shared with other work, where time slices
    taken by other processes would land in wall time)."""

    def __init__(self, device: torch.device, clock: str = "wall"):
        self.device = device
        self.clock = time.thread_time if clock == "cpu" else time.perf_counter
        # Larger than the last-level cache: 50 MiB L2 on an H100/H200; on the CPU twice the L3 (some server
        # CPUs have hundreds of MiB), at least 256 MiB.
        size = 256 << 20 if device.type == "cuda" else max(256 << 20, min(2 * last_level_cache_bytes(), 2 << 30))
        # Written once here; each flush then reads it, which leaves the cache holding clean lines only.
        self.flush = torch.ones(size // 4, dtype=torch.int32, device=device)

    def flush_caches(self) -> None:
        self.flush.max()

    def __call__(self, fn, repeats: int) -> float:
        return self.many({"fn": fn}, repeats)["fn"]

    def many(self, fns: dict, repeats: dict | int, flush: bool = True, primes: dict | None = None) -> dict:
        """primes: per fn name, a call run after the flush and before the timed call (see --warm-path)."""
        primes = primes or {}
        if isinstance(repeats, int):
            repeats = {name: repeats for name in fns}
        for fn in fns.values():
            fn()  # warm-up: first-touch, lazy init, allocator
        samples = {name: [] for name in fns}
        for r in range(max(repeats.values())):
            for name, fn in fns.items():
                if r >= repeats[name]:
                    continue
                if flush:
                    self.flush_caches()
                if name in primes:
                    primes[name]()
                if self.device.type == "cuda":
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    fn()
                    end.record()
                    end.synchronize()
                    samples[name].append(start.elapsed_time(end) / 1e3)
                else:
                    t0 = self.clock()
                    fn()
                    samples[name].append(self.clock() - t0)
        return {name: statistics.median(s) for name, s in samples.items()}


def copy_bandwidth(device: torch.device, timer: Timer) -> float:
    """Bytes per second moved (read + written) by a large torch copy."""
    src = torch.ones(512 << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = timer(lambda: dst.copy_(src), 7)
    return 2 * src.numel() / t


def read_bandwidth(device: torch.device, timer: Timer) -> float:
    """Bytes per second read by a large torch reduction (a pure streaming read, like a decode kernel's)."""
    src = torch.ones(128 << 20, dtype=torch.int32, device=device)
    t = timer(lambda: src.max(), 7)
    return 4 * src.numel() / t


def tensor_contiguous(batch: int, ctx: int, dtype, device):
    """K/V as plain [batch, ctx, kv_heads, head_dim] tensors and their BatchedKV (BatchedKV.from_tensors)."""
    k = torch.empty(batch, ctx, KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    v = torch.empty_like(k)
    return (k, v), BatchedKV.from_tensors(k, v, ctx)


KERNELS = ("contiguous", "tensors", "paged", "sdpa")


def run_cell(
    batch: int,
    ctx: int,
    dtype,
    device,
    timer: Timer,
    repeats: int,
    bw: float,
    layout: str,
    use_vmm: bool,
    read_bw: float | None = None,
    primes: dict | None = None,
) -> dict:
    itemsize = torch.empty((), dtype=dtype).element_size()
    token_bytes = KV_HEADS * HEAD_DIM * itemsize
    paged = PagedKVCache(
        KVGeometry(1, KV_HEADS, HEAD_DIM, dtype),
        PagedCacheConfig(
            max_seqs=batch, max_seq_len=ctx, device=device, num_blocks=batch * -(-ctx // BLOCK), block_size=BLOCK
        ),
    )
    pseqs = paged.allocate_many(batch)
    if use_vmm:
        virt = VirtualKVCache(
            KVGeometry(1, KV_HEADS, HEAD_DIM, dtype),
            VirtualCacheConfig(
                max_seqs=batch,
                max_seq_len=ctx,
                device=device,
                layout=layout,
                capacity_bytes=2 * batch * (ctx * token_bytes + (2 << 20)),
            ),
        )
        vseqs = virt.allocate_many(batch)
    (kt, vt), desc = tensor_contiguous(batch, ctx, dtype, device)
    for i in range(batch):
        k = torch.randn(ctx, KV_HEADS, HEAD_DIM, device=device).to(dtype)
        v = torch.randn(ctx, KV_HEADS, HEAD_DIM, device=device).to(dtype)
        paged.extend(pseqs[i], ctx)
        paged.write(0, pseqs[i], k, v)
        if use_vmm:
            virt.extend(vseqs[i], ctx)
            virt.write(0, vseqs[i], k, v)
        kt[i], vt[i] = k, v
    q = torch.randn(batch, HEADS, HEAD_DIM, device=device).to(dtype)
    outs = {name: torch.empty_like(q) for name in KERNELS}

    def contiguous():
        if use_vmm:
            ops.decode_attention(q, virt, vseqs, 0, out=outs["contiguous"])
        else:
            ops.decode_attention_contiguous(q, desc, out=outs["contiguous"], max_len=ctx)

    def tensors():
        ops.decode_attention_contiguous(q, desc, out=outs["tensors"], max_len=ctx)

    def block_table():
        ops.decode_attention(q, paged, pseqs, 0, out=outs["paged"])

    def sdpa():
        if use_vmm:
            ops.decode_attention_reference(q, virt, vseqs, 0, out=outs["sdpa"])
        else:
            ops.decode_attention_reference(q, paged, pseqs, 0, out=outs["sdpa"])

    kernels = {"contiguous": contiguous, "tensors": tensors, "paged": block_table, "sdpa": sdpa}
    kv_bytes = 2 * batch * ctx * token_bytes
    floor = kv_bytes / bw
    cell = {
        "dtype": str(dtype).removeprefix("torch."),
        "batch": batch,
        "context": ctx,
        "kv_bytes": kv_bytes,
        "floor_ms": floor * 1e3,
        "read_floor_ms": kv_bytes / read_bw * 1e3 if read_bw else None,
        "load_average": os.getloadavg(),
        "kernels": {},
    }
    # The floors again at this cell's size, timed in the same round-robin as the kernels (flushed alike):
    # a torch copy of kv_bytes (its bytes moved are twice the K/V read, so half its time is the floor) and
    # a torch max over kv_bytes. A drift of the machine between the start of the run and this cell then
    # lands on floor and kernels alike; small cells also pay an op's fixed cost here, as a kernel does.
    src = torch.ones(kv_bytes // 4, dtype=torch.int32, device=device)
    dst = torch.empty_like(src)
    floors = {"copy_floor": lambda: dst.copy_(src), "read_floor": lambda: src.max()}
    # SDPA per sequence is 10-100x slower: fewer repeats keep the run short, the median stays honest.
    reps = {name: repeats if name != "sdpa" else max(2, repeats // 4) for name in kernels}
    times = timer.many({**kernels, **floors}, {**reps, "copy_floor": repeats, "read_floor": repeats}, primes=primes)
    cell_floor, cell_read_floor = times.pop("copy_floor") / 2, times.pop("read_floor")
    cell["cell_floor_ms"] = cell_floor * 1e3
    cell["cell_read_floor_ms"] = cell_read_floor * 1e3
    for name, t in times.items():
        cell["kernels"][name] = {"median_ms": t * 1e3, "x_floor": t / floor, "GBps": kv_bytes / t / 1e9}
        if read_bw:
            cell["kernels"][name]["x_read_floor"] = t * read_bw / kv_bytes
        cell["kernels"][name]["x_cell_floor"] = t / cell_floor
        cell["kernels"][name]["x_cell_read_floor"] = t / cell_read_floor
    cell["contiguous_vs_paged"] = times["contiguous"] / times["paged"]
    cell["contiguous_vs_tensors"] = times["contiguous"] / times["tensors"]
    # Same data, so the kernels must agree with SDPA (bf16/fp16 outputs differ by rounding).
    cell["max_abs_diff_vs_sdpa"] = {
        n: (outs[n].float() - outs["sdpa"].float()).abs().max().item() for n in ("contiguous", "tensors", "paged")
    }
    paged.close()
    if use_vmm:
        virt.close()
    return cell


def one_token_calls(dtype, device, layout: str, use_vmm: bool):
    """Each kernel's call on a batch of one 1-token sequence, in caches of its own: (fns, close)."""
    paged = PagedKVCache(
        KVGeometry(1, KV_HEADS, HEAD_DIM, dtype),
        PagedCacheConfig(max_seqs=1, max_seq_len=16, device=device, num_blocks=1, block_size=BLOCK),
    )
    ps = paged.allocate()
    paged.extend(ps, 1)
    (kt, vt), desc = tensor_contiguous(1, 1, dtype, device)
    # Real values everywhere (uninitialised memory may hold denormals, which make the arithmetic crawl).
    kt.copy_(torch.randn(kt.shape, device=device).to(dtype))
    vt.copy_(torch.randn(vt.shape, device=device).to(dtype))
    paged.write(0, ps, kt[0], vt[0])
    q = torch.randn(1, HEADS, HEAD_DIM, device=device).to(dtype)
    out = torch.empty_like(q)
    fns = {
        "paged": lambda: ops.decode_attention(q, paged, [ps], 0, out=out),
        "tensors": lambda: ops.decode_attention_contiguous(q, desc, out=out, max_len=1),
        "tensors_checked": lambda: ops.decode_attention_contiguous(q, desc, out=out),
        "sdpa": lambda: ops.decode_attention_reference(q, paged, [ps], 0, out=out),
    }
    virt = None
    if use_vmm:
        virt = VirtualKVCache(
            KVGeometry(1, KV_HEADS, HEAD_DIM, dtype),
            VirtualCacheConfig(max_seqs=1, max_seq_len=16, device=device, layout=layout, capacity_bytes=8 << 20),
        )
        vs = virt.allocate()
        virt.extend(vs, 1)
        virt.write(0, vs, kt[0], vt[0])
        fns["contiguous"] = lambda: ops.decode_attention(q, virt, [vs], 0, out=out)
        fns["sdpa"] = lambda: ops.decode_attention_reference(q, virt, [vs], 0, out=out)
    else:
        fns["contiguous"] = fns["tensors"]

    def close():
        paged.close()
        if virt is not None:
            virt.close()

    return fns, close


def warm_path_primes(dtype, device, layout: str, use_vmm: bool):
    """For --warm-path: per fn of a cell, a call of the same path that reads no K/V of the cell (a 1-token
    cache of its own; for the floors, the same torch op on 4 KiB), run after each flush and before the timed
    call. The flush has evicted everything; this brings back the call's code and torch's dispatch, as the
    previous layer's call does in a decode step (the cell's own cache objects stay cold, a few lines), while
    the cell's K/V stay in memory. (primes, close)"""
    fns, close = one_token_calls(dtype, device, layout, use_vmm)
    src = torch.ones(1024, dtype=torch.int32, device=device)
    dst = torch.empty_like(src)
    primes = {name: fns[name] for name in KERNELS}
    primes.update(copy_floor=lambda: dst.copy_(src), read_floor=lambda: src.max())
    return primes, close


def per_call_overhead(dtype, device, timer: Timer, layout: str, use_vmm: bool, repeats: int = 301) -> dict:
    """Median time of one decode call on a 1-token context (batch 1): the fixed cost of a call."""
    fns, close = one_token_calls(dtype, device, layout, use_vmm)
    order = (["contiguous"] if use_vmm else []) + ["paged", "tensors", "tensors_checked"]
    times = timer.many({name: fns[name] for name in order}, repeats, flush=False)
    close()
    return {name: t * 1e6 for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--quick", action="store_true", help="small grid (~1-2 min on 2 CPU cores)")
    ap.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32, bf16, fp16")
    ap.add_argument("--layout", default="per_layer", choices=["per_layer", "interleaved", "head_major"])
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats per kernel (default 5 quick, 9 full)")
    ap.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="skip cells with batch*context above this (memory: two caches of the cell live at once)",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch (and vpaged kernel) threads (default: torch's; the issue's table uses 2)",
    )
    ap.add_argument(
        "--warm-path",
        action="store_true",
        help="after each flush, run the same call on a 1-token cache of its own before the timed call: K/V "
        "cold, the call's code and objects warm, as in a decode step over many layers",
    )
    ap.add_argument(
        "--clock",
        default="wall",
        choices=["wall", "cpu"],
        help="cpu: time by the thread's CPU time (needs --threads 1; for machines shared with other work)",
    )
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/decode_<device>.json)")
    ap.add_argument("--vllm-python", default=None, metavar="PATH", help="compare with vLLM's CPU attention op")
    ap.add_argument("--vllm-only", action="store_true", help="with --vllm-python: only the vLLM comparison")
    ap.add_argument("--vllm-blocks", default="16,32,128", help="vLLM block sizes to time (its fastest is compared)")
    ap.add_argument(
        "--vllm-heads",
        default="16",
        help="with --vllm-python: query heads per cell (8 kv heads; comma-separated, e.g. 16,32 for groups of 2 and 4)",
    )
    ap.add_argument(
        "--isas",
        default="",
        help="with --vllm-python: also time vpaged on these CPU code paths (comma-separated, e.g. avx512bf16,amx), "
        "each beside the auto path in the same round-robin",
    )
    args = ap.parse_args()

    device = vpaged.memory.device.normalize_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu" and (device.type != "cpu" or torch.get_num_threads() != 1):
        raise SystemExit("--clock cpu measures the calling thread only: use it with --device cpu --threads 1")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch.cuda is not available here")
    if args.quick:
        batches, contexts, default_cap, repeats = [1, 8], [512, 4096, 16384], 1 << 15, 5
    else:
        batches, contexts, default_cap, repeats = [1, 4, 16, 64], [512, 2048, 8192, 16384], 1 << 18, 9
    if device.type == "cuda":
        default_cap = 1 << 20
    cap = args.max_tokens or default_cap
    repeats = args.repeats or repeats
    use_vmm = device.type == "cpu" or vpaged.backends()["cuda"].usable
    timer = Timer(device, args.clock)
    bw = copy_bandwidth(device, timer)
    read_bw = read_bandwidth(device, timer)
    print(
        f"device {device}, copy bandwidth {bw / 1e9:.1f} GB/s (read + write), read bandwidth {read_bw / 1e9:.1f} "
        f"GB/s, threads {torch.get_num_threads()}, load average {os.getloadavg()}"
    )
    if not use_vmm:
        print(f"contiguous kernel on a plain tensor: {vpaged.backends()['cuda'].reason}")

    cells, skipped, overhead = [], [], {}
    out = Path(args.out) if args.out else RESULTS / f"decode_{device.type}.json"

    def payload(complete: bool) -> dict:
        return {
            "benchmark": "decode_attention",
            "complete": complete,
            "machine": machine(device),
            "device": str(device),
            "grid": "quick" if args.quick else "full",
            "repeats": repeats,
            "layout": args.layout,
            "clock": args.clock,
            "geometry": {"kv_heads": KV_HEADS, "heads": HEADS, "head_dim": HEAD_DIM, "block_size": BLOCK, "layers": 1},
            "contiguous_on": "VirtualKVCache" if use_vmm else "plain tensor (per_layer strides)",
            "copy_bandwidth_GBps": bw / 1e9,
            "read_bandwidth_GBps": read_bw / 1e9,
            "floor": "K/V bytes read / copy bandwidth; caches flushed (by a read) before each call",
            "warm_path": args.warm_path,
            "read_floor": "K/V bytes read / read bandwidth (a large torch max reduction)",
            "cell_floor": "per cell, timed round-robin with its kernels: half a torch copy of the cell's K/V bytes "
            "(cell_read_floor: a torch max over them); x_cell_floor / x_cell_read_floor divide by these",
            "cells": cells,
            "skipped": skipped,
            "one_token_call_us": overhead,
            "one_token_call": "median of 301 calls, batch 1, 1-token context, no flush: contiguous = decode_attention "
            "on a VirtualKVCache, paged = on a PagedKVCache, tensors = decode_attention_contiguous "
            "on a from_tensors descriptor with max_len (tensors_checked: without, lengths checked)",
            "cpu_code_path": (vpaged._C.decode_cpu_isas()[-1] if device.type == "cpu" else None),
            # The path the auto calls ran (VPAGED_CPU_ISA caps it): what docs/numbers.md names as the run's ISA.
            "vpaged_isa": (vpaged._C.cpu_auto_isa() if device.type == "cpu" else None),
        }

    vllm_cmp = None
    if args.vllm_python:
        vllm_cmp = vllm_comparison(args, device, timer, repeats, [d.strip() for d in args.dtypes.split(",")])
    if args.vllm_only:
        result = payload(complete=True)
        result["vllm"] = vllm_cmp
        write_json(out, result)
        print(f"wrote {out}")
        return

    header = f"{'dtype':>8} {'batch':>5} {'context':>7} {'KV MiB':>7} {'floor ms':>9}"
    for name in KERNELS:
        header += f" {name + ' ms':>14} {'x floor':>7}"
    header += f" {'contig/paged':>12} {'contig/tensors':>14} {'c x read':>8} {'c x cell':>8} {'load':>5}"
    print(header)
    for dname in args.dtypes.split(","):
        dtype = DTYPES[dname.strip()]
        for batch in batches:
            for ctx in contexts:
                if batch * ctx > cap:
                    skipped.append({"dtype": dname, "batch": batch, "context": ctx})
                    continue
                primes, close_primes = (
                    warm_path_primes(dtype, device, args.layout, use_vmm) if args.warm_path else (None, None)
                )
                c = run_cell(batch, ctx, dtype, device, timer, repeats, bw, args.layout, use_vmm, read_bw, primes)
                if close_primes:
                    close_primes()
                cells.append(c)
                row = f"{dname:>8} {batch:>5} {ctx:>7} {c['kv_bytes'] / 2**20:>7.1f} {c['floor_ms']:>9.3f}"
                for name in KERNELS:
                    k = c["kernels"][name]
                    row += f" {k['median_ms']:>14.3f} {k['x_floor']:>7.2f}"
                row += f" {c['contiguous_vs_paged']:>12.3f} {c['contiguous_vs_tensors']:>14.3f}"
                row += f" {c['kernels']['contiguous']['x_read_floor']:>8.2f}"
                row += f" {c['kernels']['contiguous']['x_cell_floor']:>8.2f} {c['load_average'][0]:>5.1f}"
                print(row, flush=True)
                write_json(out, payload(complete=False))  # partial results survive a run stopped part way
    if skipped:
        print(f"skipped {len(skipped)} cells above --max-tokens {cap} (batch*context)")
    for dname in args.dtypes.split(","):
        overhead[dname.strip()] = per_call_overhead(DTYPES[dname.strip()], device, timer, args.layout, use_vmm)
        print(
            f"1-token call, {dname.strip()}: "
            + ", ".join(f"{n} {us:.1f} us" for n, us in overhead[dname.strip()].items()),
            flush=True,
        )

    result = payload(complete=True)
    if vllm_cmp is not None:
        result["vllm"] = vllm_cmp
    write_json(out, result)
    print(f"wrote {out}")


VLLM_CELLS = (
    dict(batch=8, heads=16, kv_heads=8, head_dim=128, context=2048),
    dict(batch=1, heads=16, kv_heads=8, head_dim=128, context=16384),
)


def vllm_comparison(args, device, timer: Timer, repeats: int, dtypes: list[str]) -> dict:
    """vpaged's contiguous kernel against vLLM's CPU attention op (its fastest block size) on the same K/V, per
    cell of VLLM_CELLS and dtype."""
    import tempfile

    from vllm_peer import PeerError, peer_env, probe, run_runner

    if device.type != "cpu":
        return {"skipped": "vLLM's CPU attention op runs on the CPU only"}
    facts, why = probe(args.vllm_python)
    if facts is None:
        print(f"vllm comparison skipped: {why}")
        return {"python": args.vllm_python, "skipped": why}
    isas = [isa for isa in args.isas.split(",") if isa]
    missing = [isa for isa in isas if isa not in vpaged._C.decode_cpu_isas()]
    if missing:
        raise SystemExit(f"--isas: this CPU has no code path {missing} (it has {vpaged._C.decode_cpu_isas()})")
    gen = torch.Generator().manual_seed(0)
    tensors, vpaged_fns, floor_fns, closers, outs, cases = {}, {}, {}, [], {}, {}
    heads = [int(h) for h in args.vllm_heads.split(",")]
    cells = [dict(c, heads=h) for h in heads for c in VLLM_CELLS]
    for c, dtype_name in ((c, n) for c in cells for n in dtypes):
        b, h, kvh, d, ctx = c["batch"], c["heads"], c["kv_heads"], c["head_dim"], c["context"]
        name = f"{dtype_name}-b{b}x{ctx}" + ("" if h == VLLM_CELLS[0]["heads"] else f"-h{h}")
        cases[name] = (c, dtype_name)
        dtype = DTYPES[dtype_name]
        k = torch.randn(b, ctx, kvh, d, generator=gen).to(dtype)
        v = torch.randn(b, ctx, kvh, d, generator=gen).to(dtype)
        q = torch.randn(b, h, d, generator=gen).to(dtype)
        tensors[name] = {"q": q, "k": k, "v": v}
        token_bytes = kvh * d * q.element_size()
        virt = VirtualKVCache(
            KVGeometry(1, kvh, d, dtype),
            VirtualCacheConfig(
                max_seqs=b,
                max_seq_len=ctx,
                device=device,
                layout=args.layout,
                capacity_bytes=2 * b * (ctx * token_bytes + (2 << 20)),
            ),
        )
        seqs = virt.allocate_many(b)
        for i in range(b):
            virt.extend(seqs[i], ctx)
            virt.write(0, seqs[i], k[i], v[i])
        outs[name] = torch.empty_like(q)
        vpaged_fns[name] = lambda q=q, virt=virt, seqs=seqs, o=outs[name]: ops.decode_attention(q, virt, seqs, 0, out=o)
        for isa in isas:
            vpaged_fns[f"{name}@{isa}"] = on_code_path(isa, vpaged_fns[name])
        # The cell's K/V bytes read once (the read floor), reduced as int32: torch's max over bf16 is no streaming
        # read (2.7x the int32 time over the same bytes on an AMX Xeon), which made a bf16 "floor" slower than the
        # kernels it bounds.
        floor_fns[name] = lambda k=k, v=v: (
            k.reshape(-1).view(torch.int32).max(),
            v.reshape(-1).view(torch.int32).max(),
        )
        closers.append(virt.close)
    before = timer.many(vpaged_fns, repeats)
    floors = timer.many(floor_fns, repeats)
    try:
        with tempfile.TemporaryDirectory(prefix="vpaged-vllm-decode-") as tmp:
            tpath, opath = Path(tmp) / "kv.pt", Path(tmp) / "out.pt"
            torch.save(tensors, tpath)
            job = {
                "tensors": str(tpath),
                "out": str(opath),
                "repeats": repeats,
                "threads": torch.get_num_threads(),
                "flush_bytes": timer.flush.numel() * 4,
                "block_sizes": [int(x) for x in args.vllm_blocks.split(",")],
            }
            res = run_runner(args.vllm_python, "decode", job, env=peer_env(torch.get_num_threads()), timeout=900)
            vouts = torch.load(opath)
    except PeerError as e:
        for close in closers:
            close()
        print(f"vllm comparison failed: {e}")
        return {"python": args.vllm_python, "error": str(e), "vllm_version": facts.get("vllm_version")}
    after = timer.many(vpaged_fns, repeats)
    rows = []
    for name, (c, dtype_name) in cases.items():
        vp = statistics.median([before[name], after[name]]) * 1e3
        best = res["ops"][name]
        vl = best["median_ms"]
        diff = (outs[name].float() - vouts[name].float()).abs().max().item()
        rows.append(
            {
                "dtype": dtype_name,
                **c,
                "vpaged_contiguous_ms": vp,
                "vpaged_before_after_ms": [before[name] * 1e3, after[name] * 1e3],
                "vllm_ms": vl,
                "vllm_isa": best["isa"],
                "vllm_block_size": best["block_size"],
                "vllm_by_block_ms": {bs: r.get("median_ms", r.get("error")) for bs, r in best["by_block"].items()},
                "vpaged_over_vllm": vp / vl,
                "read_floor_ms": floors[name] * 1e3,
                "vpaged_over_read_floor": vp / (floors[name] * 1e3),
                "max_abs_diff": diff,
            }
        )
        if isas:
            rows[-1]["vpaged_by_isa"] = {
                isa: {
                    "ms": (ms := statistics.median([before[f"{name}@{isa}"], after[f"{name}@{isa}"]]) * 1e3),
                    "over_vllm": ms / vl,
                    "over_read_floor": ms / (floors[name] * 1e3),
                }
                for isa in isas
            }
        print(
            f"vs vLLM {res['vllm_version']} ({dtype_name}, batch {c['batch']}, {c['heads']}/{c['kv_heads']} heads, "
            f"d{c['head_dim']}, ctx {c['context']}): vpaged contiguous {vp:.3f} ms, vLLM cpu_attention_with_kv_cache "
            f"{vl:.3f} ms (best of blocks {rows[-1]['vllm_by_block_ms']}: {best['block_size']}, isa {best['isa']}): "
            f"ratio {vp / vl:.2f}; read floor {floors[name] * 1e3:.3f} ms (vpaged {vp / (floors[name] * 1e3):.2f}x), "
            f"max |diff| {diff:.2e}"
        )
        for isa, r in rows[-1].get("vpaged_by_isa", {}).items():
            print(
                f"    vpaged on {isa}: {r['ms']:.3f} ms, ratio {r['over_vllm']:.2f}, {r['over_read_floor']:.2f}x the read floor"
            )
    for close in closers:
        close()
    return {"python": args.vllm_python, "vllm_version": res["vllm_version"], "threads": res["threads"], "rows": rows}


def on_code_path(isa: str, fn):
    """fn with vpaged's CPU decode kernel forced onto code path `isa` for the call (the step path a cache's
    decode_attention takes reads _C.decode_cpu_rows per call; its last argument is the path)."""
    real = vpaged._C.decode_cpu_rows

    def run():
        vpaged._C.decode_cpu_rows = lambda *a: real(*a[:8], isa)
        try:
            return fn()
        finally:
            vpaged._C.decode_cpu_rows = real

    return run


def summary_rows(results: dict) -> list[dict]:
    """This script's comparisons as `vpaged bench` and docs/numbers.md show them, read from its JSON: for each
    cell, the median step of the kernel over vpaged's contiguous view against the block-table kernel's.
    Builtins only: the suite compiles this function alone, without the imports above."""
    rows = []
    for c in results.get("cells", []):
        kernels = c.get("kernels") if isinstance(c.get("kernels"), dict) else {}
        contiguous, paged = kernels.get("contiguous"), kernels.get("paged")
        contiguous_ms = contiguous.get("median_ms") if isinstance(contiguous, dict) else None
        paged_ms = paged.get("median_ms") if isinstance(paged, dict) else None
        if contiguous_ms is None or paged_ms is None:
            continue
        rows.append(
            {
                "benchmark": "decode",
                "comparison": f"{c.get('dtype')} {c.get('batch')} x {c.get('context')} tokens",
                "vpaged": contiguous_ms,
                "baseline": paged_ms,
                "baseline_name": "block-table kernel",
                "unit": "ms",
                "better": "lower",
            }
        )
    return rows


if __name__ == "__main__":
    main()
