"""Fair share: how much of a shared budget a member may fill with new work while another member is starved.

Without a rule, the first engine whose burst finds the budget free takes all of it, and its requests keep the
pages in live K/V (which no give-back may touch) while the next engine's burst waits for them to finish. The
rule is a budget-wide choice, kept in the ledger's header (`SharedBudget.create(..., share_policy=)`,
`vpaged budget create --share-policy`), so that every member follows the same one:

- "greedy" (the default): no cap; whoever is short asks for whatever the others hold beyond their live K/V
  and minimum. Measured best on the bursty three-engine experiment (benchmarks/NOTES.md, "fair share"):
  requests there finish within a second or two, so the pages of the engine that took the budget come back
  as fast as the next burst needs them, and one engine's big batch is cheaper per token than three small
  ones on a shared CPU.
- "fair": a member is *active* when it holds live K/V or asked for pages within STARVED_S; its
  fair share is max(min_bytes, capacity / active members), whole pages, at most its ceiling. A member is
  *starved* when it asked within STARVED_S and holds (grant or minimum) less than its fair share. While any
  other member is starved, a member may admit a new request only if its live K/V plus the request's pages
  stay within its own fair share (its running requests go on; as they finish, the give-back thread hands
  their pages to the starved member, which asks for them). With nobody starved there is no cap: one
  engine alone may use the whole budget, which is the point of sharing.
  Asking follows the same rule (spare_bytes): a starved member asks the others for what they hold beyond
  their fair share (their last report may predate the requests they finished since), and one that is not
  starved asks only for what an active member holds beyond its live K/V *and* its fair share, so engines
  that all sit at their shares do not keep taking each other's reusable pages (measured: three engines at
  a third each, asking each other every poll, ran at 0.67x the static split's throughput).
  Measured on the same experiment, its p99 TTFT was 1.07x the static split's (median of two rounds: 1.70x
  and 0.25x), against 0.11x for greedy:
  the engines settle at a third of the budget each, i.e. the static split with the costs of sharing, and
  the capped engine's reusable pages were slow to move (see NOTES). It is kept for budgets whose members
  hold K/V long (long generations, a busy model beside a latency-bound one), where waiting for the first
  engine's requests to finish is what hurts.

The members publish what the rule reads: live bytes (member.py reports them every REPORT_S and at
each give-back) and, when short, the bytes they asked for and when (SharedBudget.grant). The cap is a
planning answer: the scheduler asks it before admitting (KVStore.within_share), never a hard limit on
the pool, so running requests are never failed by it.
"""

from __future__ import annotations

from typing import Protocol

from ...errors import InvalidArgumentError
from .segment import MemberRecord

STARVED_S = 0.25  # a member's ask counts this long (a short member asks at every step, POLL_S apart at most)
_STARVED_NS = int(STARVED_S * 1e9)


def is_asking(r: MemberRecord, now_ns: int) -> bool:
    """Whether `r` was short of pages within the last STARVED_S."""
    return r.demand_bytes > 0 and now_ns - r.demand_ns <= _STARVED_NS


def active_count(records: list[MemberRecord], now_ns: int) -> int:
    """Members that hold live K/V or are asking for pages (at least 1)."""
    return max(1, sum(1 for r in records if r.live_bytes > 0 or is_asking(r, now_ns)))


def fair_share_bytes(r: MemberRecord, active: int, capacity: int, page_size: int) -> int:
    """max(min_bytes, capacity / active) in whole pages, at most the member's ceiling."""
    even = capacity // max(1, active) // page_size * page_size
    return min(r.ceiling_bytes, max(r.min_bytes, even))


def is_starved(r: MemberRecord, active: int, capacity: int, page_size: int, now_ns: int) -> bool:
    """Asking for pages while holding less than its fair share."""
    return is_asking(r, now_ns) and r.reserved_bytes() < fair_share_bytes(r, active, capacity, page_size)


def unused_bytes(r: MemberRecord) -> int:
    """What `r` holds beyond its live K/V (as last reported) and its minimum: free or reusable pages."""
    return r.granted_bytes - max(r.min_bytes, r.live_bytes)


class SharePolicy(Protocol):
    """How much live K/V a member may hold when it admits new work (None: no cap), and how much each other
    member may be asked to give back when `mine` is short."""

    name: str
    caps_admissions: bool  # False: admission_cap is always None (members need not read the ledger for it)

    def admission_cap(
        self, records: list[MemberRecord], mine: MemberRecord, capacity: int, page_size: int, now_ns: int
    ) -> int | None: ...

    def spare_bytes(
        self, records: list[MemberRecord], mine: MemberRecord, capacity: int, page_size: int, now_ns: int
    ) -> dict[int, int]: ...


class FairShare:
    """A member's fair share caps its admissions while another member is starved (see the module)."""

    name = "fair"
    caps_admissions = True

    def admission_cap(self, records, mine, capacity, page_size, now_ns):
        active = active_count(records, now_ns)
        if not any(is_starved(r, active, capacity, page_size, now_ns) for r in records if r is not mine):
            return None
        return fair_share_bytes(mine, active, capacity, page_size)

    def spare_bytes(self, records, mine, capacity, page_size, now_ns):
        active = active_count(records, now_ns)
        others = [r for r in records if r is not mine]
        if is_starved(mine, active, capacity, page_size, now_ns):
            # Their reports may predate the requests they finished since: ask for the excess over the share.
            fair = {r.index: fair_share_bytes(r, active, capacity, page_size) for r in others}
            return {r.index: max(unused_bytes(r), r.granted_bytes - fair[r.index]) for r in others}
        out = {}
        for r in others:
            busy = r.live_bytes > 0 or is_asking(r, now_ns)
            keep = fair_share_bytes(r, active, capacity, page_size) if busy else 0
            out[r.index] = min(unused_bytes(r), r.granted_bytes - keep)
        return out


class Greedy:
    """No cap: whoever asks first takes what is free (the budget before the fair-share rule)."""

    name = "greedy"
    caps_admissions = False

    def admission_cap(self, records, mine, capacity, page_size, now_ns):
        return None

    def spare_bytes(self, records, mine, capacity, page_size, now_ns):
        return {r.index: unused_bytes(r) for r in records if r is not mine}


SHARE_POLICIES: dict[str, type] = {"fair": FairShare, "greedy": Greedy}
POLICY_CODES = {"fair": 0, "greedy": 1}  # as the ledger's header stores them
DEFAULT_SHARE_POLICY = "greedy"  # the better of the two on the measurements in benchmarks/NOTES.md


def policy_code(name: str) -> int:
    if name not in POLICY_CODES:
        raise InvalidArgumentError(f"share_policy must be one of {sorted(POLICY_CODES)}, got {name!r}")
    return POLICY_CODES[name]


def share_policy(code: int) -> SharePolicy:
    """The policy a ledger's header names."""
    name = next((n for n, c in POLICY_CODES.items() if c == code), None)
    if name is None:
        raise InvalidArgumentError(f"unknown share policy code {code} in a budget's header")
    return SHARE_POLICIES[name]()
