"""A server whose engine thread died (serve/http/loop.py's `dead`): every request to that model gets 503 at once,
naming the model and the cause, instead of waiting on a thread that will never answer; GET /metrics answers
within a second with vpaged_engine_up 0 for it (its stats skipped); /health says why; the other models of the
server go on serving, token for token as before. The same for a server of one model. And the engine loop
itself: a command queued to a loop that dies or stops always completes.

The thread is killed by what `except Exception` around a step does not catch: a BaseException out of the
engine's step (as a SystemExit or a C extension's error might). Random-weight llama-tiny models, fp32, one
torch thread, token-id prompts."""

from __future__ import annotations

import concurrent.futures
import random
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")


from vpaged.errors import EngineUnavailableError  # noqa: E402
from vpaged.serve import LLMEngine, load_model  # noqa: E402
from vpaged.serve.http.loop import EngineLoop  # noqa: E402
from vpaged.serve.http.server import ServerThread  # noqa: E402

pytestmark = pytest.mark.serving  # skipped where transformers cannot serve (tests/conftest.py)

TIMEOUT = 60  # a request that waits this long on a dead engine has hung
OPTIONS = dict(kv_budget_bytes=8 << 20, max_num_seqs=8, max_model_len=256, cpu_prepack=False)


class EngineThreadKilled(BaseException):
    """Not an Exception: the loop's per-step `except Exception` lets it through and the thread ends."""


def engine(seed: int) -> LLMEngine:
    model, tok = load_model(f"random:llama-tiny:{seed}", dtype=torch.float32)
    return LLMEngine(model, tok, **OPTIONS)


def kill_after(eng: LLMEngine, steps: int) -> str:
    """Make eng's thread die in its (steps+1)-th step from now; returns the cause's text."""
    real, done, cause = eng.step, [0], f"injected death {random.randrange(10**6)}"

    def step():
        if done[0] >= steps:
            raise EngineThreadKilled(cause)
        done[0] += 1
        return real()

    eng.step = step
    return cause


def body(model: str, prompt: list[int], max_tokens: int, **extra) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}


def tokens(client, model: str, prompt: list[int], max_tokens: int) -> list[int]:
    r = client.post("/v1/completions", json=body(model, prompt, max_tokens))
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def assert_unavailable(r, model: str, cause: str) -> None:
    assert r.status_code == 503, r.text
    message = r.json()["error"]["message"]
    assert f"model {model!r}" in message and "EngineThreadKilled" in message and cause in message, message


def scrape(client) -> tuple[str, float]:
    start = time.monotonic()
    r = client.get("/metrics")
    elapsed = time.monotonic() - start
    assert r.status_code == 200, r.text
    return r.text, elapsed


def samples(text: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line[:1] != "#"}


def test_a_dead_engine_thread_of_one_model_answers_503_and_the_other_goes_on():
    rng = random.Random()
    engines = {"a": engine(1), "b": engine(2)}
    prompt = [rng.randrange(11, 500) for _ in range(rng.randint(3, 40))]
    with ServerThread(engines) as srv, httpx.Client(base_url=srv.url, timeout=TIMEOUT) as client:
        before = {name: tokens(client, name, prompt, 6) for name in engines}
        cause = kill_after(engines["b"], rng.randint(0, 3))
        # the request in flight when the thread dies: its answer, not a timeout
        assert_unavailable(client.post("/v1/completions", json=body("b", prompt, 40)), "b", cause)
        loop_b = srv.app.state.router.servers["b"].loop
        assert loop_b.dead is not None and not loop_b.alive
        for stream in (False, True, False):  # later ones: refused at once, streamed or not
            start = time.monotonic()
            r = client.post("/v1/completions", json=body("b", prompt, 4, stream=stream))
            assert time.monotonic() - start < 10
            assert_unavailable(r, "b", cause)
        for _ in range(3):
            text, elapsed = scrape(client)
            assert elapsed < 1.0, f"/metrics took {elapsed:.2f} s"
        got = samples(text)
        assert got['vpaged_engine_up{model="a"}'] == 1.0 and got['vpaged_engine_up{model="b"}'] == 0.0
        assert any(k.startswith('vpaged_engine_failure_info{model="b",reason=') and cause in k for k in got)
        assert 'vpaged_running{model="a"}' in got and not any(k.startswith('vpaged_running{model="b"') for k in got)
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["models"]["a"] == "ok"
        assert cause in health.json()["models"]["b"] and health.json()["error"]["code"] == "EngineUnavailableError"
        # the other model serves as before, concurrent requests included
        results: dict[int, list[int]] = {}
        threads = [
            threading.Thread(target=lambda i=i: results.update({i: tokens(client, "a", prompt, 6)})) for i in range(3)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT)
        assert results == {i: before["a"] for i in range(3)}
    assert not any(loop.alive for loop in srv.app.state.router.loops())


def test_a_dead_engine_thread_of_the_only_model_answers_503_and_metrics_answer():
    rng = random.Random()
    eng = engine(rng.randint(1, 9))
    prompt = [rng.randrange(11, 500) for _ in range(rng.randint(3, 40))]
    with ServerThread(eng, model_name="solo") as srv, httpx.Client(base_url=srv.url, timeout=TIMEOUT) as client:
        assert len(tokens(client, "solo", prompt, 3)) == 3
        cause = kill_after(eng, 0)
        assert_unavailable(client.post("/v1/completions", json=body("solo", prompt, 8)), "solo", cause)
        assert_unavailable(client.post("/v1/completions", json=body("solo", prompt, 8)), "solo", cause)
        text, elapsed = scrape(client)
        assert elapsed < 1.0, f"/metrics took {elapsed:.2f} s"
        got = samples(text)
        assert got["vpaged_engine_up"] == 0.0 and "vpaged_running" not in got
        health = client.get("/health")
        assert health.status_code == 503 and cause in health.json()["error"]["message"]


# ---------------------------------------------------------------------------------------------- the loop


class ScriptedEngine:
    """An engine with `work` steps to do; its thread dies in has_unfinished() once `die` is set."""

    def __init__(self):
        self.die = threading.Event()
        self.work = 0
        self.aborted: list[str] = []

    def has_unfinished(self) -> bool:
        if self.die.is_set():
            raise EngineThreadKilled("scripted")
        return self.work > 0

    def step(self):
        self.work -= 1
        return []

    def add_request(self, prompt, params, request_id):
        self.work += 1000
        return request_id

    def abort(self, request_id):
        self.aborted.append(request_id)


def call_until(loop: EngineLoop, ended: threading.Event, futures: list, lock: threading.Lock) -> None:
    """Queue commands to `loop` until `ended`, and a few more after it."""
    more = 20
    while more:
        with lock:
            futures.append(loop.call(lambda: 7))
        if ended.is_set():
            more -= 1


def test_every_command_to_a_loop_that_dies_or_stops_completes():
    rng = random.Random()
    for ending in ("dies", "stops"):
        eng = ScriptedEngine()
        loop = EngineLoop(eng, idle_wait_s=0.01, name=f"m{rng.randrange(100)}").start()
        sunk: list = []
        assert loop.add([1, 2], None, "r1", sunk.append).result(TIMEOUT) == "r1"
        futures: list[concurrent.futures.Future] = []
        lock, ended = threading.Lock(), threading.Event()
        callers = [threading.Thread(target=call_until, args=(loop, ended, futures, lock)) for _ in range(4)]
        for t in callers:
            t.start()
        time.sleep(rng.uniform(0, 0.05))
        if ending == "dies":
            eng.die.set()
            deadline = time.monotonic() + TIMEOUT
            while loop.dead is None and time.monotonic() < deadline:
                time.sleep(0.001)
        else:
            loop.stop(TIMEOUT)
        ended.set()
        for t in callers:
            t.join(TIMEOUT)
        # every future is answered: run (7) or failed with the loop's EngineUnavailableError, none left waiting
        done, pending = concurrent.futures.wait(futures, timeout=TIMEOUT)
        assert not pending
        failed = [f.exception() for f in done if f.exception() is not None]
        assert failed and all(isinstance(e, EngineUnavailableError) for e in failed)
        assert all(f.result() == 7 for f in done if f.exception() is None)
        late = loop.call(lambda: 7)  # once the loop is gone: failed at once
        assert late.done() and isinstance(late.exception(), EngineUnavailableError)
        assert f"model {loop.name!r}" in str(late.exception())
        # the request in flight got the error too
        deadline = time.monotonic() + TIMEOUT
        while not sunk and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(sunk) == 1 and isinstance(sunk[0], EngineUnavailableError)
        if ending == "dies":
            assert loop.dead is not None and "EngineThreadKilled: scripted" in str(loop.dead)
            assert late.exception() is loop.dead
        else:
            assert loop.dead is None and "stopping" in str(late.exception())
        assert "r1" in eng.aborted and not loop.alive
