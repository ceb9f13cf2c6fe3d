"""A request body read into its request model: JSON decoded, validated (pydantic, strict), the fields this
server does not serve refused, and the request's own checks run; every problem a RequestError naming the field.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from pydantic import ValidationError

from ....errors import RequestError

# Bodies larger than this are decoded and validated on a worker thread, so the event loop goes on meanwhile.
_THREAD_PARSE_BYTES = 64 << 10


def parse_request(cls, body: Any):
    """Validate a decoded JSON body as `cls` (a request model: a pydantic model with unsupported(), the
    fields it refuses to serve, and check(), its checks beyond its types); RequestError with the first
    problem otherwise."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    try:
        req = cls.model_validate(body)
    except RecursionError:
        raise RequestError("the request body is nested too deeply") from None
    except ValidationError as e:
        errors = e.errors()
        # An unknown field is named as such, before any other problem: it is what the client must change.
        first = next((x for x in errors if x.get("type") == "extra_forbidden"), errors[0])
        loc = first.get("loc", ())
        where = ".".join(str(x) for x in loc)
        if first.get("type") == "extra_forbidden":
            raise RequestError(
                f"unknown field {where}: not part of this API or not implemented by this server",
                param=str(loc[0]) if loc else None,
                code="unknown_field",
            ) from None
        raise RequestError(
            f"{where}: {first.get('msg')}" if where else str(first.get("msg")), param=str(loc[0]) if loc else None
        ) from None
    bad = req.unsupported()
    if bad:
        raise RequestError(f"not supported by this server: {', '.join(bad)}", param=bad[0])
    req.check()
    return req


def _decode_and_validate(cls, raw: bytes):
    try:
        body = json.loads(raw)
    except RecursionError:
        raise RequestError("the request body is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestError(f"the request body is not valid JSON: {e}") from None
    return parse_request(cls, body)


async def read_request(request, cls):
    """The HTTP request's body (a Starlette Request), decoded and validated as `cls` (parse_request)."""
    raw = await request.body()
    if len(raw) > _THREAD_PARSE_BYTES:
        return await asyncio.to_thread(_decode_and_validate, cls, raw)
    return _decode_and_validate(cls, raw)


def refused_param(error: Exception, fields) -> str | None:
    """The request field an engine's refusal is about: "prompt" for a prompt error, else the field its message
    starts with when that is one of `fields` (the engine's messages name the field first)."""
    if "prompt" in type(error).__name__.lower():
        return "prompt"
    first = str(error).split(" ", 1)[0]
    return first if first in fields else None
