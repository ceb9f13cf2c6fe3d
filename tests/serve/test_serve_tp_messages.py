"""The tensor-parallel seam, in one process: every store method that changes a store has an operation record
(a test that fails when a new mutating method is not mirrored), records replayed on a second store leave it
equal to the first under random operations, messages are frozen records dispatched by type, the engine's
constructor returns on every rank (run_worker), and NCCL's device is current and bound before the process
group exists (#36 item 6, checked by the order of the calls on a fake torch.distributed)."""

from __future__ import annotations

import dataclasses
import pickle
import random
from typing import Protocol

import pytest
import torch

from vpaged.errors import InvalidArgumentError, VPagedError
from vpaged.kvcache.geometry import KVGeometry
from vpaged.serve.config import EngineConfig
from vpaged.serve.distributed import messages, mirror, worker
from vpaged.serve.distributed.mirror import NOT_MIRRORED, OPERATIONS, RecordingStore, Replica, mirror_gaps
from vpaged.serve.stores import make_store
from vpaged.serve.stores.base import KVSTORE_METHODS, KVSTORE_MUTATING, KVStore, mutates

PAGE = 4096


def test_every_mutating_store_method_is_mirrored_and_every_other_says_why_not():
    assert mirror_gaps() == []
    assert set(OPERATIONS) == set(KVSTORE_MUTATING)
    assert set(OPERATIONS) | set(NOT_MIRRORED) == set(KVSTORE_METHODS)
    assert not set(OPERATIONS) & set(NOT_MIRRORED)
    # the mutating set comes from the protocol's marks, not from this test's list
    assert {"allocate", "extend", "free", "swap_out"} <= set(KVSTORE_MUTATING)
    assert not {"pages_needed", "can_allocate", "memory", "step_attention"} & set(KVSTORE_MUTATING)
    assert set(Replica.HANDLERS) == set(OPERATIONS.values())


def test_a_new_store_method_that_is_not_mirrored_is_caught():
    class Defragmenting(KVStore, Protocol):
        @mutates
        def defragment(self) -> None:
            """Moves pages: changes the store."""

        def fragmentation(self) -> float:
            """A read nobody classified."""

    gaps = mirror_gaps(Defragmenting)
    assert any(g.startswith("defragment: changes the store") for g in gaps), gaps
    assert any(g.startswith("fragmentation: neither mirrored") for g in gaps), gaps
    assert len(gaps) == 2

    class Unmarked(Protocol):  # a protocol whose free() lost its mark, and without the other mirrored methods
        def free(self, handle: int) -> None: ...

    gaps = mirror_gaps(Unmarked)
    assert "free: mirrored, but KVStore does not mark it @mutates" in gaps
    assert any(g.startswith("allocate: in mirror.OPERATIONS but not a Unmarked method") for g in gaps)


def test_messages_and_operations_are_frozen_records_that_pickle_by_value():
    ops = (mirror.Allocate((1, 2, 3), 2, 7, 0), mirror.Extend((7,), 3), mirror.Fork(7, 2, 3, (8, 9)))
    step = messages.Step(ops, ((7, 3),), ((8, 0, 3),), (4, 5, 6), (0, 1, 2), (2,))
    for record in (*ops, step, messages.Ping(), messages.Stop(ops), messages.MemoryRequest()):
        assert pickle.loads(pickle.dumps(record)) == record
        assert dataclasses.is_dataclass(record) and type(record).__dataclass_params__.frozen
    with pytest.raises(dataclasses.FrozenInstanceError):
        step.input_ids = ()
    assert set(worker.HANDLERS) == set(messages.MESSAGE_TYPES)


def _store(kind: str):
    # static reserves 32 pages (256 tokens) a seat at admission: room for a few seats, forks included
    config = EngineConfig(
        kv_budget_bytes=(160 if kind == "static" else 48) * PAGE,
        page_size=PAGE,
        swap_bytes=16 * PAGE if kind == "vpaged" else 0,
        kv=kind,
    )
    return make_store(config, KVGeometry(2, 2, 16, torch.float32), 256)


def _random_calls(rng: random.Random, store, live: dict, swapped: set, seats: dict) -> None:
    """One random store call the way the scheduler makes them (planning call first). live: handle -> length;
    seats: handle -> the completions it was admitted for and has not forked into yet."""
    ready = [h for h in live if h not in swapped]
    choice = rng.choice(["allocate", "allocate", "extend", "extend", "truncate", "fork", "free", "free", "swap"])
    want = rng.choice([1, 1, 2, 3])
    if choice == "allocate" and store.can_allocate(want):
        prefix = [[3, 1, 4, 1, 5, 9, 2, 6] * 8, [2, 7, 1, 8] * 16][rng.randrange(2)]
        tokens = prefix[: rng.randrange(1, 65)] + [rng.randrange(500) for _ in range(rng.randrange(0, 40))]
        if store.pages_available(store.pages_for_request(len(tokens), want)):
            allocation = store.allocate(tokens, want)
            h = allocation.handle
            live[h] = allocation.cached_tokens
            seats[h] = want
            if store.pages_available(store.pages_needed([h], len(tokens) - live[h])):
                store.extend([h], len(tokens) - allocation.cached_tokens)
                live[h] = len(tokens)
                store.cache_prefix(h, tokens)
    elif choice == "extend" and ready:
        handles = rng.sample(ready, rng.randint(1, len(ready)))
        n = rng.randint(1, 16)
        if all(live[h] + n <= 256 for h in handles) and store.pages_available(store.pages_needed(handles, n)):
            store.extend(handles, n)
            for h in handles:
                live[h] += n
    elif choice == "truncate" and ready:
        h = rng.choice(ready)
        live[h] = rng.randint(0, live[h])
        store.truncate(h, live[h])
    elif choice == "fork" and [h for h in ready if seats.get(h, 1) > 1]:
        h = rng.choice([h for h in ready if seats.get(h, 1) > 1])
        for child in store.fork(h, seats.pop(h) - 1, live[h]):
            live[child] = live[h]
    elif choice == "free" and live:
        h = rng.choice(list(live))
        store.free(h)
        del live[h]
        swapped.discard(h)
        seats.pop(h, None)
    elif choice == "swap" and live:
        h = rng.choice(list(live))
        if h in swapped:
            store.swap_in(h)
            swapped.discard(h)
        elif store.can_swap_out(h) and seats.get(h, 1) == 1:
            store.swap_out(h)
            swapped.add(h)


@pytest.mark.parametrize("kind", ["vpaged", "paged", "static"])
def test_recorded_operations_replayed_on_another_store_keep_it_equal(kind):
    seed = random.randrange(1 << 32)
    rng = random.Random(seed)
    first, second = _store(kind), _store(kind)
    recording, replica = RecordingStore(first), Replica(second, rank=1)
    live: dict[int, int] = {}
    swapped: set[int] = set()
    seats: dict[int, int] = {}
    kinds_seen = set()
    wanted = {mirror.Allocate, mirror.Extend, mirror.Free, mirror.Fork}
    if kind == "vpaged":
        wanted |= {mirror.SwapOut, mirror.SwapIn}
    try:
        # 200 random steps, and more (up to 1,000) until every kind of operation was recorded: a seed whose forks
        # were all refused (out of pages) would check nothing about forks.
        for step in range(1000):
            if step >= 200 and wanted <= kinds_seen:
                break
            try:
                _random_calls(rng, recording, live, swapped, seats)
            except VPagedError:  # refused (e.g. out of pages for a copy-on-write): nothing changed, nothing logged
                pass
            ops = recording.take()
            kinds_seen |= {type(op) for op in ops}
            replica.apply(pickle.loads(pickle.dumps(ops)))  # as the control message carries them
            assert first.memory() == second.memory(), f"seed {seed}, step {step}, ops {ops}"
            assert set(replica.handles) == set(live)
            for h in live:
                assert first.slot(h) == second.slot(replica.local(h)), f"seed {seed}"
        assert wanted <= kinds_seen, f"seed {seed}: {kinds_seen}"
        if kind == "vpaged":
            assert first.memory().prefix_hit_tokens > 0
    finally:
        first.close()
        second.close()


def test_recording_store_reaches_only_the_protocol():
    store = _store("vpaged")
    try:
        recording = RecordingStore(store)
        assert recording.page_bytes == store.page_bytes and recording.total_pages() == store.total_pages()
        with pytest.raises(AttributeError, match="not a KVStore member"):
            recording.cache  # noqa: B018 - the wrapped store's own attribute, outside the protocol
    finally:
        store.close()


def test_one_process_engine_is_rank_0_and_refuses_run_worker():
    from vpaged.serve import LLMEngine
    from vpaged.serve.distributed import run_worker

    engine = LLMEngine("random:llama-tiny", kv_budget_bytes=1 << 20, page_size=PAGE, cpu_prepack=False)
    try:
        assert engine.rank == 0 and engine.broken is None
        with pytest.raises(InvalidArgumentError, match="ranks > 0"):
            run_worker(engine)
    finally:
        engine.close()


def test_nccl_device_is_current_and_bound_before_the_process_group(monkeypatch):
    """torchrun's rank 1 of 2 on CUDA: set_device(cuda:LOCAL_RANK) comes before init_process_group("nccl",
    device_id=cuda:LOCAL_RANK). torch.distributed and torch.cuda are fakes that log the calls."""
    import torch.distributed as dist

    from vpaged.serve import LLMEngine
    from vpaged.serve.distributed import launch

    calls = []
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setattr(launch, "check_tensor_parallel", lambda *a: None)
    monkeypatch.setattr(launch, "materialize", lambda spec, dtype: (spec, None))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", torch.device(device))))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "rendezvous", lambda *a, **k: iter([(dist.HashStore(), 1, 2)]))
    monkeypatch.setattr(
        dist, "init_process_group", lambda backend, **k: calls.append(("init", backend, k.get("device_id")))
    )
    monkeypatch.setattr(dist, "new_group", lambda **k: calls.append(("new_group", k["backend"])))
    config = EngineConfig(kv_budget_bytes=1 << 20, tensor_parallel_size=2, device="cuda")
    started = launch.start("/a/model", config, LLMEngine)
    cuda1 = torch.device("cuda", 1)
    assert calls == [("set_device", cuda1), ("init", "nccl", cuda1), ("new_group", "gloo")]
    assert started.config.model.device == cuda1 and started.group.rank == 1
    # on the CPU: gloo, no device bound
    calls.clear()
    started = launch.start("/a/model", dataclasses.replace(config, device="cpu"), LLMEngine)
    assert calls == [("init", "gloo", None), ("new_group", "gloo")]
