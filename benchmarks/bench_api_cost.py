"""What the API's extra fields cost a batch: SmolLM2-135M-Instruct (benchmarks/real_model.py), a batch of 32
chat requests decoded together, in three arms alternated (their order rotating) for `--repeats` rounds of one run:

- plain: every request asks for nothing beyond temperature and a seed;
- mixed: the same batch, but one request asks for top_logprobs 5 and one for a JSON schema;
- bypassed: the plain batch with the sampler's per-request hooks (logit controls, grammar masks) replaced by
  no-ops: what the plain batch would cost if the API fields did not exist.

Every request generates exactly --max-tokens tokens (ignore_eos; a completed grammar then allows only EOS), so
each arm does the same work and a tokens-per-second ratio is a time ratio. Reports medians of the generated
tokens per second, mixed / plain (the issue asks >= 0.9) and plain / bypassed (requests that ask for nothing
unchanged: >= 0.98), and whether the plain requests' tokens are the same in the mixed batch as in the plain one.

python benchmarks/bench_api_cost.py [--batch 32] [--max-tokens 32] [--repeats 5] [--threads N]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_model  # noqa: E402
from common import machine, print_table, write_json  # noqa: E402

import vpaged.serve.sample.sampler as sampler  # noqa: E402
from vpaged.serve import LLM, LLMEngine, SamplingParams  # noqa: E402
from vpaged.serve.sample.structured import GrammarSpec  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array"}},
    "required": ["name", "age"],
}


def run(llm, prompts, params) -> tuple[float, list[list[int]], float]:
    """(generated tokens per second of the whole batch, each request's tokens, the seconds the engine spent
    sampling: the only phase the fields change, and less exposed to other jobs' load than the whole)."""
    sampling = llm.engine.times.sample
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - t0
    tokens = [list(o.token_ids) for o in outs]
    return sum(map(len, tokens)) / seconds, tokens, llm.engine.times.sample - sampling


@contextlib.contextmanager
def hooks_bypassed():
    """The sampler without the API's per-request hooks: logit controls and grammar masks are no-ops (the
    logprobs of a draw are computed only when a row asks, so a plain batch never reaches them)."""
    saved = (sampler.apply_controls, LLMEngine._grammar_masks)
    sampler.apply_controls = lambda logits, *_: logits
    LLMEngine._grammar_masks = lambda *_: None
    try:
        yield
    finally:
        sampler.apply_controls, LLMEngine._grammar_masks = saved


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--output", default="api-cost_smollm2_epyc-avx2-2c.json", help="under benchmarks/results/")
    args = ap.parse_args(argv)
    why = real_model.why_unavailable()
    if why:
        raise SystemExit(why)
    torch.set_num_threads(args.threads)
    llm = LLM(str(real_model.model_dir()), kv_budget_bytes=512 << 20, max_num_seqs=args.batch)
    tok = llm.engine.tokenizer
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": f"Tell me about item {i} in JSON."}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for i in range(args.batch)
    ]
    spec = GrammarSpec.json_schema(SCHEMA)
    llm.engine.grammars.compile(spec)  # compiled once, before timing (as the server does off the engine thread)
    base = dict(max_tokens=args.max_tokens, temperature=0.8, ignore_eos=True)
    plain = [SamplingParams(seed=i, **base) for i in range(args.batch)]
    mixed = list(plain)
    mixed[0] = SamplingParams(seed=0, logprobs=5, **base)
    mixed[1] = SamplingParams(seed=1, structured=spec, **base)
    run(llm, prompts[:4], mixed[:4])  # warm-up
    arms = {"plain": plain, "mixed": mixed, "bypassed": plain}
    rates = {name: [] for name in arms}
    sample_s = {name: [] for name in arms}
    tokens = {}
    for round_ in range(args.repeats):
        names = list(arms)[round_ % 3 :] + list(arms)[: round_ % 3]  # each arm first in turn: drift cancels
        for name in names:
            with hooks_bypassed() if name == "bypassed" else contextlib.nullcontext():
                rate, tokens[name], sampled = run(llm, prompts, arms[name])
            rates[name].append(rate)
            sample_s[name].append(sampled)
    med = {k: statistics.median(v) for k, v in rates.items()}
    ratios = {"mixed_vs_plain": med["mixed"] / med["plain"], "plain_vs_bypassed": med["plain"] / med["bypassed"]}
    # the same ratios per round (arms of one round ran back to back), medians: less exposed to drift
    for name, (a, b) in {"mixed_vs_plain": ("mixed", "plain"), "plain_vs_bypassed": ("plain", "bypassed")}.items():
        ratios[name + "_paired"] = statistics.median(x / y for x, y in zip(rates[a], rates[b]))
    same = tokens["mixed"][2:] == tokens["plain"][2:] == tokens["bypassed"][2:]
    print_table(["run", "tokens/s (median)"], [[k, f"{v:.1f}"] for k, v in med.items()])
    print_table(["ratio", "value"], [[k, f"{v:.3f}"] for k, v in ratios.items()])
    print(f"plain requests' tokens the same in every arm: {same}")
    payload = {"machine": machine(), "args": vars(args), "rates": rates, "median": med, "ratios": ratios}
    payload["plain_requests_tokens_identical"] = same
    payload["sample_seconds"] = sample_s
    payload["sample_seconds_median"] = {k: statistics.median(v) for k, v in sample_s.items()}
    print(f"seconds in the sampler per run (median): {payload['sample_seconds_median']}")
    print(f"wrote {write_json(args.output, payload)}")
    return payload


if __name__ == "__main__":
    main()
