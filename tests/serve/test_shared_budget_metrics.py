"""/metrics of a server whose engine is a member of a shared budget carries the budget's figures: its capacity,
what its members hold, how many they are, and this member's mapped / live / dormant / granted / min / ceiling
and fair share, equal to the ledger's own record and to the engine's stats(); a server outside a budget
exports none of them."""

from __future__ import annotations

import random

import pytest
import torch

from vpaged import KVGeometry, VirtualCacheConfig

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")


from vpaged import VirtualKVCache  # noqa: E402
from vpaged.memory import SharedBudget  # noqa: E402
from vpaged.serve import LLMEngine, SamplingParams  # noqa: E402
from vpaged.serve.http.server import ServerThread  # noqa: E402

pytestmark = pytest.mark.serving  # skipped where transformers cannot serve (tests/conftest.py)

PAGE = 64 * 1024
TIMEOUT = 120


def parse_metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_metrics_carry_the_shared_budget(model_and_tok, budget_name):
    model, tok = model_and_tok
    capacity = random.randint(96, 160) * PAGE
    budget = SharedBudget.create(budget_name, capacity, share_policy=random.choice(["fair", "greedy"]))
    min_bytes = random.randint(1, 8) * PAGE  # the other member's guarantee: counted in the budget, not the engine's
    other = VirtualKVCache(
        KVGeometry(2, 2, 64, torch.float32),
        VirtualCacheConfig(max_seqs=8, max_seq_len=1024, shared_budget=budget_name, min_bytes=min_bytes),
    )
    held = []
    for _ in range(random.randint(1, 4)):  # another member holding pages
        s = other.allocate()
        other.extend(s, random.randint(1, 500))
        held.append(s)
    engine = LLMEngine(model, tok, kv_budget_bytes=capacity, shared_budget=budget_name, max_model_len=256)
    try:
        engine.add_request([5, 6, 7, 8] * 10, SamplingParams(max_tokens=4, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        with ServerThread(engine, model_name="tiny") as srv:
            text = httpx.get(srv.url + "/metrics", timeout=TIMEOUT).text
            st = srv.app.state.engine_loop.call(engine.stats).result(TIMEOUT)
        m = parse_metrics(text)
        label = f'{{budget="{budget_name}"}}'
        assert m[f'vpaged_shared_budget_info{{budget="{budget_name}",share_policy="{budget.policy.name}"}}'] == 1.0
        ledger = budget.state()
        mine = next(r for r in ledger.members if r.index == st.shared_budget.member_index)
        assert m[f"vpaged_shared_budget_capacity_bytes{label}"] == capacity
        assert m[f"vpaged_shared_budget_members{label}"] == 2
        assert m[f"vpaged_shared_budget_granted_bytes{label}"] == ledger.granted_bytes
        assert m[f"vpaged_shared_budget_member_granted_bytes{label}"] == mine.granted_bytes
        assert m[f"vpaged_shared_budget_member_min_bytes{label}"] == 0 == mine.min_bytes
        assert m[f"vpaged_shared_budget_reserved_bytes{label}"] == ledger.reserved_bytes
        assert ledger.reserved_bytes >= mine.granted_bytes + min_bytes
        assert m[f"vpaged_shared_budget_member_ceiling_bytes{label}"] == mine.ceiling_bytes == capacity
        assert m[f"vpaged_shared_budget_member_fair_share_bytes{label}"] == mine.fair_share_bytes
        # Counted now by the engine's pool: what the engine's own figures say (idle: the same at both reads).
        pool = engine.store.cache.pool.stats()
        assert m[f"vpaged_shared_budget_member_mapped_bytes{label}"] == pool.used_pages * PAGE == st.kv_mapped_bytes
        assert m[f"vpaged_shared_budget_member_dormant_bytes{label}"] == st.kv_dormant_pages * PAGE
        assert m[f"vpaged_shared_budget_member_live_bytes{label}"] == (pool.used_pages - st.kv_dormant_pages) * PAGE
        assert m[f"vpaged_shared_budget_member_starved{label}"] == 0
        # The other member's pages count in the budget's total.
        assert ledger.granted_bytes >= mine.granted_bytes + other.pool.stats().used_pages * PAGE
    finally:
        engine.close()
        other.close()
        budget.close()


def test_metrics_without_a_budget_have_no_budget_figures(model_and_tok):
    model, tok = model_and_tok
    engine = LLMEngine(model, tok, kv_budget_bytes=4 << 20, max_model_len=256)
    try:
        with ServerThread(engine, model_name="tiny") as srv:
            text = httpx.get(srv.url + "/metrics", timeout=TIMEOUT).text
        assert "vpaged_engine_up 1.0" in text and "vpaged_shared_budget" not in text
        assert engine.stats().shared_budget is None
    finally:
        engine.close()
