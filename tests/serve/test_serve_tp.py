"""Tensor-parallel serving on the CPU: two gloo ranks spawned by the engine (vpaged.serve.distributed).

Every request's greedy tokens equal the one-process engine's (staggered arrivals, chunked prefill, a KV budget
tight enough to preempt); each rank's store holds half the K/V bytes and stays in step with rank 0's (prefix
hits and n > 1 sharing on every rank); a rank killed mid-run ends the run with an error naming it; bad
configurations are refused before any process starts. Each rank's budget is half the one-process budget, so
that both hold the same tokens.
"""

from __future__ import annotations

import dataclasses
import os
import time

import pytest
import torch

from vpaged.errors import InvalidArgumentError, TensorParallelError
from vpaged.serve import LLMEngine, SamplingParams

pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")

MODEL = "random:llama-tiny"
PAGE = 4096  # llama-tiny: 128 bytes per token per layer -> 32 tokens a page in one process, 64 on a rank of two
GREEDY = dict(temperature=0.0, ignore_eos=True)


def _prompts(count: int, shared: int = 40) -> list[list[int]]:
    system = [3 + (7 * j) % 400 for j in range(shared)]
    return [system + [5 + (11 * i + 3 * j) % 500 for j in range(20 + 17 * (i % 5))] for i in range(count)]


def _drive(engine: LLMEngine, prompts, params, every: int = 2, abort: dict | None = None) -> dict:
    """Requests arrive one every `every` steps; returns each request's completions' tokens by request id
    (an aborted one: "abort"). abort: {step: request id} aborted before that step."""
    ids, done, step = [], {}, 0
    while len(done) < len(prompts):
        if abort and step in abort and abort[step] not in done:
            engine.abort(abort[step])
        if len(ids) < len(prompts) and step % every == 0:
            ids.append(engine.add_request(prompts[len(ids)], params[len(ids)], request_id=f"r{len(ids)}"))
        for out in engine.step():
            if out.finished:
                aborted = out.finish_reason == "abort"
                done[out.request_id] = "abort" if aborted else [list(c.token_ids) for c in out.outputs]
        step += 1
    return done


def _engine(tp: int, **options) -> LLMEngine:
    options.setdefault("cpu_prepack", False)
    if tp > 1:
        for key in ("kv_budget_bytes", "swap_bytes"):
            if options.get(key):
                options[key] //= tp
    return LLMEngine(MODEL, tensor_parallel_size=tp, page_size=PAGE, **options)


def test_tensor_parallel_matches_one_process_under_preemption():
    # 16 requests sharing a 140-token system prompt (two full pages on a rank), one of them n=2; chunks of 48
    # tokens; 96 pages of 4 KiB in one process (48 on each rank: the same tokens), a few sequences' worth, and
    # swap space for about one: so that sequences are swapped out and recomputed.
    prompts = _prompts(16, shared=140)
    params = [SamplingParams(max_tokens=24, n=2 if i == 5 else 1, **GREEDY) for i in range(16)]
    options = dict(kv_budget_bytes=96 * PAGE, swap_bytes=32 * PAGE, max_num_batched_tokens=48, max_num_seqs=8)
    abort = {12: "r3"}  # request r3 is aborted mid-run (its pages go back on every rank)
    one = _engine(1, **options)
    expected = _drive(one, prompts, params, abort=abort)
    one_stats = one.stats()
    one.close()
    two = _engine(2, **options)
    try:
        got = _drive(two, prompts, params, abort=abort)
        stats = two.stats()
    finally:
        two.close()
    assert got == expected and got["r3"] == "abort"
    assert stats.running == stats.waiting == stats.swapped == 0 and stats.ranks[1].live_tokens == 0
    assert stats.preemptions_swap + stats.preemptions_recompute > 0, "the budget must be tight enough to preempt"
    assert one_stats.preemptions_swap + one_stats.preemptions_recompute > 0
    assert stats.tensor_parallel_size == 2 and len(stats.ranks) == 2
    rank0, rank1 = stats.ranks
    assert rank0 == rank1, "every rank's store is in step with rank 0's"
    assert rank1.prefix_hit_tokens > 0, "prefix hits on every rank"
    assert stats.kv_high_water_bytes == rank0.high_water_bytes + rank1.high_water_bytes
    assert stats.kv_budget_bytes == one_stats.kv_budget_bytes
    assert stats.prefix_hit_tokens > 0


def _check_half(single: LLMEngine, sharded: LLMEngine, page_bytes: int, runs: int) -> bool:
    """Whether the pages mapped could be compared (no freed slot keeps pages for reuse yet); asserts that each
    rank maps half the one-process bytes within one page per sequence and run: a rank's page holds twice the
    tokens of a one-process page, and each of a sequence's runs rounds up to its own page size."""
    s, t = single.stats(), sharded.stats()
    if s.kv_dormant_pages or any(r.dormant_pages for r in t.ranks):
        return False
    live = len(single.scheduler.running) + len(single.scheduler.swapped)
    for rank in t.ranks:
        assert abs(2 * rank.held_bytes - s.kv_mapped_bytes) <= 2 * page_bytes * runs * live, (rank, s)
    return live > 0


def test_each_rank_holds_half_the_kv_bytes_and_shares_forks():
    # Both engines in lockstep on a roomy budget: the same plan every step, so their memory can be compared at
    # each one. kv="paged": blocks count tokens, so a rank holds exactly half; kv="vpaged": within a page per
    # sequence and run. An n=3 request shares its prompt's pages on every rank.
    prompts = _prompts(6, shared=0)
    params = [SamplingParams(max_tokens=16, n=3 if i == 1 else 1, **GREEDY) for i in range(6)]
    options = dict(kv_budget_bytes=256 * PAGE * 2, max_num_batched_tokens=64, max_num_seqs=8, kv="paged")
    one, two = _engine(1, **options), _engine(2, **options)
    try:
        ids = {}
        for step in range(200):
            if step % 2 == 0 and step // 2 < len(prompts):
                i = step // 2
                for e in (one, two):
                    ids[e, i] = e.add_request(prompts[i], params[i], request_id=f"r{i}")
            outs = [{o.request_id: o.token_ids for o in e.step()} for e in (one, two)]
            assert outs[0] == outs[1]
            s, t = one.stats(), two.stats()
            assert all(2 * r.held_bytes == s.kv_mapped_bytes for r in t.ranks), (s, t.ranks)
            if not (one.has_unfinished() or two.has_unfinished()):
                break
    finally:
        one.close()
        two.close()


def test_vpaged_ranks_halve_bytes_share_forks_and_a_killed_rank_ends_the_run():
    prompts = _prompts(6, shared=0)
    params = [SamplingParams(max_tokens=16, n=3 if i == 1 else 1, **GREEDY) for i in range(6)]
    options = dict(
        kv_budget_bytes=256 * PAGE * 2, max_num_batched_tokens=64, max_num_seqs=8, enable_prefix_caching=False
    )
    one, two = _engine(1, **options), _engine(2, **options)
    runs = 2 * one.model.config.num_hidden_layers  # per_layer layout: K and V of each layer
    shared, compared = [], 0
    try:
        for step in range(200):
            if step % 2 == 0 and step // 2 < len(prompts):
                i = step // 2
                for e in (one, two):
                    e.add_request(prompts[i], params[i], request_id=f"r{i}")
            outs = [{o.request_id: o.token_ids for o in e.step()} for e in (one, two)]
            assert outs[0] == outs[1]
            compared += _check_half(one, two, PAGE, runs)
            shared.append(all(r.shared_pages > 0 for r in two.stats().ranks))
            if not (one.has_unfinished() or two.has_unfinished()):
                break
        assert any(shared), "the n=3 completions share their prompt's pages on every rank"
        assert compared >= 5
        # Kill rank 1 in the middle of a run: the next steps raise, naming the rank, well within 30 s.
        for i, p in enumerate(prompts):
            two.add_request(p, SamplingParams(max_tokens=200, **GREEDY), request_id=f"k{i}")
        for _ in range(3):
            two.step()
        two.tp.group.processes[1].kill()
        t0 = time.monotonic()
        with pytest.raises(TensorParallelError, match="rank 1") as err:
            while time.monotonic() - t0 < 60:
                two.step()
        assert time.monotonic() - t0 < 30, f"the error took {time.monotonic() - t0:.1f} s"
        assert "SIGKILL" in str(err.value) or "rank 1 failed" in str(err.value)
        with pytest.raises(TensorParallelError):
            two.step()
    finally:
        one.close()
        t0 = time.monotonic()
        two.close()
        assert time.monotonic() - t0 < 15, "closing a broken engine does not wait for the dead rank"


def test_bad_configurations_are_refused_before_any_rank_starts(tmp_path, monkeypatch):
    from transformers import AutoConfig

    from vpaged.serve import load_model

    with pytest.raises(InvalidArgumentError, match="must divide the model's KV heads"):
        LLMEngine(MODEL, kv_budget_bytes=1 << 20, tensor_parallel_size=4)
    with pytest.raises(InvalidArgumentError, match="must divide"):
        LLMEngine(MODEL, kv_budget_bytes=1 << 20, tensor_parallel_size=3)
    model, _ = load_model(MODEL)
    with pytest.raises(InvalidArgumentError, match="cannot be sharded"):
        LLMEngine(model, kv_budget_bytes=1 << 20, tensor_parallel_size=2)
    AutoConfig.for_model("gpt2", n_embd=64, n_head=4, n_layer=2).save_pretrained(tmp_path)
    with pytest.raises(InvalidArgumentError, match="no tensor-parallel plan"):
        LLMEngine(str(tmp_path), kv_budget_bytes=1 << 20, tensor_parallel_size=2)
    with pytest.raises(InvalidArgumentError, match="tensor_parallel_size"):
        LLMEngine(MODEL, kv_budget_bytes=1 << 20, tensor_parallel_size=0)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(InvalidArgumentError, match="WORLD_SIZE=4"):
        LLMEngine(MODEL, kv_budget_bytes=1 << 20, tensor_parallel_size=2)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_PORT", "0")
    with pytest.raises(InvalidArgumentError, match="MASTER_PORT=0"):
        LLMEngine(MODEL, kv_budget_bytes=1 << 20, tensor_parallel_size=2)
    assert not torch.distributed.is_initialized()


def test_one_process_config_is_unchanged():
    from vpaged.serve import EngineConfig

    config = EngineConfig(kv_budget_bytes=1 << 20)
    assert config.parallel.tensor_parallel_size == 1
    assert dataclasses.replace(config, tensor_parallel_size=2).parallel.tensor_parallel_size == 2


class _FailsOnRank1(LLMEngine):
    """An engine whose rank 1 raises in its third step (its worker loop's run_step patched in that process)."""

    def __init__(self, *args, **kwargs):
        if os.environ.get("RANK") == "1":
            from vpaged.serve.distributed import worker

            real, calls = worker.run_step, []

            def run_step(engine, replica, step):
                calls.append(1)
                if len(calls) == 3:
                    raise RuntimeError("injected failure on rank 1")
                return real(engine, replica, step)

            worker.run_step = run_step
        super().__init__(*args, **kwargs)


class _FailsToStartOnRank1(LLMEngine):
    def __init__(self, *args, **kwargs):
        if os.environ.get("RANK") == "1":
            raise ValueError("rank 1 cannot start")
        super().__init__(*args, **kwargs)


def test_a_rank_that_raises_is_named_with_its_cause(monkeypatch):
    # Collectives time out after 4 s here: an engine left idle for longer still works (rank 0 pings the others).
    monkeypatch.setenv("VPAGED_TP_TIMEOUT_S", "4")
    engine = _FailsOnRank1(MODEL, kv_budget_bytes=1 << 20, page_size=PAGE, tensor_parallel_size=2, cpu_prepack=False)
    try:
        time.sleep(6)
        engine.add_request(list(range(5, 40)), SamplingParams(max_tokens=20, **GREEDY))
        t0 = time.monotonic()
        with pytest.raises(TensorParallelError, match="rank 1 failed: RuntimeError: injected failure on rank 1"):
            for _ in range(20):
                engine.step()
        assert time.monotonic() - t0 < 30
    finally:
        engine.close()
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError, match="rank 1 failed while starting: ValueError: rank 1 cannot start"):
        _FailsToStartOnRank1(MODEL, kv_budget_bytes=1 << 20, tensor_parallel_size=2)
    assert time.monotonic() - t0 < 60
    assert not torch.distributed.is_initialized()
