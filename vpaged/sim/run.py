"""The simulator's serving loop: one decode step at a time, FIFO admission while the budget allows,
preemption of the newest request when a step cannot get its pages (recomputed later), and a memory
breakdown sampled over time. Prefill is modelled as mapping the whole prompt at admission."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from ..errors import OutOfPagesError
from ..kvcache.accounting import MemoryBreakdown
from .kinds import CacheKind, Running
from .traces import SimRequest


@dataclass
class Sample:
    step: int
    running: int
    breakdown: MemoryBreakdown


@dataclass
class KindResult:
    kind: str  # the cache kind's name
    budget_bytes: int
    steps: int
    finished: int
    unfinished: int
    dropped: int  # requests that could not fit the budget even alone
    preemptions: int
    peak_running: int
    mean_running: float
    samples: list[Sample] = field(default_factory=list)
    seconds: float = 0.0

    def _sum(self, attr: str) -> int:
        return sum(getattr(s.breakdown, attr) for s in self.samples)

    @property
    def peak_held_bytes(self) -> int:
        return max((s.breakdown.held_bytes for s in self.samples), default=0)

    def summary(self) -> dict:
        """Shares summed over the samples (so busy times weigh more). live/waste/fragmentation/reserved are
        shares of the memory held for live sequences (stored + waste); dormant is a share of all held memory
        (it is reusable at once, so it would only dilute the waste figure)."""
        stored, frag, reserved = (self._sum(a) for a in ("stored_bytes", "fragmentation_bytes", "reserved_bytes"))
        active, held = stored + frag + reserved, self._sum("held_bytes")
        return {
            "policy": self.kind,  # the JSON keeps the key earlier results have (a kind was called a policy)
            "budget_bytes": self.budget_bytes,
            "steps": self.steps,
            "finished": self.finished,
            "unfinished": self.unfinished,
            "dropped": self.dropped,
            "preemptions": self.preemptions,
            "peak_running": self.peak_running,
            "mean_running": round(self.mean_running, 2),
            "peak_held_bytes": self.peak_held_bytes,
            "live_share": stored / active if active else 0.0,
            "waste_share": (frag + reserved) / active if active else 0.0,
            "fragmentation_share": frag / active if active else 0.0,
            "reserved_share": reserved / active if active else 0.0,
            "dormant_share": self._sum("dormant_bytes") / held if held else 0.0,
            "held_composition": {
                a: self._sum(a) / held if held else 0.0
                for a in ("stored_bytes", "fragmentation_bytes", "reserved_bytes", "dormant_bytes")
            },
            "seconds": round(self.seconds, 3),
        }


def simulate(
    kind: CacheKind, trace: list[SimRequest], step_seconds: float = 0.03, max_steps: int = 1_000_000, samples: int = 200
) -> KindResult:
    """Run `trace` through a cache kind. A decode step lasts step_seconds of trace time; about `samples`
    breakdowns are taken, evenly spaced in steps (estimated from the trace), plus one at the end."""
    t0 = time.perf_counter()
    pending = deque(sorted(trace, key=lambda r: r.arrival))
    waiting: deque[tuple[SimRequest, int, int]] = deque()  # (request, tokens to prefill, tokens still to generate)
    running: list[Running] = []
    finished = preemptions = dropped = peak = step = 0
    running_sum = 0
    horizon = max((r.arrival for r in trace), default=0) / step_seconds + max((r.output_len for r in trace), default=1)
    every = max(1, int(horizon // samples))
    result = KindResult(kind.name, kind.budget_bytes, 0, 0, 0, 0, 0, 0, 0.0)
    while (pending or waiting or running) and step < max_steps:
        now = step * step_seconds
        while pending and pending[0].arrival <= now:
            req = pending.popleft()
            waiting.append((req, req.prompt_len, req.output_len))
        while waiting:  # FIFO: the head waits for room, nobody overtakes it
            req, prompt_len, remaining = waiting[0]
            run = kind.admit(req, prompt_len)
            if run is None:
                if not running:  # an empty system has no room for it: it never fits
                    waiting.popleft()
                    dropped += 1
                    continue
                break
            waiting.popleft()
            run.extra["remaining"] = remaining
            running.append(run)
        if running:
            while True:
                try:
                    kind.step(running)
                    break
                except OutOfPagesError:
                    victim = running.pop()  # the newest: it loses the least work
                    kind.release(victim)
                    if not running:  # it cannot grow even alone
                        dropped += 1
                        break
                    preemptions += 1
                    # Recompute: it comes back first, with its generated tokens as part of the prompt.
                    waiting.appendleft((victim.request, victim.length, victim.extra["remaining"]))
            still = []
            for run in running:
                run.length += 1
                run.extra["remaining"] -= 1
                if run.extra["remaining"] == 0:
                    kind.release(run)
                    finished += 1
                else:
                    still.append(run)
            running = still
        peak = max(peak, len(running))
        running_sum += len(running)
        if step % every == 0:
            result.samples.append(Sample(step, len(running), kind.breakdown()))
        step += 1
    result.samples.append(Sample(step, len(running), kind.breakdown()))
    result.steps, result.finished, result.preemptions, result.peak_running = step, finished, preemptions, peak
    result.dropped = dropped
    result.unfinished = len(pending) + len(waiting) + len(running)
    result.mean_running = running_sum / step if step else 0.0
    result.seconds = time.perf_counter() - t0
    return result
