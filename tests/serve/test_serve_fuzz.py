"""Fuzzing the request schema: random JSON bodies (nested values, wrong types, huge numbers, unicode, and
near-valid requests with one field mutated) against /v1/completions and /v1/chat/completions. No answer may be
a 5xx, every error is in the OpenAI error shape, and afterwards the engine holds nothing: no running or
waiting request, no live KV page. In-process server on 127.0.0.1, a tiny random-weight model; generation is
kept short (the server's own max_model_len bounds what a valid request may ask)."""

from __future__ import annotations

import json
import time

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
hypothesis = pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from serve_helpers import save_model_with_tokenizer  # noqa: E402

from vpaged.serve import LLMEngine, load_model  # noqa: E402
from vpaged.serve.http.server import ServerLimits, ServerThread  # noqa: E402

pytestmark = pytest.mark.serving  # skipped where transformers cannot serve (tests/conftest.py)

NAME = "fuzz"
MAX_MODEL_LEN = 48  # keeps every valid request short: prompt + max_tokens <= 48
TIMEOUT = 60

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.integers(min_value=-3, max_value=600),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["", "\x00", "\ud7ff", "é🦀\u202e", "the cat", NAME, "user", "assistant", "text"]),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=8) | st.sampled_from(["type", "text"]), inner)
    ),
    max_leaves=12,
)
FIELDS = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "n",
    "stream",
    "stream_options",
    "stop",
    "seed",
    "stop_token_ids",
    "ignore_eos",
    "logprobs",
    "logit_bias",
    "best_of",
    "echo",
    "suffix",
    "tools",
    "tool_choice",
    "response_format",
    "presence_penalty",
    "user",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "top_logprobs",
    "prompt_logprobs",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "bad_words",
]
# The fields of the API issue (#39): a bad value of one of them alone is a 400 whose param names it.
NEW_FIELDS = [
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
    "echo",
    "logit_bias",
    "min_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "bad_words",
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "tools",
    "tool_choice",
]


def base(path: str) -> dict:
    if path == "/v1/completions":
        return {"model": NAME, "prompt": [5, 6, 7], "max_tokens": 3}
    return {"model": NAME, "messages": [{"role": "user", "content": "the cat"}], "max_tokens": 3}


mutations = st.dictionaries(st.sampled_from(FIELDS), values, min_size=1, max_size=3)
bodies = st.one_of(
    st.tuples(st.just("mutated"), mutations),
    st.tuples(st.just("random"), values),
    st.tuples(st.just("nested"), st.integers(min_value=900, max_value=6000)),
)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-fuzz")
    save_model_with_tokenizer(path)
    model, tok = load_model(str(path), dtype=torch.float32)
    engine = LLMEngine(
        model, tok, kv_budget_bytes=4 << 20, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=MAX_MODEL_LEN
    )
    with ServerThread(engine, model_name=NAME, limits=ServerLimits(max_n=2, max_prompts=2)) as srv:
        with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as client:
            yield srv, engine, client


def encode(path: str, kind: str, payload) -> bytes:
    if kind == "mutated":
        return json.dumps({**base(path), **payload}).encode()
    if kind == "nested":
        return (b'{"model": "fuzz", "prompt": [1], "stop": ' if path == "/v1/completions" else b"") + (
            b"[" * payload + b"]" * payload + (b"}" if path == "/v1/completions" else b"")
        )
    return json.dumps(payload).encode()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_random_bodies_get_no_5xx_and_leave_no_state(served, path):
    srv, engine, client = served

    @settings(
        max_examples=120,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=False,
        database=None,
    )
    @given(bodies)
    def check(case):
        kind, payload = case
        raw = encode(path, kind, payload)
        resp = client.post(path, content=raw, headers={"content-type": "application/json"})
        assert resp.status_code < 500, (raw[:300], resp.status_code, resp.text[:300])
        if resp.status_code >= 400:
            err = resp.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}
        elif "text/event-stream" not in resp.headers.get("content-type", ""):
            assert resp.json()["choices"]

    check()
    s_now = None
    for _ in range(200):
        s_now = srv.app.state.engine_loop.call(engine.stats).result(TIMEOUT)
        if s_now.running == 0 and s_now.waiting == 0:
            break
        time.sleep(0.05)
    s = s_now
    assert s.running == 0 and s.waiting == 0 and s.swapped == 0, s
    assert s.live_kv_tokens == 0
    assert s.kv_used_pages == s.kv_dormant_pages, s  # only pages kept for reuse remain taken
    assert srv.app.state.engine_loop.step_failures == 0


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_bad_value_of_a_new_field_is_a_400_naming_it(served, path):
    srv, engine, client = served

    @settings(
        max_examples=100,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=False,
        database=None,
    )
    @given(st.sampled_from(NEW_FIELDS), values)
    def check(name, value):
        raw = json.dumps({**base(path), name: value}).encode()
        resp = client.post(path, content=raw, headers={"content-type": "application/json"})
        assert resp.status_code < 500, (raw[:300], resp.status_code, resp.text[:300])
        if resp.status_code >= 400:
            assert resp.status_code == 400, (raw[:300], resp.text[:300])
            assert resp.json()["error"]["param"] == name, (raw[:300], resp.text[:300])

    check()
