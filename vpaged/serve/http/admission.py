"""RequestChecks: what one request may ask of a served model, checked before any work (ServerLimits, the
model's length and vocabulary, and the size its answer could reach); a refusal is a RequestError naming the
field. The endpoints' handlers (common/serving.py) and served_model.py inherit it.
"""

from __future__ import annotations

from ...errors import RequestError
from .guard import response_bytes_estimate


class RequestChecks:
    """Mixed into ServingBase and ServedModel: needs self.engine, self.tokenizer, self.limits (ServerLimits) and
    self.default_max_tokens."""

    def _max_model_len(self) -> int | None:
        limit = getattr(self.engine, "max_model_len", None)
        return limit if isinstance(limit, int) else None

    def _max_prompt_tokens(self) -> int | None:
        limits = [x for x in (self.limits.max_prompt_tokens, self._max_model_len()) if x is not None]
        if self._max_model_len() is not None:
            limits[-1] -= 1  # a prompt must leave room for one token
        return min(limits) if limits else None

    def _tokenize(self, prompt: str | list[int]) -> list[int]:
        limit = self._max_prompt_tokens()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer: send the prompt as token ids", param="prompt")
            if limit is not None and len(prompt) > 64 * limit:  # no tokenizer makes a token of < 1 character
                self._prompt_too_long(f"over {64 * limit} characters", limit)
            ids = list(self.tokenizer.encode(prompt))
        else:
            vocab = self._vocab_size()
            if vocab is not None and any(t < 0 or t >= vocab for t in prompt):
                raise RequestError(f"prompt token ids must lie in [0, {vocab})", param="prompt")
            ids = list(prompt)
        if limit is not None and len(ids) > limit:
            self._prompt_too_long(f"{len(ids)} tokens", limit)
        return ids

    @staticmethod
    def _prompt_too_long(what: str, limit: int):
        raise RequestError(
            f"prompt of {what}: this server takes prompts of at most {limit} tokens",
            param="prompt",
            code="PromptTooLongError",
        )

    def _check_limits(self, req, num_prompts: int) -> tuple[str, ...]:
        """The limits of what one request asks for; returns its stop strings."""
        lim = self.limits
        if num_prompts > lim.max_prompts:
            raise RequestError(f"at most {lim.max_prompts} prompts per request, got {num_prompts}", param="prompt")
        if req.n > lim.max_n:
            raise RequestError(f"n must be at most {lim.max_n}, got {req.n}", param="n")
        if req.stop_token_ids and len(req.stop_token_ids) > lim.max_stop_token_ids:
            raise RequestError(f"at most {lim.max_stop_token_ids} stop_token_ids", param="stop_token_ids")
        stops = req.stop_strings(lim.max_stop_strings)
        if stops and self.tokenizer is None:
            raise RequestError("this model has no tokenizer: stop strings cannot be matched", param="stop")
        return stops

    def _check_max_tokens(self, prompts: list[list[int]], max_tokens: int | None, param: str) -> None:
        """A max_tokens the client gave that cannot fit the model's length is refused (as vLLM does)."""
        limit = self._max_model_len()
        if max_tokens is None or limit is None or not prompts:
            return
        longest = max(len(p) for p in prompts)
        if longest + max_tokens > limit:
            raise RequestError(
                f"this model's maximum context length is {limit} tokens; the request asks for {longest + max_tokens} "
                f"({longest} in the prompt, {max_tokens} to generate): lower {param} or the prompt",
                param=param,
            )

    def _check_response_size(self, req, tokens_per_choice: list[int], logprobs: int | None, chat: bool) -> None:
        """An answer that could grow past max_response_bytes is refused before any work (as a body is)."""
        size = response_bytes_estimate(tokens_per_choice, req.n, logprobs, chat, req.stream)
        limit = self.limits.max_response_bytes
        if size <= limit:
            return
        each = f", {logprobs} logprobs each" if logprobs else ""
        param = ("top_logprobs" if chat else "logprobs") if logprobs else "max_tokens"
        raise RequestError(
            f"the answer to this request could take about {size / 2**20:.1f} MiB ({len(tokens_per_choice)} "
            f"prompt(s) x n={req.n} x up to {max(tokens_per_choice)} tokens{each}): over this server's limit of "
            f"{limit / 2**20:.1f} MiB (--max-response-mib): lower {', '.join(dict.fromkeys((param, 'max_tokens')))}"
            " or n",
            param=param,
            code="response_too_large",
        )

    def _max_tokens_of(self, prompts: list[list[int]], max_tokens: int | None) -> int:
        """The request's max_tokens, or the server's default, cut to the room the model's length leaves."""
        if max_tokens is not None:
            return max_tokens
        limit = getattr(self.engine, "max_model_len", None)
        if isinstance(limit, int) and prompts:
            return max(1, min(self.default_max_tokens, limit - max(len(p) for p in prompts)))
        return self.default_max_tokens

    def _vocab_size(self) -> int | None:
        cfg = getattr(getattr(self.engine, "model", None), "config", None)
        if cfg is not None and hasattr(cfg, "get_text_config"):
            cfg = cfg.get_text_config(decoder=True)
        return getattr(cfg, "vocab_size", None)
