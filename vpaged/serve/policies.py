"""Scheduling policies: the order requests are admitted in and which running sequence a step preempts.

Two injected strategies of the Scheduler, each chosen by one EngineConfig option (today's behaviour is the
default):

- scheduling_policy: the admission queue. "fcfs" (first come, first served: a deque) or "priority" (lowest
  `priority` value first, then first come; as vLLM's --scheduling-policy priority). A sequence preempted by
  recompute goes back ahead of the requests of its priority that came after it (fcfs: to the head).
  The queue also orders swapped-out sequences for resumption (sort_key).
- preemption_policy: the victim when running sequences cannot grow. "newest" (the last admitted: it has
  done the least work, so the oldest always progress) or "lowest_priority" (the highest priority value,
  the newest among equals). Default: the scheduling policy's own ("newest" for fcfs, "lowest_priority" for
  priority).

Priorities never preempt by themselves: a waiting request of high priority is admitted first, but it does
not evict running ones (vLLM's v1 scheduler behaves the same).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from ..errors import InvalidArgumentError

if TYPE_CHECKING:
    from .sequence import Sequence


def fcfs_key(seq: Sequence) -> tuple:
    """Arrival order, completions of one request by index."""
    return (seq.request.metrics.arrival_time, seq.request.arrival_index, seq.index)


def priority_key(seq: Sequence) -> tuple:
    """Lowest priority value first, then arrival order."""
    return (seq.request.priority, *fcfs_key(seq))


@runtime_checkable
class AdmissionQueue(Protocol):
    """The waiting sequences, in the order the scheduler admits them (it looks at the head first)."""

    name: str

    def push(self, seq: Sequence) -> None:
        """A new request's first sequence."""

    def push_preempted(self, seq: Sequence) -> None:
        """A sequence preempted by recompute (or of a failed step): it goes back ahead of later arrivals."""

    def head(self) -> Sequence:
        """The sequence to admit next (the queue is not empty)."""

    def pop(self) -> Sequence:
        """Take the head."""

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out wherever it is (abort)."""

    def sort_key(self, seq: Sequence) -> tuple:
        """Admission order as a key (smallest first): the scheduler resumes swapped sequences by it too."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Sequence]: ...


class FCFSQueue:
    """First come, first served; preempted sequences go to the head (the scheduler's order before seams)."""

    name = "fcfs"

    def __init__(self):
        self._queue: deque[Sequence] = deque()

    def push(self, seq: Sequence) -> None:
        self._queue.append(seq)

    def push_preempted(self, seq: Sequence) -> None:
        self._queue.appendleft(seq)

    def head(self) -> Sequence:
        return self._queue[0]

    def pop(self) -> Sequence:
        return self._queue.popleft()

    def remove(self, seq: Sequence) -> None:
        self._queue.remove(seq)

    def sort_key(self, seq: Sequence) -> tuple:
        return fcfs_key(seq)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._queue)


class PriorityQueue:
    """Lowest priority value first, then by arrival: a heap of (key, sequence). A preempted sequence keeps its
    arrival, so it comes back ahead of its priority's later arrivals without any special case."""

    name = "priority"

    def __init__(self):
        self._heap: list[tuple[tuple, int, Sequence]] = []
        self._ties = itertools.count()  # never compare two Sequences

    def push(self, seq: Sequence) -> None:
        heapq.heappush(self._heap, (priority_key(seq), next(self._ties), seq))

    push_preempted = push

    def head(self) -> Sequence:
        return self._heap[0][2]

    def pop(self) -> Sequence:
        return heapq.heappop(self._heap)[2]

    def remove(self, seq: Sequence) -> None:
        self._heap = [entry for entry in self._heap if entry[2] is not seq]
        heapq.heapify(self._heap)

    def sort_key(self, seq: Sequence) -> tuple:
        return priority_key(seq)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Sequence]:
        return (seq for _, _, seq in sorted(self._heap, key=lambda e: e[:2]))


@runtime_checkable
class PreemptionPolicy(Protocol):
    """Which of the candidate running sequences (in admission order, oldest first) a step preempts."""

    name: str

    def victim(self, candidates: list[Sequence]) -> Sequence: ...


class NewestFirst:
    """The last admitted: it has done the least work (the scheduler's choice before seams)."""

    name = "newest"

    def victim(self, candidates: list[Sequence]) -> Sequence:
        return candidates[-1]


class LowestPriorityFirst:
    """The highest priority value; among equals the newest."""

    name = "lowest_priority"

    def victim(self, candidates: list[Sequence]) -> Sequence:
        # max() keeps the first of equal keys: scan newest first so that ties go to the newest.
        return max(reversed(candidates), key=lambda s: s.request.priority)


SCHEDULING_POLICIES: dict[str, type] = {"fcfs": FCFSQueue, "priority": PriorityQueue}
PREEMPTION_POLICIES: dict[str, type] = {"newest": NewestFirst, "lowest_priority": LowestPriorityFirst}
# The victim each admission order implies when preemption_policy is not given.
DEFAULT_PREEMPTION = {"fcfs": "newest", "priority": "lowest_priority"}


def check_policy_names(scheduling_policy, preemption_policy) -> None:
    """InvalidArgumentError for a name no policy has (EngineConfig checks its fields with it)."""
    if scheduling_policy not in SCHEDULING_POLICIES:
        raise InvalidArgumentError(
            f"scheduling_policy must be one of {sorted(SCHEDULING_POLICIES)}, got {scheduling_policy!r}"
        )
    if preemption_policy is not None and preemption_policy not in PREEMPTION_POLICIES:
        raise InvalidArgumentError(
            f"preemption_policy must be one of {sorted(PREEMPTION_POLICIES)} or None, got {preemption_policy!r}"
        )


def admission_queue(scheduling_policy: str = "fcfs") -> AdmissionQueue:
    """An empty queue of the named policy."""
    check_policy_names(scheduling_policy, None)
    return SCHEDULING_POLICIES[scheduling_policy]()


def preemption_policy(name: str | None = None, scheduling_policy: str = "fcfs") -> PreemptionPolicy:
    """The named victim policy, or (None) the one the scheduling policy implies."""
    check_policy_names(scheduling_policy, name)
    return PREEMPTION_POLICIES[name or DEFAULT_PREEMPTION[scheduling_policy]]()
