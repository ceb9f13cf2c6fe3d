"""`vpaged bench`: the benchmark scripts of a source checkout (benchmarks/) run one after another, each
writing its JSON into one results folder, then one table comparing vpaged with the baseline each script
measures beside it (bare system calls, plain copies, block tables, transformers' caches, serving engines).

The scripts stay the source of truth (each runs alone too): each writes its JSON and exports
`summary_rows(results) -> list[dict]`, the comparisons that JSON holds (the fields of `Row`). This module only
runs the scripts and collects those rows (`summary_rows` below; docs/numbers.md reads results through it too).
A script that fails or is missing is reported as such; the others still run.
"""

from __future__ import annotations
import __future__

import ast
import builtins
import dataclasses
import functools
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import BenchmarkScriptError, InvalidArgumentError


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


@dataclass(frozen=True)
class Bench:
    name: str
    script: str
    result: str
    quick: tuple[str, ...]
    full: tuple[str, ...]
    in_quick: bool = True


SUITE = (
    Bench("mapping", "bench_mapping.py", "mapping_cpu.json", ("--quick",), ()),
    Bench("sharing", "bench_sharing.py", "sharing_cpu.json", ("--quick",), ()),
    Bench("decode", "bench_decode.py", "decode_cpu.json", ("--quick", "--dtypes", "fp32"), ()),
    Bench("transformers", "bench_hf.py", "hf_cpu.json", ("--quick",), (), in_quick=False),
    Bench(
        "serving",
        "bench_serve.py",
        "serve_cpu.json",
        ("--quick", "--output", "serve_cpu.json"),
        (),
        in_quick=False,
    ),
    Bench("elastic", "bench_elastic.py", "elastic_cpu.json", ("--quick",), (), in_quick=False),
)


def find_benchmarks(explicit: str | None) -> Path:
    """The benchmarks/ folder: given, or beside the package in a source checkout."""
    # Absolute: the scripts run with this folder as their working directory (run_one).
    path = Path(explicit).expanduser().resolve() if explicit else Path(__file__).resolve().parents[2] / "benchmarks"
    if not (path / "common.py").is_file():
        raise BenchmarkScriptError(
            f"no benchmark scripts at {path}: `vpaged bench` runs the scripts of a source checkout's benchmarks/ "
            "folder; pass --benchmarks DIR"
        )
    return path


SUMMARY = "summary_rows"
ROW_FIELDS = frozenset(f.name for f in dataclasses.fields(Row))


@functools.lru_cache(maxsize=32)
def _compiled_summary(script: Path, mtime_ns: int) -> Callable[[dict], list[dict]]:
    # Only the function is compiled, not the script: importing one runs its imports (bench_mapping.py builds
    # the benchmark C++ extension, bench_hf.py and bench_serve.py load transformers and the engine: 40 s for
    # the six on a 2-core box), which reading a results file does not need. So `summary_rows` uses builtins
    # only. mtime_ns keys the cache: an edited script is compiled again.
    del mtime_ns
    tree = ast.parse(script.read_text(), filename=str(script))
    found = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == SUMMARY]
    if not found:
        raise BenchmarkScriptError(f"{script} defines no {SUMMARY}(results) function: the suite reads its rows with it")
    code = compile(
        ast.Module(body=found[-1:], type_ignores=[]),
        str(script),
        "exec",
        flags=__future__.annotations.compiler_flag,  # as the scripts are written: annotations stay unevaluated
        dont_inherit=True,
    )
    namespace = {"__builtins__": builtins, "__name__": f"{script.stem}.{SUMMARY}"}
    exec(code, namespace)
    return namespace[SUMMARY]


def summary_function(bench: Bench | str, bench_dir: Path | None = None) -> Callable[[dict], list[dict]]:
    """The `summary_rows(results)` function of a benchmark's script (a SUITE entry or its name) in `bench_dir`
    (default: the checkout's benchmarks/ folder), loaded without running the script."""
    bench = _bench(bench)
    script = (bench_dir if bench_dir is not None else find_benchmarks(None)) / bench.script
    try:
        mtime_ns = script.stat().st_mtime_ns
    except OSError as e:
        raise BenchmarkScriptError(f"no benchmark script {script} ({e.strerror})") from e
    return _compiled_summary(script.resolve(), mtime_ns)


def summary_rows(bench: Bench | str, results: dict, bench_dir: Path | None = None) -> list[Row]:
    """The rows a benchmark's results hold, as its script's `summary_rows(results)` gives them."""
    rows = []
    for d in summary_function(bench, bench_dir)(results):
        if not isinstance(d, dict) or set(d) != ROW_FIELDS:
            raise BenchmarkScriptError(
                f"{_bench(bench).script}'s {SUMMARY} gave {d!r}: each row must be a dict of {sorted(ROW_FIELDS)}"
            )
        rows.append(Row(**d))
    return rows


def _bench(bench: Bench | str) -> Bench:
    if isinstance(bench, Bench):
        return bench
    known = {b.name: b for b in SUITE}
    if bench not in known:
        raise InvalidArgumentError(f"unknown benchmark {bench!r}; the suite has {', '.join(known)}")
    return known[bench]


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
    try:
        rows = summary_rows(bench, data, bench_dir)
    except BenchmarkScriptError as e:
        with log.open("a") as f:
            print(f"vpaged bench: {e}", file=f)
        return Outcome(bench, "no summary rows (see log)", seconds, [], log)
    return Outcome(bench, "ok", seconds, rows, log)


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
