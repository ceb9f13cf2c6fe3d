"""The `vpaged` command: `vpaged demo` (a mixed workload on the CPU), `vpaged info` (backends),
`vpaged simulate` (KV memory of cache kinds at production scale, vpaged/cli/simulate.py), `vpaged bench`
(the benchmark suite, vpaged/cli/bench.py), `vpaged budget` (a machine-wide shared budget,
vpaged/cli/budget.py), `vpaged store` (a KV page store, vpaged/cli/store.py) and the serving commands
`generate`, `serve` and `bench-serve` (vpaged/cli/serve.py)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

import torch

from ..memory.device import backends
from .demo import DemoConfig, run_demo

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _print_table(title: str, rows: list[tuple[str, str]]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        width = max(len(k) for k, _ in rows)
        print(title)
        for k, v in rows:
            print(f"  {k:<{width}}  {v}")
        return
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in rows:
        table.add_row(k, v)
    Console().print(table)


def cmd_demo(args) -> int:
    cfg = DemoConfig(
        layout=args.layout,
        steps=args.steps,
        seed=args.seed,
        budget_bytes=args.budget_mib << 20,
        max_seqs=args.max_seqs,
        max_seq_len=args.max_seq_len,
        dtype=DTYPES[args.dtype],
    )
    r = run_demo(cfg)
    if args.json:
        d = asdict(r)
        d["config"]["dtype"] = args.dtype
        json.dump(d, sys.stdout, indent=2)
        print()
        return 0
    rows = [
        (
            "model (layers × kv heads × head dim)",
            f"{cfg.num_layers} × {cfg.num_kv_heads} × {cfg.head_dim}, {args.dtype}",
        ),
        ("layout / page size", f"{cfg.layout} / {r.page_size // 1024} KiB"),
        ("budget", _mib(cfg.budget_bytes)),
        ("steps / finished / deferred", f"{r.steps} / {r.finished} / {r.deferred}"),
        ("peak concurrent sequences", str(r.peak_sequences)),
        ("peak live tokens", f"{r.peak_live_tokens:,}"),
        ("peak live KV bytes", _mib(r.peak_live_bytes)),
        ("peak mapped bytes", _mib(r.peak_mapped_bytes)),
        ("utilization at peak (live / mapped)", f"{r.utilization_at_peak:.1%}"),
        ("mean utilization", f"{r.mean_utilization:.1%}"),
        ("static max-length allocation for the peak", _mib(r.static_bytes_for_peak)),
        ("static / vpaged mapped at peak", f"{r.static_bytes_for_peak / max(r.peak_mapped_bytes, 1):.1f}×"),
        ("pages mapped / unmapped (map calls)", f"{r.pages_mapped:,} / {r.pages_unmapped:,} ({r.map_calls:,})"),
        ("map calls per step", f"{r.map_calls / r.steps:.2f}"),
        ("wall time", f"{r.seconds:.1f} s"),
    ]
    _print_table("vpaged demo: mixed workload on the CPU", rows)
    return 0


def cmd_info(_args) -> int:
    import vpaged

    from ..memory.buildinfo import build_info, describe_build

    build = build_info()
    rows = [("vpaged", vpaged.__version__), ("build", describe_build(build))]
    if build.get("version") not in (None, vpaged.__version__):  # a stale extension next to newer sources
        rows.append(("extension built from", f"vpaged {build['version']} (rebuild it)"))
    rows.append(("torch", torch.__version__))
    for name, b in backends().items():
        rows.append((f"backend {name}", "usable" if b.usable else f"unavailable: {b.reason}"))
    from ..hf.compat import support_status  # reads the installed version; does not import transformers

    hf_version, _, hf_status = support_status()
    rows.append(("transformers", f"{hf_version}: {hf_status}" if hf_version else hf_status))
    _print_table("vpaged info", rows)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="vpaged", description="Virtual-memory KV cache for LLM inference")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run a mixed workload on the CPU and compare with static allocation")
    demo.add_argument("--layout", choices=["per_layer", "interleaved"], default="per_layer")
    demo.add_argument("--steps", type=int, default=1500)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--budget-mib", type=int, default=1024)
    demo.add_argument("--max-seqs", type=int, default=64)
    demo.add_argument("--max-seq-len", type=int, default=4096)
    demo.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    demo.add_argument("--json", action="store_true", help="print the result as JSON")
    demo.set_defaults(func=cmd_demo)
    info = sub.add_parser("info", help="show which backends are usable here and why not")
    info.set_defaults(func=cmd_info)
    from .bench import add_parser as add_bench
    from .budget import add_parser as add_budget
    from .simulate import add_parser as add_simulate
    from .store import add_parser as add_store

    add_simulate(sub)
    add_bench(sub)
    add_budget(sub)
    add_store(sub)
    from .serve import add_serve_commands  # generate, serve, bench-serve

    add_serve_commands(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
