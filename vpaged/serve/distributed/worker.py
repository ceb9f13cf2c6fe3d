"""The loop of every rank but 0: receive rank 0's message, bring the store in step, run the same forward.

A rank other than 0 holds an engine like rank 0's (its shard of the model, its store of its own KV heads,
a ModelRunner) but never schedules or samples. run_worker(engine) is its loop: it applies each message's
store operations (mirror.py) and handles the message by its type (messages.py: a Step runs the forward with
the packed inputs rank 0 sent, discarding the logits), bumping this rank's heartbeat meanwhile (group.py),
and returns when rank 0 sends Stop. `spawned` is the entry point of a rank that rank 0 started with
torch.multiprocessing; under torchrun the script (or `vpaged serve`) calls run_worker itself.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ...errors import InvalidArgumentError
from .group import Group, report
from .messages import MemoryRequest, Ping, Step, Stop
from .mirror import Replica


@dataclass
class _Row:
    """What a store's step_attention reads of a sequence: its handle, slot and tokens computed."""

    handle: int
    slot: int
    num_computed: int


def run_step(engine, replica: Replica, step: Step) -> None:
    store = replica.store
    rows = []
    for handle, computed in step.decodes:
        mine = replica.local(handle)
        rows.append(_Row(mine, store.slot(mine), computed))
    chunks, offsets, row = [], [], len(rows)
    for handle, start, n in step.prefills:
        mine = replica.local(handle)
        chunks.append((_Row(mine, store.slot(mine), start), start, n))
        offsets.append(row)
        row += n
    attention = store.step_attention(rows, chunks, offsets, row)
    dev = engine.runner.device
    inputs = dict(
        input_ids=torch.tensor([step.input_ids], device=dev),
        position_ids=torch.tensor([step.position_ids], device=dev),
        logits_to_keep=torch.tensor(step.logits_to_keep, dtype=torch.long, device=dev),
    )
    engine.runner.forward(inputs, attention)


def _on_step(engine, group: Group, replica: Replica, message: Step) -> bool:
    run_step(engine, replica, message)  # looked up at each call: a test may replace it in its rank
    return True


def _on_memory(engine, group: Group, replica: Replica, message: MemoryRequest) -> bool:
    group.reply(engine.store.memory())
    return True


def _on_ping(engine, group: Group, replica: Replica, message: Ping) -> bool:
    return True


def _on_stop(engine, group: Group, replica: Replica, message: Stop) -> bool:
    return False


# What a rank does with each message after applying its store operations; False: leave the loop.
HANDLERS = {Step: _on_step, MemoryRequest: _on_memory, Ping: _on_ping, Stop: _on_stop}


def follow(engine, group: Group) -> None:
    """Serve rank 0 until it sends Stop (or the group fails: that raises)."""
    replica = Replica(engine.store, group.rank)
    group.start_heartbeat()
    going = True
    while going:
        message = group.receive()
        handler = HANDLERS.get(type(message))
        if handler is None:
            raise InvalidArgumentError(f"rank {group.rank} got an unknown control message: {type(message).__name__}")
        replica.apply(getattr(message, "ops", ()))
        going = handler(engine, group, replica, message)


def run_worker(engine) -> None:
    """Ranks > 0 of a tensor-parallel engine: serve rank 0 until its engine closes, then close this one and
    return. A failure is written where rank 0 reads it (naming this rank and the cause), then raised.

        engine = LLMEngine(model, tensor_parallel_size=N, ...)   # on every rank (e.g. under torchrun)
        if engine.rank != 0:
            run_worker(engine)   # returns when rank 0 closes
    """
    tp = getattr(engine, "tp", None)
    if tp is None or tp.rank == 0:
        raise InvalidArgumentError("run_worker(engine) is for the ranks > 0 of a tensor-parallel engine")
    try:
        follow(engine, tp.group)
    except BaseException as e:
        report(tp.group.store, tp.rank, e)
        raise
    finally:
        engine.close()


def spawned(rank: int, size: int, port: int, spec: str, config, timeout_s: float, threads: int, engine_class):
    """A rank that rank 0 spawned: the rendezvous variables torchrun would set, then an engine of
    engine_class (LLMEngine or the caller's subclass of it: every rank runs the same class) and its worker
    loop; the process ends when rank 0 stops."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(size),
        LOCAL_WORLD_SIZE=str(size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        VPAGED_TP_TIMEOUT_S=str(timeout_s),
    )
    torch.set_num_threads(threads)
    try:
        engine = engine_class(spec, config=config)
    except BaseException as e:
        import datetime

        import torch.distributed as dist

        # The failure happened before (or while) this rank joined: report it through a client of the store.
        try:
            store = dist.TCPStore("127.0.0.1", port, size, False, timeout=datetime.timedelta(seconds=10))
        except Exception:  # noqa: BLE001 - rank 0 is gone: nobody to tell
            raise e from None
        report(store, rank, e)
        raise
    run_worker(engine)
