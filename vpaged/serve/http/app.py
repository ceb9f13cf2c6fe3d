"""The FastAPI app: OpenAI-compatible routes over one EngineLoop per served model (extra `vpaged[serve]`).

Endpoints: POST /v1/completions (prompt as text, token ids, or a batch of either), POST /v1/chat/completions
(when the tokenizer has a chat template), both with SSE streaming (`"stream": true`) and logprobs (logprobs.py);
GET /v1/models and /v1/models/{id}, POST /tokenize and /detokenize (vLLM's, tokenize.py), GET /metrics
(Prometheus text: the engine's stats() and request counters; once the engine is down, why), GET /health (503
with the cause once the engine cannot serve, e.g. a tensor-parallel rank lost while idle). A request the
engine refuses (prompt too long, bad sampling parameters) gets HTTP 400 and changes nothing for the others; a
client that disconnects has its request aborted, streamed or not, so its pages go back at once. Every error
answers in the OpenAI error shape (unknown routes and methods included). The limits of ServerLimits are
checked before any work: those about HTTP by the Guard middleware (guard.py), those about what is asked for
here. Several models in one app: router.py (ModelRouter) picks each request's model by its `model` field.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

from ...errors import (
    EngineStepError,
    EngineUnavailableError,
    InvalidArgumentError,
    ModelNotFoundError,
    NoAllowedTokenError,
    TensorParallelError,
    VPagedError,
)
from . import guided, tools
from . import protocol as proto
from . import tokenize as tok
from .admission import RequestChecks
from .chat_template import ChatRenderer
from .generation import Generation
from .guard import Guard, ServerLimits
from .guided import grammar_of
from .logprobs import CompletionLogprobs, TokenTexts, chat_logprobs
from .loop import EngineLoop
from .metrics import prometheus_text
from .protocol import RequestError
from .router import ModelRouter, served_engines

try:
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("the vpaged server needs FastAPI and uvicorn: pip install 'vpaged[serve]'") from e


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _error(
    status: int, message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> JSONResponse:
    return JSONResponse(proto.error_body(message, type_, param, code), status_code=status)


class _Server(RequestChecks):
    """The request handlers of one served model, bound to its engine loop (ModelRouter picks the model)."""

    def __init__(
        self,
        loop: EngineLoop,
        model_name: str,
        default_max_tokens: int,
        limits: ServerLimits,
        tool_call_parser: str,
        http_counts: Counter,
    ):
        self.loop = loop
        self.limits = limits
        self.engine = loop.engine
        self.tokenizer = getattr(self.engine, "tokenizer", None)
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        self.created = proto.now()
        self.http_counts = http_counts  # the app's, counted by its Guard (one for all the models)
        self.token_texts = TokenTexts(self.tokenizer)  # token id -> text, for logprobs
        self.tool_call_parser = tool_call_parser  # how tool calls are read from an output (tools.PARSERS)
        self.renderer = ChatRenderer(self.tokenizer, model_name)  # chat template, and tools it cannot render

    # ---- helpers (the checks of what a request asks for: RequestChecks)
    def _params(self, req, prompts: list[list[int]], max_tokens: int | None, structured=None):
        from ..sample.params import SamplingParams

        kwargs = proto.sampling_kwargs(req, self._max_tokens_of(prompts, max_tokens))
        if structured is not None:
            kwargs["structured"] = structured
        vocab = self._vocab_size()
        if vocab is not None and any(t >= vocab for t in kwargs.get("logit_bias", ())):
            raise RequestError(f"logit_bias keys must be token ids in [0, {vocab})", param="logit_bias")
        try:
            return SamplingParams(**kwargs)
        except (VPagedError, ValueError, TypeError) as e:
            # SamplingParams names the field first in its messages: the 400 names it too (as the client did)
            field = str(e).split(" ", 1)[0]
            param = field if field in kwargs else None
            if param == "max_tokens" and getattr(req, "max_completion_tokens", None) is not None:
                param = "max_completion_tokens"
            raise RequestError(str(e), param=param) from None

    async def _start(
        self,
        req,
        prompts: list[list[int]],
        max_tokens: int | None,
        prefix: str,
        stops: tuple[str, ...],
        structured: tuple | None = None,
        keep_outputs: bool = True,
    ) -> Generation:
        """structured: (GrammarSpec, the field it comes from) in place of the request's own (tool calls);
        keep_outputs: Generation's (False: the prompts are only scored)."""
        spec, field = structured if structured is not None else grammar_of(req)
        params = self._params(req, prompts, max_tokens, spec)
        if spec is not None:
            await guided.compile_off_thread(self.engine, spec, field)
        gen = Generation(self.loop, self.tokenizer, prompts, params, req.n, stops, prefix, keep_outputs)
        try:
            await gen.start()
        except EngineStepError:  # the engine cannot serve at all (a lost rank: 503), not a refusal of this request
            raise
        except VPagedError as e:  # the engine refused this request (too long, bad parameters, ...)
            param = proto.refused_param(e, req.model_fields_set)
            if param is None and spec is not None and isinstance(e, NoAllowedTokenError):
                param = field  # the grammar itself allows no token: the field it came from (guided_json, ...)
            raise RequestError(str(e), param=param, code=type(e).__name__) from None
        return gen

    async def _collect(self, request: Request, gen: Generation) -> bool:
        """Wait for every choice to finish; False (the request aborted) if the client went away meanwhile.

        The client is checked after every update and every 0.2 s without one, so a busy generation (an update
        each step) notices a disconnect as soon as an idle one does."""
        try:
            while not gen.done:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(gen.next_update(), timeout=0.2)
                if await request.is_disconnected():
                    return False
            return True
        finally:
            gen.abort_unfinished()

    # ---- endpoints
    async def completions(self, request: Request, req: proto.CompletionRequest):
        guided.check_available(self.engine, req)
        stops = self._check_limits(req, len(req.prompts()))
        prompts = [self._tokenize(p) for p in req.prompts()]
        self._check_max_tokens(prompts, req.max_tokens, "max_tokens")
        rid, created = proto.new_id("cmpl"), proto.now()
        # max_tokens 0 (echo): the engine draws one token that no choice takes
        max_tokens = 1 if req.scores_only else (req.max_tokens if req.max_tokens is not None else 16)
        generated = 0 if req.scores_only else max_tokens
        sizes = [generated + (len(p) if req.echo else 0) for p in prompts]
        self._check_response_size(req, sizes, req.logprobs, chat=False)
        gen = await self._start(req, prompts, max_tokens, rid, stops, keep_outputs=not req.scores_only)
        echoes = [self._echo_text(p, ids) for p, ids in zip(req.prompts(), prompts)] if req.echo else None
        with_logprobs = req.logprobs is not None
        if req.stream:
            formats = [CompletionLogprobs(self.token_texts) for _ in gen.choices]
            echoed: set[int] = set()

            def chunk(k, text, toks, finish, entries):
                i, logprobs = k // req.n, None
                if echoes is not None and k not in echoed:  # the prompt goes out with the choice's first chunk
                    echoed.add(k)
                    text = echoes[i] + text
                    if with_logprobs:
                        logprobs = formats[k].echo_body(prompts[i], gen.prompt_logprobs[i], entries)
                elif with_logprobs:
                    logprobs = formats[k].body(entries)
                choice = proto.completion_choice(k, text, toks, finish, logprobs)
                return proto.completion_chunk(rid, self.model_name, created, [choice])

            return self._sse_response(
                gen, chunk, [], req, lambda u: proto.completion_chunk(rid, self.model_name, created, [], u)
            )
        if not await self._collect(request, gen):
            return _error(499, "the client closed the request", "invalid_request_error")
        choices = []
        for k, c in enumerate(gen.choices):
            i, text, logprobs = k // req.n, c.text, None
            if with_logprobs:
                fmt = CompletionLogprobs(self.token_texts)
                logprobs = (
                    fmt.echo_body(prompts[i], gen.prompt_logprobs[i], c.logprobs) if echoes else fmt.body(c.logprobs)
                )
            if echoes is not None:
                text = echoes[i] + text
            choices.append(proto.completion_choice(k, text, c.token_ids, c.finish_reason, logprobs))
        return proto.completion_body(rid, self.model_name, created, choices, gen.usage())

    def _echo_text(self, prompt: str | list[int], ids: list[int]) -> str:
        """What echo puts before a completion: the prompt as the client sent it (token ids: their decode)."""
        if isinstance(prompt, str):
            return prompt
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    async def chat(self, request: Request, req: proto.ChatCompletionRequest):
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
        conversation = req.conversation()  # a part the server cannot read is refused as such, not as a template error
        text = self.renderer.render(conversation, True, [{"type": "function", "function": fn} for fn in fns.values()])
        prompt = list(self.tokenizer.encode(text, add_special_tokens=False))
        limit = self._max_prompt_tokens()
        if limit is not None and len(prompt) > limit:
            self._prompt_too_long(f"{len(prompt)} tokens", limit)
        given = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        self._check_max_tokens([prompt], max_tokens, given)
        self._check_response_size(req, [self._max_tokens_of([prompt], max_tokens)], req.logprobs_count(), chat=True)
        rid, created = proto.new_id("chatcmpl"), proto.now()
        structured = (tool_grammar, "tool_choice") if tool_grammar is not None else None
        gen = await self._start(req, [prompt], max_tokens, rid, stops, structured)
        with_logprobs = bool(req.logprobs)
        calls_possible = choice != "none"

        def message(c) -> tuple[str | None, dict, str | None]:
            """content, the message's calls ({"tool_calls": [...]} or legacy {"function_call": {...}}, or {}),
            finish_reason of a finished choice"""
            if not calls_possible:
                return c.text, {}, c.finish_reason
            content, calls = tools.parse(c.text, choice, self.tool_call_parser)
            if calls and (legacy or req.parallel_tool_calls is False):
                calls = calls[:1]  # a legacy message holds one function_call
            if not calls:
                return content, {}, c.finish_reason
            finish = c.finish_reason
            if finish == "stop":
                finish = "function_call" if legacy else "tool_calls"
            if legacy:
                return content, {"function_call": calls[0].legacy_body()}, finish
            return content, {"tool_calls": [call.body(i) for i, call in enumerate(calls)]}, finish

        if req.stream:

            def chunk(k, text, toks, finish, entries):
                logprobs = chat_logprobs(self.token_texts, entries) if with_logprobs else None
                if calls_possible:  # text that may hold calls goes out whole, parsed, when the choice ends
                    delta = {}
                    if finish is not None:
                        content, calls, finish = message(gen.choices[k])
                        delta = {"content": content} if content else {}
                        delta.update(calls)
                else:
                    delta = {"content": text} if text or finish is None else {}
                return proto.chat_chunk(
                    rid, self.model_name, created, [proto.chat_delta_choice(k, delta, toks, finish, logprobs)]
                )

            first = [
                proto.chat_chunk(
                    rid,
                    self.model_name,
                    created,
                    [proto.chat_delta_choice(k, {"role": "assistant", "content": ""}, [], None)],
                )
                for k in range(len(gen.choices))
            ]
            return self._sse_response(
                gen, chunk, first, req, lambda u: proto.chat_chunk(rid, self.model_name, created, [], u)
            )
        if not await self._collect(request, gen):
            return _error(499, "the client closed the request", "invalid_request_error")
        choices = []
        for k, c in enumerate(gen.choices):
            content, calls, finish = message(c)
            logprobs = chat_logprobs(self.token_texts, c.logprobs) if with_logprobs else None
            choices.append(proto.chat_choice(k, content, c.token_ids, finish, logprobs, calls))
        return proto.chat_body(rid, self.model_name, created, choices, gen.usage())

    def _sse_response(self, gen, chunk, first, req, usage_chunk) -> StreamingResponse:
        body = self._stream_chunks(gen, chunk, first, req.include_usage_in_stream(), usage_chunk)
        return StreamingResponse(
            body, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )

    async def _stream_chunks(self, gen, chunk, first, include_usage, usage_chunk) -> AsyncIterator[str]:
        try:
            for c in first:
                yield _sse(c)
            while not gen.done:
                try:
                    changed = await gen.next_update()
                except EngineStepError as e:
                    yield _sse(proto.error_body(str(e), "server_error"))
                    return
                except RequestError as e:  # found mid-stream (no token left that the request allows)
                    yield _sse(proto.error_body(e.message, param=e.param, code=e.code))
                    return
                for k in changed:
                    ch = gen.choices[k]
                    start = ch.sent_tokens
                    text, toks = ch.delta()
                    if text or toks or ch.done:
                        yield _sse(chunk(k, text, toks, ch.finish_reason, ch.new_logprobs(start, len(toks))))
            if include_usage:
                yield _sse(usage_chunk(gen.usage()))
            yield "data: [DONE]\n\n"
        finally:
            gen.abort_unfinished()  # the client went away (this generator is cancelled) or the stream ended

    def card(self) -> dict:
        """This model's entry of /v1/models."""
        return proto.model_card(self.model_name, self.created, self._max_model_len())

    def tokenize(self, req: tok.TokenizeRequest) -> dict:
        limit = self._max_prompt_tokens()
        return tok.tokenize(self.renderer, req, self._max_model_len(), 64 * limit if limit else 1 << 24)

    def detokenize(self, req: tok.DetokenizeRequest) -> dict:
        return tok.detokenize(self.tokenizer, req, self._vocab_size())

    def failure(self) -> Exception | None:
        """Why the engine cannot serve (the loop's fatal error, why its thread died, or a tensor-parallel group
        found broken while the loop has not looked yet), else None."""
        return self.loop.fatal or self.loop.dead or getattr(self.engine, "broken", None)

    async def metrics(self):
        extra = {"engine_step_failures_total": self.loop.step_failures}
        failure = self.failure()
        stats = None
        if failure is None:
            try:
                stats = await asyncio.wrap_future(self.loop.call(self.engine.stats))
            except (TensorParallelError, EngineUnavailableError) as e:  # broke, died or stopped meanwhile
                failure = e
        # Answered 200 also when the engine is down, so that a scraper records why (vpaged_engine_up 0 and
        # vpaged_engine_failure_info's reason) instead of a failed scrape.
        return PlainTextResponse(
            prometheus_text(stats, self.http_counts, extra, failure=None if failure is None else str(failure)),
            media_type="text/plain; version=0.0.4; charset=utf-8",
        )


def create_app(
    engine,
    model_name: str | None = None,
    default_max_tokens: int = 256,
    limits: ServerLimits | None = None,
    tool_call_parser: str = "hermes",
) -> FastAPI:
    """A FastAPI app serving `engine`, or several models: a dict {served name: engine} (model_name None), each
    with its own engine thread; the threads start and stop with the app's lifespan. `limits`: what one request
    may ask for (ServerLimits(): the defaults); tool_call_parser: how tool calls are read from outputs (a key
    of tools.PARSERS)."""
    if tool_call_parser not in tools.PARSERS:
        raise InvalidArgumentError(f"tool_call_parser must be one of {sorted(tools.PARSERS)}, got {tool_call_parser!r}")
    engines = served_engines(engine, model_name)
    limits = limits if limits is not None else ServerLimits()
    counts: Counter = Counter()
    router = ModelRouter(
        {
            name: _Server(EngineLoop(e, name=name), name, default_max_tokens, limits, tool_call_parser, counts)
            for name, e in engines.items()
        }
    )

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        router.start()
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, router.stop)

    app = FastAPI(title="vpaged", lifespan=lifespan)
    app.state.router = router
    app.state.server = router.first  # the one model's (of a one-model app; the first given of several)
    app.state.engine_loop = router.first.loop
    app.add_middleware(Guard, limits=limits, counts=counts)

    @app.exception_handler(RequestError)
    async def bad_request(_request, e: RequestError):
        return _error(404 if isinstance(e, ModelNotFoundError) else 400, e.message, param=e.param, code=e.code)

    @app.exception_handler(EngineStepError)
    async def engine_failed(_request, e: EngineStepError):
        return _error(500, str(e), "server_error")

    @app.exception_handler(TensorParallelError)
    async def engine_lost_a_rank(_request, e: TensorParallelError):
        return _error(503, str(e), "server_error")

    @app.exception_handler(EngineUnavailableError)
    async def engine_unavailable(_request, e: EngineUnavailableError):  # its thread died, or the server stops
        return _error(503, str(e), "server_error")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request, e: StarletteHTTPException):
        # unknown routes (404) and methods (405) answer in the OpenAI error shape too
        response = _error(
            e.status_code, str(e.detail), "invalid_request_error" if e.status_code < 500 else "server_error"
        )
        for k, v in (e.headers or {}).items():
            response.headers[k] = v
        return response

    @app.exception_handler(Exception)
    async def unexpected(_request, e: Exception):
        return _error(500, f"internal error: {type(e).__name__}", "server_error")

    app.post("/v1/completions")(router.completions)
    app.post("/v1/chat/completions")(router.chat)
    app.get("/v1/models")(router.models)
    app.get("/v1/models/{model_id:path}")(router.model)
    app.post("/tokenize")(router.tokenize)
    app.post("/detokenize")(router.detokenize)
    app.get("/metrics")(router.metrics)
    app.get("/health")(router.health)

    async def responses_not_served():
        # The Responses API keeps conversations server-side; this server is stateless: say so, not a bare 404.
        return _error(
            404,
            "the Responses API (/v1/responses) is not served by vpaged: use POST /v1/chat/completions "
            "(openai: client.chat.completions.create) or /v1/completions",
            code="responses_api_not_served",
        )

    for path in ("/v1/responses", "/v1/responses/{rest:path}"):
        app.api_route(path, methods=["GET", "POST", "DELETE"], include_in_schema=False)(responses_not_served)
    return app
