"""Several engines on one machine: a static split of the KV budget against one shared budget.

Three engine processes (random-weight models by default; any `--models` the engine loads) serve bursty
traffic: time is cut into phases, and engine i is busy in the phases p with p % 3 == i (Poisson arrivals at
--rate within a busy phase) and idle otherwise. The total KV budget B is either split statically (each engine
a private pool of B/3) or shared (one SharedBudget of B; each engine's ceiling is B) under the budget's share
policy: "shared" with the default policy ("greedy"), "fair" with the fair-share rule (memory/budget/policy.py).
Reported per engine and overall: TTFT p50 / p99, output tokens/s, preemptions, requests refused or lost; and
each process's mapped KV bytes over time (a plot with matplotlib when it is installed).

Fairness of the comparison: every arm gets the same B and the same arrivals and prompts (seeded by engine and
phase); each engine warms up (a few requests) before the clock starts; with --rounds N the arms run N times,
their order rotating from round to round, and the figures reported are the medians over the rounds.

    python benchmarks/bench_elastic.py --quick            # a short run (about a minute on 2 cores)
    python benchmarks/bench_elastic.py --rounds 2 --output benchmarks/results/elastic_cpu.json --plot elastic_cpu.png
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def worker(args) -> None:
    """One engine: load, say ready, wait for the start time on stdin, serve its phases, print a JSON line."""
    import torch

    from vpaged.errors import VPagedError
    from vpaged.serve import LLMEngine, SamplingParams, load_model
    from vpaged.serve.bench import percentile, poisson_arrivals, random_prompts

    torch.set_num_threads(1)
    model, tok = load_model(args.model, dtype=torch.float32)
    shared = args.mode != "static"
    engine = LLMEngine(
        model,
        tok,
        kv_budget_bytes=args.budget_bytes if shared else args.budget_bytes // 3,
        shared_budget=args.budget_name if shared else None,
        max_num_seqs=args.max_num_seqs,
        max_model_len=1024,
        enable_prefix_caching=True,
        cpu_prepack=False,
    )
    pool = engine.store.cache.pool
    # This engine's arrivals: Poisson within each of its busy phases.
    arrivals = []
    for p in range(args.phases):
        if p % 3 == args.index:
            base = p * args.phase_s
            arrivals += [
                base + t for t in poisson_arrivals(10_000, args.rate, seed=1000 * args.index + p) if t < args.phase_s
            ]
    vocab = model.config.vocab_size
    prompts = random_prompts(len(arrivals), args.min_prompt, args.max_prompt, vocab, seed=args.index)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    # Warm-up (first calls into torch and the kernels) before the clock starts, then back to an idle engine.
    for k, prompt in enumerate(random_prompts(2, args.min_prompt, args.min_prompt, vocab, seed=99)):
        engine.add_request(list(prompt), params, request_id=f"warm{k}")
    while engine.has_unfinished():
        engine.step()
    warm = engine.stats()
    warm_preemptions = warm.preemptions_swap + warm.preemptions_recompute
    print(json.dumps({"ready": os.getpid()}), flush=True)
    t0 = float(sys.stdin.readline())
    time.sleep(max(0.0, t0 - time.time()))
    ids, first, done, refused, memory = {}, {}, {}, 0, []
    nxt, last_sample = 0, -1.0
    end = args.phases * args.phase_s
    while True:
        now = time.time() - t0
        while nxt < len(arrivals) and arrivals[nxt] <= now:
            try:
                ids[engine.add_request(list(prompts[nxt]), params, request_id=f"r{nxt}")] = nxt
            except VPagedError:
                refused += 1
            nxt += 1
        if now - last_sample >= 0.1:
            memory.append((round(now, 3), pool.stats().used_pages * pool.page_size))
            last_sample = now
        if engine.has_unfinished():
            for out in engine.step():
                i = ids.get(out.request_id)
                t = time.time() - t0
                if i is not None and i not in first and out.outputs and out.outputs[0].token_ids:
                    first[i] = t
                if i is not None and out.finished:
                    done[i] = len(out.outputs[0].token_ids)
        elif nxt >= len(arrivals) and now >= end:
            break
        else:
            time.sleep(0.005)  # idle: not calling into vpaged (the budget's thread gives back meanwhile)
    st = engine.stats()
    ttft = [first[i] - arrivals[i] for i in first]
    busy_s = max(1e-9, (max(first.values(), default=0.0) if first else 0.0))
    print(
        json.dumps(
            {
                "index": args.index,
                "model": args.model,
                "requests": len(arrivals),
                "finished": len(done),
                "refused": refused,
                "lost": len(arrivals) - len(done) - refused,
                "output_tokens": sum(done.values()),
                "seconds": time.time() - t0,
                "busy_seconds": busy_s,
                "ttft": ttft,
                "ttft_p50": percentile(ttft, 50),
                "ttft_p99": percentile(ttft, 99),
                "preemptions": int(st.preemptions_swap + st.preemptions_recompute - warm_preemptions),
                "memory": memory,
            }
        ),
        flush=True,
    )
    engine.close()


def run_mode(args, mode: str) -> list[dict]:
    from vpaged.memory import SharedBudget

    name = f"bench-elastic-{uuid.uuid4().hex[:8]}"
    policy = {"shared": "greedy", "fair": "fair"}.get(mode)
    budget = SharedBudget.create(name, args.budget_bytes, share_policy=policy) if policy else None
    procs = []
    try:
        for i, model in enumerate(args.models):
            cmd = [
                sys.executable,
                __file__,
                "--worker",
                str(i),
                "--mode",
                mode,
                "--model",
                model,
                "--budget-name",
                name,
            ]
            cmd += [
                "--budget-bytes",
                str(args.budget_bytes),
                "--phases",
                str(args.phases),
                "--phase-s",
                str(args.phase_s),
            ]
            cmd += [
                "--rate",
                str(args.rates[i] if args.rates else args.rate),
                "--max-tokens",
                str(args.max_tokens),
                "--max-num-seqs",
                str(args.max_num_seqs),
            ]
            cmd += ["--min-prompt", str(args.min_prompt), "--max-prompt", str(args.max_prompt)]
            env = dict(os.environ, PYTHONPATH=str(HERE.parent))
            procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env))
        for p in procs:
            assert "ready" in json.loads(p.stdout.readline())
        start = time.time() + 0.5
        for p in procs:
            p.stdin.write(f"{start}\n")
            p.stdin.flush()
        results = [json.loads(p.stdout.readline()) for p in procs]
        for p in procs:
            p.wait(timeout=60)
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        if budget is not None:
            SharedBudget.remove(name)


def summarize(mode: str, rows: list[dict]) -> dict:
    from vpaged.serve.bench import percentile

    ttft = [t for r in rows for t in r["ttft"]]
    seconds = max(r["seconds"] for r in rows)
    return {
        "mode": mode,
        "requests": sum(r["requests"] for r in rows),
        "finished": sum(r["finished"] for r in rows),
        "refused": sum(r["refused"] for r in rows),
        "lost": sum(r["lost"] for r in rows),
        "ttft_p50": percentile(ttft, 50),
        "ttft_p99": percentile(ttft, 99),
        "output_tokens_per_s": sum(r["output_tokens"] for r in rows) / seconds,
        "preemptions": sum(r["preemptions"] for r in rows),
        "engines": [{k: v for k, v in r.items() if k != "ttft"} for r in rows],
    }


def median_of_rounds(mode: str, rounds: list[dict]) -> dict:
    """The medians over rounds of the overall and per-engine figures; requests lost or refused: the most in
    any round. The rounds themselves (with each engine's memory over time) are kept under "rounds"."""

    def med(rows, key):
        values = [r[key] for r in rows if r[key] is not None]
        return statistics.median(values) if values else None

    keys = ("ttft_p50", "ttft_p99", "preemptions")
    engines = []
    for i in range(len(rounds[0]["engines"])):
        rows = [r["engines"][i] for r in rounds]
        e = {k: rows[0][k] for k in ("index", "model", "requests")}
        e |= {k: med(rows, k) for k in (*keys, "finished")}
        e["output_tokens_per_s"] = statistics.median(r["output_tokens"] / r["seconds"] for r in rows)
        e |= {"refused": max(r["refused"] for r in rows), "lost": max(r["lost"] for r in rows)}
        engines.append(e)
    out = {"mode": mode, "rounds_run": len(rounds), "requests": rounds[0]["requests"]}
    out |= {k: med(rounds, k) for k in (*keys, "finished", "output_tokens_per_s")}
    out |= {"refused": max(r["refused"] for r in rounds), "lost": max(r["lost"] for r in rounds)}
    return out | {"engines": engines, "rounds": rounds}


def plot(results: dict, path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(len(results), 1, figsize=(9, 3 * len(results)), sharex=True, squeeze=False)
    axes = [row[0] for row in axes]
    for ax, (mode, summary) in zip(axes, results.items()):
        for e in summary["rounds"][0]["engines"]:
            ts, mem = zip(*e["memory"]) if e["memory"] else ((), ())
            ax.plot(ts, [m / 2**20 for m in mem], label=f"engine {e['index']} ({e['model']})")
        ax.set_title(f"{mode}: mapped KV per process (round 1)")
        ax.set_ylabel("MiB")
        ax.legend(loc="upper right", fontsize=8)
    axes[-1].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path)
    return True


def overhead(args) -> dict:
    """One engine alone, with and without a shared budget (no contention), runs interleaved: the cost of
    being a member (the ledger calls when the grant grows, the client lock on cache calls)."""
    import statistics

    import torch

    from vpaged.memory import SharedBudget
    from vpaged.serve import LLMEngine, SamplingParams, load_model
    from vpaged.serve.bench import Workload, random_prompts, run_workload

    torch.set_num_threads(1)
    model, tok = load_model(args.models[0], dtype=torch.float32)
    prompts = random_prompts(args.overhead_requests, args.min_prompt, args.max_prompt, model.config.vocab_size)
    work = Workload(prompts, [0.0] * len(prompts), args.overhead_max_tokens)
    params = SamplingParams(max_tokens=args.overhead_max_tokens, temperature=0.0, ignore_eos=True)
    name = f"bench-overhead-{uuid.uuid4().hex[:8]}"
    SharedBudget.create(name, args.budget_bytes)
    rates = {"private": [], "shared": []}
    try:
        for k in range(args.repeats):
            for mode in ("private", "shared") if k % 2 == 0 else ("shared", "private"):  # alternate who goes first
                engine = LLMEngine(
                    model, tok, kv_budget_bytes=args.budget_bytes, max_num_seqs=args.max_num_seqs, cpu_prepack=False,
                    shared_budget=name if mode == "shared" else None,
                )  # fmt: skip
                rates[mode].append(run_workload(engine, work, params).output_tokens_per_s)
                engine.close()
    finally:
        SharedBudget.remove(name)
    med = {m: statistics.median(v) for m, v in rates.items()}
    paired = statistics.median(s / p for s, p in zip(rates["shared"], rates["private"]))
    out = {
        "requests": len(prompts), "max_tokens": args.overhead_max_tokens, "tokens_per_s": rates, "median": med,
        "shared_over_private": med["shared"] / med["private"], "shared_over_private_paired": paired,
    }  # fmt: skip
    print(
        f"one engine, no contention: private {med['private']:.1f} tok/s, shared {med['shared']:.1f} tok/s "
        f"(x{out['shared_over_private']:.3f} of the medians, x{paired:.3f} paired per round; {args.repeats} rounds)"
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs=3, default=["random:llama-tiny"] * 3)
    ap.add_argument("--budget-mib", type=float, default=12.0, help="total KV budget B (MiB)")
    ap.add_argument("--phases", type=int, default=6)
    ap.add_argument("--phase-s", type=float, default=6.0)
    ap.add_argument("--rate", type=float, default=6.0, help="requests per second within a busy phase")
    ap.add_argument(
        "--rates", nargs=3, type=float, default=None,
        help="requests per second in a busy phase, per engine (default: --rate for each); a larger model "
        "steps slower, and one rate for all would measure its CPU queue rather than its memory",
    )  # fmt: skip
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--min-prompt", type=int, default=64)
    ap.add_argument("--max-prompt", type=int, default=384)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument(
        "--modes",
        nargs="*",
        default=["static", "shared"],
        choices=["static", "shared", "fair"],
        help="static: B/3 each; shared: one budget B (default share policy, greedy); fair: one budget B, fair share",
    )
    ap.add_argument("--rounds", type=int, default=1, help="runs of every arm, the order rotating each round")
    ap.add_argument("--quick", action="store_true", help="3 phases of 4 s")
    ap.add_argument("--overhead", action="store_true", help="also: one engine with and without a shared budget")
    ap.add_argument("--overhead-requests", type=int, default=64)
    ap.add_argument("--overhead-max-tokens", type=int, default=128, help="long enough that a run is seconds, not noise")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output", default=None, help="write the results as JSON here (default: results/elastic_cpu.json)")
    ap.add_argument("--plot", default=None, help="write the memory-over-time plot here (PNG)")
    # A worker's options (the parent starts workers with them).
    ap.add_argument("--worker", type=int, default=None, dest="index")
    ap.add_argument("--mode", default="static")
    ap.add_argument("--model", default=None)
    ap.add_argument("--budget-name", default=None)
    ap.add_argument("--budget-bytes", type=int, default=None)
    args = ap.parse_args()
    if args.index is not None:
        return worker(args)
    if args.quick:
        args.phases, args.phase_s = 3, 4.0
    args.budget_bytes = int(args.budget_mib * 2**20)
    # Beside the other results by default (VPAGED_RESULTS_DIR redirects them, as `vpaged bench` does); a
    # folder that does not exist is said now, not after the runs.
    results_dir = Path(os.environ.get("VPAGED_RESULTS_DIR") or HERE / "results")
    output = Path(args.output) if args.output else results_dir / "elastic_cpu.json"
    if not output.parent.is_dir():
        ap.error(f"--output {output}: folder {output.parent} does not exist")
    rounds = {mode: [] for mode in args.modes}
    for k in range(args.rounds if args.modes else 0):
        shift = k % len(args.modes)
        for mode in args.modes[shift:] + args.modes[:shift]:  # rotate the arms' order: none always runs first
            rounds[mode].append(summarize(mode, run_mode(args, mode)))
            r = rounds[mode][-1]
            print(
                f"round {k + 1} {mode}: TTFT p99 {r['ttft_p99']:.3f} s, {r['output_tokens_per_s']:.1f} tok/s",
                flush=True,
            )
    results = {mode: median_of_rounds(mode, rounds[mode]) for mode in args.modes}
    if args.overhead:
        results["overhead"] = overhead(args)
    print(
        f"{'mode':<8} {'engine':<8} {'reqs':>5} {'done':>5} {'refused':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'tok/s':>8} {'preempt':>7}"
    )
    for mode in args.modes:
        s = results[mode]
        for e in s["engines"]:
            print(
                f"{mode:<8} {e['index']:<8} {e['requests']:>5} {e['finished']:>5} {e['refused']:>7} "
                f"{e['ttft_p50'] or 0:>9.3f} {e['ttft_p99'] or 0:>9.3f} {e['output_tokens_per_s']:>8.1f} "
                f"{e['preemptions']:>7}"
            )
        print(
            f"{mode:<8} {'all':<8} {s['requests']:>5} {s['finished']:>5} {s['refused']:>7} {s['ttft_p50'] or 0:>9.3f} "
            f"{s['ttft_p99'] or 0:>9.3f} {s['output_tokens_per_s']:>8.1f} {s['preemptions']:>7}"
        )
    for mode in ("shared", "fair"):
        if "static" in results and mode in results:
            st, sh = results["static"], results[mode]
            ratio = sh["ttft_p99"] / st["ttft_p99"] if st["ttft_p99"] else float("nan")
            tput = sh["output_tokens_per_s"] / st["output_tokens_per_s"]
            results[f"{mode}_vs_static"] = {"ttft_p99_ratio": ratio, "throughput_ratio": tput}
            print(f"{mode} / static: TTFT p99 x{ratio:.2f}, throughput x{tput:.2f} (medians of {args.rounds})")
    meta = {"cpu": _cpu_name(), "budget_bytes": args.budget_bytes, "phases": args.phases, "phase_s": args.phase_s,
            "rate": args.rate, "rates": args.rates, "models": args.models, "max_tokens": args.max_tokens, "rounds": args.rounds,
            "min_prompt": args.min_prompt, "max_prompt": args.max_prompt, "max_num_seqs": args.max_num_seqs,
            "load_average": os.getloadavg()}  # fmt: skip
    if args.plot and args.modes and plot({m: results[m] for m in args.modes}, args.plot):
        print(f"plot: {args.plot}")
    output.write_text(json.dumps({"config": meta, "results": results}, indent=2) + "\n")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


def summary_rows(results: dict) -> list[dict]:
    """This script's comparisons as `vpaged bench` and docs/numbers.md show them, read from its JSON: three
    engine processes on one shared budget against a static split of it, TTFT p99, output tokens/s and the
    requests finished (a static split refuses a request larger than its share).
    Builtins only: the suite compiles this function alone, without the imports above."""
    r = results.get("results", {})
    static, shared = r.get("static"), r.get("shared")
    if not (static and shared):
        return []
    common = {"benchmark": "elastic", "baseline_name": "static split"}
    return [
        {
            **common,
            "comparison": "TTFT p99 of the finished requests, 3 engines, bursty",
            "vpaged": shared["ttft_p99"],
            "baseline": static["ttft_p99"],
            "unit": "s",
            "better": "lower",
        },
        {
            **common,
            "comparison": "output tokens/s, 3 engines, bursty",
            "vpaged": shared["output_tokens_per_s"],
            "baseline": static["output_tokens_per_s"],
            "unit": "tok/s",
            "better": "higher",
        },
    ] + (
        [  # files written before the counts were recorded have none
            {
                **common,
                "comparison": f"requests finished (of {shared['requests']}), 3 engines, bursty",
                "vpaged": shared["finished"],
                "baseline": static["finished"],
                "unit": "requests",
                "better": "higher",
            }
        ]
        if "finished" in shared and "finished" in static and "requests" in shared
        else []
    )


if __name__ == "__main__":
    main()
