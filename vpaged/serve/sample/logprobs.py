"""Log probabilities of chosen tokens under the model's raw distribution (log_softmax of the logits as the
model produced them: before temperature, penalties, bias and top-k / top-p), with the k most likely tokens.

Computed only for the rows whose request asks (SamplingParams.logprobs / prompt_logprobs), in float32.
"""

from __future__ import annotations

import torch

from ..outputs import TokenLogprob


def token_logprobs(logits: torch.Tensor, tokens: list[int], ks: list[int]) -> list[TokenLogprob | None]:
    """logits [R, V]; tokens[i]: the token row i chose (or the prompt token that followed it); ks[i]: the
    alternatives row i reports. None for a row that drew no token (sampler.NO_TOKEN, a negative id)."""
    if not tokens:
        return []
    device = logits.device
    logp = logits.float().log_softmax(dim=-1)
    chosen_ids = torch.tensor(tokens, dtype=torch.long, device=device).clamp(min=0)[:, None]
    chosen = logp.gather(1, chosen_ids)
    ranks = ((logp > chosen).sum(dim=-1) + 1).tolist()
    chosen = chosen.squeeze(1).tolist()
    k_max = min(max(ks), logp.shape[1])
    top_values = top_ids = None
    if k_max:
        top = logp.topk(k_max, dim=-1)
        top_values, top_ids = top.values.tolist(), top.indices.tolist()
    out = []
    for i, (token, lp, rank, k) in enumerate(zip(tokens, chosen, ranks, ks)):
        if token < 0:
            out.append(None)
            continue
        top_pairs = tuple(zip(top_ids[i][:k], top_values[i][:k])) if k else ()
        out.append(TokenLogprob(token, lp, rank, top_pairs))
    return out


def record_prompt_logprobs(spans, logits: torch.Tensor) -> None:
    """Append the logprobs of the prompt tokens whose positions a step computed to the requests that asked.
    spans: the step's runner.PromptRows (runner.prompt_logprob_rows); logits: their rows, in that order."""
    targets, ks = [], []
    for rows in spans:
        req = rows.seq.request
        targets += req.prompt[rows.first + 1 : rows.first + 1 + rows.count]
        ks += [req.params.prompt_logprobs] * rows.count
    entries = iter(token_logprobs(logits, targets, ks))
    for rows in spans:
        rows.seq.request.prompt_logprobs.extend(next(entries) for _ in range(rows.count))
