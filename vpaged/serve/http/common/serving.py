"""ServingBase: what the handler of either generation endpoint does with one served model: the request's
SamplingParams, starting its Generation on the model's engine loop, and waiting for a whole answer while
watching the client. The checks of what a request may ask for come from RequestChecks (admission.py).
"""

from __future__ import annotations

import asyncio
import contextlib

from ....errors import EngineStepError, NoAllowedTokenError, RequestError, VPagedError
from ...sample.params import SamplingParams
from .. import guided
from ..admission import RequestChecks
from ..generation import Generation
from ..guard import ServerLimits
from ..guided import grammar_of
from ..logprobs import TokenTexts
from ..loop import EngineLoop
from .parse import refused_param
from .protocol import SamplingRequest, sampling_kwargs


class ServingBase(RequestChecks):
    """One served model as an endpoint's handler sees it (its engine loop, tokenizer, limits, and the
    token texts of logprobs, shared by the endpoints of the model)."""

    def __init__(
        self, loop: EngineLoop, model_name: str, default_max_tokens: int, limits: ServerLimits, token_texts: TokenTexts
    ):
        self.loop = loop
        self.engine = loop.engine
        self.tokenizer = getattr(self.engine, "tokenizer", None)
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        self.limits = limits
        self.token_texts = token_texts  # token id -> text, for logprobs

    def _params(self, req: SamplingRequest, prompts: list[list[int]], max_tokens: int | None, structured=None):
        kwargs = sampling_kwargs(req, self._max_tokens_of(prompts, max_tokens))
        if structured is not None:
            kwargs["structured"] = structured
        vocab = self._vocab_size()
        if vocab is not None and any(t >= vocab for t in kwargs.get("logit_bias", ())):
            raise RequestError(f"logit_bias keys must be token ids in [0, {vocab})", param="logit_bias")
        try:
            return SamplingParams(**kwargs)
        except (VPagedError, ValueError, TypeError) as e:
            # SamplingParams names the field first in its messages: the 400 names it too (as the client did)
            field = str(e).split(" ", 1)[0]
            param = field if field in kwargs else None
            if param == "max_tokens" and getattr(req, "max_completion_tokens", None) is not None:
                param = "max_completion_tokens"
            raise RequestError(str(e), param=param) from None

    async def _start(
        self,
        req: SamplingRequest,
        prompts: list[list[int]],
        max_tokens: int | None,
        prefix: str,
        stops: tuple[str, ...],
        structured: tuple | None = None,
        keep_outputs: bool = True,
    ) -> Generation:
        """structured: (GrammarSpec, the field it comes from) in place of the request's own (tool calls);
        keep_outputs: Generation's (False: the prompts are only scored)."""
        spec, field = structured if structured is not None else grammar_of(req)
        params = self._params(req, prompts, max_tokens, spec)
        if spec is not None:
            await guided.compile_off_thread(self.engine, spec, field)
        gen = Generation(self.loop, self.tokenizer, prompts, params, req.n, stops, prefix, keep_outputs)
        try:
            await gen.start()
        except EngineStepError:  # the engine cannot serve at all (a lost rank: 503), not a refusal of this request
            raise
        except VPagedError as e:  # the engine refused this request (too long, bad parameters, ...)
            param = refused_param(e, req.model_fields_set)
            if param is None and spec is not None and isinstance(e, NoAllowedTokenError):
                param = field  # the grammar itself allows no token: the field it came from (guided_json, ...)
            raise RequestError(str(e), param=param, code=type(e).__name__) from None
        return gen

    async def _collect(self, request, gen: Generation) -> bool:
        """Wait for every choice to finish; False (the request aborted) if the client (a Starlette Request)
        went away meanwhile.

        The client is checked after every update and every 0.2 s without one, so a busy generation (an update
        each step) notices a disconnect as soon as an idle one does."""
        try:
            while not gen.done:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(gen.next_update(), timeout=0.2)
                if await request.is_disconnected():
                    return False
            return True
        finally:
            gen.abort_unfinished()
