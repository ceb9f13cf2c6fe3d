"""What the engine hands back: per-request outputs (with this step's delta) and engine statistics."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    prefix_hit_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log probability under the model's raw distribution at its position, and the `k` most
    likely tokens there (k = the request's logprobs / prompt_logprobs), most likely first."""

    token_id: int
    logprob: float
    rank: int  # 1 + the number of tokens more likely than this one (1: the argmax)
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob)


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]  # all generated so far
    new_token_ids: list[int]  # generated in this step (the streaming delta)
    text: str | None = None  # None without a tokenizer
    # None while running, else "stop" | "length" | "abort" | "error" (the request's constraints - its grammar with
    # bad_words or min_tokens - left no token to draw at some step: sampler.NO_TOKEN; token_ids end before it)
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids (SamplingParams.logprobs set)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # SamplingParams.prompt_logprobs set: None for the first prompt token, then one per prompt token, once
    # the prompt is computed (an empty list before).
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def new_token_ids(self) -> list[int]:
        return self.outputs[0].new_token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def text(self) -> str | None:
        return self.outputs[0].text


@dataclass(frozen=True)
class EngineStats:
    running: int  # sequences scheduled in the last step's batch or waiting for their next token
    waiting: int  # requests not admitted yet (including those preempted by recompute)
    swapped: int  # sequences whose KV sits in host swap space
    live_kv_tokens: int  # tokens whose K/V are held (shared tokens count once per sequence)
    kv_mapped_bytes: int  # KV memory held now (pages mapped / blocks taken / slots reserved)
    kv_high_water_bytes: int  # most KV memory held at once
    kv_budget_bytes: int
    kv_utilization: float  # live KV bytes / mapped KV bytes (> 1 when pages are shared; 0 when nothing is mapped)
    prefix_hit_tokens: int  # prompt tokens served from the prefix cache, all requests
    prefix_tokens_per_page: float  # granularity of the prefix cache: tokens per cached page (0.0 when off)
    prefix_caching: str  # "on", or why it is off
    preemptions_swap: int
    preemptions_recompute: int
    requests_finished: int
    requests_aborted: int
    prompt_tokens_total: int  # prompt tokens computed (recomputation included)
    generation_tokens_total: int
    steps: int
    kv: str  # "vpaged" | "paged" | "static"
    # Seconds spent in each phase of step(), summed over all steps.
    time_schedule_s: float = 0.0
    time_prepare_s: float = 0.0
    time_forward_s: float = 0.0
    time_sample_s: float = 0.0
    time_output_s: float = 0.0
    kv_free_pages: int = 0  # pages (blocks for kv="paged") of the pool not taken
    kv_used_pages: int = 0  # pages taken: by live sequences, swapped-in copies, freed slots kept, the prefix cache
    kv_dormant_pages: int = 0  # of the used pages, those kept only for reuse (reclaimable on demand)
    prefix_hit_rate: float = 0.0  # prefix_hit_tokens / (prefix_hit_tokens + prompt_tokens_total); 0 before any
    # A shared prefix store (VirtualStoreConfig.prefix_store): tokens of prompts it supplied (part of
    # prefix_hit_tokens), the bytes of its pages mapped without a copy and copied, the pages published to it.
    prefix_store_hit_tokens_total: int = 0
    prefix_store_mapped_bytes_total: int = 0
    prefix_store_copied_bytes_total: int = 0
    prefix_store_published_pages_total: int = 0
    extra: dict = field(default_factory=dict)
    # Tensor parallel: ranks, and each rank's StoreMemory (rank 0 first). With more than one rank the kv_*
    # byte and page fields above are the sums over the ranks; token counts are per sequence, the same on each.
    tensor_parallel_size: int = 1
    ranks: tuple = ()
    # In a machine-wide shared budget: its totals and this engine's figures as a member (BudgetFigures); None
    # otherwise. /metrics exports them as vpaged_shared_budget_*.
    shared_budget: object = None


@dataclass
class StepTimes:
    """Seconds in each phase of LLMEngine.step(): of one step (StepRecord.times), or summed over all steps
    (EngineStats.time_*_s). schedule: the scheduler's plan (admissions, preemptions, cache growth); prepare:
    the packed inputs and the step's attention metadata; forward: the model; sample: the sampling rows and
    the draw; output: the scheduler's postprocess (every sequence state change of the step) and the
    RequestOutputs."""

    schedule: float = 0.0
    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    output: float = 0.0

    def add(self, other: StepTimes) -> None:
        """Add another's seconds to these, phase by phase."""
        self.schedule += other.schedule
        self.prepare += other.prepare
        self.forward += other.forward
        self.sample += other.sample
        self.output += other.output


@dataclass(frozen=True)
class StepRecord:
    """One step as LLMEngine.step_log keeps it (record_steps=True): what it computed and how long it took."""

    decodes: int  # sequences that decoded one token
    prefill_tokens: int  # prompt (or recomputed) tokens in prefill chunks
    times: StepTimes

    def as_dict(self) -> dict:
        """Flat: decodes, prefill_tokens and the seconds of each phase by its name (for JSON reports)."""
        return dict(decodes=self.decodes, prefill_tokens=self.prefill_tokens, **asdict(self.times))
