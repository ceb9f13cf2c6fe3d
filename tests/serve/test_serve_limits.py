"""The server against hostile or careless clients: disconnects of non-streaming requests, inputs that must be
400s (never 500s), /metrics labels, connection options, the limits of ServerLimits (body, prompts, n, stops,
tokens, headers), API key, Host and content-type checks, strict request types, and the meaning of the KV
metrics. In-process server on 127.0.0.1, a tiny random-weight model without a tokenizer; every request is
bounded."""

from __future__ import annotations

import json
import re
import socket
import time

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from process_helpers import wait_until  # noqa: E402

from vpaged.serve import LLMEngine, load_model  # noqa: E402
from vpaged.serve.http.server import ServerLimits, ServerThread  # noqa: E402

pytestmark = pytest.mark.serving  # skipped where transformers cannot serve (tests/conftest.py)

TIMEOUT = 60
MAX_MODEL_LEN = 4096
NAME = "m"


def make_engine(**kw):
    model, _ = load_model("random:llama-tiny", dtype=torch.float32)
    opts = dict(kv_budget_bytes=16 << 20, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=MAX_MODEL_LEN)
    opts.update(kw)
    return LLMEngine(model, None, **opts)


@pytest.fixture(scope="module")
def served():
    engine = make_engine()
    limits = ServerLimits(max_body_bytes=64 << 10, max_n=4, max_prompts=3, max_stop_token_ids=5, header_timeout_s=0.5)
    with ServerThread(engine, model_name=NAME, limits=limits) as srv:
        yield srv, engine


@pytest.fixture
def h(served):
    with httpx.Client(base_url=served[0].url, timeout=TIMEOUT) as c:
        yield c


def stats(srv, engine):
    return srv.app.state.engine_loop.call(engine.stats).result(TIMEOUT)


def assert_openai_error(resp, status: int, word: str | None = None):
    assert resp.status_code == status, (resp.status_code, resp.text)
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if word is not None:
        assert word in f"{err['message']} {err['param']} {err['code']}", err
    return err


def body(**kw):
    return {"model": NAME, "prompt": [1, 2, 3], "max_tokens": 2, **kw}


# ------------------------------------------------------------------------------------------ disconnects


def test_non_streaming_request_is_aborted_when_its_client_goes_away(served):
    srv, engine = served
    before = stats(srv, engine)
    payload = json.dumps(body(max_tokens=4000, ignore_eos=True)).encode()
    host, port = srv.host, srv.port
    sock = socket.create_connection((host, port), timeout=TIMEOUT)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    assert wait_until(lambda: stats(srv, engine).running == 1, TIMEOUT), "the request never ran"
    sock.close()
    gone = time.monotonic()
    assert wait_until(lambda: stats(srv, engine).live_kv_tokens == 0, 1.0), (
        "pages not back within 1 s of the disconnect"
    )
    after = stats(srv, engine)
    assert time.monotonic() - gone < 2.0
    assert after.running == 0 and after.waiting == 0
    assert after.requests_aborted == before.requests_aborted + 1


# ------------------------------------------------------------------------------------------ no 500s


@pytest.mark.parametrize("seed", [2**64, 2**70, -(2**63) - 1])
def test_seed_out_of_range_is_a_400(h, seed):
    assert_openai_error(h.post("/v1/completions", json=body(seed=seed, temperature=1.0)), 400, "seed")


def test_seed_at_the_edges_is_served(h):
    for seed in (2**64 - 1, -(2**63)):
        assert h.post("/v1/completions", json=body(seed=seed, temperature=1.0)).status_code == 200


@pytest.mark.parametrize("depth", [5_000, 30_000])
def test_deeply_nested_json_is_a_400(h, depth):
    raw = b'{"model": "m", "prompt": [1], "logprobs": ' + b"[" * depth + b"]" * depth + b"}"
    resp = h.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert_openai_error(resp, 400)
    assert h.get("/health").status_code == 200  # the connection and the server are fine


def test_unknown_routes_and_methods_answer_in_the_openai_error_shape(h):
    assert_openai_error(h.get("/no/such/route"), 404)
    assert_openai_error(h.get("/v1/completions"), 405)
    assert_openai_error(h.post("/v1/models", json={}), 405)


# ------------------------------------------------------------------------------------------ /metrics

SAMPLE = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-zA-Z_][a-zA-Z0-9_]*="([^"\\\n]|\\[\\"n])*",?)*\})? \S+$')


def test_metrics_labels_are_bounded_and_escaped(h):
    h.get('/a"} 1')
    h.get("/a%22%7D%201")
    h.get("/x\\y")
    for i in range(200):
        h.get(f"/unknown-{i}")
    text = h.get("/metrics").text
    for line in text.splitlines():
        if line and not line.startswith("#"):
            assert SAMPLE.match(line), f"not a valid sample line: {line!r}"
    series = [x for x in text.splitlines() if x.startswith("vpaged_http_requests_total{")]
    assert len(series) < 30, len(series)
    assert 'vpaged_http_requests_total{path="other",status="404"}' in text


# ------------------------------------------------------------------------------------------ connections


def test_accepted_connections_have_tcp_nodelay(served, h):
    srv, _ = served
    assert h.get("/health").status_code == 200  # a kept-alive connection is open now
    conns = list(srv.server.server_state.connections)
    assert conns
    for proto in conns:
        sock = proto.transport.get_extra_info("socket")
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


def test_slow_header_senders_are_closed(served):
    srv, _ = served  # header_timeout_s=0.5
    socks = []
    for _ in range(100):
        s = socket.create_connection((srv.host, srv.port), timeout=10)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        socks.append(s)
    try:
        deadline = time.monotonic() + 10
        for s in socks:
            s.settimeout(max(0.1, deadline - time.monotonic()))
            assert s.recv(100) == b"", "a slow header sender was kept open"
    finally:
        for s in socks:
            s.close()
    with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
        assert c.get("/health").status_code == 200


# ------------------------------------------------------------------------------------------ limits


def test_limits_on_what_a_request_asks_for(h):
    assert_openai_error(h.post("/v1/completions", json=body(n=5)), 400, "n")
    assert_openai_error(h.post("/v1/completions", json=body(prompt=[[1]] * 4)), 400, "prompt")
    assert_openai_error(h.post("/v1/completions", json=body(stop_token_ids=list(range(6)))), 400, "stop_token_ids")
    assert_openai_error(h.post("/v1/completions", json=body(prompt=[1] * MAX_MODEL_LEN)), 400, "PromptTooLongError")
    # max_tokens that cannot fit the model's length is refused, not clamped
    err = assert_openai_error(h.post("/v1/completions", json=body(max_tokens=MAX_MODEL_LEN)), 400, "max_tokens")
    assert str(MAX_MODEL_LEN) in err["message"]


def test_max_tokens_that_fits_exactly_is_served(h):
    r = h.post("/v1/completions", json=body(prompt=[1] * (MAX_MODEL_LEN - 2), max_tokens=2, ignore_eos=True))
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 2


def test_max_prompt_tokens():
    limits = ServerLimits(max_prompt_tokens=8)
    with ServerThread(make_engine(), model_name=NAME, limits=limits) as srv:
        with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
            assert_openai_error(c.post("/v1/completions", json=body(prompt=[1] * 9)), 400, "PromptTooLongError")
            assert c.post("/v1/completions", json=body(prompt=[1] * 8)).status_code == 200


def test_body_size_is_checked_before_parsing(h):
    big = json.dumps(body(prompt=[1] * 40_000)).encode()  # over 64 KiB
    assert_openai_error(h.post("/v1/completions", content=big, headers={"content-type": "application/json"}), 413)

    def chunks():  # no Content-Length: the size is counted as it arrives
        for i in range(0, len(big), 4096):
            yield big[i : i + 4096]

    resp = h.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert_openai_error(resp, 413)


def test_content_type_must_be_json(h):
    raw = json.dumps(body()).encode()
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        headers = {} if ctype is None else {"content-type": ctype}
        assert_openai_error(h.post("/v1/completions", content=raw, headers=headers), 415)
    assert h.post(
        "/v1/completions", content=raw, headers={"content-type": "application/json; charset=utf-8"}
    ).is_success


def test_host_header_is_checked(h):
    assert_openai_error(h.get("/v1/models", headers={"host": "evil.example:8000"}), 421)
    assert_openai_error(h.post("/v1/completions", json=body(), headers={"host": "rebind.example"}), 421)
    for host in ("localhost:1234", "127.0.0.1", "[::1]:80"):
        assert h.get("/v1/models", headers={"host": host}).status_code == 200


def test_allowed_hosts_and_api_key():
    limits = ServerLimits(api_key="sekrit", allowed_hosts=("api.example",))
    with ServerThread(make_engine(), model_name=NAME, limits=limits) as srv:
        with httpx.Client(base_url=srv.url, timeout=TIMEOUT, headers={"host": "api.example"}) as c:
            assert c.get("/health").status_code == 200  # open
            err = assert_openai_error(c.get("/v1/models"), 401)
            assert err["type"] == "authentication_error"
            assert_openai_error(c.post("/v1/completions", json=body()), 401)
            assert_openai_error(c.get("/metrics"), 401)
            assert_openai_error(c.get("/v1/models", headers={"authorization": "Bearer wrong"}), 401)
            good = {"authorization": "Bearer sekrit"}
            assert c.get("/v1/models", headers=good).status_code == 200
            assert c.post("/v1/completions", json=body(), headers=good).status_code == 200
            assert_openai_error(c.get("/v1/models", headers={**good, "host": "127.0.0.1"}), 421)
        import openai

        with openai.OpenAI(base_url=srv.url + "/v1", api_key="sekrit", max_retries=0, timeout=TIMEOUT) as oc:
            oc._client.headers["host"] = "api.example"
            assert [m.id for m in oc.models.list().data] == [NAME]


# ------------------------------------------------------------------------------------------ silent acceptance


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"stop": ["x"]}, "stop"),  # no tokenizer: stop strings cannot be matched
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"max_tokens": "5"}, "max_tokens"),
        ({"n": 2.0}, "n"),
        ({"stream": "yes"}, "stream"),
        ({"prompt": [1, True, 3]}, "prompt"),
        ({"prompt": [[1], [True]]}, "prompt"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"temperature": "0.5"}, "temperature"),
    ],
)
def test_fields_that_would_be_ignored_or_coerced_are_refused(h, extra, field):
    err = assert_openai_error(h.post("/v1/completions", json=body(**extra)), 400, field)
    assert err["param"] == field


def test_response_format_on_chat_is_refused(h):
    chat = {"model": NAME, "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}}
    assert_openai_error(h.post("/v1/chat/completions", json=chat), 400, "response_format")


# ------------------------------------------------------------------------------------------ metrics meaning


def metrics(c) -> dict[str, float]:
    out = {}
    for line in c.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


def test_kv_metrics_mean_what_they_say():
    engine = make_engine(enable_prefix_caching=False)
    with ServerThread(engine, model_name=NAME) as srv, httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
        m = metrics(c)
        assert m["vpaged_kv_utilization"] == 0.0  # nothing mapped: 0, not 1
        assert m["vpaged_kv_used_pages"] == 0 and m["vpaged_kv_dormant_pages"] == 0
        total = m["vpaged_kv_free_pages"]
        assert total * engine.store.cache.pool.page_size == m["vpaged_kv_budget_bytes"]
        assert m["vpaged_prefix_hit_rate"] == 0.0
        seen = {}

        def during():
            seen.update(metrics(c))
            return seen["vpaged_running"] == 1

        payload = body(prompt=[5] * 600, max_tokens=2000, ignore_eos=True, stream=True)
        with c.stream("POST", "/v1/completions", json=payload) as s:
            for line in s.iter_lines():
                if line.startswith("data: {") and during():
                    break
        assert 0 < seen["vpaged_kv_utilization"] <= 1.0
        live = seen["vpaged_kv_used_pages"] - seen["vpaged_kv_dormant_pages"]
        assert live > 0 and seen["vpaged_kv_used_pages"] + seen["vpaged_kv_free_pages"] == total
        assert wait_until(lambda: metrics(c)["vpaged_running"] == 0, TIMEOUT)
        m = metrics(c)
        assert m["vpaged_kv_used_pages"] == m["vpaged_kv_dormant_pages"]  # idle: only pages kept for reuse
        assert m["vpaged_kv_used_pages"] + m["vpaged_kv_free_pages"] == total


def test_prefix_hit_rate():
    engine = make_engine(enable_prefix_caching=True)
    with ServerThread(engine, model_name=NAME) as srv, httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
        prompt = [7] * 2048
        for _ in range(2):
            assert c.post("/v1/completions", json=body(prompt=prompt, max_tokens=1)).status_code == 200
        m = metrics(c)
        hits, computed = m["vpaged_prefix_hit_tokens"], m["vpaged_prompt_tokens_total"]
        assert m["vpaged_prefix_hit_rate"] == pytest.approx(hits / (hits + computed) if hits else 0.0)
