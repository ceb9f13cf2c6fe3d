"""shared_budget= through the caches and the engine: two engines on one budget take turns with its memory
and produce what engines with private pools produce; a PagedKVCache holds its reservation; VPagedCache joins."""

import random

import pytest
import torch

from vpaged import KVGeometry, PagedCacheConfig, PagedKVCache
from vpaged.errors import BudgetMismatchError, InvalidArgumentError
from vpaged.memory import SharedBudget

PAGE = 64 * 1024


@pytest.fixture(scope="module")
def tiny():
    pytest.importorskip("transformers")
    from vpaged.serve import load_model

    return load_model("random:llama-tiny")[0]


def prompts(n, seed):
    rng = random.Random(seed)
    return [[rng.randrange(10, 500) for _ in range(rng.randint(40, 200))] for _ in range(n)]


def run(engine_kwargs, model, batch, max_tokens=24):
    from vpaged.serve import LLM, SamplingParams

    llm = LLM(model, cpu_prepack=False, **engine_kwargs)
    outs = llm.generate(batch, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return llm, [list(o.outputs[0].token_ids) for o in outs]


def test_two_engines_take_turns_with_one_budget(budget_name, tiny):
    # llama-tiny: 512 bytes per token; each sequence takes at least one 64 KiB page in each of 4 regions.
    budget = SharedBudget.create(budget_name, capacity_bytes=160 * PAGE)
    seed = random.randrange(1 << 30)
    first, second = prompts(12, seed), prompts(30, seed + 1)
    _, want_first = run(dict(kv_budget_bytes=160 * PAGE), tiny, first)
    _, want_second = run(dict(kv_budget_bytes=160 * PAGE), tiny, second)
    shared = dict(kv_budget_bytes=160 * PAGE, shared_budget=budget_name, max_num_seqs=32)
    llm_a, got_first = run(shared, tiny, first)
    assert got_first == want_first
    a_pool = llm_a.engine.store.cache.pool
    a_before = a_pool.stats().used_pages
    assert a_before >= 48  # 12 sequences x 4 regions: their pages stay mapped (dormant) while a is idle
    llm_b, got_second = run(shared, tiny, second)  # needs more than the budget has free: a gives back
    assert got_second == want_second
    state = budget.state()
    assert state.granted_bytes <= state.capacity_bytes and len(state.members) == 2
    assert a_pool.stats().used_pages < a_before  # a gave dormant pages back while idle
    assert llm_b.engine.store.cache.pool.stats().high_water_pages > 160 - a_before


def test_engine_config_rejects_a_non_name(tiny):
    from vpaged.serve import EngineConfig

    with pytest.raises(InvalidArgumentError, match="shared_budget"):
        EngineConfig(kv_budget_bytes=1 << 20, shared_budget=3)


def test_paged_cache_holds_its_reservation(budget_name):
    budget = SharedBudget.create(budget_name, capacity_bytes=64 * PAGE)
    a = PagedKVCache(
        KVGeometry(2, 2, 64, torch.float32), PagedCacheConfig(num_blocks=40, block_size=16, shared_budget=budget_name)
    )  # 40 x 32 KiB
    assert budget.state().members[0].granted_bytes == 20 * PAGE == budget.state().members[0].min_bytes
    with pytest.raises(BudgetMismatchError, match="cannot guarantee"):  # 50 pages, 44 not guaranteed to a
        PagedKVCache(
            KVGeometry(2, 2, 64, torch.float32),
            PagedCacheConfig(num_blocks=100, block_size=16, shared_budget=budget_name),
        )
    assert len(budget.state().members) == 1  # the refused one holds nothing
    a.close()
    assert budget.state().members == ()


def test_vpaged_cache_joins_the_budget(budget_name, tiny):
    pytest.importorskip("transformers")
    from vpaged.hf import VPagedCache

    budget = SharedBudget.create(budget_name, capacity_bytes=64 * PAGE)
    cache = VPagedCache(tiny.config, max_cache_len=256, shared_budget=budget_name)
    ids = torch.randint(10, 500, (1, 20))
    with torch.no_grad():
        tiny(input_ids=ids, cache=cache, use_cache=True)
    assert cache.pool.budget is not None and budget.state().members[0].granted_bytes > 0
