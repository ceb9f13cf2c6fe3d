"""Logit controls of the batched sampler: logit_bias, min_tokens, bad_words, repetition / frequency / presence
penalties, each per request, for the rows of one step at once.

Applied in that order (vLLM's: the logits processors, then the penalties), before temperature, top-k and
top-p. Rows whose request asks for none of them are not touched, so a batch costs nothing here unless one of
its requests asks; those that do are changed in one float32 copy of their rows.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from .params import SamplingParams

# (all of a sequence's tokens so far, its prompt length): the tokens after prompt_len are its output.
History = tuple[Sequence[int], int]


def apply_controls(
    logits: torch.Tensor, params: list[SamplingParams], histories: list[History] | None, eos_token_ids: Collection[int]
) -> torch.Tensor:
    """logits [R, V] with each row's controls applied (the same tensor when no row asks for any)."""
    rows = [i for i, p in enumerate(params) if p.adjusts_logits]
    if not rows:
        return logits
    if histories is None:
        raise ValueError("penalties and min_tokens need each row's token history")
    device, vocab = logits.device, logits.shape[1]
    sub = logits.index_select(0, torch.tensor(rows, device=device)).float()
    ps = [params[i] for i in rows]
    hist = [histories[i] for i in rows]
    bias = [(r, t, b) for r, p in enumerate(ps) for t, b in p.logit_bias if t < vocab]
    if bias:
        r, t, b = zip(*bias)
        sub.index_put_((_long(r, device), _long(t, device)), torch.tensor(b, device=device), accumulate=True)
    banned = []
    for r, (p, (tokens, prompt_len)) in enumerate(zip(ps, hist)):
        if len(tokens) - prompt_len < p.min_tokens:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            banned += [(r, t) for t in stops if t < vocab]
        banned += [(r, t) for t in banned_next_tokens(p.bad_words_token_ids, tokens, prompt_len) if t < vocab]
    if banned:
        r, t = zip(*banned)
        sub[_long(r, device), _long(t, device)] = float("-inf")
    if any(p.repetition_penalty != 1.0 for p in ps):
        seen = _token_counts(hist, vocab, device, output_only=False) > 0
        penalty = torch.tensor([p.repetition_penalty for p in ps], device=device)[:, None]
        scaled = torch.where(sub > 0, sub / penalty, sub * penalty)
        sub = torch.where(seen, scaled, sub)
    if any(p.frequency_penalty or p.presence_penalty for p in ps):
        counts = _token_counts(hist, vocab, device, output_only=True)
        freq = torch.tensor([p.frequency_penalty for p in ps], device=device)[:, None]
        pres = torch.tensor([p.presence_penalty for p in ps], device=device)[:, None]
        sub = sub - freq * counts - pres * (counts > 0).float()
    out = logits.float() if logits.dtype != torch.float32 else logits.clone()
    return out.index_copy(0, torch.tensor(rows, device=device), sub)


def banned_next_tokens(sequences, tokens: Sequence[int], prompt_len: int) -> list[int]:
    """The tokens that would complete one of the bad sequences next: the last token of each sequence whose
    other tokens are the end of the output, tokens[prompt_len:] (every one-token sequence). The prompt does not
    count: a bad word the prompt ends with may be completed, as in vLLM."""
    out = []
    for seq in sequences:
        head = len(seq) - 1
        if head == 0 or (len(tokens) - prompt_len >= head and tuple(tokens[len(tokens) - head :]) == tuple(seq[:head])):
            out.append(seq[-1])
    return out


def _long(values, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _token_counts(hist: list[History], vocab: int, device, output_only: bool) -> torch.Tensor:
    """[R, V] float32: how often each token occurs in each row's output (or prompt and output)."""
    row_idx, tok_idx = [], []
    for r, (tokens, prompt_len) in enumerate(hist):
        picked = tokens[prompt_len:] if output_only else tokens
        row_idx += [r] * len(picked)
        tok_idx += picked
    counts = torch.zeros((len(hist), vocab), dtype=torch.float32, device=device)
    if tok_idx:
        counts.index_put_(
            (_long(row_idx, device), _long(tok_idx, device)),
            torch.ones(len(tok_idx), device=device),
            accumulate=True,
        )
    return counts
