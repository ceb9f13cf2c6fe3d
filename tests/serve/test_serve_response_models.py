"""The typed response models of the HTTP server (serve/http/{common,completion,chat}/protocol.py) write the
OpenAI wire shape key for key: every key the shape has, null ones included (`"logprobs": null`,
`"finish_reason": null`, a message's `"content": null`), and none it leaves out (a message's `tool_calls`
only with calls, a chunk's `usage` only on the usage chunk, a delta's keys only when they have something).

The expected bodies are written here from OpenAI's field lists (with the server's `token_ids` extension),
not produced by the code under test; key order is compared too, since it is what goes on the wire.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

import pytest

pytest.importorskip("fastapi")

from vpaged.serve.http.chat.protocol import (  # noqa: E402
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatDeltaChoice,
    ChatResponseMessage,
)
from vpaged.serve.http.common.protocol import UsageInfo, error_body  # noqa: E402
from vpaged.serve.http.completion.protocol import (  # noqa: E402
    CompletionChoice,
    CompletionChunk,
    CompletionResponse,
)
from vpaged.serve.http.logprobs import LOGPROB_FLOOR, CompletionLogprobsFormat, TokenTexts, chat_logprobs  # noqa: E402
from vpaged.serve.http.model_cards import ModelCard, ModelList  # noqa: E402
from vpaged.serve.http.streaming import sse  # noqa: E402
from vpaged.serve.http.tokenize import DetokenizeResponse, TokenizeResponse  # noqa: E402
from vpaged.serve.http.tools import ToolCall  # noqa: E402


@dataclass
class Entry:
    """What the engine gives per token when logprobs are asked (the fields the formatters read)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


def same(got: dict, want: dict) -> None:
    """Equal as JSON values and in key order at every level (what a client's parser and the bytes see)."""
    assert got == want
    assert json.dumps(got) == json.dumps(want)


def usage_dict(prompt: int, completion: int, cached: int) -> dict:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def test_usage_and_error_bodies():
    same(UsageInfo.of(7, 3, 2).json_body(), usage_dict(7, 3, 2))
    same(UsageInfo.of(5, 0).json_body(), usage_dict(5, 0, 0))
    same(
        error_body("bad n", param="n"),
        {"error": {"message": "bad n", "type": "invalid_request_error", "param": "n", "code": None}},
    )
    same(
        error_body("engine lost", "server_error", code="TensorParallelError"),
        {"error": {"message": "engine lost", "type": "server_error", "param": None, "code": "TensorParallelError"}},
    )


def test_completion_response_and_chunks():
    use = UsageInfo.of(4, 2, 0)
    body = CompletionResponse(
        id="cmpl-1",
        created=123,
        model="tiny",
        choices=[
            CompletionChoice(index=0, text="ab", finish_reason="length", token_ids=[5, 6]),
            CompletionChoice(index=1, text="", finish_reason="stop", token_ids=[]),
        ],
        usage=use,
    )
    same(
        body.json_body(),
        {
            "id": "cmpl-1",
            "object": "text_completion",
            "created": 123,
            "model": "tiny",
            "choices": [
                {"index": 0, "text": "ab", "logprobs": None, "finish_reason": "length", "token_ids": [5, 6]},
                {"index": 1, "text": "", "logprobs": None, "finish_reason": "stop", "token_ids": []},
            ],
            "usage": usage_dict(4, 2, 0),
        },
    )
    piece = CompletionChunk(
        id="cmpl-1", created=123, model="tiny", choices=[CompletionChoice(index=0, text="a", token_ids=[5])]
    )
    want_piece = {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 123,
        "model": "tiny",
        "choices": [{"index": 0, "text": "a", "logprobs": None, "finish_reason": None, "token_ids": [5]}],
    }
    same(piece.json_body(), want_piece)  # no usage key on a chunk that has none
    last = CompletionChunk(id="cmpl-1", created=123, model="tiny", choices=[], usage=use)
    same(last.json_body(), {**want_piece, "choices": [], "usage": usage_dict(4, 2, 0)})
    # the event as it goes out: compact JSON, one data line and a blank one
    assert sse(piece) == "data: " + json.dumps(want_piece, separators=(",", ":")) + "\n\n"


def test_completion_logprobs_with_echo():
    texts = TokenTexts(None)  # no tokenizer: a token's text is token_id:<id>
    fmt = CompletionLogprobsFormat(texts)
    prompt_entries = [None, Entry(8, -0.5, [(9, -1.0)])]
    got = fmt.echo_body([7, 8], prompt_entries, [Entry(3, float("-inf"), [])]).json_body()
    same(
        got,
        {
            "tokens": ["token_id:7", "token_id:8", "token_id:3"],
            "token_logprobs": [None, -0.5, LOGPROB_FLOOR],
            "top_logprobs": [None, {"token_id:9": -1.0, "token_id:8": -0.5}, {"token_id:3": LOGPROB_FLOOR}],
            "text_offset": [0, 10, 20],
        },
    )
    # a stream's next piece goes on from where the text stopped
    same(
        fmt.body([Entry(4, -2.0, [(4, -2.0)])]).json_body(),
        {
            "tokens": ["token_id:4"],
            "token_logprobs": [-2.0],
            "top_logprobs": [{"token_id:4": -2.0}],
            "text_offset": [30],
        },
    )
    choice = CompletionChoice(index=0, text="x", logprobs=fmt.body([]), finish_reason="stop", token_ids=[])
    same(choice.json_body()["logprobs"], {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []})


def test_chat_response_with_content_calls_and_legacy_call():
    use = UsageInfo.of(10, 4, 8)
    call = ToolCall("get_weather", '{"city": "Oslo"}')
    tool_call = call.body(0)
    plain = ChatCompletionChoice(
        index=0, message=ChatResponseMessage(content="hi"), finish_reason="stop", token_ids=[1, 2]
    )
    calls = ChatCompletionChoice(
        index=1,
        message=ChatResponseMessage(content=None, tool_calls=[tool_call]),
        finish_reason="tool_calls",
        token_ids=[3],
    )
    legacy = ChatCompletionChoice(
        index=2,
        message=ChatResponseMessage(content="ok", function_call=call.legacy_body()),
        finish_reason="function_call",
        token_ids=[],
    )
    body = ChatCompletionResponse(id="chatcmpl-9", created=5, model="m", choices=[plain, calls, legacy], usage=use)
    same(
        body.json_body(),
        {
            "id": "chatcmpl-9",
            "object": "chat.completion",
            "created": 5,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "hi"},  # no tool_calls key without calls
                    "logprobs": None,
                    "finish_reason": "stop",
                    "token_ids": [1, 2],
                },
                {
                    "index": 1,
                    "message": {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": tool_call.id,
                                "type": "function",
                                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                            }
                        ],
                    },
                    "logprobs": None,
                    "finish_reason": "tool_calls",
                    "token_ids": [3],
                },
                {
                    "index": 2,
                    "message": {
                        "role": "assistant",
                        "content": "ok",
                        "function_call": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    },
                    "logprobs": None,
                    "finish_reason": "function_call",
                    "token_ids": [],
                },
            ],
            "usage": usage_dict(10, 4, 8),
        },
    )
    assert tool_call.id.startswith("call_") and len(tool_call.id) == len("call_") + 24
    # a call without an index (not a list entry) has no index key
    same(call.body().json_body()["function"], {"name": "get_weather", "arguments": '{"city": "Oslo"}'})
    assert "index" not in call.body().json_body()


def test_chat_chunks_and_deltas():
    def chunk(delta: ChatDelta, finish=None, toks=()):
        return ChatCompletionChunk(
            id="c",
            created=1,
            model="m",
            choices=[ChatDeltaChoice(index=0, delta=delta, finish_reason=finish, token_ids=list(toks))],
        ).json_body()

    def want(delta: dict, finish=None, toks=()):
        return {
            "id": "c",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "m",
            "choices": [
                {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish, "token_ids": list(toks)}
            ],
        }

    same(chunk(ChatDelta(role="assistant", content="")), want({"role": "assistant", "content": ""}))
    same(chunk(ChatDelta(content="He"), toks=[4]), want({"content": "He"}, toks=[4]))
    same(chunk(ChatDelta(content=""), toks=[]), want({"content": ""}))  # an empty piece of a running choice
    same(chunk(ChatDelta(), "stop"), want({}, "stop"))  # the finish of a choice with nothing left to send
    call = ToolCall("f", "{}").body(0)
    same(
        chunk(ChatDelta(tool_calls=[call]), "tool_calls"),
        want(
            {
                "tool_calls": [
                    {"index": 0, "id": call.id, "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ]
            },
            "tool_calls",
        ),
    )
    usage_only = ChatCompletionChunk(id="c", created=1, model="m", choices=[], usage=UsageInfo.of(3, 1)).json_body()
    same(usage_only, {**want({}), "choices": [], "usage": usage_dict(3, 1, 0)})


def test_chat_logprobs():
    texts = TokenTexts(None)
    got = chat_logprobs(texts, [Entry(65, -0.25, [(65, -0.25), (66, float("-inf"))])]).json_body()
    tok_a, tok_b = "token_id:65", "token_id:66"
    same(
        got,
        {
            "content": [
                {
                    "token": tok_a,
                    "logprob": -0.25,
                    "bytes": list(tok_a.encode()),
                    "top_logprobs": [
                        {"token": tok_a, "logprob": -0.25, "bytes": list(tok_a.encode())},
                        {"token": tok_b, "logprob": LOGPROB_FLOOR, "bytes": list(tok_b.encode())},
                    ],
                }
            ],
            "refusal": None,
        },
    )
    same(chat_logprobs(texts, []).json_body(), {"content": [], "refusal": None})


def test_model_cards_and_tokenize_bodies():
    same(
        ModelCard(id="tiny", created=9).json_body(),
        {"id": "tiny", "object": "model", "created": 9, "owned_by": "vpaged"},
    )
    card = ModelCard(id="tiny", created=9, max_model_len=2048).json_body()
    same(card, {"id": "tiny", "object": "model", "created": 9, "owned_by": "vpaged", "max_model_len": 2048})
    same(
        ModelList(data=[ModelCard(id="tiny", created=9, max_model_len=2048)]).json_body(),
        {"object": "list", "data": [card]},
    )
    same(
        TokenizeResponse(count=2, max_model_len=None, tokens=[1, 2], token_strs=None).json_body(),
        {"count": 2, "max_model_len": None, "tokens": [1, 2], "token_strs": None},
    )
    same(DetokenizeResponse(prompt="hi").json_body(), {"prompt": "hi"})


@pytest.mark.parametrize("seed", [random.randrange(1 << 30) for _ in range(3)])
def test_random_answers_match_the_shape(seed):
    """Random choices (text with non-ASCII characters, token ids, finish reasons, calls or not): the models'
    JSON equals the dicts written from the field list."""
    rng = random.Random(seed)
    alphabet = 'ab c\u00e9\u4e2d\U0001f600\n"\\'
    finishes = ["stop", "length", None]
    choices, want = [], []
    for k in range(rng.randint(1, 5)):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        ids = [rng.randrange(50_000) for _ in range(rng.randint(0, 6))]
        finish = rng.choice(finishes)
        if rng.random() < 0.5:
            call = ToolCall(f"fn_{k}", json.dumps({"x": text}))
            tc = call.body(0)
            message = ChatResponseMessage(content=text or None, tool_calls=[tc])
            want_message = {
                "role": "assistant",
                "content": text or None,
                "tool_calls": [
                    {
                        "index": 0,
                        "id": tc.id,
                        "type": "function",
                        "function": {"name": f"fn_{k}", "arguments": call.arguments},
                    }
                ],
            }
        else:
            message = ChatResponseMessage(content=text)
            want_message = {"role": "assistant", "content": text}
        choices.append(ChatCompletionChoice(index=k, message=message, finish_reason=finish, token_ids=ids))
        want.append({"index": k, "message": want_message, "logprobs": None, "finish_reason": finish, "token_ids": ids})
    p, c, cached = rng.randrange(1000), rng.randrange(1000), rng.randrange(1000)
    body = ChatCompletionResponse(
        id="chatcmpl-r", created=seed, model="m", choices=choices, usage=UsageInfo.of(p, c, cached)
    )
    expected = {
        "id": "chatcmpl-r",
        "object": "chat.completion",
        "created": seed,
        "model": "m",
        "choices": want,
        "usage": usage_dict(p, c, cached),
    }
    same(body.json_body(), expected)
    # what the SSE framing writes decodes back to the same object
    assert json.loads(sse(body)[len("data: ") :]) == expected
