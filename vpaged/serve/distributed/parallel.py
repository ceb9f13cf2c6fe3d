"""TensorParallel: what an LLMEngine of tensor_parallel_size > 1 holds, and the few places it calls it.

engine.__init__   TensorParallel.start(model, config, LLMEngine) -> check, spawn or join the ranks;
                  load_model(tp.model_path, ..., tensor_parallel_size=N) -> this rank's shard;
                  tp.mirror(store), tp.runner(...)  -> rank 0 records and broadcasts, the others replay;
                  tp.follow(engine) on ranks > 0    -> the worker loop, then the process exits.
engine.step       a failed forward -> tp.failed(e): the TensorParallelError naming the rank and cause.
engine.stats      tp.memories(own) -> every rank's StoreMemory (summed by sum_memory).
engine.close      tp.close()       -> the stop message, the spawned processes joined, groups left.
"""

from __future__ import annotations

import atexit
import dataclasses
import shutil

from ..runner import ModelRunner
from ..stores.base import StoreMemory
from .group import Message, report
from .launch import Launch, start
from .mirror import RecordingStore
from .runner import TensorParallelRunner
from .worker import follow

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
        return self.group.gather(Message("memory", self._store.take()), own)

    def failed(self, exc: BaseException):
        """The TensorParallelError of a failed step (the group is broken from then on)."""
        return self.group.failure(exc)

    def follow(self, engine) -> None:
        """Ranks > 0: serve rank 0 until it stops, then end this process (status 0; a failure raises, after
        writing its cause where rank 0 reads it)."""
        try:
            follow(engine, self.group)
        except BaseException as e:
            report(self.group.store, self.rank, e)
            raise
        finally:
            engine.store.close()
            self.close()
        raise SystemExit(0)

    def close(self) -> None:
        if self.group.closed:
            return
        ops = self._store.take() if self._store is not None else []
        self.group.close(Message("stop", ops))
        if self._temp_dir is not None:
            shutil.rmtree(self._temp_dir, ignore_errors=True)
        atexit.unregister(self.close)
