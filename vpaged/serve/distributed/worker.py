"""The loop of every rank but 0: receive rank 0's message, bring the store in step, run the same forward.

A rank other than 0 holds an engine like rank 0's (its shard of the model, its store of its own KV heads,
a ModelRunner) but never schedules or samples: follow() applies each message's cache operations (mirror.py)
and runs the step's forward with the packed inputs rank 0 sent, discarding the logits. It returns when rank 0
sends "stop". `spawned` is the entry point of a rank that rank 0 started with torch.multiprocessing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .group import Group, report
from .mirror import Replica


@dataclass
class _Row:
    """What a store's step_attention reads of a sequence: its handle, slot and tokens computed."""

    handle: int
    slot: int
    num_computed: int


def run_step(engine, replica: Replica, step: tuple) -> None:
    decodes, prefills, ids, positions, keep = step
    store = replica.store
    rows = []
    for handle, computed in decodes:
        mine = replica.local(handle)
        rows.append(_Row(mine, store.slot(mine), computed))
    chunks, offsets, row = [], [], len(rows)
    for handle, start, n in prefills:
        mine = replica.local(handle)
        chunks.append((_Row(mine, store.slot(mine), start), start, n))
        offsets.append(row)
        row += n
    attention = store.step_attention(rows, chunks, offsets, row)
    dev = engine.runner.device
    inputs = dict(
        input_ids=torch.tensor([ids], device=dev),
        position_ids=torch.tensor([positions], device=dev),
        logits_to_keep=torch.tensor(keep, dtype=torch.long, device=dev),
    )
    engine.runner.forward(inputs, attention)


def follow(engine, group: Group) -> None:
    """Serve rank 0 until it sends "stop" (or the group fails: that raises)."""
    replica = Replica(engine.store, group.rank)
    while True:
        message = group.receive()
        replica.apply(message.ops)
        if message.kind == "step":
            run_step(engine, replica, message.step)
        elif message.kind == "memory":
            group.reply(engine.store.memory())
        elif message.kind == "stop":
            return


def spawned(rank: int, size: int, port: int, spec: str, config, timeout_s: float, threads: int, engine_class):
    """A rank that rank 0 spawned: the rendezvous variables torchrun would set, then an engine of
    engine_class (LLMEngine), whose constructor follows rank 0 (LLMEngine.__init__ -> TensorParallel.follow)
    and ends this process when rank 0 stops."""
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
        engine_class(spec, config=config)
    except SystemExit:
        raise
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
