"""ServedModel: one model of the server: its engine loop, its two generation endpoints (CompletionServing,
ChatServing, sharing the model's token texts), and what the other routes ask of it: its card, /tokenize and
/detokenize, whether it can serve, its /metrics text. ModelRouter (router.py) picks one per request.
"""

from __future__ import annotations

import asyncio
from collections import Counter

from ...errors import EngineUnavailableError, TensorParallelError
from . import tokenize as tok
from .admission import RequestChecks
from .chat.serving import ChatServing
from .chat_template import ChatRenderer
from .common.protocol import now
from .completion.serving import CompletionServing
from .guard import ServerLimits
from .logprobs import TokenTexts
from .loop import EngineLoop
from .metrics import prometheus_text
from .model_cards import ModelCard

try:
    from fastapi.responses import PlainTextResponse
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("the vpaged server needs FastAPI and uvicorn: pip install 'vpaged[serve]'") from e


class ServedModel(RequestChecks):
    def __init__(
        self,
        loop: EngineLoop,
        model_name: str,
        default_max_tokens: int,
        limits: ServerLimits,
        tool_call_parser: str,
        http_counts: Counter,
    ):
        self.loop = loop
        self.limits = limits
        self.engine = loop.engine
        self.tokenizer = getattr(self.engine, "tokenizer", None)
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        self.created = now()
        self.http_counts = http_counts  # the app's, counted by its Guard (one for all the models)
        self.renderer = ChatRenderer(self.tokenizer, model_name)  # chat template, and tools it cannot render
        texts = TokenTexts(self.tokenizer)  # token id -> text, for logprobs
        self.completions = CompletionServing(loop, model_name, default_max_tokens, limits, texts)
        self.chat = ChatServing(loop, model_name, default_max_tokens, limits, texts, self.renderer, tool_call_parser)

    def card(self) -> ModelCard:
        """This model's entry of /v1/models."""
        return ModelCard(id=self.model_name, created=self.created, max_model_len=self._max_model_len())

    def tokenize(self, req: tok.TokenizeRequest) -> tok.TokenizeResponse:
        limit = self._max_prompt_tokens()
        return tok.tokenize(self.renderer, req, self._max_model_len(), 64 * limit if limit else 1 << 24)

    def detokenize(self, req: tok.DetokenizeRequest) -> tok.DetokenizeResponse:
        return tok.detokenize(self.tokenizer, req, self._vocab_size())

    def failure(self) -> Exception | None:
        """Why the engine cannot serve (the loop's fatal error, why its thread died, or a tensor-parallel group
        found broken while the loop has not looked yet), else None."""
        return self.loop.fatal or self.loop.dead or getattr(self.engine, "broken", None)

    async def metrics(self) -> PlainTextResponse:
        extra = {"engine_step_failures_total": self.loop.step_failures}
        failure = self.failure()
        stats = None
        if failure is None:
            try:
                stats = await asyncio.wrap_future(self.loop.call(self.engine.stats))
            except (TensorParallelError, EngineUnavailableError) as e:  # broke, died or stopped meanwhile
                failure = e
        # Answered 200 also when the engine is down, so that a scraper records why (vpaged_engine_up 0 and
        # vpaged_engine_failure_info's reason) instead of a failed scrape.
        return PlainTextResponse(
            prometheus_text(stats, self.http_counts, extra, failure=None if failure is None else str(failure)),
            media_type="text/plain; version=0.0.4; charset=utf-8",
        )
