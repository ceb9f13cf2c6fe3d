"""EngineLoop: the one thread that owns an LLMEngine behind the HTTP server.

The engine is not thread-safe, so one background thread owns it: it runs engine.step() while work is pending,
runs the commands the HTTP handlers queue (add a request, abort one, read stats) between steps, and hands
each step's outputs to the sink of the request they belong to. A failed step ends the requests in flight
(each sink gets an EngineStepError) and the loop goes on, unless the engine cannot go on (a tensor-parallel
engine that lost a rank: TensorParallelError): then the loop stops, keeps the error in `fatal`, answers every
later command with it and calls on_fatal(error). An idle loop does not wait for a step to find that out: it
looks at engine.broken (set by the tensor-parallel keepalive while nothing runs) every idle_wait_s and stops
the same way.

Anything else that escapes the loop (a BaseException out of a step, an error outside it) ends the thread: the
loop keeps why in `dead` (an EngineUnavailableError naming the model and the cause), ends the requests in flight
and the commands queued with it, and every later command fails at once with it, as every command does once the
loop has stopped: nothing waits on a thread that will not answer.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

from ...errors import EngineStepError, EngineUnavailableError, TensorParallelError, VPagedError

log = logging.getLogger("vpaged.serve")


@contextlib.contextmanager
def built_for_an_engine_thread(threads: int | None = None):
    """Build the engines an EngineLoop will own under this, on the thread that serves HTTP: torch's intra-op
    threads are 1 meanwhile, then `threads` (None: what they were).

    Why: torch's CPU build runs intra-op work on GNU OpenMP, which keeps a pool of worker threads for each thread
    that opens a parallel region. A model loaded and packed here with N threads leaves an idle pool of N - 1
    workers behind on this thread; the engine thread then opens a second pool, and with more OpenMP threads than
    CPUs libgomp stops spinning between regions (every region wakes its workers through the kernel). The same
    steps ran 1.18x slower on an engine thread than on the main thread that way (SmolLM2-135M fp32, a burst of
    32 x 256 -> 64 tokens on 2 cores: 12.9 s against 15.3 s; benchmarks/NOTES.md). Built with one thread, nothing
    opens a pool here, and the engine thread's is the only one."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads or before)


class EngineLoop:
    """Owns an engine on one thread. Other threads call add/abort/call, which return futures."""

    def __init__(self, engine, idle_wait_s: float = 0.5, name: str = ""):
        """name: the served model's, in the thread's name (one loop per model in a server of several)."""
        self.engine = engine
        self._commands: list[tuple[Callable[[], Any], concurrent.futures.Future]] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._closed = False  # set (under _lock) once the thread takes no more commands: call() fails at once
        self.name = name
        self._idle_wait_s = idle_wait_s
        self._sinks: dict[str, Callable[[Any], None]] = {}  # request id -> where its outputs go (engine thread)
        self._thread = threading.Thread(
            target=self._run, name=f"vpaged-engine-{name}" if name else "vpaged-engine", daemon=True
        )
        self.steps = 0
        self.step_failures = 0
        self.fatal: TensorParallelError | None = None
        self.on_fatal: Callable[[TensorParallelError], None] | None = None
        self.dead: EngineUnavailableError | None = None  # why the thread died, if it did

    # ---- any thread
    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run fn on the engine thread between two steps. A loop that takes no more commands (stopped, or its
        thread died) fails the future at once: with `fatal`, `dead`, or an EngineUnavailableError."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if not self._closed and not self._stop:
                self._commands.append((fn, fut))
                self._wake.set()
                return fut
        fut.set_exception(self.unavailable())
        return fut

    def unavailable(self) -> Exception:
        """What a command to this loop fails with once the loop takes no more."""
        return self.fatal or self.dead or self.stopping_error()

    def stopping_error(self) -> EngineUnavailableError:
        """What a request of a stopping server ends with (503 naming the model)."""
        return EngineUnavailableError(f"{self.describe()} is stopped: the server is stopping")

    def describe(self) -> str:
        """'the engine of model NAME', for messages."""
        return f"the engine of model {self.name!r}" if self.name else "the engine"

    def abort_in_flight(self, error: Exception) -> concurrent.futures.Future:
        """Abort every request in flight; each one's sink gets `error`. The loop goes on."""
        return self.call(lambda: self._abort_all(error))

    def add(self, prompt, params, request_id: str, sink: Callable[[Any], None]) -> concurrent.futures.Future:
        """Queue a request; `sink` receives each RequestOutput of it (or an EngineStepError) on the engine thread.
        The future raises what engine.add_request raised."""

        def add():
            rid = self.engine.add_request(prompt, params, request_id=request_id)
            self._sinks[rid] = sink
            return rid

        return self.call(add)

    def abort(self, request_id: str) -> concurrent.futures.Future:
        def abort():
            self._sinks.pop(request_id, None)
            with contextlib.suppress(VPagedError, LookupError):  # finished meanwhile: nothing to abort
                self.engine.abort(request_id)

        return self.call(abort)

    def stop(self, timeout: float = 30.0) -> None:
        """Abort what is in flight (each request's sink gets an EngineUnavailableError: the server is stopping)
        and end the thread."""
        if not self._thread.is_alive():
            self._stop = True
            return
        done = self.abort_in_flight(self.stopping_error())
        with contextlib.suppress(Exception):
            done.result(timeout)
        self._stop = True
        self._wake.set()
        self._thread.join(timeout)

    # ---- engine thread
    def _run_commands(self) -> None:
        with self._lock:
            commands, self._commands = self._commands, []
        for fn, fut in commands:
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the caller, whatever it is
                fut.set_exception(e)

    def _abort_all(self, notify: Exception | None = None) -> None:
        """Abort every request in flight; `notify`: what their sinks get (None: nothing)."""
        for rid in list(self._sinks):
            sink = self._sinks.pop(rid, None)
            with contextlib.suppress(Exception):
                self.engine.abort(rid)
            if notify is not None and sink is not None:
                with contextlib.suppress(Exception):
                    sink(notify)

    def _fail(self, e: Exception) -> None:
        """End the requests in flight with the failure; a TensorParallelError also stops the loop."""
        failure = EngineStepError(f"engine step failed: {type(e).__name__}: {e}")
        if isinstance(e, TensorParallelError):
            failure = self.fatal = e
            self._stop = True
        self._abort_all(failure)
        if self.fatal is not None and self.on_fatal is not None:
            self.on_fatal(self.fatal)

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # noqa: BLE001 - the thread ends either way; the server must hear why
            dead = EngineUnavailableError(f"{self.describe()} died: {type(e).__name__}: {e}")
            log.error("%s; its requests get 503 from now on", dead, exc_info=e)
            with self._lock:
                self.dead = dead
                self._closed = True
                self._stop = True
                commands, self._commands = self._commands, []
            for _fn, fut in commands:
                if fut.set_running_or_notify_cancel():
                    fut.set_exception(self.dead)
            with contextlib.suppress(BaseException):
                self._abort_all(self.dead)

    def _serve(self) -> None:
        while not self._stop:
            self._wake.clear()  # before running commands: a command queued after this wakes the wait below
            self._run_commands()
            if self._stop:
                break
            broken = getattr(self.engine, "broken", None)
            if broken is not None:  # the group broke while idle (or between two steps)
                log.error("the engine cannot go on: %s", broken)
                self._fail(broken)
                continue
            if not self.engine.has_unfinished():
                self._wake.wait(self._idle_wait_s)
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # noqa: BLE001 - a failed step must not take the server down
                self.step_failures += 1
                log.exception("engine step failed; ending the requests in flight")
                self._fail(e)
                continue
            self.steps += 1
            for out in outputs:
                sink = self._sinks.get(out.request_id)
                if sink is None:
                    continue
                if out.finished:
                    del self._sinks[out.request_id]
                sink(out)
        with self._lock:  # from here on call() fails at once: nothing is queued that no one will run
            self._closed = True
        self._run_commands()  # answer anything queued during shutdown
