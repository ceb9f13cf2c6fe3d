"""/v1/completions on the wire: the request (a prompt as text, token ids, or a batch of either; echo; the
legacy integer logprobs) and the response models, whole (CompletionResponse) and streamed (CompletionChunk).

A choice's `token_ids` is an extension (OpenAI clients keep unknown fields): models without a tokenizer answer
with token ids only, and clients can check exactly what was generated.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from ....errors import RequestError
from ..common.protocol import ResponseModel, SamplingRequest, UsageInfo, check_logprobs_count, is_none


class CompletionRequest(SamplingRequest):
    # A string, a list of token ids, or a batch of either: each prompt becomes its own engine request.
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    # The legacy completions form: an int, the alternatives per token (0: the chosen token's logprob only).
    logprobs: int | None = None

    def check(self) -> None:
        super().check()
        check_logprobs_count("logprobs", self.logprobs)
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


class CompletionLogprobs(ResponseModel):
    """The legacy logprobs of one choice, one entry per token in each list. With echo the prompt's tokens come
    first, and the first of them has null for its logprob and its alternatives (no position predicts it)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)  # {token text: logprob}
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(ResponseModel):
    """A choice of a whole answer, or its piece in one stream chunk (text and token_ids: the new ones)."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int]


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionChunk(ResponseModel):
    """One event of a stream; the last one before [DONE] holds only usage (stream_options.include_usage)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = Field(default=None, exclude_if=is_none)
