"""Logprobs of generated tokens and of prompt tokens (SamplingParams.logprobs / prompt_logprobs) against
log_softmax of a plain transformers forward (SDPA) on the same tokens, fp32: greedy and seeded sampling,
chunked prefill, a prompt found in the prefix cache, n > 1 completions; and requests that do not ask get
nothing and the last-position-only path."""

import pytest
import torch

pytest.importorskip("transformers")

from vpaged.errors import InvalidArgumentError  # noqa: E402
from vpaged.serve import LLM, SamplingParams  # noqa: E402

pytestmark = pytest.mark.serving  # skipped where transformers cannot serve (tests/conftest.py)

TOL = 1e-4


@torch.no_grad()
def reference_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V]: row p is log_softmax of the logits at position p (predicting token p + 1)."""
    model.set_attn_implementation("sdpa")
    return model(input_ids=torch.tensor([tokens])).logits[0].float().log_softmax(dim=-1)


def check_entry(entry, ref_row: torch.Tensor, token: int, k: int):
    assert entry.token_id == token
    assert abs(entry.logprob - float(ref_row[token])) <= TOL
    assert (
        entry.rank == 1 + int((ref_row > ref_row[token] + TOL).sum())
        or abs(float(ref_row.sort(descending=True).values[entry.rank - 1]) - float(ref_row[token])) <= TOL
    )  # ties within rounding may order either way
    assert len(entry.top) == k
    top_ref = ref_row.topk(k)
    for (tid, lp), ref_lp in zip(entry.top, top_ref.values.tolist()):
        assert abs(lp - ref_lp) <= TOL  # the k-th largest values agree ...
        assert abs(lp - float(ref_row[tid])) <= TOL  # ... and each id has the logprob it is reported with


def check_output(reference, out, k_gen, k_prompt):
    seq_tokens = out.prompt_token_ids + out.outputs[0].token_ids
    ref = reference_logprobs(reference, seq_tokens)
    prompt_len = len(out.prompt_token_ids)
    if k_prompt is None:
        assert out.prompt_logprobs is None
    else:
        assert len(out.prompt_logprobs) == prompt_len and out.prompt_logprobs[0] is None
        for p in range(1, prompt_len):
            check_entry(out.prompt_logprobs[p], ref[p - 1], seq_tokens[p], k_prompt)
    for c in out.outputs:
        if k_gen is None:
            assert c.logprobs is None
            continue
        tokens = out.prompt_token_ids + c.token_ids
        ref_c = reference_logprobs(reference, tokens) if c.index else ref
        assert len(c.logprobs) == len(c.token_ids)
        for j, entry in enumerate(c.logprobs):
            check_entry(entry, ref_c[prompt_len + j - 1], tokens[prompt_len + j], k_gen)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_equal_log_softmax_of_a_transformers_forward(reference, prng, temperature):
    llm = LLM("random:llama-tiny", kv_budget_bytes=8 << 20, max_num_batched_tokens=24)  # prompts span chunks
    prompts = [[prng.randrange(3, 500) for _ in range(prng.randint(2, 60))] for _ in range(5)]
    asks = [(5, 3), (0, None), (None, 20), (None, None), (20, 0)]
    params = [
        SamplingParams(
            max_tokens=prng.randint(1, 8),
            temperature=temperature,
            seed=prng.randrange(1 << 32),
            ignore_eos=True,
            logprobs=k_gen,
            prompt_logprobs=k_prompt,
        )
        for k_gen, k_prompt in asks
    ]
    outs = llm.generate(prompts, params)
    for out, (k_gen, k_prompt) in zip(outs, asks):
        check_output(reference, out, k_gen, k_prompt)
    # the tokens do not depend on asking: the same requests without logprobs draw the same
    plain = llm.generate(
        prompts, [SamplingParams(**{**p.__dict__, "logprobs": None, "prompt_logprobs": None}) for p in params]
    )
    assert [o.token_ids for o in plain] == [o.token_ids for o in outs]


def test_prompt_logprobs_of_a_cached_prompt_and_of_n_completions(reference, prng):
    llm = LLM("random:llama-tiny", kv_budget_bytes=8 << 20, page_size=4096)  # 32 tokens a page
    prompt = [prng.randrange(3, 500) for _ in range(70)]
    first = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))[0]
    assert first.prompt_logprobs is None
    again = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))[0]
    assert again.metrics.prefix_hit_tokens >= 32  # the prefix cache serves this prompt ...
    asked = llm.generate(
        [prompt], SamplingParams(max_tokens=3, temperature=0.7, seed=5, n=3, logprobs=2, prompt_logprobs=1)
    )[0]
    assert asked.metrics.prefix_hit_tokens == 0  # ... but not a request that needs every position's logits
    assert len(asked.outputs) == 3
    check_output(reference, asked, 2, 1)


def test_bad_logprob_counts_are_refused():
    for bad in (-1, 21, 2.0, True, "1"):
        with pytest.raises(InvalidArgumentError, match="logprobs"):
            SamplingParams(logprobs=bad)
        with pytest.raises(InvalidArgumentError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
