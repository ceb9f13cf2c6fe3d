"""LLMEngine (serving code owns the loop: add_request / step / abort) and LLM (generate / stream on top).

    from vpaged.serve import LLM, SamplingParams
    llm = LLM("random:llama-tiny", kv_budget_bytes=64 << 20)
    outs = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=8, temperature=0.0))

A step: schedule (scheduler.py) -> one packed forward (runner.py) -> sample (sample/sampler.py) -> postprocess
(scheduler.py: every change to the sequences) -> outputs for the requests that changed. The engine only
orchestrates: the options live in one EngineConfig (config.py), the K/V in a KVStore (stores/), sequence
state in the scheduler. Not thread-safe: one thread drives an engine.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass

import torch

from ..errors import BackendUnavailableError, InvalidArgumentError, PromptTooLongError, UnknownRequestError
from ..hf.attention import NAME as ATTN_NAME
from ..hf.compat import serving_support
from ..hf.fused import fuse_modules
from ..hf.prepack import prepack_linears, prepack_supported
from ..kvcache.geometry import KVGeometry
from .config import EngineConfig
from .direct_forward import DirectForward
from .models import attention_window, load_model, model_geometry
from .outputs import CompletionOutput, EngineStats, RequestMetrics, RequestOutput, StepRecord, StepTimes
from .runner import ModelRunner, prompt_logprob_rows
from .sample.bad_words import resolve_bad_words
from .sample.logprobs import record_prompt_logprobs, token_logprobs
from .sample.params import SamplingParams
from .sample.sampler import NO_TOKEN, check_first_draw, sample
from .sample.structured import Grammars
from .scheduler import Scheduler, StepUpdate
from .sequence import Request, Sequence
from .stores import make_store
from .weights_identity import weights_identity

_log = logging.getLogger("vpaged.serve")


@dataclass
class EngineCounters:
    """What EngineStats counts over the engine's life (its fields are EngineStats fields of the same name)."""

    requests_finished: int = 0
    requests_aborted: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    steps: int = 0


class _Clock:
    """Seconds since the last lap (perf_counter)."""

    def __init__(self):
        self._last = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        elapsed, self._last = now - self._last, now
        return elapsed


class LLMEngine:
    """Continuous-batching engine over one transformers model and one KV store.

    LLMEngine(model, tokenizer=None, **options) or LLMEngine(model, tokenizer=None, config=EngineConfig(...)):
    the options are EngineConfig's fields (kv_budget_bytes is required), checked once when the config is built.

    Args:
        model: a PreTrainedModel, a local model directory or "random:<name>" (see load_model).
        tokenizer: for string prompts and output text (default: the directory's tokenizer, if any).
        config: an EngineConfig; or its fields as keyword arguments (not both).
    """

    def __init__(self, model, tokenizer=None, *, config: EngineConfig | None = None, **options):
        ok, why = serving_support()
        if not ok:
            raise BackendUnavailableError(why)
        if config is None:
            config = EngineConfig(**options)
        elif options:
            raise InvalidArgumentError(f"give either config or keyword options, not both (got {sorted(options)})")
        elif not isinstance(config, EngineConfig):
            raise InvalidArgumentError(f"config must be an EngineConfig, got {type(config).__name__}")
        self.tp = None  # tensor_parallel_size > 1: this rank's place among the ranks (vpaged.serve.distributed)
        if config.parallel.tensor_parallel_size > 1:
            from .distributed import TensorParallel

            self.tp = TensorParallel.start(model, config, type(self))
            model, config = self.tp.model_path, self.tp.config
        for name in config.unused_options:  # said, not silent: the option changes nothing for this kind
            _log.warning("%s is not an option of kv=%r; it is ignored", name, config.kv)
        self.max_num_seqs = config.scheduler.max_num_seqs
        self.max_num_batched_tokens = config.scheduler.max_num_batched_tokens
        model, loaded_tokenizer = load_model(
            model, config.model.dtype or torch.float32, tensor_parallel_size=config.parallel.tensor_parallel_size
        )
        self.tokenizer = tokenizer if tokenizer is not None else loaded_tokenizer
        self.device = config.model.device
        if config.model.dtype is not None and model.dtype != config.model.dtype:
            model = model.to(config.model.dtype)
        # The K/V format, resolved once against the dtype the model has now (config.kv_format).
        self.config = config = config.for_model_dtype(model.dtype)
        if model.device != self.device:
            model = model.to(self.device)
        model.eval()
        model.set_attn_implementation(ATTN_NAME)
        if model.config._attn_implementation != ATTN_NAME:
            raise InvalidArgumentError(
                f"{type(model).__name__} does not dispatch attention through transformers' "
                "AttentionInterface; the engine cannot serve it"
            )
        self.prepacked_layers = self.fused_modules = 0
        # TP layers keep their own forward.
        if config.model.cpu_prepack and self.device.type == "cpu" and self.tp is None:
            batch_hint = max(16, config.scheduler.max_num_seqs)
            ok, why = prepack_supported(model.dtype)
            if ok:
                self.prepacked_layers = prepack_linears(model, batch_hint=batch_hint)
            else:
                _log.info("cpu prepack is off: %s", why)
            # After the packing: a fused MLP packs its gate and up weights as one and drops their own copies.
            self.fused_modules = fuse_modules(model, batch_hint=batch_hint)
        self.model = model
        model_config = model.config
        self.model_name = getattr(model_config, "name_or_path", None) or type(model).__name__
        layers, kv_heads, head_dim = model_geometry(model_config)
        kv_heads //= config.parallel.tensor_parallel_size  # each rank keeps the K/V of its own heads
        text_config = model_config.get_text_config(decoder=True)
        limit = int(getattr(text_config, "max_position_embeddings", 0) or 1 << 20)
        window = attention_window(model_config)
        if window is not None:
            limit = min(limit, window)
        if config.model.max_model_len is not None:
            limit = min(limit, config.model.max_model_len)
        self.max_model_len = limit
        self.vocab_size = int(text_config.vocab_size)
        self.kv = config.kv
        fmt = config.kv_format
        geometry = KVGeometry(layers, kv_heads, head_dim, fmt.dtype, kv_dtype=fmt.kv_dtype)
        weights = ""
        if getattr(config.store, "prefix_store", None) is not None:
            if self.tp is not None:
                raise InvalidArgumentError(
                    "a prefix_store with tensor parallelism is not supported yet: each rank holds other heads"
                )
            weights = weights_identity(model)
        self.store = make_store(config, geometry, limit, weights=weights)
        if self.tp is not None:
            self.store = self.tp.mirror(self.store)
        self.scheduler = Scheduler(self.store, config)
        direct, self.direct_forward_off = None, "cpu_prepack is off, on CUDA or with tensor parallelism"
        if self.fused_modules and not config.model.direct_forward:
            self.direct_forward_off = "direct_forward=False"
        elif self.fused_modules:
            direct, self.direct_forward_off = DirectForward.build(model, batch_hint)
            if direct is None:
                _log.info("the direct forward is off, transformers' runs the steps: %s", self.direct_forward_off)
        self.runner = (
            ModelRunner(model, self.store, config, direct)
            if self.tp is None
            else self.tp.runner(model, self.store, config)
        )
        store = self.store
        if store.prefix_caching:
            _log.info("prefix caching: on, %.2f tokens per cached page", store.prefix_tokens_per_page)
        elif not config.store.prefix_caching_turned_off:  # this kind cannot (unasked): said, not silent
            _log.warning("prefix caching is off: %s", store.prefix_caching_off)
        if store.decode_unsupported is not None:
            _log.warning("decode rows go to SDPA, not the decode kernel: %s", store.decode_unsupported)
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        if eos is None:
            eos = getattr(model_config, "eos_token_id", None)
        self.eos_token_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        # structured output: grammars compiled for this tokenizer (lazily, at the first request that asks)
        self.grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self._rng = random.Random(config.seed)
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self._requests: dict[str, Request] = {}
        self._pending: list[RequestOutput] = []  # outputs of aborted requests, handed out by the next step()
        self.counters = EngineCounters()
        self.times = StepTimes()  # summed over all steps
        self.step_log: list[StepRecord] | None = [] if config.record_steps else None

    # ------------------------------------------------------------------------------------------ ranks
    @property
    def rank(self) -> int:
        """This process's rank in a tensor-parallel engine (0 in one process). Only rank 0 takes requests;
        the others serve it through vpaged.serve.distributed.run_worker(engine)."""
        return self.tp.rank if self.tp is not None else 0

    @property
    def broken(self):
        """Why this engine cannot go on (the TensorParallelError of a group that lost a rank, also found while
        idle), or None."""
        return self.tp.broken if self.tp is not None else None

    def _check_driver(self) -> None:
        if self.rank != 0:
            raise InvalidArgumentError(
                f"rank {self.rank} of a tensor-parallel engine follows rank 0: call "
                "vpaged.serve.distributed.run_worker(engine) on it instead"
            )

    # ------------------------------------------------------------------------------------------ requests
    def add_request(
        self, prompt, params: SamplingParams | None = None, request_id: str | None = None, priority: int = 0
    ) -> str:
        """Queue a request; returns its id. Raises (for this request only, nothing queued) on bad input.
        priority: with scheduling_policy="priority", lower values are admitted first (ignored by "fcfs")."""
        self._check_driver()
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InvalidArgumentError(f"params must be a SamplingParams, got {type(params).__name__}")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidArgumentError(f"priority must be an int, got {priority!r}")
        if params.n > self.max_num_seqs:
            raise InvalidArgumentError(f"n={params.n} exceeds max_num_seqs={self.max_num_seqs}")
        if params.logit_bias and params.logit_bias[-1][0] >= self.vocab_size:
            raise InvalidArgumentError(f"logit_bias token ids must lie in 0..{self.vocab_size - 1}")
        params = resolve_bad_words(params, self.tokenizer, self.vocab_size)  # words -> the token ids banned
        if params.structured is not None:
            self.grammars.compile(params.structured)  # refused here if it cannot compile; cached for the steps
        tokens = self._prompt_tokens(prompt)
        check_first_draw(params, tokens, self.vocab_size, self.eos_token_ids, self.grammars)
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
            while request_id in self._requests:
                request_id = f"req-{next(self._ids)}"
        elif not isinstance(request_id, str) or not request_id:
            raise InvalidArgumentError(f"request_id must be a non-empty str, got {request_id!r}")
        elif request_id in self._requests:
            raise InvalidArgumentError(f"request id {request_id!r} is already in use")
        if len(tokens) >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt of {len(tokens)} tokens leaves no room to generate within max_model_len={self.max_model_len}"
            )
        max_tokens = min(params.max_tokens, self.max_model_len - len(tokens))
        need = self.store.pages_for_request(len(tokens) + max_tokens, params.n)
        if need > self.store.total_pages():
            raise PromptTooLongError(
                f"prompt of {len(tokens)} tokens plus {max_tokens} to generate needs {need} pages of "
                f"{self.store.page_bytes} bytes; the KV budget holds {self.store.total_pages()}"
            )
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        req = Request(request_id, tokens, params, RequestMetrics(arrival_time=time.time()), max_tokens)
        req.priority, req.arrival_index = priority, next(self._arrivals)
        req.seeds = [seed] if params.n == 1 else [(seed * 1_000_003 + i) % (1 << 63) for i in range(params.n)]
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None]
        req.seqs.append(Sequence(req, 0, list(tokens), req.generator(0)))
        self._requests[request_id] = req
        self.scheduler.add(req.seqs[0])
        return request_id

    def _prompt_tokens(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidArgumentError("string prompts need a tokenizer; pass token ids")
            tokens = list(self.tokenizer(prompt)["input_ids"])
        else:
            try:
                tokens = [t for t in prompt]
            except TypeError:
                raise InvalidArgumentError(
                    f"prompt must be a str or a list of token ids, got {type(prompt).__name__}"
                ) from None
            if isinstance(prompt, torch.Tensor):
                tokens = prompt.flatten().tolist()
        if not tokens:
            raise InvalidArgumentError("the prompt is empty")
        for t in tokens:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                raise InvalidArgumentError(f"token ids must be ints in 0..{self.vocab_size - 1}, got {t!r}")
        return tokens

    def abort(self, request_id: str) -> None:
        """Stop a request now and give its pages back; its final output (finish_reason "abort") comes with
        the next step()."""
        req = self._requests.get(request_id)
        if req is None:
            raise UnknownRequestError(f"no unfinished request {request_id!r}")
        self.scheduler.abort(req, time.time())
        self.counters.requests_aborted += 1
        del self._requests[request_id]
        self._pending.append(self._output(req))

    def has_unfinished(self) -> bool:
        return bool(self._requests) or bool(self._pending)

    # ------------------------------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """Run one step; returns the outputs of the requests that changed (new tokens or finished)."""
        self._check_driver()
        outputs, self._pending = self._pending, []
        clock = _Clock()
        plan = self.scheduler.schedule()
        schedule_s = clock.lap()
        if not plan:
            self.times.schedule += schedule_s
            return outputs
        try:
            inputs, step_attention, samplers = self.runner.prepare(plan)
            prepare_s = clock.lap()
            logits = self.runner.forward(inputs, step_attention)
        except BaseException as e:
            # The cache grew for tokens whose K/V may be half written: the step's sequences give their pages
            # back and are recomputed later (the caller may abort them instead); other requests go on.
            step_attention = None
            if self.tp is not None:  # the ranks are no longer in step: the engine cannot go on
                raise self.tp.failed(e) from e
            self.scheduler.requeue(plan)
            raise
        del step_attention  # its views pin pages: gone before anything is swapped or freed
        forward_s = clock.lap()
        if logits.shape[0] > len(samplers):  # prompt rows follow the sampling rows
            record_prompt_logprobs(prompt_logprob_rows(plan), logits[len(samplers) :])
            logits = logits[: len(samplers)]
        draws, drawn_logprobs = self._sample(samplers, logits)
        sample_s = clock.lap()
        update = self.scheduler.postprocess(plan, draws, self.eos_token_ids, time.time())
        for seq, entries in drawn_logprobs:
            # a request that forked at this draw: entry k belongs to completion k (created by postprocess)
            for target, entry in zip(seq.request.seqs if len(entries) > 1 else [seq], entries):
                if entry is not None:  # None: no token was drawn (the sequence ended with "error")
                    target.logprobs.append(entry)
        outputs += self._outputs(update)
        times = StepTimes(schedule_s, prepare_s, forward_s, sample_s, clock.lap())
        self.counters.steps += 1
        self.times.add(times)
        if self.step_log is not None:
            self.step_log.append(StepRecord(len(plan.decodes), plan.num_tokens - len(plan.decodes), times))
        return outputs

    def _sample(self, samplers: list[Sequence], logits: torch.Tensor):
        """One token per sampling sequence, in logits order; n for a request of n > 1 completions that has
        just computed its prompt (the first for the sequence itself, the others for the completions it forks
        into, each with its own generator). Also the TokenLogprob of each draw of a request that asks for
        logprobs, computed from the same (raw) logits: [(seq, [entry per draw])]."""
        rows, params, generators, counts, histories = [], [], [], [], []
        for i, seq in enumerate(samplers):
            req = seq.request
            count = req.params.n if req.params.n > 1 and not req.forked else 1
            for k in range(count):
                rows.append(i)
                params.append(req.params)
                generators.append(seq.generator if k == 0 else req.generator(k))
                histories.append((seq.tokens, req.prompt_len))
            counts.append(count)
        if len(rows) != len(samplers):
            logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
        allowed = self._grammar_masks(samplers, rows, params)
        tokens = sample(logits, params, generators, histories, self.eos_token_ids, allowed)
        drawn = iter(zip(tokens, generators))
        draws = [(seq, [next(drawn) for _ in range(count)]) for seq, count in zip(samplers, counts)]
        if allowed is not None:
            for seq, seq_draws in draws:
                if seq.matcher is not None and seq_draws[0][0] != NO_TOKEN and not seq.matcher.is_terminated():
                    seq.matcher.accept_token(seq_draws[0][0])  # forked completions replay their own later
        asking = [r for r, p in enumerate(params) if p.logprobs is not None]
        if not asking:
            return draws, []
        sub = logits.index_select(0, torch.tensor(asking, device=logits.device)) if len(asking) < len(rows) else logits
        entries = iter(token_logprobs(sub, [tokens[r] for r in asking], [params[r].logprobs for r in asking]))
        drawn_logprobs = [
            (seq, [next(entries) for _ in range(count)])
            for seq, count in zip(samplers, counts)
            if seq.request.params.logprobs is not None
        ]
        return draws, drawn_logprobs

    def _grammar_masks(self, samplers: list[Sequence], rows: list[int], params: list[SamplingParams]):
        """(rows, allowed tokens) of the rows whose request follows a grammar; None when none does. The rows
        of a request about to fork share its prompt's state, so they share the sequence's matcher."""
        structured = [r for r, p in enumerate(params) if p.structured is not None]
        if not structured:
            return None
        matchers = []
        for r in structured:
            seq = samplers[rows[r]]
            if seq.matcher is None:
                seq.matcher = self.grammars.matcher(seq.request.params.structured, seq.tokens[seq.prompt_len :])
            matchers.append(seq.matcher)
        return structured, self.grammars.allowed(matchers)

    def _outputs(self, update: StepUpdate) -> list[RequestOutput]:
        """The outputs of the requests a step changed; finished requests leave the engine."""
        self.counters.prompt_tokens_total += update.prompt_tokens
        self.counters.generation_tokens_total += update.generated_tokens
        self.counters.requests_finished += len(update.finished)
        outputs = [self._output(req) for req in update.changed]
        for req in update.changed:
            if req.finished:
                del self._requests[req.request_id]
        return outputs

    def _output(self, req: Request) -> RequestOutput:
        completions = []
        for seq in req.seqs:
            ids = seq.tokens[req.prompt_len :]
            new = seq.tokens[max(seq.delta_from, req.prompt_len) :]
            seq.delta_from = len(seq.tokens)
            text = self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else None
            logprobs = list(seq.logprobs) if req.params.logprobs is not None else None
            completions.append(CompletionOutput(seq.index, ids, new, text, seq.finish_reason, logprobs))
        prompt_logprobs = None if req.prompt_logprobs is None else list(req.prompt_logprobs)
        return RequestOutput(req.request_id, list(req.prompt), completions, req.finished, req.metrics, prompt_logprobs)

    # ------------------------------------------------------------------------------------------ stats
    def stats(self) -> EngineStats:
        self._check_driver()
        mem = self.store.memory()
        ranks = tuple(self.tp.memories(mem)) if self.tp is not None else ()
        if ranks:
            from .distributed import sum_memory

            mem = sum_memory(list(ranks))
        sched = self.scheduler
        held = mem.held_bytes
        hits = sched.prefix_hit_tokens
        return EngineStats(
            running=len(sched.running),
            waiting=len(sched.waiting),
            swapped=len(sched.swapped),
            live_kv_tokens=mem.live_tokens,
            kv_mapped_bytes=held,
            kv_high_water_bytes=mem.high_water_bytes,
            kv_budget_bytes=mem.budget_bytes,
            kv_utilization=mem.live_bytes / held if held else 0.0,
            prefix_hit_tokens=sched.prefix_hit_tokens,
            prefix_tokens_per_page=self.store.prefix_tokens_per_page,
            prefix_caching=self.store.prefix_caching_off or "on",
            preemptions_swap=sched.preemptions_swap,
            preemptions_recompute=sched.preemptions_recompute,
            kv=self.kv,
            time_schedule_s=self.times.schedule,
            time_prepare_s=self.times.prepare,
            time_forward_s=self.times.forward,
            time_sample_s=self.times.sample,
            time_output_s=self.times.output,
            kv_free_pages=mem.free_pages,
            kv_used_pages=mem.used_pages,
            kv_dormant_pages=mem.dormant_pages,
            prefix_hit_rate=hits / (hits + self.counters.prompt_tokens_total) if hits else 0.0,
            tensor_parallel_size=self.config.parallel.tensor_parallel_size,
            ranks=ranks,
            shared_budget=self.store.budget_figures(),
            **self._prefix_store_figures(),
            **asdict(self.counters),
        )

    def _prefix_store_figures(self) -> dict:
        link = getattr(getattr(self.store, "cache", None), "prefix_store", None)
        if link is None:
            return {}
        s = link.stats
        return dict(
            prefix_store_hit_tokens_total=s.hit_tokens,
            prefix_store_mapped_bytes_total=s.mapped_bytes,
            prefix_store_copied_bytes_total=s.copied_bytes,
            prefix_store_published_pages_total=s.published_pages,
        )

    def close(self) -> None:
        """Abort everything and release the cache."""
        for request_id in list(self._requests):
            self.abort(request_id)
        self._pending = []
        if self.tp is not None:
            self.tp.close()
        if self.runner.direct is not None:
            self.runner.direct.close()
        self.store.close()


class LLM:
    """Offline generation over an LLMEngine: LLM(model, tokenizer=None, **engine_kwargs), where engine_kwargs
    are EngineConfig's fields (kv_budget_bytes defaults to 1 GiB here) or config=EngineConfig(...)."""

    def __init__(self, model, tokenizer=None, **engine_kwargs):
        if "config" not in engine_kwargs:
            engine_kwargs.setdefault("kv_budget_bytes", 1 << 30)
        self.engine = LLMEngine(model, tokenizer, **engine_kwargs)

    def generate(
        self,
        prompts,
        params: SamplingParams | list[SamplingParams] | None = None,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Final outputs, in the order of prompts (a prompt: str or list of token ids; or one prompt).
        priority: one per prompt, for scheduling_policy="priority" (lower first; default 0 each)."""
        prompts = self._as_list(prompts)
        if isinstance(params, (list, tuple)):
            if len(params) != len(prompts):
                raise InvalidArgumentError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
            per_prompt = list(params)
        else:
            per_prompt = [params] * len(prompts)
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise InvalidArgumentError(f"{len(priorities)} priorities for {len(prompts)} prompts")
        ids = []
        try:
            for prompt, p, rank in zip(prompts, per_prompt, priorities):
                ids.append(self.engine.add_request(prompt, p, priority=rank))
        except BaseException:
            for request_id in ids:
                self.engine.abort(request_id)
            raise
        final: dict[str, RequestOutput] = {}
        wanted = set(ids)
        while len(final) < len(ids):
            for out in self.engine.step():
                if out.finished and out.request_id in wanted:
                    final[out.request_id] = out
        return [final[i] for i in ids]

    def stream(self, prompt, params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Outputs of one request as they come (each with this step's new_token_ids); aborted if the
        consumer stops early."""
        request_id = self.engine.add_request(prompt, params)
        done = False
        try:
            while not done:
                for out in self.engine.step():
                    if out.request_id == request_id:
                        done = out.finished
                        yield out
        finally:
            if not done:
                self.engine.abort(request_id)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    @staticmethod
    def _as_list(prompts) -> list:
        if isinstance(prompts, str) or isinstance(prompts, torch.Tensor):
            return [prompts]
        prompts = list(prompts) if isinstance(prompts, Iterable) else [prompts]
        if prompts and isinstance(prompts[0], int):
            return [prompts]  # one prompt of token ids
        return prompts
