"""The sampler's draw against a reference written from the definitions in float64: inverse_cdf's two-level
search gives the index whose CDF interval holds u * total (up to float32 rounding of the sums), never an index of
zero weight, whatever the vocabulary's size and the weights' shape; and sample() with temperature, top-k and top-p
picks, for the uniform number its generator gives, the token the reference's inverse CDF gives."""

import math

import numpy as np
import pytest
import torch

from vpaged.serve import SamplingParams
from vpaged.serve.sample.sampler import DRAW_BLOCK, inverse_cdf, past_top_p, sample

# float32 sums of up to 10^5 weights against float64 ones: the target may move by this share of the row's total.
ROUNDING = 1e-4


def assert_in_interval(weights: torch.Tensor, u: torch.Tensor, picked: torch.Tensor) -> None:
    """Every pick has a positive weight, and its float64 CDF interval holds u * total within ROUNDING * total."""
    w = weights.double().numpy()
    cdf = np.cumsum(w, axis=1)
    for r, k in enumerate(picked.tolist()):
        assert 0 <= k < w.shape[1] and w[r, k] > 0, (
            f"row {r}: index {k} has weight {w[r, k] if k < w.shape[1] else None}"
        )
        total = cdf[r, -1]
        target = float(u[r]) * total
        lo, hi = (cdf[r, k - 1] if k else 0.0), cdf[r, k]
        slack = ROUNDING * total
        assert lo - slack <= target <= hi + slack, f"row {r}: target {target} outside [{lo}, {hi}] of index {k}"


def random_weights(rng: torch.Generator, rows: int, vocab: int, shape: str) -> torch.Tensor:
    logits = torch.randn(rows, vocab, generator=rng) * 4
    w = (logits - logits.amax(dim=1, keepdim=True)).exp()
    if shape == "sparse":  # most tokens cut away, as top-k / top-p leave them
        w *= torch.rand(rows, vocab, generator=rng) < 0.01
    elif shape == "tail":  # weight only in the last, partial block
        w[:, : vocab - vocab % DRAW_BLOCK - 1] = 0
    elif shape == "one":  # a single token left
        w.zero_()
        w[torch.arange(rows), torch.randint(vocab, (rows,), generator=rng)] = 1.0
    elif shape == "range":  # weights over 60 orders of magnitude
        w = torch.exp(-torch.rand(rows, vocab, generator=rng) * 138)
    w[torch.arange(rows), torch.randint(vocab, (rows,), generator=rng)] += 1e-3  # every row keeps some weight
    return w


@pytest.mark.parametrize("vocab", [1, 7, DRAW_BLOCK, DRAW_BLOCK + 1, 5000, 49152, 50257])
@pytest.mark.parametrize("shape", ["dense", "sparse", "tail", "one", "range"])
def test_inverse_cdf_picks_the_interval_that_holds_the_target(rng, vocab, shape):
    w = random_weights(rng, 16, vocab, shape)
    u = 1.0 - torch.rand(16, generator=rng)  # (0, 1]
    u[0], u[1] = 1.0, 1e-9  # the very top and the very bottom of the CDF
    picked = inverse_cdf(w, u)
    assert picked.dtype == torch.int64 and picked.shape == (16,)
    assert_in_interval(w, u, picked)


def test_inverse_cdf_of_a_row_does_not_depend_on_the_others(rng):
    w = random_weights(rng, 32, 49152, "dense")
    u = 1.0 - torch.rand(32, generator=rng)
    together = inverse_cdf(w, u)
    alone = torch.cat([inverse_cdf(w[r : r + 1].clone(), u[r : r + 1]) for r in range(32)])
    assert torch.equal(together, alone)


def test_inverse_cdf_ends_of_the_cdf(rng):
    vocab = 3 * DRAW_BLOCK + 5
    w = torch.zeros(3, vocab)
    first, last = 40, 2 * DRAW_BLOCK + 9
    w[:, first], w[:, last] = 0.5, 0.5
    assert inverse_cdf(w, torch.tensor([1e-9, 0.5, 1.0])).tolist() == [first, first, last]


def reference_pick(row: np.ndarray, p: SamplingParams, u: float) -> tuple[int | None, float]:
    """(the token the definitions give for u, how close the row's top-p cut came to top_p): temperature, then the
    top_k largest, then the smallest set of the most likely whose probability reaches top_p, then inverse CDF."""
    x = row / p.temperature
    keep = np.ones_like(x, dtype=bool)
    if p.top_k > 0:
        keep &= x >= np.sort(x)[-min(p.top_k, len(x))]
    margin = math.inf
    if p.top_p < 1.0:
        y = np.where(keep, x, -np.inf)
        order = np.argsort(-y, kind="stable")
        probs = np.exp(y[order] - y[order[0]])
        probs /= probs.sum()
        before = np.cumsum(probs) - probs
        margin = float(np.min(np.abs(before - p.top_p)))
        keep[order[before >= p.top_p]] = False
    w = np.where(keep, np.exp(x - x[keep].max()), 0.0)
    cdf = np.cumsum(w)
    return int(np.searchsorted(cdf, u * cdf[-1])), margin


def test_sample_draws_the_reference_token_for_its_uniform_number(rng, prng):
    vocab = 2000
    params, generators, rows = [], [], []
    while len(params) < 24:
        p = SamplingParams(
            temperature=prng.choice([0.3, 0.7, 1.0, 1.6]),
            top_k=prng.choice([-1, 1, 5, 50]),
            top_p=prng.choice([1.0, 0.9, 0.5]),
            seed=prng.randrange(1 << 30),
        )
        row = (torch.randn(vocab, generator=rng) * 3).double().numpy()
        if reference_pick(row.astype(np.float32).astype(np.float64), p, 0.5)[1] < 1e-4:
            continue  # the top-p cut within float32 rounding of a token's boundary: either side is right
        params.append(p)
        generators.append(torch.Generator().manual_seed(p.seed))
        rows.append(row)
    logits = torch.tensor(np.stack(rows), dtype=torch.float32)
    # The uniform number each row's generator gives for its draw (sample takes u = 1 - rand).
    us = [1.0 - float(torch.rand(1, generator=torch.Generator().set_state(g.get_state()))) for g in generators]
    picked = sample(logits.clone(), params, generators)
    for r, (p, u) in enumerate(zip(params, us)):
        x = logits[r].double().numpy()
        want, _ = reference_pick(x, p, u)
        if picked[r] != want:  # a target within rounding of a boundary: the token on either side of it
            lo = reference_pick(x, p, max(u - ROUNDING, 1e-12))[0]
            hi = reference_pick(x, p, min(u + ROUNDING, 1.0))[0]
            assert lo <= picked[r] <= hi, f"row {r} ({p}): picked {picked[r]}, reference {want} (u = {u})"


@pytest.mark.parametrize("vocab", [3, 200, 2000, 49152])
def test_the_top_p_cut_keeps_the_tokens_the_definition_keeps(rng, vocab):
    """past_top_p against a float64 sort of every row: rows peaked (the cut among the first TOP_P_FIRST_K tokens),
    wider (past them) and flat (a full sort), rows cut to a few tokens by top-k first, rows with top_p 1.0 kept
    whole, all in one batch; a token within float32 rounding of the cut may fall on either side."""
    scales = [8.0, 3.0, 1.0, 0.05, 3.0, 8.0, 0.5, 2.0]
    logits = torch.randn(len(scales), vocab, generator=rng) * torch.tensor(scales)[:, None]
    logits[4, torch.randperm(vocab, generator=rng)[: vocab // 2]] = float("-inf")  # as top-k leaves a row
    top_p = torch.tensor([0.9, 0.95, 0.5, 0.9, 0.8, 1.0, 1.0, 0.3])
    dropped = past_top_p(logits, top_p)
    assert dropped.dtype == torch.bool and dropped.shape == logits.shape
    for r in range(len(scales)):
        x = logits[r].double().numpy()
        if top_p[r] == 1.0:
            assert not dropped[r].any(), f"row {r}: top_p 1.0 dropped a token"
            continue
        order = np.argsort(-x, kind="stable")
        probs = np.exp(x[order] - x[order[0]])
        probs /= probs.sum()
        before = np.cumsum(probs) - probs
        p = float(top_p[r])
        got = dropped[r].numpy()[order]
        sure = np.abs(before - p) > ROUNDING
        assert np.array_equal(got[sure], (before >= p)[sure]), f"row {r}: the cut differs from the definition's"
        assert not got[0], f"row {r}: its most likely token was dropped"
