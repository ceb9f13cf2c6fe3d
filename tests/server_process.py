"""A `vpaged serve` process under test: started with its output read by a thread, waited for until it prints
its "serving ... at URL" line, stopped by a signal with a bounded wait (then killed). A plain module on the
tests' path, used through the `server_process` fixture (tests/conftest.py), which stops any server a test
left running."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time


class ServerProcess:
    """`python -m vpaged.cli serve ARGS...` with unbuffered output (extra environment: env)."""

    def __init__(self, args: list[str], env: dict | None = None):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vpaged.cli", "serve", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})),
        )
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(x) for x in self.proc.stdout], daemon=True).start()
        self.line = ""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def ready(self, timeout: float) -> str:
        """The server's "serving" line, once it is up; fails the test if it exits or takes over timeout s."""
        deadline = time.monotonic() + timeout
        while "serving" not in self.line:
            assert time.monotonic() < deadline and self.proc.poll() is None, (
                f"the server did not come up: {self.stderr_if_exited()}"
            )
            with contextlib.suppress(queue.Empty):
                self.line = self.lines.get(timeout=1)
        return self.line

    @property
    def url(self) -> str:
        """The OpenAI base URL (ending in /v1) of the "serving" line."""
        return self.line.split(" at ")[1].split()[0]

    @property
    def base_url(self) -> str:
        return self.url.removesuffix("/v1")

    def stderr_if_exited(self) -> str:
        return self.proc.stderr.read() if self.proc.poll() is not None else "(still running)"

    def stop(self, sig: int = signal.SIGINT, wait: float = 60) -> tuple[int, str]:
        """Send sig and wait up to `wait` s; (exit status, stderr). Killed (and an AssertionError) if it does not
        exit in time."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(wait)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the server did not stop within {wait} s of signal {sig}") from None
        return rc, self.proc.stderr.read()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
