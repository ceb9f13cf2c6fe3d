"""Server-sent events of a streamed answer: each chunk one `data: {json}` event, an error found mid-stream
as an event in the OpenAI error shape (the status line went out already), then `data: [DONE]`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

from ...errors import EngineStepError, RequestError
from .common.protocol import ResponseModel, UsageInfo, error_body
from .generation import Generation

try:
    from fastapi.responses import StreamingResponse
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("the vpaged server needs FastAPI and uvicorn: pip install 'vpaged[serve]'") from e

DONE = "data: [DONE]\n\n"

# chunk(choice index, new text, new token ids, finish_reason or None, new TokenLogprobs) -> the event's body
ChunkOf = Callable[[int, str, list[int], "str | None", list], ResponseModel]


def sse(body: ResponseModel | dict) -> str:
    obj = body.json_body() if isinstance(body, ResponseModel) else body
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(
        events, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )


async def stream_chunks(
    gen: Generation,
    chunk: ChunkOf,
    first: list[ResponseModel],
    include_usage: bool,
    usage_chunk: Callable[[UsageInfo], ResponseModel],
) -> AsyncIterator[str]:
    """The events of `gen`: `first` (chat's role chunks), a chunk for each update of a choice with something
    new, the usage chunk when asked (stream_options.include_usage), [DONE]."""
    try:
        for c in first:
            yield sse(c)
        while not gen.done:
            try:
                changed = await gen.next_update()
            except EngineStepError as e:
                yield sse(error_body(str(e), "server_error"))
                return
            except RequestError as e:  # found mid-stream (no token left that the request allows)
                yield sse(error_body(e.message, param=e.param, code=e.code))
                return
            for k in changed:
                ch = gen.choices[k]
                start = ch.sent_tokens
                text, toks = ch.delta()
                if text or toks or ch.done:
                    yield sse(chunk(k, text, toks, ch.finish_reason, ch.new_logprobs(start, len(toks))))
        if include_usage:
            yield sse(usage_chunk(gen.usage()))
        yield DONE
    finally:
        gen.abort_unfinished()  # the client went away (this generator is cancelled) or the stream ended
