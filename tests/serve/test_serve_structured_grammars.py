"""Grammars of structured output (vpaged/serve/sample/structured.py, http/tools.py) walked by a random "model": random
logits through the real batched sampler under each step's grammar mask, on SmolLM2's tokenizer (no weights).
JSON objects come out in the schema's key order (a shuffled one each run) and a required tool call writes its
name before its arguments; Pydantic tools with local $defs / $ref and a tool whose parameters refer to
themselves ("$ref": "#") compile under tool_choice "required" and their outputs validate against the tool's own
schema; compile errors say what is wrong without xgrammar's log time stamp and source paths; a grammar that
ended under ignore_eos allows its stop tokens. Skipped with the reason when xgrammar or the tokenizer is missing."""

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

from vpaged.errors import InvalidArgumentError  # noqa: E402
from vpaged.serve import SamplingParams  # noqa: E402
from vpaged.serve.http import tools  # noqa: E402
from vpaged.serve.sample.sampler import sample  # noqa: E402
from vpaged.serve.sample.structured import Grammars, GrammarSpec, compile_error_text, relocate_refs  # noqa: E402

WHY = real_model.why_unavailable()
NAMES = ["reasoning", "answer", "zeta", "confidence", "mid", "alpha", "verdict"]


@pytest.fixture(scope="module")
def grammars():
    if WHY is not None:
        pytest.skip(WHY)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(real_model.model_dir()))
    return Grammars(tok, len(tok), [tok.eos_token_id])


def walk(grammars: Grammars, spec: GrammarSpec, gen: torch.Generator, max_tokens: int = 600) -> str:
    """The text a random model writes under spec: each step, fresh random logits sampled (temperature 1) by
    the engine's sampler with the grammar's mask, until it draws a stop token."""
    matcher = grammars.matcher(spec, [])
    params, out = [SamplingParams(temperature=1.0)], []
    for _ in range(max_tokens):
        logits = torch.randn(1, grammars.vocab_size, generator=gen) * 4
        token = sample(logits, params, [gen], allowed=([0], grammars.allowed([matcher])))[0]
        if token in grammars.stop_token_ids:
            return grammars.tokenizer.decode(out)
        assert matcher.accept_token(token), token
        out.append(token)
    raise AssertionError(f"no stop token within {max_tokens} tokens: {grammars.tokenizer.decode(out)!r}")


def ordered_keys(text: str):
    """The parsed JSON with every object as its list of (key, value) pairs, in the order written.

    Not strict about raw control characters inside strings: xgrammar's string rule under maxLength admits
    them (a random walk writes a tab, a form feed), which is the grammar's affair, not the key order's."""
    return json.loads(text, object_pairs_hook=list, strict=False)


def shuffled_schema(gen: torch.Generator) -> tuple[dict, list[str]]:
    names = [NAMES[i] for i in torch.randperm(len(NAMES), generator=gen)[:5].tolist()]
    kinds = [
        {"type": "string", "maxLength": 6},
        {"type": "boolean"},
        {"enum": ["x", "y", 3]},
        {"type": "integer", "minimum": 0, "maximum": 99},
        {"type": "null"},
    ]
    props = {n: kinds[int(torch.randint(len(kinds), (1,), generator=gen))] for n in names}
    return {"type": "object", "properties": props, "required": names}, names


def test_json_schema_objects_keep_the_schema_key_order(grammars, rng):
    fixed = {
        "type": "object",
        "properties": {"reasoning": {"type": "string", "maxLength": 12}, "answer": {"type": "integer"}},
        "required": ["reasoning", "answer"],
    }
    cases = [(fixed, ["reasoning", "answer"])] + [shuffled_schema(rng) for _ in range(4)]
    for schema, names in cases:
        spec = GrammarSpec.json_schema(schema)
        for _ in range(3):
            text = walk(grammars, spec, rng)
            assert [k for k, _ in ordered_keys(text)] == names, text
        # the cache key is the schema's exact text: equal schemas share a grammar, another order is another one
        assert spec == GrammarSpec.json_schema(json.dumps(schema)) and spec.value == json.dumps(
            schema, separators=(",", ":")
        )
        assert grammars.compile(spec) is grammars.compile(GrammarSpec.json_schema(json.loads(spec.value)))
        reordered = {**schema, "properties": dict(reversed(list(schema["properties"].items())))}
        assert GrammarSpec.json_schema(reordered) != spec


def test_required_tool_calls_write_the_name_first_and_arguments_in_schema_order(grammars, rng):
    schema_a, names_a = shuffled_schema(rng)
    schema_b, names_b = shuffled_schema(rng)
    fns = tools.functions(
        [
            {"type": "function", "function": {"name": "lookup", "parameters": schema_a}},
            {"type": "function", "function": {"name": "act", "parameters": schema_b}},
        ]
    )
    spec = tools.grammar("required", fns)
    for _ in range(4):
        text = walk(grammars, spec, rng)
        (call,) = ordered_keys(text)
        assert [k for k, _ in call] == ["name", "arguments"], text
        name, arguments = call[0][1], call[1][1]
        assert [k for k, _ in arguments] == {"lookup": names_a, "act": names_b}[name], text


class Addr(pydantic.BaseModel):
    street: str = pydantic.Field(max_length=8)
    zip: int = pydantic.Field(ge=0, le=999)


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    home: Addr
    work: Addr | None


# parameters that refer to themselves: a tree whose children are trees (the "$ref": "#" of a recursive schema)
TREE = {
    "type": "object",
    "properties": {
        "label": {"type": "string", "maxLength": 4},
        "children": {"type": "array", "maxItems": 1, "items": {"$ref": "#"}},
    },
    "required": ["label", "children"],
}


def tree_depth(node) -> int:
    """Depth of a value that follows TREE (raises AssertionError when it does not)."""
    assert isinstance(node, dict) and set(node) == {"label", "children"}, node
    assert isinstance(node["label"], str) and len(node["label"]) <= 4, node
    assert isinstance(node["children"], list) and len(node["children"]) <= 1, node
    return 1 + max((tree_depth(c) for c in node["children"]), default=0)


def test_required_accepts_tools_with_local_refs_and_outputs_validate(grammars, rng):
    person = Person.model_json_schema()
    assert "$defs" in person and '"#/$defs/Addr"' in json.dumps(person)  # Pydantic's local references
    fns = tools.functions(
        [
            {"type": "function", "function": {"name": "add_person", "parameters": person}},
            {"type": "function", "function": {"name": "tree", "parameters": TREE}},
            {"type": "function", "function": {"name": "ping"}},
        ]
    )
    spec = tools.grammar("required", fns)
    grammars.compile(spec)  # before: "Cannot find field '$defs'" (the references resolved against the wrapper)
    assert GrammarSpec.json_schema(person) == tools.grammar("add_person", fns)  # a named tool: its own schema
    seen, depths = set(), []
    for _ in range(24):
        content, calls = tools.parse(walk(grammars, spec, rng), "required", "hermes")
        assert content is None and len(calls) == 1
        call = calls[0]
        seen.add(call.name)
        if call.name == "add_person":
            Person.model_validate_json(call.arguments)
        elif call.name == "tree":
            depths.append(tree_depth(json.loads(call.arguments)))
        else:
            assert json.loads(call.arguments) == {}
    assert {"add_person", "tree"} <= seen, seen
    # the recursion was walked at least once: "#" is the tree itself, not the list of calls around it
    for _ in range(40):
        if max(depths, default=0) > 1:
            break
        depths.append(tree_depth(json.loads(walk(grammars, tools.grammar("tree", fns), rng))))
    assert max(depths) > 1, depths


def test_relocate_refs_moves_local_references_only():
    schema = {
        "type": "object",
        "$defs": {"A": {"type": "integer"}, "const": {"$ref": "#/$defs/A"}},
        "properties": {
            "default": {"$ref": "#/$defs/A"},  # a property named like a data keyword is still a schema
            "self": {"$ref": "#"},
            "remote": {"$ref": "other.json#/x"},
            "tag": {"const": {"$ref": "#/not/a/reference"}, "default": {"$ref": "#"}},
            "e": {"enum": [{"$ref": "#"}]},
        },
    }
    moved = relocate_refs(schema, "#/$defs/f")
    assert moved["$defs"]["const"] == {"$ref": "#/$defs/f/$defs/A"}
    props = moved["properties"]
    assert props["default"] == {"$ref": "#/$defs/f/$defs/A"} and props["self"] == {"$ref": "#/$defs/f"}
    assert props["remote"] == schema["properties"]["remote"]
    assert props["tag"] == schema["properties"]["tag"] and props["e"] == schema["properties"]["e"]
    assert schema["properties"]["self"] == {"$ref": "#"}  # the caller's schema is not changed
    plain = {"type": "object", "properties": {"a": {"type": "string"}}}
    assert relocate_refs(plain, "#/$defs/f") is plain


LEAK = re.compile(r"\[\d{2}:\d{2}:\d{2}\]|/\w+\.(?:cc|h|cpp)\b|\.cc:\d+|/project/")


@pytest.mark.parametrize(
    "spec, says",
    [
        (GrammarSpec.json_schema({"type": "bogus"}), 'Unsupported type "bogus"'),
        (GrammarSpec.json_schema({"type": "object", "properties": {"a": {"$ref": "#/$defs/Nope"}}}), "$defs"),
        (GrammarSpec("regex", "a(b"), "parenthesis is not closed"),
        (GrammarSpec("grammar", "root ::= foo"), 'Rule "foo" is not defined'),
    ],
)
def test_compile_errors_say_what_is_wrong_without_log_stamps_or_paths(grammars, spec, says):
    with pytest.raises(InvalidArgumentError) as info:
        grammars.compile(spec)
    message = str(info.value)
    assert message.startswith(f"the {spec.kind} cannot be compiled: ") and says in message, message
    assert not LEAK.search(message), message


def test_compile_error_text_strips_stamps_and_source_locations():
    assert compile_error_text(RuntimeError("[08:29:22] /project/cpp/regex_converter.cc:94: Bad regex\n")) == "Bad regex"
    assert compile_error_text(RuntimeError("\n[1:2:3] C:\\b\\x.cpp:7: at C:\\b\\y.h:9 oops\nmore")) == "at oops"
    assert compile_error_text(ValueError("plain words")) == "plain words"
    assert compile_error_text(RuntimeError("[08:29:22] /a/b.cc:1: ")) == "RuntimeError"


def test_a_grammar_ended_by_a_stop_token_allows_the_stop_tokens(grammars):
    """ignore_eos goes on past the stop token the grammar ended with: xgrammar refuses to fill a mask then,
    which failed the whole step; the finished grammar allows its stop tokens (the request runs to max_tokens)."""
    spec = GrammarSpec.choice(["yes"])
    matcher = grammars.matcher(spec, [])
    for token in grammars.tokenizer.encode("yes", add_special_tokens=False):
        assert matcher.accept_token(token)
    assert matcher.accept_token(grammars.stop_token_ids[0]) and matcher.is_terminated()
    fresh = grammars.matcher(spec, [])
    mask = grammars.allowed([matcher, fresh])
    assert mask[0].nonzero()[:, 0].tolist() == grammars.stop_token_ids
    assert mask[1].any() and not mask[1, grammars.stop_token_ids].any()
