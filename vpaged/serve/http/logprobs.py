"""The OpenAI shapes of log probabilities, from the engine's TokenLogprobs.

Chat: `{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}], "refusal": null}`.
Completions: `{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}`; with echo the prompt's
tokens come first and the first of them has null for its logprob and its alternatives (what lm-eval's
loglikelihood reads). The top_logprobs dict of a completion also holds the chosen token, as vLLM's does, so
that `logprobs: 0` still names it. A token's text is its own decode (a byte-level BPE piece that is part of a
character decodes to U+FFFD; its `bytes` are then those of U+FFFD); without a tokenizer it is `token_id:<id>`.
"""

from __future__ import annotations

from .chat.protocol import ChatLogprobs, ChatLogprobToken, ChatTopLogprob
from .completion.protocol import CompletionLogprobs

# JSON has no -inf: a probability that underflowed is reported at this floor (as vLLM does).
LOGPROB_FLOOR = -9999.0


def _lp(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


class TokenTexts:
    """Token id -> its text, decoded once per id."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            if self.tokenizer is None:
                text = f"token_id:{token_id}"
            else:
                text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._texts[token_id] = text
        return text


def chat_logprobs(texts: TokenTexts, entries: list) -> ChatLogprobs:
    def top(token_id: int, logprob: float) -> ChatTopLogprob:
        text = texts(token_id)
        return ChatTopLogprob(token=text, logprob=_lp(logprob), bytes=list(text.encode("utf-8")))

    content = []
    for e in entries:
        chosen = top(e.token_id, e.logprob)
        alternatives = [top(t, lp) for t, lp in e.top]
        content.append(
            ChatLogprobToken(token=chosen.token, logprob=chosen.logprob, bytes=chosen.bytes, top_logprobs=alternatives)
        )
    return ChatLogprobs(content=content)


class CompletionLogprobsFormat:
    """The logprobs object of one completion choice, built in pieces (streaming) with running text offsets."""

    def __init__(self, texts: TokenTexts):
        self.texts = texts
        self.offset = 0

    def body(self, entries: list) -> CompletionLogprobs:
        """entries: TokenLogprobs, or None for a first prompt token (echo)."""
        tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
        for e in entries:
            if e is None:  # the prompt's first token: no position predicts it
                continue
            text = self.texts(e.token_id)
            tokens.append(text)
            token_logprobs.append(_lp(e.logprob))
            top = {self.texts(t): _lp(lp) for t, lp in e.top}
            top.setdefault(text, _lp(e.logprob))
            top_logprobs.append(top)
            text_offset.append(self.offset)
            self.offset += len(text)
        return CompletionLogprobs(
            tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top_logprobs, text_offset=text_offset
        )

    def echo_body(self, prompt_ids: list[int], prompt_entries: list | None, entries: list) -> CompletionLogprobs:
        """The prompt's tokens first (the first with null logprob and alternatives), then the generated ones."""
        first = self.texts(prompt_ids[0])
        head = CompletionLogprobs(tokens=[first], token_logprobs=[None], top_logprobs=[None], text_offset=[self.offset])
        self.offset += len(first)
        rest = self.body(list((prompt_entries or [None])[1:]) + list(entries))
        return CompletionLogprobs(
            tokens=head.tokens + rest.tokens,
            token_logprobs=head.token_logprobs + rest.token_logprobs,
            top_logprobs=head.top_logprobs + rest.top_logprobs,
            text_offset=head.text_offset + rest.text_offset,
        )
