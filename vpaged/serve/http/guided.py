"""Request fields that constrain the output to a grammar (sample/structured.py), mapped to one GrammarSpec.

OpenAI: `response_format` `{"type": "json_object"}` (any JSON object) or `{"type": "json_schema",
"json_schema": {"name", "schema", "strict"}}` (`{"type": "text"}`: no constraint). vLLM: `structured_outputs`
`{"json" | "regex" | "choice" | "grammar": ...}` and the older `guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar`. At most one of them per request; the field's name is the `param` of any 400 about it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ...errors import InvalidArgumentError, RequestError, VPagedError
from ..sample.structured import GrammarSpec

MAX_GRAMMAR_CHARS = 1 << 20  # a schema, regex or grammar larger than this is refused before compiling


def grammar_of(req) -> tuple[GrammarSpec | None, str | None]:
    """(the request's GrammarSpec, the field that gave it), or (None, None)."""
    given = [
        (name, getattr(req, name, None))
        for name in (
            "response_format",
            "structured_outputs",
            "guided_json",
            "guided_regex",
            "guided_choice",
            "guided_grammar",
        )
    ]
    given = [(n, v) for n, v in given if v is not None and not (n == "response_format" and v == {"type": "text"})]
    if not given:
        return None, None
    if len(given) > 1:
        raise RequestError(f"give one structured output field, not {', '.join(n for n, _ in given)}", param=given[1][0])
    name, value = given[0]
    try:
        return _spec(name, value), name
    except InvalidArgumentError as e:
        raise RequestError(str(e), param=name) from None


def _spec(name: str, value: Any) -> GrammarSpec:
    if name == "response_format":
        kind = value.get("type") if isinstance(value, dict) else None
        if kind == "json_object":
            return GrammarSpec("json")
        if kind == "json_schema":
            inner = value.get("json_schema")
            if not isinstance(inner, dict) or not isinstance(inner.get("schema", {}), dict):
                raise InvalidArgumentError("response_format.json_schema must be {name, schema, strict}")
            return _sized(GrammarSpec.json_schema(inner.get("schema") or {"type": "object"}))
        raise InvalidArgumentError("response_format.type must be 'text', 'json_object' or 'json_schema'")
    if name == "structured_outputs":
        if not isinstance(value, dict):
            raise InvalidArgumentError("structured_outputs must be an object")
        keys = [k for k in ("json", "regex", "choice", "grammar", "json_object") if value.get(k) not in (None, False)]
        if len(keys) != 1:
            raise InvalidArgumentError("structured_outputs needs exactly one of json, regex, choice, grammar")
        key = keys[0]
        return (
            _spec(
                {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice"}.get(key, "guided_grammar"),
                value[key],
            )
            if key != "json_object"
            else GrammarSpec("json")
        )
    if name == "guided_json":
        if not isinstance(value, (dict, str)):
            raise InvalidArgumentError(f"{name} must be a JSON schema")
        return _sized(GrammarSpec.json_schema(value))
    if name == "guided_choice":
        if not isinstance(value, list):
            raise InvalidArgumentError(f"{name} must be a list of strings")
        return _sized(GrammarSpec.choice(value))
    if not isinstance(value, str) or not value:
        raise InvalidArgumentError(f"{name} must be a non-empty string")
    return _sized(GrammarSpec("regex" if name == "guided_regex" else "grammar", value))


def _sized(spec: GrammarSpec) -> GrammarSpec:
    if len(spec.value) > MAX_GRAMMAR_CHARS:
        raise InvalidArgumentError(f"at most {MAX_GRAMMAR_CHARS} characters of schema or grammar")
    return spec


def grammars(engine, field: str):
    """The engine's Grammars; a 400 naming the field when it cannot run here (no xgrammar, no tokenizer)."""
    found = getattr(engine, "grammars", None)
    why = "this engine has no structured output" if found is None else found.unavailable()
    if why is not None:
        raise RequestError(why, param=field, code="structured_output_unavailable")
    return found


def check_available(engine, req) -> None:
    """A grammar field the server cannot honour is refused before anything else about the request."""
    spec, field = grammar_of(req)
    if spec is not None:
        grammars(engine, field)


async def compile_off_thread(engine, spec: GrammarSpec, field: str) -> None:
    """Compile a request's grammar on a worker thread (cached), so that the engine thread finds it compiled;
    one that cannot be compiled is a 400 naming the field."""
    found = grammars(engine, field)
    try:
        await asyncio.to_thread(found.compile, spec)
    except VPagedError as e:
        raise RequestError(str(e), param=field, code="invalid_grammar") from None
