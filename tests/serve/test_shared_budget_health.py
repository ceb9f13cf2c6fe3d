"""A served member of a shared budget under what an operator (or an accident) does to the budget, in real
processes: a ceiling lowered below a busy server's grant holds once its requests finish; a budget removed,
damaged, or removed and created again makes /health, /metrics and new requests say so (503 with the cause,
per model), and the server joins the budget created again without a restart; a member that waits on a
stopped member names it."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from process_helpers import wait_until

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")


import vpaged  # noqa: E402
from vpaged import PagePool  # noqa: E402
from vpaged.cli.main import main  # noqa: E402
from vpaged.memory import SharedBudget  # noqa: E402
from vpaged.memory.budget.member import REPORT_S  # noqa: E402
from vpaged.memory.budget.segment import segment_path  # noqa: E402
from vpaged.serve import LLMEngine  # noqa: E402
from vpaged.serve.http.server import ServerThread  # noqa: E402

pytestmark = pytest.mark.serving  # skipped where transformers cannot serve (tests/conftest.py)

PAGE = 64 * 1024
TIMEOUT = 120
WORKER = Path(__file__).resolve().parents[1] / "budget_worker.py"


def force_remove(name: str) -> None:
    """Remove the budget's segment even while members are in it (`vpaged budget remove NAME --force`)."""
    SharedBudget.remove(name, force=True)


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vpaged.cli", "budget", *args], capture_output=True, text=True, timeout=TIMEOUT
    )


def engine_in(name: str, model_and_tok, member: str, capacity: int) -> LLMEngine:
    model, tok = model_and_tok
    return LLMEngine(
        model, tok, kv_budget_bytes=capacity, shared_budget=name, shared_budget_member=member, max_model_len=2048,
        max_num_seqs=8, cpu_prepack=False,
    )  # fmt: skip


def complete(url: str, prompt: list[int], max_tokens: int, model: str = "tiny") -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return httpx.post(url + "/v1/completions", json=body, timeout=TIMEOUT)


def member_record(name: str, member: str):
    budget = SharedBudget.open(name)
    try:
        return next((m for m in budget.state().members if m.name == member), None)
    finally:
        budget.close()


def metric_lines(url: str) -> list[str]:
    return httpx.get(url + "/metrics", timeout=TIMEOUT).text.splitlines()


def test_a_ceiling_below_a_busy_servers_grant_holds_once_its_requests_finish(model_and_tok, budget_name):
    capacity = 8 << 20
    SharedBudget.create(budget_name, capacity).close()
    engine = engine_in(budget_name, model_and_tok, "busy", capacity)
    pool = engine.store.cache.pool
    rng = random.Random()
    # 1,100-1,200 prompt tokens and 300 generated stay within 3 pages of each of the 4 regions (512 tokens a
    # page): once computed, the running requests need no page more, and finish under any ceiling.
    prompts = [[rng.randrange(10, 500) for _ in range(rng.randint(1100, 1200))] for _ in range(4)]
    try:
        with ServerThread(engine, model_name="tiny") as srv:
            answers = []
            threads = [threading.Thread(target=lambda p=p: answers.append(complete(srv.url, p, 300))) for p in prompts]
            for t in threads:
                t.start()
            # Busy: the 4 prompts' pages are mapped (48), all the pages the requests will need.
            stats = srv.app.state.engine_loop.call
            assert wait_until(lambda: stats(engine.stats).result(TIMEOUT).kv_mapped_bytes >= 48 * PAGE, TIMEOUT)
            held = member_record(budget_name, "busy").granted_bytes
            # The CLI's own code (a subprocess of it takes longer to start here than the requests last).
            assert main(["budget", "limit", budget_name, "--member", "busy", "--max", "64KiB"]) == 0
            # Meanwhile the grant never grows (sampled while the requests run).
            grants = []
            while any(t.is_alive() for t in threads):
                grants.append(member_record(budget_name, "busy").granted_bytes)
                time.sleep(0.05)
            done = time.monotonic()
            for t in threads:
                t.join()
            assert [a.status_code for a in answers] == [200] * 4
            assert all(len(a.json()["choices"][0]["text"].split()) > 0 for a in answers)
            assert grants, "the requests ended before the ceiling came down"
            assert grants[0] <= held and all(b <= a for a, b in zip(grants, grants[1:])), grants
            # Down to the ceiling within one report period after the requests finish (2x for a loaded box).
            assert wait_until(lambda: member_record(budget_name, "busy").granted_bytes <= PAGE, 2 * REPORT_S)
            elapsed = time.monotonic() - done
            assert elapsed <= 2 * REPORT_S + 0.1
            assert pool._pool.limit <= 1 and pool.stats().used_pages <= 1
            record = member_record(budget_name, "busy")
            assert record.ceiling_bytes == PAGE and record.granted_bytes <= PAGE
            # Raised again: the member grows to serve a request as before.
            assert cli("limit", budget_name, "--member", "busy", "--max", "8MiB").returncode == 0
            assert wait_until(lambda: not pool.budget._over_ceiling, 4 * REPORT_S)
            assert complete(srv.url, prompts[0][:200], 8).status_code == 200
    finally:
        engine.close()


def wait_health(url: str, status: int, timeout: float = 8 * REPORT_S + 5) -> httpx.Response:
    last = None

    def got():
        nonlocal last
        last = httpx.get(url + "/health", timeout=TIMEOUT)
        return last.status_code == status

    assert wait_until(got, timeout), (last.status_code, last.text)
    return last


def assert_down(url: str, budget_name: str, kind: str, model: str = "tiny") -> None:
    health = wait_health(url, 503).json()
    assert health["error"]["code"] == f"shared_budget_{kind}" and budget_name in health["error"]["message"]
    refused = complete(url, [5, 6, 7, 8], 4, model)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == f"shared_budget_{kind}"
    lines = metric_lines(url)
    assert any(line.startswith("vpaged_shared_budget_ok{") and line.endswith(" 0.0") for line in lines), lines
    assert any(f'kind="{kind}"' in line for line in lines if line.startswith("vpaged_shared_budget_problem_info"))


def assert_rejoined(url: str, budget_name: str, engine, member: str, capacity: int) -> None:
    wait_health(url, 200)
    record = member_record(budget_name, member)
    pool = engine.store.cache.pool
    assert record is not None and record.pid == os.getpid() and record.ceiling_bytes == capacity
    assert record.granted_bytes >= pool.stats().used_pages * PAGE  # what its pool holds is counted in the new one
    assert record.granted_bytes == pool._pool.limit * PAGE
    assert complete(url, [5, 6, 7, 8] * 20, 8).status_code == 200
    lines = metric_lines(url)
    assert f'vpaged_shared_budget_ok{{budget="{budget_name}"}} 1.0' in lines


def test_a_server_reports_a_removed_or_damaged_budget_and_joins_it_again(model_and_tok, budget_name):
    capacity = 6 << 20
    SharedBudget.create(budget_name, capacity).close()
    engine = engine_in(budget_name, model_and_tok, "served", capacity)
    try:
        with ServerThread(engine, model_name="tiny") as srv:
            assert complete(srv.url, [5, 6, 7, 8] * 30, 8).status_code == 200
            assert httpx.get(srv.url + "/health", timeout=TIMEOUT).status_code == 200
            force_remove(budget_name)
            assert_down(srv.url, budget_name, "removed")
            SharedBudget.create(budget_name, capacity).close()  # the same name again: joined without a restart
            assert_rejoined(srv.url, budget_name, engine, "served", capacity)
            with open(segment_path(budget_name), "r+b") as f:  # damaged: its magic overwritten
                f.write(b"garbage!")
            assert_down(srv.url, budget_name, "corrupt")
            force_remove(budget_name)
            SharedBudget.create(budget_name, capacity).close()
            assert_rejoined(srv.url, budget_name, engine, "served", capacity)
    finally:
        engine.close()


def test_several_models_report_their_own_budget(model_and_tok, budget_name):
    capacity = 4 << 20
    SharedBudget.create(budget_name, capacity).close()
    model, tok = model_and_tok
    a = engine_in(budget_name, model_and_tok, "a", capacity)
    b = LLMEngine(model, tok, kv_budget_bytes=capacity, max_model_len=512, cpu_prepack=False)  # no budget
    try:
        with ServerThread({"a": a, "b": b}) as srv:
            force_remove(budget_name)
            health = wait_health(srv.url, 503).json()
            assert health["models"]["b"] == "ok" and "removed" in health["models"]["a"]
            assert complete(srv.url, [5, 6, 7, 8], 4, model="a").status_code == 503
            assert complete(srv.url, [5, 6, 7, 8], 4, model="b").status_code == 200
            SharedBudget.create(budget_name, capacity).close()
            assert wait_health(srv.url, 200).json()["models"] == {"a": "ok", "b": "ok"}
    finally:
        a.close()
        b.close()


def ask(worker: subprocess.Popen, line: str) -> dict:
    worker.stdin.write(line + "\n")
    worker.stdin.flush()
    return json.loads(worker.stdout.readline())


def test_a_member_short_behind_a_stopped_member_names_it(budget_name):
    SharedBudget.create(budget_name, 48 * PAGE).close()
    root = str(Path(vpaged.__file__).resolve().parents[1])  # the vpaged this test imports, in the worker too
    worker = subprocess.Popen(
        [sys.executable, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
        env={**os.environ, "PYTHONPATH": root},
    )  # fmt: skip
    try:
        assert ask(worker, f"join {budget_name}")["ok"]
        assert ask(worker, f"fill 2 500 {random.randrange(1 << 30)}")["ok"]  # 2 x 4 regions x 4 pages
        assert ask(worker, "free 2")["ok"]  # dormant: what an ask would get back from it
        budget = SharedBudget.open(budget_name)
        assert wait_until(lambda: budget.state().members[0].dormant_bytes >= 32 * PAGE, 10 * REPORT_S + 5)
        os.kill(worker.pid, signal.SIGSTOP)
        pool = PagePool("cpu", capacity_bytes=48 * PAGE, shared_budget=budget_name, member_name="asker")
        seen = []

        def watch():
            wait_until(lambda: pool.budget_health().kind == "waiting", 10)
            seen.append(pool.budget_health())

        watcher = threading.Thread(target=watch)
        watcher.start()
        started = time.monotonic()
        pool.ensure_free(40)  # short: asks the stopped member, waits a bounded time for it
        assert time.monotonic() - started < 10
        watcher.join()
        assert seen and seen[0].kind == "waiting", seen
        assert f"pid {worker.pid}" in seen[0].message and seen[0].serves  # requests wait; none refused
        os.kill(worker.pid, signal.SIGCONT)
        assert wait_until(lambda: pool.ensure_free(40) and pool.budget_health().ok, 10 * REPORT_S + 5)
        pool.leave_budget()
        budget.close()
    finally:
        os.kill(worker.pid, signal.SIGCONT)
        worker.kill()
        worker.wait()
