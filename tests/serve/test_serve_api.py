"""The OpenAI API fields evaluation and agent clients send, end to end on 127.0.0.1: logprobs and top_logprobs
(chat and completions, streamed and not) against log_softmax of a transformers forward, echo + logprobs in the
shape lm-eval's loglikelihood reads, penalties and logit_bias as request fields, GET /v1/models/{id},
/tokenize and /detokenize, usage.prompt_tokens_details.cached_tokens, and 400s that name the field.

A tiny random-weight fp32 model with a word-level tokenizer (serve_helpers); the official openai client where
it has the field, httpx for the rest."""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from serve_helpers import save_model_with_tokenizer  # noqa: E402

from vpaged.serve import LLMEngine, load_model  # noqa: E402
from vpaged.serve.http.server import ServerThread  # noqa: E402

pytestmark = pytest.mark.serving  # skipped where transformers cannot serve (tests/conftest.py)

NAME = "tiny"
MAX_MODEL_LEN = 256
TIMEOUT = 120
TOL = 1e-4


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-api")
    save_model_with_tokenizer(path)
    model, tok = load_model(str(path), dtype=torch.float32)
    engine = LLMEngine(
        model,
        tok,
        kv_budget_bytes=16 << 20,
        page_size=4096,  # 32 tokens a page: prompts of the tests fill pages of the prefix cache
        max_num_seqs=8,
        max_num_batched_tokens=48,
        max_model_len=MAX_MODEL_LEN,
    )
    ref, _ = load_model(str(path), dtype=torch.float32)
    ref.set_attn_implementation("sdpa")
    with ServerThread(engine, model_name=NAME) as srv:
        with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as h:
            yield srv, engine, ref, tok, h


@pytest.fixture
def client(served):
    with openai.OpenAI(base_url=served[0].url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT) as c:
        yield c


@torch.no_grad()
def ref_logprobs(ref, tokens: list[int]) -> torch.Tensor:
    return ref(input_ids=torch.tensor([tokens])).logits[0].float().log_softmax(dim=-1)


def words(tok, prng, n) -> str:
    return " ".join(tok.convert_ids_to_tokens([prng.randrange(11, 300) for _ in range(n)]))


def sse_events(resp) -> list[dict]:
    out = []
    for line in resp.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


def test_echo_logprobs_give_lm_eval_loglikelihoods(served, prng):
    """lm-eval's loglikelihood request (logprobs 1, echo, max_tokens 1, temperature 0) on a batch of context +
    continuation prompts: the continuation's summed logprob and is_greedy as a transformers forward gives."""
    srv, engine, ref, tok, h = served
    contexts = [words(tok, prng, prng.randint(3, 30)) for _ in range(4)]
    continuations = [" " + words(tok, prng, prng.randint(1, 4)) for _ in contexts]
    prompts = [tok.encode(c) + tok.encode(x, add_special_tokens=False) for c, x in zip(contexts, continuations)]
    body = {"model": NAME, "prompt": prompts, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True, "seed": 1}
    resp = h.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    choices = resp.json()["choices"]
    for ctx, prompt, choice in zip(contexts, prompts, choices):
        lp = choice["logprobs"]
        ctxlen = len(tok.encode(ctx))
        assert len(lp["tokens"]) == len(prompt) + 1 == len(lp["token_logprobs"]) == len(lp["top_logprobs"])
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["tokens"][: len(prompt)] == [tok.decode([t]) for t in prompt]
        ref_lp = ref_logprobs(ref, prompt + choice["token_ids"])
        want = sum(float(ref_lp[p - 1, prompt[p]]) for p in range(ctxlen, len(prompt)))
        got = sum(lp["token_logprobs"][ctxlen:-1])  # lm-eval's slice: the continuation, not the generated token
        assert abs(got - want) <= 1e-3
        for p in range(1, len(prompt) + 1):
            token = (prompt + choice["token_ids"])[p]
            assert abs(lp["token_logprobs"][p] - float(ref_lp[p - 1, token])) <= TOL
            top = lp["top_logprobs"][p]
            best = int(ref_lp[p - 1].argmax())
            assert abs(top[tok.decode([best])] - float(ref_lp[p - 1, best])) <= TOL
        want_greedy = all(int(ref_lp[p - 1].argmax()) == prompt[p] for p in range(ctxlen, len(prompt)))
        got_greedy = all(
            max(top, key=top.get) == tok_s for top, tok_s in zip(lp["top_logprobs"][ctxlen:-1], lp["tokens"][ctxlen:-1])
        )
        assert got_greedy == want_greedy
        assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
        assert choice["text"].startswith(tok.decode(prompt))


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_chat_and_completion_logprobs_streamed_and_not(served, client, prng, temperature):
    srv, engine, ref, tok, h = served
    messages = [{"role": "user", "content": words(tok, prng, 6)}]
    kw = dict(model=NAME, max_tokens=6, temperature=temperature, seed=prng.randrange(1 << 30))
    full = client.chat.completions.create(messages=messages, logprobs=True, top_logprobs=3, **kw)
    streamed = []
    for chunk in client.chat.completions.create(messages=messages, logprobs=True, top_logprobs=3, stream=True, **kw):
        for c in chunk.choices:
            if c.logprobs is not None:
                streamed += c.logprobs.content
    content = full.choices[0].logprobs.content
    ids = full.choices[0].model_extra["token_ids"]
    assert len(content) == len(ids) == len(streamed)
    prompt = tok.encode(
        tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False
    )
    ref_lp = ref_logprobs(ref, prompt + ids)
    for j, (a, b) in enumerate(zip(content, streamed)):
        row = ref_lp[len(prompt) + j - 1]
        assert a.token == b.token == tok.decode([ids[j]])
        assert a.bytes == list(a.token.encode())
        assert abs(a.logprob - float(row[ids[j]])) <= TOL and abs(a.logprob - b.logprob) <= TOL
        assert len(a.top_logprobs) == 3
        assert [x.token for x in a.top_logprobs] == [tok.decode([i]) for i in row.topk(3).indices.tolist()]
    # completions: logprobs 0 is the chosen token's logprob alone, not null
    comp = client.completions.create(prompt=ids[:3] or [5], logprobs=0, **kw)
    lp = comp.choices[0].logprobs
    assert lp is not None and len(lp.token_logprobs) == len(comp.choices[0].model_extra["token_ids"])
    assert all(len(t) == 1 for t in lp.top_logprobs)
    chunks = list(client.completions.create(prompt=ids[:3] or [5], logprobs=2, stream=True, **kw))
    got = [x for c in chunks for ch in c.choices if ch.logprobs for x in ch.logprobs.token_logprobs]
    assert len(got) == len(lp.token_logprobs)


def test_requests_without_logprobs_get_null(served, client):
    out = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "the cat"}], max_tokens=2)
    assert out.choices[0].logprobs is None
    comp = client.completions.create(model=NAME, prompt="the dog", max_tokens=2)
    assert comp.choices[0].logprobs is None


def test_penalties_and_logit_bias_are_honoured(served, client):
    srv, engine, ref, tok, h = served
    base = dict(model=NAME, prompt="the cat sees", max_tokens=6, temperature=0)
    plain = client.completions.create(**base).choices[0].model_extra["token_ids"]
    forced = client.completions.create(**base, logit_bias={"42": 100}).choices[0].model_extra["token_ids"]
    assert forced == [42] * len(forced) and len(forced) == 6
    banned = client.completions.create(**base, logit_bias={str(t): -100 for t in set(plain)})
    assert not set(banned.choices[0].model_extra["token_ids"]) & set(plain)
    # a frequency penalty of 2 against a +100-biased token still cannot overcome the bias; presence likewise
    pen = client.completions.create(**base, frequency_penalty=2.0, presence_penalty=2.0, extra_body={"min_tokens": 2})
    assert len(pen.choices[0].model_extra["token_ids"]) >= 2
    rep = client.completions.create(**base, extra_body={"repetition_penalty": 1.3})
    assert rep.choices[0].finish_reason in ("stop", "length")


def test_bad_words_are_kept_out_of_the_output(served, client):
    srv, engine, ref, tok, h = served
    base = dict(model=NAME, prompt="the cat sees", max_tokens=6, temperature=0)
    plain = client.completions.create(**base).choices[0].model_extra["token_ids"]
    words = tok.convert_ids_to_tokens(sorted(set(plain)))
    out = client.completions.create(**base, extra_body={"bad_words": words}).choices[0].model_extra["token_ids"]
    assert len(out) == 6 and not set(out) & set(plain)
    chat = dict(model=NAME, messages=[{"role": "user", "content": "the cat"}], max_tokens=4, temperature=0)
    said = client.chat.completions.create(**chat).choices[0].message.content.split()
    again = client.chat.completions.create(**chat, extra_body={"bad_words": said[:1]})
    assert said[0] not in again.choices[0].message.content.split()


def test_model_retrieve_tokenize_and_detokenize(served, client):
    srv, engine, ref, tok, h = served
    card = client.models.retrieve(NAME)
    assert card.id == NAME and card.model_extra["max_model_len"] == MAX_MODEL_LEN
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")
    r = h.post("/tokenize", json={"model": NAME, "prompt": "the cat runs", "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode("the cat runs") and r["count"] == len(r["tokens"])
    assert r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"]) and r["max_model_len"] == MAX_MODEL_LEN
    chat = h.post("/tokenize", json={"messages": [{"role": "user", "content": "the dog"}]}).json()
    text = tok.apply_chat_template([{"role": "user", "content": "the dog"}], tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == tok.encode(text, add_special_tokens=False)
    assert h.post("/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == tok.decode(r["tokens"])
    for path, body, param in [
        ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ]:
        resp = h.post(path, json=body)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, (path, body, resp.text)


def test_usage_reports_cached_prompt_tokens(served, client, prng):
    srv, engine, ref, tok, h = served
    prompt = [prng.randrange(11, 300) for _ in range(120)]  # longer than a page of the prefix cache
    first = client.completions.create(model=NAME, prompt=prompt, max_tokens=1)
    again = client.completions.create(model=NAME, prompt=prompt, max_tokens=1)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < len(prompt)
    chunks = list(
        client.completions.create(
            model=NAME, prompt=prompt, max_tokens=1, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached


CHAT = {"model": NAME, "messages": [{"role": "user", "content": "the cat"}], "max_tokens": 2}
COMP = {"model": NAME, "prompt": "the cat", "max_tokens": 2}


@pytest.mark.parametrize(
    "path, extra, param",
    [
        ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"temperature": -1}, "temperature"),
        ("/v1/chat/completions", {"max_completion_tokens": 0}, "max_completion_tokens"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": 1}, "logprobs"),
        ("/v1/completions", {"logprobs": -1}, "logprobs"),
        ("/v1/completions", {"logprobs": True}, "logprobs"),
        ("/v1/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/completions", {"presence_penalty": 2.5}, "presence_penalty"),
        ("/v1/completions", {"frequency_penalty": "1"}, "frequency_penalty"),
        ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty"),
        ("/v1/completions", {"min_tokens": -1}, "min_tokens"),
        ("/v1/completions", {"min_tokens": 5}, "min_tokens"),
        ("/v1/completions", {"logit_bias": {"x": 1}}, "logit_bias"),
        ("/v1/completions", {"logit_bias": {"1": 200}}, "logit_bias"),
        ("/v1/completions", {"logit_bias": {"99999999": 1}}, "logit_bias"),
        ("/v1/completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
        ("/v1/completions", {"bad_words": "cat"}, "bad_words"),
        ("/v1/completions", {"bad_words": [3]}, "bad_words"),
        ("/v1/completions", {"bad_words": [" "]}, "bad_words"),
        ("/v1/chat/completions", {"bad_words": ["x" * 300]}, "bad_words"),
        ("/v1/chat/completions", {"bad_words": ["cat"] * 65}, "bad_words"),
    ],
)
def test_bad_values_get_a_400_naming_the_field(served, path, extra, param):
    h = served[4]
    resp = h.post(path, json={**(COMP if path == "/v1/completions" else CHAT), **extra})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param, err


def test_an_image_part_is_refused_as_such(served):
    h = served[4]
    msg = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}
    resp = h.post("/v1/chat/completions", json={**CHAT, "messages": [msg]})
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert "image_url" in err["message"] and "template" not in err["message"] and err["param"] == "messages"


def test_logprob_values_are_finite_json(served):
    h = served[4]
    resp = h.post("/v1/completions", json={**COMP, "logprobs": 20, "echo": True, "logit_bias": {"7": -100}})
    assert resp.status_code == 200
    lp = resp.json()["choices"][0]["logprobs"]
    assert all(x is None or math.isfinite(x) for x in lp["token_logprobs"])


def test_streamed_echo_with_logprobs_equals_the_whole_answer(served, prng):
    srv, engine, ref, tok, h = served
    prompt = [prng.randrange(11, 300) for _ in range(prng.randint(2, 20))]
    body = {"model": NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 2, "echo": True}
    whole = h.post("/v1/completions", json=body).json()["choices"][0]
    with h.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
        events = sse_events(resp)
    text = "".join(c["text"] for e in events for c in e["choices"])
    merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in events:
        for c in e["choices"]:
            for key in merged:
                merged[key] += (c["logprobs"] or {}).get(key, [])
    assert text == whole["text"]
    assert merged["tokens"] == whole["logprobs"]["tokens"]
    assert merged["text_offset"] == whole["logprobs"]["text_offset"]
    for a, b in zip(merged["token_logprobs"], whole["logprobs"]["token_logprobs"]):
        assert (a is None and b is None) or abs(a - b) <= TOL
