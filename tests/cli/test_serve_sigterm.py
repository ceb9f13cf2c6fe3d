"""SIGTERM (what systemd, docker and Kubernetes send) stops `vpaged serve` as Ctrl-C does
(serve/http/termination.py): a real server process of two models on the budget it made exits 0 and leaves no
segment in /dev/shm, idle or with a request in flight; a SIGTERM while the models load also removes the budget
(exit 143, no traceback); a server of one model exits 0 too. And in-process: a stopping server waits at most
shutdown_timeout_s for the requests in flight, then ends them and its engine threads.

Random-weight llama-tiny models, token-id prompts, one torch thread; every wait bounded."""

from __future__ import annotations

import glob
import json
import os
import random
import signal
import subprocess
import threading
import time

import pytest
import torch

from vpaged.memory.budget.segment import SHM_DIR, segment_path

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.serving  # skipped where transformers cannot serve (tests/conftest.py)

TIMEOUT = 180
EXIT_WAIT = 60  # the shutdown waits 5 s for requests in flight; the rest is a loaded machine's slack
TWO_MODELS = ["--model", "a=random:llama-tiny:1", "--model", "b=random:llama-tiny:2"]


def serve_args(models: list[str]) -> list[str]:
    return [*models, "--port", "0", "--kv-budget-mib", "8", "--log-level", "warning", "--threads", "1",
            "--max-model-len", "2048"]  # fmt: skip


def made_by(pid: int) -> list[str]:
    """The budget segments a server of this pid made (serve-PID-XXXXXX: served_models.several_engines)."""
    return glob.glob(os.path.join(SHM_DIR, f"vpaged-budget.serve-{pid}-*"))


def url_and_budget(line: str) -> tuple[str, str]:
    return line.split(" at ")[1].split()[0].removesuffix("/v1"), line.split("one budget ")[1].split()[0]


def test_sigterm_stops_an_idle_server_of_two_models_and_removes_its_budget(server_process):
    server = server_process(serve_args(TWO_MODELS))
    proc = server.proc
    try:
        url, budget = url_and_budget(server.ready(TIMEOUT))
        assert os.path.exists(segment_path(budget)) and made_by(proc.pid) == [segment_path(budget)]
        with httpx.Client(base_url=url, timeout=TIMEOUT) as client:
            body = {"model": "b", "prompt": [random.randrange(11, 500)], "max_tokens": 2, "ignore_eos": True}
            assert client.post("/v1/completions", json=body).status_code == 200
    finally:
        rc, err = server.stop(signal.SIGTERM, EXIT_WAIT)
    assert rc == 0, err
    assert made_by(proc.pid) == [] and "Traceback" not in err


@pytest.mark.parametrize("stream", [True, False])
def test_sigterm_with_a_request_in_flight_ends_it_and_cleans_up(stream, server_process):
    server = server_process(serve_args(TWO_MODELS))
    proc = server.proc
    answer: dict = {}
    try:
        url, budget = url_and_budget(server.ready(TIMEOUT))
        started = threading.Event()
        prompt = [random.randrange(11, 500) for _ in range(random.randint(3, 30))]
        body = {"model": random.choice("ab"), "prompt": prompt, "max_tokens": 1900, "ignore_eos": True}

        def request():
            try:
                with httpx.Client(base_url=url, timeout=TIMEOUT) as client:
                    if stream:
                        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                            events = []
                            for line in r.iter_lines():
                                started.set()
                                if line:
                                    events.append(line)
                            answer["events"] = events
                    else:
                        started.set()
                        answer["status"] = client.post("/v1/completions", json=body).status_code
            finally:
                started.set()

        client_thread = threading.Thread(target=request)
        client_thread.start()
        assert started.wait(TIMEOUT)
        time.sleep(random.uniform(0.05, 0.3))  # non-streamed: let the request reach the engine
    finally:
        rc, err = server.stop(signal.SIGTERM, EXIT_WAIT)
    client_thread.join(TIMEOUT)
    assert not client_thread.is_alive(), "the request in flight was left hanging"
    assert rc == 0, err
    assert not os.path.exists(segment_path(budget)) and made_by(proc.pid) == []
    assert "Traceback" not in err, err
    # it finished, or the shutdown ended it 5 s after the signal with a 503 (a stream: an error event)
    if stream:
        last = answer["events"][-1] if answer.get("events") else answer
        assert last == "data: [DONE]" or "stopping" in json.loads(last[6:])["error"]["message"], answer
    else:
        assert answer.get("status") in (200, 503), answer


def test_sigterm_while_the_models_load_removes_the_budget(server_process):
    server = server_process(serve_args([*TWO_MODELS, "--model", "c=random:llama-tiny:3"]))
    proc = server.proc
    try:
        deadline = time.monotonic() + TIMEOUT
        while not made_by(proc.pid):  # the budget is made before the first model loads
            assert time.monotonic() < deadline and proc.poll() is None, "no budget was made"
            time.sleep(0.002)
    finally:
        rc, err = server.stop(signal.SIGTERM, EXIT_WAIT)
    assert made_by(proc.pid) == []
    # 143 (128 + SIGTERM) when it landed while loading; 0 if the server was already up
    assert rc in (0, 143), (rc, err)
    assert "Traceback" not in err, err


def test_sigterm_stops_a_server_of_one_model_with_status_0(server_process):
    server = server_process(serve_args(["random:llama-tiny"]))
    try:
        server.ready(TIMEOUT)
    finally:
        rc, err = server.stop(signal.SIGTERM, EXIT_WAIT)
    assert rc == 0 and "Traceback" not in err, err


def test_a_stopping_server_answers_the_requests_in_flight_after_its_timeout():
    """ServerThread.stop() takes uvicorn's shutdown path, as a signal does: a request that would go on for
    minutes is ended shutdown_timeout_s later with a 503 naming the stop (a stream: an error event, then its
    end), its engine request aborted, and the engine threads end."""
    from vpaged.serve import LLMEngine, load_model
    from vpaged.serve.http.server import ServerThread

    model, tok = load_model("random:llama-tiny", dtype=torch.float32)
    engine = LLMEngine(model, tok, kv_budget_bytes=8 << 20, max_model_len=4096, cpu_prepack=False)
    real_step = engine.step

    def slow_step():  # a generation of 4000 tokens takes 200 s at this pace
        time.sleep(0.05)
        return real_step()

    engine.step = slow_step
    timeout = random.uniform(0.5, 2.0)
    srv = ServerThread(engine, model_name="slow", shutdown_timeout_s=timeout).start()
    outcome: dict = {}
    first = threading.Event()

    def request(stream: bool):
        body = {"model": "slow", "prompt": [5, 6, 7], "max_tokens": 4000, "ignore_eos": True, "stream": stream}
        with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as client:
            if stream:
                with client.stream("POST", "/v1/completions", json=body) as r:
                    events = []
                    for line in r.iter_lines():
                        first.set()
                        events.append(line)
                outcome[stream] = (r.status_code, [json.loads(e[6:]) for e in events if e.startswith("data: {")])
            else:
                r = client.post("/v1/completions", json=body)
                outcome[stream] = (r.status_code, r.json())

    threads = [threading.Thread(target=request, args=(s,)) for s in (True, False)]
    for t in threads:
        t.start()
    assert first.wait(TIMEOUT)
    time.sleep(0.3)  # the non-streamed request reaches the engine too
    began = time.monotonic()
    srv.stop(TIMEOUT)
    took = time.monotonic() - began
    for t in threads:
        t.join(TIMEOUT)
    assert not any(t.is_alive() for t in threads)
    status, events = outcome[True]
    assert status == 200 and "choices" in events[0] and "stopping" in events[-1]["error"]["message"], events[-1]
    status, answer = outcome[False]
    assert status == 503 and "stopping" in answer["error"]["message"], answer
    assert took < TIMEOUT / 2, f"stop took {took:.1f} s"  # a bounded wait, not the generation's 200 s
    assert not srv.app.state.engine_loop.alive
    assert not engine.has_unfinished()  # the requests in flight were aborted in the engine


def test_sigterm_stops_a_tensor_parallel_server_with_its_ranks_and_temporary_directory(server_process):
    before = set(glob.glob("/tmp/vpaged-tp-*"))
    server = server_process(serve_args(["random:llama-tiny", "--tensor-parallel-size", "2"]))
    proc = server.proc
    try:
        server.ready(TIMEOUT)
        made = set(glob.glob("/tmp/vpaged-tp-*")) - before  # random weights saved for the ranks to load
        ranks = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    finally:
        rc, err = server.stop(signal.SIGTERM, EXIT_WAIT)
    assert rc == 0 and "Traceback" not in err, err
    assert made and not any(os.path.exists(d) for d in made)
    deadline = time.monotonic() + EXIT_WAIT  # the ranks end with their group (a helper may outlive it briefly)
    while any(os.path.exists(f"/proc/{pid}") for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in ranks if os.path.exists(f"/proc/{pid}")]
