"""Logits processors of the batched sampler: logit_bias, min_tokens and bad_words, each per request, on the rows
of one step that ask for one of them (the penalties follow them: penalties.py; both run from
sampler.apply_controls).

vLLM's order: the logits processors, then the penalties, then temperature, top-k and top-p.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from .bad_words import banned_next_tokens
from .params import SamplingParams

# (all of a sequence's tokens so far, its prompt length): the tokens after prompt_len are its output.
History = tuple[Sequence[int], int]


def apply_processors(
    sub: torch.Tensor, params: list[SamplingParams], histories: list[History], eos_token_ids: Collection[int]
) -> torch.Tensor:
    """sub [R, V] float32 (row r for params[r], histories[r]) with each row's logit_bias added, in place, and
    -inf on the tokens it may not draw next: its EOS and stop tokens before min_tokens, the last token of a
    bad word whose other tokens end its output."""
    device, vocab = sub.device, sub.shape[1]
    bias = [(r, t, b) for r, p in enumerate(params) for t, b in p.logit_bias if t < vocab]
    if bias:
        r, t, b = zip(*bias)
        sub.index_put_((_long(r, device), _long(t, device)), torch.tensor(b, device=device), accumulate=True)
    banned = []
    for r, (p, (tokens, prompt_len)) in enumerate(zip(params, histories)):
        if len(tokens) - prompt_len < p.min_tokens:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            banned += [(r, t) for t in stops if t < vocab]
        banned += [(r, t) for t in banned_next_tokens(p.bad_words_token_ids, tokens, prompt_len) if t < vocab]
    if banned:
        r, t = zip(*banned)
        sub[_long(r, device), _long(t, device)] = float("-inf")
    return sub


def _long(values, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)
