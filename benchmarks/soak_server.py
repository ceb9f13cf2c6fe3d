"""Soak test of the HTTP server: mixed requests from many client threads under a KV budget small enough that
the engine preempts, with disconnects, kills and bad requests interleaved; then checks that the server is
idle and holds nothing.

Each request is one of: a non-streaming completion (answered in full), a streamed one (read to [DONE]), a
non-streaming one whose client disconnects after a moment, a streamed one killed mid-stream (the socket
closed after a few chunks), or a bad request (wrong types, too long, not JSON, wrong content type, unknown
route). Prompts are random token ids (random:llama-tiny, no tokenizer), greedy, EOS ignored.

  python benchmarks/soak_server.py
  python benchmarks/soak_server.py --requests 300 --clients 32 --output soak_server.json

Reports requests answered, errors by type, p50 / p99 latency of the completed requests, the engine's pages,
live tokens and preemptions, and the process RSS before and after; prints a table and writes
benchmarks/results/soak_server_cpu.json (or --output). Bounded: 127.0.0.1 only, at most 2000 requests, and a
deadline (--max-seconds, at most 300) after which no new request starts. Exit status 1 when a 5xx was
answered or the server did not end idle with its pages back.
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import statistics
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, print_table, write_json  # noqa: E402

from vpaged.serve import LLMEngine, load_model  # noqa: E402
from vpaged.serve.http.server import ServerThread  # noqa: E402

NAME = "soak"
KINDS = (("complete", 40), ("stream", 20), ("disconnect", 15), ("kill", 15), ("bad", 10))


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def bad_request(rng: random.Random, max_len: int):
    """(method, path, body bytes, content type) of a request the server must refuse with a 4xx."""
    good = {"model": NAME, "prompt": [1, 2, 3], "max_tokens": 4}
    cases = [
        ("POST", "/v1/completions", json.dumps({**good, "max_tokens": "5"}), "application/json"),
        ("POST", "/v1/completions", json.dumps({**good, "n": 2.0}), "application/json"),
        ("POST", "/v1/completions", json.dumps({**good, "prompt": [1] * (max_len + 5)}), "application/json"),
        ("POST", "/v1/completions", json.dumps({**good, "seed": 2**64, "temperature": 1}), "application/json"),
        ("POST", "/v1/completions", "[" * 6000 + "]" * 6000, "application/json"),
        ("POST", "/v1/completions", "{not json", "application/json"),
        ("POST", "/v1/completions", json.dumps(good), "text/plain"),
        ("POST", "/v1/chat/completions", json.dumps({"model": NAME, "messages": []}), "application/json"),
        ("GET", "/no/such/route", "", None),
    ]
    return rng.choice(cases)


def raw_request(host: str, port: int, payload: dict) -> socket.socket:
    data = json.dumps(payload).encode()
    s = socket.create_connection((host, port), timeout=30)
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--kv-budget-kib", type=int, default=256, help="small enough that the engine preempts")
    ap.add_argument("--page-size", type=int, default=4096, help="small pages: sequences grow page by page")
    ap.add_argument("--max-seconds", type=float, default=240.0, help="no request starts after this (<= 300)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the engine")
    ap.add_argument("--output", default="soak_server_cpu.json")
    args = ap.parse_args()
    total = max(1, min(args.requests, 2000))
    max_seconds = min(args.max_seconds, 300.0)
    torch.set_num_threads(args.threads)
    import httpx

    model, _ = load_model("random:llama-tiny", dtype=torch.float32)
    max_len = 512
    engine = LLMEngine(
        model,
        None,
        kv_budget_bytes=args.kv_budget_kib << 10,
        max_num_seqs=16,
        max_num_batched_tokens=128,
        max_model_len=max_len,
        page_size=args.page_size,
    )
    rng = random.Random(args.seed)
    vocab = model.config.get_text_config(decoder=True).vocab_size
    kinds = rng.choices([k for k, _ in KINDS], weights=[w for _, w in KINDS], k=total)
    plan = []
    for i, kind in enumerate(kinds):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(8, 200))]
        plan.append((i, kind, prompt, rng.randint(8, 120), rng.random()))
    lock = threading.Lock()
    outcomes: Counter = Counter()
    latencies: list[float] = []
    next_job = iter(plan)
    start = time.monotonic()

    with ServerThread(engine, model_name=NAME) as srv:
        loop = srv.app.state.engine_loop

        def stats():
            return loop.call(engine.stats).result(60)

        before, rss_before = stats(), rss_mib()

        def record(key: str, seconds: float | None = None) -> None:
            with lock:
                outcomes[key] += 1
                if seconds is not None:
                    latencies.append(seconds)

        def run(client, job) -> None:
            i, kind, prompt, max_tokens, u = job
            body = {"model": NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            t0 = time.perf_counter()
            try:
                if kind == "complete":
                    r = client.post("/v1/completions", json=body)
                    record(f"answered {r.status_code}", time.perf_counter() - t0 if r.status_code == 200 else None)
                elif kind == "stream":
                    done = False
                    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                        for line in r.iter_lines():
                            done = done or line == "data: [DONE]"
                    record(f"answered {r.status_code}" + ("" if done else " (no [DONE])"), time.perf_counter() - t0)
                elif kind == "disconnect":
                    s = raw_request(srv.host, srv.port, body)
                    time.sleep(0.05 + 0.5 * u)
                    s.close()
                    record("disconnected (client)")
                elif kind == "kill":
                    s = raw_request(srv.host, srv.port, {**body, "stream": True})
                    seen = b""
                    while seen.count(b"data: {") < 2:
                        chunk = s.recv(4096)
                        if not chunk:
                            break
                        seen += chunk
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                    s.close()  # linger 0: a reset, as a killed client leaves
                    record("killed mid-stream (client)")
                else:
                    method, path, raw, ctype = bad_request(random.Random(i), max_len)
                    headers = {"content-type": ctype} if ctype else {}
                    r = client.request(method, path, content=raw.encode(), headers=headers)
                    record(f"refused {r.status_code}" if 400 <= r.status_code < 500 else f"answered {r.status_code}")
            except Exception as e:  # noqa: BLE001 - counted by type
                record(f"client error {type(e).__name__}")

        def worker() -> None:
            with httpx.Client(base_url=srv.url, timeout=120) as client:
                while time.monotonic() - start < max_seconds:
                    with lock:
                        job = next(next_job, None)
                    if job is None:
                        return
                    run(client, job)

        threads = [threading.Thread(target=worker, daemon=True) for _ in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(max_seconds + 180)
        seconds = time.monotonic() - start
        idle_deadline = time.monotonic() + 30
        after = stats()
        while (after.running or after.waiting or after.swapped) and time.monotonic() < idle_deadline:
            time.sleep(0.1)
            after = stats()
        rss_after = rss_mib()

    pages = ("kv_used_pages", "kv_free_pages", "kv_dormant_pages", "live_kv_tokens", "running", "waiting")
    ok = (
        not any(k.startswith("answered 5") for k in outcomes)
        and after.running == after.waiting == after.swapped == after.live_kv_tokens == 0
        and after.kv_used_pages == after.kv_dormant_pages
    )
    lat = sorted(latencies)
    result = {
        "requests_planned": total,
        "requests_done": sum(outcomes.values()),
        "seconds": seconds,
        "outcomes": dict(sorted(outcomes.items())),
        "latency_p50_s": statistics.median(lat) if lat else None,
        "latency_p99_s": lat[min(len(lat) - 1, int(round(0.99 * (len(lat) - 1))))] if lat else None,
        "preemptions_swap": after.preemptions_swap - before.preemptions_swap,
        "preemptions_recompute": after.preemptions_recompute - before.preemptions_recompute,
        "requests_aborted": after.requests_aborted - before.requests_aborted,
        "before": {k: getattr(before, k) for k in pages},
        "after": {k: getattr(after, k) for k in pages},
        "rss_mib_before": rss_before,
        "rss_mib_after": rss_after,
        "idle_and_pages_back": ok,
    }
    print(
        f"vpaged soak: {result['requests_done']}/{total} requests from {args.clients} clients in {seconds:.1f} s, "
        f"KV budget {args.kv_budget_kib} KiB"
    )
    print_table(["outcome", "count"], [[k, v] for k, v in result["outcomes"].items()])
    print_table(
        ["", "before", "after"],
        [[k, result["before"][k], result["after"][k]] for k in pages]
        + [["rss MiB", f"{rss_before:.0f}", f"{rss_after:.0f}"]],
    )
    p50, p99 = result["latency_p50_s"], result["latency_p99_s"]
    print(
        f"latency p50 / p99 (completed): {p50 or 0:.2f} / {p99 or 0:.2f} s; preemptions swap / recompute: "
        f"{result['preemptions_swap']} / {result['preemptions_recompute']}; aborted: {result['requests_aborted']}; "
        f"idle with pages back: {ok}"
    )
    path = write_json(
        args.output,
        {
            "benchmark": "soak_server",
            "machine": machine(),
            "config": {
                "requests": total,
                "clients": args.clients,
                "kv_budget_bytes": args.kv_budget_kib << 10,
                "page_size": args.page_size,
                "max_seconds": max_seconds,
                "seed": args.seed,
                "threads": args.threads,
                "model": "random:llama-tiny",
                "max_model_len": max_len,
                "mix": dict(KINDS),
                "engine": {k: v for k, v in asdict(before).items() if k == "kv"},
            },
            "result": result,
        },
    )
    print(f"wrote {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
