"""Requests and their sequences as the engine tracks them (plain records).

The engine creates them (add_request); from then on only the scheduler changes a sequence's state: its queue
and status, its cache handle, the tokens computed and appended, its finish (scheduler.py). The engine moves
only the reporting cursor (delta_from) as it builds outputs.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from .outputs import RequestMetrics
from .sample.params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # not in the cache (new, or preempted by recompute)
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One completion: the prompt plus its generated tokens. The K/V of tokens[:num_computed] are in the
    cache; the step that computes the last token's K/V also yields the logits of the next token."""

    request: Request
    index: int  # completion index within the request
    tokens: list[int]
    generator: torch.Generator | None  # None for greedy requests
    num_computed: int = 0
    handle: int | None = None  # the cache's sequence id while it has one
    slot: int = -1  # the cache slot (contiguous stores)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    delta_from: int = 0  # index in tokens of the first token not yet reported
    prefix_offered: bool = False  # prompt pages handed to the prefix cache
    logprobs: list = field(default_factory=list)  # TokenLogprob per generated token (params.logprobs set)
    matcher: object | None = None  # params.structured: the grammar's state after the generated tokens

    @property
    def prompt_len(self) -> int:
        return self.request.prompt_len

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.request.prompt_len

    @property
    def remaining(self) -> int:
        """Tokens whose K/V are still to be computed (1 for a decoding sequence)."""
        return len(self.tokens) - self.num_computed


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    max_tokens: int  # params.max_tokens capped by the model length
    seqs: list[Sequence] = field(default_factory=list)
    seeds: list[int] = field(default_factory=list)  # one per completion
    forked: bool = False  # n > 1: the completions exist (after the prompt's prefill)
    finished: bool = False
    priority: int = 0  # scheduling_policy="priority": lower values are admitted first (policies.py)
    arrival_index: int = 0  # the engine's count of requests added before it: breaks ties of arrival_time
    # params.prompt_logprobs set: [None] (the first prompt token has none), then a TokenLogprob per prompt
    # token as its position is computed; None otherwise.
    prompt_logprobs: list | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    def generator(self, index: int) -> torch.Generator | None:
        """The sampling generator of completion `index`, seeded from seeds[index] (None for greedy requests):
        each completion draws from its own stream, so its tokens do not depend on the batch it runs in."""
        if self.params.greedy:
            return None
        return torch.Generator().manual_seed(self.seeds[index])

    @property
    def seats(self) -> int:
        """Running places the request takes at admission: all n completions once its prompt is computed."""
        return 1 if self.forked else self.params.n
