"""The server's limits (ServerLimits) and the ASGI middleware that applies the ones about HTTP itself before any
route runs: the Host header, the API key, the content type, the body size and how long the body may take to
arrive; it also counts requests for /metrics by route template (bounded labels).

Checks in order, each answered in the OpenAI error shape: Host not allowed -> 421; API key missing or wrong
-> 401 (GET /health is always open); a POST whose content type is not JSON -> 415 (a web page can send a
"simple" cross-origin POST only as text/plain, form data or multipart, so this keeps DNS-rebinding pages out);
a Content-Length over max_body_bytes -> 413 before anything is read; a body that grows past it while read
-> 413; a body that takes longer than body_timeout_s -> 408. The body is read here, once, and replayed to
the route. Limits about what a request asks for (prompts, n, stops, tokens) are checked by the routes.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections import Counter
from dataclasses import dataclass, field

from ...errors import InvalidArgumentError
from ..options import option

# Route templates counted in vpaged_http_requests_total; every other path is counted as "other".
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/metrics", "/health")
OPEN_PATHS = ("/health",)


def host_list(text: str) -> tuple[str, ...]:
    """allowed_hosts from comma-separated names ('a.example, b.example'; blanks dropped)."""
    return tuple(h.strip() for h in text.split(",") if h.strip())


@dataclass(frozen=True)
class ServerLimits:
    """What one HTTP request may ask of the server; every limit is checked before any work is done.

    max_body_bytes: request body size (413 beyond). max_response_bytes: the size an answer may reach,
    estimated before any work from what the request asks for (response_bytes_estimate; 400 beyond).
    max_prompt_tokens: tokens of one prompt (None: the engine's max_model_len less one token to generate; more
    is a 400 either way). max_n: completions per prompt. max_prompts: prompts in one /v1/completions batch.
    max_stop_strings, max_stop_token_ids: per request. header_timeout_s: a connection must send a request's
    headers within this many seconds of opening (or of its previous response); slow senders are closed.
    body_timeout_s: the body must arrive within this (408). keep_alive_s: an idle kept-alive connection is
    closed after this. api_key: when set, every route but /health wants `Authorization: Bearer <api_key>`.
    allowed_hosts: Host header names accepted (None: no check; "*" in it: any).
    """

    # The fields' metadata makes `vpaged serve`'s limit flags (vpaged/cli/record_flags.py).
    max_body_bytes: int = field(
        default=4 << 20, metadata=option("request body size (413 beyond)", flag="--max-body-kib", scale=1 << 10)
    )
    max_response_bytes: int = field(
        default=32 << 20,
        metadata=option(
            "an answer's size, estimated from what the request asks for before any work (400 beyond)",
            flag="--max-response-mib",
            scale=1 << 20,
        ),
    )
    max_prompt_tokens: int | None = field(
        default=None, metadata=option("tokens of one prompt", default_text="max model length - 1")
    )
    max_n: int = field(default=16, metadata=option("completions per prompt"))
    max_prompts: int = field(default=64, metadata=option("prompts in one /v1/completions request"))
    max_stop_strings: int = field(default=4, metadata=option("stop strings of one request"))
    max_stop_token_ids: int = field(default=64, metadata=option("stop token ids of one request"))
    header_timeout_s: float = field(
        default=10.0, metadata=option("seconds to send a request's headers", flag="--header-timeout")
    )
    body_timeout_s: float = field(
        default=30.0, metadata=option("seconds to send a request's body (408)", flag="--body-timeout")
    )
    keep_alive_s: float = field(
        default=5.0, metadata=option("seconds an idle connection stays open", flag="--keep-alive-timeout")
    )
    api_key: str | None = field(
        default=None,
        metadata=option(
            "require `Authorization: Bearer KEY` on every route but /health",
            default_text="$VPAGED_API_KEY, else none",
        ),
    )
    allowed_hosts: tuple[str, ...] | None = field(
        default=None,
        metadata=option(
            "comma-separated Host header names accepted, '*' for any",
            parse=host_list,
            default_text="the bind address; localhost, 127.0.0.1 and ::1 for a loopback one; any for 0.0.0.0",
        ),
    )

    def __post_init__(self):
        for name in (
            "max_body_bytes",
            "max_response_bytes",
            "max_n",
            "max_prompts",
            "max_stop_strings",
            "max_stop_token_ids",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise InvalidArgumentError(f"{name} must be an int >= 1, got {v!r}")
        v = self.max_prompt_tokens
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise InvalidArgumentError(f"max_prompt_tokens must be an int >= 1 or None, got {v!r}")
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                raise InvalidArgumentError(f"{name} must be a number > 0, got {v!r}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise InvalidArgumentError("api_key must be a non-empty string or None")
        if self.allowed_hosts is not None:
            object.__setattr__(self, "allowed_hosts", tuple(h.lower() for h in self.allowed_hosts))


# JSON bytes per token of an answer, a little over what SmolLM2's and the word tokenizer's answers measured
# (tests/serve/test_serve_limits.py checks answers against the estimate): the token's text and its id; with logprobs,
# each entry of a completion (a "text": logprob pair, and the token's own tokens / token_logprobs / text_offset
# items), or of a chat answer ({"token", "logprob", "bytes"}); and a streamed chunk's envelope. Plus what an
# answer holds however short: its envelope (id, usage, ...) and each choice's (index, finish_reason, ...).
ANSWER_BYTES = 1024
CHOICE_BYTES = 512
TOKEN_BYTES = 24
COMPLETION_LOGPROB_BYTES = 40
CHAT_LOGPROB_BYTES = 96
STREAM_CHUNK_BYTES = 240


def response_bytes_estimate(
    tokens_per_choice: list[int], n: int, logprobs: int | None, chat: bool, stream: bool
) -> int:
    """The size of an answer whose choices (n per prompt; tokens_per_choice: each prompt's choice's tokens at
    most, echoed prompt included) each carry `logprobs` alternatives per token (None: no logprobs)."""
    per_token = TOKEN_BYTES + (STREAM_CHUNK_BYTES if stream else 0)
    if logprobs is not None:
        per_token += (logprobs + 1) * CHAT_LOGPROB_BYTES if chat else (logprobs + 2) * COMPLETION_LOGPROB_BYTES
    return ANSWER_BYTES + n * (len(tokens_per_choice) * CHOICE_BYTES + sum(tokens_per_choice) * per_token)


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARD_ADDRESSES = ("0.0.0.0", "::", "")


def hosts_for_bind(host: str) -> tuple[str, ...] | None:
    """The Host names to accept by default for a server bound to `host`: loopback names for a loopback
    address, the address itself otherwise; None (no check) for a wildcard address."""
    h = host.strip("[]").lower()
    if h in WILDCARD_ADDRESSES:
        return None
    if h in LOOPBACK_NAMES or h.startswith("127."):
        return tuple(dict.fromkeys((h, *LOOPBACK_NAMES)))
    return (h,)


def host_name(value: str) -> str:
    """The name part of a Host header value ("example.org:8000" -> "example.org", "[::1]:80" -> "::1")."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    if value.count(":") == 1:
        return value.split(":", 1)[0]
    return value


def route_label(path: str) -> str:
    return path if path in ROUTES else "other"


def _error_bytes(message: str, type_: str, code: str | None = None) -> bytes:
    body = {"error": {"message": message, "type": type_, "param": None, "code": code}}
    return json.dumps(body).encode()


class Guard:
    """The ASGI middleware (see the module's doc)."""

    def __init__(self, app, limits: ServerLimits, counts: Counter):
        self.app = app
        self.limits = limits
        self.counts = counts
        self._key = limits.api_key.encode() if limits.api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        label = route_label(scope.get("path", ""))

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.counts[(label, message["status"])] += 1
            await send(message)

        refusal = self._refusal(scope)
        if refusal is not None:
            await self._respond(counting_send, *refusal)
            return
        if scope.get("method") == "POST":
            body = await self._read_body(scope, receive, counting_send)
            if body is None:
                return
            receive = _replay(body, receive)
        await self.app(scope, receive, counting_send)

    def _refusal(self, scope) -> tuple[int, str, str, str | None] | None:
        headers = {}
        for k, v in scope.get("headers", ()):
            headers.setdefault(k.decode("latin-1").lower(), v.decode("latin-1"))
        allowed = self.limits.allowed_hosts
        if allowed is not None and "*" not in allowed and "host" in headers:
            if host_name(headers["host"]) not in allowed:
                return 421, "this server does not answer for that Host", "invalid_request_error", "misdirected_request"
        path = scope.get("path", "")
        if self._key is not None and path not in OPEN_PATHS:
            auth = headers.get("authorization", "")
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self._key):
                return (
                    401,
                    "a valid API key is needed: Authorization: Bearer <key>",
                    "authentication_error",
                    ("invalid_api_key"),
                )
        if scope.get("method") == "POST":
            ctype = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if ctype != "application/json" and not ctype.endswith("+json"):
                return (
                    415,
                    "the request body must be JSON (Content-Type: application/json)",
                    ("invalid_request_error"),
                    "unsupported_media_type",
                )
            length = headers.get("content-length")
            if length is not None:
                if not length.isdigit():
                    return 400, "bad Content-Length", "invalid_request_error", None
                if int(length) > self.limits.max_body_bytes:
                    return self._too_large()
        return None

    def _too_large(self) -> tuple[int, str, str, str]:
        return (
            413,
            f"the request body is over {self.limits.max_body_bytes} bytes",
            "invalid_request_error",
            ("request_too_large"),
        )

    async def _read_body(self, scope, receive, send) -> bytes | None:
        """The whole body, or None once a refusal (413, 408) or the client's disconnect ended the request."""
        chunks, size = [], 0
        limit = self.limits.max_body_bytes

        async def read() -> bool:
            nonlocal size
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return False
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    raise _TooLarge
                chunks.append(chunk)
                if not message.get("more_body", False):
                    return True

        try:
            complete = await asyncio.wait_for(read(), self.limits.body_timeout_s)
        except _TooLarge:
            await self._respond(send, *self._too_large(), close=True)
            return None
        except asyncio.TimeoutError:
            await self._respond(
                send, 408, "the request body did not arrive in time", "invalid_request_error", "timeout", close=True
            )
            return None
        return b"".join(chunks) if complete else None

    @staticmethod
    async def _respond(send, status: int, message: str, type_: str, code: str | None, close: bool = False) -> None:
        body = _error_bytes(message, type_, code)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        if close:
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass


def _replay(body: bytes, receive):
    """A receive() that hands the route the body read already, then the client's own messages (disconnect)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
