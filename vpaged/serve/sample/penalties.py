"""Penalties of the batched sampler: repetition (prompt and output tokens), frequency and presence (output
tokens), each per request, on the rows of one step that ask for one of them, after the logits processors
(logits_processors.py)."""

from __future__ import annotations

import torch

from .logits_processors import History
from .params import SamplingParams


def apply_penalties(sub: torch.Tensor, params: list[SamplingParams], histories: list[History]) -> torch.Tensor:
    """sub [R, V] float32 with each row's penalties applied: a repetition penalty divides the positive logits
    of the tokens seen in the prompt or output and multiplies the negative ones (the CTRL / transformers /
    vLLM rule); the frequency penalty is subtracted once per occurrence of a token in the output, the presence
    penalty once per token that occurs there (the OpenAI rule)."""
    device, vocab = sub.device, sub.shape[1]
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = _token_counts(histories, vocab, device, output_only=False) > 0
        penalty = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
        scaled = torch.where(sub > 0, sub / penalty, sub * penalty)
        sub = torch.where(seen, scaled, sub)
    if any(p.frequency_penalty or p.presence_penalty for p in params):
        counts = _token_counts(histories, vocab, device, output_only=True)
        freq = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
        pres = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
        sub = sub - freq * counts - pres * (counts > 0).float()
    return sub


def _token_counts(histories: list[History], vocab: int, device, output_only: bool) -> torch.Tensor:
    """[R, V] float32: how often each token occurs in each row's output (or prompt and output)."""
    row_idx, tok_idx = [], []
    for r, (tokens, prompt_len) in enumerate(histories):
        picked = tokens[prompt_len:] if output_only else tokens
        row_idx += [r] * len(picked)
        tok_idx += picked
    counts = torch.zeros((len(histories), vocab), dtype=torch.float32, device=device)
    if tok_idx:
        index = tuple(torch.tensor(i, dtype=torch.long, device=device) for i in (row_idx, tok_idx))
        counts.index_put_(index, torch.ones(len(tok_idx), device=device), accumulate=True)
    return counts
