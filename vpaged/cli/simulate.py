"""`vpaged simulate`: argument parsing and output of the simulator (kept apart from vpaged/cli/main.py's
other commands)."""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

from ..errors import DTypeError, InvalidArgumentError
from ..kvcache.formats import KVFormat

GiB = 1 << 30


def add_parser(sub) -> None:
    from ..sim import BUILTIN, SHAPES

    p = sub.add_parser(
        "simulate",
        help="KV memory of static slots, block tables and vpaged layouts under one budget",
        description="Runs a request trace through each cache kind with the real caches on the accounting "
        "backend (nothing is mapped, so GPU-scale budgets run on any machine) and reports where the "
        "memory goes: live tokens, waste (fragmentation + reservation) and dormant reusable pages.",
    )
    p.add_argument(
        "--model",
        default="Llama-3-8B",
        help=f"model shape: {', '.join(SHAPES)}, or LAYERSxKV_HEADSxHEAD_DIM[:bf16|fp16|fp32]",
    )
    p.add_argument(
        "--kv-dtype",
        choices=["auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2"],
        default="auto",
        help="what the caches store (auto: the model dtype; int8 counts its per-token scales)",
    )
    p.add_argument("--budget-gib", type=float, default=80.0, help="KV memory budget in GiB (default 80)")
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="simulate one rank of N: it keeps num_kv_heads / N heads of every token, within --budget-gib "
        "(the budget of each rank); every rank holds the same tokens",
    )
    p.add_argument(
        "--trace",
        default="sharegpt",
        help=f"built-in trace ({', '.join(BUILTIN)}) or a CSV file with a header: arrival, prompt_len, "
        "output_len[, prefix_id, prefix_len, n]",
    )
    p.add_argument("--requests", type=int, default=2000, help="requests of a built-in trace (default 2000)")
    p.add_argument(
        "--rate",
        type=float,
        default=100.0,
        help="arrivals per second of a built-in trace; 'inf': all at once (default 100)",
    )
    p.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        help="built-in trace: every prompt starts with the same system prompt of N tokens",
    )
    p.add_argument("--n", type=int, default=1, help="built-in trace: parallel samples per request")
    p.add_argument(
        "--prefix-len",
        type=int,
        default=0,
        help="CSV trace: shared prefix length of rows that name a prefix_id but no prefix_len",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-seq-len", type=int, default=4096, help="longest sequence (static slots reserve it)")
    p.add_argument("--max-seqs", type=int, default=4096, help="sequence slots of the block and vpaged caches")
    p.add_argument("--step-ms", type=float, default=30.0, help="trace time of one decode step")
    p.add_argument(
        "--kinds",
        "--policies",  # its earlier name
        dest="kinds",
        default="all",
        help="comma-separated cache kinds, e.g. 'static,block 16,vpaged interleaved 2 MiB' (default all; "
        "--policies is the same option under its earlier name)",
    )
    p.add_argument("--samples", type=int, default=100, help="memory samples per cache kind")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON ('-': standard output)")
    p.add_argument("--plot", metavar="DIR", help="write memory_over_time.png and waste_by_cause.png into DIR")
    p.set_defaults(func=run, parser=p)


def run(args) -> int:
    from ..sim import SimConfig, builtin_trace, kind_names, load_csv, make_kind, model_shape, simulate
    from ..sim.report import plot, print_table, write_json

    parser = args.parser
    try:
        if args.budget_gib <= 0 or not math.isfinite(args.budget_gib):
            raise InvalidArgumentError(f"--budget-gib must be a positive number, got {args.budget_gib}")
        for name in ("requests", "max_seq_len", "max_seqs", "samples", "n"):
            if getattr(args, name) <= 0:
                raise InvalidArgumentError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
        if args.step_ms <= 0:
            raise InvalidArgumentError(f"--step-ms must be positive, got {args.step_ms}")
        shape = model_shape(args.model).per_rank(args.tensor_parallel_size)
        if args.kv_dtype != "auto":
            shape = dataclasses.replace(shape, kv_dtype=KVFormat(shape.dtype, args.kv_dtype).kv_dtype)
        if Path(args.trace).suffix.lower() == ".csv" or Path(args.trace).exists():
            trace = load_csv(args.trace, args.max_seq_len, args.prefix_len)
            trace_name = Path(args.trace).name
        else:
            trace = builtin_trace(
                args.trace, args.requests, args.rate, args.max_seq_len, args.seed, args.shared_prefix, args.n
            )
            trace_name = args.trace
        sharing = any(r.prefix_id is not None or r.n > 1 for r in trace)
        names = kind_names(sharing) if args.kinds == "all" else [n.strip() for n in args.kinds.split(",")]
        cfg = SimConfig(shape, int(args.budget_gib * GiB), args.max_seq_len, args.max_seqs)
        kinds = [make_kind(n, cfg) for n in names]  # every name checked before the long run starts
    except (InvalidArgumentError, DTypeError) as e:
        parser.error(str(e))
    results = []
    for kind in _progress(kinds):
        try:
            results.append(simulate(kind, trace, args.step_ms / 1000, samples=args.samples))
        finally:
            kind.close()
    title = (
        f"{shape.name}{'' if shape.kv_dtype is None else ' K/V ' + args.kv_dtype} "
        f"({shape.bytes_per_token / 1024:g} KiB/token), {args.budget_gib:g} GiB, "
        f"{trace_name}: {len(trace)} requests"
    )
    summaries = [r.summary() for r in results]
    payload = {
        "title": title,
        "model": shape.name,
        "bytes_per_token": shape.bytes_per_token,
        "kv_dtype": None if shape.kv_dtype is None else args.kv_dtype,
        "tensor_parallel_size": args.tensor_parallel_size,
        "budget_bytes": cfg.budget_bytes,
        "trace": trace_name,
        "requests": len(trace),
        "mean_prompt_len": sum(r.prompt_len for r in trace) / len(trace),
        "mean_output_len": sum(r.output_len for r in trace) / len(trace),
        "max_seq_len": args.max_seq_len,
        "policies": summaries,  # one summary per cache kind (the key earlier results have)
        "timeline": {
            r.kind: [{"step": s.step, "running": s.running, **s.breakdown.as_dict()} for s in r.samples]
            for r in results
        },
    }
    if args.json == "-":
        import json

        json.dump(payload, sys.stdout, indent=2)
        print()
    else:
        print_table(title, summaries)
        if args.json:
            write_json(Path(args.json), payload)
            print(f"JSON: {args.json}")
    if args.plot:
        try:
            for path in plot(results, Path(args.plot), title):
                print(f"plot: {path}", file=sys.stderr if args.json == "-" else sys.stdout)
        except InvalidArgumentError as e:
            print(f"vpaged simulate: {e}", file=sys.stderr)
            return 2
    return 0


def _progress(items):
    try:
        from rich.progress import track
    except ImportError:
        return items
    return track(items, description="simulating", transient=True, console=None)
