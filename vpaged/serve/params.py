"""SamplingParams: how one request is decoded, validated when it is built."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..errors import InvalidArgumentError


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """
    max_tokens: tokens to generate at most (finish_reason "length" when reached).
    temperature: 0 is greedy (argmax); otherwise logits are divided by it before sampling.
    top_k: keep the k most likely tokens (-1 or 0: all).
    top_p: keep the smallest set of most likely tokens whose probability reaches top_p (1.0: all).
    seed: an int in [-2**63, 2**64); seeds this request's own random generator, so its tokens do not depend
        on the other requests that share its batches (None: a seed drawn from the engine's generator).
    stop_token_ids: tokens that end the request (finish_reason "stop"); the stop token is kept in the output.
    ignore_eos: keep generating past the model's end-of-sequence token.
    n: completions of the same prompt; they share the prompt's KV pages.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    n: int = 1

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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
