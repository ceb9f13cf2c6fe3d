"""SamplingParams: how one request is decoded, validated when it is built."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ...errors import InvalidArgumentError
from .structured import GrammarSpec

MAX_LOGPROBS = 20  # most alternatives per token that logprobs / prompt_logprobs may ask for (OpenAI's chat limit)
GREEDY_BELOW = 1e-5  # a temperature below this decodes greedily (logits / 1e-300 are inf and NaN in float32)
MAX_REPETITION_PENALTY = 100.0
MIN_REPETITION_PENALTY = 1 / MAX_REPETITION_PENALTY  # a factor of 100 either way at most


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _bias_pairs(bias) -> tuple[tuple[int, float], ...]:
    """logit_bias as sorted (token id, bias) pairs, from a dict or pairs; each id once, each bias in [-100, 100]."""
    try:
        pairs = list(bias.items()) if isinstance(bias, dict) else [tuple(p) for p in bias]
    except TypeError:
        raise InvalidArgumentError(f"logit_bias must map token ids to numbers, got {bias!r}") from None
    out = {}
    for pair in pairs:
        if len(pair) != 2 or not _is_int(pair[0]) or pair[0] < 0 or pair[0] in out:
            raise InvalidArgumentError(f"logit_bias keys must be distinct token ids >= 0, got {pair!r}")
        if not _is_number(pair[1]) or not -100.0 <= pair[1] <= 100.0:
            raise InvalidArgumentError(f"logit_bias values must be numbers in [-100, 100], got {pair!r}")
        out[pair[0]] = float(pair[1])
    return tuple(sorted(out.items()))


def _bad_words(words) -> tuple[str, ...]:
    """bad_words as a tuple of strings with something besides whitespace (a lone str is refused: it is
    almost always a missing list)."""
    if isinstance(words, str) or not isinstance(words, (list, tuple)):
        raise InvalidArgumentError(f"bad_words must be a list of strings, got {words!r}")
    if any(not isinstance(w, str) or not w.strip() for w in words):
        raise InvalidArgumentError(f"bad_words must be non-blank strings, got {words!r}")
    return tuple(words)


def _bad_sequences(sequences) -> tuple[tuple[int, ...], ...]:
    """bad_words_token_ids as a tuple of non-empty tuples of token ids >= 0."""
    try:
        out = tuple(tuple(s) for s in sequences)
    except TypeError:
        raise InvalidArgumentError(f"bad_words_token_ids must be a list of token id lists, got {sequences!r}") from None
    if any(not s or not all(_is_int(t) and t >= 0 for t in s) for s in out):
        raise InvalidArgumentError(f"bad_words_token_ids must be non-empty lists of ids >= 0, got {sequences!r}")
    return out


@dataclass(frozen=True)
class SamplingParams:
    """
    max_tokens: tokens to generate at most (finish_reason "length" when reached).
    temperature: 0 (or below GREEDY_BELOW, 1e-5) is greedy (argmax); otherwise logits are divided by it before
        sampling (a smaller divisor would overflow float32 logits to inf and NaN; vLLM's rule too).
    top_k: keep the k most likely tokens (-1 or 0: all).
    top_p: keep the smallest set of most likely tokens whose probability reaches top_p (1.0: all).
    seed: an int in [-2**63, 2**64); seeds this request's own random generator, so its tokens do not depend
        on the other requests that share its batches (None: a seed drawn from the engine's generator).
    stop_token_ids: tokens that end the request (finish_reason "stop"); the stop token is kept in the output.
    ignore_eos: keep generating past the model's end-of-sequence token.
    n: completions of the same prompt; they share the prompt's KV pages.
    logprobs: None, or k in 0..20: each generated token's log probability and the k most likely tokens'
        (CompletionOutput.logprobs), from the model's raw distribution: log_softmax of its logits before
        temperature, penalties, bias or top-k/top-p (what vLLM returns by default).
    prompt_logprobs: None, or k in 0..20: the same for every prompt token after the first
        (RequestOutput.prompt_logprobs). The prefill then computes logits at every prompt position, and the
        request reads no K/V from the prefix cache (positions served from it would have no logits).
    presence_penalty, frequency_penalty: in [-2, 2]; subtracted from the logit of every token already
        generated, once (presence) or once per occurrence (frequency), as in the OpenAI API.
    repetition_penalty: in [0.01, 100] (1: off; below 1 it favours repeats; past 100 either way the penalty
        alone decides already, and a factor like 1e-300 turns float32 logits into inf); logits of tokens in the
        prompt or the output are divided by it when positive and multiplied when negative (the CTRL /
        transformers / vLLM rule).
    logit_bias: {token id: bias in [-100, 100]} added to the logits (kept as sorted (id, bias) pairs).
    min_tokens: the EOS and stop tokens cannot be drawn before this many tokens are generated.
    structured: a GrammarSpec the output must follow (structured.py; needs xgrammar and a tokenizer).
    bad_words: strings the output must not contain (vLLM's field). The engine tokenizes each word, with and
        without a leading space, into bad_words_token_ids when the request is added (bad_words.py).
    bad_words_token_ids: token sequences the output must not contain: the last token of a sequence cannot be
        drawn while the output ends with the tokens before it (always, for a one-token sequence).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = field(default=())
    min_tokens: int = 0
    structured: GrammarSpec | None = None
    bad_words: tuple[str, ...] = field(default=())
    bad_words_token_ids: tuple[tuple[int, ...], ...] = field(default=())

    def __post_init__(self):
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidArgumentError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if (
            isinstance(self.temperature, bool)
            or not isinstance(self.temperature, (int, float))
            or not math.isfinite(self.temperature)
            or self.temperature < 0
        ):
            raise InvalidArgumentError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise InvalidArgumentError(f"top_k must be -1 (all tokens) or an int >= 1, got {self.top_k!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise InvalidArgumentError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not -(2**63) <= self.seed < 2**64):
            # torch generators take a 64-bit seed: anything wider is refused here, not in the middle of a step
            raise InvalidArgumentError(f"seed must be an int in [-2**63, 2**64) or None, got {self.seed!r}")
        try:
            stops = tuple(self.stop_token_ids)
        except TypeError:
            raise InvalidArgumentError(
                f"stop_token_ids must be a sequence of ints, got {self.stop_token_ids!r}"
            ) from None
        if any(not _is_int(t) or t < 0 for t in stops):
            raise InvalidArgumentError(f"stop_token_ids must be ints >= 0, got {stops!r}")
        object.__setattr__(self, "stop_token_ids", stops)
        if not isinstance(self.ignore_eos, bool):
            raise InvalidArgumentError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if not _is_int(self.n) or self.n < 1:
            raise InvalidArgumentError(f"n must be an int >= 1, got {self.n!r}")
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not _is_int(k) or not 0 <= k <= MAX_LOGPROBS):
                raise InvalidArgumentError(f"{name} must be None or an int in 0..{MAX_LOGPROBS}, got {k!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -2.0 <= v <= 2.0:
                raise InvalidArgumentError(f"{name} must be a number in [-2, 2], got {v!r}")
            object.__setattr__(self, name, float(v))
        penalty = self.repetition_penalty
        if not _is_number(penalty) or not MIN_REPETITION_PENALTY <= penalty <= MAX_REPETITION_PENALTY:
            raise InvalidArgumentError(
                f"repetition_penalty must be a number in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY:g}], "
                f"got {penalty!r}"
            )
        object.__setattr__(self, "repetition_penalty", float(self.repetition_penalty))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidArgumentError(f"min_tokens must be an int in 0..max_tokens, got {self.min_tokens!r}")
        if self.structured is not None and not isinstance(self.structured, GrammarSpec):
            raise InvalidArgumentError(f"structured must be a GrammarSpec or None, got {self.structured!r}")
        object.__setattr__(self, "bad_words", _bad_words(self.bad_words))
        object.__setattr__(self, "bad_words_token_ids", _bad_sequences(self.bad_words_token_ids))

    @property
    def adjusts_logits(self) -> bool:
        """Whether the sampler changes this request's logits before choosing (penalties, bias, min_tokens)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
            or self.bad_words_token_ids
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW
