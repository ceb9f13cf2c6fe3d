"""The OpenAI-compatible server, end to end on 127.0.0.1 with the official `openai` client: completions and chat,
streaming and not, /metrics against stats(), HTTP 400 for bad requests while others go on, client disconnects.

Tiny random-weight models in fp32 with a word-level tokenizer built here (no network). Every request is
bounded (max_tokens, client timeouts, no retries); the server runs on a thread and stops at the end."""

from __future__ import annotations

import json
import random
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from serve_helpers import (  # noqa: E402
    assert_greedy_matches,
    save_model_with_tokenizer,
)

from vpaged.errors import RequestError  # noqa: E402
from vpaged.serve import LLMEngine, load_model  # noqa: E402
from vpaged.serve.http.choice_text import ChoiceText  # noqa: E402
from vpaged.serve.http.common.parse import parse_request  # noqa: E402
from vpaged.serve.http.completion.protocol import CompletionRequest  # noqa: E402
from vpaged.serve.http.server import ServerThread, prometheus_text  # noqa: E402

MODEL_NAME = "tiny"


pytestmark = pytest.mark.serving  # skipped where transformers cannot serve (tests/conftest.py)


MAX_MODEL_LEN = 256
TIMEOUT = 120


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    save_model_with_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def served(model_dir):
    """One server for the module: (ServerThread, engine, reference model, tokenizer)."""
    model, tok = load_model(str(model_dir), dtype=torch.float32)
    assert tok is not None
    engine = LLMEngine(
        model, tok, kv_budget_bytes=16 << 20, max_num_seqs=16, max_num_batched_tokens=64, max_model_len=MAX_MODEL_LEN
    )
    ref, _ = load_model(str(model_dir), dtype=torch.float32)
    with ServerThread(engine, model_name=MODEL_NAME) as srv:
        yield srv, engine, ref, tok


@pytest.fixture
def client(served):
    srv = served[0]
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT) as c:
        yield c


def engine_stats(srv, engine):
    """stats() read on the engine's own thread (the engine is not thread-safe)."""
    return srv.app.state.engine_loop.call(engine.stats).result(TIMEOUT)


def wait_idle(srv, engine, timeout=TIMEOUT):
    deadline = time.monotonic() + timeout
    while True:
        st = engine_stats(srv, engine)
        if st.running == 0 and st.waiting == 0 and st.swapped == 0:
            return st
        assert time.monotonic() < deadline, f"engine not idle: {st}"
        time.sleep(0.05)


def words(rng: random.Random, n: int) -> str:
    from serve_helpers import WORDS

    return " ".join(rng.choice(WORDS) for _ in range(n))


# ---------------------------------------------------------------------------------------------- completions


def test_completion_text_prompt_is_greedy_generate(served, client):
    srv, engine, ref, tok = served
    rng = random.Random()
    prompt = words(rng, rng.randint(3, 20))
    r = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    choice = r.choices[0]
    ids = tok.encode(prompt)
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == 12
    assert choice.finish_reason == "length"
    got = choice.model_extra["token_ids"]
    assert_greedy_matches(got, ids, ref, 12)
    assert choice.text == tok.decode(got, skip_special_tokens=True)


def test_completion_token_ids_batch_and_n(served, client):
    srv, engine, ref, tok = served
    rng = random.Random()
    prompts = [[rng.randrange(8, 500) for _ in range(rng.randint(1, 40))] for _ in range(3)]
    r = client.completions.create(
        model=MODEL_NAME, prompt=prompts, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    for p, c in zip(prompts, r.choices):
        assert_greedy_matches(c.model_extra["token_ids"], p, ref, 6)
    assert r.usage.prompt_tokens == sum(map(len, prompts))
    # n > 1 with a seed: two choices per prompt, reproducible whatever else runs
    kw = dict(
        model=MODEL_NAME,
        prompt=prompts[:2],
        max_tokens=5,
        temperature=1.0,
        n=2,
        seed=1234,
        extra_body={"ignore_eos": True},
    )
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2, 3]
    assert [c.model_extra["token_ids"] for c in a.choices] == [c.model_extra["token_ids"] for c in b.choices]
    assert all(len(c.model_extra["token_ids"]) == 5 for c in a.choices)


def test_streamed_completion_concatenates_to_the_non_streamed_one(served, client):
    srv, engine, ref, tok = served
    rng = random.Random()
    prompt = words(rng, rng.randint(2, 15))
    kw = dict(model=MODEL_NAME, prompt=prompt, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    text, ids, finish, usage, chunks = "", [], None, None, 0
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            chunks += 1
            text += c.text
            ids += c.model_extra["token_ids"]
            if c.finish_reason is not None:
                assert finish is None, "finish_reason sent twice"
                finish = c.finish_reason
    assert chunks > 2, "the answer was not streamed"
    assert text == full.choices[0].text
    assert ids == full.choices[0].model_extra["token_ids"]
    assert finish == full.choices[0].finish_reason == "length"
    assert usage.completion_tokens == 16 and usage.prompt_tokens == full.usage.prompt_tokens


def test_stop_strings_end_the_text_streamed_or_not(served, client):
    srv, engine, ref, tok = served
    rng = random.Random()
    prompt = words(rng, 5)
    base = (
        client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )
    pieces = base.split(" ")
    if len(pieces) < 4:
        pytest.skip("the random model produced too little text")
    stop = pieces[len(pieces) // 2]
    expected = base[: base.find(stop)]
    kw = dict(
        model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
    )
    r = client.completions.create(**kw)
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    streamed, finish = "", None
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            streamed += c.text
            finish = c.finish_reason or finish
    assert streamed == expected and finish == "stop"
    wait_idle(srv, engine)


# ---------------------------------------------------------------------------------------------- chat


def test_chat_streamed_and_not(served, client):
    srv, engine, ref, tok = served
    rng = random.Random()
    messages = [{"role": "system", "content": words(rng, 4)}, {"role": "user", "content": words(rng, 6)}]
    kw = dict(model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**kw)
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(rendered, add_special_tokens=False)
    assert r.usage.prompt_tokens == len(ids)
    msg = r.choices[0].message
    assert msg.role == "assistant" and r.choices[0].finish_reason == "length"
    got = r.choices[0].model_extra["token_ids"]
    assert_greedy_matches(got, ids, ref, 10)
    assert msg.content == tok.decode(got, skip_special_tokens=True)
    content, roles, finish = "", [], None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            if c.delta.role:
                roles.append(c.delta.role)
            content += c.delta.content or ""
            finish = c.finish_reason or finish
    assert roles == ["assistant"]
    assert content == msg.content and finish == "length"


# ---------------------------------------------------------------------------------------------- metrics


def parse_metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_models_health_and_metrics_agree_with_stats(served, client):
    srv, engine, ref, tok = served
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert httpx.get(srv.url + "/health", timeout=TIMEOUT).json() == {"status": "ok"}
    client.completions.create(model=MODEL_NAME, prompt=[5, 6, 7], max_tokens=3, extra_body={"ignore_eos": True})
    wait_idle(srv, engine)
    resp = httpx.get(srv.url + "/metrics", timeout=TIMEOUT)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    m = parse_metrics(resp.text)
    st = engine_stats(srv, engine)  # idle: nothing changes between the two reads
    from dataclasses import fields

    numeric = {
        f.name: getattr(st, f.name)
        for f in fields(st)
        if isinstance(getattr(st, f.name), (int, float)) and not isinstance(getattr(st, f.name), bool)
    }
    for name in (
        "running",
        "waiting",
        "swapped",
        "live_kv_tokens",
        "kv_mapped_bytes",
        "kv_high_water_bytes",
        "kv_utilization",
        "prefix_hit_tokens",
        "preemptions_swap",
        "preemptions_recompute",
    ):
        assert name in numeric, f"stats() lacks {name}"
    for name, value in numeric.items():
        assert m[f"vpaged_{name}"] == pytest.approx(float(value)), name
    assert m["vpaged_live_kv_tokens"] == 0  # idle: no pages held for finished requests
    assert m['vpaged_http_requests_total{path="/v1/completions",status="200"}'] >= 1


def test_prometheus_text_format():
    from collections import Counter
    from dataclasses import dataclass

    @dataclass
    class S:
        running: int = 3
        kv_utilization: float = 0.5
        preemptions_swap: int = 2
        name: str = "ignored"

    text = prometheus_text(S(), Counter({("/v1/completions", 200): 4}))
    assert "# TYPE vpaged_running gauge\nvpaged_running 3.0" in text
    assert "# TYPE vpaged_preemptions_swap counter\nvpaged_preemptions_swap 2.0" in text
    assert "vpaged_kv_utilization 0.5" in text and "name" not in text.replace("# HELP", "")
    assert 'vpaged_http_requests_total{path="/v1/completions",status="200"} 4.0' in text


# ---------------------------------------------------------------------------------------------- bad input


BAD_COMPLETIONS = [
    (b"{not json", "JSON"),
    (b"[1, 2]", "object"),
    ({"model": MODEL_NAME}, "prompt"),
    ({"prompt": "the cat"}, "model"),
    ({"model": "no-such-model", "prompt": "the cat"}, "no-such-model"),
    ({"model": MODEL_NAME, "prompt": "the cat", "temperature": -1}, "temperature"),
    ({"model": MODEL_NAME, "prompt": "the cat", "top_p": 1.5}, "top_p"),
    ({"model": MODEL_NAME, "prompt": "the cat", "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL_NAME, "prompt": "the cat", "n": 0}, "n"),
    ({"model": MODEL_NAME, "prompt": "the cat", "max_tokens": "many"}, "max_tokens"),
    ({"model": MODEL_NAME, "prompt": []}, "prompt"),
    ({"model": MODEL_NAME, "prompt": [1, -3]}, "prompt"),
    ({"model": MODEL_NAME, "prompt": [10**9]}, "prompt"),
    ({"model": MODEL_NAME, "prompt": list(range(1, MAX_MODEL_LEN + 10))}, "PromptTooLongError"),
    ({"model": MODEL_NAME, "prompt": "the cat", "logprobs": 21}, "logprobs"),
    ({"model": MODEL_NAME, "prompt": "the cat", "stop": [""]}, "stop"),
]


def test_bad_requests_get_400_while_others_are_served(served, client):
    srv, engine, ref, tok = served
    before = engine_stats(srv, engine)
    # a long streamed request runs through all the bad ones and must come out complete
    result = {}

    def long_request():
        ids = []
        for chunk in client.completions.create(
            model=MODEL_NAME,
            prompt=[3, 4, 5, 6],
            max_tokens=40,
            stream=True,
            temperature=0,
            extra_body={"ignore_eos": True},
        ):
            for c in chunk.choices:
                ids += c.model_extra["token_ids"]
        result["ids"] = ids

    t = threading.Thread(target=long_request)
    t.start()
    with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as h:
        for body, word in BAD_COMPLETIONS:
            kw = (
                {"content": body, "headers": {"content-type": "application/json"}}
                if isinstance(body, bytes)
                else {"json": body}
            )
            resp = h.post("/v1/completions", **kw)
            assert resp.status_code == 400, (body, resp.text)
            err = resp.json()["error"]
            assert word.lower() in f"{err['message']} {err['code']}".lower(), (word, err)
            assert err["type"] == "invalid_request_error"
        resp = h.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": []})
        assert resp.status_code == 400 and "messages" in resp.json()["error"]["message"]
        resp = h.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": [{"role": "wizard"}]})
        assert resp.status_code == 400
    # the same through the official client: a typed BadRequestError
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt="the cat", temperature=-2)
    t.join(TIMEOUT)
    assert len(result["ids"]) == 40
    assert_greedy_matches(result["ids"], [3, 4, 5, 6], ref, 40)
    after = wait_idle(srv, engine)
    assert after.live_kv_tokens == 0
    assert after.requests_finished - before.requests_finished >= 1


def test_client_disconnect_aborts_the_request(served):
    srv, engine, ref, tok = served
    body = {
        "model": MODEL_NAME,
        "prompt": [7, 8, 9],
        "max_tokens": MAX_MODEL_LEN - 10,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as h:
        with h.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            seen = 0
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    seen += 1
                    if seen == 3:
                        break
    # the stream is closed after 3 chunks of a long request: the engine must drop it soon, pages returned
    st = wait_idle(srv, engine, timeout=60)
    assert st.live_kv_tokens == 0
    # the server still answers
    with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as h:
        r = h.post("/v1/completions", json={"model": MODEL_NAME, "prompt": [1, 2], "max_tokens": 2})
        assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) <= 2


# ---------------------------------------------------------------------------------------------- no tokenizer


def test_model_without_tokenizer_takes_token_ids_only():
    model, tok = load_model("random:llama-tiny", dtype=torch.float32)
    ref, _ = load_model("random:llama-tiny", dtype=torch.float32)  # seeded: the same weights
    assert tok is None
    engine = LLMEngine(model, None, kv_budget_bytes=8 << 20, max_num_seqs=4, max_num_batched_tokens=32)
    with ServerThread(engine, model_name="ids-only") as srv, httpx.Client(base_url=srv.url, timeout=TIMEOUT) as h:
        r = h.post("/v1/completions", json={"model": "ids-only", "prompt": "some words", "max_tokens": 2})
        assert r.status_code == 400 and "token ids" in r.json()["error"]["message"]
        r = h.post("/v1/chat/completions", json={"model": "ids-only", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]
        r = h.post(
            "/v1/completions",
            json={"model": "ids-only", "prompt": [4, 5, 6], "max_tokens": 4, "temperature": 0, "ignore_eos": True},
        )
        assert r.status_code == 200
        c = r.json()["choices"][0]
        assert c["text"] == "" and len(c["token_ids"]) == 4
        assert_greedy_matches(c["token_ids"], [4, 5, 6], ref, 4)
        # SSE by hand: data lines, JSON chunks, [DONE] last
        lines = []
        with h.stream(
            "POST",
            "/v1/completions",
            json={
                "model": "ids-only",
                "prompt": [4, 5, 6],
                "max_tokens": 4,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            },
        ) as s:
            assert s.headers["content-type"].startswith("text/event-stream")
            lines = [x for x in s.iter_lines() if x]
        assert lines[-1] == "data: [DONE]"
        streamed = [t for x in lines[:-1] for ch in json.loads(x[6:])["choices"] for t in ch["token_ids"]]
        assert streamed == c["token_ids"]


# ---------------------------------------------------------------------------------------------- pieces


class CharTokenizer:
    """Decodes ids as characters; id 0 is half of a two-id character (shown as U+FFFD until completed by 1)."""

    def decode(self, ids, skip_special_tokens=True):
        out, i = [], 0
        while i < len(ids):
            if ids[i] == 0:
                if i + 1 < len(ids) and ids[i + 1] == 1:
                    out.append("é")
                    i += 2
                    continue
                out.append("\ufffd")
            else:
                out.append(chr(ord("a") + ids[i] - 2))
            i += 1
        return "".join(out)


def test_choice_text_holds_back_incomplete_characters_and_stop_prefixes():
    ch = ChoiceText(CharTokenizer(), stops=("cd",))
    sent = []
    seq = [2, 0, 1, 3, 4, 5]  # a é b c d
    for k in range(1, len(seq) + 1):
        ch.update(seq[:k], None)
        sent.append(ch.delta()[0])
        if ch.done:
            break
    assert "".join(sent) == "aéb" and ch.finish_reason == "stop"
    assert "\ufffd" not in "".join(sent)
    ch = ChoiceText(CharTokenizer())
    ch.update([2, 0], None)
    assert ch.delta()[0] == "a"
    ch.update([2, 0], "length")
    assert ch.delta()[0] == "\ufffd"  # finished: what is there is final


def test_parse_request_reports_the_field():
    with pytest.raises(RequestError) as e:
        parse_request(CompletionRequest, {"model": "m", "prompt": "x", "n": "two"})
    assert e.value.param == "n"
    with pytest.raises(RequestError, match="frequency_penalty"):
        parse_request(CompletionRequest, {"model": "m", "prompt": "x", "frequency_penalty": 5.0})
    req = parse_request(CompletionRequest, {"model": "m", "prompt": [[1, 2], [3]]})
    assert req.prompts() == [[1, 2], [3]]
    with pytest.raises(RequestError, match="unknown field unknown_field") as e:  # refused, not ignored
        parse_request(CompletionRequest, {"model": "m", "prompt": [[1, 2], [3]], "unknown_field": 1})
    assert e.value.param == "unknown_field"


class FailingStepEngine:
    """An engine whose next step() raises (before touching the real engine) when `fail` is set."""

    def __init__(self, engine):
        self._engine = engine
        self.fail = False

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def step(self):
        if self.fail:
            self.fail = False
            raise RuntimeError("injected failure")
        return self._engine.step()


def test_a_failed_step_ends_the_requests_in_flight_and_the_server_goes_on():
    model, _ = load_model("random:llama-tiny", dtype=torch.float32)
    engine = FailingStepEngine(
        LLMEngine(model, None, kv_budget_bytes=8 << 20, max_num_seqs=4, max_num_batched_tokens=32)
    )
    body = {"model": "m", "prompt": [4, 5, 6], "max_tokens": 4, "ignore_eos": True}
    with ServerThread(engine, model_name="m") as srv, httpx.Client(base_url=srv.url, timeout=TIMEOUT) as h:
        engine.fail = True
        r = h.post("/v1/completions", json=body)
        assert r.status_code == 500 and "injected failure" in r.json()["error"]["message"]
        r = h.post("/v1/completions", json=body)
        assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 4
        st = wait_idle(srv, engine)
        assert st.live_kv_tokens == 0
        m = parse_metrics(h.get("/metrics").text)
        assert m["vpaged_engine_step_failures_total"] == 1
