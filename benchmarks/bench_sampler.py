"""The serving sampler's cost per step: `vpaged.serve.sample.sampler.sample` against the one-level draw it
replaced (softmax over the row, a prefix sum over the whole vocabulary, a binary search), and for top-p against
the cut it replaced (a sort of every row), side by side in one run.

Rows R of fp32 logits over a vocabulary V (SmolLM2's 49,152, Llama 3's 128,256), every row sampled with a seed of
its own, in four modes: greedy, temperature 1.0 (what a client that sends no temperature gets), top-k 50 at 0.7,
top-p 0.9 at 0.7. Both arms take the same logits and generators; the one-level arm runs the sampler's own
temperature / top-k / top-p code and differs only in the draw; the sorted-top-p arm (top-p modes only) differs
only in the cut. Reported: median milliseconds per step of each arm and their ratios, and how many of the drawn
tokens agree (the arms sum in a different order, so a target within float32 rounding of a token boundary can
fall on the other side of it).

    .venv/bin/python benchmarks/bench_sampler.py [--rows 1,8,32] [--vocab 49152,128256] [--repeats 15] [--threads N]

Writes benchmarks/results/OUTPUT (default sampler.json). Time it on a quiet machine: under other CPU load the
same 2-thread ops run many times slower.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, print_table, write_json  # noqa: E402

import vpaged.serve.sample.sampler as sampler  # noqa: E402
from vpaged.serve import SamplingParams  # noqa: E402

MODES = {
    "greedy": dict(temperature=0.0),
    "temperature 1.0": dict(temperature=1.0),
    "top-k 50, T 0.7": dict(temperature=0.7, top_k=50),
    "top-p 0.9, T 0.7": dict(temperature=0.7, top_p=0.9),
}


def one_level_draw(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The textbook draw: normalize, prefix-sum the whole row, search it."""
    cdf = (weights / weights.sum(dim=-1, keepdim=True)).cumsum(dim=-1)
    picked = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).squeeze(1)
    return picked.clamp_(max=weights.shape[1] - 1)


def sorted_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The textbook top-p cut: sort every row, prefix-sum its probabilities, drop past top_p."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs
    drop_sorted = (before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    return torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)


# Each arm: the sampler's functions it replaces (none for vpaged's own).
ARMS = {"vpaged": {}, "one-level": {"inverse_cdf": one_level_draw}, "sorted top-p": {"past_top_p": sorted_top_p}}


def time_arm(logits: torch.Tensor, params: list[SamplingParams], arm: str, repeats: int) -> tuple[float, list[int]]:
    """(median seconds of one sample() call, the tokens of the first call) with the arm's functions in the
    sampler."""
    saved = {name: getattr(sampler, name) for name in ARMS[arm]}
    for name, fn in ARMS[arm].items():
        setattr(sampler, name, fn)
    try:
        samples, first = [], None
        for i in range(repeats + 1):
            generators = [torch.Generator().manual_seed(p.seed) if not p.greedy else None for p in params]
            t0 = time.perf_counter()
            tokens = sampler.sample(logits, params, generators)
            if i:  # the first call warms the allocator and the kernels
                samples.append(time.perf_counter() - t0)
            first = first or tokens
        return statistics.median(samples), first
    finally:
        for name, fn in saved.items():
            setattr(sampler, name, fn)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--vocab", default="49152,128256")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--output", default="sampler.json", help="results file name under benchmarks/results/")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    cells, table = [], []
    for vocab in map(int, args.vocab.split(",")):
        for rows in map(int, args.rows.split(",")):
            logits = torch.randn(rows, vocab, generator=gen) * 3
            for mode, kw in MODES.items():
                params = [SamplingParams(seed=1000 + r, **kw) for r in range(rows)]
                names = [a for a in ARMS if a != "sorted top-p" or kw.get("top_p", 1.0) < 1.0]
                arms = {}
                for _ in range(2):  # alternated, twice: each arm's figure is the lower of its two medians
                    for name in names:
                        seconds, tokens = time_arm(logits, params, name, args.repeats)
                        best = arms.get(name, (float("inf"), tokens))[0]
                        arms[name] = (min(best, seconds), tokens)
                agree = sum(a == b for a, b in zip(arms["vpaged"][1], arms["one-level"][1]))
                cell = dict(
                    rows=rows,
                    vocab=vocab,
                    mode=mode,
                    vpaged_ms=1e3 * arms["vpaged"][0],
                    one_level_ms=1e3 * arms["one-level"][0],
                    tokens_agree=agree,
                )
                cell["ratio"] = cell["vpaged_ms"] / cell["one_level_ms"]
                sort = ""
                if "sorted top-p" in arms:
                    cell["sorted_top_p_ms"] = 1e3 * arms["sorted top-p"][0]
                    cell["top_p_ratio"] = cell["vpaged_ms"] / cell["sorted_top_p_ms"]
                    cell["top_p_tokens_agree"] = sum(a == b for a, b in zip(arms["vpaged"][1], arms["sorted top-p"][1]))
                    sort = f"{cell['sorted_top_p_ms']:.3f} ({cell['top_p_ratio']:.2f})"
                cells.append(cell)
                table.append([vocab, rows, mode, f"{cell['vpaged_ms']:.3f}", f"{cell['one_level_ms']:.3f}",
                              f"{cell['ratio']:.2f}", f"{agree}/{rows}", sort])  # fmt: skip
    headers = ["vocab", "rows", "mode", "vpaged ms", "one-level ms", "ratio", "same token", "sorted top-p ms (ratio)"]
    print_table(headers, table)
    path = write_json(
        args.output,
        dict(machine=machine(), threads=torch.get_num_threads(), args=vars(args), cells=cells),
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
