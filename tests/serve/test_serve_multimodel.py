"""Several models in one server (serve/http/router.py): each request goes to the engine its `model` names,
every answer is what that model served alone answers (greedy, token-identical), requests to both run at
once, an unknown model is a 404 and a missing one a 400, /v1/models lists both, /metrics labels each
model's series, /health reports each model, and both engines' pools are members of one shared budget in
which one model's burst takes the memory the other's finished burst left.

Two random-weight llama-tiny models of different seeds (so that answers tell the models apart), each saved
with a word tokenizer (no network); fp32, one torch thread, short generations."""

from __future__ import annotations

import dataclasses
import json
import random
import re
import threading
import uuid
from collections import Counter

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
hypothesis = pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from serve_helpers import save_model_with_tokenizer  # noqa: E402

from vpaged.errors import InvalidArgumentError  # noqa: E402
from vpaged.memory import SharedBudget  # noqa: E402
from vpaged.serve import LLM, LLMEngine, SamplingParams, load_model  # noqa: E402
from vpaged.serve.http.app import create_app  # noqa: E402
from vpaged.serve.http.model_metrics import labelled_exposition, sample_name  # noqa: E402
from vpaged.serve.http.server import ServerThread, prometheus_text  # noqa: E402

pytestmark = pytest.mark.serving  # skipped where transformers cannot serve (tests/conftest.py)

PAGE = 64 * 1024
# llama-tiny: 512 bytes per token; a sequence takes at least one page in each of its 4 regions (2 layers x K, V)
CAPACITY = 128 * PAGE
MAX_MODEL_LEN = 256
TIMEOUT = 120
NAMES = ("alpha", "beta")
OPTIONS = dict(kv_budget_bytes=CAPACITY, max_num_seqs=32, max_model_len=MAX_MODEL_LEN, cpu_prepack=False)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    dirs = {}
    for seed, name in enumerate(NAMES, start=1):
        path = tmp_path_factory.mktemp(f"tiny-{name}")
        save_model_with_tokenizer(path, f"random:llama-tiny:{seed}")
        dirs[name] = str(path)
    return dirs


def engines_on(budget: str, model_dirs) -> dict[str, LLMEngine]:
    engines = {}
    for name in NAMES:
        model, tok = load_model(model_dirs[name], dtype=torch.float32)
        engines[name] = LLMEngine(model, tok, shared_budget=budget, shared_budget_member=name, **OPTIONS)
    return engines


@pytest.fixture(scope="module")
def served(model_dirs):
    """(ServerThread, {name: engine}, budget, httpx client) of one server of both models on one budget."""
    name = f"mm-{uuid.uuid4().hex[:12]}"
    budget = SharedBudget.create(name, capacity_bytes=CAPACITY)
    try:
        engines = engines_on(name, model_dirs)
        with ServerThread(engines) as srv, httpx.Client(base_url=srv.url, timeout=TIMEOUT) as client:
            yield srv, engines, budget, client
    finally:
        SharedBudget.remove(name, force=True)


@pytest.fixture(scope="module")
def alone(model_dirs):
    """Each model served alone: an offline engine with a private pool of the same size and options."""
    llms = {}
    for name in NAMES:
        model, tok = load_model(model_dirs[name], dtype=torch.float32)
        llms[name] = LLM(model, tok, **OPTIONS)
    return llms


def greedy_alone(alone, name: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in alone[name].generate(prompts, params)]


def complete(client, model: str, prompt: list[int], max_tokens: int) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == model
    return r.json()["choices"][0]["token_ids"]


def prompts(rng: random.Random, n: int, lo: int = 3, hi: int = 60) -> list[list[int]]:
    return [[rng.randrange(11, 500) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def member(budget: SharedBudget, name: str):
    (m,) = [m for m in budget.state().members if m.name == name]
    return m


def engine_stats(srv, name: str):
    server = srv.app.state.router.servers[name]
    return server.loop.call(server.engine.stats).result(TIMEOUT)


def wait_idle(srv):
    for name in NAMES:
        for _ in range(400):
            st_ = engine_stats(srv, name)
            if st_.running == 0 and st_.waiting == 0 and st_.swapped == 0:
                break
            threading.Event().wait(0.05)
        else:
            raise AssertionError(f"{name} not idle: {st_}")


# ---------------------------------------------------------------------------------------------- routing


def test_each_model_answers_as_served_alone(served, alone):
    srv, engines, budget, client = served
    rng = random.Random()
    batch = prompts(rng, 3)
    got = {name: [complete(client, name, p, 8) for p in batch] for name in NAMES}
    for name in NAMES:
        assert got[name] == greedy_alone(alone, name, batch, 8), name
    assert got["alpha"] != got["beta"]  # different weights: the answers tell which engine ran


def test_requests_to_both_models_at_once(served, alone):
    srv, engines, budget, client = served
    rng = random.Random()
    work = [(rng.choice(NAMES), p) for p in prompts(rng, 12)]
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def send(i, name, prompt):
        try:
            results[i] = complete(client, name, prompt, 6)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=send, args=(i, n, p)) for i, (n, p) in enumerate(work)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert not errors, errors
    for name in NAMES:
        mine = [i for i, (n, _) in enumerate(work) if n == name]
        want = greedy_alone(alone, name, [work[i][1] for i in mine], 6) if mine else []
        assert [results[i] for i in mine] == want, name


def test_unknown_model_is_404_and_a_missing_one_400(served):
    srv, engines, budget, client = served
    comp = {"model": "gamma", "prompt": [5, 6], "max_tokens": 2}
    chat = {"model": "gamma", "messages": [{"role": "user", "content": "the cat"}], "max_tokens": 2}
    for path, body in [
        ("/v1/completions", comp),
        ("/v1/chat/completions", chat),
        ("/tokenize", {"model": "gamma", "prompt": "a"}),
    ]:
        r = client.post(path, json=body)
        err = r.json()["error"]
        assert r.status_code == 404 and err["code"] == "model_not_found" and err["param"] == "model", r.text
        assert "'gamma'" in err["message"] and "'alpha'" in err["message"]
    r = client.get("/v1/models/gamma")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    for path, body in [("/v1/completions", {"prompt": [5], "max_tokens": 2}), ("/detokenize", {"tokens": [5]})]:
        r = client.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text


def test_models_lists_both_and_tokenize_routes_by_model(served):
    srv, engines, budget, client = served
    listed = client.get("/v1/models").json()
    assert [m["id"] for m in listed["data"]] == list(NAMES)
    assert all(m["max_model_len"] == MAX_MODEL_LEN for m in listed["data"])
    assert client.get("/v1/models/beta").json()["id"] == "beta"
    for name in NAMES:
        tok = engines[name].tokenizer
        r = client.post("/tokenize", json={"model": name, "prompt": "the cat runs"}).json()
        assert r["tokens"] == tok.encode("the cat runs")
        back = client.post("/detokenize", json={"model": name, "tokens": r["tokens"]}).json()
        assert back["prompt"] == tok.decode(r["tokens"])


def parse_exposition(text: str) -> dict[str, dict[str, float]]:
    """{family: {labels: value}}, checking that every family has one TYPE line and its samples together."""
    families: dict[str, dict[str, float]] = {}
    types: Counter = Counter()
    current = None
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            types[line.split()[2]] += 1
            continue
        if line.startswith("#") or not line:
            continue
        name = sample_name(line)
        assert name == current or name not in families, f"samples of {name} apart"
        current = name
        labels, value = line[len(name) :].rsplit(" ", 1)
        families.setdefault(name, {})[labels] = float(value)
    assert all(count == 1 for count in types.values()), types
    return families


def test_metrics_label_each_models_series(served):
    srv, engines, budget, client = served
    complete(client, "beta", [7, 8, 9], 2)
    wait_idle(srv)
    families = parse_exposition(client.get("/metrics").text)
    for name in NAMES:
        s = engine_stats(srv, name)
        assert families["vpaged_requests_finished"][f'{{model="{name}"}}'] == s.requests_finished
        assert families["vpaged_engine_up"][f'{{model="{name}"}}'] == 1.0
    counts = families["vpaged_http_requests_total"]
    assert all("model=" not in labels for labels in counts)  # the server's counts, once
    assert counts['{path="/v1/completions",status="200"}'] >= 1


def test_labelled_exposition_keeps_every_models_samples():
    rng = random.Random()

    @dataclasses.dataclass
    class Stats:
        running: int
        kv_used_pages: int
        requests_finished: int

    texts, want = {}, {}
    counts = Counter({("/v1/completions", "200"): rng.randrange(100)})
    for i in range(rng.randint(2, 4)):
        name = f'm{i} "x"\\' if i == 0 else f"m{i}"  # a name the format must escape
        stats = Stats(rng.randrange(50), rng.randrange(1000), rng.randrange(10**6))
        texts[name] = prometheus_text(stats, counts, {"engine_step_failures_total": rng.randrange(3)})
        want[name] = parse_exposition(texts[name])
    merged = parse_exposition(labelled_exposition(texts, ("vpaged_http_requests_total",)))
    for name, families in want.items():
        label = 'model="' + name.replace("\\", "\\\\").replace('"', '\\"') + '"'
        for family, samples in families.items():
            for labels, value in samples.items():
                if family == "vpaged_http_requests_total":
                    assert merged[family][labels] == value
                else:
                    inner = labels[1:-1] if labels else ""
                    assert merged[family]["{" + label + ("," + inner if inner else "") + "}"] == value


def test_health_reports_each_model(model_dirs):
    name = f"mm-{uuid.uuid4().hex[:12]}"
    SharedBudget.create(name, capacity_bytes=CAPACITY)
    try:
        with ServerThread(engines_on(name, model_dirs)) as srv, httpx.Client(base_url=srv.url) as client:
            r = client.get("/health")
            assert r.status_code == 200 and r.json() == {"status": "ok", "models": {"alpha": "ok", "beta": "ok"}}
            srv.app.state.router.servers["beta"].loop.stop()
            r = client.get("/health")
            assert r.status_code == 503 and r.json()["models"] == {
                "alpha": "ok",
                "beta": "the engine thread is not running",
            }
            assert "'beta'" in r.json()["error"]["message"]
            assert client.post("/v1/completions", json={"model": "alpha", "prompt": [5], "max_tokens": 1}).is_success
        assert not any(loop.alive for loop in srv.app.state.router.loops())  # the shutdown stopped every loop
    finally:
        SharedBudget.remove(name, force=True)


class IdleEngine:
    """An engine with nothing to do; `broken` says why it cannot go on (as a tensor-parallel engine does)."""

    tokenizer = None

    def __init__(self, broken=None):
        self.broken = broken

    def has_unfinished(self) -> bool:
        return False

    def abort(self, request_id) -> None:
        pass


def test_one_engine_that_cannot_go_on_ends_the_server_of_several():
    from vpaged.errors import TensorParallelError
    from vpaged.serve.http.server import serve

    lost = TensorParallelError(f"rank {random.randint(1, 7)} lost")
    with pytest.raises(TensorParallelError) as e:
        serve({"fine": IdleEngine(), "lost": IdleEngine(lost)}, port=0, log_level="warning")
    assert e.value is lost


def test_create_app_refuses_a_bad_mapping(model_dirs):
    engine = object()
    for engines, model_name, match in [
        ({}, None, "empty"),
        ({"a": engine}, "a", "model_name"),
        ({"a": engine, "b": engine}, None, "engine of its own"),
        ({"": engine}, None, "non-empty"),
    ]:
        with pytest.raises(InvalidArgumentError, match=match):
            create_app(engines, model_name)


# ---------------------------------------------------------------------------------------------- one budget


def test_one_models_burst_takes_what_the_others_gave_back(served, alone):
    srv, engines, budget, client = served
    wait_idle(srv)
    rng = random.Random()
    first, second = prompts(rng, 12, 40, 200), prompts(rng, 30, 40, 200)

    def burst(name, batch):
        out: dict[int, list[int]] = {}

        def send(i, p):
            out[i] = complete(client, name, p, 24)

        threads = [threading.Thread(target=send, args=(i, p)) for i, p in enumerate(batch)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT)
        return [out.get(i) for i in range(len(batch))]

    assert {m.name for m in budget.state().members} == set(NAMES)
    assert burst("alpha", first) == greedy_alone(alone, "alpha", first, 24)
    alpha_held = member(budget, "alpha").granted_bytes
    assert alpha_held >= 48 * PAGE  # 12 sequences x 4 regions, kept (dormant) while alpha is idle
    assert burst("beta", second) == greedy_alone(alone, "beta", second, 24)  # needs more than was free
    state = budget.state()
    assert state.granted_bytes <= state.capacity_bytes
    assert member(budget, "alpha").granted_bytes < alpha_held  # alpha gave its dormant pages back, idle
    beta_pool = engines["beta"].store.cache.pool
    assert beta_pool.stats().high_water_pages * PAGE > CAPACITY - alpha_held  # beta used what alpha gave


# ---------------------------------------------------------------------------------------------- fuzz

names = st.one_of(
    st.sampled_from([*NAMES, "ALPHA", "alpha ", "", "gamma", "\x00", "é🦀"]),
    st.text(max_size=12),
    st.none(),
    st.integers(),
    st.lists(st.sampled_from(NAMES), max_size=2),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
ROUTES = {
    "/v1/completions": {"prompt": [5, 6, 7], "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "the cat"}], "max_tokens": 2},
    "/tokenize": {"prompt": "the cat"},
    "/detokenize": {"tokens": [5, 6]},
}


def test_random_model_fields_get_no_5xx(served):
    srv, engines, budget, client = served

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(st.sampled_from(sorted(ROUTES)), names, st.booleans())
    def check(path, model, leave_out):
        body = dict(ROUTES[path]) if leave_out else {**ROUTES[path], "model": model}
        r = client.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
        assert r.status_code < 500, (path, body, r.text[:300])
        if r.status_code >= 400:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        else:
            assert isinstance(body.get("model"), str) and body["model"] in NAMES
        plain = isinstance(model, str) and re.fullmatch(r"[\w.-]+", model, re.ASCII)
        card = client.get(f"/v1/models/{model}") if plain else None
        assert card is None or card.status_code in (200, 404)

    check()
    wait_idle(srv)
    for name in NAMES:
        s = engine_stats(srv, name)
        assert s.live_kv_tokens == 0 and s.kv_used_pages == s.kv_dormant_pages, s
        assert srv.app.state.router.servers[name].loop.step_failures == 0
