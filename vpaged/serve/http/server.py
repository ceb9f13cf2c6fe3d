"""An OpenAI-compatible HTTP server around an LLMEngine (extra `vpaged[serve]`: FastAPI + uvicorn).

    from vpaged.serve import LLMEngine, load_model
    from vpaged.serve.http.server import create_app, serve
    model, tok = load_model("path/to/model_dir")
    serve(LLMEngine(model, tok, kv_budget_bytes=1 << 30), host="127.0.0.1", port=8000)

Endpoints: POST /v1/completions (prompt as text, token ids, or a batch of either), POST /v1/chat/completions
(when the tokenizer has a chat template), both with SSE streaming (`"stream": true`); GET /v1/models,
GET /metrics (Prometheus text: the engine's stats() and request counters), GET /health.

The parts, one file each: loop.py (EngineLoop, the thread that owns the engine), generation.py (one HTTP
request's choices), metrics.py (the Prometheus text), app.py (the FastAPI app and its routes), and this file:
running the app with uvicorn (serve, ServerThread). create_app, EngineLoop and prometheus_text are importable
from here too.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable

from .app import create_app
from .loop import EngineLoop
from .metrics import prometheus_text

try:
    import uvicorn
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("the vpaged server needs FastAPI and uvicorn: pip install 'vpaged[serve]'") from e

__all__ = ["EngineLoop", "ServerThread", "create_app", "prometheus_text", "serve"]


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
