"""A request whose constraints leave no token to draw never samples from an all -inf / NaN row.

The sampler gives such a row NO_TOKEN (partly NaN rows draw from their other tokens, +inf rows among their
+inf tokens) and every other row of the batch draws what it draws alone; repetition_penalty outside [0.01, 100]
is refused and a temperature below 1e-5 is greedy (1e-300 made NaN rows). In the engine (a random-weight model
with a word tokenizer), a grammar whose first tokens bad_words ban is refused when added
(NoAllowedTokenError); one that runs out later (guided_choice "catdog" with bad_words ["dog"], min_tokens past
a finished grammar) ends with finish_reason "error" and the tokens before it, while the other requests of the
batch come out as they do alone. Through the server: 400 up front, 400 when found before a non-streamed answer,
an error event the openai client raises on in a stream; never 200 with text outside the grammar."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("xgrammar", reason="structured output needs xgrammar: pip install 'vpaged[structured]'")

from serve_helpers import save_model_with_tokenizer  # noqa: E402

from vpaged.errors import InvalidArgumentError, NoAllowedTokenError  # noqa: E402
from vpaged.serve import SamplingParams  # noqa: E402
from vpaged.serve.sample.sampler import NO_TOKEN, apply_controls, sample  # noqa: E402
from vpaged.serve.sample.structured import GrammarSpec  # noqa: E402

NEG, NAN, INF = float("-inf"), float("nan"), float("inf")
VOCAB = 64
TIMEOUT = 120


def row_params(rng: torch.Generator, r: int) -> tuple[SamplingParams, torch.Generator | None]:
    if r % 2 == 0:
        return SamplingParams(temperature=0.0), None
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    top_k = int(torch.randint(-1, 5, (1,), generator=rng)) or -1
    return SamplingParams(temperature=0.8, top_k=top_k, top_p=0.9, seed=seed), torch.Generator().manual_seed(seed)


def test_dead_rows_get_no_token_and_the_others_draw_as_alone(rng):
    for _ in range(20):
        rows = int(torch.randint(3, 10, (1,), generator=rng))
        logits = torch.randn(rows, VOCAB, generator=rng) * 3
        kinds = torch.randint(0, 5, (rows,), generator=rng).tolist()  # 0, 1 plain; 2 dead; 3 part NaN; 4 +inf
        allowed_rows, masks = [], []
        for r, kind in enumerate(kinds):
            some = torch.rand(VOCAB, generator=rng) < 0.3
            if kind == 2:  # no token left: a mask that allows nothing, or NaN and -inf everywhere
                if r % 2:
                    allowed_rows.append(r)
                    masks.append(torch.zeros(VOCAB, dtype=torch.bool))
                else:
                    logits[r] = torch.where(some, NAN, NEG)
            elif kind == 3:
                logits[r, some] = NAN
            elif kind == 4:
                logits[r, some] = INF
                some[0] = True
                logits[r, 0] = INF
        allowed = (allowed_rows, torch.stack(masks)) if masks else None
        specs = [row_params(rng, r) for r in range(rows)]
        params, seeds = [p for p, _ in specs], [p.seed for p, _ in specs]
        gens = [g for _, g in specs]
        got = sample(logits.clone(), params, gens, allowed=allowed)
        for r, kind in enumerate(kinds):
            if kind == 2:
                assert got[r] == NO_TOKEN, (r, got)
                continue
            row = logits[r : r + 1].clone()
            if kind == 3:
                row = row.nan_to_num(nan=NEG, posinf=INF, neginf=NEG)
                assert not torch.isnan(logits[r, got[r]])
            if kind == 4:
                assert logits[r, got[r]] == INF  # +inf: only those tokens, whatever the temperature
                continue
            if params[r].greedy:
                assert got[r] == int(row[0].argmax())
            else:  # the same draw as the row alone, from a generator seeded alike
                alone = sample(row, [params[r]], [torch.Generator().manual_seed(seeds[r])])
                assert got[r] == alone[0], (r, kind)


@pytest.mark.parametrize("bad", [1e-300, 0.0, 0.009, 100.5, -1.0, NAN, INF, True])
def test_repetition_penalty_outside_its_range_is_refused(bad):
    with pytest.raises(InvalidArgumentError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=bad)


def test_extreme_valid_penalties_and_tiny_temperatures_keep_rows_finite(rng):
    logits = torch.randn(4, VOCAB, generator=rng) * 10
    history = [(list(range(VOCAB)), 1)] * 4  # every token seen: the penalty scales the whole row
    for penalty in (0.01, 100.0):
        params = [SamplingParams(repetition_penalty=penalty)] * 4
        assert torch.isfinite(apply_controls(logits, params, history, ())).all()
    tiny = SamplingParams(temperature=1e-300, seed=1)
    assert tiny.greedy  # logits / 1e-300 are inf and NaN in float32: such a temperature decodes greedily
    assert sample(logits, [tiny] * 4, [None] * 4) == logits.argmax(dim=-1).tolist()


# ------------------------------------------------------------------------------------------ the engine
@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from vpaged.serve import LLMEngine, load_model

    path = tmp_path_factory.mktemp("tiny-llama-words")
    save_model_with_tokenizer(path)
    model, tok = load_model(str(path), dtype=torch.float32)
    eng = LLMEngine(model, tok, kv_budget_bytes=16 << 20, max_num_seqs=16, max_num_batched_tokens=64, max_model_len=256)
    yield eng
    eng.close()


def run(engine, requests: list[tuple[list[int], SamplingParams]]) -> list:
    """Add every request (one batch), step until all finish; their final outputs in order."""
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return [final[i] for i in ids]


def words(engine, text: str) -> list[int]:
    return engine.tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize(
    "kw",
    [
        dict(structured=GrammarSpec.choice(["cat"]), bad_words=["cat"]),
        dict(structured=GrammarSpec("regex", "(cat|dog)+"), bad_words=["cat", "dog"]),
        dict(structured=GrammarSpec.choice(["cat", "dog"]), bad_words_token_ids=[[26], [27]]),
    ],
)
@pytest.mark.serving
def test_a_grammar_whose_first_tokens_are_banned_is_refused_when_added(engine, kw):
    assert words(engine, "cat dog") == [26, 27]  # the word tokenizer of serve_helpers: one token each
    with pytest.raises(NoAllowedTokenError, match="ban every token the (choice|regex) grammar allows"):
        engine.add_request(words(engine, "the cat"), SamplingParams(max_tokens=8, **kw))
    assert not engine.has_unfinished()


@pytest.mark.serving
def test_a_grammar_that_runs_out_later_ends_with_error_and_the_batch_is_unaffected(engine, rng):
    prompt = words(engine, "the small cat sees a dog")
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    others = [
        (prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)),
        (words(engine, "a bird"), SamplingParams(max_tokens=12, temperature=0.9, seed=seed, ignore_eos=True)),
        (prompt, SamplingParams(max_tokens=8, temperature=0.7, seed=seed, structured=GrammarSpec.choice(["catdog"]))),
    ]
    failing = [
        # after "cat" the grammar allows only "dog", which bad_words ban (with logprobs and n=2: forked rows)
        (prompt, SamplingParams(max_tokens=8, structured=GrammarSpec.choice(["catdog"]), bad_words=["dog"])),
        (
            prompt,
            SamplingParams(
                max_tokens=8, n=2, logprobs=2, seed=seed, structured=GrammarSpec("regex", "catdog"), bad_words=["dog"]
            ),
        ),
        # after "cat" the grammar is done and allows only EOS, which min_tokens holds back
        (prompt, SamplingParams(max_tokens=8, min_tokens=3, structured=GrammarSpec.choice(["cat"]))),
    ]
    alone = [run(engine, [r])[0] for r in others]
    mixed = run(engine, failing[:1] + others[:2] + failing[1:] + others[2:])
    bad, good = [mixed[0], mixed[3], mixed[4]], [mixed[1], mixed[2], mixed[5]]
    for out in bad:
        assert out.finished and [c.finish_reason for c in out.outputs] == ["error"] * len(out.outputs), out
        for c in out.outputs:
            assert c.token_ids == [26] and c.text == "cat"  # what came before the dead end, nothing after
            assert c.logprobs is None or len(c.logprobs) == len(c.token_ids)
    assert len(bad[1].outputs) == 2
    for got, ref in zip(good, alone):
        assert got.token_ids == ref.token_ids and got.finish_reason == ref.finish_reason
    assert good[2].text == "cat dog"  # the word tokenizer decodes with spaces between words
    assert not engine.has_unfinished()


# ------------------------------------------------------------------------------------------ the server
@pytest.fixture(scope="module")
def server(engine):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    httpx = pytest.importorskip("httpx")
    from vpaged.serve.http.server import ServerThread

    with ServerThread(engine, model_name="tiny") as srv, httpx.Client(base_url=srv.url, timeout=TIMEOUT) as client:
        yield srv, client


def completion(client, **body):
    return client.post("/v1/completions", json={"model": "tiny", "prompt": "the small cat", "max_tokens": 8, **body})


def test_server_refuses_impossible_requests_with_400_never_200(server):
    _, client = server
    plain = completion(client, temperature=0.0, ignore_eos=True)
    assert plain.status_code == 200
    up_front = completion(client, guided_choice=["cat"], bad_words=["cat"])
    assert up_front.status_code == 400, up_front.text
    error = up_front.json()["error"]
    assert error["param"] == "bad_words" and error["code"] == "NoAllowedTokenError", error
    later = completion(client, guided_choice=["catdog"], bad_words=["dog"])
    assert later.status_code == 400, later.text
    assert "no token is left that the request allows after 1 generated tokens" in later.json()["error"]["message"]
    chat = client.post(
        "/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "the cat"}],
            "max_tokens": 8,
            "guided_regex": "catdog",
            "bad_words": ["dog"],
        },
    )
    assert chat.status_code == 400 and chat.json()["error"]["code"] == "NoAllowedTokenError", chat.text
    penalty = completion(client, repetition_penalty=1e-300)
    assert penalty.status_code == 400 and penalty.json()["error"]["param"] == "repetition_penalty", penalty.text
    # the server goes on serving, and the same request answers as before
    again = completion(client, temperature=0.0, ignore_eos=True)
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]


def test_a_stream_that_runs_out_ends_with_an_error_event_the_client_raises(server):
    srv, client = server
    with client.stream(
        "POST",
        "/v1/completions",
        json={
            "model": "tiny",
            "prompt": "the cat",
            "max_tokens": 8,
            "stream": True,
            "guided_choice": ["catdog"],
            "bad_words": ["dog"],
        },
    ) as response:
        assert response.status_code == 200
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    assert "".join(c["text"] for e in events[:-1] for c in e["choices"]) == "cat"
    assert events[-1]["error"]["code"] == "NoAllowedTokenError", events[-1]
    assert all(c["finish_reason"] is None for e in events[:-1] for c in e["choices"])  # no "stop", no "length"
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT) as oai:
        with pytest.raises(openai.APIError, match="no token is left"):
            stream = oai.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "the cat"}],
                max_tokens=8,
                stream=True,
                extra_body={"guided_choice": ["catdog"], "bad_words": ["dog"]},
            )
            for _ in stream:
                pass
