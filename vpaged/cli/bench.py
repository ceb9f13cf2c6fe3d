"""`vpaged bench`: argument parsing and output for vpaged/cli/suite.py."""

from __future__ import annotations

import json
import time
from pathlib import Path

from ..errors import InvalidArgumentError


def add_parser(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="run the benchmark suite and print one comparison table",
        description="Runs the scripts in benchmarks/ (mapping, sharing, decode kernels, transformers, serving), "
        "each writing JSON into one results folder, then prints vpaged against the baseline each one "
        "measures beside it, and writes bench.json (with the machine's facts) and bench_ratios.png.",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="short settings, without the transformers and serving benchmarks (about 2 minutes)",
    )
    p.add_argument("--only", metavar="NAMES", help="comma-separated: mapping, sharing, decode, transformers, serving")
    p.add_argument("--out", metavar="DIR", help="results folder (default: vpaged-bench-<UTC time>)")
    p.add_argument("--benchmarks", metavar="DIR", help="the benchmark scripts (default: the checkout's benchmarks/)")
    p.add_argument(
        "--vllm-python",
        metavar="PATH",
        help="an interpreter with vLLM's CPU build: the serving and decode benchmarks add vLLM rows",
    )
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per script (default 3600)")
    p.set_defaults(func=run, parser=p)


def run(args) -> int:
    from . import suite as bs

    try:
        if args.timeout <= 0:
            raise InvalidArgumentError(f"--timeout must be positive, got {args.timeout}")
        bench_dir = bs.find_benchmarks(args.benchmarks)
        suite = bs.select(args.only, args.quick)
    except InvalidArgumentError as e:
        args.parser.error(str(e))
    # Absolute before anything runs: the scripts run with bench_dir as their working directory, so a relative
    # folder would be written there and read back here (every result "missing", issue #35).
    out = Path(args.out or time.strftime("vpaged-bench-%Y%m%dT%H%M%SZ", time.gmtime())).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    facts = bs.machine_facts()
    outcomes = []
    try:
        from rich.progress import Progress

        with Progress(transient=True) as progress:
            task = progress.add_task("benchmarks", total=len(suite))
            for bench in suite:
                progress.update(task, description=f"running {bench.name}")
                outcomes.append(bs.run_one(bench, bench_dir, out, args.quick, args.timeout, args.vllm_python))
                progress.advance(task)
    except ImportError:
        for bench in suite:
            print(f"running {bench.name} ...", flush=True)
            outcomes.append(bs.run_one(bench, bench_dir, out, args.quick, args.timeout, args.vllm_python))
    rows = [r for o in outcomes for r in o.rows]
    _print(facts, outcomes, rows)
    payload = {
        "machine": facts,
        "mode": "quick" if args.quick else "full",
        "benchmarks": [
            {
                "name": o.bench.name,
                "status": o.status,
                "seconds": round(o.seconds, 1),
                "log": str(o.log) if o.log else None,
            }
            for o in outcomes
        ],
        "comparisons": [
            {
                "benchmark": r.benchmark,
                "comparison": r.comparison,
                "vpaged": r.vpaged,
                "baseline": r.baseline,
                "baseline_name": r.baseline_name,
                "unit": r.unit,
                "better": r.better,
                "ratio": r.ratio,
            }
            for r in rows
        ],
    }
    (out / "bench.json").write_text(json.dumps(payload, indent=2) + "\n")
    print(f"results: {out / 'bench.json'}")
    if rows:
        try:
            bs.plot_ratios(rows, out / "bench_ratios.png")
            print(f"plot: {out / 'bench_ratios.png'}")
        except ImportError:
            print("plot skipped: matplotlib is not installed (pip install 'vpaged[plot]')")
    return 0 if all(o.status in ("ok", "missing") for o in outcomes) else 1


def _print(facts: dict, outcomes, rows) -> None:
    head = f"{facts['cpu']}, {facts['cores']} cores, torch {facts['torch']}" + (
        f", {facts['gpu']}" if "gpu" in facts else ""
    )
    status = [[o.bench.name, o.status, f"{o.seconds:.0f} s"] for o in outcomes]
    table = [
        [
            r.benchmark,
            r.comparison,
            f"{r.vpaged:,.3g} {r.unit}",
            f"{r.baseline:,.3g} {r.unit}",
            r.baseline_name,
            f"{r.ratio:.2f}×",
            "lower" if r.better == "lower" else "higher",
        ]
        for r in rows
    ]
    headers = ["benchmark", "comparison", "vpaged", "baseline", "baseline is", "ratio", "better"]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(head)
        for row in status + [headers] + table:
            print("  ".join(row))
        return
    console = Console(width=200)
    t = Table(title=f"vpaged bench: {head}")
    for name in ("benchmark", "status", "time"):
        t.add_column(name)
    for row in status:
        t.add_row(*row)
    console.print(t)
    if table:
        t = Table(title="vpaged against its baselines (ratio = vpaged / baseline)")
        for i, name in enumerate(headers):
            t.add_column(name, justify="right" if i in (2, 3, 5) else "left")
        for row in table:
            t.add_row(*row)
        console.print(t)
