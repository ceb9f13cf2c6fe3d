"""TensorParallel: what an LLMEngine of tensor_parallel_size > 1 holds, and the few places it calls it.

engine.__init__   TensorParallel.start(model, config, type(engine)) -> check, spawn or join the ranks (a
                  spawned rank builds the same engine class, then runs run_worker);
                  load_model(tp.model_path, ..., tensor_parallel_size=N) -> this rank's shard;
                  tp.mirror(store), tp.runner(...)  -> rank 0 records and broadcasts, the others replay.
                  The constructor returns on every rank; ranks > 0 then call run_worker(engine) (worker.py).
engine.step       a failed forward -> tp.failed(e): the TensorParallelError naming the rank and cause.
engine.broken     tp.broken: the group's error once it broke, even while the engine was idle (keepalive).
engine.stats      tp.memories(own) -> every rank's StoreMemory (summed by sum_memory).
engine.close      tp.close()       -> the stop message, the spawned processes joined, groups left.
"""

from __future__ import annotations

import atexit
import dataclasses
import shutil

from ..runner import ModelRunner
from ..stores.base import StoreMemory
from .launch import Launch, start
from .messages import MemoryRequest, Stop
from .mirror import RecordingStore
from .runner import TensorParallelRunner

# StoreMemory fields that are per token (the same on every rank: each holds every sequence's tokens) rather
# than per byte or page (each rank holds its own heads: they add up).
_SAME_ON_EVERY_RANK = ("live_tokens", "prefix_hit_tokens")


def sum_memory(ranks: list[StoreMemory]) -> StoreMemory:
    """The memory of all ranks together: bytes and pages summed, token counts those of rank 0."""
    values = {}
    for f in dataclasses.fields(StoreMemory):
        if f.name in _SAME_ON_EVERY_RANK:
            values[f.name] = getattr(ranks[0], f.name)
        else:
            values[f.name] = sum(getattr(m, f.name) for m in ranks)
    return StoreMemory(**values)


class TensorParallel:
    def __init__(self, launch: Launch):
        self.group = launch.group
        self.model_path = launch.model_path
        self.config = launch.config
        self._temp_dir = launch.temp_dir
        self._store: RecordingStore | None = None
        if self.rank == 0:
            atexit.register(self.close)

    @classmethod
    def start(cls, model, config, engine_class) -> TensorParallel:
        return cls(start(model, config, engine_class))

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def size(self) -> int:
        return self.group.size

    def mirror(self, store):
        """Rank 0: the store wrapped to record its changes; other ranks: the store itself."""
        if self.rank != 0:
            return store
        self._store = RecordingStore(store)
        return self._store

    def runner(self, model, store, config) -> ModelRunner:
        """The rank's runner; built last, once this rank has its model and store: rank 0 starts its pings."""
        if self.rank != 0:
            return ModelRunner(model, store, config)
        self.group.start_keepalive()
        return TensorParallelRunner(model, store, config, self.group)

    def memories(self, own: StoreMemory) -> list[StoreMemory]:
        """Every rank's store memory, rank 0's (`own`) first."""
        return self.group.gather(MemoryRequest(self._store.take()), own)

    def failed(self, exc: BaseException):
        """The TensorParallelError of a failed step (the group is broken from then on)."""
        return self.group.failure(exc)

    @property
    def broken(self):
        """The group's TensorParallelError once it broke (found by a step or by rank 0's keepalive), else None."""
        return self.group.broken

    def close(self) -> None:
        if self.group.closed:
            return
        ops = self._store.take() if self._store is not None else ()
        self.group.close(Stop(ops))
        if self._temp_dir is not None:
            shutil.rmtree(self._temp_dir, ignore_errors=True)
        atexit.unregister(self.close)
