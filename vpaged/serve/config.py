"""EngineConfig: every option of an LLMEngine, in parts, each part checked once when it is built.

    SchedulerConfig   what runs each step: sequences, tokens per step, the admission watermark
    StoreConfig       where K/V live, one class per kind (VirtualStoreConfig "vpaged", StaticStoreConfig
                      "static", PagedStoreConfig "paged"): each holds only the options its kind uses
    ModelConfig       the model's dtype and device, its longest sequence, CPU preparation
    ParallelConfig    tensor parallelism

The engine, the scheduler, the store and the runner read their own part of one frozen EngineConfig
(`config.scheduler.max_num_seqs`, `config.model.device`): an option has one place to be read. The flat form
of earlier releases still builds a config, mapped onto the parts (`dataclasses.replace(config,
block_size=32)` too):

    from vpaged.serve import EngineConfig, LLMEngine, PagedStoreConfig
    config = EngineConfig(store=PagedStoreConfig(kv_budget_bytes=64 << 20, block_size=32))
    config = EngineConfig(kv_budget_bytes=64 << 20, kv="paged", block_size=32)  # the same config
    engine = LLMEngine("random:llama-tiny", config=config)   # same as LLMEngine(model, kv_budget_bytes=...)

A flat option that the chosen kind does not use (say layout with kv="paged") is kept out of the parts and
listed in `config.unused_options`: the engine says so in its log, `vpaged serve` refuses it. The kv_dtype
is resolved once, against the model's dtype, into `config.kv_format` (None until that dtype is known: the
engine asks `config.for_model_dtype(model.dtype)` once it has loaded the model).

To add an option: a field with `metadata=option("help text")` on the part it belongs to (a scheduling policy
goes on SchedulerConfig), checked in that part's __post_init__. The flat form and `vpaged serve`'s flags
(vpaged/cli/engine_flags.py, from these fields) pick it up; tests/cli/test_cli_engine_flags.py checks that.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from fractions import Fraction
from typing import ClassVar

import torch

from ..errors import InvalidArgumentError
from ..kvcache.checks import check_positive_int, is_int
from ..kvcache.eviction import EVICTION_POLICIES, RECLAIM_ORDERS, resolve_eviction_policy, resolve_reclaim_order
from ..kvcache.formats import MODEL_DTYPES, NAMES, KVFormat
from ..kvcache.paged import BLOCK_SIZES
from ..kvcache.virtual import LAYOUTS
from ..memory.device import normalize_device
from .options import option
from .policies import PREEMPTION_POLICIES, SCHEDULING_POLICIES, check_policy_names
from .stores.base import KV_KINDS


def _check_nonnegative_int(name: str, value) -> None:
    if not is_int(value) or value < 0:
        raise InvalidArgumentError(f"{name} must be an int >= 0, got {value!r}")


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"{name} must be a bool, got {value!r}")


# ---------------------------------------------------------------------------------------------- parts
@dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler admits and runs each step. Scheduling policies are fields here too."""

    max_num_seqs: int = field(default=64, metadata=option("sequences running at once"))
    # 2,048: what vLLM's OpenAI server takes a step on the CPU. Against 512, a burst's prompts finish sooner (SmolLM2
    # on a 2-core Zen 3: last first token 7-16 % earlier, burst throughput level or better; benchmarks/NOTES.md), while
    # a long prompt arriving mid-decode holds the running sequences' next token for a longer step: lower it for that.
    max_num_batched_tokens: int = field(default=2048, metadata=option("tokens per step (chunked prefill)"))
    watermark_fraction: float = field(
        default=0.01,
        metadata=option(
            "share of the KV pages an admission must leave free while other sequences run (vLLM's watermark), "
            "so that admitting a request does not force the next decode step to preempt"
        ),
    )
    # Policies (serve/policies.py): today's orders by default.
    scheduling_policy: str = field(
        default="fcfs",
        metadata=option(
            "the admission queue: fcfs (first come, first served) or priority (lowest add_request(priority=...) "
            "first, then first come)",
            tuple(SCHEDULING_POLICIES),
        ),
    )
    preemption_policy: str | None = field(
        default=None,
        metadata=option(
            "which running sequence is preempted when pages run short: newest or lowest_priority (default: the "
            "scheduling policy's own, newest for fcfs)",
            tuple(PREEMPTION_POLICIES),
        ),
    )

    def __post_init__(self):
        check_positive_int("max_num_seqs", self.max_num_seqs)
        check_positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        f = self.watermark_fraction
        if not isinstance(f, (int, float)) or isinstance(f, bool) or not 0 <= f < 1:
            raise InvalidArgumentError(f"watermark_fraction must be a number in [0, 1), got {f!r}")
        check_policy_names(self.scheduling_policy, self.preemption_policy)

    @property
    def max_cache_seqs(self) -> int:
        """Sequences the cache gives addresses to: the running ones plus as many swapped out (addresses
        only: no memory is behind an unused slot)."""
        return 2 * self.max_num_seqs

    def watermark_pages(self, total_pages: int) -> int:
        """Pages an admission leaves free while sequences run: floor(total_pages * watermark_fraction),
        computed exactly (0.01 of 300 pages is 3, not 2.9999...)."""
        return int(Fraction(str(self.watermark_fraction)) * total_pages)


@dataclass(frozen=True)
class StoreConfig:
    """What every kind of store takes. Use the class of a kind (below); `kind` names it (EngineConfig.kv)."""

    kind: ClassVar[str]
    kv_budget_bytes: int = field(
        metadata=option("memory for K/V: the page pool, the block pool, or the static reservations")
    )
    kv_dtype: torch.dtype | str | None = field(
        default=None,
        metadata=option(
            "what the cache stores: auto (the model dtype), int8 (a scale per token and KV head), fp8 / fp8_e4m3 "
            "or fp8_e5m2 (per-layer scales), or a torch dtype; a quantized format holds ~2x (bf16) or ~4x (fp32) "
            "the tokens in the same budget",
            ("auto", *NAMES),
        ),
    )
    kv_scales: object = field(
        default=None,
        metadata=option("fp8 K/V scales: per-layer (K, V) pairs, a number, or 'calibrate' (from each layer's "
                        "first write, i.e. the first prompt); default 1.0"),
    )  # fmt: skip
    shared_budget: str | None = field(
        default=None,
        metadata=option(
            "the name of a machine-wide budget (`vpaged budget create NAME --bytes N`) the store's pool joins: "
            "kv_budget_bytes is then this engine's ceiling, and its pages count against the budget shared with "
            "other engines and processes (vpaged.memory.SharedBudget)"
        ),
    )

    shared_budget_member: str | None = field(
        default=None,
        metadata=option(
            "how `vpaged budget show` names this engine's member of the shared budget (kept whole: at most 64 "
            "bytes of UTF-8, unique among the budget's live members, else the join is refused; default pool-PID; "
            "`vpaged serve` gives the served model's name)"
        ),
    )

    def __post_init__(self):
        check_positive_int("kv_budget_bytes", self.kv_budget_bytes)
        if self.shared_budget is not None and not isinstance(self.shared_budget, str):
            raise InvalidArgumentError(f"shared_budget must be a budget's name, got {self.shared_budget!r}")
        member = self.shared_budget_member
        if member is not None and (not isinstance(member, str) or not member):
            raise InvalidArgumentError(f"shared_budget_member must be a non-empty name, got {member!r}")

    @property
    def prefix_caching_turned_off(self) -> bool:
        """Whether the user turned prefix caching off (a kind without a prefix cache did not ask)."""
        return False


def _page_size():
    return field(default=None, metadata=option("bytes per page of the pool (default: the device's)"))


STORE_LAYOUTS = ("auto", *LAYOUTS)


def _layout():
    return field(
        default="auto",
        metadata=option(
            "VirtualKVCache layout (auto: per_layer for K/V in the model's dtype, interleaved for int8 / fp8)",
            STORE_LAYOUTS,
        ),
    )


@dataclass(frozen=True)
class VirtualStoreConfig(StoreConfig):
    """kv="vpaged": a VirtualKVCache, pages mapped as sequences grow, prefix caching and swap."""

    kind: ClassVar[str] = "vpaged"
    page_size: int | None = _page_size()
    layout: str = _layout()
    swap_bytes: int = field(
        default=0, metadata=option("host swap space for preempted sequences (0: preemption recomputes)")
    )
    enable_prefix_caching: bool = field(
        default=True, metadata=option("reuse the K/V of full prompt pages computed before")
    )
    # Policies of the cache (kvcache/eviction.py): names, so that the config crosses to other ranks as plain data.
    eviction_policy: str = field(
        default="lru",
        metadata=option("which cached prefix blocks the cache evicts first: lru or lfu", tuple(EVICTION_POLICIES)),
    )
    reclaim_order: str = field(
        default="dormant_first",
        metadata=option(
            "which kind of kept pages the cache gives back first: dormant_first (freed slots, then prefix blocks, "
            "then spare tails) or prefix_first",
            tuple(RECLAIM_ORDERS),
        ),
    )

    prefix_store: str | None = field(
        default=None,
        metadata=option(
            "a KV page store shared with other processes (NAME in /dev/shm, or dir:PATH, kept across restarts), "
            "made when missing: full prompt blocks are published there, and a prompt's blocks past the engine's "
            "own prefix hits are taken from it (docs/kv-store.md)"
        ),
    )
    prefix_store_pages: int | None = field(
        default=None, metadata=option("pages of a prefix store made here (default 4096)")
    )
    prefix_store_map: bool = field(
        default=True,
        metadata=option(
            "map the store's pages into a request's range on a hit, no byte copied (else copy each page into the "
            "request's own)"
        ),
    )

    def __post_init__(self):
        super().__post_init__()
        _check_nonnegative_int("swap_bytes", self.swap_bytes)
        _check_pages(self)
        _check_bool("enable_prefix_caching", self.enable_prefix_caching)
        _check_bool("prefix_store_map", self.prefix_store_map)
        if self.prefix_store is not None and (not isinstance(self.prefix_store, str) or not self.prefix_store):
            raise InvalidArgumentError(f'prefix_store is a store name or "dir:PATH", got {self.prefix_store!r}')
        if self.prefix_store_pages is not None:
            check_positive_int("prefix_store_pages", self.prefix_store_pages)
        if self.prefix_store is not None and not self.enable_prefix_caching:
            raise InvalidArgumentError("a prefix_store works through prefix caching: leave enable_prefix_caching on")
        for name, resolve in (("eviction_policy", resolve_eviction_policy), ("reclaim_order", resolve_reclaim_order)):
            if not isinstance(getattr(self, name), str):
                raise InvalidArgumentError(f"{name} must be a name, got {getattr(self, name)!r}")
            resolve(getattr(self, name))

    @property
    def prefix_caching_turned_off(self) -> bool:
        return not self.enable_prefix_caching


@dataclass(frozen=True)
class StaticStoreConfig(StoreConfig):
    """kv="static": each request maps a fixed slot of max_model_len tokens at admission (set max_model_len)."""

    kind: ClassVar[str] = "static"
    page_size: int | None = _page_size()
    layout: str = _layout()

    def __post_init__(self):
        super().__post_init__()
        _check_pages(self)


@dataclass(frozen=True)
class PagedStoreConfig(StoreConfig):
    """kv="paged": a PagedKVCache of blocks (the block-table baseline): no prefix caching, no swap."""

    kind: ClassVar[str] = "paged"
    block_size: int = field(default=16, metadata=option("tokens per block", BLOCK_SIZES))

    def __post_init__(self):
        super().__post_init__()
        if self.block_size not in BLOCK_SIZES or not is_int(self.block_size):
            raise InvalidArgumentError(f"block_size must be one of {BLOCK_SIZES}, got {self.block_size!r}")


def _check_pages(store) -> None:
    if store.page_size is not None:
        check_positive_int("page_size", store.page_size)  # the pool checks what its device allows
    if store.layout not in STORE_LAYOUTS:
        raise InvalidArgumentError(f"layout must be one of {STORE_LAYOUTS}, got {store.layout!r}")


STORE_CONFIGS: dict[str, type[StoreConfig]] = {
    "vpaged": VirtualStoreConfig,
    "paged": PagedStoreConfig,
    "static": StaticStoreConfig,
}
assert tuple(STORE_CONFIGS) == KV_KINDS


@dataclass(frozen=True)
class ModelConfig:
    """The model the engine runs, and where."""

    dtype: torch.dtype | None = field(
        default=None, metadata=option("of the model and the cache (default: the model's)")
    )
    device: torch.device | str = field(
        default="cpu", metadata=option("of the model and the cache: cpu, cuda or cuda:N (stored normalized)")
    )
    max_model_len: int | None = field(
        default=None,
        metadata=option(
            "tokens a sequence may hold (default: the model's max_position_embeddings, and its sliding window "
            "when it has one); the engine resolves it against the model (LLMEngine.max_model_len)"
        ),
    )
    cpu_prepack: bool = field(
        default=True,
        metadata=option(
            "on CPU, prepare the model once: linear layers on oneDNN weights packed once, RMSNorms and gated MLPs "
            "on vpaged's fused ops (vpaged.hf.prepack / vpaged.hf.fused); ignored on CUDA"
        ),
    )

    direct_forward: bool = field(
        default=True,
        metadata=option(
            "on CPU with cpu_prepack, run Llama-family models (llama, mistral, qwen2, qwen3) through vpaged's own "
            "layer walk (vpaged.serve.direct_forward) instead of the transformers forward; a model that does not "
            "qualify runs the transformers forward (the log says why)"
        ),
    )

    def __post_init__(self):
        if self.dtype is not None and not isinstance(self.dtype, torch.dtype):
            raise InvalidArgumentError(f"dtype must be a torch.dtype, got {self.dtype!r}")
        if self.max_model_len is not None:
            check_positive_int("max_model_len", self.max_model_len)
        _check_bool("cpu_prepack", self.cpu_prepack)
        _check_bool("direct_forward", self.direct_forward)
        object.__setattr__(self, "device", normalize_device(self.device))


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is spread over ranks (vpaged.serve.distributed)."""

    tensor_parallel_size: int = field(
        default=1,
        metadata=option(
            "ranks the model is sharded over (transformers' tp_plan='auto'); each rank keeps the K/V of its own "
            "KV heads in its own store of kv_budget_bytes (and swap_bytes): the budgets are per rank"
        ),
    )

    def __post_init__(self):
        check_positive_int("tensor_parallel_size", self.tensor_parallel_size)


# ---------------------------------------------------------------------------------------------- the whole
PARTS: dict[str, type] = {"scheduler": SchedulerConfig, "model": ModelConfig, "parallel": ParallelConfig}


def _names(cls) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


# Every flat option: "kv" (the store's kind), the store fields of every kind, the other parts' fields, and
# EngineConfig's own (seed, record_steps).
STORE_OPTIONS = tuple(dict.fromkeys(name for cls in STORE_CONFIGS.values() for name in _names(cls)))
FLAT_OPTIONS = ("kv", *STORE_OPTIONS, *(n for cls in PARTS.values() for n in _names(cls)), "seed", "record_steps")
assert len(set(FLAT_OPTIONS)) == len(FLAT_OPTIONS), "an option name must belong to one part"


@dataclass(frozen=True, init=False)
class EngineConfig:
    """Options of an LLMEngine (see LLMEngine for the model and tokenizer), in parts (see the module).

    EngineConfig(store=..., scheduler=..., model=..., parallel=..., seed=0, record_steps=False), or the flat
    options of earlier releases (EngineConfig(kv_budget_bytes=..., kv="paged", block_size=32, ...)), or both
    (the flat options then change the given parts). kv_budget_bytes (or a store) is required.

    Args:
        store: a VirtualStoreConfig, StaticStoreConfig or PagedStoreConfig (default kind: "vpaged").
        scheduler, model, parallel: a SchedulerConfig, ModelConfig, ParallelConfig (default: theirs).
        seed: seeds the generator that seeds requests given no seed.
        record_steps: keep a per-step timing record in LLMEngine.step_log (for benchmarks).
    """

    store: StoreConfig
    scheduler: SchedulerConfig
    model: ModelConfig
    parallel: ParallelConfig
    seed: int = field(default=0, metadata=option("seeds the generator that seeds requests given no seed"))
    record_steps: bool = field(default=False, metadata=option("keep a per-step timing record (LLMEngine.step_log)"))
    # Derived: flat options the store's kind does not use, and the K/V format (None: model dtype not known).
    unused_options: tuple[str, ...] = field(init=False, default=(), compare=False, repr=False)
    kv_format: KVFormat | None = field(init=False, default=None, compare=False, repr=False)

    def __init__(self, store=None, scheduler=None, model=None, parallel=None, seed=0, record_steps=False, **options):
        unknown = [name for name in options if name not in FLAT_OPTIONS]
        if unknown:
            raise TypeError(f"EngineConfig got unexpected options {unknown}")
        seed, record_steps = options.pop("seed", seed), options.pop("record_steps", record_steps)
        store, unused = _store_part(store, options)
        given = dict(scheduler=scheduler, model=model, parallel=parallel)
        parts = {name: _part(name, cls, given[name], options) for name, cls in PARTS.items()}
        if not is_int(seed):
            raise InvalidArgumentError(f"seed must be an int, got {seed!r}")
        _check_bool("record_steps", record_steps)
        set_ = object.__setattr__
        for name, value in dict(store=store, **parts, seed=seed, record_steps=record_steps).items():
            set_(self, name, value)
        set_(self, "unused_options", unused)
        dtype = parts["model"].dtype
        if dtype is not None:  # the one place kv_dtype becomes a format (DTypeError for one that is not)
            set_(self, "kv_format", KVFormat.of(dtype, store.kv_dtype))
        elif store.kv_dtype is not None:  # the model's dtype comes later: refuse what no dtype makes valid now
            _check_kv_dtype_alone(store.kv_dtype)

    def for_model_dtype(self, dtype: torch.dtype) -> EngineConfig:
        """This config for a model of `dtype` (the engine's, once loaded): kv_format resolved against it."""
        return self if self.model.dtype == dtype else dataclasses.replace(self, dtype=dtype)

    @property
    def kv(self) -> str:
        """The store's kind: "vpaged", "paged" or "static" (config.store.kind, the name the flat form sets)."""
        return self.store.kind


def _store_part(store, options: dict) -> tuple[StoreConfig, tuple[str, ...]]:
    """The store config: `store` (or a new one of kind options["kv"]) with the flat store options applied;
    the flat store options its kind does not take come back as unused."""
    kind = options.pop("kv", None)
    if store is not None and not isinstance(store, StoreConfig):
        raise InvalidArgumentError(f"store must be a StoreConfig of one kind, got {type(store).__name__}")
    if kind is None:
        kind = store.kind if store is not None else "vpaged"
    if kind not in KV_KINDS:
        raise InvalidArgumentError(f"kv must be one of {KV_KINDS}, got {kind!r}")
    cls = STORE_CONFIGS[kind]
    names = _names(cls)
    values = {} if store is None else {n: getattr(store, n) for n in _names(type(store)) if n in names}
    unused = []
    for name in STORE_OPTIONS:
        if name in options:
            value = options.pop(name)
            if name in names:
                values[name] = value
            else:
                unused.append(name)
    if "kv_budget_bytes" not in values:
        raise TypeError("EngineConfig needs kv_budget_bytes (or a store config)")
    if store is not None and type(store) is cls and values == {n: getattr(store, n) for n in names}:
        return store, tuple(unused)
    return cls(**values), tuple(unused)


def _part(name: str, cls: type, given, options: dict):
    if given is not None and not isinstance(given, cls):
        raise InvalidArgumentError(f"{name} must be a {cls.__name__}, got {type(given).__name__}")
    changes = {n: options.pop(n) for n in _names(cls) if n in options}
    if given is None:
        return cls(**changes)
    return dataclasses.replace(given, **changes) if changes else given


def _check_kv_dtype_alone(kv_dtype) -> None:
    """DTypeError for a kv_dtype that no model dtype makes valid (a model dtype itself may be the model's)."""
    if isinstance(kv_dtype, torch.dtype) and kv_dtype in MODEL_DTYPES:
        return
    KVFormat(torch.float32, kv_dtype)  # names, quantized formats; anything else raises
