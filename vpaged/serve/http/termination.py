"""SIGTERM as an orderly shutdown: the signal systemd, docker and Kubernetes send to stop a server.

Python's default for SIGTERM is the OS's: the process dies at once, and no `finally` block, context manager
or atexit hook runs, so whatever the server made (a shared budget's segment in /dev/shm, a tensor-parallel
engine's ranks and temporary directory) stays behind. Inside `sigterm_raises()`, SIGTERM in the main thread
raises Terminated instead, as SIGINT raises KeyboardInterrupt: every cleanup on the way out runs.

While uvicorn serves it takes SIGTERM (and SIGINT) itself, shuts the server down gracefully, then raises the
signal again with the handler it found: this one, so serve() sees Terminated once the server has stopped and
returns normally (server.py). Terminated is a SystemExit of 128 + SIGTERM, the shell's status for a process
ended by the signal: a SIGTERM that lands outside serve() (a model still loading) ends the program with that
status, quietly, after its cleanups. The first SIGTERM starts the shutdown; later ones are ignored, so that
they cannot cut the cleanup short (SIGKILL still ends the process at once).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

TERMINATED_STATUS = 128 + int(signal.SIGTERM)  # 143


class Terminated(SystemExit):
    """SIGTERM arrived while sigterm_raises() was in force. A SystemExit (not an Exception), so that
    `except Exception` blocks let it through, and the program exits with TERMINATED_STATUS, no traceback."""

    def __init__(self) -> None:
        super().__init__(TERMINATED_STATUS)


class _RaiseOnce:
    """The handler: raises Terminated on the first SIGTERM, ignores the later ones."""

    def __init__(self) -> None:
        self.terminating = False

    def __call__(self, _signum, _frame) -> None:
        if self.terminating:
            return
        self.terminating = True
        raise Terminated()


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """While inside, SIGTERM raises Terminated in the main thread. Nothing changes off the main thread (signals
    are delivered to it only) or where SIGTERM already has a handler other than the OS default (one of this
    module's, an outer sigterm_raises(), or the program's own: it is kept)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, _RaiseOnce())
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
