"""bad_words / bad_words_token_ids: per request within one batch, against a per-request reference that states
the rule the other way round (a token is banned when appending it would make the output end with a bad
sequence); the words' tokenization with and without a leading space; in the engine, greedy decoding with bad
sequences against a token-by-token transformers loop applying the same rule, with the other requests of the
batch unchanged."""

import random

import pytest
import torch
from serve_helpers import tiny_engine_and_reference

from vpaged.errors import InvalidArgumentError
from vpaged.serve import SamplingParams
from vpaged.serve.sample.bad_words import bad_word_sequences, resolve_bad_words
from vpaged.serve.sample.sampler import apply_controls, sample

VOCAB = 48
EOS = (2,)


def reference_banned(bad: tuple[tuple[int, ...], ...], tokens: list[int], prompt_len: int) -> set[int]:
    """Every token t such that output + [t] ends with one of the bad sequences (only a sequence's last token
    can do that, so those are the candidates)."""
    output = tokens[prompt_len:]
    banned = set()
    for t in {seq[-1] for seq in bad}:
        extended = output + [t]
        for seq in bad:
            if len(extended) >= len(seq) and extended[len(extended) - len(seq) :] == list(seq):
                banned.add(t)
    return banned


def random_row(prng: random.Random):
    """(params, history): bad sequences of 1-4 tokens, and an output that often ends with a sequence's head."""
    bad = tuple(tuple(prng.randrange(VOCAB) for _ in range(prng.randint(1, 4))) for _ in range(prng.randint(0, 4)))
    prompt_len = prng.randint(1, 6)
    tokens = [prng.randrange(VOCAB) for _ in range(prompt_len + prng.randint(0, 6))]
    if bad and prng.random() < 0.6:
        seq = prng.choice(bad)
        tokens += list(seq[:-1])  # the head of a bad sequence as the output's end (or across the prompt's end)
    return SamplingParams(temperature=0.0, bad_words_token_ids=bad), (tokens, prompt_len)


def test_each_row_bans_what_its_own_sequences_complete(prng, rng):
    for _ in range(30):
        rows = [random_row(prng) for _ in range(prng.randint(1, 10))]
        params = [p for p, _ in rows]
        histories = [h for _, h in rows]
        logits = torch.randn(len(rows), VOCAB, generator=rng) * 3
        got = apply_controls(logits, params, histories, EOS)
        tokens = sample(logits, params, [None] * len(rows), histories, EOS)
        for r, (p, (hist, prompt_len)) in enumerate(rows):
            banned = reference_banned(p.bad_words_token_ids, hist, prompt_len)
            assert set(torch.isinf(got[r]).nonzero()[:, 0].tolist()) == banned
            kept = [t for t in range(VOCAB) if t not in banned]
            torch.testing.assert_close(got[r, kept], logits[r, kept])  # nothing else changes
            if kept:
                assert tokens[r] == max(kept, key=lambda t: float(logits[r, t]))


def test_a_bad_sequence_split_by_the_prompt_end_is_not_banned():
    # the output alone must end with the head: a prompt ending in 7 does not ban (7, 9)'s 9 at the first draw
    p = SamplingParams(bad_words_token_ids=((7, 9),))
    logits = torch.zeros(2, VOCAB)
    got = apply_controls(logits, [p, p], [([1, 7], 2), ([1, 7, 7], 2)], EOS)
    assert not torch.isinf(got[0]).any()
    assert torch.isinf(got[1]).nonzero()[:, 0].tolist() == [9]


class CharTokenizer:
    """One id per character, and a separate id for a space folded into the next letter (as BPE does)."""

    def encode(self, text, add_special_tokens=False):
        ids, i = [], 0
        while i < len(text):
            if text[i] == " " and i + 1 < len(text):
                ids.append(100 + ord(text[i + 1]) - ord("a"))
                i += 2
            else:
                ids.append(ord(text[i]) - ord("a"))
                i += 1
        return ids


def test_words_are_tokenized_with_and_without_a_leading_space():
    tok = CharTokenizer()
    assert bad_word_sequences(tok, ["cab", "  cab", "d"]) == ((2, 0, 1), (102, 0, 1), (3,), (103,))
    p = resolve_bad_words(SamplingParams(bad_words=["ab"], bad_words_token_ids=[[5]]), tok, 200)
    assert p.bad_words_token_ids == ((5,), (0, 1), (100, 1))
    assert p.bad_words == ("ab",) and p.adjusts_logits
    with pytest.raises(InvalidArgumentError, match="bad_words"):
        resolve_bad_words(SamplingParams(bad_words=["ab"]), None, 200)
    with pytest.raises(InvalidArgumentError, match="bad_words"):
        resolve_bad_words(SamplingParams(bad_words=["ab"]), tok, 100)  # " b" is id 101
    plain = SamplingParams()
    assert resolve_bad_words(plain, None, 10) is plain


@pytest.mark.parametrize(
    "kw",
    [
        dict(bad_words="word"),
        dict(bad_words=["ok", 3]),
        dict(bad_words=["  "]),
        dict(bad_words=[""]),
        dict(bad_words={"a": 1}),
        dict(bad_words_token_ids=[[]]),
        dict(bad_words_token_ids=[[1, -2]]),
        dict(bad_words_token_ids=[["a"]]),
        dict(bad_words_token_ids=[[True]]),
        dict(bad_words_token_ids=5),
    ],
)
def test_bad_values_are_refused(kw):
    field = next(iter(kw))
    with pytest.raises(InvalidArgumentError, match=field):
        SamplingParams(**kw)


@torch.no_grad()
def test_engine_greedy_with_bad_sequences_matches_a_token_by_token_reference(prng):
    llm, reference = tiny_engine_and_reference()
    prompts = [[prng.randrange(3, 500) for _ in range(prng.randint(3, 16))] for _ in range(6)]
    base = dict(max_tokens=8, temperature=0.0, ignore_eos=True)
    plain = llm.generate(prompts, [SamplingParams(**base)] * len(prompts))
    # ban what greedy decoding would produce: single tokens and pairs of the plain outputs, per request
    params = []
    for i, out in enumerate(plain):
        ids = out.token_ids
        if i % 3 == 2:
            params.append(SamplingParams(**base))  # asks for nothing: must come out as before
            continue
        j = prng.randrange(len(ids) - 1)
        bad = [(ids[j], ids[j + 1]), (ids[prng.randrange(len(ids))],)]
        params.append(SamplingParams(**base, bad_words_token_ids=bad))
    outs = llm.generate(prompts, params)
    for prompt, p, out, before in zip(prompts, params, outs, plain):
        if not p.bad_words_token_ids:
            assert out.token_ids == before.token_ids
            continue
        tokens = list(prompt)
        for got in out.token_ids:
            logits = reference(input_ids=torch.tensor([tokens])).logits[0, -1].double()
            for t in reference_banned(p.bad_words_token_ids, tokens, len(prompt)):
                logits[t] = float("-inf")
            top = logits.topk(2)
            if int(top.indices[0]) != got:
                assert float(top.values[0] - top.values[1]) < 1e-4  # a tie that rounding broke the other way
                break
            tokens.append(got)
        output = list(out.token_ids)
        for seq in p.bad_words_token_ids:
            assert not any(output[k : k + len(seq)] == list(seq) for k in range(len(output)))
