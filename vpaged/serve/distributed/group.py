"""Group: the ranks of one tensor-parallel engine on torch.distributed, and rank 0's control channel to them.

Two process groups over the same ranks:

  model    the default group (gloo on CPU, NCCL on CUDA): the all-reduces and all-gathers that
           transformers' tensor-parallel layers run inside the forward.
  control  a gloo group: rank 0 broadcasts one small pickled Message per step (the cache operations the
           scheduler made and the step's packed inputs) and gathers the stores' memory for stats(). It is
           gloo on every device, so that no step plan goes through a CUDA buffer.

Every collective has a timeout (VPAGED_TP_TIMEOUT_S seconds, default 120): a rank that stops answering ends
the others' wait with an error instead of a hang (a checkpoint whose shards take longer to load than that
needs a larger VPAGED_TP_TIMEOUT_S). Once every rank is loaded, an idle rank 0 sends a ping on the control
group every quarter of the timeout, so that the other ranks, waiting for the next step, do not time out
while rank 0 simply has nothing to do. A rank that fails writes its cause into the rendezvous store
(`vpaged/error/<rank>`) before it exits; its exit closes its connections, the other ranks' collectives
fail at once, and rank 0 reads the cause there (or, for a process it spawned, its exit code) to name the
rank and why in a TensorParallelError.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from ...errors import TensorParallelError

TIMEOUT_ENV = "VPAGED_TP_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 120.0
ERROR_KEY = "vpaged/error/{}"
_log = logging.getLogger("vpaged.serve")


def collective_timeout() -> float:
    """Seconds any collective of a tensor-parallel engine may wait (VPAGED_TP_TIMEOUT_S, default 120)."""
    value = os.environ.get(TIMEOUT_ENV)
    try:
        seconds = float(value) if value else DEFAULT_TIMEOUT_S
    except ValueError:
        seconds = DEFAULT_TIMEOUT_S
    return seconds if seconds > 0 else DEFAULT_TIMEOUT_S


@dataclass
class Message:
    """What rank 0 tells the others. kind: "step" (apply `ops`, then run the forward of `step`), "memory"
    (apply `ops`, then send the store's memory), "ping" (nothing), "stop" (apply `ops`, close, exit)."""

    kind: str
    ops: list = field(default_factory=list)
    step: tuple | None = None


class Group:
    """This process's place among the ranks: rank, size, the control channel and the failure report."""

    def __init__(self, rank: int, size: int, store, backend: str, timeout_s: float, processes=()):
        self.rank = rank
        self.size = size
        self.store = store
        self.backend = backend
        self.timeout_s = timeout_s
        self.processes = dict(processes)  # rank -> the multiprocessing.Process rank 0 spawned for it
        self.broken: TensorParallelError | None = None
        self.closed = False
        self._lock = threading.Lock()
        self._last_send = time.monotonic()
        self._stop_keepalive = threading.Event()
        timeout = timedelta(seconds=timeout_s)
        dist.init_process_group(
            backend, store=dist.PrefixStore("vpaged/pg", store), rank=rank, world_size=size, timeout=timeout
        )
        self.control = dist.new_group(backend="gloo", timeout=timeout)

    def start_keepalive(self) -> None:
        """Rank 0, once every rank has its model and store: ping the others while there is nothing to do (not
        before: a rank still loading its shard is not listening yet)."""
        threading.Thread(target=self._keepalive, name="vpaged-tp-keepalive", daemon=True).start()

    # ---- rank 0
    def send(self, message: Message) -> None:
        """Broadcast a message to the other ranks (raises the group's TensorParallelError once it broke)."""
        with self._lock:
            self._check()
            self._broadcast(message)

    def gather(self, message: Message, own) -> list:
        """Broadcast `message`, then gather one object from every rank (rank 0's is `own`), by rank."""
        with self._lock:
            self._check()
            self._broadcast(message)
            out = [None] * self.size
            self._collective(dist.gather_object, own, out, dst=0, group=self.control)
            return out

    def _broadcast(self, message: Message) -> None:
        self._collective(dist.broadcast_object_list, [message], src=0, group=self.control)
        self._last_send = time.monotonic()

    def _collective(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - any failure of a collective breaks the group
            raise self.failure(e) from e

    def _check(self) -> None:
        if self.broken is not None:
            raise self.broken
        if self.closed:
            raise TensorParallelError("the tensor-parallel group is closed")

    def _keepalive(self) -> None:
        interval = max(0.5, self.timeout_s / 4)
        while not self._stop_keepalive.wait(min(interval, 1.0)):
            dead = [r for r, p in self.processes.items() if p.exitcode is not None]
            if dead and self.broken is None:
                self.failure(RuntimeError("a rank's process ended"))
            if self.broken is not None or self.closed:
                return
            if time.monotonic() - self._last_send < interval or not self._lock.acquire(blocking=False):
                continue
            try:
                if not self.closed and self.broken is None:
                    self._broadcast(Message("ping"))
            except TensorParallelError:
                return
            finally:
                self._lock.release()

    def failure(self, exc: BaseException) -> TensorParallelError:
        """The TensorParallelError for a failed collective: which rank failed and why, read from the store's
        error keys and the spawned processes' exit codes (waiting up to 3 s for them to show)."""
        if self.broken is not None:
            return self.broken
        causes: dict[int, str] = {}
        deadline = time.monotonic() + 3.0
        while not causes and time.monotonic() < deadline:
            for r in range(self.size):
                if r == self.rank:
                    continue
                cause = self._reported(r)
                if cause is None and r in self.processes and self.processes[r].exitcode is not None:
                    cause = _exit_cause(self.processes[r].exitcode)
                if cause is not None:
                    causes[r] = cause
            if not causes:
                time.sleep(0.1)
        if causes:
            text = "; ".join(f"rank {r} failed: {c}" for r, c in sorted(causes.items()))
        else:
            text = f"a collective failed on rank {self.rank}: {type(exc).__name__}: {exc}".strip()
        self.broken = TensorParallelError(text)
        self._stop_keepalive.set()
        return self.broken

    def _reported(self, rank: int) -> str | None:
        key = ERROR_KEY.format(rank)
        try:
            if self.store.check([key]):
                return self.store.get(key).decode(errors="replace")
        except Exception:  # noqa: BLE001 - the store's host may be the rank that died
            return None
        return None

    # ---- other ranks
    def receive(self) -> Message:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def reply(self, own) -> None:
        dist.gather_object(own, None, dst=0, group=self.control)

    # ---- every rank
    def close(self, message: Message | None = None) -> None:
        """Rank 0: send `message` (the stop) unless the group broke, and wait for the spawned processes. Then
        leave the process groups."""
        if self.closed:
            return
        if self.rank == 0 and message is not None and self.broken is None:
            try:
                self.send(message)
            except TensorParallelError as e:
                _log.warning("tensor-parallel stop not delivered: %s", e)
        self.closed = True
        self._stop_keepalive.set()
        for p in self.processes.values():
            p.join(timeout=self.timeout_s if self.broken is None else 5.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken group may not tear down cleanly
                pass


def report(store, rank: int, exc: BaseException) -> None:
    """Write this rank's failure into the rendezvous store, where rank 0 looks for it."""
    text = f"{type(exc).__name__}: {exc}"
    tb = traceback.extract_tb(exc.__traceback__)
    if tb:
        last = tb[-1]
        text += f" (at {os.path.basename(last.filename)}:{last.lineno})"
    try:
        store.set(ERROR_KEY.format(rank), text)
    except Exception:  # noqa: BLE001 - nothing more to do if rank 0's store is gone too
        pass


def _exit_cause(code: int) -> str:
    if code < 0:
        import signal

        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"
