"""`vpaged bench`: the benchmark scripts of a source checkout (benchmarks/) run one after another, each
writing its JSON into one results folder, then one table comparing vpaged with the baseline each script
measures beside it (bare system calls, plain copies, block tables, transformers' caches, serving engines).

The scripts stay the source of truth (each runs alone too); this module only runs them and reads the
numbers back. A script that fails or is missing is reported as such; the others still run.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import InvalidArgumentError


@dataclass(frozen=True)
class Row:
    benchmark: str
    comparison: str
    vpaged: float
    baseline: float
    baseline_name: str
    unit: str
    better: str  # "lower" or "higher": which direction favours vpaged

    @property
    def ratio(self) -> float:
        """vpaged / baseline."""
        return self.vpaged / self.baseline if self.baseline else float("nan")


def _get(d, *keys, default=None):
    for k in keys:
        if isinstance(d, dict) and k in d:
            d = d[k]
        elif isinstance(d, list) and isinstance(k, int) and -len(d) <= k < len(d):
            d = d[k]
        else:
            return default
    return d


def _mapping(d: dict) -> list[Row]:
    rows = []
    for m in d.get("mapping", []):
        size = f"{m['page_size'] // 1024} KiB" if m["page_size"] < 1 << 20 else f"{m['page_size'] >> 20} MiB"
        rows.append(
            Row(
                "mapping",
                f"map + unmap one {size} page",
                m["vpaged_1_us"],
                m["raw_c_us"],
                "bare syscalls (C++)",
                "µs",
                "lower",
            )
        )
    ext = d.get("extend_256")
    if ext:
        rows.append(
            Row(
                "mapping",
                "decode-step bookkeeping, 256 sequences",
                ext["extend_many_us"],
                ext["extend_loop_us"],
                "256 extend() calls",
                "µs",
                "lower",
            )
        )
    return rows


def _sharing(d: dict) -> list[Row]:
    rows = []
    cow = d.get("cow")
    if cow:
        rows.append(
            Row(
                "sharing",
                "copy-on-write of one page",
                cow["cow_us_per_page"],
                cow["plain_copy_us_per_page"],
                "memcpy of the page",
                "µs",
                "lower",
            )
        )
    swap = d.get("swap")
    if swap:
        rows.append(
            Row("sharing", "swap out", swap["swap_out_GBps"], swap["plain_copy_GBps"], "plain copy", "GB/s", "higher")
        )
    for p in d.get("parallel_sampling", []):
        rows.append(
            Row(
                "sharing",
                f"parallel sampling n={p['n']}: KV memory",
                p["shared_MiB"],
                p["unshared_MiB"],
                "without sharing",
                "MiB",
                "lower",
            )
        )
    sp = d.get("system_prompt")
    if sp:
        rows.append(
            Row(
                "sharing",
                f"{sp['requests']} requests, shared system prompt: KV memory",
                sp["shared_MiB"],
                sp["unshared_MiB"],
                "without prefix cache",
                "MiB",
                "lower",
            )
        )
    return rows


def _decode(d: dict) -> list[Row]:
    rows = []
    for c in d.get("cells", []):
        k = c.get("kernels", {})
        cont, paged = _get(k, "contiguous", "median_ms"), _get(k, "paged", "median_ms")
        if cont is None or paged is None:
            continue
        rows.append(
            Row(
                "decode",
                f"{c.get('dtype')} {c.get('batch')} x {c.get('context')} tokens",
                cont,
                paged,
                "block-table kernel",
                "ms",
                "lower",
            )
        )
    return rows


def _hf(d: dict) -> list[Row]:
    by = {(r["kind"], r["context"]): r for r in d.get("decode", [])}
    rows = []
    for ctx in sorted({c for _, c in by}):
        v = by.get(("vpaged", ctx))
        for base in ("dynamic", "static"):
            b = by.get((base, ctx))
            if v and b:
                rows.append(
                    Row(
                        "transformers",
                        f"decode step at {ctx} tokens",
                        v["step_ms"],
                        b["step_ms"],
                        f"{base.capitalize()}Cache",
                        "ms",
                        "lower",
                    )
                )
    beam = {r["kind"]: r for r in d.get("beam", [])}
    if "vpaged" in beam and "dynamic" in beam:
        v, b = beam["vpaged"], beam["dynamic"]
        rows.append(
            Row(
                "transformers",
                f"beam search {v['beams']}x{v['context']}: reorder",
                v["reorder_ms"],
                b["reorder_ms"],
                "DynamicCache",
                "ms",
                "lower",
            )
        )
        rows.append(
            Row(
                "transformers",
                f"beam search {v['beams']}x{v['context']}: peak KV",
                v["peak_kv_mib"],
                b["peak_kv_mib"],
                "DynamicCache",
                "MiB",
                "lower",
            )
        )
    return rows


def _serve(d: dict) -> list[Row]:
    """Serving (bench_serve.py's throughput section): output tokens/s of each engine KV backend against
    transformers' generate_batch on the same requests, and kv=vpaged against vLLM's CPU engine when the run
    had that row (--vllm-python). With --repeats, each row's median."""
    tp = _get(d, "throughput", default={}) or {}
    medians = tp.get("medians") or {}
    if medians:
        tps = {str(k): float(m["output_tokens_per_s"]) for k, m in medians.items() if m.get("output_tokens_per_s")}
    else:
        rows = tp.get("rows") or []
        tps = {str(r.get("kv")): float(r["output_tokens_per_s"]) for r in rows if r.get("output_tokens_per_s")}
    out = []
    base = tps.get("generate_batch")
    if base:
        out += [
            Row("serving", f"output tokens/s, engine kv={name}", value, base, "generate_batch", "tok/s", "higher")
            for name, value in tps.items()
            if name not in ("generate_batch", "vllm")
        ]
    if tps.get("vllm") and tps.get("vpaged"):
        out.append(
            Row(
                "serving",
                "output tokens/s, engine kv=vpaged",
                tps["vpaged"],
                tps["vllm"],
                "vLLM CPU",
                "tok/s",
                "higher",
            )
        )
    return out


def _elastic(d: dict) -> list[Row]:
    """bench_elastic.py: three engine processes on one shared budget against a static split of it."""
    r = d.get("results", {})
    st, sh = r.get("static"), r.get("shared")
    if not (st and sh):
        return []
    rows = [Row("elastic", "TTFT p99, 3 engines, bursty", sh["ttft_p99"], st["ttft_p99"], "static split", "s", "lower")]
    rows.append(
        Row(
            "elastic",
            "output tokens/s, 3 engines, bursty",
            sh["output_tokens_per_s"],
            st["output_tokens_per_s"],
            "static split",
            "tok/s",
            "higher",
        )
    )
    return rows


@dataclass(frozen=True)
class Bench:
    name: str
    script: str
    result: str
    quick: tuple[str, ...]
    full: tuple[str, ...]
    extract: Callable[[dict], list[Row]]
    in_quick: bool = True


SUITE = (
    Bench("mapping", "bench_mapping.py", "mapping_cpu.json", ("--quick",), (), _mapping),
    Bench("sharing", "bench_sharing.py", "sharing_cpu.json", ("--quick",), (), _sharing),
    Bench("decode", "bench_decode.py", "decode_cpu.json", ("--quick", "--dtypes", "fp32"), (), _decode),
    Bench("transformers", "bench_hf.py", "hf_cpu.json", ("--quick",), (), _hf, in_quick=False),
    Bench(
        "serving",
        "bench_serve.py",
        "serve_cpu.json",
        ("--quick", "--output", "serve_cpu.json"),
        (),
        _serve,
        in_quick=False,
    ),
    Bench("elastic", "bench_elastic.py", "elastic_cpu.json", ("--quick",), (), _elastic, in_quick=False),
)


def find_benchmarks(explicit: str | None) -> Path:
    """The benchmarks/ folder: given, or beside the package in a source checkout."""
    # Absolute: the scripts run with this folder as their working directory (run_one).
    path = Path(explicit).expanduser().resolve() if explicit else Path(__file__).resolve().parents[2] / "benchmarks"
    if not (path / "common.py").is_file():
        raise InvalidArgumentError(
            f"no benchmark scripts at {path}: `vpaged bench` runs the scripts of a source checkout's benchmarks/ "
            "folder; pass --benchmarks DIR"
        )
    return path


def machine_facts() -> dict:
    import torch

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    facts = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "load_average": list(os.getloadavg()),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if torch.cuda.is_available():
        facts["gpu"] = torch.cuda.get_device_name()
    return facts


@dataclass
class Outcome:
    bench: Bench
    status: str  # "ok", "failed (exit N)", "missing", "timed out"
    seconds: float
    rows: list[Row]
    log: Path | None


# The benchmarks that take --vllm-python PATH (an interpreter with vLLM's CPU build) for their vLLM rows.
VLLM_BENCHES = ("serving", "decode")


def run_one(
    bench: Bench, bench_dir: Path, out_dir: Path, quick: bool, timeout: float, vllm_python: str | None = None
) -> Outcome:
    # Both absolute whatever the caller's working directory: the script runs in bench_dir and writes to out_dir.
    bench_dir, out_dir = bench_dir.resolve(), out_dir.resolve()
    script = bench_dir / bench.script
    if not script.is_file():
        return Outcome(bench, "missing", 0.0, [], None)
    log = out_dir / "logs" / f"{bench.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    args = list(bench.quick if quick else bench.full)
    if bench.name == "decode":
        args += ["--out", str(out_dir / bench.result)]
    if vllm_python and bench.name in VLLM_BENCHES:
        args += ["--vllm-python", vllm_python]
    env = {**os.environ, "VPAGED_RESULTS_DIR": str(out_dir)}
    t0 = time.perf_counter()
    with log.open("w") as f:
        try:
            rc = subprocess.run(
                [sys.executable, str(script), *args],
                cwd=bench_dir,
                env=env,
                stdout=f,
                stderr=subprocess.STDOUT,
                timeout=timeout,
            ).returncode
        except subprocess.TimeoutExpired:
            return Outcome(bench, "timed out", time.perf_counter() - t0, [], log)
    seconds = time.perf_counter() - t0
    if rc != 0:
        return Outcome(bench, f"failed (exit {rc})", seconds, [], log)
    try:
        data = json.loads((out_dir / bench.result).read_text())
    except (OSError, ValueError) as e:
        return Outcome(bench, f"no results ({e.__class__.__name__})", seconds, [], log)
    return Outcome(bench, "ok", seconds, bench.extract(data), log)


def select(names: str | None, quick: bool) -> list[Bench]:
    if not names:
        return [b for b in SUITE if b.in_quick or not quick]
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    known = {b.name: b for b in SUITE}
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise InvalidArgumentError(f"unknown benchmark(s) {', '.join(unknown)}; the suite has {', '.join(known)}")
    return [known[n] for n in wanted]


def plot_ratios(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Speed-up (> 1 favours vpaged) whichever direction a metric improves in.
    labels = [f"{r.benchmark}: {r.comparison} vs {r.baseline_name}" for r in rows]
    gains = [
        (r.baseline / r.vpaged if r.better == "lower" else r.vpaged / r.baseline) if r.vpaged and r.baseline else 0.0
        for r in rows
    ]
    fig, ax = plt.subplots(figsize=(10, 0.32 * len(rows) + 1.5))
    ax.barh(labels, gains, color=["#4c9a2a" if g >= 1 else "#d1495b" for g in gains])
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("advantage of vpaged over the baseline (×, log scale; > 1 is better)")
    ax.invert_yaxis()
    ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
