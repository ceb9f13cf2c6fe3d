"""What the server does with each field a client may send: unknown and unimplemented fields are 400s naming
them, the listed hints are accepted and ignored, the legacy `functions` / `function_call` are served as the
tools they map to (answered in the legacy shape); tools reach a chat template without tool support (the
prompt's token count changes, in the Hermes convention the parser reads); completions with echo, logprobs and
max_tokens 0 score the prompt as a transformers forward does; POST /v1/responses says it is not served; an
answer that could pass max_response_bytes is refused before any work, and the estimate bounds real answers.
In-process servers on 127.0.0.1: a random-weight model saved with a word tokenizer whose template ignores
tools, and random:llama-tiny (token ids) for the scores."""

from __future__ import annotations

import json
import logging
import random

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from serve_helpers import CHAT_TEMPLATE, save_model_with_tokenizer  # noqa: E402

from vpaged.serve import LLMEngine, load_model  # noqa: E402
from vpaged.serve.http import chat_template, guard, tools  # noqa: E402
from vpaged.serve.http.common.protocol import IGNORED_FIELDS  # noqa: E402
from vpaged.serve.http.server import ServerLimits, ServerThread  # noqa: E402

pytestmark = pytest.mark.serving  # skipped where transformers cannot serve (tests/conftest.py)

TIMEOUT = 60
NAME = "m"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
# A template that renders tools itself (the probe must find them and leave the rendering to it).
TOOL_TEMPLATE = (
    "{% if tools %}tools : {% for t in tools %}{{ t['function']['name'] }} {% endfor %}{% endif %}"
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}"
)


@pytest.fixture(scope="module")
def word_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("words")
    save_model_with_tokenizer(path, chat_template=CHAT_TEMPLATE)  # renders role and content only: no tools
    return load_model(str(path))


@pytest.fixture(scope="module")
def served(word_model):
    model, tok = word_model
    engine = LLMEngine(model, tok, kv_budget_bytes=16 << 20, max_model_len=1024)
    with ServerThread(engine, model_name=NAME, limits=ServerLimits(max_response_bytes=2 << 20)) as srv:
        yield srv, tok


@pytest.fixture
def h(served):
    with httpx.Client(base_url=served[0].url, timeout=TIMEOUT) as c:
        yield c


def chat(**kw):
    return {"model": NAME, "messages": [{"role": "user", "content": "the cat sees a dog"}], "max_tokens": 2, **kw}


def completion(**kw):
    return {"model": NAME, "prompt": "the cat", "max_tokens": 2, **kw}


def refused(resp, field: str) -> dict:
    assert resp.status_code == 400, resp.text[:500]
    err = resp.json()["error"]
    assert err["param"] == field and field in err["message"], err
    return err


# ------------------------------------------------------------------------------------------ unknown fields


@pytest.mark.parametrize(
    "field, value",
    [
        ("bogus_field_xyz", 1),
        ("min_p", 0.1),  # vLLM's, not implemented here
        ("chat_template_kwargs", {"x": 1}),
        ("prediction", {"type": "content", "content": "the"}),
        ("audio", {"voice": "alloy", "format": "wav"}),
        ("web_search_options", {}),
        ("modalities", ["text", "audio"]),
        ("reasoning_effort", "low"),
        ("verbosity", "low"),
    ],
)
def test_unknown_and_unimplemented_chat_fields_are_400s_naming_them(h, field, value):
    refused(h.post("/v1/chat/completions", json=chat(**{field: value})), field)


def test_unknown_fields_are_refused_on_every_route(h):
    refused(h.post("/v1/completions", json=completion(bogus_field_xyz=1)), "bogus_field_xyz")
    refused(h.post("/v1/completions", json=completion(modalities=["text"])), "modalities")  # a chat field
    refused(h.post("/tokenize", json={"model": NAME, "prompt": "the", "bogus": 1}), "bogus")
    refused(h.post("/detokenize", json={"model": NAME, "tokens": [11], "bogus": 1}), "bogus")
    err = refused(h.post("/v1/completions", json=completion(bogus=1, n="x")), "bogus")  # named first
    assert err["code"] == "unknown_field"


def test_hints_real_clients_send_are_accepted_and_change_nothing(h):
    hints = {
        "user": "u1",
        "metadata": {"k": "v"},
        "store": False,
        "service_tier": "auto",
        "safety_identifier": "s",
        "prompt_cache_key": "p",
        "prompt_cache_retention": "24h",
        "prompt_cache_options": {},
    }
    assert set(hints) == set(IGNORED_FIELDS)
    neutral = {"modalities": ["text"], "audio": None, "prediction": None, "parallel_tool_calls": True}
    plain = h.post("/v1/chat/completions", json=chat(temperature=0, max_tokens=4))
    given = h.post("/v1/chat/completions", json=chat(temperature=0, max_tokens=4, **hints, **neutral))
    assert plain.status_code == given.status_code == 200, given.text
    assert given.json()["choices"][0]["token_ids"] == plain.json()["choices"][0]["token_ids"]
    assert given.json()["usage"] == plain.json()["usage"]
    resp = h.post("/v1/completions", json=completion(user="u", stream=True, stream_options={"include_usage": True}))
    assert resp.status_code == 200 and "[DONE]" in resp.text


# ------------------------------------------------------------------------------------------ tools


def prompt_tokens(h, **kw) -> int:
    resp = h.post("/v1/chat/completions", json=chat(**kw))
    assert resp.status_code == 200, resp.text
    return resp.json()["usage"]["prompt_tokens"]


def test_tools_reach_a_template_without_tool_support(h, served, caplog):
    _, tok = served
    messages = chat()["messages"]
    with caplog.at_level(logging.WARNING, logger="vpaged.serve"):
        with_tools = prompt_tokens(h, tools=[WEATHER])
    without = prompt_tokens(h)
    assert with_tools > without
    # the independent count: the template's rendering of a system message holding the Hermes block
    system = {"role": "system", "content": chat_template.tool_prompt([WEATHER])}
    expected = tok.apply_chat_template([system, *messages], tokenize=False, add_generation_prompt=True)
    assert with_tools == len(tok.encode(expected, add_special_tokens=False))
    assert any("does not render tools" in r.getMessage() for r in caplog.records)
    # /tokenize renders the same way (vLLM's /tokenize takes tools too)
    counted = h.post("/tokenize", json={"model": NAME, "messages": messages, "tools": [WEATHER]}).json()["count"]
    plain = h.post("/tokenize", json={"model": NAME, "messages": messages}).json()["count"]
    assert (counted, plain) == (with_tools, without)
    # the legacy functions reach it the same way
    assert prompt_tokens(h, functions=[WEATHER["function"]]) == with_tools


def test_a_template_with_tool_support_renders_the_tools_itself(word_model):
    _, tok = word_model
    tok = type(tok).from_pretrained(tok.name_or_path)  # a copy: the served one keeps its template
    tok.chat_template = TOOL_TEMPLATE
    renderer = chat_template.ChatRenderer(tok, "m")
    conv = [{"role": "user", "content": "the cat"}]
    text = renderer.render(conv, True, [WEATHER])
    assert text == tok.apply_chat_template(conv, tools=[WEATHER], tokenize=False, add_generation_prompt=True)
    assert text.startswith("tools : get_weather") and "<tools>" not in text


def test_the_default_tool_prompt_asks_for_what_the_parser_reads(word_model):
    block = chat_template.tool_prompt([WEATHER])
    assert json.dumps(WEATHER) in block  # each tool's JSON schema, whole
    # an answer in the form the block shows parses into the call
    answer = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert "<tool_call>\n{" in block and "</tool_call>" in block
    content, calls = tools.parse(answer, "auto", "hermes")
    assert content is None and calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Oslo"}
    # a history the template cannot render goes in the same convention
    _, tok = word_model
    renderer = chat_template.ChatRenderer(tok, "m")
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    history = [
        {"role": "user", "content": "weather ?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
        {"role": "tool", "content": "warm", "tool_call_id": "c1"},
    ]
    text = renderer.render(history, True, [WEATHER])
    assert 'assistant : <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert "user : <tool_response>\nsunny\n</tool_response>\n<tool_response>\nwarm\n</tool_response>" in text


def test_a_legacy_function_result_in_the_history_is_read_as_a_tool_message(h):
    history = [
        {"role": "user", "content": "weather ?"},
        {"role": "assistant", "content": None, "function_call": {"name": "get_weather", "arguments": "{}"}},
        {"role": "function", "name": "get_weather", "content": "sunny"},
    ]
    resp = h.post("/v1/chat/completions", json=chat(messages=history, functions=[WEATHER["function"]]))
    assert resp.status_code == 200, resp.text
    call = {"id": "call_0", "type": "function", "function": history[1]["function_call"]}
    as_tools = [
        history[0],
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_0"},
    ]
    again = h.post("/v1/chat/completions", json=chat(messages=as_tools, tools=[WEATHER]))
    assert again.json()["usage"]["prompt_tokens"] == resp.json()["usage"]["prompt_tokens"]


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"function_call": "auto"}, "function_call"),  # without functions
        ({"functions": [WEATHER["function"]], "tools": [WEATHER]}, "functions"),
        ({"functions": [WEATHER["function"]], "function_call": {"name": "other"}}, "function_call"),
        ({"functions": [WEATHER["function"]], "function_call": "sometimes"}, "function_call"),
        ({"functions": [{"name": "bad name!"}]}, "functions"),
        ({"functions": []}, "functions"),
    ],
)
def test_bad_legacy_functions_are_400s_naming_the_field(h, extra, field):
    refused(h.post("/v1/chat/completions", json=chat(**extra)), field)


# ------------------------------------------------------------------------------------------ /v1/responses


def test_the_responses_api_says_it_is_not_served(h):
    for method, path in (("POST", "/v1/responses"), ("GET", "/v1/responses/resp_1")):
        resp = h.request(method, path, json={"model": NAME, "input": "hi"} if method == "POST" else None)
        assert resp.status_code == 404
        err = resp.json()["error"]
        assert err["code"] == "responses_api_not_served" and "/v1/chat/completions" in err["message"]


# ------------------------------------------------------------------------------------------ response size


def test_an_answer_over_max_response_bytes_is_refused_before_any_work(h, served):
    srv, _ = served
    engine = srv.app.state.engine_loop.engine

    def finished():
        return srv.app.state.engine_loop.call(engine.stats).result(TIMEOUT).requests_finished

    before = finished()
    prompt = " ".join(["the cat sees a dog"] * 60)  # 300 tokens, echoed 8 times with 20 logprobs each: > 2 MiB
    body = completion(prompt=[prompt] * 8, echo=True, logprobs=20, max_tokens=1)
    err = refused(h.post("/v1/completions", json=body), "logprobs")
    assert err["code"] == "response_too_large" and "MiB" in err["message"]
    wide = chat(max_tokens=900, n=4, logprobs=True, top_logprobs=20)
    assert refused(h.post("/v1/chat/completions", json=wide), "top_logprobs")["code"] == "response_too_large"
    assert finished() == before  # nothing reached the engine
    assert h.post("/v1/completions", json={**body, "prompt": prompt[:200]}).status_code == 200


def test_the_estimate_bounds_real_answers(h, rng):
    prng = random.Random(int(torch.randint(0, 2**31, (1,), generator=rng)))
    words = "the cat sees a dog over the river and a bird sings".split()
    for _ in range(6):
        k = prng.choice([None, 0, 5, 20])
        stream, echo, n = prng.random() < 0.5, prng.random() < 0.5, prng.randint(1, 3)
        max_tokens = prng.randint(1, 12)
        text = " ".join(prng.choice(words) for _ in range(prng.randint(1, 40)))
        body = completion(prompt=text, max_tokens=max_tokens, logprobs=k, echo=echo, n=n, stream=stream, seed=1)
        resp = h.post("/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        prompt_len = len(h.post("/tokenize", json={"model": NAME, "prompt": text}).json()["tokens"])
        estimate = guard.response_bytes_estimate([max_tokens + (prompt_len if echo else 0)], n, k, False, stream)
        assert len(resp.content) <= estimate, (body, len(resp.content), estimate)
        chat_body = chat(max_tokens=max_tokens, n=n, stream=stream, logprobs=k is not None, top_logprobs=k, seed=1)
        resp = h.post("/v1/chat/completions", json=chat_body)
        assert resp.status_code == 200, resp.text
        assert len(resp.content) <= guard.response_bytes_estimate([max_tokens], n, k, True, stream)


# ------------------------------------------------------------------------------------------ prompt scoring


@pytest.fixture(scope="module")
def tiny():
    engine = LLMEngine(load_model("random:llama-tiny")[0], None, kv_budget_bytes=16 << 20, max_model_len=512)
    with ServerThread(engine, model_name=NAME) as srv, httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
        yield srv, c


@torch.no_grad()
def reference_logprobs(tokens: list[int]) -> torch.Tensor:
    model = load_model("random:llama-tiny")[0]  # the same seeded weights as the server's
    model.set_attn_implementation("sdpa")
    return model(input_ids=torch.tensor([tokens])).logits[0].float().log_softmax(dim=-1)


def test_echo_with_max_tokens_0_scores_the_prompt_as_a_transformers_forward(tiny, rng):
    _, c = tiny
    prng = random.Random(int(torch.randint(0, 2**31, (1,), generator=rng)))
    prompts = [[prng.randrange(3, 500) for _ in range(prng.randint(2, 40))] for _ in range(3)]
    k = prng.randint(0, 5)
    body = {"model": NAME, "prompt": prompts, "max_tokens": 0, "echo": True, "logprobs": k, "temperature": 0}
    resp = c.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert out["usage"]["completion_tokens"] == 0
    assert out["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)
    streamed = c.post("/v1/completions", json={**body, "stream": True})
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    for choice, prompt in zip(out["choices"], prompts):
        assert choice["token_ids"] == [] and choice["finish_reason"] == "length"
        lp = choice["logprobs"]
        assert lp["tokens"] == [f"token_id:{t}" for t in prompt]  # the prompt only: nothing generated
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        ref = reference_logprobs(prompt)
        for p in range(1, len(prompt)):
            assert abs(lp["token_logprobs"][p] - float(ref[p - 1, prompt[p]])) <= 1e-4
            top = lp["top_logprobs"][p]
            assert len(top) in (k, k + 1)  # the k best, and the prompt's own token when it is not among them
            for key, value in top.items():
                assert abs(value - float(ref[p - 1, int(key.split(":")[1])])) <= 1e-4
        mine = [ch for ch in chunks if ch["choices"] and ch["choices"][0]["index"] == choice["index"]]
        assert sum(len(ch["choices"][0]["token_ids"]) for ch in mine) == 0
        assert [x for ch in mine if ch["choices"][0]["logprobs"] for x in ch["choices"][0]["logprobs"]["tokens"]] == (
            lp["tokens"]
        )


def test_max_tokens_0_needs_echo(h):
    refused(h.post("/v1/completions", json=completion(max_tokens=0)), "max_tokens")
    refused(h.post("/v1/completions", json=completion(max_tokens=0, echo=True, min_tokens=1)), "min_tokens")
    refused(h.post("/v1/chat/completions", json=chat(max_tokens=0)), "max_tokens")  # chat has no echo
    resp = h.post("/v1/completions", json=completion(max_tokens=0, echo=True))  # echo alone: the prompt back
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == "the cat"


# ------------------------------------------------------------------------------------------ a real model


@pytest.fixture(scope="module")
def smol():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import real_model

    why = real_model.why_unavailable()
    if why is not None:
        pytest.skip(why)
    model, tok = load_model(str(real_model.model_dir()))
    engine = LLMEngine(model, tok, kv_budget_bytes=64 << 20, max_model_len=2048)
    with ServerThread(engine, model_name=NAME) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        yield c


def test_smollm2_gets_the_tools_and_legacy_functions_answer_in_the_legacy_shape(smol):
    """SmolLM2's template ignores tools: 37 prompt tokens with and without them before."""
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
    counts = [
        smol.post("/tokenize", json={"model": NAME, "messages": messages, **extra}).json()["count"]
        for extra in ({}, {"tools": [WEATHER]})
    ]
    assert counts[1] > counts[0] + 50  # the block and the tool's schema
    pytest.importorskip("xgrammar")
    body = {
        "model": NAME,
        "messages": messages,
        "max_tokens": 48,
        "temperature": 0,
        "functions": [WEATHER["function"]],
        "function_call": {"name": "get_weather"},
    }
    resp = smol.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["prompt_tokens"] == counts[1]
    choice = resp.json()["choices"][0]
    message = choice["message"]
    assert "tool_calls" not in message and message["function_call"]["name"] == "get_weather"
    assert choice["finish_reason"] == "function_call", choice
    args = json.loads(message["function_call"]["arguments"])
    assert set(args) == {"city"} and isinstance(args["city"], str)
    # the same as tools answers in today's shape, with the same arguments
    tools_body = {**body, "functions": None, "function_call": None}
    del tools_body["functions"], tools_body["function_call"]
    tools_body.update(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    current = smol.post("/v1/chat/completions", json=tools_body).json()["choices"][0]
    assert current["finish_reason"] == "tool_calls"
    assert current["message"]["tool_calls"][0]["function"]["arguments"] == message["function_call"]["arguments"]
