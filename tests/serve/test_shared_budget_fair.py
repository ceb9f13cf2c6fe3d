"""The fair-share rule across processes (host backend): an engine that keeps submitting holds the whole shared
budget; when a second engine's burst arrives it is starved, the first stops admitting above its fair share,
and the second's grant reaches its fair share (half the budget) within a bound while the first goes on
submitting. No request of either is lost, and their tokens are what a plain greedy decode gives (data intact).
The first engine is tests/engine_budget_worker.py; the second runs here."""

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from serve_helpers import assert_greedy_matches

from vpaged.memory import SharedBudget

PAGE = 64 * 1024
WORKER = Path(__file__).resolve().parents[1] / "engine_budget_worker.py"
# Generous for a loaded 2-core machine: the first engine's running requests must finish (MAX_TOKENS steps
# each) before their pages can move; on a quiet machine this takes well under a second.
FAIR_WITHIN_S = 30.0
MAX_TOKENS = 16


def granted(budget: SharedBudget, pid: int) -> int:
    return sum(m.granted_bytes for m in budget.state().members if m.pid == pid)


def test_a_starved_engine_gets_its_fair_share_while_the_other_keeps_submitting(budget_name):
    pytest.importorskip("transformers")
    from vpaged.serve import LLMEngine, SamplingParams, load_model

    capacity = 64 * PAGE  # llama-tiny: 4 pages a sequence, so 16 sequences in all, 8 each at a fair share
    budget = SharedBudget.create(budget_name, capacity, share_policy="fair")
    seed = random.randrange(1 << 30)
    env = dict(os.environ, PYTHONPATH=str(WORKER.parent.parent))
    flood = subprocess.Popen(
        [sys.executable, str(WORKER), budget_name, str(seed), str(MAX_TOKENS)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert "ready" in json.loads(flood.stdout.readline())
        model, _ = load_model("random:llama-tiny", dtype=torch.float32)
        engine = LLMEngine(
            model, None, kv_budget_bytes=capacity, shared_budget=budget_name, max_num_seqs=32, cpu_prepack=False
        )
        me = os.getpid()
        deadline = time.monotonic() + 120
        while granted(budget, flood.pid) < capacity - 8 * PAGE:  # the flood takes (nearly) all of it
            assert time.monotonic() < deadline and flood.poll() is None, "the flooding engine never filled the budget"
            time.sleep(0.05)
        rng = random.Random(seed + 1)
        burst = [[rng.randrange(10, 500) for _ in range(rng.randint(40, 200))] for _ in range(16)]
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        for k, p in enumerate(burst):
            engine.add_request(p, params, request_id=f"b{k}")
        start, fair_after, most = time.monotonic(), None, 0
        outputs = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = list(out.outputs[0].token_ids)
            most = max(most, granted(budget, me))
            if fair_after is None and most >= capacity // 2:
                fair_after = time.monotonic() - start
            assert time.monotonic() - start < 10 * FAIR_WITHIN_S, "the burst did not finish"
        assert flood.poll() is None  # the flood kept going all along
        assert fair_after is not None and fair_after <= FAIR_WITHIN_S, (fair_after, most)
        engine.close()
        flood.stdin.write("stop\n")
        flood.stdin.flush()
        report = json.loads(flood.stdout.readline())
        flood.wait(timeout=60)
    finally:
        if flood.poll() is None:
            flood.kill()
        budget.close()
    # No request lost: every one submitted finished, with all its tokens.
    assert sorted(outputs) == sorted(f"b{k}" for k in range(16))
    assert len(report["outputs"]) == report["submitted"] >= 16
    assert all(len(t) == MAX_TOKENS for t in [*outputs.values(), *report["outputs"].values()])
    # Data intact: the tokens equal a greedy decode of the same model (the burst, and a sample of the flood).
    for k, p in enumerate(burst):
        assert_greedy_matches(outputs[f"b{k}"], p, model, MAX_TOKENS)
    for rid in random.Random(seed).sample(sorted(report["outputs"]), 8):
        assert_greedy_matches(report["outputs"][rid], report["prompts"][rid], model, MAX_TOKENS)
