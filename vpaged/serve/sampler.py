"""Sampler: the next token of every sequence of a step from its logits row, vectorized over the rows.

Each request's logit controls (penalties, logit_bias, min_tokens: logits.py) apply first, to its rows only.
Greedy rows take the argmax. Sampled rows are scaled by their temperature, cut to their top-k and top-p
sets, and drawn by inverse CDF with one uniform number from the sequence's own generator: a sequence's
tokens depend only on its logits and its seed, never on which other sequences share the batch.
"""

from __future__ import annotations

import torch

from .logits import History, apply_controls
from .params import SamplingParams


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list,
    histories: list[History] | None = None,
    eos_token_ids=(),
    allowed: tuple[list[int], torch.Tensor] | None = None,
) -> list[int]:
    """logits [R, V] (row i for params[i] / generators[i]; generators[i] is None for greedy rows).
    histories[i]: row i's tokens so far and prompt length, needed by the rows with penalties or min_tokens;
    eos_token_ids: what min_tokens holds back (with each request's stop tokens); allowed: (rows, bool
    [len(rows), V]) the only tokens those rows may draw (structured output), applied after the controls."""
    rows = logits.shape[0]
    if rows == 0:
        return []
    logits = apply_controls(logits, params, histories, eos_token_ids)
    if allowed is not None:
        idx = torch.tensor(allowed[0], device=logits.device)
        masked = logits.index_select(0, idx).masked_fill(~allowed[1].to(logits.device), float("-inf"))
        logits = logits.index_copy(0, idx, masked)
    tokens = logits.argmax(dim=-1)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if sampled:
        idx = torch.tensor(sampled, device=logits.device)
        picked = _sample_rows(
            logits.index_select(0, idx).float(), [params[i] for i in sampled], [generators[i] for i in sampled]
        )
        tokens = tokens.index_copy(0, idx, picked)
    return tokens.tolist()


def _sample_rows(logits: torch.Tensor, params: list[SamplingParams], generators: list) -> torch.Tensor:
    device = logits.device
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=device)
    logits = logits / temps[:, None]
    top_k = [p.top_k if p.top_k > 0 else 0 for p in params]
    if any(top_k):
        k_max = min(max(top_k), logits.shape[1])
        kth = logits.topk(k_max, dim=-1).values  # [R, k_max], descending
        ks = torch.tensor([min(k, k_max) if k else k_max for k in top_k], device=device)
        threshold = kth.gather(1, (ks - 1)[:, None])
        keep_all = torch.tensor([k == 0 for k in top_k], device=device)[:, None]
        logits = logits.masked_fill(~keep_all & (logits < threshold), float("-inf"))
    top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=device)
    if bool((top_p < 1.0).any()):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Keep a token while the probability of the tokens before it is below top_p (the first always stays).
        before = probs.cumsum(dim=-1) - probs
        drop_sorted = before >= top_p[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)
    cdf = probs.cumsum(dim=-1)
    # u in (0, 1]: the first index whose CDF reaches u * total always has a positive probability.
    u = 1.0 - torch.cat([torch.rand(1, generator=g) for g in generators]).to(device=device, dtype=cdf.dtype)
    picked = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).squeeze(1)
    return picked.clamp_(max=logits.shape[1] - 1)  # rounding at the very top of the CDF
