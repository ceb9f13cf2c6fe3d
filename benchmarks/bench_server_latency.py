"""Keep-alive latency of the HTTP server on an idle machine: repeated GET /health and a small non-streaming
/v1/completions (3 prompt tokens, 1 greedy token) over one kept-alive connection to 127.0.0.1.

What it watches is the server's own overhead per request: with TCP_NODELAY missing on accepted connections,
Nagle's algorithm meets the client's delayed ACK and every small response waits ~40 ms. Target: <= 5 ms
median for /health, and for the completion less the same request run on the engine directly (no HTTP: the
"engine alone" row, measured first in the same process), i.e. the HTTP path's overhead. The model is
random:llama-tiny (no tokenizer), so the completion's forward costs little.

  python benchmarks/bench_server_latency.py
  python benchmarks/bench_server_latency.py --requests 500 --output server_latency.json

Writes benchmarks/results/server_latency_cpu.json (or --output). Bounded: --requests per row (at most
5000), and a 120 s deadline for the whole run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, print_table, write_json  # noqa: E402

from vpaged.serve import LLMEngine, SamplingParams, load_model  # noqa: E402
from vpaged.serve.http.server import ServerThread  # noqa: E402

TARGET_MS = 5.0
KEYS = ("p50_ms", "p90_ms", "p99_ms", "mean_ms")
DEADLINE_S = 120.0


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def measure(client, method: str, path: str, json_body, n: int, deadline: float) -> list[float]:
    out = []
    for _ in range(n):
        if time.monotonic() > deadline:
            break
        t0 = time.perf_counter()
        r = client.request(method, path, json=json_body)
        out.append((time.perf_counter() - t0) * 1e3)
        r.raise_for_status()
    return out


def engine_alone(engine, n: int, deadline: float) -> list[float]:
    params = SamplingParams(max_tokens=1, temperature=0)
    out = []
    for _ in range(n):
        if time.monotonic() > deadline:
            break
        t0 = time.perf_counter()
        engine.add_request([1, 2, 3], params)
        while engine.has_unfinished():
            engine.step()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def summary(ms: list[float]) -> dict:
    return {
        "requests": len(ms),
        "p50_ms": statistics.median(ms),
        "p90_ms": percentile(ms, 0.90),
        "p99_ms": percentile(ms, 0.99),
        "mean_ms": statistics.fmean(ms),
        "max_ms": max(ms),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=300, help="requests per row (<= 5000)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the engine")
    ap.add_argument("--output", default="server_latency_cpu.json")
    args = ap.parse_args()
    n = max(10, min(args.requests, 5000))
    torch.set_num_threads(args.threads)
    import httpx

    model, _ = load_model("random:llama-tiny", dtype=torch.float32)
    engine = LLMEngine(model, None, kv_budget_bytes=16 << 20, max_num_seqs=8, max_num_batched_tokens=64)
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 1, "temperature": 0}
    rows, results = [], {}
    deadline = time.monotonic() + DEADLINE_S
    engine_alone(engine, 20, deadline)  # warm-up
    alone = summary(engine_alone(engine, n, deadline))
    results["engine alone (no HTTP)"] = alone
    rows.append(["engine alone (no HTTP)", alone["requests"]] + [f"{alone[k]:.2f}" for k in KEYS] + ["-", "-"])
    with ServerThread(engine, model_name="m") as srv, httpx.Client(base_url=srv.url, timeout=30) as client:
        for name, method, path, payload in (
            ("GET /health", "GET", "/health", None),
            ("POST /v1/completions (1 token)", "POST", "/v1/completions", body),
        ):
            measure(client, method, path, payload, 20, deadline)  # warm-up
            ms = measure(client, method, path, payload, n, deadline)
            res = summary(ms)
            res["overhead_p50_ms"] = res["p50_ms"] - (alone["p50_ms"] if method == "POST" else 0.0)
            res["meets_target"] = res["overhead_p50_ms"] <= TARGET_MS
            results[name] = res
            rows.append(
                [name, len(ms)]
                + [f"{res[k]:.2f}" for k in KEYS]
                + [f"{res['overhead_p50_ms']:.2f}", "yes" if res["meets_target"] else "NO"]
            )
    print(f"vpaged HTTP keep-alive latency, idle server on 127.0.0.1 (target p50 <= {TARGET_MS} ms)")
    print_table(["request", "n", "p50 ms", "p90 ms", "p99 ms", "mean ms", "HTTP p50 ms", f"<= {TARGET_MS} ms"], rows)
    path = write_json(
        args.output,
        {
            "benchmark": "server_latency",
            "machine": machine(),
            "config": {"requests": n, "threads": args.threads, "model": "random:llama-tiny", "target_ms": TARGET_MS},
            "results": results,
        },
    )
    print(f"wrote {path}")
    return 0 if all(r.get("meets_target", True) for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
