"""The OpenAI wire format the server speaks: request bodies (validated with pydantic), the mapping of a body
to SamplingParams, incremental detokenization with stop strings, and the JSON of responses and stream chunks.

Kept apart from server.py so that what a request means is testable without HTTP or an engine. Fields of the
OpenAI API that the engine cannot honour (suffix, audio, prediction, ...) are refused with a clear
message rather than silently ignored, and so are combinations that would be (top_logprobs without logprobs,
stream_options without stream); so is any field this server does not know (400 naming it), since a client
that sends one expects it to do something. The exceptions are IGNORED_FIELDS: hints about billing, storage
and caching on OpenAI's side that change nothing in the answer, which real clients send routinely.
Types are strict (pydantic strict mode): `"max_tokens": "5"`, `"n": 2.0`, `"stream": "yes"` or a token id
`true` are refused, not coerced (an int is still a valid float).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ...errors import RequestError
from ..sample.params import MAX_LOGPROBS, MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY
from .choice_text import ChoiceText  # noqa: F401 - where the server's modules and tests have imported it from

MAX_LOGIT_BIAS = 1024  # entries of logit_bias one request may give
MAX_BAD_WORDS = 64  # bad_words one request may give
MAX_BAD_WORD_CHARS = 256  # the length of each

# Accepted and ignored: they ask OpenAI to bill, store, log or cache on its side, never to change the answer.
IGNORED_FIELDS = (
    "user",
    "metadata",
    "store",
    "service_tier",
    "safety_identifier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "prompt_cache_options",
)
# OpenAI chat fields this server does not implement: accepted only at their neutral value (null; modalities
# ["text"]), refused naming the field otherwise.
UNIMPLEMENTED_CHAT_FIELDS = ("audio", "modalities", "prediction", "reasoning_effort", "verbosity", "web_search_options")


def error_body(
    message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class _Sampling(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: dict | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    # IGNORED_FIELDS
    user: str | None = None
    metadata: dict | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict | None = None
    # Fields outside the OpenAI API that OpenAI-compatible servers commonly accept (pass via extra_body).
    top_k: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    bad_words: list[str] | None = None
    # OpenAI fields the engine does not implement: accepted only at their neutral value.
    best_of: int | None = None
    # Structured output and tool calling: refused when given (see unsupported()).
    # Structured output (guided.py): OpenAI's response_format, vLLM's structured_outputs and guided_*.
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    tools: Any = None
    tool_choice: Any = None

    def check(self) -> None:
        """Values pydantic's types let through that the request cannot mean: RequestError naming the field."""
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options is only allowed when stream is true", param="stream_options")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if v is not None and not -2.0 <= v <= 2.0:
                raise RequestError(f"{name} must be in [-2, 2], got {v}", param=name)
        penalty = self.repetition_penalty
        if penalty is not None and not MIN_REPETITION_PENALTY <= penalty <= MAX_REPETITION_PENALTY:
            raise RequestError(
                f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY:g}], got {penalty}",
                "repetition_penalty",
            )
        if self.min_tokens is not None and self.min_tokens < 0:
            raise RequestError(f"min_tokens must be >= 0, got {self.min_tokens}", param="min_tokens")
        _check_logprobs_count("prompt_logprobs", self.prompt_logprobs)
        if self.logit_bias is not None:
            self.token_bias()
        if self.bad_words is not None:
            if len(self.bad_words) > MAX_BAD_WORDS:
                raise RequestError(f"at most {MAX_BAD_WORDS} bad_words", param="bad_words")
            if any(not w.strip() or len(w) > MAX_BAD_WORD_CHARS for w in self.bad_words):
                raise RequestError(
                    f"bad_words must be non-blank strings of at most {MAX_BAD_WORD_CHARS} characters", "bad_words"
                )

    def token_bias(self) -> dict[int, float]:
        """logit_bias with its keys as token ids (JSON keys are strings)."""
        bias = self.logit_bias or {}
        if len(bias) > MAX_LOGIT_BIAS:
            raise RequestError(f"logit_bias may have at most {MAX_LOGIT_BIAS} entries", param="logit_bias")
        out = {}
        for key, value in bias.items():
            if not key.isascii() or not key.isdigit():
                raise RequestError(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias")
            if not -100.0 <= value <= 100.0:
                raise RequestError(f"logit_bias values must be in [-100, 100], got {value}", param="logit_bias")
            out[int(key)] = value
        return out

    def logprobs_count(self) -> int | None:
        """SamplingParams.logprobs: None (not asked) or how many alternatives per generated token."""
        return None

    def prompt_logprobs_count(self) -> int | None:
        return self.prompt_logprobs

    def unsupported(self) -> list[str]:
        bad = []
        if self.best_of not in (None, self.n):
            bad.append("best_of")
        return bad

    def stop_strings(self, max_count: int = 4) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not s for s in stops):
            raise RequestError("stop strings must not be empty", param="stop")
        if len(stops) > max_count:
            raise RequestError(f"at most {max_count} stop strings", param="stop")
        return stops

    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(_Sampling):
    # A string, a list of token ids, or a batch of either: each prompt becomes its own engine request.
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    # The legacy completions form: an int, the alternatives per token (0: the chosen token's logprob only).
    logprobs: int | None = None

    def check(self) -> None:
        super().check()
        _check_logprobs_count("logprobs", self.logprobs)
        if self.max_tokens == 0:  # the legacy API's prompt scoring (lm-eval, vLLM): echo, nothing generated
            if not self.echo:
                raise RequestError("max_tokens 0 needs echo: true (it scores the prompt only)", param="max_tokens")
            if self.min_tokens:
                raise RequestError("min_tokens must be 0 with max_tokens 0", param="min_tokens")

    @property
    def scores_only(self) -> bool:
        """max_tokens 0 with echo: the prompt (and its logprobs) comes back, and no generated token."""
        return self.max_tokens == 0

    def logprobs_count(self) -> int | None:
        return self.logprobs

    def prompt_logprobs_count(self) -> int | None:
        # echo with logprobs scores the prompt too (lm-eval's loglikelihood: logprobs 1, echo, max_tokens 1)
        asked = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return max(asked) if asked else None

    @field_validator("prompt")
    @classmethod
    def _nonempty(cls, v):
        if isinstance(v, list) and len(v) == 0:
            raise ValueError("prompt must not be an empty list")
        return v

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.suffix:
            bad.append("suffix")
        if self.tools is not None and self.tools != []:  # tools are a chat feature
            bad.append("tools")
        if self.tool_choice is not None and self.tool_choice != "none":
            bad.append("tool_choice")
        return bad

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    # "function": a legacy function's result (read as a tool message)
    role: Literal["system", "user", "assistant", "developer", "tool", "function"]
    # OpenAI allows content as a list of parts; only text parts can be rendered by a text chat template.
    content: str | list[dict] | None = None
    tool_calls: list[dict] | None = None  # an assistant message's calls, in the history
    tool_call_id: str | None = None  # a tool message: the call it answers
    function_call: dict | None = None  # the legacy form of an assistant's one call, in the history
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            kind = part.get("type")
            if kind != "text" or not isinstance(part.get("text"), str):
                what = f"{kind!r} content parts" if isinstance(kind, str) else "content parts without a type"
                raise RequestError(
                    f"this model reads text only: {what} are not supported (only 'text' parts)",
                    param="messages",
                    code="unsupported_content",
                )
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call per choice
    # The legacy form of tools (before tools and tool_choice): served as the tools they map to, answered in
    # the legacy shape (message.function_call, finish_reason "function_call").
    functions: list | None = None
    function_call: str | dict | None = None
    # UNIMPLEMENTED_CHAT_FIELDS
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        for name in UNIMPLEMENTED_CHAT_FIELDS:
            value = getattr(self, name)
            if value is not None and not (name == "modalities" and value == ["text"]):
                bad.append(name)
        return bad

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
        _check_logprobs_count("top_logprobs", self.top_logprobs)
        self._map_legacy_functions()

    @property
    def legacy_functions(self) -> bool:
        """Whether the request gave `functions` (the answer then takes the legacy shape)."""
        return self.functions is not None

    def _map_legacy_functions(self) -> None:
        if self.functions is None:
            if self.function_call is not None:
                raise RequestError("function_call needs functions", param="function_call")
            return
        if self.tools is not None or self.tool_choice is not None:
            raise RequestError("give functions (legacy) or tools, not both", param="functions")
        if not self.functions or not all(isinstance(f, dict) for f in self.functions):
            raise RequestError("functions must be a non-empty list of {name, description, parameters}", "functions")
        self.tools = [{"type": "function", "function": f} for f in self.functions]
        call = self.function_call
        if call is None or call in ("auto", "none"):
            self.tool_choice = call
        elif isinstance(call, dict) and set(call) == {"name"} and isinstance(call["name"], str):
            self.tool_choice = {"type": "function", "function": {"name": call["name"]}}
        else:
            raise RequestError('function_call must be "auto", "none" or {"name": a given function}', "function_call")

    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def conversation(self) -> list[dict]:
        from .tools import history

        return [history(m) for m in self.messages]


def parse_request(cls: type[_Sampling], body: Any) -> _Sampling:
    """Validate a decoded JSON body; RequestError with the first problem otherwise."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    try:
        req = cls.model_validate(body)
    except RecursionError:
        raise RequestError("the request body is nested too deeply") from None
    except ValidationError as e:
        errors = e.errors()
        # An unknown field is named as such, before any other problem: it is what the client must change.
        first = next((x for x in errors if x.get("type") == "extra_forbidden"), errors[0])
        loc = first.get("loc", ())
        where = ".".join(str(x) for x in loc)
        if first.get("type") == "extra_forbidden":
            raise RequestError(
                f"unknown field {where}: not part of this API or not implemented by this server",
                param=str(loc[0]) if loc else None,
                code="unknown_field",
            ) from None
        raise RequestError(
            f"{where}: {first.get('msg')}" if where else str(first.get("msg")), param=str(loc[0]) if loc else None
        ) from None
    bad = req.unsupported()
    if bad:
        raise RequestError(f"not supported by this server: {', '.join(bad)}", param=bad[0])
    req.check()
    return req


# Bodies larger than this are decoded and validated on a worker thread, so the event loop goes on meanwhile.
_THREAD_PARSE_BYTES = 64 << 10


def _decode_and_validate(cls, raw: bytes):
    try:
        body = json.loads(raw)
    except RecursionError:
        raise RequestError("the request body is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestError(f"the request body is not valid JSON: {e}") from None
    return parse_request(cls, body)


async def read_request(request, cls):
    """The HTTP request's body (a Starlette Request), decoded and validated as `cls` (parse_request)."""
    raw = await request.body()
    if len(raw) > _THREAD_PARSE_BYTES:
        return await asyncio.to_thread(_decode_and_validate, cls, raw)
    return _decode_and_validate(cls, raw)


def refused_param(error: Exception, fields) -> str | None:
    """The request field an engine's refusal is about: "prompt" for a prompt error, else the field its message
    starts with when that is one of `fields` (the engine's messages name the field first)."""
    if "prompt" in type(error).__name__.lower():
        return "prompt"
    first = str(error).split(" ", 1)[0]
    return first if first in fields else None


def _check_logprobs_count(name: str, k: int | None) -> None:
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        raise RequestError(f"{name} must be in 0..{MAX_LOGPROBS}, got {k}", param=name)


def sampling_kwargs(req: _Sampling, max_tokens: int) -> dict:
    """Keyword arguments of SamplingParams for a request (validation of the values is SamplingParams' job)."""
    kw: dict[str, Any] = {"max_tokens": max_tokens, "n": req.n, "ignore_eos": req.ignore_eos}
    if req.temperature is not None:
        kw["temperature"] = req.temperature
    if req.top_p is not None:
        kw["top_p"] = req.top_p
    if req.top_k is not None:
        kw["top_k"] = req.top_k
    if req.seed is not None:
        kw["seed"] = req.seed
    if req.stop_token_ids:
        kw["stop_token_ids"] = tuple(req.stop_token_ids)
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens"):
        if getattr(req, name) is not None:
            kw[name] = getattr(req, name)
    if req.logit_bias:
        kw["logit_bias"] = req.token_bias()
    if req.bad_words:
        kw["bad_words"] = tuple(req.bad_words)
    kw["logprobs"] = req.logprobs_count()
    kw["prompt_logprobs"] = req.prompt_logprobs_count()
    return kw


# --------------------------------------------------------------------------------------------------------
# Response bodies


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """The usage record; cached_tokens: prompt tokens whose K/V came from the prefix cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_body(rid: str, model: str, created: int, choices: list[dict], use: dict) -> dict:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": use,
    }


def completion_choice(
    index: int, text: str, token_ids: list[int], finish_reason: str | None, logprobs: dict | None = None
) -> dict:
    # token_ids is an extension (OpenAI clients keep unknown fields): models without a tokenizer answer
    # with token ids only, and clients can check exactly what was generated.
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason, "token_ids": token_ids}


def completion_chunk(rid: str, model: str, created: int, choices: list[dict], use: dict | None = None) -> dict:
    body = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices}
    if use is not None:
        body["usage"] = use
    return body


def chat_body(rid: str, model: str, created: int, choices: list[dict], use: dict) -> dict:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": use,
    }


def chat_choice(
    index: int,
    text: str | None,
    token_ids: list[int],
    finish_reason: str | None,
    logprobs: dict | None = None,
    calls: dict | None = None,
) -> dict:
    """calls: {"tool_calls": [...]}, the legacy {"function_call": {...}}, or None."""
    message = {"role": "assistant", "content": text, **(calls or {})}
    return {
        "index": index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "token_ids": token_ids,
    }


def chat_chunk(rid: str, model: str, created: int, choices: list[dict], use: dict | None = None) -> dict:
    body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices}
    if use is not None:
        body["usage"] = use
    return body


def chat_delta_choice(
    index: int, delta: dict, token_ids: list[int], finish_reason: str | None, logprobs: dict | None = None
) -> dict:
    return {
        "index": index,
        "delta": delta,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "token_ids": token_ids,
    }


def model_card(name: str, created: int, max_model_len: int | None = None) -> dict:
    card = {"id": name, "object": "model", "created": created, "owned_by": "vpaged"}
    if max_model_len is not None:
        card["max_model_len"] = max_model_len  # as vLLM reports it
    return card


def model_list(name: str, created: int, max_model_len: int | None = None) -> dict:
    return {"object": "list", "data": [model_card(name, created, max_model_len)]}


def now() -> int:
    return int(time.time())
