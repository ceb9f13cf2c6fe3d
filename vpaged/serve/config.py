"""EngineConfig: every option of an LLMEngine in one record, checked once.

The engine, the scheduler, the KV store and the model runner each read the options they need from the same
frozen object, so an option is validated in one place (here, when the config is built) and cannot drift
between the parts that use it:

    from vpaged.serve import EngineConfig, LLMEngine
    config = EngineConfig(kv_budget_bytes=64 << 20, kv="paged", max_num_seqs=16)
    engine = LLMEngine("random:llama-tiny", config=config)   # same as LLMEngine(model, kv_budget_bytes=...)

Options that only a cache understands (page_size, layout, block_size) are checked by that cache when the store
builds it: an engine whose kind does not use one ignores it, as it always has, and the cache's own message
names the problem.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import torch

from ..errors import InvalidArgumentError
from ..kvcache.checks import check_positive_int, is_int
from ..kvcache.formats import resolve_kv_dtype
from ..memory.device import normalize_device
from .stores.base import KV_KINDS


@dataclass(frozen=True)
class EngineConfig:
    """Options of an LLMEngine (see LLMEngine for the model and tokenizer).

    Args:
        kv_budget_bytes: memory for K/V (the page pool, the block pool, or the static reservations).
        swap_bytes: host swap space for preempted sequences (kv="vpaged" only; 0: preemption recomputes).
        max_num_seqs: sequences running at once. max_num_batched_tokens: tokens per step (chunked prefill).
        kv: "vpaged" (VirtualKVCache), "paged" (PagedKVCache, block tables) or "static" (each request maps
            a fixed slot of max_model_len tokens at admission, as static batching does: set max_model_len).
        enable_prefix_caching: reuse the K/V of full prompt pages computed before (vpaged).
        max_model_len: tokens a sequence may hold (default: the model's max_position_embeddings, and its
            sliding window when it has one: the engine attends over full contexts). The engine resolves it
            against the model (LLMEngine.max_model_len); this field keeps what was asked for.
        dtype, device: of the model and the cache (default: the model's dtype, "cpu"). device is stored
            normalized (a torch.device with an index for CUDA).
        page_size: bytes per page of the vpaged / static pool (default: the device's).
        layout: VirtualKVCache layout ("per_layer", "interleaved", "head_major").
        block_size: tokens per block of the paged store.
        seed: seeds the generator that seeds requests given no seed.
        record_steps: keep a per-step timing record in LLMEngine.step_log (for benchmarks).
        watermark_fraction: share of the KV pages an admission must leave free while other sequences run
            (vLLM's watermark), so that admitting a request does not force the next decode step to preempt.
        kv_dtype: what the cache stores: None / "auto" (the model dtype), "int8" (a scale per token and KV
            head), "fp8" / "fp8_e4m3" or "fp8_e5m2" (per-layer scales), or the torch dtype. A quantized
            format holds ~2x (bf16 models) or ~4x (fp32) the tokens in the same kv_budget_bytes.
        kv_scales: fp8 only: per-layer (K, V) scales, a float, or "calibrate" (from each layer's first
            write, i.e. the first prompt); default 1.0.
        cpu_prepack: on CPU, prepare the model once at construction: its linear layers run on oneDNN weights
            packed once (vpaged.hf.prepack), its Llama-formula RMSNorms and SiLU-gated MLPs on vpaged's fused
            ops, the MLP's gate and up products as one (vpaged.hf.fused); parameters and state_dict unchanged.
            Ignored on CUDA. False leaves the model's modules as they are (a model prepared before stays so:
            vpaged.hf.unprepack and vpaged.hf.unfuse undo it).
        tensor_parallel_size: ranks the model is sharded over (transformers' tp_plan="auto" on
            torch.distributed; see vpaged.serve.distributed). Each rank keeps the K/V of its own KV heads in
            its own store of kv_budget_bytes (and swap_bytes): the budgets are per rank.
        shared_budget: the name of a machine-wide budget (`vpaged budget create NAME --bytes N`) the store's
            pool joins: kv_budget_bytes is then this engine's ceiling, and its pages count against the
            budget shared with other engines and processes (vpaged.memory.SharedBudget).
    """

    kv_budget_bytes: int
    swap_bytes: int = 0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    kv: str = "vpaged"
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    dtype: torch.dtype | None = None
    device: torch.device | str = "cpu"
    page_size: int | None = None
    layout: str = "per_layer"
    block_size: int = 16
    seed: int = 0
    record_steps: bool = False
    watermark_fraction: float = 0.01
    cpu_prepack: bool = True
    kv_dtype: torch.dtype | str | None = None
    kv_scales: object = None
    tensor_parallel_size: int = 1
    # A plain field for now (issue #37); the config split (#35) decides which part it belongs to.
    shared_budget: str | None = None

    def __post_init__(self):
        # The order of the checks is the order LLMEngine has always reported them in.
        if self.kv not in KV_KINDS:
            raise InvalidArgumentError(f"kv must be one of {KV_KINDS}, got {self.kv!r}")
        check_positive_int("kv_budget_bytes", self.kv_budget_bytes)
        if not is_int(self.swap_bytes) or self.swap_bytes < 0:
            raise InvalidArgumentError(f"swap_bytes must be an int >= 0, got {self.swap_bytes!r}")
        check_positive_int("max_num_seqs", self.max_num_seqs)
        check_positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.dtype is not None and not isinstance(self.dtype, torch.dtype):
            raise InvalidArgumentError(f"dtype must be a torch.dtype, got {self.dtype!r}")
        if self.max_model_len is not None:
            check_positive_int("max_model_len", self.max_model_len)
        f = self.watermark_fraction
        if not isinstance(f, (int, float)) or isinstance(f, bool) or not 0 <= f < 1:
            raise InvalidArgumentError(f"watermark_fraction must be a number in [0, 1), got {f!r}")
        if not isinstance(self.cpu_prepack, bool):
            raise InvalidArgumentError(f"cpu_prepack must be a bool, got {self.cpu_prepack!r}")
        if self.kv_dtype is not None:
            resolve_kv_dtype(self.kv_dtype, self.dtype or torch.float32)  # DTypeError for an unknown format
        check_positive_int("tensor_parallel_size", self.tensor_parallel_size)
        if self.shared_budget is not None and not isinstance(self.shared_budget, str):
            raise InvalidArgumentError(f"shared_budget must be a budget's name, got {self.shared_budget!r}")
        object.__setattr__(self, "device", normalize_device(self.device))

    @property
    def max_cache_seqs(self) -> int:
        """Sequences the cache gives addresses to: the running ones plus as many swapped out (addresses
        only: no memory is behind an unused slot)."""
        return 2 * self.max_num_seqs

    def watermark_pages(self, total_pages: int) -> int:
        """Pages an admission leaves free while sequences run: floor(total_pages * watermark_fraction),
        computed exactly (0.01 of 300 pages is 3, not 2.9999...)."""
        return int(Fraction(str(self.watermark_fraction)) * total_pages)
