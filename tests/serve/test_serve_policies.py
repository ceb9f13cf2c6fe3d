"""Scheduling policies as strategies (serve/policies.py): the admission queues against a reference order
computed here, the victim choice, a Scheduler over a real store following both, and the options' checks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vpaged.errors import InvalidArgumentError
from vpaged.kvcache.geometry import KVGeometry
from vpaged.serve.config import EngineConfig
from vpaged.serve.outputs import RequestMetrics
from vpaged.serve.policies import (
    FCFSQueue,
    LowestPriorityFirst,
    NewestFirst,
    PriorityQueue,
    admission_queue,
    preemption_policy,
)
from vpaged.serve.sample.params import SamplingParams
from vpaged.serve.scheduler import Scheduler
from vpaged.serve.sequence import Request, Sequence
from vpaged.serve.stores import make_store

GEOM = KVGeometry(1, 2, 16, torch.float32)  # 128 bytes a token and run: 32 tokens a 4 KiB page


def sequence(number: int, priority: int = 0, prompt_len: int = 4, max_tokens: int = 8) -> Sequence:
    # Arrival times tie on purpose (a coarse clock): arrival_index orders them.
    params, metrics = SamplingParams(max_tokens=max_tokens), RequestMetrics(arrival_time=0.0)
    req = Request(f"r{number}", list(range(1, prompt_len + 1)), params, metrics, max_tokens)
    req.priority, req.arrival_index = priority, number
    seq = Sequence(req, 0, list(req.prompt), None)
    req.seqs.append(seq)
    return seq


queue_ops = st.lists(
    st.one_of(
        st.tuples(st.just("push"), st.integers(-2, 2)),
        st.tuples(st.just("pop"), st.just(0)),
        st.tuples(st.just("preempt"), st.just(0)),  # pop the head and put it back as preempted
        st.tuples(st.just("remove"), st.integers(0, 50)),
    ),
    max_size=60,
)


@settings(max_examples=40, deadline=None)
@given(queue_ops)
def test_priority_queue_admits_lowest_value_then_first_come(ops):
    queue, reference, made = PriorityQueue(), [], 0
    for op, arg in ops:
        if op == "push":
            seq = sequence(made, priority=arg)
            made += 1
            queue.push(seq)
            reference.append(seq)
        elif reference and op in ("pop", "preempt"):
            expected = min(reference, key=lambda s: (s.request.priority, s.request.arrival_index))
            assert queue.head() is expected
            assert queue.pop() is expected
            reference.remove(expected)
            if op == "preempt":  # keeps its arrival: back ahead of its priority's later arrivals
                queue.push_preempted(expected)
                reference.append(expected)
        elif reference and op == "remove":
            seq = reference.pop(arg % len(reference))
            queue.remove(seq)
        assert len(queue) == len(reference)
        assert list(queue) == sorted(reference, key=lambda s: (s.request.priority, s.request.arrival_index))


@settings(max_examples=30, deadline=None)
@given(queue_ops)
def test_fcfs_queue_is_arrival_order_with_preempted_at_the_head(ops):
    queue, reference, made = FCFSQueue(), [], 0
    for op, arg in ops:
        if op == "push":
            seq = sequence(made, priority=arg)  # priorities are ignored
            made += 1
            queue.push(seq)
            reference.append(seq)
        elif reference and op in ("pop", "preempt"):
            assert queue.head() is reference[0] and queue.pop() is reference[0]
            seq = reference.pop(0)
            if op == "preempt":
                queue.push_preempted(seq)
                reference.insert(0, seq)
        elif reference and op == "remove":
            queue.remove(reference.pop(arg % len(reference)))
        assert list(queue) == reference


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(-3, 3), min_size=1, max_size=12))
def test_victims(priorities):
    running = [sequence(i, p) for i, p in enumerate(priorities)]  # admission order
    assert NewestFirst().victim(running) is running[-1]
    worst = max(priorities)
    newest_worst = [s for s in running if s.request.priority == worst][-1]
    assert LowestPriorityFirst().victim(running) is newest_worst


def test_policy_defaults_and_names():
    assert isinstance(admission_queue(), FCFSQueue) and isinstance(preemption_policy(), NewestFirst)
    assert isinstance(preemption_policy(None, "priority"), LowestPriorityFirst)
    assert isinstance(preemption_policy("newest", "priority"), NewestFirst)
    with pytest.raises(InvalidArgumentError, match="scheduling_policy must be one of"):
        admission_queue("sjf")
    with pytest.raises(InvalidArgumentError, match="preemption_policy must be one of"):
        preemption_policy("oldest")


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("scheduling_policy", "lifo", "scheduling_policy must be one of"),
        ("preemption_policy", "random", "preemption_policy must be one of"),
        ("eviction_policy", "mru", "eviction_policy must be one of"),
        ("eviction_policy", None, "eviction_policy must be a name"),
        ("reclaim_order", "spare_first", "reclaim_order must be one of"),
    ],
)
def test_engine_config_refuses_unknown_policy_names(field, value, message):
    with pytest.raises(InvalidArgumentError, match=message):
        EngineConfig(kv_budget_bytes=1 << 20, **{field: value})


def scheduler(pages: int, **options) -> Scheduler:
    config = EngineConfig(
        kv_budget_bytes=pages * 4096, page_size=4096, max_num_seqs=8, max_num_batched_tokens=256, **options
    )
    return Scheduler(make_store(config, GEOM, 256), config)


def run_step(sched: Scheduler) -> list[Sequence]:
    """One scheduled step whose forward 'ran': every sampling sequence draws token 7. Returns the admitted."""
    plan = sched.schedule()
    draws = [(seq, [(7, None)]) for seq in plan.decodes]
    draws += [(seq, [(7, None)]) for seq, start, n in plan.prefills if start + n == len(seq.tokens)]
    sched.postprocess(plan, draws, frozenset(), 0.0)
    return [seq for seq, start, _ in plan.prefills if start == 0]


def first_preempted(sched: Scheduler, seqs: list[Sequence]) -> list[Sequence]:
    """Run steps until a sequence is preempted; those preempted in that step."""
    for _ in range(80):
        run_step(sched)
        hit = [s for s in seqs if s.request.metrics.num_preemptions]
        if hit:
            return hit
    raise AssertionError("nothing was preempted")


# Three prompts of one page each (the budget: 3 pages a run); the longest needs a second page first, and one
# victim's page is enough for it.
PROMPTS = [30, 20, 10]


@pytest.mark.parametrize(
    "options, admitted, victim",
    [
        ({}, [0, 1, 2], 2),  # fcfs: arrival order; the newest gives way
        ({"scheduling_policy": "priority"}, [1, 2, 0], 0),  # lowest value first; priority 5 gives way
        ({"scheduling_policy": "priority", "preemption_policy": "newest"}, [1, 2, 0], 0),  # admitted last
        ({"preemption_policy": "lowest_priority"}, [0, 1, 2], 0),
    ],
)
def test_the_scheduler_admits_and_preempts_as_its_policies_say(options, admitted, victim):
    sched = scheduler(pages=6, **options)  # 2 runs (K, V)
    seqs = [sequence(i, priority=p, prompt_len=n, max_tokens=60) for i, (p, n) in enumerate(zip([5, 1, 3], PROMPTS))]
    for seq in seqs:
        sched.add(seq)
    assert [s.request.arrival_index for s in run_step(sched)] == admitted
    assert first_preempted(sched, seqs) == [seqs[victim]]


def test_priority_queue_holds_back_a_low_priority_arrival():
    # One sequence at a time: whatever waits is admitted by priority, not by arrival.
    config = EngineConfig(kv_budget_bytes=64 * 4096, page_size=4096, max_num_seqs=1, scheduling_policy="priority")
    sched = Scheduler(make_store(config, GEOM, 256), config)
    first = sequence(0, priority=0, prompt_len=4, max_tokens=2)
    sched.add(first)
    run_step(sched)
    late = [sequence(1, priority=9), sequence(2, priority=-1), sequence(3, priority=9), sequence(4, priority=2)]
    for seq in late:
        sched.add(seq)
    order = []
    while sched.has_work():
        order += [s.request.arrival_index for s in run_step(sched)]
    assert order == [2, 4, 1, 3]


@pytest.mark.serving
def test_the_engine_serves_by_priority_and_hands_the_cache_its_policies():
    pytest.importorskip("transformers")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model gains nothing from threads on a shared machine
    try:
        engine_serves_by_priority()
    finally:
        torch.set_num_threads(threads)


def engine_serves_by_priority():
    from vpaged.serve import LLM

    llm = LLM(
        "random:llama-tiny",
        kv_budget_bytes=64 * 4096,
        page_size=4096,
        max_num_seqs=1,
        scheduling_policy="priority",
        eviction_policy="lfu",
        reclaim_order="prefix_first",
    )
    cache = llm.engine.store.cache
    assert (cache.eviction_policy.name, cache.reclaim_order.name) == ("lfu", "prefix_first")
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11]]
    outs = llm.generate(prompts, params, priority=[2, 0, 1, 0])
    started = [out.metrics.first_token_time for out in outs]
    # One at a time: lowest value first, first come among equals.
    assert sorted(range(4), key=lambda i: started[i]) == [1, 3, 2, 0]
    assert all(len(out.outputs[0].token_ids) == 3 for out in outs)
    with pytest.raises(InvalidArgumentError, match="priority must be an int"):
        llm.engine.add_request([1, 2], params, priority="high")
    with pytest.raises(InvalidArgumentError, match="2 priorities for 1 prompts"):
        llm.generate([[1, 2]], params, priority=[0, 1])
    assert not llm.engine.has_unfinished()
    llm.engine.close()


def test_pages_gone_between_the_check_and_the_extend_preempt_instead_of_failing(monkeypatch):
    # In a shared budget pages_available counts what the budget would grant, and another process may take it
    # before the extend runs. Here the check always says yes on a pool of 4 pages (2 runs: 2 pages a run): the
    # extends that then find no pages must leave the request waiting or preempt, never raise, and every
    # request still finishes with all its tokens.
    sched = scheduler(pages=4)
    monkeypatch.setattr(sched.store, "pages_available", lambda need: True)
    seqs = [sequence(i, prompt_len=n, max_tokens=24) for i, n in enumerate([30, 20, 10, 25])]
    for seq in seqs:
        sched.add(seq)
    for _ in range(400):
        if not sched.has_work():
            break
        run_step(sched)
    assert not sched.has_work()
    assert all(s.tokens[len(s.request.prompt) :] == [7] * 24 for s in seqs)
    assert sum(s.request.metrics.num_preemptions for s in seqs) > 0
    assert sched.store.cache.pool.stats().used_pages - sched.store.cache.pool.reclaimable_pages() == 0
