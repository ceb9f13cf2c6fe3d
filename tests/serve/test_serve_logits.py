"""Logit controls of the batched sampler (logit_bias, min_tokens, repetition / frequency / presence penalties),
per request within one batch, against a per-request reference written from the definitions in float64; and
in the engine, greedy decoding with penalties against a token-by-token transformers loop applying them."""

import random

import pytest
import torch
from serve_helpers import tiny_engine_and_reference

from vpaged.errors import InvalidArgumentError
from vpaged.serve import SamplingParams
from vpaged.serve.sample.sampler import apply_controls, sample

VOCAB = 64
EOS = (2,)


def reference_controls(logits: list[float], p: SamplingParams, tokens: list[int], prompt_len: int) -> list[float]:
    """One row by the rules (OpenAI's penalties, CTRL's repetition penalty), in plain Python floats."""
    out = [float(x) for x in logits]
    for t, b in p.logit_bias:
        out[t] += b
    if len(tokens) - prompt_len < p.min_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(EOS)):
            out[t] = float("-inf")
    seen = set(tokens)
    for t in seen:
        if p.repetition_penalty != 1.0:
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    generated = tokens[prompt_len:]
    for t in set(generated):
        out[t] -= p.frequency_penalty * generated.count(t) + p.presence_penalty
    return out


def random_params(prng: random.Random) -> SamplingParams:
    def maybe(x, default):
        return x if prng.random() < 0.5 else default

    max_tokens = prng.randint(1, 10)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=prng.choice([0.0, 0.7]),
        seed=prng.randrange(1 << 30),
        presence_penalty=maybe(prng.uniform(-2, 2), 0.0),
        frequency_penalty=maybe(prng.uniform(-2, 2), 0.0),
        repetition_penalty=maybe(prng.uniform(0.5, 2.0), 1.0),
        logit_bias=maybe({prng.randrange(VOCAB): prng.uniform(-100, 100) for _ in range(prng.randint(1, 4))}, {}),
        min_tokens=maybe(prng.randint(0, max_tokens), 0),
        stop_token_ids=maybe((prng.randrange(VOCAB),), ()),
        ignore_eos=prng.random() < 0.3,
    )


def test_each_row_gets_its_own_controls(prng, rng):
    for _ in range(20):
        rows = prng.randint(1, 12)
        params = [random_params(prng) for _ in range(rows)]
        histories = []
        for _ in range(rows):
            prompt_len = prng.randint(1, 8)
            tokens = [prng.randrange(VOCAB) for _ in range(prompt_len + prng.randint(0, 10))]
            histories.append((tokens, prompt_len))
        logits = torch.randn(rows, VOCAB, generator=rng) * 3
        got = apply_controls(logits, params, histories, EOS)
        for r in range(rows):
            want = torch.tensor(reference_controls(logits[r].tolist(), params[r], *histories[r]), dtype=torch.float64)
            torch.testing.assert_close(got[r].double(), want, rtol=1e-5, atol=1e-4)
        # greedy rows take the argmax of their controlled row, whatever the others in the batch ask
        greedy = [SamplingParams(**{**p.__dict__, "temperature": 0.0}) for p in params]
        tokens = sample(logits, greedy, [None] * rows, histories, EOS)
        for r in range(rows):
            alone = sample(logits[r : r + 1], [greedy[r]], [None], [histories[r]], EOS)
            assert tokens[r] == alone[0] == int(got[r].argmax())


def test_rows_without_controls_are_untouched(rng):
    logits = torch.randn(3, VOCAB, generator=rng)
    plain = [SamplingParams()] * 3
    assert apply_controls(logits, plain, None, EOS) is logits
    mixed = [SamplingParams(), SamplingParams(presence_penalty=1.0), SamplingParams()]
    got = apply_controls(logits, mixed, [([1, 2, 3], 1)] * 3, EOS)
    assert torch.equal(got[0], logits[0]) and torch.equal(got[2], logits[2])
    assert not torch.equal(got[1], logits[1])


def test_min_tokens_holds_back_eos_and_stop_tokens(rng):
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS[0]] = 50.0
    p = SamplingParams(max_tokens=5, temperature=0.0, min_tokens=2)
    assert sample(logits, [p], [None], [([5, 6], 2)], EOS) != [EOS[0]]  # none generated yet
    assert sample(logits, [p], [None], [([5, 6, 7, 8], 2)], EOS) == [EOS[0]]  # two generated


@pytest.mark.parametrize(
    "kw",
    [
        dict(presence_penalty=2.5),
        dict(frequency_penalty=-3),
        dict(frequency_penalty=float("nan")),
        dict(repetition_penalty=0.0),
        dict(repetition_penalty=True),
        dict(logit_bias={1: 101}),
        dict(logit_bias={-1: 1.0}),
        dict(logit_bias={"1": 1.0}),
        dict(logit_bias=5),
        dict(min_tokens=-1),
        dict(min_tokens=20, max_tokens=10),
    ],
)
def test_bad_control_values_are_refused(kw):
    field = next(iter(kw))
    with pytest.raises(InvalidArgumentError, match=field):
        SamplingParams(**kw)


@torch.no_grad()
def test_engine_greedy_with_penalties_matches_a_token_by_token_reference(prng):
    llm, reference = tiny_engine_and_reference()
    vocab = reference.config.vocab_size
    prompts = [[prng.randrange(3, 500) for _ in range(prng.randint(3, 20))] for _ in range(6)]
    params = []
    for _ in prompts:
        p = random_params(prng)
        bias = {prng.randrange(vocab): prng.uniform(-5, 5) for _ in range(3)}
        params.append(SamplingParams(**{**p.__dict__, "temperature": 0.0, "logit_bias": bias, "ignore_eos": True}))
    outs = llm.generate(prompts, params)
    eos = tuple(llm.engine.eos_token_ids)
    for prompt, p, out in zip(prompts, params, outs):
        tokens = list(prompt)
        for _ in out.token_ids:
            logits = reference(input_ids=torch.tensor([tokens])).logits[0, -1].double()
            controlled = torch.tensor(reference_controls(logits.tolist(), p, tokens, len(prompt)))
            top = controlled.topk(2)
            tokens.append(int(top.indices[0]))
            if tokens[-1] != out.token_ids[len(tokens) - len(prompt) - 1]:
                assert float(top.values[0] - top.values[1]) < 1e-4  # a tie that rounding broke the other way
                break
            if tokens[-1] in p.stop_token_ids or (not p.ignore_eos and tokens[-1] in eos):
                break
