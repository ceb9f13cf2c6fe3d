"""GET /v1/models and /v1/models/{id}: each served model's card."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .common.protocol import ResponseModel, is_none


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "vpaged"
    max_model_len: int | None = Field(default=None, exclude_if=is_none)  # as vLLM reports it, when known


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
