"""ChatServing: POST /v1/chat/completions for one served model, whole or streamed.

The messages are rendered by the model's chat template (ChatRenderer) with the request's tools; the calls
are parsed from each choice's text by the server's tool-call parser (tools.py) and answered as `tool_calls`,
or in the legacy shape (`function_call`) when the request gave `functions`. Streamed, a choice that may hold
calls goes out whole, parsed, when it ends; one that cannot goes out as its text arrives.
"""

from __future__ import annotations

from ....errors import RequestError
from .. import guided, tools
from ..chat_template import ChatRenderer
from ..common.protocol import UsageInfo, new_id, now
from ..common.responses import error_response, json_response
from ..common.serving import ServingBase
from ..generation import Generation
from ..guard import ServerLimits
from ..guided import grammar_of
from ..logprobs import TokenTexts, chat_logprobs
from ..loop import EngineLoop
from ..streaming import sse_response, stream_chunks
from .protocol import (
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatDeltaChoice,
    ChatResponseMessage,
    ChatToolCall,
    FunctionCall,
)


class ChatServing(ServingBase):
    def __init__(
        self,
        loop: EngineLoop,
        model_name: str,
        default_max_tokens: int,
        limits: ServerLimits,
        token_texts: TokenTexts,
        renderer: ChatRenderer,
        tool_call_parser: str,
    ):
        super().__init__(loop, model_name, default_max_tokens, limits, token_texts)
        self.renderer = renderer  # chat template, and tools it cannot render
        self.tool_call_parser = tool_call_parser  # how tool calls are read from an output (tools.PARSERS)

    async def handle(self, request, req: ChatCompletionRequest):
        """The answer to `req` (request: the Starlette Request, watched for a disconnect)."""
        guided.check_available(self.engine, req)
        stops = self._check_limits(req, 1)
        legacy = req.legacy_functions  # functions / function_call: the legacy names of tools / tool_choice
        fns = tools.functions(req.tools, "functions" if legacy else "tools") if req.tools else {}
        choice = tools.choice_of(req.tool_choice, fns, "function_call" if legacy else "tool_choice")
        tool_grammar = tools.grammar(choice, fns)
        if tool_grammar is not None:
            if grammar_of(req)[0] is not None:
                raise RequestError("tool_choice required / a named function and a response_format", "tool_choice")
            guided.grammars(self.engine, "tool_choice")
        self.renderer.require()
        conversation = tools.conversation(req.messages)  # before rendering: an unreadable part is refused as such
        text = self.renderer.render(conversation, True, [{"type": "function", "function": fn} for fn in fns.values()])
        prompt = list(self.tokenizer.encode(text, add_special_tokens=False))
        limit = self._max_prompt_tokens()
        if limit is not None and len(prompt) > limit:
            self._prompt_too_long(f"{len(prompt)} tokens", limit)
        given = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        self._check_max_tokens([prompt], max_tokens, given)
        self._check_response_size(req, [self._max_tokens_of([prompt], max_tokens)], req.logprobs_count(), chat=True)
        rid, created = new_id("chatcmpl"), now()
        structured = (tool_grammar, "tool_choice") if tool_grammar is not None else None
        gen = await self._start(req, [prompt], max_tokens, rid, stops, structured)
        answer = _Answer(req, choice, self.tool_call_parser)

        def chunk_of(choices: list[ChatDeltaChoice], usage: UsageInfo | None = None) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=rid, created=created, model=self.model_name, choices=choices, usage=usage)

        if req.stream:
            return self._stream(gen, req, answer, chunk_of)
        if not await self._collect(request, gen):
            return error_response(499, "the client closed the request", "invalid_request_error")
        choices = []
        for k, c in enumerate(gen.choices):
            content, calls, finish = answer.message(c)
            choices.append(
                ChatCompletionChoice(
                    index=k,
                    message=ChatResponseMessage(content=content, **calls),
                    logprobs=chat_logprobs(self.token_texts, c.logprobs) if req.logprobs else None,
                    finish_reason=finish,
                    token_ids=c.token_ids,
                )
            )
        body = ChatCompletionResponse(
            id=rid, created=created, model=self.model_name, choices=choices, usage=gen.usage()
        )
        return json_response(body)

    def _stream(self, gen: Generation, req: ChatCompletionRequest, answer: _Answer, chunk_of):
        def chunk(k, text, toks, finish, entries) -> ChatCompletionChunk:
            logprobs = chat_logprobs(self.token_texts, entries) if req.logprobs else None
            if answer.calls_possible:  # text that may hold calls goes out whole, parsed, when the choice ends
                delta = ChatDelta()
                if finish is not None:
                    content, calls, finish = answer.message(gen.choices[k])
                    delta = ChatDelta(content=content or None, **calls)
            else:
                delta = ChatDelta(content=text) if text or finish is None else ChatDelta()
            return chunk_of(
                [ChatDeltaChoice(index=k, delta=delta, logprobs=logprobs, finish_reason=finish, token_ids=toks)]
            )

        # Each choice opens with its role (and empty content), as OpenAI's streams do.
        opening = ChatDelta(role="assistant", content="")
        first = [chunk_of([ChatDeltaChoice(index=k, delta=opening, token_ids=[])]) for k in range(len(gen.choices))]
        events = stream_chunks(gen, chunk, first, req.include_usage_in_stream(), lambda u: chunk_of([], u))
        return sse_response(events)


class _Answer:
    """How a finished choice's text becomes the message: its content, its calls, its finish_reason."""

    def __init__(self, req: ChatCompletionRequest, choice: str, parser: str):
        self.legacy = req.legacy_functions
        self.one_call = self.legacy or req.parallel_tool_calls is False  # a legacy message holds one function_call
        self.choice = choice  # the tool_choice: "auto", "none", "required" or a function's name
        self.parser = parser
        self.calls_possible = choice != "none"

    def message(self, c) -> tuple[str | None, dict[str, list[ChatToolCall] | FunctionCall], str | None]:
        """content, the message's calls as keyword arguments of a message or delta ({"tool_calls": [...]} or
        the legacy {"function_call": ...}, or {}), the finish_reason of the finished choice `c` (ChoiceText)."""
        if not self.calls_possible:
            return c.text, {}, c.finish_reason
        content, calls = tools.parse(c.text, self.choice, self.parser)
        if calls and self.one_call:
            calls = calls[:1]
        if not calls:
            return content, {}, c.finish_reason
        finish = c.finish_reason
        if finish == "stop":
            finish = "function_call" if self.legacy else "tool_calls"
        if self.legacy:
            return content, {"function_call": calls[0].legacy_body()}, finish
        return content, {"tool_calls": [call.body(i) for i, call in enumerate(calls)]}, finish
