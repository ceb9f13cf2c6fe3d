"""The FastAPI app: OpenAI-compatible routes over an EngineLoop (extra `vpaged[serve]`).

Endpoints: POST /v1/completions (prompt as text, token ids, or a batch of either), POST /v1/chat/completions
(when the tokenizer has a chat template), both with SSE streaming (`"stream": true`); GET /v1/models,
GET /metrics (Prometheus text: the engine's stats() and request counters), GET /health. A request the engine
refuses (prompt too long, bad sampling parameters) gets HTTP 400 and changes nothing for the others; a client
that disconnects has its request aborted, so its pages go back at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

from ...errors import EngineStepError, VPagedError
from . import protocol as proto
from .generation import Generation
from .loop import EngineLoop
from .metrics import prometheus_text
from .protocol import RequestError

try:
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("the vpaged server needs FastAPI and uvicorn: pip install 'vpaged[serve]'") from e


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _error(
    status: int, message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> JSONResponse:
    return JSONResponse(proto.error_body(message, type_, param, code), status_code=status)


class _Server:
    """The request handlers, bound to one engine loop."""

    def __init__(self, loop: EngineLoop, model_name: str, default_max_tokens: int):
        self.loop = loop
        self.engine = loop.engine
        self.tokenizer = getattr(self.engine, "tokenizer", None)
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        self.created = proto.now()
        self.http_counts: Counter = Counter()

    # ---- helpers
    def _check_model(self, req) -> None:
        if req.model != self.model_name:
            raise RequestError(
                f"model {req.model!r} is not served here; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def _tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer: send the prompt as token ids", param="prompt")
            return list(self.tokenizer.encode(prompt))
        vocab = self._vocab_size()
        if vocab is not None and any(t < 0 or t >= vocab for t in prompt):
            raise RequestError(f"prompt token ids must lie in [0, {vocab})", param="prompt")
        return list(prompt)

    def _vocab_size(self) -> int | None:
        cfg = getattr(getattr(self.engine, "model", None), "config", None)
        if cfg is not None and hasattr(cfg, "get_text_config"):
            cfg = cfg.get_text_config(decoder=True)
        return getattr(cfg, "vocab_size", None)

    def _params(self, req, prompts: list[list[int]], max_tokens: int | None):
        from ..params import SamplingParams

        if max_tokens is None:
            max_tokens = self.default_max_tokens
            limit = getattr(self.engine, "max_model_len", None)
            if isinstance(limit, int) and prompts:
                max_tokens = max(1, min(max_tokens, limit - max(len(p) for p in prompts)))
        try:
            return SamplingParams(**proto.sampling_kwargs(req, max_tokens))
        except (VPagedError, ValueError, TypeError) as e:
            raise RequestError(str(e)) from None

    async def _start(self, req, prompts: list[list[int]], max_tokens: int | None, prefix: str) -> Generation:
        params = self._params(req, prompts, max_tokens)
        gen = Generation(self.loop, self.tokenizer, prompts, params, req.n, req.stop_strings(), prefix)
        try:
            await gen.start()
        except VPagedError as e:  # the engine refused this request (too long, bad parameters, ...)
            raise RequestError(
                str(e), param="prompt" if "prompt" in type(e).__name__.lower() else None, code=type(e).__name__
            ) from None
        return gen

    async def _collect(self, request: Request, gen: Generation) -> None:
        """Wait for every choice to finish; abort if the client goes away."""
        try:
            while not gen.done:
                try:
                    await asyncio.wait_for(gen.next_update(), timeout=1.0)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        gen.abort_unfinished()
                        return
        finally:
            gen.abort_unfinished()

    # ---- endpoints
    async def completions(self, request: Request):
        req = proto.parse_request(proto.CompletionRequest, await _json_body(request))
        self._check_model(req)
        prompts = [self._tokenize(p) for p in req.prompts()]
        rid, created = proto.new_id("cmpl"), proto.now()
        gen = await self._start(req, prompts, req.max_tokens if req.max_tokens is not None else 16, rid)
        if req.stream:

            def chunk(k, text, toks, finish):
                return proto.completion_chunk(
                    rid, self.model_name, created, [proto.completion_choice(k, text, toks, finish)]
                )

            return self._sse_response(
                gen, chunk, [], req, lambda u: proto.completion_chunk(rid, self.model_name, created, [], u)
            )
        await self._collect(request, gen)
        choices = [proto.completion_choice(k, c.text, c.token_ids, c.finish_reason) for k, c in enumerate(gen.choices)]
        return proto.completion_body(rid, self.model_name, created, choices, gen.usage())

    async def chat(self, request: Request):
        req = proto.parse_request(proto.ChatCompletionRequest, await _json_body(request))
        self._check_model(req)
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise RequestError(
                "this model's tokenizer has no chat template: use /v1/completions", code="no_chat_template"
            )
        try:
            text = self.tokenizer.apply_chat_template(req.conversation(), tokenize=False, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - a template may raise anything (e.g. role order)
            raise RequestError(f"the chat template refused these messages: {e}", param="messages") from None
        prompt = list(self.tokenizer.encode(text, add_special_tokens=False))
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        rid, created = proto.new_id("chatcmpl"), proto.now()
        gen = await self._start(req, [prompt], max_tokens, rid)
        if req.stream:

            def chunk(k, text, toks, finish):
                delta = {"content": text} if text or finish is None else {}
                return proto.chat_chunk(
                    rid, self.model_name, created, [proto.chat_delta_choice(k, delta, toks, finish)]
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
        await self._collect(request, gen)
        choices = [proto.chat_choice(k, c.text, c.token_ids, c.finish_reason) for k, c in enumerate(gen.choices)]
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
                for k in changed:
                    ch = gen.choices[k]
                    text, toks = ch.delta()
                    if text or toks or ch.done:
                        yield _sse(chunk(k, text, toks, ch.finish_reason))
            if include_usage:
                yield _sse(usage_chunk(gen.usage()))
            yield "data: [DONE]\n\n"
        finally:
            gen.abort_unfinished()  # the client went away (this generator is cancelled) or the stream ended

    async def metrics(self):
        stats = await asyncio.wrap_future(self.loop.call(self.engine.stats))
        extra = {"engine_step_failures_total": self.loop.step_failures}
        return PlainTextResponse(
            prometheus_text(stats, self.http_counts, extra), media_type="text/plain; version=0.0.4; charset=utf-8"
        )


async def _json_body(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestError(f"the request body is not valid JSON: {e}") from None


def create_app(engine, model_name: str | None = None, default_max_tokens: int = 256) -> FastAPI:
    """A FastAPI app serving `engine`; the engine thread starts and stops with the app's lifespan."""
    loop = EngineLoop(engine)
    name = model_name or getattr(engine, "model_name", None) or "vpaged"
    srv = _Server(loop, name, default_max_tokens)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        loop.start()
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, loop.stop)

    app = FastAPI(title="vpaged", lifespan=lifespan)
    app.state.engine_loop = loop
    app.state.server = srv

    @app.middleware("http")
    async def count(request: Request, call_next):
        response = await call_next(request)
        srv.http_counts[(request.url.path, response.status_code)] += 1
        return response

    @app.exception_handler(RequestError)
    async def bad_request(_request, e: RequestError):
        return _error(400, e.message, param=e.param, code=e.code)

    @app.exception_handler(EngineStepError)
    async def engine_failed(_request, e: EngineStepError):
        return _error(500, str(e), "server_error")

    app.post("/v1/completions")(srv.completions)
    app.post("/v1/chat/completions")(srv.chat)

    @app.get("/v1/models")
    async def models():
        return proto.model_list(srv.model_name, srv.created)

    @app.get("/metrics")
    async def metrics():
        return await srv.metrics()

    @app.get("/health")
    async def health():
        if not loop.alive:
            return _error(503, "the engine thread is not running", "server_error")
        return {"status": "ok"}

    return app
