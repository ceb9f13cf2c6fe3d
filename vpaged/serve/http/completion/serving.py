"""CompletionServing: POST /v1/completions for one served model, whole or streamed.

Each prompt of the request is its own engine request with n choices (choice k answers prompt k // n). echo
puts the prompt before a choice's text (and its logprobs first); max_tokens 0 with echo only scores the prompt.
"""

from __future__ import annotations

from .. import guided
from ..common.protocol import UsageInfo, new_id, now
from ..common.responses import error_response, json_response
from ..common.serving import ServingBase
from ..logprobs import CompletionLogprobsFormat
from ..streaming import sse_response, stream_chunks
from .protocol import CompletionChoice, CompletionChunk, CompletionRequest, CompletionResponse


class CompletionServing(ServingBase):
    async def handle(self, request, req: CompletionRequest):
        """The answer to `req` (request: the Starlette Request, watched for a disconnect)."""
        guided.check_available(self.engine, req)
        stops = self._check_limits(req, len(req.prompts()))
        prompts = [self._tokenize(p) for p in req.prompts()]
        self._check_max_tokens(prompts, req.max_tokens, "max_tokens")
        rid, created = new_id("cmpl"), now()
        # max_tokens 0 (echo): the engine draws one token that no choice takes
        max_tokens = 1 if req.scores_only else (req.max_tokens if req.max_tokens is not None else 16)
        generated = 0 if req.scores_only else max_tokens
        sizes = [generated + (len(p) if req.echo else 0) for p in prompts]
        self._check_response_size(req, sizes, req.logprobs, chat=False)
        gen = await self._start(req, prompts, max_tokens, rid, stops, keep_outputs=not req.scores_only)
        echoes = [self._echo_text(p, ids) for p, ids in zip(req.prompts(), prompts)] if req.echo else None
        with_logprobs = req.logprobs is not None

        def chunk_of(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> CompletionChunk:
            return CompletionChunk(id=rid, created=created, model=self.model_name, choices=choices, usage=usage)

        if req.stream:
            formats = [CompletionLogprobsFormat(self.token_texts) for _ in gen.choices]
            echoed: set[int] = set()

            def chunk(k, text, toks, finish, entries) -> CompletionChunk:
                i, logprobs = k // req.n, None
                if echoes is not None and k not in echoed:  # the prompt goes out with the choice's first chunk
                    echoed.add(k)
                    text = echoes[i] + text
                    if with_logprobs:
                        logprobs = formats[k].echo_body(prompts[i], gen.prompt_logprobs[i], entries)
                elif with_logprobs:
                    logprobs = formats[k].body(entries)
                return chunk_of(
                    [CompletionChoice(index=k, text=text, logprobs=logprobs, finish_reason=finish, token_ids=toks)]
                )

            events = stream_chunks(gen, chunk, [], req.include_usage_in_stream(), lambda u: chunk_of([], u))
            return sse_response(events)
        if not await self._collect(request, gen):
            return error_response(499, "the client closed the request", "invalid_request_error")
        choices = []
        for k, c in enumerate(gen.choices):
            i, text, logprobs = k // req.n, c.text, None
            if with_logprobs:
                fmt = CompletionLogprobsFormat(self.token_texts)
                logprobs = (
                    fmt.echo_body(prompts[i], gen.prompt_logprobs[i], c.logprobs) if echoes else fmt.body(c.logprobs)
                )
            if echoes is not None:
                text = echoes[i] + text
            choices.append(
                CompletionChoice(
                    index=k, text=text, logprobs=logprobs, finish_reason=c.finish_reason, token_ids=c.token_ids
                )
            )
        body = CompletionResponse(id=rid, created=created, model=self.model_name, choices=choices, usage=gen.usage())
        return json_response(body)

    def _echo_text(self, prompt: str | list[int], ids: list[int]) -> str:
        """What echo puts before a completion: the prompt as the client sent it (token ids: their decode)."""
        if isinstance(prompt, str):
            return prompt
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""
