"""vLLM's /tokenize and /detokenize (lm-eval's `tokenizer_backend=remote` and other clients probe them).

POST /tokenize `{"prompt": str, "add_special_tokens": true}` or `{"messages": [...], "add_generation_prompt":
true, "tools": [...]}` (rendered as /v1/chat/completions renders them, tools included: chat_template.py) ->
`{"count", "max_model_len", "tokens", "token_strs"}` (token_strs only with `"return_token_strs": true`).
POST /detokenize `{"tokens": [...]}` -> `{"prompt": str}`. `model` is optional with one model (when given it
must be the served one); a server of several needs it (router.py). Unknown fields are refused naming them,
as on the generation routes.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from ...errors import RequestError
from .chat.protocol import ChatMessage
from .common.protocol import ResponseModel


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    tools: list | None = None  # with messages: rendered as a chat request's tools are

    def unsupported(self) -> list[str]:
        return []

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise RequestError("give exactly one of prompt and messages", param="prompt")
        if self.tools and self.messages is None:
            raise RequestError("tools go with messages", param="tools")


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    tokens: list[int]

    def unsupported(self) -> list[str]:
        return []

    def check(self) -> None:
        pass


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int | None
    tokens: list[int]
    token_strs: list[str] | None  # null unless return_token_strs


class DetokenizeResponse(ResponseModel):
    prompt: str


def tokenize(renderer, req: TokenizeRequest, max_model_len: int | None, max_chars: int) -> TokenizeResponse:
    """renderer: the model's ChatRenderer (its tokenizer, and how chat requests are rendered)."""
    from .tools import conversation, functions

    tokenizer = renderer.tokenizer
    if tokenizer is None:
        raise RequestError("this model has no tokenizer", code="no_tokenizer")
    if req.prompt is not None:
        text, special = req.prompt, True if req.add_special_tokens is None else req.add_special_tokens
    else:
        fns = functions(req.tools) if req.tools else {}
        tools = [{"type": "function", "function": fn} for fn in fns.values()]
        text = renderer.render(conversation(req.messages), req.add_generation_prompt, tools)
        special = bool(req.add_special_tokens)  # the template already wrote the special tokens
    if len(text) > max_chars:
        raise RequestError(f"at most {max_chars} characters", param="prompt")
    ids = list(tokenizer.encode(text, add_special_tokens=special))
    strs = tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=max_model_len, tokens=ids, token_strs=strs)


def detokenize(tokenizer, req: DetokenizeRequest, vocab_size: int | None) -> DetokenizeResponse:
    if tokenizer is None:
        raise RequestError("this model has no tokenizer", code="no_tokenizer")
    if vocab_size is not None and any(not 0 <= t < vocab_size for t in req.tokens):
        raise RequestError(f"token ids must lie in [0, {vocab_size})", param="tokens")
    return DetokenizeResponse(prompt=tokenizer.decode(req.tokens))
