"""Shared helpers of the benchmark scripts: machine facts, medians, JSON output, and the benchmark-only C++
module (bench_ext)."""

from __future__ import annotations

import datetime
import fcntl
import importlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

# VPAGED_RESULTS_DIR redirects every benchmark's JSON (`vpaged bench` and scripts/gpu_check.sh point it at
# their output folder).
RESULTS = Path(os.environ.get("VPAGED_RESULTS_DIR") or Path(__file__).resolve().parent / "results")


def cpuinfo() -> dict:
    """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the end of the first processor's block
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def machine() -> dict:
    fields = cpuinfo()
    info = {
        "cpu": fields.get("model name") or platform.processor(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "mkl_num_threads": os.environ.get("MKL_NUM_THREADS"),
        "load_average_1min": os.getloadavg()[0],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    info.update(isa_facts(fields))
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def isa_facts(fields: dict | None = None) -> dict:
    """The instruction sets a figure was measured with: the CPU's (from its flags), the path vpaged's kernels run
    for isa='auto' (capped by VPAGED_CPU_ISA), and torch's own kernels' (capped by ATEN_CPU_CAPABILITY)."""
    flags = (cpuinfo() if fields is None else fields).get("flags", "").split()
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16")
    facts = {"cpu_flags": [x for x in wanted if x in flags]}
    try:
        from vpaged import _C

        facts["vpaged_isa"] = _C.cpu_auto_isa()
    except (ImportError, AttributeError, ValueError) as e:
        facts["vpaged_isa"] = f"unknown ({e})"
    facts["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    return facts


def median_time(fn, repeats: int = 7, inner: int = 1) -> float:
    """Median over `repeats` of the mean seconds per call of `inner` back-to-back calls."""
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - t0) / inner)
    return statistics.median(samples)


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists (how long two greedy outputs agree)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def write_json(name: str | Path, payload: dict) -> Path:
    """Write payload to RESULTS/name (or to a path). Atomic (a temporary file renamed over the old one), so
    a benchmark may call it after every part: a run stopped part way leaves the last complete file."""
    path = Path(name) if isinstance(name, Path) else RESULTS / name
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def print_table(headers: list[str], rows: list[list]) -> None:
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    for r in cells:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))


BENCH_EXT_SOURCES = Path(__file__).resolve().parent / "csrc"
BENCH_EXT_BUILD = Path(__file__).resolve().parent.parent / "build" / "bench_ext"


def _pybind11_include() -> str:
    """The pybind11 headers, found as setup.py finds them (pybind11, else torch's copy): vpaged_bench_ext
    passes objects to vpaged._C, which works only when both were compiled against the same pybind11."""
    try:
        import pybind11

        return pybind11.get_include()
    except ImportError:
        inc = Path(torch.__file__).resolve().parent / "include"
        if (inc / "pybind11" / "pybind11.h").exists():
            return str(inc)
        raise RuntimeError("pybind11 headers not found: pip install pybind11") from None


def bench_ext(build_dir: Path | None = None):
    """vpaged_bench_ext: the C++ that only benchmarks need (benchmarks/csrc/: the per-page host backend and the
    bare map + unmap loops), kept out of vpaged._C. Built on first use with setuptools into build/bench_ext/
    (or build_dir) and rebuilt only when a source or a csrc/ header changed; a lock keeps concurrent callers
    from building at once. Needs a C++ compiler and the Python headers."""
    from setuptools import Distribution, Extension
    from setuptools.command.build_ext import build_ext

    import vpaged._C  # noqa: F401  (the module's Backend type must be registered first)

    out = Path(build_dir or BENCH_EXT_BUILD).resolve()
    out.mkdir(parents=True, exist_ok=True)
    core = BENCH_EXT_SOURCES.parent.parent / "csrc"
    ext = Extension(
        "vpaged_bench_ext",
        sources=sorted(str(p) for p in BENCH_EXT_SOURCES.glob("*.cpp")),
        include_dirs=[_pybind11_include(), str(core)],
        depends=sorted(str(p) for p in (core / "core").glob("*.h")),
        language="c++",
        extra_compile_args=["-std=c++17", "-O3", "-fvisibility=hidden"],
    )
    with open(out / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        cmd = build_ext(Distribution({"name": "vpaged_bench_ext", "ext_modules": [ext]}))
        cmd.build_lib, cmd.build_temp = str(out), str(out / "tmp")
        cmd.ensure_finalized()
        cmd.run()
    if str(out) not in sys.path:
        sys.path.insert(0, str(out))
    return importlib.import_module("vpaged_bench_ext")
