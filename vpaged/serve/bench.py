"""Serving workloads and their measurement, shared by `vpaged bench-serve` and benchmarks/bench_serve.py.

A workload is a list of prompts (random token ids), arrival times (all at t=0, or Poisson) and sampling
parameters. `run_workload` drives an LLMEngine the way a server does (adds requests when they arrive, steps
while work is pending) and reports throughput, time to first token (TTFT), time per output token (TPOT),
peak KV bytes, preemptions and peak concurrency.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from .options import option


@dataclass
class Workload:
    prompts: list[list[int]]
    arrivals: list[float]  # seconds after the start
    max_tokens: int
    name: str = "workload"

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def random_prompts(
    num: int, min_len: int, max_len: int, vocab: int, seed: int = 0, shared_prefix: int = 0
) -> list[list[int]]:
    """`num` prompts of uniform random length in [min_len, max_len] (token ids drawn from [10, vocab), away from
    the special ids at the low end); with `shared_prefix`, every prompt starts with the same that many tokens
    (a system prompt) followed by its own min_len..max_len tokens."""
    rng = random.Random(seed)
    prefix = [rng.randrange(10, vocab) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(10, vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(num)]


def poisson_arrivals(num: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival times of a Poisson process of `rate` requests per second, the first at t=0."""
    rng = random.Random(seed + 1)
    t, out = 0.0, []
    for _ in range(num):
        out.append(t)
        t += rng.expovariate(rate)
    return out


@dataclass(frozen=True)
class WorkloadSpec:
    """A random workload by its shape (`vpaged bench-serve`'s flags are made from these fields): `draw` gives
    the Workload, the same for the same spec and vocabulary."""

    num_requests: int = field(default=64, metadata=option("requests in the workload"))
    min_prompt: int = field(default=64, metadata=option("shortest prompt, in tokens (after the shared prefix)"))
    max_prompt: int = field(default=512, metadata=option("longest prompt, in tokens (after the shared prefix)"))
    shared_prefix: int = field(default=0, metadata=option("tokens of a system prompt all requests share"))
    max_tokens: int = field(default=128, metadata=option("greedy output tokens per request (EOS ignored)"))
    request_rate: float = field(
        default=math.inf,
        metadata=option("Poisson arrivals per second", default_text="all requests at t=0"),
    )
    vocab: int | None = field(default=None, metadata=option("draw prompt ids below this", default_text="the model's"))
    seed: int = field(default=0, metadata=option("seed of the prompts and of the arrival times"))

    def draw(self, vocab: int, name: str = "bench-serve") -> Workload:
        """The workload: prompt ids drawn below self.vocab, or below `vocab` (the model's) when that is None."""
        prompts = random_prompts(
            self.num_requests,
            self.min_prompt,
            self.max_prompt,
            self.vocab or vocab,
            seed=self.seed,
            shared_prefix=self.shared_prefix,
        )
        if math.isinf(self.request_rate):
            arrivals = [0.0] * len(prompts)
        else:
            arrivals = poisson_arrivals(len(prompts), self.request_rate, seed=self.seed)
        return Workload(prompts, arrivals, self.max_tokens, name=name)


def percentile(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


@dataclass
class RunResult:
    kv: str
    requests: int
    seconds: float
    prompt_tokens: int
    output_tokens: int
    output_tokens_per_s: float
    total_tokens_per_s: float
    peak_kv_bytes: int
    peak_running: int | None
    preemptions_swap: int
    preemptions_recompute: int
    prefix_hit_tokens: int
    steps: int
    ttft_p50: float | None = None
    ttft_p99: float | None = None
    tpot_p50: float | None = None
    tpot_p99: float | None = None
    finish_reasons: dict = field(default_factory=dict)
    outputs: list[list[int]] | None = None

    def as_dict(self, with_outputs: bool = False) -> dict:
        d = asdict(self)
        if not with_outputs:
            d.pop("outputs")
        return d


def run_workload(
    engine,
    workload: Workload,
    params,
    kv: str = "",
    progress: Callable[[int], None] | None = None,
    keep_outputs: bool = False,
) -> RunResult:
    """Serve `workload` on `engine` (requests added at their arrival times) and measure it.

    `progress(n)` is called with the number of requests that finished in a step. The engine's stats are read
    after every step for the peak number of running requests (their cost is part of the measured time, as
    a server that exports metrics pays it too)."""
    n = len(workload.prompts)
    order = sorted(range(n), key=lambda i: workload.arrivals[i])
    ids: dict[str, int] = {}
    first: dict[int, float] = {}
    finish: dict[int, float] = {}
    tokens: dict[int, list[int]] = {}
    reasons: dict[str, int] = {}
    peak_running = 0
    steps = 0
    base = engine.stats()
    t0 = time.perf_counter()
    nxt = 0
    while nxt < n or engine.has_unfinished():
        now = time.perf_counter() - t0
        while nxt < n and workload.arrivals[order[nxt]] <= now:
            i = order[nxt]
            ids[engine.add_request(list(workload.prompts[i]), params, request_id=f"bench-{i}")] = i
            nxt += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, workload.arrivals[order[nxt]] - (time.perf_counter() - t0)))
            continue
        outs = engine.step()
        steps += 1
        t = time.perf_counter() - t0
        done = 0
        for out in outs:
            i = ids.get(out.request_id)
            if i is None:
                continue
            if i not in first and out.outputs and out.outputs[0].token_ids:
                first[i] = t
            if out.finished:
                finish[i] = t
                tokens[i] = list(out.outputs[0].token_ids)
                r = out.outputs[0].finish_reason
                reasons[r] = reasons.get(r, 0) + 1
                done += 1
        peak_running = max(peak_running, int(engine.stats().running))
        if progress is not None and done:
            progress(done)
    seconds = time.perf_counter() - t0
    st = engine.stats()
    out_tokens = sum(len(v) for v in tokens.values())
    ttft = [first[i] - workload.arrivals[i] for i in first]
    tpot = [(finish[i] - first[i]) / (len(tokens[i]) - 1) for i in tokens if len(tokens[i]) > 1 and i in first]
    return RunResult(
        kv=kv,
        requests=n,
        seconds=seconds,
        prompt_tokens=workload.prompt_tokens,
        output_tokens=out_tokens,
        output_tokens_per_s=out_tokens / seconds,
        total_tokens_per_s=(out_tokens + workload.prompt_tokens) / seconds,
        peak_kv_bytes=int(st.kv_high_water_bytes),
        peak_running=peak_running,
        preemptions_swap=int(st.preemptions_swap - base.preemptions_swap),
        preemptions_recompute=int(st.preemptions_recompute - base.preemptions_recompute),
        prefix_hit_tokens=int(st.prefix_hit_tokens - base.prefix_hit_tokens),
        steps=steps,
        ttft_p50=percentile(ttft, 50),
        ttft_p99=percentile(ttft, 99),
        tpot_p50=percentile(tpot, 50),
        tpot_p99=percentile(tpot, 99),
        finish_reasons=reasons,
        outputs=[tokens.get(i, []) for i in range(n)] if keep_outputs else None,
    )


def median(xs: list[float]) -> float:
    return statistics.median(xs)


async def _http_request(
    client, url: str, model: str, prompt: list[int], max_tokens: int, delay: float, t0: float
) -> dict:
    import asyncio
    import json as _json

    await asyncio.sleep(max(0.0, delay - (time.perf_counter() - t0)))
    start = time.perf_counter()
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    first = None
    tokens: list[int] = []
    finish = None
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = _json.loads(line[6:])
            for c in chunk.get("choices", []):
                if c.get("token_ids") and first is None:
                    first = time.perf_counter()
                tokens += c.get("token_ids", [])
                finish = c.get("finish_reason") or finish
    return {
        "start": start - t0,
        "first": None if first is None else first - t0,
        "end": time.perf_counter() - t0,
        "tokens": tokens,
        "finish_reason": finish,
    }


def _scrape(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def run_http_workload(
    url: str, workload: Workload, progress: Callable[[int], None] | None = None, timeout_s: float = 3600.0
) -> RunResult:
    """Send `workload` to a running `vpaged serve` at `url` (streamed completions, token-id prompts, greedy,
    EOS ignored) and measure it from the client's side; peak KV bytes and preemptions come from /metrics."""
    import asyncio

    import httpx

    url = url.rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]

    async def main():
        limits = httpx.Limits(max_connections=len(workload.prompts) + 4)
        async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
            model = (await client.get(url + "/v1/models")).json()["data"][0]["id"]
            before = _scrape((await client.get(url + "/metrics")).text)
            t0 = time.perf_counter()

            async def one(i):
                r = await _http_request(
                    client, url, model, workload.prompts[i], workload.max_tokens, workload.arrivals[i], t0
                )
                if progress is not None:
                    progress(1)
                return r

            results = await asyncio.gather(*(one(i) for i in range(len(workload.prompts))))
            seconds = time.perf_counter() - t0
            after = _scrape((await client.get(url + "/metrics")).text)
            return results, seconds, before, after

    results, seconds, before, after = asyncio.run(main())

    def delta(name):
        return int(after.get(name, 0) - before.get(name, 0))

    out_tokens = sum(len(r["tokens"]) for r in results)
    ttft = [r["first"] - workload.arrivals[i] for i, r in enumerate(results) if r["first"] is not None]
    tpot = [
        (r["end"] - r["first"]) / (len(r["tokens"]) - 1)
        for r in results
        if r["first"] is not None and len(r["tokens"]) > 1
    ]
    reasons: dict[str, int] = {}
    for r in results:
        reasons[r["finish_reason"]] = reasons.get(r["finish_reason"], 0) + 1
    return RunResult(
        kv="http",
        requests=len(results),
        seconds=seconds,
        prompt_tokens=workload.prompt_tokens,
        output_tokens=out_tokens,
        output_tokens_per_s=out_tokens / seconds,
        total_tokens_per_s=(out_tokens + workload.prompt_tokens) / seconds,
        peak_kv_bytes=int(after.get("vpaged_kv_high_water_bytes", 0)),
        peak_running=None,
        preemptions_swap=delta("vpaged_preemptions_swap"),
        preemptions_recompute=delta("vpaged_preemptions_recompute"),
        prefix_hit_tokens=delta("vpaged_prefix_hit_tokens"),
        steps=delta("vpaged_steps"),
        ttft_p50=percentile(ttft, 50),
        ttft_p99=percentile(ttft, 99),
        tpot_p50=percentile(tpot, 50),
        tpot_p99=percentile(tpot, 99),
        finish_reasons=reasons,
    )
