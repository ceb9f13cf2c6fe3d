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

This file holds the routes and the app's lifecycle only: each model is a ServedModel (served_model.py), whose
endpoints are completion/serving.py and chat/serving.py, their wire format in {completion,chat}/protocol.py
and common/protocol.py, streams framed by streaming.py.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter

from ...errors import (
    EngineStepError,
    EngineUnavailableError,
    InvalidArgumentError,
    ModelNotFoundError,
    RequestError,
    TensorParallelError,
)
from . import tools
from .common.responses import error_response
from .guard import Guard, ServerLimits
from .loop import EngineLoop
from .router import ModelRouter, served_engines
from .served_model import ServedModel

try:
    from fastapi import FastAPI
    from starlette.exceptions import HTTPException as StarletteHTTPException
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("the vpaged server needs FastAPI and uvicorn: pip install 'vpaged[serve]'") from e


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
            name: ServedModel(EngineLoop(e, name=name), name, default_max_tokens, limits, tool_call_parser, counts)
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
        return error_response(404 if isinstance(e, ModelNotFoundError) else 400, e.message, param=e.param, code=e.code)

    @app.exception_handler(EngineStepError)
    async def engine_failed(_request, e: EngineStepError):
        return error_response(500, str(e), "server_error")

    @app.exception_handler(TensorParallelError)
    async def engine_lost_a_rank(_request, e: TensorParallelError):
        return error_response(503, str(e), "server_error")

    @app.exception_handler(EngineUnavailableError)
    async def engine_unavailable(_request, e: EngineUnavailableError):  # its thread died, or the server stops
        return error_response(503, str(e), "server_error")

    @app.exception_handler(StarletteHTTPException)
    async def httperror_response(_request, e: StarletteHTTPException):
        # unknown routes (404) and methods (405) answer in the OpenAI error shape too
        response = error_response(
            e.status_code, str(e.detail), "invalid_request_error" if e.status_code < 500 else "server_error"
        )
        for k, v in (e.headers or {}).items():
            response.headers[k] = v
        return response

    @app.exception_handler(Exception)
    async def unexpected(_request, e: Exception):
        return error_response(500, f"internal error: {type(e).__name__}", "server_error")

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
        return error_response(
            404,
            "the Responses API (/v1/responses) is not served by vpaged: use POST /v1/chat/completions "
            "(openai: client.chat.completions.create) or /v1/completions",
            code="responses_api_not_served",
        )

    for path in ("/v1/responses", "/v1/responses/{rest:path}"):
        app.api_route(path, methods=["GET", "POST", "DELETE"], include_in_schema=False)(responses_not_served)
    return app
