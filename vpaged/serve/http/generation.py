"""Generation: one HTTP request's generation, n choices for each of its prompts, fed by the engine thread.

Each prompt is one engine request; the engine thread's outputs arrive on an asyncio queue, and each choice
keeps its text so far (ChoiceText: stop strings, streaming deltas). A prompt whose choices all met a stop
string is aborted at once, so the engine does not go on for nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from ...errors import RequestError
from .choice_text import ChoiceText
from .common.protocol import UsageInfo
from .loop import EngineLoop


class Generation:
    def __init__(
        self,
        loop: EngineLoop,
        tokenizer,
        prompts: list[list[int]],
        params,
        n: int,
        stops: tuple[str, ...],
        prefix: str,
        keep_outputs: bool = True,
    ):
        """keep_outputs False: the prompts are only scored (completions' max_tokens 0): the engine still draws
        its one token (it has no prefill-only request), which no choice takes; each ends with "length"."""
        self.loop = loop
        self.keep_outputs = keep_outputs
        self.prompts = prompts
        self.params = params
        self.n = n
        self.ids = [f"{prefix}-{i}" for i in range(len(prompts))]
        self.choices = [ChoiceText(tokenizer, stops) for _ in range(len(prompts) * n)]
        self.finished = [False] * len(prompts)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.first_token_time: float | None = None
        self.cached_tokens = [0] * len(prompts)  # per prompt: tokens served from the prefix cache
        self.prompt_logprobs: list[list | None] = [None] * len(prompts)  # per prompt, when asked

    async def start(self) -> None:
        aloop = asyncio.get_running_loop()
        queued = []
        try:
            for i, (rid, prompt) in enumerate(zip(self.ids, self.prompts)):

                def sink(item, i=i):
                    with contextlib.suppress(RuntimeError):  # the event loop is gone: nobody is listening
                        aloop.call_soon_threadsafe(self.queue.put_nowait, (i, item))

                queued.append(rid)
                await asyncio.wrap_future(self.loop.add(prompt, self.params, rid, sink))
        except BaseException:
            # A refused prompt, or the client left while waiting: withdraw what was queued. Commands run in
            # order on the engine thread, so an abort queued after an add sees its request (or nothing).
            for rid in queued:
                self.loop.abort(rid)
            raise

    @property
    def done(self) -> bool:
        return all(self.finished)

    async def next_update(self) -> list[int]:
        """Wait for the engine's next output; returns the indexes of the choices it changed."""
        i, out = await self.queue.get()
        if isinstance(out, BaseException):
            self.finished[i] = True
            raise out
        for c in out.outputs:
            if c.finish_reason == "error":  # the sampler found no token the request allows (sampler.NO_TOKEN)
                self.finished[i] = out.finished  # the rest of an unfinished prompt is aborted by the caller
                raise RequestError(
                    f"no token is left that the request allows after {len(c.token_ids)} generated tokens: its "
                    "grammar and its bad_words / min_tokens together exclude every token (or the model's logits "
                    "were NaN)",
                    code="NoAllowedTokenError",
                )
        changed = []
        self.cached_tokens[i] = out.metrics.prefix_hit_tokens
        if out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(self.prompts[i]):
            self.prompt_logprobs[i] = out.prompt_logprobs
        for c in out.outputs:
            k = i * self.n + c.index
            ch = self.choices[k]
            if ch.done:
                continue
            if self.keep_outputs:
                ch.update(c.token_ids, c.finish_reason if (c.finish_reason or out.finished) else None, c.logprobs)
            else:
                ch.update([], "length" if out.finished else None, [] if c.logprobs is not None else None)
            if out.finished and ch.finish_reason is None:
                ch.finish_reason = "length"
            changed.append(k)
        if self.first_token_time is None and any(self.choices[k].token_ids for k in changed):
            self.first_token_time = time.perf_counter()
        if out.finished:
            self.finished[i] = True
        elif all(ch.done for ch in self.choices[i * self.n : (i + 1) * self.n]):
            # every choice met a stop string: the engine need not go on
            self.finished[i] = True
            self.loop.abort(self.ids[i])
        return changed

    def abort_unfinished(self) -> None:
        for i, rid in enumerate(self.ids):
            if not self.finished[i]:
                self.finished[i] = True
                self.loop.abort(rid)

    def usage(self) -> UsageInfo:
        return UsageInfo.of(
            sum(len(p) for p in self.prompts), sum(len(c.token_ids) for c in self.choices), sum(self.cached_tokens)
        )
