"""An OpenAI-compatible HTTP server around an LLMEngine (extra `vpaged[serve]`: FastAPI + uvicorn).

    from vpaged.serve import LLMEngine, load_model
    from vpaged.serve.http.server import create_app, serve
    model, tok = load_model("path/to/model_dir")
    serve(LLMEngine(model, tok, kv_budget_bytes=1 << 30), host="127.0.0.1", port=8000)

Endpoints: POST /v1/completions (prompt as text, token ids, or a batch of either), POST /v1/chat/completions
(when the tokenizer has a chat template), both with SSE streaming (`"stream": true`); GET /v1/models,
GET /metrics (Prometheus text: the engine's stats() and request counters), GET /health.

Several models in one server: `serve({"a": engine_a, "b": engine_b})`, one engine thread each, requests
routed by their `model` field (router.py).

The parts, one concept each: loop.py (EngineLoop, the thread that owns the engine), generation.py (one HTTP
request's choices), completion/ and chat/ (each endpoint's wire format in protocol.py, its handler in
serving.py), common/ (what they share), streaming.py (SSE framing), served_model.py (one model's handlers),
metrics.py (the Prometheus text), app.py (the FastAPI app and its routes), router.py (the served models by
name), model_metrics.py (/metrics of several), and this file:
running the app with uvicorn (serve, ServerThread). create_app, EngineLoop, ServerLimits and prometheus_text
are importable from here too.

Connections: the listening socket is a TCP one by protocol (IPPROTO_TCP), so asyncio sets TCP_NODELAY on
every accepted connection (and the protocol sets it again): small responses on a kept-alive connection are not
held back by Nagle's algorithm waiting for a delayed ACK (40 ms). A connection must send each request's
headers within ServerLimits.header_timeout_s (a slowloris sender is closed) and is closed after
keep_alive_s idle. Unless ServerLimits.allowed_hosts says otherwise, the Host header must name the bind
address (for a loopback address: localhost, 127.0.0.1 or ::1; a wildcard address checks nothing).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import socket
import threading
import time
from collections.abc import Callable

from .app import create_app
from .guard import ServerLimits, hosts_for_bind
from .loop import EngineLoop
from .metrics import prometheus_text
from .termination import Terminated, sigterm_raises

try:
    import h11
    import uvicorn
    from uvicorn.protocols.http.h11_impl import H11Protocol
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("the vpaged server needs FastAPI and uvicorn: pip install 'vpaged[serve]'") from e

# Seconds a server whose engine cannot go on keeps answering (503 and the cause on /health, the reason on
# /metrics) before it exits: a health check polled every second or two sees why instead of a refused connection.
FATAL_GRACE_S = 3.0
# Seconds a stopping server (SIGTERM, SIGINT) waits for the requests in flight to finish before it cancels them
# (their clients see the connection close) and closes the engines: under docker's default 10 s from SIGTERM to
# SIGKILL, so that the cleanup after it (the engines, a shared budget the server made) has time to run.
SHUTDOWN_TIMEOUT_S = 5.0
# Seconds the requests still in flight at shutdown_timeout_s have to write their answer (a 503 naming the stop;
# a stream's error event) once their engine requests are aborted, before uvicorn cancels what is left.
ANSWER_GRACE_S = 2.0

__all__ = ["EngineLoop", "ServerLimits", "ServerThread", "create_app", "prometheus_text", "serve"]


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: accepted sockets inherit it, and asyncio sets TCP_NODELAY only on sockets that say so
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


class _Protocol(H11Protocol):
    """uvicorn's h11 protocol with TCP_NODELAY set on the connection and a deadline for request headers."""

    header_timeout_s = 10.0

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._header_timer = None
        self._arm_header_timer()

    def _arm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def _header_timeout(self) -> None:
        self._header_timer = None
        # their_state IDLE: the next request's headers have not all arrived (a request in progress is past it)
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._header_timer is not None and self.conn.their_state is not h11.IDLE:
            self._header_timer.cancel()
            self._header_timer = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_header_timer()

    def connection_lost(self, exc) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().connection_lost(exc)


def _limits_for(limits: ServerLimits | None, host: str) -> ServerLimits:
    limits = limits if limits is not None else ServerLimits()
    if limits.allowed_hosts is None:
        limits = dataclasses.replace(limits, allowed_hosts=hosts_for_bind(host))
    return limits


def _uvicorn_config(app, limits: ServerLimits, log_level: str, shutdown_timeout_s: float) -> uvicorn.Config:
    protocol = type("VPagedH11Protocol", (_Protocol,), {"header_timeout_s": float(limits.header_timeout_s)})
    return uvicorn.Config(
        app,
        log_level=log_level,
        lifespan="on",
        http=protocol,
        timeout_keep_alive=limits.keep_alive_s,
        timeout_graceful_shutdown=shutdown_timeout_s + ANSWER_GRACE_S,
    )


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def _run(
    server: uvicorn.Server,
    sock: socket.socket,
    loops: list[EngineLoop],
    shutdown_timeout_s: float,
    on_ready: Callable[[str], None] | None = None,
) -> None:
    """Serve on `sock` until server.should_exit (a signal, stop(), a fatal engine). Once it is set, uvicorn
    refuses new connections and waits for the requests in flight; those still running shutdown_timeout_s later
    have their engine requests aborted, so that each answers 503 (a stream: an error event) rather than being
    cancelled without an answer (uvicorn's 500 or a cut connection) ANSWER_GRACE_S after that."""

    async def announce():
        while not server.started:
            await asyncio.sleep(0.01)
        on_ready(_url(sock))

    async def end_in_flight_when_stopping():
        while not server.should_exit:
            await asyncio.sleep(0.1)
        await asyncio.sleep(shutdown_timeout_s)
        for loop in loops:
            loop.abort_in_flight(loop.stopping_error())

    helpers = [asyncio.ensure_future(end_in_flight_when_stopping())]
    if on_ready is not None:
        helpers.append(asyncio.ensure_future(announce()))
    try:
        await server.serve(sockets=[sock])
    finally:
        for task in helpers:
            task.cancel()


def serve(
    engine,
    host: str = "127.0.0.1",
    port: int = 8000,
    model_name: str | None = None,
    log_level: str = "info",
    default_max_tokens: int = 256,
    on_ready: Callable[[str], None] | None = None,
    limits: ServerLimits | None = None,
    tool_call_parser: str = "hermes",
    shutdown_timeout_s: float = SHUTDOWN_TIMEOUT_S,
) -> None:
    """Serve until interrupted (Ctrl-C / SIGTERM). `engine`: an LLMEngine, or a dict {served name: engine} of
    several models (model_name None). Port 0 takes a free port; `on_ready(url)` is called once the server
    accepts connections. `limits`: ServerLimits (default: its defaults, Host checked against `host`). An
    engine that cannot go on (a tensor-parallel engine that lost a rank, found by a step or while idle; any
    one of several) shuts the server down FATAL_GRACE_S later (meanwhile /health answers 503 with the cause,
    so that a health check sees why), and serve raises its TensorParallelError once the requests in flight
    have had their answers.

    SIGTERM (what systemd, docker and Kubernetes send) stops the server as Ctrl-C does, and serve returns
    normally: no new connections, the requests in flight get up to `shutdown_timeout_s` to finish (then they are
    answered 503), the engine threads end, and the caller's cleanup runs (termination.py); a second SIGINT cuts
    the wait short."""
    sock = _bind(host, port)
    limits = _limits_for(limits, host)
    app = create_app(engine, model_name, default_max_tokens, limits, tool_call_parser)
    server = uvicorn.Server(_uvicorn_config(app, limits, log_level, shutdown_timeout_s))
    loops = app.state.router.loops()

    def shut_down(_error) -> None:
        timer = threading.Timer(FATAL_GRACE_S, lambda: setattr(server, "should_exit", True))
        timer.daemon = True
        timer.start()

    for loop in loops:
        loop.on_fatal = shut_down

    # What exists now (the model, the tokenizer, the imported modules: some 400,000 objects) lives as long as the
    # server; frozen, it is left out of the collector's full passes, each of which would otherwise stop every
    # thread, the engine's included, for some 250 ms (SmolLM2 on one core) in the middle of a request's steps.
    gc.collect()
    gc.freeze()
    try:
        with sigterm_raises():
            asyncio.run(_run(server, sock, loops, shutdown_timeout_s, on_ready))
    except (KeyboardInterrupt, Terminated):  # uvicorn shut down gracefully, then re-raised the signal it caught
        pass
    finally:
        sock.close()
    for loop in loops:
        if loop.fatal is not None:
            raise loop.fatal


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
        limits: ServerLimits | None = None,
        tool_call_parser: str = "hermes",
        shutdown_timeout_s: float = SHUTDOWN_TIMEOUT_S,
    ):
        self.limits = _limits_for(limits, host)
        self.app = create_app(engine, model_name, default_max_tokens, self.limits, tool_call_parser)
        self._sock = _bind(host, port)
        self.host, self.port = self._sock.getsockname()[:2]
        self.url = _url(self._sock)
        self.server = uvicorn.Server(_uvicorn_config(self.app, self.limits, log_level, shutdown_timeout_s))
        serving = _run(self.server, self._sock, self.app.state.router.loops(), shutdown_timeout_s)
        self._thread = threading.Thread(target=asyncio.run, args=(serving,), name="vpaged-http", daemon=True)

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
