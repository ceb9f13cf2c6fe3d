"""Faults of a tensor-parallel engine that no step sees (issue #41 items 1 and 3), on two gloo ranks.

An idle TP=2 server whose rank 1 is SIGKILLed answers /health 503 with the cause within two keepalive
periods, its engine loop stops as it does under load, and /metrics says why (before: /health said "ok" until
the next request). A rank that is SIGSTOPped is named in the error of the collective that timed out waiting
for it, with the cause (before: "a collective failed on rank 0: ... Timed out", naming no one).
"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
import torch

from vpaged.errors import TensorParallelError

pytestmark = [
    pytest.mark.serving,
    pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available"),
]
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

MODEL = "random:llama-tiny"
PAGE = 4096
GREEDY = dict(temperature=0.0, ignore_eos=True)


def _engine(monkeypatch, timeout_s: int):
    from vpaged.serve import LLMEngine

    monkeypatch.setenv("VPAGED_TP_TIMEOUT_S", str(timeout_s))
    return LLMEngine(MODEL, kv_budget_bytes=1 << 20, page_size=PAGE, tensor_parallel_size=2, cpu_prepack=False)


def test_idle_server_with_a_killed_rank_answers_health_503_within_two_keepalive_periods(monkeypatch):
    from vpaged.serve.http.server import ServerThread

    engine = _engine(monkeypatch, timeout_s=12)
    keepalive = 12 / 4  # the keepalive period: a quarter of VPAGED_TP_TIMEOUT_S (Group.keepalive_s)
    try:
        with ServerThread(engine, model_name="tiny") as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
            done = http.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 3})
            assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 3
            assert http.get("/health").json() == {"status": "ok"}
            assert re.search(r"^vpaged_engine_up 1\.0$", http.get("/metrics").text, re.M)
            time.sleep(keepalive)  # idle for a keepalive period: the pings have started
            engine.tp.group.processes[1].kill()
            t0 = time.monotonic()
            while (health := http.get("/health")).status_code == 200 and time.monotonic() - t0 < 30:
                time.sleep(0.1)
            elapsed = time.monotonic() - t0
            assert health.status_code == 503, health.text
            assert elapsed < 2 * keepalive, f"/health answered 503 {elapsed:.1f} s after the kill"
            error = health.json()["error"]
            assert "rank 1 failed: killed by SIGKILL" in error["message"] and error["code"] == "TensorParallelError"
            loop = srv.app.state.engine_loop
            deadline = time.monotonic() + 10
            while loop.alive and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not loop.alive and isinstance(loop.fatal, TensorParallelError), "the loop shuts down"
            metrics = http.get("/metrics")
            assert metrics.status_code == 200
            assert re.search(r"^vpaged_engine_up 0\.0$", metrics.text, re.M), metrics.text
            reason = re.search(r'^vpaged_engine_failure_info\{reason="([^"]*)"\} 1\.0$', metrics.text, re.M)
            assert reason and "rank 1 failed: killed by SIGKILL" in reason.group(1), metrics.text
            refused = http.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6], "max_tokens": 2})
            assert refused.status_code == 503 and "rank 1" in refused.json()["error"]["message"]
    finally:
        t0 = time.monotonic()
        engine.close()
        assert time.monotonic() - t0 < 15


def test_a_stopped_rank_is_named_in_the_collective_timeout(monkeypatch):
    from vpaged.serve import SamplingParams

    engine = _engine(monkeypatch, timeout_s=6)
    rank1 = engine.tp.group.processes[1]
    stopped = False
    try:
        engine.add_request(list(range(5, 30)), SamplingParams(max_tokens=200, **GREEDY))
        for _ in range(3):
            engine.step()
        os.kill(rank1.pid, signal.SIGSTOP)
        stopped = True
        t0 = time.monotonic()
        with pytest.raises(TensorParallelError) as err:
            while time.monotonic() - t0 < 60:
                engine.step()
        message = str(err.value)
        assert re.search(r"rank 1 did not answer: no heartbeat in \d+\.\d s \(the process is stopped", message), message
        assert "rank 0" not in message.split(";")[0], "the rank named first is the stopped one, not rank 0"
        assert time.monotonic() - t0 < 6 + 3 + 15, f"the error took {time.monotonic() - t0:.1f} s"
        assert engine.broken is err.value
    finally:
        if stopped:
            rank1.kill()  # SIGKILL ends a stopped process too
        engine.close()
