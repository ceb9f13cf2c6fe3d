"""Prefill/decode split against one instance on the same cores (DistServe's measure), vLLM with vpaged's connector.

Run in the venv of scripts/test_vllm.sh:

    .venv-vllm/bin/python benchmarks/bench_vllm_pd.py [--rates 0.25,0.5,1 --requests 20]

SmolLM2-135M-Instruct fp32 (benchmarks/real_model.py), `vllm serve` processes (vLLM 0.32.0 CPU build):

- `single`: one instance on both cores (VLLM_CPU_OMP_THREADS_BIND=0-1), vLLM's prefix caching on;
- `split`: a prefill instance on core 0 (kv_role kv_producer) and a decode instance on core 1 (kv_consumer), one
  page store, behind benchmarks/pd_proxy.py (in this process): each request is prefilled on core 0, its pages
  reach the decode instance through the store, core 1 decodes.

The load: REQUESTS requests at Poisson arrivals of RATE a second (a fixed seed), a mix of long prompts (LONG
tokens, one request in four) and short ones (SHORT tokens), distinct prompts (no prefix reuse between requests),
OUTPUT greedy tokens each, streamed. Per rate and arm: TTFT (to the first chunk with text), TPOT ((last chunk -
first chunk) / (tokens - 1)), the share of requests meeting both TTFT <= TTFT_SLO and TPOT <= TPOT_SLO, tail
TPOT; and the highest rate measured at which >= 90 % meet both. Writes benchmarks/results/OUTPUT.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import sys
import threading
import time
import uuid
from http.server import ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pd_proxy  # noqa: E402
import real_model  # noqa: E402
from bench_vllm_connector import ROOT, VLLMServer, add_server_args  # noqa: E402
from common import machine, write_json  # noqa: E402

sys.path.insert(0, str(ROOT))


def stream(host: str, port: int, model: str, prompt: list[int], max_tokens: int) -> dict:
    body = json.dumps(dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
                           ignore_eos=True))  # fmt: skip
    conn = http.client.HTTPConnection(host, port, timeout=1800)
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    stamps = []
    for raw in resp:
        line = raw.decode().strip()
        if line.startswith("data:") and line != "data: [DONE]":
            chunk = json.loads(line[5:])
            if any(c.get("text") for c in chunk.get("choices", [])):
                stamps.append(time.perf_counter() - start)
    conn.close()
    ttft = stamps[0]
    tpot = (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1)
    return dict(ttft_s=ttft, tpot_s=tpot, chunks=len(stamps))


def workload(prose: list[int], args, round_: int, period: int, seed: int = 3) -> list[tuple[float, list[int]]]:
    """Round `round_` (one per rate) of requests: arrival times at rate 1 (scaled per rate) and prompts that
    start at positions of the text no other request of any round starts at (997 is prime to the text's period),
    so no request hits another's prefix, in vLLM's cache or in the store: every rate computes every prompt."""
    rng = random.Random(seed)
    out, at = [], 0.0
    for i in range(args.requests):
        length = args.long if i % 4 == 0 else args.short
        start = ((round_ * args.requests + i) * 997) % period
        out.append((at, prose[start : start + length]))
        at += rng.expovariate(1.0)
    return out


def run_rate(target: tuple[str, int], model: str, load, rate: float, args) -> dict:
    results: list[dict | None] = [None] * len(load)
    errors: list[str] = []

    def one(i: int, prompt: list[int]) -> None:
        try:
            results[i] = stream(target[0], target[1], model, prompt, args.output)
        except Exception as e:  # reported after the run
            errors.append(f"request {i}: {e}")

    threads, t0 = [], time.perf_counter()
    for i, (at, prompt) in enumerate(load):
        delay = at / rate - (time.perf_counter() - t0)
        if delay > 0:
            time.sleep(delay)
        t = threading.Thread(target=one, args=(i, prompt))
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError("; ".join(errors[:3]))
    ttft = [r["ttft_s"] for r in results]
    tpot = [r["tpot_s"] for r in results]
    ok = sum(a <= args.ttft_slo and b <= args.tpot_slo for a, b in zip(ttft, tpot))
    tpot_sorted = sorted(tpot)
    return dict(
        rate=rate, attainment=ok / len(results), mean_ttft_s=statistics.mean(ttft),
        p90_ttft_s=sorted(ttft)[int(0.9 * (len(ttft) - 1))], mean_tpot_s=statistics.mean(tpot),
        p90_tpot_s=tpot_sorted[int(0.9 * (len(tpot) - 1))], p99_tpot_s=tpot_sorted[-1],
        wall_s=time.perf_counter() - t0, requests=results,
    )  # fmt: skip


def arm(name: str, model: str, prose: list[int], period: int, args) -> dict:
    servers, proxy = [], None
    store = f"bench-pd-{uuid.uuid4().hex[:10]}"
    try:
        if name == "single":
            servers.append(VLLMServer(model, "0-1", None, args))
            target = (servers[0].host, int(servers[0].port))
        else:
            servers.append(VLLMServer(model, "0", store, args, role="kv_producer"))
            servers.append(VLLMServer(model, "1", store, args, role="kv_consumer"))
            urls = [f"http://{s.host}:{s.port}" for s in servers]
            proxy = ThreadingHTTPServer(("127.0.0.1", 0), pd_proxy.make_handler(*urls))
            threading.Thread(target=proxy.serve_forever, daemon=True).start()
            target = ("127.0.0.1", proxy.server_address[1])
        stream(*target, model, prose[:64][::-1], 4)  # warm the path (not measured; no request's prefix)
        rates = [run_rate(target, model, workload(prose, args, k, period), r, args) for k, r in enumerate(args.rates)]
    finally:
        if proxy is not None:
            proxy.shutdown()
        for s in servers:
            s.stop()
        from vpaged.memory.store import PageStore

        PageStore.remove(store)
    met = [r["rate"] for r in rates if r["attainment"] >= 0.9]
    return dict(rates=rates, best_rate_90=max(met) if met else 0.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[0.25, 0.5, 1.0])
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--long", type=int, default=1500)
    ap.add_argument("--short", type=int, default=200)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--ttft-slo", type=float, default=4.0, help="seconds")
    ap.add_argument("--tpot-slo", type=float, default=0.15, help="seconds")
    add_server_args(ap)
    ap.add_argument("--arms", default="single,split")
    ap.add_argument("--out", default="vllm-pd.json", help="results file name under benchmarks/results/")
    args = ap.parse_args()
    why = real_model.why_unavailable()
    if why:
        print(f"SmolLM2 is not available: {why}")
        return 1
    import vllm
    from transformers import AutoTokenizer

    model = str(real_model.model_dir())
    period = 4096
    prose = real_model.prose_ids(AutoTokenizer.from_pretrained(model), period) * 2  # a window may wrap around
    result = dict(machine=machine(), model=real_model.NAME, dtype="float32", vllm=vllm.__version__, args=vars(args))
    for name in args.arms.split(","):
        result[name] = arm(name, model, prose, period, args)
        summary = [{k: r[k] for k in ("rate", "attainment", "mean_ttft_s", "mean_tpot_s", "p99_tpot_s")}
                   for r in result[name]["rates"]]  # fmt: skip
        print(name, json.dumps(summary), "best rate at 90 %:", result[name]["best_rate_90"], flush=True)
    path = write_json(args.out, result)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
