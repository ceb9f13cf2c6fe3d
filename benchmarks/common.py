"""Shared helpers of the benchmark scripts: machine facts, medians, JSON output."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

# VPAGED_RESULTS_DIR redirects every benchmark's JSON (`vpaged bench` and scripts/gpu_check.sh point it at
# their output folder).
RESULTS = Path(os.environ.get("VPAGED_RESULTS_DIR") or Path(__file__).resolve().parent / "results")


def machine() -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "mkl_num_threads": os.environ.get("MKL_NUM_THREADS"),
        "load_average_1min": os.getloadavg()[0],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def median_time(fn, repeats: int = 7, inner: int = 1) -> float:
    """Median over `repeats` of the mean seconds per call of `inner` back-to-back calls."""
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - t0) / inner)
    return statistics.median(samples)


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
