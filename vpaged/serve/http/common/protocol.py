"""The OpenAI wire format both generation endpoints share: the sampling fields of a request (validated with
pydantic), their mapping to SamplingParams, and the records every answer carries (usage, the error body).

Fields of the OpenAI API that the engine cannot honour (suffix, audio, prediction, ...) are refused with a
clear message rather than silently ignored, and so are combinations that would be (top_logprobs without
logprobs, stream_options without stream); so is any field this server does not know (400 naming it), since a
client that sends one expects it to do something. The exceptions are IGNORED_FIELDS: hints about billing,
storage and caching on OpenAI's side that change nothing in the answer, which real clients send routinely.
Types are strict (pydantic strict mode): `"max_tokens": "5"`, `"n": 2.0`, `"stream": "yes"` or a token id
`true` are refused, not coerced (an int is still a valid float).

Responses are models too (ResponseModel): `json_body()` is the JSON object sent, with every field the OpenAI
shape has, null ones included (clients read `"logprobs": null`); a key that the shape leaves out when it has
no value is declared with `exclude_if=is_none` on its own field.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict

from ....errors import RequestError
from ...sample.params import MAX_LOGPROBS, MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY

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


class SamplingRequest(BaseModel):
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
        check_logprobs_count("prompt_logprobs", self.prompt_logprobs)
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


def check_logprobs_count(name: str, k: int | None) -> None:
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        raise RequestError(f"{name} must be in 0..{MAX_LOGPROBS}, got {k}", param=name)


def sampling_kwargs(req: SamplingRequest, max_tokens: int) -> dict:
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
# Response records


def is_none(value: Any) -> bool:
    """exclude_if of a key the OpenAI shape leaves out, rather than writing null, when it has no value."""
    return value is None


class ResponseModel(BaseModel):
    """A response body or a part of one: built by the server, so not validated strictly."""

    model_config = ConfigDict(extra="forbid")

    def json_body(self) -> dict:
        """The JSON object sent: every field in declaration order, nulls included (but exclude_if ones)."""
        return self.model_dump(mode="json")


class PromptTokensDetails(ResponseModel):
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache


class UsageInfo(ResponseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> UsageInfo:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


class ErrorInfo(ResponseModel):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class ErrorResponse(ResponseModel):
    """The OpenAI error shape: {"error": {message, type, param, code}}, all four always present."""

    error: ErrorInfo


def error_body(
    message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict:
    return ErrorResponse(error=ErrorInfo(message=message, type=type_, param=param, code=code)).json_body()


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
