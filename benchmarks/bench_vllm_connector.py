"""vLLM's CPU server with vpaged's KV connector: prefix reuse across two instances and across a restart.

Run in the venv of scripts/test_vllm.sh (vLLM's CPU build; vpaged from the repository):

    .venv-vllm/bin/python benchmarks/bench_vllm_connector.py [--users 8 --rounds 4 --system 1000 --history 500]

SmolLM2-135M-Instruct (benchmarks/real_model.py) in float32, every server a real `vllm serve` process
(vllm.entrypoints.openai.api_server) on one core of its own (VLLM_CPU_OMP_THREADS_BIND), with vLLM's own prefix
caching on in every arm, TTFT read from the streamed /v1/completions as bench_prefix_store.py reads it:

- multi-round QA (bench_prefix_store.py's workload: USERS users, ROUNDS rounds, a shared system prompt, each
  user's history growing a round, user u's round r to server (u + r) % SERVERS), one request at a time
  (`multi_round_serial`, TTFT is the prefill alone) and with the users at once (`multi_round`). Arms: each
  instance with vLLM's prefix cache alone (`own`), and both instances with the connector on one store (`store`:
  a hit copies each page into vLLM's buffer; under `vllm serve` on the CPU the scheduler and the worker are two
  processes, where the connector always copies: docs/vllm-connector.md).
- warm restart: a WARM-token prompt on an instance with the connector on a `dir:` store, the instance stopped
  and started again, the same prompt: TTFT cold vs warm (the new process's own cache is empty both times).

Writes benchmarks/results/OUTPUT (default vllm-connector.json).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))  # vpaged from the repository, as in scripts/test_vllm.sh
import real_model  # noqa: E402
from bench_prefix_store import (  # noqa: E402
    Server,
    add_workload_args,
    multi_round,
    ttft_summary,
    warm_restart,
    workload_tokens,
)
from common import machine, write_json  # noqa: E402


def connector_config(store: str, store_bytes: int, role: str = "kv_both") -> str:
    return json.dumps(
        {
            "kv_connector": "VPagedConnector",
            "kv_connector_module_path": "vpaged.integrations.vllm.connector",
            "kv_role": role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"store": store, "store_bytes": store_bytes},
        }
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMServer(Server):
    """A `vllm serve` process on core(s) `core` ("0", "0-1"), up once /health answers."""

    def __init__(self, model: str, core: int | str, store: str | None, args, role: str = "kv_both"):
        self.host, self.port, self.model = "127.0.0.1", str(free_port()), model
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", self.port]
        cmd += ["--dtype", "float32", "--max-model-len", str(args.max_model_len), "--enable-prefix-caching"]
        cmd += ["--max-num-batched-tokens", "4096"]
        if store:
            cmd += ["--kv-transfer-config", connector_config(store, args.store_mib << 20, role)]
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=str(core), VLLM_CPU_KVCACHE_SPACE=str(args.kv_gib))
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        self.log = tempfile.NamedTemporaryFile("w+", prefix="vllm-server-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 600
        while not self._healthy():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                self.log.seek(0)
                raise RuntimeError("a vllm serve process did not come up:\n" + self.log.read()[-3000:])
            time.sleep(1)

    def _healthy(self) -> bool:
        try:
            conn = http.client.HTTPConnection(self.host, int(self.port), timeout=2)
            conn.request("GET", "/health")
            ok = conn.getresponse().status == 200
            conn.close()
            return ok
        except OSError:
            return False

    def metrics(self) -> dict[str, float]:
        conn = http.client.HTTPConnection(self.host, int(self.port), timeout=60)
        conn.request("GET", "/metrics")
        out: dict[str, float] = {}
        for line in conn.getresponse().read().decode().splitlines():
            if line.startswith(("vllm:prefix_cache", "vllm:external_prefix_cache", "vllm:prompt_tokens_total")):
                name, value = line.rsplit(" ", 1)
                out[name.split("{")[0]] = out.get(name.split("{")[0], 0.0) + float(value)
        conn.close()
        return out


def add_server_args(ap: argparse.ArgumentParser) -> None:
    """VLLMServer's options (also bench_vllm_pd.py's)."""
    ap.add_argument("--kv-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE of every instance")
    ap.add_argument("--store-mib", type=int, default=2048, help="the store's capacity")
    ap.add_argument("--max-model-len", type=int, default=4096)


def summarize(own: dict, shared: dict) -> dict:
    return ttft_summary(
        own,
        shared,
        external_hit_tokens=sum(m.get("vllm:external_prefix_cache_hits_total", 0) for m in shared["metrics"]),
        local_hit_tokens_store=sum(m.get("vllm:prefix_cache_hits_total", 0) for m in shared["metrics"]),
        local_hit_tokens_own=sum(m.get("vllm:prefix_cache_hits_total", 0) for m in own["metrics"]),
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_workload_args(ap, answer=32)
    add_server_args(ap)
    ap.add_argument("--sections", default="multi_round_serial,multi_round,warm_restart")
    ap.add_argument("--output", default="vllm-connector.json", help="results file name under benchmarks/results/")
    args = ap.parse_args()
    why = real_model.why_unavailable()
    if why:
        print(f"SmolLM2 is not available: {why}")
        return 1
    import vllm
    from transformers import AutoTokenizer

    from vpaged.memory.store import PageStore

    model = str(real_model.model_dir())
    tok = AutoTokenizer.from_pretrained(model)
    need = workload_tokens(args)
    prose = (real_model.prose_ids(tok, 4096) * (need // 4096 + 2))[:need]
    result = dict(machine=machine(), model=real_model.NAME, dtype="float32", vllm=vllm.__version__, args=vars(args))
    sections = args.sections.split(",")
    for section in ("multi_round_serial", "multi_round"):
        if section not in sections:
            continue
        name = f"bench-vllm-{uuid.uuid4().hex[:10]}"
        concurrent = section == "multi_round"
        try:
            core = lambda i: i % (os.cpu_count() or 1)  # noqa: E731  (more servers than cores share them)
            own = multi_round(
                model, prose, args, None, concurrent, start=lambda i: VLLMServer(model, core(i), None, args)
            )
            shared = multi_round(
                model, prose, args, name, concurrent, start=lambda i: VLLMServer(model, core(i), name, args)
            )
        finally:
            PageStore.remove(name)
        summary = summarize(own, shared)
        result[section] = dict(summary=summary, own=own, store=shared)
        print(section, json.dumps(summary, indent=1), flush=True)
    if "warm_restart" in sections:
        warm = warm_restart(model, prose, args.warm, start=lambda store: VLLMServer(model, 0, store, args))
        result["warm_restart"] = warm
        print(
            json.dumps({k: warm[k] for k in ("ratio", "same_text")} | {p: warm[p]["ttft_s"] for p in ("cold", "warm")})
        )
    path = write_json(args.output, result)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
