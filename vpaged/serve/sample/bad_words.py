"""bad_words: the strings a request's output must not contain, as the token sequences the sampler bans.

A word can reach the output as the tokens of the word alone (at the start of the text, or after a character
that is its own token) or as the tokens of " word" (inside a text: BPE tokenizers fold the space into the
word's first token), so each word is tokenized both ways (vLLM's rule, which only adds the spaced form when it
is a different sequence). The sampler then bans the last token of a sequence while the output ends with the
tokens before it (banned_next_tokens, applied in logits_processors.py), which keeps the whole sequence out of
the output whichever way it was reached.
Like vLLM, this bans token sequences, not the string: a word the model spells with other tokens goes through.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ...errors import InvalidArgumentError
from .params import SamplingParams


def bad_word_sequences(tokenizer, words) -> tuple[tuple[int, ...], ...]:
    """Each word's token sequences, without and with a leading space, each sequence once, in order."""
    out: dict[tuple[int, ...], None] = {}
    for word in words:
        stripped = word.lstrip()
        for text in (stripped, " " + stripped):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids:
                out.setdefault(ids, None)
    return tuple(out)


def resolve_bad_words(params: SamplingParams, tokenizer, vocab_size: int) -> SamplingParams:
    """params with its bad_words added to bad_words_token_ids (the sampler reads only the ids); the same
    object when it has no bad_words. InvalidArgumentError (naming bad_words) without a tokenizer, or for an id
    outside the vocabulary."""
    if params.bad_words:
        if tokenizer is None:
            raise InvalidArgumentError("bad_words need the model's tokenizer; pass bad_words_token_ids instead")
        known = dict.fromkeys(params.bad_words_token_ids)
        known.update(dict.fromkeys(bad_word_sequences(tokenizer, params.bad_words)))
        params = dataclasses.replace(params, bad_words_token_ids=tuple(known))
    if any(t >= vocab_size for seq in params.bad_words_token_ids for t in seq):
        name = "bad_words" if params.bad_words else "bad_words_token_ids"
        raise InvalidArgumentError(f"{name} token ids must lie in 0..{vocab_size - 1}")
    return params


def banned_next_tokens(sequences, tokens: Sequence[int], prompt_len: int) -> list[int]:
    """The tokens that would complete one of the bad sequences next: the last token of each sequence whose
    other tokens are the end of the output, tokens[prompt_len:] (every one-token sequence). The prompt does not
    count: a bad word the prompt ends with may be completed, as in vLLM."""
    out = []
    for seq in sequences:
        head = len(seq) - 1
        if head == 0 or (len(tokens) - prompt_len >= head and tuple(tokens[len(tokens) - head :]) == tuple(seq[:head])):
            out.append(seq[-1])
    return out
