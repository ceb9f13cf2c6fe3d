"""Structured output (vpaged/serve/sample/structured.py, xgrammar): on the real SmolLM2-135M-Instruct, 20 chat requests
with a Pydantic schema as response_format all parse and validate (sampled, in one batch); any-JSON, regex and
choice grammars hold for LLM.generate; and on the tiny server, bad schemas and several grammar fields are 400s
naming the field. Skipped with the reason when xgrammar or the model is missing."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("xgrammar", reason="structured output needs xgrammar: pip install 'vpaged[structured]'")
pydantic = pytest.importorskip("pydantic")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import real_model  # noqa: E402

from vpaged.serve import LLM, SamplingParams  # noqa: E402
from vpaged.serve.sample.structured import GrammarSpec  # noqa: E402

pytestmark = pytest.mark.serving  # skipped where transformers cannot serve (tests/conftest.py)
WHY = real_model.why_unavailable()
PLACES = (
    "Paris Lima Oslo Cairo Tokyo Quito Rome Accra Hanoi Perth Dakar Lagos Seoul Kyiv Riga Baku Doha Sofia Bern Nice"
)


class City(pydantic.BaseModel):
    # Bounded fields: a sampled 135M model otherwise fills an unbounded integer with digits until max_tokens.
    name: str = pydantic.Field(max_length=16)
    country: str = pydantic.Field(max_length=16)
    population_millions: int = pydantic.Field(ge=0, le=999)
    coastal: bool


@pytest.fixture(scope="module")
def smol():
    if WHY is not None:
        pytest.skip(WHY)
    before = torch.get_num_threads()
    torch.set_num_threads(min(2, before))
    llm = LLM(str(real_model.model_dir()), kv_budget_bytes=128 << 20)
    yield llm
    torch.set_num_threads(before)
    llm.engine.close()


def chat_prompt(tok, text: str) -> str:
    return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)


def test_twenty_pydantic_outputs_parse_and_validate(smol):
    tok = smol.engine.tokenizer
    spec = GrammarSpec.json_schema(City.model_json_schema())
    places = (
        "Paris Lima Oslo Cairo Tokyo Quito Rome Accra Hanoi Perth Dakar Lagos Seoul Kyiv Riga Baku Doha Sofia Bern Nice"
    )
    prompts = [chat_prompt(tok, f"Describe the city {p} as JSON.") for p in places.split()]
    params = [SamplingParams(max_tokens=96, temperature=0.7, seed=i, structured=spec) for i in range(len(prompts))]
    outs = smol.generate(prompts, params)
    for out in outs:
        assert out.finish_reason == "stop", out.text  # the grammar ended it, within max_tokens
        City.model_validate_json(out.text)  # raises on any output that does not validate


def test_json_regex_and_choice_grammars(smol):
    tok = smol.engine.tokenizer
    prompt = chat_prompt(tok, "Give me a code and an answer.")
    cases = [
        (GrammarSpec("json"), lambda t: isinstance(json.loads(t), dict)),
        (GrammarSpec("regex", r"[A-Z]{3}-[0-9]{2}"), lambda t: re.fullmatch(r"[A-Z]{3}-[0-9]{2}", t)),
        (GrammarSpec.choice(["yes", "no", "maybe"]), lambda t: t in ("yes", "no", "maybe")),
    ]
    outs = smol.generate(
        [prompt] * len(cases), [SamplingParams(max_tokens=48, temperature=0.0, structured=s) for s, _ in cases]
    )
    for (spec, ok), out in zip(cases, outs):
        if spec.kind == "json" and out.finish_reason == "length":
            # The grammar bounds the form, not the length: a 135M model may write one long key. What it
            # wrote is then the start of an object (xgrammar's builtin grammar let it answer `[1]`).
            assert out.text.startswith("{"), out.text
            continue
        assert out.finish_reason == "stop" and ok(out.text), (spec, out.text)
    # a request without a grammar in the same engine is not constrained (and unchanged by the others)
    alone = smol.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0))[0]
    mixed = smol.generate(
        [prompt, prompt],
        [SamplingParams(max_tokens=8, temperature=0.0), SamplingParams(max_tokens=8, structured=cases[0][0])],
    )
    assert mixed[0].token_ids == alone.token_ids


def test_a_schema_that_cannot_compile_is_refused(smol):
    from vpaged.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="cannot be compiled"):
        smol.engine.add_request("x", SamplingParams(structured=GrammarSpec.json_schema({"type": "bogus"})))
    assert not smol.engine.has_unfinished()


def schema_answer(client, content: str, schema: type[pydantic.BaseModel], seed: int, max_tokens: int):
    """One sampled chat answer of model "smol" under a strict json_schema response_format of `schema`."""
    return client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": content}],
        max_tokens=max_tokens,
        temperature=0.7,
        seed=seed,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": schema.__name__, "schema": schema.model_json_schema(), "strict": True},
        },
    )


class Weather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=16)
    unit: str = pydantic.Field(pattern="^(celsius|fahrenheit)$")


def test_server_structured_output_and_required_tool_calls_validate(smol):
    """The openai client against the server: response_format json_schema from a Pydantic model, and tools
    with tool_choice "required" / a named function, 20 prompts each: every output parses and validates."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    openai = pytest.importorskip("openai")
    from concurrent.futures import ThreadPoolExecutor

    from vpaged.serve.http.server import ServerThread

    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "weather of a city",
            "parameters": Weather.model_json_schema(),
        },
    }
    cities = PLACES.split()

    def structured(client, i):
        return schema_answer(client, f"Describe {cities[i]} as JSON.", City, seed=i, max_tokens=96)

    def required(client, i):
        choice = "required" if i % 2 else {"type": "function", "function": {"name": "get_weather"}}
        return client.chat.completions.create(
            model="smol",
            messages=[{"role": "user", "content": f"What is the weather in {cities[i]}?"}],
            max_tokens=64,
            temperature=0.8,
            seed=i,
            tools=[tool],
            tool_choice=choice,
        )

    with ServerThread(smol.engine, model_name="smol") as srv:

        def batch(ask):
            # All 20 in flight at once: one batch in the engine. A client per batch: a connection idle past the
            # server's keep_alive_s while the batch's slowest request ran is closed by the server, and a reuse
            # racing that close is a reset that retries (off here) would hide.
            with openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=600) as client:
                with ThreadPoolExecutor(20) as pool:
                    return list(pool.map(lambda i: ask(client, i), range(20)))

        answers = batch(structured)
        calls = batch(required)
    for a in answers:
        City.model_validate_json(a.choices[0].message.content)
    for c in calls:
        msg = c.choices[0]
        assert msg.finish_reason == "tool_calls", msg
        assert msg.message.tool_calls and all(t.function.name == "get_weather" for t in msg.message.tool_calls)
        for t in msg.message.tool_calls:
            Weather.model_validate_json(t.function.arguments)


class Verdict(pydantic.BaseModel):
    # Not in alphabetical order: the reasoning is written before the answer it leads to.
    reasoning: str = pydantic.Field(max_length=24)
    answer: int = pydantic.Field(ge=0, le=99)
    sure: bool


class Addr(pydantic.BaseModel):
    street: str = pydantic.Field(max_length=16)
    city: str = pydantic.Field(max_length=16)


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=16)
    home: Addr  # a local "$ref": "#/$defs/Addr" in the tool's parameters


def test_real_model_keeps_schema_key_order_and_required_tools_with_defs_validate(smol):
    """On SmolLM2 through the server: json_schema answers keep the schema's key order (they came back
    alphabetical), a Pydantic tool with $defs under tool_choice "required" is served (it was a 400) and its
    arguments validate; in the engine, the required call writes its name before its arguments."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    openai = pytest.importorskip("openai")
    from concurrent.futures import ThreadPoolExecutor

    from vpaged.serve.http import tools
    from vpaged.serve.http.server import ServerThread

    tool = {"type": "function", "function": {"name": "add_person", "parameters": Person.model_json_schema()}}
    cities = PLACES.split()[:4]
    with ServerThread(smol.engine, model_name="smol") as srv:
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=600) as client:

            def verdict(i):
                text = f"How many letters has {cities[i]}? Reason, then answer."
                return schema_answer(client, text, Verdict, seed=i, max_tokens=64)

            def person(i):
                return client.chat.completions.create(
                    model="smol",
                    messages=[{"role": "user", "content": f"Add Ann, who lives on Main Street in {cities[i]}."}],
                    max_tokens=64,
                    temperature=0.7,
                    seed=i,
                    tools=[tool],
                    tool_choice="required",
                )

            with ThreadPoolExecutor(8) as pool:  # all in flight at once: one batch in the engine
                answers = [pool.submit(verdict, i) for i in range(len(cities))]
                calls = [pool.submit(person, i) for i in range(len(cities))]
                answers, calls = [a.result() for a in answers], [c.result() for c in calls]
    for answer in answers:
        text = answer.choices[0].message.content
        assert [k for k, _ in json.loads(text, object_pairs_hook=list)] == ["reasoning", "answer", "sure"], text
        Verdict.model_validate_json(text)
    for call in calls:
        choice = call.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (made,) = choice.message.tool_calls
        assert made.function.name == "add_person"
        Person.model_validate_json(made.function.arguments)
    spec = tools.grammar("required", tools.functions([tool]))
    prompt = chat_prompt(smol.engine.tokenizer, "Add Bob, who lives on High Street in Oslo.")
    out = smol.generate([prompt], SamplingParams(max_tokens=64, temperature=0.0, structured=spec))[0]
    assert out.finish_reason == "stop" and out.text.startswith('[{"name": "add_person", "arguments": {'), out.text
