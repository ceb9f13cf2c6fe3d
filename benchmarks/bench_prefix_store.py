"""Prefix reuse across server processes and restarts through a shared page store (`vpaged serve --prefix-store`).

Two sections, each measured side by side in one run on SmolLM2-135M-Instruct (benchmarks/real_model.py), every
server a real `vpaged serve` process on one torch thread, TTFT read from the streamed /v1/completions (the time
to the first chunk that carries text):

- multi-round QA (LMCache's multi-round QA benchmark scaled to this box): USERS users, ROUNDS rounds each, a shared
  system prompt of SYSTEM tokens, each user's own history of USER_HISTORY tokens up front (none by default), growing
  by HISTORY tokens of question plus the previous answers a round, ANSWER-token greedy answers, SERVERS servers
  (default two) behind a client that moves each user from one to the next every round (user u's round r to server
  (u + r) % SERVERS: every server sees every SERVERS-th round of a user, and each round as many users as the others).
  As LMCache runs it, the users are concurrent: user u joins STAGGER seconds after user u - 1 and asks its next
  question as soon as the last answer is in, so a request waits for the servers' other work, as in service
  (`multi_round`); `multi_round_serial` sends one request at a time, so TTFT is the prefill alone. Arms: each server
  with its own prefix cache (today's default), and both servers on one store. Reported: mean and p99 TTFT per arm,
  their ratios, whether every answer is identical between the arms, and the bytes the store copied and mapped for
  its hits.
- warm restart: a WARM-token prompt served by a server on a directory store, the server stopped and started
  again on the same directory, the same prompt: TTFT cold vs warm.
- tier under pressure (`tier`): one server with a KV budget of TIER_BUDGET MiB, PREFIXES distinct documents of
  TIER_PREFIX tokens (a working set 4x what the budget holds, by default), each asked twice in turn with a
  different short question. Arms: the server's own prefix cache alone (it evicts what the next documents need
  room for), and the server on a store that holds the working set. Reported for the second pass: the share of
  prompt tokens that hit, and mean TTFT.

    .venv/bin/python benchmarks/bench_prefix_store.py [--users 8 --rounds 4 --system 1000 --history 500
        --user-history 0 --servers 2]

Writes benchmarks/results/OUTPUT (default prefix-store.json; docs/numbers.md reads files named prefix-store_*).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_model  # noqa: E402
from common import machine, write_json  # noqa: E402


class Server:
    """A `vpaged serve` process, up once it prints its serving line."""

    def __init__(self, model: str, extra: list[str], budget_mib: int = 512):
        args = [sys.executable, "-m", "vpaged.cli", "serve", model, "--port", "0", "--threads", "1"]
        args += ["--log-level", "warning", "--kv-budget-mib", str(budget_mib), "--max-num-batched-tokens", "4096"]
        args += extra
        self.proc = subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in self.proc.stdout], daemon=True).start()
        deadline, line = time.monotonic() + 300, ""
        while "serving" not in line:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                raise RuntimeError("a vpaged serve process did not come up")
            with contextlib.suppress(queue.Empty):
                line = lines.get(timeout=1)
        url = line.split(" at ")[1].split()[0]  # http://127.0.0.1:PORT/v1
        self.host, self.port = url.split("//")[1].split("/")[0].split(":")
        self.model = model

    def complete(self, prompt: list[int], max_tokens: int) -> tuple[float, str, dict]:
        """(TTFT s, the text, the final usage) of one streamed greedy completion."""
        body = json.dumps(
            dict(model=self.model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
                 ignore_eos=True, stream_options={"include_usage": True})
        )  # fmt: skip
        conn = http.client.HTTPConnection(self.host, int(self.port), timeout=600)
        start = time.perf_counter()
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
        ttft, text, usage = None, [], {}
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            for choice in chunk.get("choices", []):
                if choice.get("text"):
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    text.append(choice["text"])
            usage = chunk.get("usage") or usage
        conn.close()
        return ttft, "".join(text), usage

    def metrics(self) -> dict[str, float]:
        conn = http.client.HTTPConnection(self.host, int(self.port), timeout=60)
        conn.request("GET", "/metrics")
        out = {}
        for line in conn.getresponse().read().decode().splitlines():
            if line.startswith(("vpaged_prefix", "vpaged_prompt_tokens")) and "{" not in line:
                name, value = line.split()
                out[name] = float(value)
        conn.close()
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))]


def multi_round(model: str, prose: list[int], args, store: str | None, concurrent: bool, start=None) -> dict:
    """start(i): server i of args.servers (default: `vpaged serve`, on the store when one is named)."""
    # The store holds the whole working set (its capacity is the host tier's size); each server's own KV budget
    # (KV_BUDGET_MIB, 512 by default) holds about half of it in the default workload with two servers, in both arms.
    if start is None:
        extra = ["--prefix-store", store, "--prefix-store-pages", str(args.store_pages)] if store else []
        start = lambda i: Server(model, extra, args.kv_budget_mib)  # noqa: E731
    with ThreadPoolExecutor(args.servers) as pool:  # all come up at once (a vLLM server takes a minute)
        starting = [pool.submit(start, i) for i in range(args.servers)]
        wait(starting)
    if any(f.exception() for f in starting):
        for f in starting:
            if f.exception() is None:
                f.result().stop()
        raise next(f.exception() for f in starting if f.exception())
    servers = [f.result() for f in starting]
    system = prose[: args.system]
    ttfts, answers, errors = {}, {}, []

    def ask(u: int, rnd: int, history: list[int]) -> None:
        """User u's round rnd: its question joins its history (after its history up front, in round 0), the
        prompt goes to its server of the round."""
        block = args.system + u * (args.user_history + args.rounds * args.history)  # user u's own prose
        if rnd == 0:
            history += prose[block : block + args.user_history]
        start = block + args.user_history + rnd * args.history
        history += prose[start : start + args.history]
        ttft, text, _ = servers[(u + rnd) % len(servers)].complete(system + history, args.answer)
        # The answer joins the history as its tokens would: the next round's prompt extends this one.
        history += prose[-args.answer :]
        ttfts[f"{u}-{rnd}"], answers[f"{u}-{rnd}"] = ttft, text

    def user(u: int) -> None:
        history: list[int] = []
        try:
            for rnd in range(args.rounds):
                ask(u, rnd, history)
        except Exception as e:  # reported after the run, not lost in a thread
            errors.append(f"user {u}: {e}")

    try:
        if concurrent:
            threads = [threading.Thread(target=user, args=(u,)) for u in range(args.users)]
            for t in threads:
                t.start()
                time.sleep(args.stagger)
            for t in threads:
                t.join()
        else:  # one request at a time, round by round: every user's round r before anyone's round r + 1
            histories: list[list[int]] = [[] for _ in range(args.users)]
            for rnd in range(args.rounds):
                for u in range(args.users):
                    ask(u, rnd, histories[u])
        if errors:
            raise RuntimeError("; ".join(errors))
        figures = [s.metrics() for s in servers]
    finally:
        for s in servers:
            s.stop()
    order = sorted(ttfts, key=lambda k: tuple(map(int, k.split("-")))[::-1])  # round-major
    return dict(ttft_s=[ttfts[k] for k in order], answers={k: answers[k] for k in order}, metrics=figures)


def warm_restart(model: str, prose: list[int], tokens: int, start=None) -> dict:
    """start(store): a server on the directory store `store` (default: `vpaged serve --prefix-store`)."""
    start = start or (lambda store: Server(model, ["--prefix-store", store]))
    folder = tempfile.mkdtemp(prefix="vpaged-warm-")
    store = f"dir:{folder}/kv"
    out = {}
    try:
        for phase in ("cold", "warm"):
            server = start(store)
            try:
                server.complete(prose[-50:], 2)  # a first request warms the process (not part of the figure)
                ttft, text, _ = server.complete(prose[:tokens], 16)
                out[phase] = dict(ttft_s=ttft, text=text, metrics=server.metrics())
            finally:
                server.stop()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    out["ratio"] = out["warm"]["ttft_s"] / out["cold"]["ttft_s"]
    out["same_text"] = out["warm"]["text"] == out["cold"]["text"]
    return out


def tier(model: str, prose: list[int], args, store: str | None) -> dict:
    """Two passes over the documents, each prompt a document and a question of its own; the second pass measured."""
    extra = ["--prefix-store", store, "--prefix-store-pages", str(args.store_pages)] if store else []
    server = Server(model, extra, budget_mib=args.tier_budget)
    passes = []
    try:
        for rnd in range(2):
            before = server.metrics()
            ttfts = []
            for d in range(args.prefixes):
                doc = prose[d * 101 : d * 101 + args.tier_prefix]  # distinct from its first token on
                question = prose[-(rnd + 1) * 40 - d : -(rnd + 1) * 40 - d + 32]
                ttft, _, _ = server.complete(doc + question, 4)
                ttfts.append(ttft)
            after = server.metrics()
            hit = after.get("vpaged_prefix_hit_tokens", 0) - before.get("vpaged_prefix_hit_tokens", 0)
            computed = after.get("vpaged_prompt_tokens_total", 0) - before.get("vpaged_prompt_tokens_total", 0)
            passes.append(dict(ttft_s=ttfts, hit_tokens=hit, computed_tokens=computed, metrics=after))
    finally:
        server.stop()
    second = passes[1]
    prompt = second["hit_tokens"] + second["computed_tokens"]
    return dict(
        passes=passes,
        hit_rate=second["hit_tokens"] / prompt if prompt else 0.0,
        mean_ttft_s=statistics.mean(second["ttft_s"]),
    )


def ttft_summary(own: dict, shared: dict, **figures) -> dict:
    """The two arms of multi_round side by side: mean and p99 TTFT, their ratios, whether the answers agree;
    `figures` (the servers' own counters) join them."""
    summary = dict(
        own_mean_ttft_s=statistics.mean(own["ttft_s"]),
        store_mean_ttft_s=statistics.mean(shared["ttft_s"]),
        own_p99_ttft_s=p99(own["ttft_s"]),
        store_p99_ttft_s=p99(shared["ttft_s"]),
        answers_identical=own["answers"] == shared["answers"],
        answers_differing=sum(own["answers"][k] != shared["answers"][k] for k in own["answers"]),
        **figures,
    )
    summary["mean_ratio"] = summary["own_mean_ttft_s"] / summary["store_mean_ttft_s"]
    summary["p99_ratio"] = summary["own_p99_ttft_s"] / summary["store_p99_ttft_s"]
    return summary


def summarize(own: dict, shared: dict) -> dict:
    m = shared["metrics"]
    return ttft_summary(
        own,
        shared,
        store_hit_tokens=sum(f.get("vpaged_prefix_store_hit_tokens_total", 0) for f in m),
        store_copied_bytes=sum(f.get("vpaged_prefix_store_copied_bytes_total", 0) for f in m),
        store_mapped_bytes=sum(f.get("vpaged_prefix_store_mapped_bytes_total", 0) for f in m),
    )


def add_workload_args(ap: argparse.ArgumentParser, answer: int) -> None:
    """The multi-round QA and warm-restart options (also bench_vllm_connector.py's)."""
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--system", type=int, default=1000)
    ap.add_argument("--history", type=int, default=500, help="tokens of question a user adds each round")
    ap.add_argument(
        "--user-history", type=int, default=0, help="tokens of each user's own history before its first question"
    )
    ap.add_argument("--answer", type=int, default=answer)
    ap.add_argument("--stagger", type=float, default=2.0, help="seconds between users joining (multi_round)")
    ap.add_argument("--warm", type=int, default=2000)
    ap.add_argument(
        "--servers", type=int, default=2, help="servers behind the client (user u's round r to (u + r) %% N)"
    )


def workload_tokens(args) -> int:
    """Tokens of prose the multi-round and warm-restart sections read: the system prompt, every user's history up
    front and questions, the answers' stand-in at the end."""
    users = args.system + args.users * (args.user_history + args.rounds * args.history)
    return max(users, args.warm) + 2 * args.answer


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_workload_args(ap, answer=64)
    ap.add_argument("--store-pages", type=int, default=24576, help="the shared store's capacity in pages")
    ap.add_argument("--kv-budget-mib", type=int, default=512, help="MiB of KV of each multi_round server")
    ap.add_argument("--tier-budget", type=int, default=128, help="MiB of KV of the tier section's server")
    ap.add_argument("--tier-prefix", type=int, default=1000, help="tokens of each document of the tier section")
    ap.add_argument("--prefixes", type=int, default=12, help="documents of the tier section")
    ap.add_argument("--sections", default="multi_round,multi_round_serial,warm_restart,tier")
    ap.add_argument("--output", default="prefix-store.json", help="results file name under benchmarks/results/")
    args = ap.parse_args()
    why = real_model.why_unavailable()
    if why:
        print(f"SmolLM2 is not available: {why}")
        return 1
    model = str(real_model.model_dir())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    need = max(workload_tokens(args), args.prefixes * 101 + args.tier_prefix + args.answer)
    prose = (real_model.prose_ids(tok, 4096) * (need // 4096 + 2))[:need]
    result = dict(machine=machine(), model=real_model.NAME, dtype="float32", args=vars(args))
    sections = args.sections.split(",")
    from vpaged.memory.store import PageStore

    for section in ("multi_round", "multi_round_serial"):
        if section not in sections:
            continue
        name = f"bench-{uuid.uuid4().hex[:10]}"
        concurrent = section == "multi_round"
        try:
            own = multi_round(model, prose, args, None, concurrent)
            shared = multi_round(model, prose, args, name, concurrent)
        finally:
            PageStore.remove(name)
        summary = summarize(own, shared)
        result[section] = dict(summary=summary, own=own, store=shared)
        print(section, json.dumps(summary, indent=1))
    if "warm_restart" in sections:
        warm = warm_restart(model, prose, args.warm)
        result["warm_restart"] = warm
        print(
            json.dumps({k: warm[k] for k in ("ratio", "same_text")} | {p: warm[p]["ttft_s"] for p in ("cold", "warm")})
        )
    if "tier" in sections:
        name = f"bench-{uuid.uuid4().hex[:10]}"
        try:
            own, shared = tier(model, prose, args, None), tier(model, prose, args, name)
        finally:
            PageStore.remove(name)
        result["tier"] = dict(own=own, store=shared)
        print(
            "tier",
            json.dumps({arm: {k: r[k] for k in ("hit_rate", "mean_ttft_s")} for arm, r in result["tier"].items()}),
        )
    path = write_json(args.output, result)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
