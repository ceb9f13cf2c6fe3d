"""ModelRouter: the models one server serves, by name, each with its own request handlers and engine loop.

One engine and one engine thread (loop.py) per model, so a failed step of one model's engine ends only that
model's requests, and one model's long step never holds up another's. Every request goes to the model its
`model` field names:

- one model: as before: a request naming another model gets 400 `model_not_found` (what earlier releases
  answered, kept for their clients); /tokenize and /detokenize may leave `model` out.
- several: a model not served gets 404 `model_not_found` (as OpenAI answers); leaving `model` out (the
  completion routes' schema requires it anyway; /tokenize and /detokenize) gets 400 naming the field.

GET /v1/models lists every model. GET /metrics of several models labels each engine's series with
model="NAME" (model_metrics.py); the HTTP request counts are the server's, unlabelled. GET /health answers
200 only while every model serves, else 503 naming those that cannot and why: one server is one process,
restarted as a whole; `models` in its body gives each model's state ("ok" or the cause). A model whose
machine-wide shared budget is removed, replaced (until its member joins the new one) or damaged answers
503 with the cause there and to new requests; one waiting on a member that does not answer, at /health.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping
from typing import Any

from ...errors import InvalidArgumentError, ModelNotFoundError, RequestError
from ..stores.base import budget_health
from . import tokenize as tok
from .chat.protocol import ChatCompletionRequest
from .common.parse import read_request
from .common.protocol import error_body
from .common.responses import json_response
from .completion.protocol import CompletionRequest
from .model_cards import ModelList
from .model_metrics import labelled_exposition

try:
    from fastapi import Request
    from fastapi.responses import JSONResponse, PlainTextResponse
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("the vpaged server needs FastAPI and uvicorn: pip install 'vpaged[serve]'") from e

# Metric families one Guard counts for the whole server: the same in every model's text (model_metrics.py).
SERVER_WIDE_METRICS = ("vpaged_http_requests_total",)


def served_engines(engine, model_name: str | None) -> dict[str, Any]:
    """{served name: engine} of create_app's arguments: one engine (named model_name, else its model_name,
    else "vpaged"), or a mapping {name: engine} of several (model_name None)."""
    if not isinstance(engine, Mapping):
        return {model_name or getattr(engine, "model_name", None) or "vpaged": engine}
    if model_name is not None:
        raise InvalidArgumentError("model_name names one engine; several are named by their mapping's keys")
    if not engine:
        raise InvalidArgumentError("no model to serve: the mapping of engines is empty")
    for name in engine:
        if not isinstance(name, str) or not name.strip():
            raise InvalidArgumentError(f"a served model's name must be a non-empty string, got {name!r}")
    if len({id(e) for e in engine.values()}) != len(engine):
        raise InvalidArgumentError("each served model needs an engine of its own (one thread owns an engine)")
    return dict(engine)


class ModelRouter:
    """The served models by name (a ServedModel each: served_model.py) and the routes that pick one."""

    def __init__(self, servers: dict[str, Any]):
        self.servers = servers
        self.first = next(iter(servers.values()))
        self.several = len(servers) > 1

    # ---- the engine loops
    def loops(self) -> list:
        return [server.loop for server in self.servers.values()]

    def start(self) -> None:
        for loop in self.loops():
            loop.start()

    def stop(self) -> None:
        """Every loop aborts what it has in flight and ends; side by side, as each waits for its step."""
        threads = [threading.Thread(target=loop.stop, name="vpaged-engine-stop") for loop in self.loops()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    # ---- which model
    def _names(self) -> str:
        return ", ".join(repr(name) for name in self.servers)

    def pick(self, name: str | None):
        """The ServedModel named `name` (None: the request named none)."""
        if not self.several:
            if name is not None and name != self.first.model_name:
                raise RequestError(
                    f"model {name!r} is not served here; this server serves {self.first.model_name!r}",
                    param="model",
                    code="model_not_found",
                )
            return self.first
        if name is None:
            raise RequestError(f"this server serves several models ({self._names()}): name one in model", "model")
        server = self.servers.get(name)
        if server is None:
            raise ModelNotFoundError(
                f"model {name!r} is not served here; this server serves {self._names()}",
                param="model",
                code="model_not_found",
            )
        return server

    # ---- routes
    async def completions(self, request: Request):
        req = await read_request(request, CompletionRequest)
        server = self.pick(req.model)
        return _budget_refusal(server) or await server.completions.handle(request, req)

    async def chat(self, request: Request):
        req = await read_request(request, ChatCompletionRequest)
        server = self.pick(req.model)
        return _budget_refusal(server) or await server.chat.handle(request, req)

    async def models(self):
        return json_response(ModelList(data=[server.card() for server in self.servers.values()]))

    async def model(self, model_id: str):
        server = self.servers.get(model_id)
        if server is None:
            raise ModelNotFoundError(f"model {model_id!r} is not served here", param="model", code="model_not_found")
        return json_response(server.card())

    async def tokenize(self, request: Request):
        req = await read_request(request, tok.TokenizeRequest)
        return json_response(self.pick(req.model).tokenize(req))

    async def detokenize(self, request: Request):
        req = await read_request(request, tok.DetokenizeRequest)
        return json_response(self.pick(req.model).detokenize(req))

    async def metrics(self):
        if not self.several:
            return await self.first.metrics()
        answers = await asyncio.gather(*(server.metrics() for server in self.servers.values()))
        texts = {name: bytes(answer.body).decode() for name, answer in zip(self.servers, answers)}
        return PlainTextResponse(labelled_exposition(texts, SERVER_WIDE_METRICS), media_type=answers[0].media_type)

    async def health(self):
        problems = {name: _problem(server) for name, server in self.servers.items()}
        down = {name: p for name, p in problems.items() if p is not None}
        if not self.several:
            if not down:
                return {"status": "ok"}
            message, code = down[self.first.model_name]
            return JSONResponse(error_body(message, "server_error", code=code), status_code=503)
        states = {name: "ok" if p is None else p[0] for name, p in problems.items()}
        if not down:
            return {"status": "ok", "models": states}
        message = "; ".join(f"model {name!r} cannot serve: {p[0]}" for name, p in down.items())
        body = error_body(message, "server_error", code=next(iter(down.values()))[1])
        return JSONResponse({**body, "models": states}, status_code=503)


def _problem(server) -> tuple[str, str | None] | None:
    """Why the model cannot serve, and the error's type as the code, or None while it can."""
    failure = server.failure()
    if failure is not None:  # a tensor-parallel engine that lost a rank, busy or idle: the cause
        return str(failure), type(failure).__name__
    if not server.loop.alive:
        return "the engine thread is not running", None
    budget = budget_health(getattr(server.engine, "store", None))
    if budget is not None and not budget.ok:  # removed, replaced, damaged, or waiting on a member that is stopped
        return budget.message, f"shared_budget_{budget.kind}"
    return None


def _budget_refusal(server) -> JSONResponse | None:
    """503 for a new request while the model's shared budget is unusable (removed, replaced and not joined
    again yet, or damaged: memory/budget_health.py), rather than a request that would fail in the engine."""
    budget = budget_health(getattr(server.engine, "store", None))
    if budget is None or budget.serves:
        return None
    body = error_body(budget.message, "server_error", code=f"shared_budget_{budget.kind}")
    return JSONResponse(body, status_code=503)
