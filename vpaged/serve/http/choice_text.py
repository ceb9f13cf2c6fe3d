"""ChoiceText: the text of one choice as its tokens arrive (incremental detokenization with stop strings), for
streamed deltas and whole answers alike."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ChoiceText:
    """The text of one choice as tokens arrive: what may be sent now, and where a stop string ended it.

    Text is always the decode of all tokens so far (decoding token by token would split multi-byte
    characters and break tokenizers that merge spaces), and a delta is the part past what was already sent.
    Text is held back while it ends in an incomplete character (U+FFFD) or could be the start of a stop
    string, so the concatenated deltas equal the final text exactly.
    """

    tokenizer: Any
    stops: tuple[str, ...] = ()
    sent: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    sent_tokens: int = 0
    finish_reason: str | None = None
    logprobs: list = field(default_factory=list)  # TokenLogprob per token of token_ids, when asked

    def new_logprobs(self, start: int, count: int) -> list:
        """The TokenLogprobs of token_ids[start : start + count] (empty when not asked)."""
        return self.logprobs[start : start + count]

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def update(self, token_ids: list[int], finish_reason: str | None, logprobs: list | None = None) -> None:
        """Take the choice's token ids so far (and the engine's finish reason, if it finished; and the tokens'
        TokenLogprobs when the request asked for them)."""
        if self.done:
            return
        self.token_ids = list(token_ids)
        if logprobs is not None:
            self.logprobs = logprobs
        if self.tokenizer is not None:
            self.text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
            if self.stops:
                start = max(0, len(self.sent) - max(len(s) for s in self.stops))
                hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
                if hits:
                    self.text = self.text[: min(hits)]
                    self.finish_reason = "stop"
                    return
        self.finish_reason = finish_reason

    def delta(self) -> tuple[str, list[int]]:
        """Text and token ids not sent yet that are safe to send; marks them sent."""
        new_tokens = self.token_ids[self.sent_tokens :]
        self.sent_tokens = len(self.token_ids)
        if self.done:
            safe = self.text
        else:
            safe = self.text
            if safe.endswith("\ufffd"):
                safe = safe.rstrip("\ufffd")
            if self.stops:
                safe = safe[: max(len(self.sent), len(safe) - (max(len(s) for s in self.stops) - 1))]
        if not safe.startswith(self.sent):
            # An earlier character changed with more context (rare with byte-level tokenizers): wait until
            # the text is final; the remainder goes out then.
            if not self.done:
                return "", new_tokens
        out = safe[len(self.sent) :]
        self.sent = safe
        return out, new_tokens
