"""The serving layer's contracts: EngineConfig checks its options once, every store class implements the whole
KVStore protocol, the stores keep their memory records and truncation, and an engine built from a config
runs as one built from keywords."""

import dataclasses
import inspect

import pytest
import torch

pytest.importorskip("transformers")

from vpaged.errors import InvalidArgumentError  # noqa: E402
from vpaged.kvcache.geometry import KVGeometry  # noqa: E402
from vpaged.serve import LLM, EngineConfig, KVStore, LLMEngine, SamplingParams, load_model  # noqa: E402
from vpaged.serve.scheduler import Scheduler  # noqa: E402
from vpaged.serve.stores import KV_KINDS, STORES, Allocation, StoreMemory, make_store  # noqa: E402
from vpaged.serve.stores.base import KVSTORE_ATTRIBUTES, KVSTORE_METHODS  # noqa: E402

PAGE = 4096  # 2 KV heads x 16 dims x 4 bytes = 128 bytes a token per layer and K or V: 32 tokens a page
GEOMETRY = KVGeometry(2, 2, 16, torch.float32)
GREEDY = dict(temperature=0.0, ignore_eos=True)


# ------------------------------------------------------------------------------------------ EngineConfig
@pytest.mark.parametrize(
    "options, message",
    [
        (dict(kv="nope"), "kv must be one of ('vpaged', 'paged', 'static'), got 'nope'"),
        (dict(kv_budget_bytes=0), "kv_budget_bytes must be a positive int, got 0"),
        (dict(kv_budget_bytes=1.5), "kv_budget_bytes must be a positive int, got 1.5"),
        (dict(kv_budget_bytes=True), "kv_budget_bytes must be a positive int, got True"),
        (dict(swap_bytes=-1), "swap_bytes must be an int >= 0, got -1"),
        (dict(swap_bytes=False), "swap_bytes must be an int >= 0, got False"),
        (dict(max_num_seqs=0), "max_num_seqs must be a positive int, got 0"),
        (dict(max_num_batched_tokens=-3), "max_num_batched_tokens must be a positive int, got -3"),
        (dict(dtype="float32"), "dtype must be a torch.dtype, got 'float32'"),
        (dict(max_model_len=0), "max_model_len must be a positive int, got 0"),
        (dict(watermark_fraction=1.0), "watermark_fraction must be a number in [0, 1), got 1.0"),
        (dict(watermark_fraction=-0.1), "watermark_fraction must be a number in [0, 1), got -0.1"),
        (dict(watermark_fraction=True), "watermark_fraction must be a number in [0, 1), got True"),
        (dict(device="meta"), "vpaged supports devices 'cpu' and 'cuda[:N]', not 'meta'"),
    ],
)
def test_engine_config_refuses_bad_options_with_the_engines_messages(options, message):
    options = dict(dict(kv_budget_bytes=1 << 20), **options)
    with pytest.raises(InvalidArgumentError) as e:
        EngineConfig(**options)
    assert str(e.value) == message


def test_engine_config_defaults_normalizes_and_is_frozen():
    c = EngineConfig(kv_budget_bytes=1 << 20)
    scheduler = c.scheduler
    assert (c.kv, scheduler.max_num_seqs, scheduler.max_num_batched_tokens, scheduler.watermark_fraction) == (
        "vpaged",
        64,
        2048,
        0.01,
    )
    assert EngineConfig(kv_budget_bytes=1 << 20, kv="paged").store.block_size == 16
    assert c.model.device == torch.device("cpu") and c.scheduler.max_cache_seqs == 128
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.kv = "paged"
    with pytest.raises(TypeError):
        EngineConfig()  # kv_budget_bytes is required, as it is for LLMEngine


@pytest.mark.parametrize("total", [0, 1, 99, 100, 101, 299, 300, 700, 12345, 10**7 + 99])
def test_the_default_watermark_is_one_percent_of_the_pages_rounded_down(total):
    assert EngineConfig(kv_budget_bytes=1).scheduler.watermark_pages(total) == total // 100
    assert EngineConfig(kv_budget_bytes=1, watermark_fraction=0).scheduler.watermark_pages(total) == 0
    assert EngineConfig(kv_budget_bytes=1, watermark_fraction=0.1).scheduler.watermark_pages(total) == total // 10


# ------------------------------------------------------------------------------------------ KVStore
def missing_members(cls) -> list[str]:
    """KVStore members a store class does not define itself or inherit from a class other than the protocol."""
    missing = []
    for name in KVSTORE_METHODS:
        owner = next((k for k in cls.__mro__ if name in vars(k)), None)
        if owner is None or owner is KVStore or not callable(getattr(cls, name)):
            missing.append(name)
            continue
        want = list(inspect.signature(getattr(KVStore, name)).parameters)
        have = list(inspect.signature(getattr(cls, name)).parameters)
        if have[: len(want)] != want:
            missing.append(f"{name}{tuple(have)} != {tuple(want)}")
    return missing


@pytest.mark.parametrize("kind", KV_KINDS)
def test_every_store_class_implements_every_kvstore_method(kind):
    assert missing_members(STORES[kind]) == []


def test_the_member_check_finds_a_missing_method():
    class Partial:
        def total_pages(self):
            return 0

    assert "truncate" in missing_members(Partial) and "total_pages" not in missing_members(Partial)

    class Complete(STORES["paged"]):
        pass

    assert missing_members(Complete) == []


def store(kind, **options):
    config = EngineConfig(**dict(dict(kv_budget_bytes=128 * PAGE, page_size=PAGE, max_num_seqs=4, kv=kind), **options))
    return make_store(config, GEOMETRY, 256)


@pytest.mark.parametrize("kind", KV_KINDS)
def test_every_store_has_the_protocols_attributes_and_records(kind):
    s = store(kind)
    try:
        assert isinstance(s, KVStore) and s.kind == kind
        for name in KVSTORE_ATTRIBUTES:
            assert hasattr(s, name), name
        assert s.can_allocate(1)
        a = s.allocate([1, 2, 3], 1)
        assert isinstance(a, Allocation) and a.cached_tokens == 0
        s.extend([a.handle], 3)
        mem = s.memory()
        assert isinstance(mem, StoreMemory) and mem.live_tokens == 3 and mem.live_bytes == 3 * GEOMETRY.bytes_per_token
        assert mem.budget_bytes == s.total_pages() * s.page_bytes and mem.held_bytes > 0
        assert not s.can_swap_out(a.handle)  # no swap space configured
        s.free(a.handle)
        assert s.memory().live_tokens == 0
    finally:
        s.close()


@pytest.mark.parametrize("kind", KV_KINDS)
def test_store_truncate_drops_tokens_and_gives_pages_back(kind):
    s = store(kind)
    try:
        a = s.allocate(list(range(100)), 1)
        s.extend([a.handle], 100)
        held = s.memory().held_bytes
        s.truncate(a.handle, 10)
        mem = s.memory()
        assert mem.live_tokens == 10
        if kind == "static":
            assert mem.held_bytes == held  # the reservation stays whole
        else:
            assert mem.held_bytes < held
            assert s.pages_needed([a.handle], 1) == 0  # room in the kept page / block
        with pytest.raises(InvalidArgumentError):
            s.truncate(a.handle, 11)
    finally:
        s.close()


def test_the_paged_store_truncates_to_whole_blocks():
    s = store("paged", block_size=16)
    try:
        a = s.allocate([], 1)
        s.extend([a.handle], 40)  # 3 blocks
        free = s.total_pages() - 3
        s.truncate(a.handle, 17)  # 2 blocks
        assert s.memory().held_bytes == 2 * s.page_bytes
        assert s.pages_available(free + 1) and not s.pages_available(free + 2)
        assert s.memory().high_water_bytes == 3 * s.page_bytes
    finally:
        s.close()


def test_static_store_reserves_a_slot_per_completion_and_refuses_a_budget_below_one_slot():
    s = store("static")
    try:
        assert s.pages_for_request(5, 3) == 3 * s.slot_pages
        assert s.pages_needed([], 7) == 0
        a = s.allocate([1, 2], 2)
        assert s.memory().held_bytes == 2 * s.slot_pages * s.page_bytes
        s.extend([a.handle], 2)
        (child,) = s.fork(a.handle, 1, 2)
        assert s.memory().live_tokens == 4
        s.free(child)
        s.free(a.handle)
        # Freed slots stay mapped until their pages are needed (the cache reclaims them lazily).
        assert s.memory().live_tokens == 0 and s.can_allocate(4)
    finally:
        s.close()
    with pytest.raises(InvalidArgumentError, match="kv='static' reserves max_model_len=256 tokens"):
        store("static", kv_budget_bytes=16 * PAGE)


def test_the_paged_store_has_no_swap_space_to_swap_into():
    s = store("paged")
    try:
        a = s.allocate([], 1)
        assert not s.can_swap_out(a.handle)
        with pytest.raises(MemoryError):
            s.swap_out(a.handle)
        with pytest.raises(InvalidArgumentError):
            s.swap_in(a.handle)
    finally:
        s.close()


def test_the_scheduler_takes_its_watermark_from_the_config():
    s = store("vpaged")
    try:
        assert Scheduler(s, EngineConfig(kv_budget_bytes=1)).watermark_pages == s.total_pages() // 100
        assert Scheduler(s, EngineConfig(kv_budget_bytes=1, watermark_fraction=0.25)).watermark_pages == (
            s.total_pages() // 4
        )
    finally:
        s.close()


# ------------------------------------------------------------------------------------------ the engine


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return load_model("random:llama-tiny")[0]


@pytest.mark.serving
@pytest.mark.parametrize("kind", KV_KINDS)
def test_an_engine_from_a_config_runs_as_one_from_keywords(model, kind):
    options = dict(kv_budget_bytes=64 * PAGE, page_size=PAGE, kv=kind, max_model_len=96, max_num_batched_tokens=32)
    prompts = [[5, 6, 7, 8] * 5, [9, 10, 11], [5, 6, 7, 8] * 5 + [12]]
    params = SamplingParams(max_tokens=6, **GREEDY)
    by_kwargs = LLM(model, **options)
    by_config = LLM(model, config=EngineConfig(**options))
    try:
        assert [o.token_ids for o in by_kwargs.generate(prompts, params)] == [
            o.token_ids for o in by_config.generate(prompts, params)
        ]
        a, b = by_kwargs.stats(), by_config.stats()
        timing = {f.name for f in dataclasses.fields(a) if f.name.startswith("time_")}
        strip = {f.name: 0 for f in dataclasses.fields(a) if f.name in timing}
        assert dataclasses.replace(a, **strip) == dataclasses.replace(b, **strip)
        assert by_config.engine.config.kv == kind and by_config.engine.max_model_len == 96
    finally:
        by_kwargs.engine.close()
        by_config.engine.close()


@pytest.mark.serving
def test_an_engine_takes_a_config_or_keywords_not_both(model):
    config = EngineConfig(kv_budget_bytes=1 << 20)
    with pytest.raises(InvalidArgumentError, match="not both"):
        LLMEngine(model, config=config, max_num_seqs=4)
    with pytest.raises(InvalidArgumentError, match="EngineConfig"):
        LLMEngine(model, config=dict(kv_budget_bytes=1 << 20))
    with pytest.raises(InvalidArgumentError, match="max_num_seqs must be a positive int"):
        LLMEngine(model, kv_budget_bytes=1 << 20, max_num_seqs=0)


@pytest.mark.serving
def test_the_step_log_and_the_stats_time_the_same_phases(model):
    eng = LLMEngine(model, kv_budget_bytes=64 * PAGE, page_size=PAGE, record_steps=True, max_num_batched_tokens=16)
    try:
        for p in ([3, 4, 5] * 10, [6, 7]):
            eng.add_request(p, SamplingParams(max_tokens=4, **GREEDY))
        while eng.has_unfinished():
            eng.step()
        stats = eng.stats()
        log = eng.step_log
        assert len(log) == stats.steps and sum(r.decodes for r in log) == stats.generation_tokens_total - 2
        assert sum(r.prefill_tokens for r in log) == stats.prompt_tokens_total == 32
        assert stats.time_forward_s == pytest.approx(sum(r.times.forward for r in log))
        assert set(log[0].as_dict()) == {
            "decodes",
            "prefill_tokens",
            "schedule",
            "prepare",
            "forward",
            "sample",
            "output",
        }
    finally:
        eng.close()
