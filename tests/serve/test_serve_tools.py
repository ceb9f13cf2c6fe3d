"""Tool calling (vpaged/serve/http/tools.py) without a model: the Hermes `<tool_call>` parser, tool_choice
validation, the grammars that enforce required / named choices, history messages as templates read them; and
on the tiny server, 400s naming tools / tool_choice and tool messages accepted in the history."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("pydantic")

from vpaged.errors import RequestError  # noqa: E402
from vpaged.serve.http import tools  # noqa: E402
from vpaged.serve.http.chat.protocol import ChatCompletionRequest  # noqa: E402
from vpaged.serve.http.common.parse import parse_request  # noqa: E402

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def test_hermes_calls_are_parsed_and_the_rest_kept_as_text():
    text = (
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call> done'
    )
    content, calls = tools.parse_hermes(text)
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Oslo"} and json.loads(calls[1].arguments) == {}
    assert content == "Let me look.\n\n done"
    # an unterminated last block (max_tokens) still parses when its JSON is whole; broken JSON stays text
    assert tools.parse_hermes('<tool_call>{"name": "f", "arguments": {"a": 1}}')[1][0].name == "f"
    assert tools.parse_hermes('<tool_call>{"name": "f", "argu') == ('<tool_call>{"name": "f", "argu', [])
    assert tools.parse_hermes("no calls") == ("no calls", [])


def test_tool_choice_modes_and_their_grammars():
    fns = tools.functions([WEATHER, TIME])
    assert tools.choice_of(None, fns) == "auto" and tools.choice_of(None, {}) == "none"
    assert tools.choice_of({"type": "function", "function": {"name": "get_time"}}, fns) == "get_time"
    assert tools.grammar("auto", fns) is None and tools.grammar("none", fns) is None
    named = json.loads(tools.grammar("get_weather", fns).value)
    assert named == WEATHER["function"]["parameters"]
    required = json.loads(tools.grammar("required", fns).value)
    assert required["type"] == "array" and required["minItems"] == 1
    assert [c["properties"]["name"]["const"] for c in required["items"]["anyOf"]] == ["get_weather", "get_time"]
    content, calls = tools.parse('[{"name": "get_weather", "arguments": {"city": "Rome"}}]', "required", "hermes")
    assert content is None and calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Rome"}
    assert tools.parse('{"city": "Rome"}', "get_weather", "hermes")[1][0].arguments == '{"city": "Rome"}'
    assert tools.parse("<tool_call>{}</tool_call>", "none", "hermes") == ("<tool_call>{}</tool_call>", [])
    body = calls[0].body(0).json_body()
    assert body["index"] == 0 and body["type"] == "function" and body["id"].startswith("call_")


@pytest.mark.parametrize("char", ["\x0c", "\t", "\x01"])
def test_calls_with_raw_control_characters_come_back_as_strict_json(char):
    # xgrammar's string rule with maxLength lets a raw control character into a string (strict JSON refuses
    # one): the calls built from such an output carry strict JSON arguments, the character escaped.
    label = f"a{char}b"
    raw = json.dumps({"label": label}).replace(json.dumps(char)[1:-1], char)
    with pytest.raises(ValueError):
        json.loads(raw)  # the output as the grammar let it be written
    outputs = {
        "required": f'[{{"name": "tree", "arguments": {raw}}}]',
        "tree": raw,  # a named function: the output is its arguments
        "auto": f'<tool_call>{{"name": "tree", "arguments": {raw}}}</tool_call>',
    }
    for choice, text in outputs.items():
        content, calls = tools.parse(text, choice, "hermes")
        assert content is None and [c.name for c in calls] == ["tree"], choice
        assert json.loads(calls[0].arguments) == {"label": label}, choice
    assert tools.parse('{"label": "ab"}', "tree", "hermes")[1][0].arguments == '{"label": "ab"}'  # kept as written


@pytest.mark.parametrize(
    "tool_list, choice",
    [
        ("x", None),
        ([{"type": "function"}], None),
        ([{"type": "retrieval", "function": {"name": "f"}}], None),
        ([WEATHER, WEATHER], None),
        ([{"type": "function", "function": {"name": "bad name!"}}], None),
        ([{"type": "function", "function": {"name": "f", "parameters": []}}], None),
        ([WEATHER], "sometimes"),
        ([WEATHER], {"type": "function", "function": {"name": "other"}}),
        (None, "required"),
    ],
)
def test_bad_tools_and_choices_name_the_field(tool_list, choice):
    with pytest.raises(RequestError) as e:
        fns = tools.functions(tool_list) if tool_list is not None else {}
        tools.choice_of(choice, fns)
    assert e.value.param == ("tools" if e.value.param == "tools" else "tool_choice")
    assert e.value.param in ("tools", "tool_choice")


def test_tool_messages_in_the_history_reach_the_template():
    body = {
        "model": "m",
        "messages": [
            {"role": "user", "content": "weather in Oslo?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
        "tools": [WEATHER],
    }
    conv = tools.conversation(parse_request(ChatCompletionRequest, body).messages)
    assert conv[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}  # HF templates read objects
    assert conv[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
