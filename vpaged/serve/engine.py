"""LLMEngine (serving code owns the loop: add_request / step / abort) and LLM (generate / stream on top).

    from vpaged.serve import LLM, SamplingParams
    llm = LLM("random:llama-tiny", kv_budget_bytes=64 << 20)
    outs = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=8, temperature=0.0))

A step: schedule (scheduler.py) -> one packed forward (runner.py) -> sample (sampler.py) -> outputs for
the requests that changed. Not thread-safe: one thread drives an engine.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Iterable, Iterator

import torch

from ..errors import BackendUnavailableError, InvalidArgumentError, PromptTooLongError, UnknownRequestError
from ..hf.attention import NAME as ATTN_NAME
from ..hf.compat import serving_support
from ..memory.device import normalize_device
from .models import attention_window, load_model, model_geometry
from .outputs import CompletionOutput, EngineStats, RequestMetrics, RequestOutput
from .params import SamplingParams
from .runner import ModelRunner
from .sampler import sample
from .scheduler import Scheduler
from .sequence import Request, Sequence, Status
from .stores import KV_KINDS, PagedStore, VirtualStore


def _positive_int(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")
    return value


class LLMEngine:
    """Continuous-batching engine over one transformers model and one KV store.

    Args:
        model: a PreTrainedModel, a local model directory or "random:<name>" (see load_model).
        tokenizer: for string prompts and output text (default: the directory's tokenizer, if any).
        kv_budget_bytes: memory for K/V (the page pool, the block pool, or the static reservations).
        swap_bytes: host swap space for preempted sequences (kv="vpaged" only; 0: preemption recomputes).
        max_num_seqs: sequences running at once. max_num_batched_tokens: tokens per step (chunked prefill).
        kv: "vpaged" (VirtualKVCache), "paged" (PagedKVCache, block tables) or "static" (each request maps
            a fixed slot of max_model_len tokens at admission, as static batching does: set max_model_len).
        enable_prefix_caching: reuse the K/V of full prompt pages computed before (vpaged).
        max_model_len: tokens a sequence may hold (default: the model's max_position_embeddings, and its
            sliding window when it has one: the engine attends over full contexts).
        dtype, device: of the model and the cache (default: the model's dtype, "cpu").
        page_size: bytes per page of the vpaged / static pool (default: the device's).
        layout: VirtualKVCache layout ("per_layer", "interleaved", "head_major").
        block_size: tokens per block of the paged store.
        seed: seeds the generator that seeds requests given no seed.
        record_steps: keep a per-step timing record in .step_log (for benchmarks).
    """

    def __init__(
        self,
        model,
        tokenizer=None,
        *,
        kv_budget_bytes: int,
        swap_bytes: int = 0,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        kv: str = "vpaged",
        enable_prefix_caching: bool = True,
        max_model_len: int | None = None,
        dtype: torch.dtype | None = None,
        device="cpu",
        page_size: int | None = None,
        layout: str = "per_layer",
        block_size: int = 16,
        seed: int = 0,
        record_steps: bool = False,
    ):
        ok, why = serving_support()
        if not ok:
            raise BackendUnavailableError(why)
        if kv not in KV_KINDS:
            raise InvalidArgumentError(f"kv must be one of {KV_KINDS}, got {kv!r}")
        _positive_int("kv_budget_bytes", kv_budget_bytes)
        if not isinstance(swap_bytes, int) or isinstance(swap_bytes, bool) or swap_bytes < 0:
            raise InvalidArgumentError(f"swap_bytes must be an int >= 0, got {swap_bytes!r}")
        self.max_num_seqs = _positive_int("max_num_seqs", max_num_seqs)
        self.max_num_batched_tokens = _positive_int("max_num_batched_tokens", max_num_batched_tokens)
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise InvalidArgumentError(f"dtype must be a torch.dtype, got {dtype!r}")
        model, loaded_tokenizer = load_model(model, dtype or torch.float32)
        self.tokenizer = tokenizer if tokenizer is not None else loaded_tokenizer
        self.device = normalize_device(device)
        if dtype is not None and model.dtype != dtype:
            model = model.to(dtype)
        if model.device != self.device:
            model = model.to(self.device)
        model.eval()
        model.set_attn_implementation(ATTN_NAME)
        if model.config._attn_implementation != ATTN_NAME:
            raise InvalidArgumentError(
                f"{type(model).__name__} does not dispatch attention through transformers' "
                "AttentionInterface; the engine cannot serve it"
            )
        self.model = model
        config = model.config
        self.model_name = getattr(config, "name_or_path", None) or type(model).__name__
        layers, kv_heads, head_dim = model_geometry(config)
        limit = int(getattr(config.get_text_config(decoder=True), "max_position_embeddings", 0) or 1 << 20)
        window = attention_window(config)
        if window is not None:
            limit = min(limit, window)
        if max_model_len is not None:
            limit = min(limit, _positive_int("max_model_len", max_model_len))
        self.max_model_len = limit
        self.vocab_size = int(config.get_text_config(decoder=True).vocab_size)
        self.kv = kv
        slots = 2 * max_num_seqs  # running plus swapped sequences (addresses only: no memory behind them)
        if kv == "paged":
            self.store = PagedStore(
                layers,
                kv_heads,
                head_dim,
                model.dtype,
                budget_bytes=kv_budget_bytes,
                max_seqs=slots,
                max_seq_len=limit,
                device=self.device,
                block_size=block_size,
            )
        else:
            self.store = VirtualStore(
                kv,
                layers,
                kv_heads,
                head_dim,
                model.dtype,
                budget_bytes=kv_budget_bytes,
                swap_bytes=swap_bytes,
                max_seqs=slots,
                max_seq_len=limit,
                device=self.device,
                page_size=page_size,
                layout=layout,
                prefix_caching=enable_prefix_caching,
            )
        if kv == "static" and self.store.slot_pages > self.store.total_pages():
            self.store.close()
            raise InvalidArgumentError(
                f"kv='static' reserves max_model_len={limit} tokens per sequence, more than the KV budget of "
                f"{kv_budget_bytes} bytes holds; raise kv_budget_bytes or lower max_model_len"
            )
        self.scheduler = Scheduler(self.store, max_num_seqs, max_num_batched_tokens)
        self.runner = ModelRunner(model, self.store, self.device)
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        if eos is None:
            eos = getattr(config, "eos_token_id", None)
        self.eos_token_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self._rng = random.Random(seed)
        self._ids = itertools.count()
        self._requests: dict[str, Request] = {}
        self._pending: list[RequestOutput] = []  # outputs of aborted requests, handed out by the next step()
        self._counters = dict(
            requests_finished=0, requests_aborted=0, prompt_tokens_total=0, generation_tokens_total=0, steps=0
        )
        self._times = dict(schedule=0.0, prepare=0.0, forward=0.0, sample=0.0, output=0.0)
        self.step_log: list[dict] | None = [] if record_steps else None

    # ------------------------------------------------------------------------------------------ requests
    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queue a request; returns its id. Raises (for this request only, nothing queued) on bad input."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InvalidArgumentError(f"params must be a SamplingParams, got {type(params).__name__}")
        if params.n > self.max_num_seqs:
            raise InvalidArgumentError(f"n={params.n} exceeds max_num_seqs={self.max_num_seqs}")
        tokens = self._prompt_tokens(prompt)
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
        if self.kv == "static":
            need = self.store.slot_pages * params.n
        else:
            need = self.store.pages_for_tokens(len(tokens) + max_tokens)
        if need > self.store.total_pages():
            raise PromptTooLongError(
                f"prompt of {len(tokens)} tokens plus {max_tokens} to generate needs {need} pages of "
                f"{self.store.page_bytes} bytes; the KV budget holds {self.store.total_pages()}"
            )
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        req = Request(request_id, tokens, params, RequestMetrics(arrival_time=time.time()), max_tokens)
        req.seeds = [seed] if params.n == 1 else [(seed * 1_000_003 + i) % (1 << 63) for i in range(params.n)]
        req.seqs.append(Sequence(req, 0, list(tokens), self._generator(req, 0)))
        self._requests[request_id] = req
        self.scheduler.add(req.seqs[0])
        return request_id

    def _generator(self, req: Request, index: int):
        if req.params.greedy:
            return None
        return torch.Generator().manual_seed(req.seeds[index])

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
        for seq in req.seqs:
            if seq.status is not Status.FINISHED:
                self.scheduler.remove(seq)
                seq.finish_reason = "abort"
        self._finish_request(req, time.time(), aborted=True)
        self._pending.append(self._output(req))

    def has_unfinished(self) -> bool:
        return bool(self._requests) or bool(self._pending)

    # ------------------------------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """Run one step; returns the outputs of the requests that changed (new tokens or finished)."""
        outputs, self._pending = self._pending, []
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        t1 = time.perf_counter()
        if not plan:
            self._times["schedule"] += t1 - t0
            return outputs
        try:
            inputs, step_attention, samplers = self.runner.prepare(plan)
            t2 = time.perf_counter()
            logits = self.runner.forward(inputs, step_attention)
        except BaseException:
            # The cache grew for tokens whose K/V may be half written: the step's sequences give their pages
            # back and are recomputed later (the caller may abort them instead); other requests go on.
            step_attention = None
            self.scheduler.requeue(plan)
            raise
        del step_attention  # its views pin pages: gone before anything is swapped or freed
        t3 = time.perf_counter()
        for seq in plan.decodes:
            seq.num_computed += 1
        for seq, start, n in plan.prefills:
            seq.num_computed = start + n
            self._counters["prompt_tokens_total"] += min(n, max(0, seq.prompt_len - start))
            if not seq.prefix_offered and seq.num_computed >= seq.prompt_len:
                self.store.cache_prefix(seq.handle, seq.request.prompt)
                seq.prefix_offered = True
        rows, params, generators, targets = [], [], [], []
        for i, seq in enumerate(samplers):
            req = seq.request
            if req.params.n > 1 and not req.forked:
                targets.append((seq, req.params.n))
                for k in range(req.params.n):
                    rows.append(i)
                    params.append(req.params)
                    generators.append(seq.generator if k == 0 else self._generator(req, k))
            else:
                targets.append((seq, 1))
                rows.append(i)
                params.append(req.params)
                generators.append(seq.generator)
        if len(rows) != len(samplers):
            logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
        tokens = sample(logits, params, generators)
        t4 = time.perf_counter()
        now = time.time()
        changed = {}
        it = iter(zip(tokens, generators))
        for seq, count in targets:
            drawn = [next(it) for _ in range(count)]
            if count > 1:
                self._fork(seq, drawn[1:])
            self._append(seq, drawn[0][0], now)
            changed[seq.request.request_id] = seq.request
        outputs += [self._output(req) for req in changed.values()]
        for req in changed.values():
            if req.finished:
                del self._requests[req.request_id]
        t5 = time.perf_counter()
        self._counters["steps"] += 1
        for key, dt in (
            ("schedule", t1 - t0),
            ("prepare", t2 - t1),
            ("forward", t3 - t2),
            ("sample", t4 - t3),
            ("output", t5 - t4),
        ):
            self._times[key] += dt
        if self.step_log is not None:
            self.step_log.append(
                dict(
                    decodes=len(plan.decodes),
                    prefill_tokens=plan.num_tokens - len(plan.decodes),
                    schedule=t1 - t0,
                    prepare=t2 - t1,
                    forward=t3 - t2,
                    sample=t4 - t3,
                    output=t5 - t4,
                )
            )
        return outputs

    def _fork(self, parent: Sequence, drawn: list) -> None:
        """n > 1: the other completions share the parent's computed prompt pages."""
        req = parent.request
        handles = self.store.fork(parent.handle, len(drawn), parent.num_computed)
        for k, (handle, (token, generator)) in enumerate(zip(handles, drawn), start=1):
            child = Sequence(
                req,
                k,
                list(parent.tokens),
                generator,
                num_computed=parent.num_computed,
                handle=handle,
                slot=self.store.slot(handle),
                prefix_offered=True,
            )
            child.delta_from = len(child.tokens)
            req.seqs.append(child)
            self.scheduler.add_running(child)
            self._append(child, token, time.time())
        req.forked = True

    def _append(self, seq: Sequence, token: int, now: float) -> None:
        req = seq.request
        seq.tokens.append(token)
        self._counters["generation_tokens_total"] += 1
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        if token in req.params.stop_token_ids or (not req.params.ignore_eos and token in self.eos_token_ids):
            seq.finish_reason = "stop"
        elif seq.num_generated >= req.max_tokens:
            seq.finish_reason = "length"
        else:
            return
        self.scheduler.remove(seq)
        if all(s.finish_reason is not None for s in req.seqs) and (req.forked or req.params.n == 1):
            self._finish_request(req, now)

    def _finish_request(self, req: Request, now: float, aborted: bool = False) -> None:
        req.finished = True
        req.metrics.finish_time = now
        self._counters["requests_aborted" if aborted else "requests_finished"] += 1
        if aborted:
            del self._requests[req.request_id]

    def _output(self, req: Request) -> RequestOutput:
        completions = []
        for seq in req.seqs:
            ids = seq.tokens[req.prompt_len :]
            new = seq.tokens[max(seq.delta_from, req.prompt_len) :]
            seq.delta_from = len(seq.tokens)
            text = self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else None
            completions.append(CompletionOutput(seq.index, ids, new, text, seq.finish_reason))
        return RequestOutput(req.request_id, list(req.prompt), completions, req.finished, req.metrics)

    # ------------------------------------------------------------------------------------------ stats
    def stats(self) -> EngineStats:
        mem = self.store.memory()
        sched = self.scheduler
        held = mem["held_bytes"]
        if self.kv == "static":
            # The cache holds each reservation in full; the tokens computed so far are the live ones.
            live = sum(s.num_computed for s in sched.running)
            live_bytes = live * self.store.cache.bytes_per_token
        else:
            live, live_bytes = mem["live_tokens"], mem["live_bytes"]
        return EngineStats(
            running=len(sched.running),
            waiting=len(sched.waiting),
            swapped=len(sched.swapped),
            live_kv_tokens=live,
            kv_mapped_bytes=held,
            kv_high_water_bytes=mem["high_water_bytes"],
            kv_budget_bytes=mem["budget_bytes"],
            kv_utilization=live_bytes / held if held else 1.0,
            prefix_hit_tokens=sched.prefix_hit_tokens,
            preemptions_swap=sched.preemptions_swap,
            preemptions_recompute=sched.preemptions_recompute,
            kv=self.kv,
            time_schedule_s=self._times["schedule"],
            time_prepare_s=self._times["prepare"],
            time_forward_s=self._times["forward"],
            time_sample_s=self._times["sample"],
            time_output_s=self._times["output"],
            **self._counters,
        )

    def close(self) -> None:
        """Abort everything and release the cache."""
        for request_id in list(self._requests):
            self.abort(request_id)
        self._pending = []
        self.store.close()


class LLM:
    """Offline generation over an LLMEngine: LLM(model, tokenizer=None, **engine_kwargs)."""

    def __init__(self, model, tokenizer=None, **engine_kwargs):
        engine_kwargs.setdefault("kv_budget_bytes", 1 << 30)
        self.engine = LLMEngine(model, tokenizer, **engine_kwargs)

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Final outputs, in the order of prompts (a prompt: str or list of token ids; or one prompt)."""
        prompts = self._as_list(prompts)
        if isinstance(params, (list, tuple)):
            if len(params) != len(prompts):
                raise InvalidArgumentError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
            per_prompt = list(params)
        else:
            per_prompt = [params] * len(prompts)
        ids = []
        try:
            for prompt, p in zip(prompts, per_prompt):
                ids.append(self.engine.add_request(prompt, p))
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
