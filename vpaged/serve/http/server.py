"""An OpenAI-compatible HTTP server around an LLMEngine (extra `vpaged[serve]`: FastAPI + uvicorn).

    from vpaged.serve import LLMEngine, load_model
    from vpaged.serve.server import create_app, serve
    model, tok = load_model("path/to/model_dir")
    serve(LLMEngine(model, tok, kv_budget_bytes=1 << 30), host="127.0.0.1", port=8000)

Endpoints: POST /v1/completions (prompt as text, token ids, or a batch of either), POST /v1/chat/completions
(when the tokenizer has a chat template), both with SSE streaming (`"stream": true`); GET /v1/models,
GET /metrics (Prometheus text: the engine's stats() and request counters), GET /health.

The engine is not thread-safe, so one background thread (EngineLoop) owns it: it runs engine.step() while
work is pending, runs the commands the HTTP handlers queue (add a request, abort one, read stats) between
steps, and hands each step's outputs to the asyncio queue of the request they belong to. A request the
engine refuses (prompt too long, bad sampling parameters) gets HTTP 400 and changes nothing for the others;
a client that disconnects has its request aborted, so its pages go back at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import socket
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import fields, is_dataclass
from typing import Any

from ...errors import EngineFailure, VPagedError
from . import protocol as proto
from .protocol import ChoiceText, RequestError

log = logging.getLogger("vpaged.serve")

try:
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("the vpaged server needs FastAPI and uvicorn: pip install 'vpaged[serve]'") from e


# --------------------------------------------------------------------------------------------------------
# The engine thread


class EngineLoop:
    """Owns an engine on one thread. Other threads call add/abort/call, which return futures."""

    def __init__(self, engine, idle_wait_s: float = 0.5):
        self.engine = engine
        self._commands: list[tuple[Callable[[], Any], concurrent.futures.Future]] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._idle_wait_s = idle_wait_s
        self._sinks: dict[str, Callable[[Any], None]] = {}  # request id -> where its outputs go (engine thread)
        self._thread = threading.Thread(target=self._run, name="vpaged-engine", daemon=True)
        self.steps = 0
        self.step_failures = 0

    # ---- any thread
    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run fn on the engine thread between two steps."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self._stop:
            fut.set_exception(RuntimeError("the engine loop is stopped"))
            return fut
        with self._lock:
            self._commands.append((fn, fut))
        self._wake.set()
        return fut

    def add(self, prompt, params, request_id: str, sink: Callable[[Any], None]) -> concurrent.futures.Future:
        """Queue a request; `sink` receives each RequestOutput of it (or an EngineFailure) on the engine thread.
        The future raises what engine.add_request raised."""

        def add():
            rid = self.engine.add_request(prompt, params, request_id=request_id)
            self._sinks[rid] = sink
            return rid

        return self.call(add)

    def abort(self, request_id: str) -> concurrent.futures.Future:
        def abort():
            self._sinks.pop(request_id, None)
            with contextlib.suppress(VPagedError, LookupError):  # finished meanwhile: nothing to abort
                self.engine.abort(request_id)

        return self.call(abort)

    def stop(self, timeout: float = 30.0) -> None:
        """Abort what is in flight and end the thread."""
        if not self._thread.is_alive():
            self._stop = True
            return
        done = self.call(self._abort_all)
        with contextlib.suppress(Exception):
            done.result(timeout)
        self._stop = True
        self._wake.set()
        self._thread.join(timeout)

    # ---- engine thread
    def _run_commands(self) -> None:
        with self._lock:
            commands, self._commands = self._commands, []
        for fn, fut in commands:
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the caller, whatever it is
                fut.set_exception(e)

    def _abort_all(self) -> None:
        for rid in list(self._sinks):
            self._sinks.pop(rid, None)
            with contextlib.suppress(Exception):
                self.engine.abort(rid)

    def _run(self) -> None:
        while not self._stop:
            self._wake.clear()  # before running commands: a command queued after this wakes the wait below
            self._run_commands()
            if self._stop:
                break
            if not self.engine.has_unfinished():
                self._wake.wait(self._idle_wait_s)
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # noqa: BLE001 - a failed step must not take the server down
                self.step_failures += 1
                log.exception("engine step failed; ending the requests in flight")
                failure = EngineFailure(f"engine step failed: {type(e).__name__}: {e}")
                sinks = list(self._sinks.values())
                self._abort_all()
                for sink in sinks:
                    sink(failure)
                continue
            self.steps += 1
            for out in outputs:
                sink = self._sinks.get(out.request_id)
                if sink is None:
                    continue
                if out.finished:
                    del self._sinks[out.request_id]
                sink(out)
        self._run_commands()  # answer anything queued during shutdown


# --------------------------------------------------------------------------------------------------------
# One HTTP request's generation: n choices for each of its prompts


class _Generation:
    def __init__(
        self, loop: EngineLoop, tokenizer, prompts: list[list[int]], params, n: int, stops: tuple[str, ...], prefix: str
    ):
        self.loop = loop
        self.prompts = prompts
        self.params = params
        self.n = n
        self.ids = [f"{prefix}-{i}" for i in range(len(prompts))]
        self.choices = [ChoiceText(tokenizer, stops) for _ in range(len(prompts) * n)]
        self.finished = [False] * len(prompts)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.first_token_time: float | None = None

    async def start(self) -> None:
        aloop = asyncio.get_running_loop()
        queued = []
        try:
            for i, (rid, prompt) in enumerate(zip(self.ids, self.prompts)):

                def sink(item, i=i):
                    with contextlib.suppress(RuntimeError):  # the event loop is gone: nobody is listening
                        aloop.call_soon_threadsafe(self.queue.put_nowait, (i, item))

                queued.append(rid)
                await asyncio.wrap_future(self.loop.add(prompt, self.params, rid, sink))
        except BaseException:
            # A refused prompt, or the client left while waiting: withdraw what was queued. Commands run in
            # order on the engine thread, so an abort queued after an add sees its request (or nothing).
            for rid in queued:
                self.loop.abort(rid)
            raise

    @property
    def done(self) -> bool:
        return all(self.finished)

    async def next_update(self) -> list[int]:
        """Wait for the engine's next output; returns the indexes of the choices it changed."""
        i, out = await self.queue.get()
        if isinstance(out, BaseException):
            self.finished[i] = True
            raise out
        changed = []
        for c in out.outputs:
            k = i * self.n + c.index
            ch = self.choices[k]
            if ch.done:
                continue
            ch.update(c.token_ids, c.finish_reason if (c.finish_reason or out.finished) else None)
            if out.finished and ch.finish_reason is None:
                ch.finish_reason = "length"
            changed.append(k)
        if self.first_token_time is None and any(self.choices[k].token_ids for k in changed):
            self.first_token_time = time.perf_counter()
        if out.finished:
            self.finished[i] = True
        elif all(ch.done for ch in self.choices[i * self.n : (i + 1) * self.n]):
            # every choice met a stop string: the engine need not go on
            self.finished[i] = True
            self.loop.abort(self.ids[i])
        return changed

    def abort_unfinished(self) -> None:
        for i, rid in enumerate(self.ids):
            if not self.finished[i]:
                self.finished[i] = True
                self.loop.abort(rid)

    def usage(self) -> dict:
        return proto.usage(sum(len(p) for p in self.prompts), sum(len(c.token_ids) for c in self.choices))


# --------------------------------------------------------------------------------------------------------
# Metrics

# EngineStats fields that only ever grow (Prometheus counters); every other numeric field is a gauge.
_COUNTERS = {
    "prefix_hit_tokens",
    "preemptions_swap",
    "preemptions_recompute",
    "requests_finished",
    "prompt_tokens_total",
    "generation_tokens_total",
    "steps",
    "requests_aborted",
    "requests_added",
}


def _stats_items(stats) -> list[tuple[str, float]]:
    if is_dataclass(stats):
        items = [(f.name, getattr(stats, f.name)) for f in fields(stats)]
    else:
        items = list(vars(stats).items())
    return [(k, float(v)) for k, v in items if isinstance(v, (int, float)) and not isinstance(v, bool)]


def prometheus_text(stats, http_counts: Counter, extra: dict[str, float] | None = None) -> str:
    """The Prometheus exposition text: one metric per numeric field of the engine's stats, `vpaged_<field>`."""
    lines = []
    for name, value in _stats_items(stats):
        metric = f"vpaged_{name}"
        kind = "counter" if name in _COUNTERS or name.endswith("_total") or name.startswith("time_") else "gauge"
        lines += [f"# HELP {metric} LLMEngine.stats().{name}", f"# TYPE {metric} {kind}", f"{metric} {value!r}"]
    for name, value in (extra or {}).items():
        lines += [f"# TYPE vpaged_{name} counter", f"vpaged_{name} {float(value)!r}"]
    lines += [
        "# HELP vpaged_http_requests_total HTTP requests by path and status",
        "# TYPE vpaged_http_requests_total counter",
    ]
    for (path, status), count in sorted(http_counts.items()):
        lines.append(f'vpaged_http_requests_total{{path="{path}",status="{status}"}} {float(count)!r}')
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------------
# The app


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

    async def _start(self, req, prompts: list[list[int]], max_tokens: int | None, prefix: str) -> _Generation:
        params = self._params(req, prompts, max_tokens)
        gen = _Generation(self.loop, self.tokenizer, prompts, params, req.n, req.stop_strings(), prefix)
        try:
            await gen.start()
        except VPagedError as e:  # the engine refused this request (too long, bad parameters, ...)
            raise RequestError(
                str(e), param="prompt" if "prompt" in type(e).__name__.lower() else None, code=type(e).__name__
            ) from None
        return gen

    async def _collect(self, request: Request, gen: _Generation) -> None:
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
                except EngineFailure as e:
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

    @app.exception_handler(EngineFailure)
    async def engine_failed(_request, e: EngineFailure):
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


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve(
    engine,
    host: str = "127.0.0.1",
    port: int = 8000,
    model_name: str | None = None,
    log_level: str = "info",
    default_max_tokens: int = 256,
    on_ready: Callable[[str], None] | None = None,
) -> None:
    """Serve until interrupted (Ctrl-C / SIGTERM). Port 0 takes a free port; `on_ready(url)` is called once
    the server accepts connections."""
    sock = _bind(host, port)
    server = uvicorn.Server(
        uvicorn.Config(create_app(engine, model_name, default_max_tokens), log_level=log_level, lifespan="on")
    )

    async def announce():
        while not server.started:
            await asyncio.sleep(0.01)
        on_ready(_url(sock))

    async def main():
        task = asyncio.ensure_future(announce()) if on_ready is not None else None
        try:
            await server.serve(sockets=[sock])
        finally:
            if task is not None:
                task.cancel()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:  # uvicorn shut down gracefully, then re-raised the Ctrl-C it caught
        pass
    finally:
        sock.close()


class ServerThread:
    """Runs the server on a background thread, on a port the OS picks unless one is given.

    with ServerThread(engine) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
    """

    def __init__(
        self,
        engine,
        host: str = "127.0.0.1",
        port: int = 0,
        model_name: str | None = None,
        default_max_tokens: int = 256,
        log_level: str = "warning",
    ):
        self.app = create_app(engine, model_name, default_max_tokens)
        self._sock = _bind(host, port)
        self.host, self.port = self._sock.getsockname()[:2]
        self.url = _url(self._sock)
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level=log_level, lifespan="on"))
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self._sock]}, name="vpaged-http", daemon=True
        )

    def start(self, timeout: float = 30.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)
        self._sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
