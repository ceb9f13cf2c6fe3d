"""Group: the ranks of one tensor-parallel engine on torch.distributed, and rank 0's control channel to them.

Two process groups over the same ranks:

  model    the default group (gloo on CPU, NCCL on CUDA): the all-reduces and all-gathers that
           transformers' tensor-parallel layers run inside the forward.
  control  a gloo group: rank 0 broadcasts one small pickled message per step (messages.py: the cache
           operations the scheduler made and the step's packed inputs) and gathers the stores' memory for
           stats(). It is gloo on every device, so that no step plan goes through a CUDA buffer.

Every collective has a timeout (VPAGED_TP_TIMEOUT_S seconds, default 120): a rank that stops answering ends
the others' wait with an error instead of a hang (a checkpoint whose shards take longer to load than that
needs a larger VPAGED_TP_TIMEOUT_S). Once every rank is loaded, an idle rank 0 sends a Ping on the control
group every quarter of the timeout (the keepalive period), so that the other ranks, waiting for the next
step, do not time out while rank 0 simply has nothing to do.

Failures. A rank that fails writes its cause into the rendezvous store (`vpaged/error/<rank>`) before it
exits; its exit closes its connections, the other ranks' collectives fail at once, and rank 0 reads the cause
there (or, for a process it spawned, its exit code) to name the rank and why in a TensorParallelError. A rank
that is stopped (SIGSTOP) or hung writes nothing and closes nothing, and a collective that waits for it fails
on rank 0 with a timeout that names no one: so every other rank's worker also bumps a heartbeat counter in the
store (`vpaged/heartbeat/<rank>`, every HEARTBEAT_S from its own thread, which runs while its main thread
waits or computes). The rank whose counter does not move while rank 0 looks is the one named. Rank 0's
keepalive thread watches the same counters and the spawned processes, so a group that breaks while nothing
runs is marked broken within one keepalive period (a rank that died) or one timeout (a rank that stopped)
and `broken` says why, which the server's /health reports.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from datetime import timedelta

import torch.distributed as dist

from ...errors import TensorParallelError
from .messages import Message, Ping

TIMEOUT_ENV = "VPAGED_TP_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 120.0
ERROR_KEY = "vpaged/error/{}"
HEARTBEAT_KEY = "vpaged/heartbeat/{}"
HEARTBEAT_S = 0.25  # how often a worker bumps its heartbeat
# How long rank 0 looks for a failed rank's cause (its error key, its exit code, a heartbeat that does not
# move) before it reports the failure without one: 12 heartbeats, enough for a loaded host's thread to run.
CAUSE_WAIT_S = 3.0
_log = logging.getLogger("vpaged.serve")


def collective_timeout() -> float:
    """Seconds any collective of a tensor-parallel engine may wait (VPAGED_TP_TIMEOUT_S, default 120)."""
    value = os.environ.get(TIMEOUT_ENV)
    try:
        seconds = float(value) if value else DEFAULT_TIMEOUT_S
    except ValueError:
        seconds = DEFAULT_TIMEOUT_S
    return seconds if seconds > 0 else DEFAULT_TIMEOUT_S


class Group:
    """This process's place among the ranks: rank, size, the control channel and the failure report."""

    def __init__(self, rank: int, size: int, store, backend: str, timeout_s: float, processes=(), device=None):
        """`device`: this rank's CUDA device under NCCL (already current: torch.cuda.set_device before
        this), bound to the group with device_id so that NCCL does not guess it from the rank."""
        self.rank = rank
        self.size = size
        self.store = store
        self.backend = backend
        self.timeout_s = timeout_s
        self.processes = dict(processes)  # rank -> the multiprocessing.Process rank 0 spawned for it
        self.broken: TensorParallelError | None = None
        self.closed = False
        self._lock = threading.Lock()  # one control message at a time (the step's or the keepalive's)
        self._failure_lock = threading.Lock()  # one failure report, whichever thread sees it first
        self._last_send = time.monotonic()
        self._stop_threads = threading.Event()
        self._threads: list[threading.Thread] = []  # keepalive / heartbeat: joined by close()
        self._beats: dict[int, tuple[int, float]] = {}  # rank -> (its heartbeat count, when rank 0 saw it move)
        timeout = timedelta(seconds=timeout_s)
        options = dict(device_id=device) if backend == "nccl" and device is not None else {}
        dist.init_process_group(
            backend,
            store=dist.PrefixStore("vpaged/pg", store),
            rank=rank,
            world_size=size,
            timeout=timeout,
            **options,
        )
        self.control = dist.new_group(backend="gloo", timeout=timeout)

    @property
    def keepalive_s(self) -> float:
        """The keepalive period: an idle rank 0 pings this often, and notices a dead rank within it."""
        return max(0.5, self.timeout_s / 4)

    def start_keepalive(self) -> None:
        """Rank 0, once every rank has its model and store: ping the others while there is nothing to do (not
        before: a rank still loading its shard is not listening yet) and watch them."""
        self._start_thread(self._keepalive, "vpaged-tp-keepalive")

    def start_heartbeat(self) -> None:
        """Other ranks, once they serve rank 0: bump this rank's heartbeat until the group closes."""
        self._start_thread(self._heartbeat, "vpaged-tp-heartbeat")

    def _start_thread(self, target, name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

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
        interval = self.keepalive_s
        while not self._stop_threads.wait(min(interval, 1.0)):
            if self.broken is not None or self.closed:
                return
            dead = [r for r, p in self.processes.items() if p.exitcode is not None]
            silent = self._silent_for(self.timeout_s)
            if dead or silent:
                what = "a rank's process ended" if dead else f"rank {silent[0]}'s heartbeat stopped"
                self.failure(RuntimeError(f"{what} (seen by rank 0's keepalive)"))
                return
            if time.monotonic() - self._last_send < interval or not self._lock.acquire(blocking=False):
                continue
            try:
                if not self.closed and self.broken is None:
                    self._broadcast(Ping())
            except TensorParallelError:
                return
            finally:
                self._lock.release()

    def _heartbeat(self) -> None:
        key = HEARTBEAT_KEY.format(self.rank)
        while not self._stop_threads.wait(HEARTBEAT_S):
            try:
                self.store.add(key, 1)
            except Exception:  # noqa: BLE001 - rank 0's store is gone: this rank's receive fails next
                return

    def _heartbeats(self) -> dict[int, int]:
        """Each other rank's heartbeat count (0: it has not started beating); {} when the store is gone."""
        try:
            return {r: self.store.add(HEARTBEAT_KEY.format(r), 0) for r in range(self.size) if r != self.rank}
        except Exception:  # noqa: BLE001 - the store's host may be the rank that died
            return {}

    def _silent_for(self, seconds: float) -> list[int]:
        """Ranks that have beaten before but whose heartbeat rank 0 has not seen move for `seconds`."""
        now = time.monotonic()
        silent = []
        for r, count in self._heartbeats().items():
            seen, since = self._beats.get(r, (0, now))
            if count != seen:
                self._beats[r] = (count, now)
            elif count > 0 and now - since > seconds:
                silent.append(r)
        return silent

    def failure(self, exc: BaseException) -> TensorParallelError:
        """The TensorParallelError for a failed collective: which rank failed and why, read from the store's
        error keys and the spawned processes' exit codes, else the ranks whose heartbeat did not move while
        rank 0 looked (up to CAUSE_WAIT_S) and the collective's own error."""
        with self._failure_lock:
            if self.broken is not None:
                return self.broken
            start = time.monotonic()
            beats = self._heartbeats()
            causes = self._causes()
            while not causes and time.monotonic() - start < CAUSE_WAIT_S:
                time.sleep(0.1)
                causes = self._causes()
            if causes:
                text = "; ".join(f"rank {r} failed: {c}" for r, c in sorted(causes.items()))
            else:
                text = f"on rank {self.rank}: {type(exc).__name__}: {exc}".strip()
                waited = time.monotonic() - start
                now = self._heartbeats()
                silent = [r for r in sorted(now) if r in beats and now[r] == beats[r]]
                if silent:
                    ranks = ", ".join(f"rank {r}" for r in silent)
                    text = (
                        f"{ranks} did not answer: no heartbeat in {waited:.1f} s (the process is stopped, hung or "
                        f"gone); the collective failed {text}"
                    )
                else:
                    text = f"a collective failed {text}"
            self.broken = TensorParallelError(text)
            self._stop_threads.set()
            return self.broken

    def _causes(self) -> dict[int, str]:
        causes = {}
        for r in range(self.size):
            if r == self.rank:
                continue
            cause = self._reported(r)
            if cause is None and r in self.processes and self.processes[r].exitcode is not None:
                cause = _exit_cause(self.processes[r].exitcode)
            if cause is not None:
                causes[r] = cause
        return causes

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
        self._stop_threads.set()
        # Joined before the process group and the store go: a daemon thread still inside a store or gloo call when
        # the interpreter exits aborted the process ("terminate called without an active exception") about one
        # torchrun launch in ten on a 2-core box.
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=5.0)
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
