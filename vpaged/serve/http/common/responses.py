"""HTTP responses of the typed bodies: a response model as JSON (Starlette's encoding, as a route returning
a dict gets), and the OpenAI error shape with its status."""

from __future__ import annotations

from .protocol import ResponseModel, error_body

try:
    from fastapi.responses import JSONResponse
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("the vpaged server needs FastAPI and uvicorn: pip install 'vpaged[serve]'") from e


def json_response(body: ResponseModel, status: int = 200) -> JSONResponse:
    return JSONResponse(body.json_body(), status_code=status)


def error_response(
    status: int, message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status)
