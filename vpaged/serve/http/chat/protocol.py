"""/v1/chat/completions on the wire: the request (messages, tools or the legacy functions, logprobs as a
bool with top_logprobs) and the response models, whole (ChatCompletionResponse) and streamed
(ChatCompletionChunk).

A message or delta carries `tool_calls` (or the legacy `function_call`) only when it holds calls; a delta
carries only what changed (the first of a choice: role and empty content; the last: its finish_reason). A
choice's `token_ids` is an extension, as on /v1/completions.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ....errors import RequestError
from ..common.protocol import ResponseModel, SamplingRequest, UsageInfo, check_logprobs_count, is_none

# OpenAI chat fields this server does not implement: accepted only at their neutral value (null; modalities
# ["text"]), refused naming the field otherwise.
UNIMPLEMENTED_CHAT_FIELDS = ("audio", "modalities", "prediction", "reasoning_effort", "verbosity", "web_search_options")


class ChatMessage(BaseModel):
    """A message of the request's history."""

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


class ChatCompletionRequest(SamplingRequest):
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
        check_logprobs_count("top_logprobs", self.top_logprobs)
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


# --------------------------------------------------------------------------------------------------------
# Response


class ChatTopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int]  # the token's text as UTF-8


class ChatLogprobToken(ResponseModel):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(ResponseModel):
    content: list[ChatLogprobToken]
    refusal: None = None  # a refusal is never generated here, but the shape has the key


class FunctionCall(ResponseModel):
    name: str
    arguments: str  # JSON text, as the OpenAI API carries it


class ChatToolCall(ResponseModel):
    index: int | None = Field(default=None, exclude_if=is_none)
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(ResponseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None  # null when the answer is calls only
    tool_calls: list[ChatToolCall] | None = Field(default=None, exclude_if=is_none)
    function_call: FunctionCall | None = Field(default=None, exclude_if=is_none)  # the legacy form: one call


class ChatDelta(ResponseModel):
    """What a stream chunk adds to a choice's message: only the keys that have something."""

    role: Literal["assistant"] | None = Field(default=None, exclude_if=is_none)
    content: str | None = Field(default=None, exclude_if=is_none)
    tool_calls: list[ChatToolCall] | None = Field(default=None, exclude_if=is_none)
    function_call: FunctionCall | None = Field(default=None, exclude_if=is_none)


class ChatCompletionChoice(ResponseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int]


class ChatDeltaChoice(ResponseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int]


class ChatCompletionResponse(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class ChatCompletionChunk(ResponseModel):
    """One event of a stream; the last one before [DONE] holds only usage (stream_options.include_usage)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatDeltaChoice]
    usage: UsageInfo | None = Field(default=None, exclude_if=is_none)
