"""Sampler: the next token of every sequence of a step from its logits row, vectorized over the rows.

Each request's logit controls apply first, to its rows only (apply_controls): the logits processors (logit_bias,
min_tokens, bad_words: logits_processors.py), then the penalties (penalties.py). Rows whose request asks for
none of them are not touched, so a batch costs nothing there unless one of its requests asks; those that do are
changed in one float32 copy of their rows.
Greedy rows take the argmax. Sampled rows are scaled by their temperature, cut to their top-k and top-p
sets, and drawn by inverse CDF (inverse_cdf, in two levels) with one uniform number from the sequence's own
generator: a sequence's tokens depend only on its logits and its seed, never on which other sequences share the
batch.

A row left with no token to draw (every logit -inf or NaN: a grammar whose every allowed token bad_words or
min_tokens ban, a model whose logits are NaN) is never sampled: it gets NO_TOKEN, and the engine ends that
sequence with finish_reason "error"; the other rows are drawn as if it were not there. A row with +inf logits
draws among those tokens only (their probabilities, in the limit). check_first_draw refuses a request whose
constraints leave no token for its very first draw when it is added, before it costs a step.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from ...errors import NoAllowedTokenError
from .logits_processors import History, apply_processors
from .params import SamplingParams
from .penalties import apply_penalties

NO_TOKEN = -1  # sample()'s answer for a row that has no token left to draw


def apply_controls(
    logits: torch.Tensor, params: list[SamplingParams], histories: list[History] | None, eos_token_ids: Collection[int]
) -> torch.Tensor:
    """logits [R, V] with each row's controls applied (the same tensor when no row asks for any)."""
    rows = [i for i, p in enumerate(params) if p.adjusts_logits]
    if not rows:
        return logits
    if histories is None:
        raise ValueError("penalties and min_tokens need each row's token history")
    index = torch.tensor(rows, device=logits.device)
    ps, hist = [params[i] for i in rows], [histories[i] for i in rows]
    sub = apply_processors(logits.index_select(0, index).float(), ps, hist, eos_token_ids)
    sub = apply_penalties(sub, ps, hist)
    out = logits.float() if logits.dtype != torch.float32 else logits.clone()
    return out.index_copy(0, index, sub)


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
    [len(rows), V]) the only tokens those rows may draw (structured output), applied after the controls.
    A row with no token left to draw gets NO_TOKEN."""
    rows = logits.shape[0]
    if rows == 0:
        return []
    logits = apply_controls(logits, params, histories, eos_token_ids)
    if allowed is not None:
        idx = torch.tensor(allowed[0], device=logits.device)
        masked = logits.index_select(0, idx).masked_fill(~allowed[1].to(logits.device), float("-inf"))
        logits = logits.index_copy(0, idx, masked)
    best, tokens = logits.max(dim=-1)  # max propagates NaN: a row's best is finite unless the row needs care
    dead: list[int] = []
    troubled = ~torch.isfinite(best)
    if bool(troubled.any()):
        logits, tokens, dead = _mend(logits, tokens, troubled)
    sampled = [i for i, p in enumerate(params) if not p.greedy and i not in dead]
    if sampled:
        idx = torch.tensor(sampled, device=logits.device)
        picked = _sample_rows(
            logits.index_select(0, idx).float(), [params[i] for i in sampled], [generators[i] for i in sampled]
        )
        tokens = tokens.index_copy(0, idx, picked)
    out = tokens.tolist()
    for i in dead:
        out[i] = NO_TOKEN
    return out


def _mend(logits: torch.Tensor, tokens: torch.Tensor, troubled: torch.Tensor):
    """(logits, greedy tokens, dead rows) with the rows whose best logit is not finite made drawable where they
    can be: NaN counts as -inf (no evidence for the token), and a row with +inf logits keeps only those tokens,
    at equal odds; a row with no token above -inf is dead."""
    rows = troubled.nonzero()[:, 0]
    sub = logits.index_select(0, rows)
    sub = sub.masked_fill(sub.isnan(), float("-inf"))
    infinite = sub == float("inf")
    sub = torch.where(infinite.any(dim=-1, keepdim=True), torch.where(infinite, 0.0, float("-inf")).to(sub.dtype), sub)
    best, picked = sub.max(dim=-1)
    dead = rows[best == float("-inf")].tolist()
    return logits.index_copy(0, rows, sub), tokens.index_copy(0, rows, picked), dead


def _sample_rows(logits: torch.Tensor, params: list[SamplingParams], generators: list) -> torch.Tensor:
    """One token for each row of logits [R, V] (float32, a copy of the caller's: it is scaled in place)."""
    device = logits.device
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=device)
    logits = logits.div_(temps[:, None])
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
        logits = logits.masked_fill(past_top_p(logits, top_p), float("-inf"))
    # Unnormalized probabilities: the draw compares u against the row's total, so softmax's division is not needed.
    weights = logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_()
    # u in (0, 1]: the first index whose cumulative weight reaches u * total always has a positive weight.
    u = 1.0 - torch.cat([torch.rand(1, generator=g) for g in generators]).to(device=device, dtype=weights.dtype)
    return inverse_cdf(weights, u)


TOP_P_FIRST_K = 64  # the most likely tokens past_top_p looks at first


def past_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """bool [R, V]: the tokens outside each row's top-p set (the smallest set of its most likely tokens whose
    probability reaches top_p [R]; a row's first token always stays; a row with top_p 1.0 keeps every token).
    A token stays while the probability of the tokens before it in descending order is below top_p.

    Without sorting the vocabulary where it can: a model's distribution puts top_p's mass on a few tokens, so the
    TOP_P_FIRST_K most likely are taken (torch.topk, one pass) and, when their mass reaches every row's top_p, the
    cut lies among them and every token past them is out. Otherwise k grows 16x a time, up to a full sort (a flat
    distribution, a high temperature). With top-p 0.9 over 32 rows of 49,152 logits the sampler's call takes 0.29x
    the time it took with a sort of every row (benchmarks/bench_sampler.py, on a Zen 3 core pair)."""
    rows, vocab = logits.shape
    probs = logits.softmax(dim=-1)
    cut = top_p < 1.0
    k = min(TOP_P_FIRST_K, vocab)
    while True:
        if 4 * k >= vocab:
            values, order = probs.sort(dim=-1, descending=True)
            break
        values, order = probs.topk(k, dim=-1)  # descending
        # A row whose cut is past the k: its k tokens hold less than top_p (rows kept whole never need more).
        if not bool((cut & (values.sum(dim=-1) < top_p)).any()):
            break
        k *= 16
    before = values.cumsum(dim=-1) - values
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, order, before < top_p[:, None])
    return ~keep & cut[:, None]  # a row with top_p 1.0 drops nothing, past the k or not


DRAW_BLOCK = 256  # tokens a block of inverse_cdf's first level sums


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """For each row of weights [R, V] (>= 0, some weight positive in every row) the first index whose cumulative
    weight reaches u * the row's total, u [R] in (0, 1]: the draw by inverse CDF, and the index it gives always has
    a positive weight. In two levels, so that no prefix sum runs over the whole vocabulary (a prefix sum is a
    serial pass, several times the cost of a vectorized sum on a CPU): the row's blocks of DRAW_BLOCK tokens are
    summed and those sums prefix-summed, the block that holds the target is found, and that block alone is
    prefix-summed. Each row's answer depends on that row only."""
    rows, vocab = weights.shape
    block = DRAW_BLOCK
    whole = vocab // block * block
    sums = weights[:, :whole].reshape(rows, -1, block).sum(dim=-1)
    if whole < vocab:
        sums = torch.cat([sums, weights[:, whole:].sum(dim=-1, keepdim=True)], dim=1)
    cum = sums.cumsum(dim=-1)
    target = u * cum[:, -1]
    # The first block whose cumulative sum reaches the target; rounding can put the target past the last block's
    # sum, and then the last block with any weight holds it.
    blocks = torch.arange(sums.shape[1], device=weights.device)
    last_block = torch.where(sums > 0, blocks, 0).amax(dim=-1)
    j = torch.minimum(torch.searchsorted(cum, target[:, None]).squeeze(1), last_block)
    before = torch.where(j > 0, cum.gather(1, (j - 1).clamp(min=0)[:, None]).squeeze(1), 0.0)
    rest = target - before  # > 0: the block's cumulative sum before it is below the target
    offsets = torch.arange(block, device=weights.device)
    cols = j[:, None] * block + offsets
    inside = cols < vocab
    chunk = weights.gather(1, cols.clamp(max=vocab - 1)).masked_fill_(~inside, 0.0)
    last_in_chunk = torch.where(chunk > 0, offsets, 0).amax(dim=-1)
    k = torch.minimum(torch.searchsorted(chunk.cumsum(dim=-1), rest[:, None]).squeeze(1), last_in_chunk)
    return j * block + k


def check_first_draw(params: SamplingParams, prompt: list[int], vocab_size: int, eos_token_ids, grammars=None) -> None:
    """NoAllowedTokenError (naming the fields) when the request's own constraints leave no token for its first
    draw: its grammar (grammars: the engine's structured.Grammars) allows none of this vocabulary, or bad_words /
    bad_words_token_ids / min_tokens ban every token it allows. A contradiction that shows only later (a
    grammar whose second token is banned) ends the request then, with finish_reason "error"."""
    if params.structured is None and not params.bad_words_token_ids:
        return  # without a grammar or bans nothing takes a token out of the running
    row = apply_controls(torch.zeros(1, vocab_size), [params], [(prompt, len(prompt))], eos_token_ids)
    banned = row[0] == float("-inf")
    if params.structured is None:
        if bool(banned.all()):
            field = "bad_words" if params.bad_words else "bad_words_token_ids"
            raise NoAllowedTokenError(f"{field} ban every token of the vocabulary: nothing can be generated")
        return
    allowed = grammars.allowed([grammars.matcher(params.structured, [])])[0]
    kind = params.structured.kind
    if not bool(allowed.any()):
        raise NoAllowedTokenError(f"the {kind} grammar allows no token of this model's vocabulary to begin with")
    if not bool((allowed & ~banned).any()):
        fields = [n for n in ("bad_words", "bad_words_token_ids") if getattr(params, n)][:1]
        fields += ["min_tokens"] if params.min_tokens else []
        raise NoAllowedTokenError(
            f"{' and '.join(fields)} ban every token the {kind} grammar allows to begin with: no output can follow both"
        )
